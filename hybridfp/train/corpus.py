"""The ``packages`` corpus: the source and text files of the running interpreter's environment.

Every ``*.py``, ``*.pyi``, ``*.rst``, ``*.md``, ``*.txt``, ``*.c`` and ``*.h`` file of the
installed packages (the interpreter's ``site-packages`` directories) and of the standard
library, read as bytes. Nothing is downloaded; what it holds depends on what is installed, so
every build has a **fingerprint** (the selected files' relative paths, sizes and content
hashes) that runs and reports record.

- **Selection.** Candidates are visited in the order of a SHA-256 of their relative path
  (``stdlib/json/decoder.py``, ``site-packages/numpy/...``): a stable pseudo-random order, so a
  size cap takes an even sample of every package rather than the alphabetically first ones. A
  file is left out when it is empty, over :data:`MAX_FILE_BYTES` (generated tables), holds a
  NUL byte (binary), or duplicates a file already taken. Taking stops before the file that
  would pass the cap.
- **Duplicates.** Two files are duplicates when their text agrees after line endings and
  surrounding whitespace are normalised and blank lines dropped, and, for Python sources,
  without their ``import`` / ``from`` lines: vendored copies (``pip/_vendor/...``) rewrite only
  their imports. Exact copies are a special case.
- **Split.** By file, as the stdlib corpus: a file is validation when the SHA-256 of its
  relative path falls in the first ``VAL_PERCENT`` percent (``data.is_val``).

``hybridfp.train.data.load_data("packages")`` loads it (``"packages:50M"`` caps it at 50 MB).
"""

from __future__ import annotations

import hashlib
import os
import re
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

#: The corpus name accepted by ``--data``.
PACKAGES = "packages"
#: Suffixes of the files read.
TEXT_SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt", ".c", ".h")
#: Larger files are generated data (Unicode tables, test vectors), not prose or code.
MAX_FILE_BYTES = 1_000_000
#: Default size cap (bytes = tokens): far more than a run of the convergence study reads.
DEFAULT_MAX_BYTES = 100_000_000
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_FORMAT = "packages-v1"


class CorpusSpecError(ValueError):
    """A ``packages:SIZE`` corpus name whose size does not parse."""


@dataclass(frozen=True)
class CorpusFile:
    """One candidate file: its stable relative path (``<root label>/<path>``), location, stat."""

    rel: str
    path: Path
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class CorpusBuild:
    """The selected documents of a build and what identifies them."""

    docs: tuple[tuple[str, bytes], ...]
    fingerprint: str
    candidates: int
    duplicates: int

    @property
    def n_bytes(self) -> int:
        """Bytes of the selected documents."""
        return sum(len(d) for _, d in self.docs)


def parse_corpus_spec(spec: str) -> Optional[int]:
    """The size cap of ``packages`` / ``packages:SIZE``, or None if ``spec`` is not that name.

    Parameters
    ----------
    spec : the ``--data`` value; SIZE is bytes with an optional k / M / G (powers of 1000).

    Returns
    -------
    int or None : the cap in bytes (:data:`DEFAULT_MAX_BYTES` without a size).

    Raises
    ------
    CorpusSpecError : ``packages:SIZE`` with a SIZE that is not a positive size.

    Example
    -------
    >>> parse_corpus_spec("packages:50M"), parse_corpus_spec("data/") is None
    (50000000, True)
    """
    name, sep, size = spec.partition(":")
    if name != PACKAGES:
        return None
    if not sep:
        return DEFAULT_MAX_BYTES
    m = _SIZE.match(size.strip())
    cap = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else 0
    if cap <= 0:
        raise CorpusSpecError(f"--data {spec}: the size after 'packages:' must be a positive number of "
                              "bytes with an optional k / M / G, e.g. packages:50M.")
    return cap


def corpus_roots() -> list[tuple[str, Path]]:
    """(label, directory) of the standard library and every site-packages directory of this
    interpreter (real paths, each once)."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    site_dirs = [paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", lambda: [])()]
    seen = {roots[0][1].resolve()}
    for d in site_dirs:
        p = Path(d)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            label = "site-packages" if not any(lab.startswith("site-packages") for lab, _ in roots) \
                else f"site-packages-{len(roots)}"
            roots.append((label, p))
    return roots


def list_files(roots: Sequence[tuple[str, Path]]) -> list[CorpusFile]:
    """Candidate files under ``roots``, in their stable pseudo-random order (see the module
    docstring). Hidden, ``__pycache__``, ``*.dist-info`` / ``*.egg-info`` and nested
    site-packages directories, and the stdlib's machine-specific ``config-*`` / ``_sysconfigdata``
    files, are not visited."""
    out = []
    for label, root in roots:
        root = Path(root)
        for dirpath, dirnames, filenames in os.walk(root):
            top = dirpath == str(root)
            dirnames[:] = [d for d in dirnames if not (d.startswith(".") or d in _SKIP_DIRS
                                                       or d.endswith((".dist-info", ".egg-info"))
                                                       or (top and label == "stdlib" and d.startswith("config-")))]
            for name in filenames:
                if not name.endswith(TEXT_SUFFIXES) or name.startswith((".", "_sysconfigdata")):
                    continue
                path = Path(dirpath, name)
                try:
                    st = path.stat()
                except OSError:  # a dangling link
                    continue
                rel = f"{label}/{path.relative_to(root).as_posix()}"
                out.append(CorpusFile(rel, path, st.st_size, st.st_mtime_ns))
    return sorted(out, key=lambda f: (order_key(f.rel), f.rel))


def order_key(rel: str) -> bytes:
    """The visiting order of a relative path (independent of the split's hash)."""
    return hashlib.sha256(b"order:" + rel.encode()).digest()[:8]


def duplicate_key(data: bytes, rel: str) -> bytes:
    """What two duplicates share: the text without blank lines and surrounding whitespace (and,
    for Python sources, without import lines)."""
    lines = (line.strip() for line in data.replace(b"\r\n", b"\n").split(b"\n"))
    python = rel.endswith((".py", ".pyi"))
    kept = [line for line in lines if line and not (python and line.startswith((b"import ", b"from ")))]
    return hashlib.sha256(b"\n".join(kept)).digest()


def listing_key(files: Iterable[CorpusFile], max_bytes: int) -> str:
    """A cheap key of the candidates (paths, sizes, modification times) for the cache: any
    change to a file gives a new key, hence a rebuild, hence a fresh fingerprint."""
    h = hashlib.sha256(f"{_FORMAT} {max_bytes}\n".encode())
    for f in files:
        h.update(f"{f.rel}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def select(files: Sequence[CorpusFile], max_bytes: int) -> CorpusBuild:
    """Read the candidates in their stable order (whatever order they are given in) and keep the
    non-duplicate text files up to ``max_bytes``."""
    docs: list[tuple[str, bytes]] = []
    seen: set[bytes] = set()
    total = duplicates = 0
    fp = hashlib.sha256(f"{_FORMAT}\n".encode())
    for f in sorted(files, key=lambda f: (order_key(f.rel), f.rel)):
        if f.size == 0 or f.size > MAX_FILE_BYTES:
            continue
        if total + f.size > max_bytes:
            break
        try:
            data = f.path.read_bytes()
        except OSError:  # unreadable: not part of the corpus (the fingerprint says what is)
            continue
        if not data or b"\0" in data or len(data) > MAX_FILE_BYTES:
            continue
        key = duplicate_key(data, f.rel)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        docs.append((f.rel, data))
        total += len(data)
        fp.update(f"{f.rel}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return CorpusBuild(tuple(docs), f"{PACKAGES}-{fp.hexdigest()[:16]}", len(files), duplicates)


__all__ = ["CorpusBuild", "CorpusFile", "CorpusSpecError", "DEFAULT_MAX_BYTES", "MAX_FILE_BYTES", "PACKAGES",
           "TEXT_SUFFIXES", "corpus_roots", "duplicate_key", "list_files", "listing_key", "order_key",
           "parse_corpus_spec", "select"]
