"""Training data: the embedded stdlib corpus, token files, text inputs, batches, clear errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hybridfp.train import cli
from hybridfp.train.data import (BYTE_VOCAB, DataError, build_stdlib_corpus, get_batch, is_val,
                                 load_data, load_stdlib_corpus, split_documents, stdlib_files)


def test_stdlib_corpus_is_deterministic_and_cached(tmp_path):
    a_train, a_val = build_stdlib_corpus()
    b_train, b_val = build_stdlib_corpus()
    assert np.array_equal(a_train, b_train) and np.array_equal(a_val, b_val)
    assert len(a_train) > 1_000_000 and len(a_val) > 10_000  # the stdlib is megabytes of code
    assert a_train.max() < BYTE_VOCAB
    built = load_stdlib_corpus(cache_dir=tmp_path)
    cached = load_stdlib_corpus(cache_dir=tmp_path)
    assert "[cached]" in cached.source and "[cached]" not in built.source
    assert np.array_equal(built.train, a_train) and np.array_equal(cached.train, a_train)
    assert np.array_equal(cached.val, a_val) and cached.vocab_size == BYTE_VOCAB


def test_stdlib_files_sorted_without_tests_or_site_packages():
    files = stdlib_files()
    parts = {part for f in files for part in f.parts}
    assert "site-packages" not in parts and "test" not in parts
    names = [f.as_posix() for f in files]
    assert names == sorted(names) and any(n.endswith("/json/decoder.py") for n in names)


def test_split_is_by_path_hash_not_order():
    docs = [(f"pkg/m{i}.py", f"# module {i}\n".encode()) for i in range(200)]
    train, val = split_documents(docs)
    train_r, val_r = split_documents(docs[::-1])
    def modules(a):
        return sorted(int(m) for m in re.findall(rb"module (\d+)", bytes(a.astype(np.uint8))))

    assert modules(train) == modules(train_r) and modules(val) == modules(val_r)
    assert modules(val) == [i for i, (p, _) in enumerate(docs) if is_val(p)]
    assert 0 < len(modules(val)) < 40


def test_bin_dir(tmp_path):
    rng = np.random.default_rng(0)
    tr, va = rng.integers(0, 1000, 5000).astype(np.uint16), rng.integers(0, 1000, 700).astype(np.uint16)
    tr.tofile(tmp_path / "train.bin")
    va.tofile(tmp_path / "val.bin")
    d = load_data(tmp_path)
    assert np.array_equal(d.train, tr) and np.array_equal(d.val, va)
    assert d.vocab_size >= 1000 and d.vocab_size % 64 == 0
    (tmp_path / "meta.json").write_text('{"vocab_size": 50257}')
    assert load_data(tmp_path).vocab_size == 50257


def test_text_dir_and_file(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"hello world number {i}\n" * 20)
    (tmp_path / ".hidden.txt").write_text("SECRET")
    (tmp_path / "blob.dat").write_bytes(b"\0\1\2SECRET")
    d = load_data(tmp_path)
    allb = bytes(np.concatenate([d.train, d.val]).astype(np.uint8))
    assert b"hello world number 39" in allb and b"SECRET" not in allb
    assert len(d.train) > len(d.val) > 0 and d.vocab_size == BYTE_VOCAB
    one = tmp_path / "doc00.txt"
    f = load_data(one)  # one document: the last 10 % is validation
    assert len(f.train) + len(f.val) == one.stat().st_size + 2 and len(f.val) > 0


def test_single_bin_file(tmp_path):
    toks = np.arange(1000, dtype=np.uint16) % 300
    toks.tofile(tmp_path / "all.bin")
    d = load_data(tmp_path / "all.bin")
    assert np.array_equal(np.concatenate([d.train, d.val]), toks) and len(d.val) == 100


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make,needle", [
    (lambda p: p / "missing", "no such file or directory"),
    (lambda p: p, "neither train.bin/val.bin nor any text file"),
    (lambda p: _write(p / "train.bin", b"\1\0" * 10).parent, "val.bin"),
    (lambda p: _write(p / "empty.txt", b""), "empty"),
    (lambda p: _write(p / "odd.bin", b"\1\0\1"), "odd number of bytes"),
    (lambda p: _write(p / "x.dat", b"\0\0abc"), "not a text file"),
], ids=["missing", "empty-dir", "no-val-bin", "empty-file", "odd-bin", "binary-file"])
def test_bad_data_paths_give_clear_errors(tmp_path, make, needle):
    path = make(tmp_path)
    with pytest.raises(DataError, match=needle) as e:
        load_data(path)
    assert str(path) in str(e.value)


def test_cli_bad_data_path(tmp_path, capsys):
    code = cli.main(["train", "--preset", "test", "--recipe", "bf16", "--data", str(tmp_path / "nope"),
                     "--out", str(tmp_path / "run"), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "nope" in err and "train.bin" in err


def test_cli_data_shorter_than_a_sequence(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("tiny")
    code = cli.main(["train", "--preset", "test", "--recipe", "bf16", "--data", str(tmp_path / "a.txt"),
                     "--out", str(tmp_path / "run"), "--no-progress"])
    assert code == 2 and "--seq-len" in capsys.readouterr().err


def test_batches_are_a_function_of_seed_and_index():
    toks = (np.arange(10_000) % 251).astype(np.uint16)
    x1, y1 = get_batch(toks, 4, 16, seed=3, index=7)
    x2, y2 = get_batch(toks, 4, 16, seed=3, index=7)
    x3, _ = get_batch(toks, 4, 16, seed=3, index=8)
    xv, _ = get_batch(toks, 4, 16, seed=3, index=7, stream=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3) and not torch.equal(x1, xv)
    assert x1.dtype == torch.int64 and x1.shape == (4, 16)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
