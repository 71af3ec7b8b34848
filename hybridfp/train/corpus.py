"""The ``packages`` corpus: the source and text files of the running interpreter's environment.

Every ``*.py``, ``*.pyi``, ``*.rst``, ``*.md``, ``*.txt``, ``*.c`` and ``*.h`` file of the
installed packages (the interpreter's ``site-packages`` directories) and of the standard
library, read as bytes. Nothing is downloaded; what it holds depends on what is installed, so
every build has a **fingerprint** (the selected files' relative paths, sizes and content
hashes) that runs and reports record.

- **Selection.** Candidates are visited in the order of a SHA-256 of their relative path
  (``stdlib/json/decoder.py``, ``site-packages/numpy/...``): a stable pseudo-random order, so a
  size cap takes a sample of every package rather than the alphabetically first ones. The sample
  is **proportional to bytes**, not even across packages: a package holding a third of the
  candidate bytes (the C headers of a CUDA torch install, say) fills about a third of a cap.
  ``max_package_share`` (``packages:SIZE,max-share=F``) caps any one top-level package
  (:func:`package_of`) at ``F`` times the size cap: its later files are skipped, the others'
  taken. A file is left out when it is empty, over :data:`MAX_FILE_BYTES` (generated tables), holds a
  NUL byte (binary), or duplicates a file already taken. Taking stops before the file that
  would pass the cap.
- **Duplicates.** Two files are duplicates when their text agrees after line endings and
  surrounding whitespace are normalised and blank lines dropped, and, for Python sources,
  without their ``import`` / ``from`` lines: vendored copies (``pip/_vendor/...``) rewrite only
  their imports. Exact copies are a special case.
- **Split.** By file, as the stdlib corpus: a file is validation when the SHA-256 of its
  relative path falls in the first ``VAL_PERCENT`` percent (``data.is_val``).

``hybridfp.train.data.load_data("packages")`` loads it (``"packages:50M"`` caps it at 50 MB).
Builds are cached under a key of the candidates' listing, the cap and the rules
(:func:`rules_digest`: these constants and the code that selects, deduplicates and splits), so
changing a rule never reuses a stale build; only the newest :data:`KEEP_BUILDS` builds are kept.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

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
#: Builds of the packages corpus kept in the cache directory (each ~200 MB at the default cap);
#: writing a new one deletes the least recently used beyond these.
KEEP_BUILDS = 2
_BUILD_NAME = re.compile(r"^packages-[0-9a-f]{16}$")


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


@dataclass(frozen=True)
class CorpusSpec:
    """What ``packages[:SIZE][,max-share=F]`` asks for: the size cap in bytes and the largest
    share of it any one top-level package may fill (None: no limit)."""

    max_bytes: int
    max_package_share: Optional[float] = None


def parse_corpus_options(spec: str) -> Optional[CorpusSpec]:
    """The options of ``packages[:SIZE][,max-share=F]``, or None if ``spec`` is not that name.

    Parameters
    ----------
    spec : the ``--data`` value; SIZE is bytes with an optional k / M / G (powers of 1000), F a
        fraction in (0, 1] of the cap that one top-level package may fill.

    Returns
    -------
    CorpusSpec or None

    Raises
    ------
    CorpusSpecError : a SIZE that is not a positive size, an F outside (0, 1], another option.

    Example
    -------
    >>> parse_corpus_options("packages:50M,max-share=0.2")
    CorpusSpec(max_bytes=50000000, max_package_share=0.2)
    """
    name, sep, rest = spec.partition(":")
    if name != PACKAGES:
        return None
    if not sep:
        return CorpusSpec(DEFAULT_MAX_BYTES)
    cap, share = DEFAULT_MAX_BYTES, None
    for i, part in enumerate(rest.split(",")):
        key, eq, value = part.strip().partition("=")
        if eq and key == "max-share":
            try:
                share = float(value)
            except ValueError:
                share = 0.0
            if not 0.0 < share <= 1.0:
                raise CorpusSpecError(f"--data {spec}: max-share must be a fraction in (0, 1] of the size cap, "
                                      f"e.g. packages:100M,max-share=0.2; got {value!r}.")
        elif eq:
            raise CorpusSpecError(f"--data {spec}: unknown option {key!r}; packages takes SIZE and max-share=F, "
                                  "e.g. packages:100M,max-share=0.2.")
        else:
            m = _SIZE.match(part.strip())
            cap = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m and i == 0 else 0
            if cap <= 0:
                raise CorpusSpecError(f"--data {spec}: the size after 'packages:' must be a positive number of "
                                      "bytes with an optional k / M / G, e.g. packages:50M.")
    return CorpusSpec(cap, share)


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
    parsed = parse_corpus_options(spec)
    return None if parsed is None else parsed.max_bytes


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


def package_of(rel: str) -> str:
    """The top-level package of a relative path: its root label and first component
    (``site-packages/torch/include/c10/x.h`` -> ``site-packages/torch``; a top-level module is
    its own package)."""
    label, _, rest = rel.partition("/")
    return f"{label}/{rest.split('/', 1)[0]}"


def code_text(fn: Callable) -> str:
    """What a rule's function does, for :func:`rules_digest`: its source, or its byte code where
    no source is installed."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return repr((fn.__code__.co_code, fn.__code__.co_consts))


def rules_digest(extra: str = "") -> str:
    """A hash of the selection rules: the constants (format, suffixes, size limit, skipped
    directories) and the code of :func:`list_files`, :func:`order_key`, :func:`duplicate_key`,
    :func:`package_of` and :func:`select`, plus ``extra`` (the caller's split rules and options).
    A build cached under one digest is never read under another."""
    g = globals()  # looked up at call time: a replaced rule is the rule in force
    parts = [_FORMAT, repr(g["TEXT_SUFFIXES"]), str(g["MAX_FILE_BYTES"]), repr(sorted(_SKIP_DIRS)), extra]
    parts += [code_text(g[name]) for name in ("list_files", "order_key", "duplicate_key", "package_of", "select")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def listing_key(files: Iterable[CorpusFile], max_bytes: int, rules: str = "") -> str:
    """A cheap key of the candidates (paths, sizes, modification times), the cap and the
    ``rules`` (:func:`rules_digest`) for the cache: any change to a file or a rule gives a new
    key, hence a rebuild, hence a fresh fingerprint."""
    h = hashlib.sha256(f"{_FORMAT} {max_bytes} {rules}\n".encode())
    for f in files:
        h.update(f"{f.rel}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def select(files: Sequence[CorpusFile], max_bytes: int, max_package_share: Optional[float] = None
           ) -> CorpusBuild:
    """Read the candidates in their stable order (whatever order they are given in) and keep the
    non-duplicate text files up to ``max_bytes``; with ``max_package_share``, a file whose
    top-level package (:func:`package_of`) would pass that share of ``max_bytes`` is skipped."""
    docs: list[tuple[str, bytes]] = []
    seen: set[bytes] = set()
    total = duplicates = 0
    per_package: dict[str, int] = {}
    fp = hashlib.sha256(f"{_FORMAT}\n".encode())
    for f in sorted(files, key=lambda f: (order_key(f.rel), f.rel)):
        if f.size == 0 or f.size > MAX_FILE_BYTES:
            continue
        if total + f.size > max_bytes:
            break
        pkg = package_of(f.rel)
        if max_package_share is not None and per_package.get(pkg, 0) + f.size > max_package_share * max_bytes:
            continue
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
        per_package[pkg] = per_package.get(pkg, 0) + len(data)
        fp.update(f"{f.rel}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return CorpusBuild(tuple(docs), f"{PACKAGES}-{fp.hexdigest()[:16]}", len(files), duplicates)


def prune_builds(cache_dir: Path, keep: int = KEEP_BUILDS) -> list[Path]:
    """Delete the packages builds in ``cache_dir`` beyond the ``keep`` most recently used (their
    ``meta.json`` times: a cache hit touches it); other entries are never touched.

    Returns
    -------
    list of Path : the deleted build directories.
    """
    builds = [p for p in Path(cache_dir).glob(f"{PACKAGES}-*")
              if _BUILD_NAME.match(p.name) and (p / "meta.json").is_file()]
    builds.sort(key=lambda p: (p / "meta.json").stat().st_mtime_ns, reverse=True)
    for old in builds[keep:]:
        shutil.rmtree(old, ignore_errors=True)  # a build in use stays readable: its files are memory-mapped
    return builds[keep:]


__all__ = ["CorpusBuild", "CorpusFile", "CorpusSpec", "CorpusSpecError", "DEFAULT_MAX_BYTES", "KEEP_BUILDS",
           "MAX_FILE_BYTES", "PACKAGES", "TEXT_SUFFIXES", "code_text", "corpus_roots", "duplicate_key", "list_files",
           "listing_key", "order_key", "package_of", "parse_corpus_options", "parse_corpus_spec", "prune_builds",
           "rules_digest", "select"]
