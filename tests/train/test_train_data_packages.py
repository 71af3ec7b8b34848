"""The ``packages`` corpus: selection, duplicates, a stable disjoint split, the cap, the
fingerprint and its cache, and ``--data packages`` errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridfp.train import corpus
from hybridfp.train.data import DataError, is_val, load_data, load_packages_corpus


def _tree(tmp_path):
    """Two roots: a fake stdlib and a fake site-packages with duplicates, binaries, skipped dirs."""
    std, site = tmp_path / "lib", tmp_path / "site"
    files = {
        std / "json" / "decoder.py": b"import re\n\ndef decode(s):\n    return s\n",
        std / "README.rst": b"The standard library.\n",
        site / "pkg" / "core.py": b"import os\nfrom . import util\n\ndef core():\n    return 1\n",
        # exact copy; copy with CRLF and trailing blanks; vendored copy with rewritten imports
        site / "other" / "core_copy.py": b"import os\nfrom . import util\n\ndef core():\n    return 1\n",
        site / "crlf" / "core.py": b"import os\r\nfrom . import util\r\n\r\ndef core():  \r\n    return 1\r\n\r\n",
        site / "pip" / "_vendor" / "pkg" / "core.py": b"import os\nfrom pip._vendor.pkg import util\n"
                                                      b"def core():\n    return 1\n",
        site / "pkg" / "notes.md": b"# notes\nsome prose about the package\n",
        site / "pkg" / "api.pyi": b"def core() -> int: ...\n",
        site / "pkg" / "ext.c": b"int core(void) { return 1; }\n",
        site / "pkg" / "ext.h": b"int core(void);\n",
        site / "pkg" / "data.txt": b"plain text data\n",
        site / "pkg" / "blob.txt": b"binary\0data\n",                 # NUL: left out
        site / "pkg" / "empty.py": b"",                               # empty: left out
        site / "pkg" / "lib.so": b"ELF not text",                     # suffix: left out
        site / "pkg" / "__pycache__" / "core.py": b"cached = 1\n",    # skipped dir
        site / "pkg-1.0.dist-info" / "LICENSE.txt": b"license\n",    # skipped dir
        site / ".hidden" / "x.py": b"hidden = 1\n",                   # skipped dir
    }
    for i in range(60):  # enough files for both sides of the split
        files[site / "many" / f"m{i}.py"] = f"value_{i} = {i}\n".encode()
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return [("stdlib", std), ("site-packages", site)]


def test_selection_skips_binaries_and_keeps_one_of_each_duplicate(tmp_path):
    roots = _tree(tmp_path)
    build = corpus.select(corpus.list_files(roots), 10**9)
    rels = [rel for rel, _ in build.docs]
    dup_group = {"site-packages/pkg/core.py", "site-packages/other/core_copy.py", "site-packages/crlf/core.py",
                 "site-packages/pip/_vendor/pkg/core.py"}
    assert len(dup_group & set(rels)) == 1 and build.duplicates == 3
    for kept in ("stdlib/json/decoder.py", "stdlib/README.rst", "site-packages/pkg/notes.md",
                 "site-packages/pkg/api.pyi", "site-packages/pkg/ext.c", "site-packages/pkg/ext.h",
                 "site-packages/pkg/data.txt"):
        assert kept in rels
    for left_out in ("blob.txt", "empty.py", "lib.so", "__pycache__", "dist-info", ".hidden"):
        assert not any(left_out in r for r in rels), left_out
    # the same build again, and from a listing in another order: the same documents
    again = corpus.select(sorted(corpus.list_files(roots), key=lambda f: f.rel), 10**9)
    assert again.docs == build.docs and again.fingerprint == build.fingerprint


def test_split_is_stable_and_disjoint(tmp_path):
    roots = _tree(tmp_path)
    a = load_packages_corpus(tmp_path / "cache_a", roots=roots)
    b = load_packages_corpus(tmp_path / "cache_b", roots=roots)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    build = corpus.select(corpus.list_files(roots), corpus.DEFAULT_MAX_BYTES)
    val_docs = [d for rel, d in build.docs if is_val(rel)]
    train_docs = [d for rel, d in build.docs if not is_val(rel)]
    assert val_docs and train_docs
    train_text, val_text = bytes(a.train.astype(np.uint8)), bytes(a.val.astype(np.uint8))
    assert all(d in val_text and d not in train_text for d in val_docs)
    assert all(d in train_text and d not in val_text for d in train_docs)


def test_cap_takes_a_prefix_of_the_stable_order(tmp_path):
    roots = _tree(tmp_path)
    files = corpus.list_files(roots)
    full = corpus.select(files, 10**9)
    capped = corpus.select(files, 300)
    assert 0 < capped.n_bytes <= 300 and len(capped.docs) < len(full.docs)
    assert capped.docs == full.docs[:len(capped.docs)]
    assert capped.fingerprint != full.fingerprint


def test_fingerprint_changes_with_a_file_and_the_cache_follows(tmp_path):
    roots = _tree(tmp_path)
    cache = tmp_path / "cache"
    first = load_packages_corpus(cache, roots=roots)
    cached = load_packages_corpus(cache, roots=roots)
    assert "[cached]" in cached.source and "[cached]" not in first.source
    assert cached.fingerprint == first.fingerprint and first.fingerprint in first.source
    assert np.array_equal(cached.train, first.train) and np.array_equal(cached.val, first.val)
    target = tmp_path / "site" / "pkg" / "notes.md"
    st = target.stat()
    target.write_bytes(b"# NOTES\nsome prose about the package\n")  # same size, other content
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = load_packages_corpus(cache, roots=roots)
    assert "[cached]" not in changed.source and changed.fingerprint != first.fingerprint


def test_corpus_spec():
    assert corpus.parse_corpus_spec("packages") == corpus.DEFAULT_MAX_BYTES
    assert corpus.parse_corpus_spec("packages:50M") == 50_000_000
    assert corpus.parse_corpus_spec("packages:1.5k") == 1500
    assert corpus.parse_corpus_spec("packages:4096") == 4096
    assert corpus.parse_corpus_spec("runs/data") is None and corpus.parse_corpus_spec("package") is None


@pytest.mark.parametrize("spec", ["packages:", "packages:lots", "packages:0", "packages:-5M"])
def test_bad_corpus_size_names_the_option(spec):
    with pytest.raises(DataError, match="size after 'packages:'"):
        load_data(spec)


def test_load_data_packages_reads_this_environment(tmp_path):
    data = load_data("packages:200k", tmp_path / "cache")
    assert data.fingerprint.startswith("packages-") and data.fingerprint in data.describe()
    assert 0 < len(data.train) + len(data.val) <= 200_000 + 2 * 10_000  # + one separator per file
    assert data.train.max() < 256


def test_local_directory_named_packages_is_ambiguous(tmp_path, monkeypatch):
    (tmp_path / "packages").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"\./packages"):
        load_data("packages")


def _cache_hit(data):
    return "[cached]" in data.source


@pytest.mark.parametrize("change", ["val_percent", "max_file_bytes", "duplicate_rule", "text_suffixes"])
def test_changed_rules_never_reuse_a_stale_cache(tmp_path, monkeypatch, change):
    from hybridfp.train import data as data_mod
    roots = _tree(tmp_path)
    cache = tmp_path / "cache"
    load_packages_corpus(cache, roots=roots)
    assert _cache_hit(load_packages_corpus(cache, roots=roots))
    if change == "val_percent":
        monkeypatch.setattr(data_mod, "VAL_PERCENT", 50)
    elif change == "max_file_bytes":
        monkeypatch.setattr(corpus, "MAX_FILE_BYTES", 30)
    elif change == "text_suffixes":
        monkeypatch.setattr(corpus, "TEXT_SUFFIXES", (".py",))
    else:
        monkeypatch.setattr(corpus, "duplicate_key", lambda data, rel: data)  # exact copies only
    rebuilt = load_packages_corpus(cache, roots=roots)
    assert not _cache_hit(rebuilt)
    assert _cache_hit(load_packages_corpus(cache, roots=roots))


def test_older_cache_entries_are_pruned_to_the_newest_two(tmp_path):
    roots = _tree(tmp_path)
    cache = tmp_path / "cache"
    (cache / "stdlib-0123456789abcdef").mkdir(parents=True)  # another corpus's entry: kept
    (cache / "packages-notes").mkdir()                       # not a build of ours: kept
    names = []
    for cap in (10**9, 2000, 1000, 500):
        load_packages_corpus(cache, max_bytes=cap, roots=roots)
        names.append({p.name for p in cache.glob("packages-*") if (p / "meta.json").is_file()})
    assert [len(n) for n in names] == [1, 2, corpus.KEEP_BUILDS, corpus.KEEP_BUILDS] and corpus.KEEP_BUILDS == 2
    assert not (names[0] & names[3])  # the first build is gone
    assert (cache / "stdlib-0123456789abcdef").is_dir() and (cache / "packages-notes").is_dir()
    # a cache hit marks its entry recently used: a build made after it prunes the other one
    assert _cache_hit(load_packages_corpus(cache, max_bytes=1000, roots=roots))
    load_packages_corpus(cache, max_bytes=300, roots=roots)
    assert _cache_hit(load_packages_corpus(cache, max_bytes=1000, roots=roots))


def test_package_share_caps_any_one_top_level_package(tmp_path):
    roots = _tree(tmp_path)
    big = tmp_path / "site" / "big"
    for i in range(40):  # one package holding most of the bytes, like the C headers of a CUDA torch
        (big / f"h{i}.h").parent.mkdir(parents=True, exist_ok=True)
        (big / f"h{i}.h").write_bytes(f"#define BIG_{i} {i}\n".encode() * 20)
    files = corpus.list_files(roots)
    plain = corpus.select(files, 3000)
    shared = corpus.select(files, 3000, max_package_share=0.25)

    def share(build):
        return sum(len(d) for rel, d in build.docs if corpus.package_of(rel) == "site-packages/big") / 3000
    assert share(plain) > 0.25 and 0 < share(shared) <= 0.25
    assert shared.fingerprint != plain.fingerprint
    assert corpus.package_of("site-packages/torch/include/c10/x.h") == "site-packages/torch"
    assert corpus.package_of("site-packages/six.py") == "site-packages/six.py"
    assert corpus.package_of("stdlib/json/decoder.py") == "stdlib/json"
    # through --data, and into the cache key
    spec = corpus.parse_corpus_options("packages:3k,max-share=0.25")
    assert spec == corpus.CorpusSpec(3000, 0.25)
    a = load_packages_corpus(tmp_path / "cache", max_bytes=3000, roots=roots)
    b = load_packages_corpus(tmp_path / "cache", max_bytes=3000, roots=roots, max_package_share=0.25)
    assert not _cache_hit(b) and a.fingerprint != b.fingerprint


@pytest.mark.parametrize("spec,message", [
    ("packages:50M,max-share=0", "max-share must be a fraction in"), ("packages:50M,max-share=1.5", "max-share must be"),
    ("packages:max-share=x", "max-share must be"), ("packages:50M,share=0.2", "unknown option 'share'.*max-share=F")])
def test_bad_package_share_names_the_option(spec, message):
    with pytest.raises(DataError, match=message):
        load_data(spec)
