"""Training data: token streams and the batches drawn from them.

Sources (all byte-level, vocab 256, unless token files say otherwise):

- default: the Python standard library's own ``*.py`` files
  (``sysconfig.get_paths()["stdlib"]``; ``site-packages``, ``test``/``tests`` and
  machine-specific files left out), read in sorted path order. A file goes to validation
  when the SHA-256 of its relative path falls in the first ``VAL_PERCENT`` percent, so the
  split does not depend on the file system's listing order. Built once and cached as
  nanoGPT token files under the cache directory (never required: a failed cache write only
  costs a rebuild next time).
- ``--data packages`` (``packages:SIZE`` caps it, e.g. ``packages:50M``; ``,max-share=F`` caps
  any one top-level package at F of that): every source and text file of the installed
  packages and the standard library, deduplicated, split by file (``hybridfp.train.corpus``),
  cached under a key of the files and the rules, the newest ``corpus.KEEP_BUILDS`` builds
  kept; its ``fingerprint`` identifies the files (a local directory named ``packages`` is
  ``./packages``).
- ``--data DIR`` holding ``train.bin`` and ``val.bin`` (nanoGPT uint16 token files; an
  optional ``meta.json`` with ``{"vocab_size": N}``).
- ``--data DIR`` of text files (every non-hidden file without NUL bytes, sorted, split by
  path hash as above) or ``--data FILE`` (text, or a ``.bin`` token file): the last 10 %
  is validation when the hash split leaves one side empty.

Batches: batch ``i`` of a run is a pure function of (seed, i) — random windows of
``seq_len + 1`` tokens — so every compared recipe sees the same data in the same order and a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from . import corpus
from .files import atomic_write, atomic_write_text

VAL_PERCENT = 5
TAIL_VAL_FRACTION = 0.1
BYTE_VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SEPARATOR = b"\n\n"


class DataError(ValueError):
    """Data missing, empty or unreadable; the message says what was looked for."""


@dataclass
class TokenData:
    """Train and validation token streams (int64 views are made per batch)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str
    #: What identifies the corpus's files (paths, sizes, contents): the packages and stdlib
    #: corpora's, or ``data-<SHA-256 of the contents>`` for ``--data DIR|FILE``.
    fingerprint: str = ""

    def describe(self) -> str:
        """One line: where the tokens came from and how many."""
        return (f"{self.source}: {len(self.train):,} train / {len(self.val):,} val tokens, "
                f"vocab {self.vocab_size}")


# ---------------------------------------------------------------------------- documents
def stdlib_files(root: Optional[Path] = None) -> list[Path]:
    """The standard library's ``*.py`` files in sorted relative-path order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        if rel.parts[0].startswith("config-") or not p.is_file():
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_val(rel_path: str) -> bool:
    """Deterministic split: validation iff the path's SHA-256 lands in the first VAL_PERCENT %."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h % 100 < VAL_PERCENT


def split_documents(docs: list[tuple[str, bytes]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (relative path, bytes) documents into train and val byte streams."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for rel, data in docs:
        parts[is_val(rel)].extend((data, _SEPARATOR))
    train, val = (np.frombuffer(b"".join(parts[v]), dtype=np.uint8) for v in (False, True))
    if len(train) == 0 or len(val) == 0:  # too few documents for a hash split: cut the tail
        allb = np.frombuffer(b"".join(d + _SEPARATOR for _, d in docs), dtype=np.uint8)
        cut = int(len(allb) * (1 - TAIL_VAL_FRACTION))
        train, val = allb[:cut], allb[cut:]
    return train.astype(np.uint16), val.astype(np.uint16)


def _fingerprint(root: Path, files: list[Path]) -> str:
    """Identity of a corpus: Python version, relative paths and sizes."""
    h = hashlib.sha256(f"v1 {sysconfig.get_python_version()}".encode())
    for p in files:
        h.update(f"{p.relative_to(root).as_posix()}:{p.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def build_stdlib_corpus(root: Optional[Path] = None) -> tuple[np.ndarray, np.ndarray]:
    """Train/val byte streams of the stdlib corpus (no caching)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise DataError(f"no *.py files found under the standard library directory {root} "
                        "(sysconfig.get_paths()['stdlib']); pass --data DIR|FILE instead.")
    return split_documents([(p.relative_to(root).as_posix(), p.read_bytes()) for p in files])


def default_cache_dir() -> Path:
    """~/.cache/hybridfp (override with --cache-dir)."""
    return Path.home() / ".cache" / "hybridfp"


def load_stdlib_corpus(cache_dir: Optional[Path] = None, root: Optional[Path] = None) -> TokenData:
    """The default corpus, from the cache when it holds this Python's build."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise DataError(f"no *.py files found under the standard library directory {root} "
                        "(sysconfig.get_paths()['stdlib']); pass --data DIR|FILE instead.")
    cache = Path(cache_dir or default_cache_dir()) / f"stdlib-{_fingerprint(root, files)}"
    source = f"Python {sysconfig.get_python_version()} stdlib ({len(files)} files)"
    if (cache / "train.bin").is_file() and (cache / "val.bin").is_file():
        train, val = _read_bin(cache / "train.bin"), _read_bin(cache / "val.bin")
        return TokenData(train, val, BYTE_VOCAB, source + " [cached]", cache.name)
    train, val = split_documents([(p.relative_to(root).as_posix(), p.read_bytes()) for p in files])
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for name, arr in (("train.bin", train), ("val.bin", val)):
            atomic_write(cache / name, arr.tofile)
        (cache / "meta.json").write_text(json.dumps({"vocab_size": BYTE_VOCAB, "source": source}))
    except OSError:
        pass  # the cache is an optimisation only
    return TokenData(train, val, BYTE_VOCAB, source, cache.name)


# ---------------------------------------------------------------------------- user data
def _read_bin(path: Path) -> np.ndarray:
    """A nanoGPT token file (uint16, memory-mapped)."""
    if path.stat().st_size % 2:
        raise DataError(f"{path} has an odd number of bytes; nanoGPT .bin files hold uint16 tokens.")
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty (no tokens).")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _vocab_of(directory: Path, *streams: np.ndarray) -> int:
    """The vocabulary of token files: ``meta.json``'s ``vocab_size`` where there is one (checked
    to cover every token), else the highest token rounded up.

    Raises
    ------
    DataError
        meta.json is not JSON, not an object, lacks ``vocab_size`` or holds no positive integer
        there, or a token is not below it (an embedding lookup would fail mid-run).
    """
    meta = directory / "meta.json"
    top = max(int(s.max()) for s in streams if len(s))
    if not meta.is_file():
        return BYTE_VOCAB if top < BYTE_VOCAB else (top + 64) // 64 * 64
    try:
        info = json.loads(meta.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta}: cannot be read as JSON ({' '.join(str(e).split())}); fix it or delete it "
                        "(the vocabulary is then taken from the tokens).") from None
    vocab = info.get("vocab_size") if isinstance(info, dict) else None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise DataError(f"{meta}: 'vocab_size' must be a positive integer, e.g. {{\"vocab_size\": "
                        f"{(top + 64) // 64 * 64}}}; got {vocab!r}" + ("" if isinstance(info, dict) else
                        f" (the file holds a {type(info).__name__}, not an object)") + ".")
    if top >= vocab:
        raise DataError(f"{meta}: 'vocab_size' is {vocab}, but the token files hold token {top}; "
                        f"set vocab_size to at least {top + 1}.")
    return vocab


def content_fingerprint(kind: str, files: list[tuple[str, Path]], extra: str = "") -> str:
    """Identity of user data: SHA-256 of ``kind``, ``extra`` and each (name, file)'s name and
    content, in the order given (callers pass a sorted one). A resume compares it with the
    step-0 record's, so it refuses to continue on other text or tokens."""
    h = hashlib.sha256(f"user-data v1 {kind} {extra}\n".encode())
    for name, path in files:
        h.update(f"{name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return f"data-{h.hexdigest()[:16]}"  # the prefix tells it apart from the packages / stdlib corpora


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def text_files(directory: Path) -> list[Path]:
    """Non-hidden files without NUL bytes under ``directory``, sorted by relative path."""
    out = []
    for p in sorted(directory.rglob("*"), key=lambda p: p.relative_to(directory).as_posix()):
        rel = p.relative_to(directory)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if _is_text(p):
            out.append(p)
    return out


def _mark_used(meta_path: Path) -> None:
    """Stamp a build as used now (the clock's full resolution, not the file system's coarser
    one): ``corpus.prune_builds`` keeps the most recently used."""
    now = time.time_ns()
    try:
        os.utime(meta_path, ns=(now, now))
    except OSError:
        pass  # the cache is an optimisation only


def split_rules() -> str:
    """The split and concatenation rules, for the packages cache key (``corpus.rules_digest``):
    :data:`VAL_PERCENT`, :data:`TAIL_VAL_FRACTION`, the separator and the code of
    :func:`is_val` and :func:`split_documents`."""
    g = globals()  # at call time: a changed rule is the rule in force
    return "\0".join([f"val {g['VAL_PERCENT']} tail {g['TAIL_VAL_FRACTION']} sep {g['_SEPARATOR']!r}",
                       corpus.code_text(g["is_val"]), corpus.code_text(g["split_documents"])])


def load_packages_corpus(cache_dir: Optional[Path] = None, max_bytes: int = corpus.DEFAULT_MAX_BYTES,
                         roots: Optional[list[tuple[str, Path]]] = None,
                         max_package_share: Optional[float] = None) -> TokenData:
    """The ``packages`` corpus (``hybridfp.train.corpus``), from the cache when its files and
    rules are unchanged. Writing a new build deletes the cached packages builds beyond the
    newest ``corpus.KEEP_BUILDS`` (each ~200 MB at the default cap).

    Parameters
    ----------
    cache_dir : where builds are kept (default :func:`default_cache_dir`).
    max_bytes : the size cap (bytes = tokens).
    roots : (label, directory) pairs to read (default: this interpreter's stdlib and
        site-packages, ``corpus.corpus_roots()``).
    max_package_share : the largest share of ``max_bytes`` one top-level package may fill
        (None: files are taken in proportion to their bytes).

    Returns
    -------
    TokenData : byte tokens; ``fingerprint`` names the selected files' paths, sizes and contents.

    Raises
    ------
    DataError : no text file found under the roots.
    """
    roots = roots if roots is not None else corpus.corpus_roots()
    files = corpus.list_files(roots)
    where = ", ".join(str(r) for _, r in roots)
    rules = corpus.rules_digest(f"{split_rules()}\0max_package_share {max_package_share!r}")
    cache_root = Path(cache_dir or default_cache_dir())
    cache = cache_root / f"packages-{corpus.listing_key(files, max_bytes, rules)}"
    meta_path = cache / "meta.json"
    if (cache / "train.bin").is_file() and (cache / "val.bin").is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            train, val = _read_bin(cache / "train.bin"), _read_bin(cache / "val.bin")
            _mark_used(meta_path)
            return TokenData(train, val, BYTE_VOCAB, meta["source"] + " [cached]", meta["fingerprint"])
        except (OSError, ValueError, KeyError, DataError):
            pass  # a damaged cache entry: rebuilt below
    build = corpus.select(files, max_bytes, max_package_share)
    if not build.docs:
        raise DataError(f"--data packages: no text file ({', '.join(corpus.TEXT_SUFFIXES)}) found under {where}.")
    train, val = split_documents(list(build.docs))
    source = (f"installed packages + stdlib corpus {build.fingerprint} ({len(build.docs):,} files, "
              f"{build.n_bytes / 1e6:.1f} MB; {build.duplicates:,} duplicates left out; cap {max_bytes:,} bytes"
              + (f", at most {max_package_share:g} of it per package" if max_package_share is not None else "") + ")")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for name, arr in (("train.bin", train), ("val.bin", val)):
            atomic_write(cache / name, arr.tofile)
        meta = {"vocab_size": BYTE_VOCAB, "source": source, "fingerprint": build.fingerprint,
                "files": [rel for rel, _ in build.docs]}
        atomic_write_text(meta_path, json.dumps(meta))
        _mark_used(meta_path)
        corpus.prune_builds(cache_root)
    except OSError:
        pass  # the cache is an optimisation only
    return TokenData(train, val, BYTE_VOCAB, source, build.fingerprint)


def load_data(path: Optional[str | Path] = None, cache_dir: Optional[str | Path] = None) -> TokenData:
    """Load ``path`` (see the module docstring), or the stdlib corpus when None."""
    if path is None:
        return load_stdlib_corpus(Path(cache_dir) if cache_dir else None)
    try:
        spec = corpus.parse_corpus_options(str(path))
    except corpus.CorpusSpecError as e:
        raise DataError(str(e)) from None
    if spec is not None:
        if Path(path).exists():
            raise DataError(f"--data {path}: a local path of that name exists too; pass ./{path} for it, "
                            "or run elsewhere for the packages corpus.")
        return load_packages_corpus(Path(cache_dir) if cache_dir else None, spec.max_bytes,
                                    max_package_share=spec.max_package_share)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"--data {path}: no such file or directory (expected a directory with "
                        "train.bin and val.bin, a directory of text files, or one text/.bin file).")
    if p.is_dir():
        tb, vb = p / "train.bin", p / "val.bin"
        if tb.exists() or vb.exists():
            missing = [str(f) for f in (tb, vb) if not f.is_file()]
            if missing:
                raise DataError(f"--data {path}: found one nanoGPT token file but not {', '.join(missing)}; "
                                "provide both train.bin and val.bin.")
            train, val = _read_bin(tb), _read_bin(vb)
            vocab = _vocab_of(p, train, val)
            return TokenData(train, val, vocab, f"{p} (train.bin/val.bin)",
                             content_fingerprint("bin", [("train.bin", tb), ("val.bin", vb)], f"vocab {vocab}"))
        files = text_files(p)
        if not files:
            raise DataError(f"--data {path}: the directory has neither train.bin/val.bin nor any "
                            "text file (non-hidden, without NUL bytes).")
        docs = [(f.relative_to(p).as_posix(), f.read_bytes()) for f in files]
        train, val = split_documents(docs)
        if len(train) < 2 or len(val) < 2:
            raise DataError(f"--data {path}: the text files hold {len(train) + len(val)} bytes; "
                            "too little to train on.")
        return TokenData(train, val, BYTE_VOCAB, f"{p} ({len(files)} text files)",
                         content_fingerprint("text", [(f.relative_to(p).as_posix(), f) for f in files]))
    if p.suffix == ".bin":
        tokens = _read_bin(p)
        cut = int(len(tokens) * (1 - TAIL_VAL_FRACTION))
        vocab = _vocab_of(p.parent, tokens)
        return TokenData(tokens[:cut], tokens[cut:], vocab, f"{p} (tokens)",
                         content_fingerprint("bin-file", [(p.name, p)], f"vocab {vocab}"))
    data = p.read_bytes()
    if not data:
        raise DataError(f"--data {path}: the file is empty.")
    if b"\0" in data[:8192]:
        raise DataError(f"--data {path}: not a text file (NUL bytes) and not a .bin token file.")
    train, val = split_documents([(p.name, data)])
    return TokenData(train, val, BYTE_VOCAB, f"{p} (text)", content_fingerprint("text-file", [(p.name, p)]))


# ---------------------------------------------------------------------------- batches
def _generator(seed: int, index: int, stream: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index * 2 + stream) % (2**63))
    return g


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, index: int,
              stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index``: ``batch_size`` random windows (x, y = x shifted by one), int64 [B, T].

    ``stream`` 0 is training, 1 validation; the same (seed, index, stream) gives the same batch.
    """
    if len(tokens) < seq_len + 1:
        raise DataError(f"the {'validation' if stream else 'training'} split has {len(tokens)} "
                        f"tokens; seq_len={seq_len} needs at least {seq_len + 1}. Use a shorter "
                        "--seq-len or more data.")
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=_generator(seed, index, stream))
    rows = [torch.from_numpy(tokens[s:s + seq_len + 1].astype(np.int64)) for s in starts.tolist()]
    xy = torch.stack(rows)
    return xy[:, :-1], xy[:, 1:]


def val_batches(data: TokenData, batch_size: int, seq_len: int, seed: int, n: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation batches (the same at every evaluation)."""
    for i in range(n):
        yield get_batch(data.val, batch_size, seq_len, seed, i, stream=1)
