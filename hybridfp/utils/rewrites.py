"""In-place writes that keep a tensor's version counter, made visible to caches keyed on it.

FSDP2 gathers a weight again into the very tensors its forward saved for backward and keeps
their version counters as they were (``torch.autograd._unsafe_preserve_version_counter``), or
autograd would refuse the backward. A cache that validates an entry by a tensor's ``_version``
and ``data_ptr`` would then serve the previous gather's result: the caching allocator usually
hands the freed block back at the same address. The same holds for a QuantizedTensor written
through a slice or view of it: the slice's payload tensors view the same memory with version
counters of their own. A writer that preserves a version counter, or writes through tensors not
sharing it, calls :func:`note_rewrite`; a cache keys on :func:`version` instead of ``_version``.

Memory refilled by a library that calls nothing here (FSDP2 all-gathering a high-precision weight
into its unsharded parameter) is noted by a refresher that library's integration registers
(:func:`register_refresher`); a cache that outlives the refills (the quantized-weight cache across
autocast regions) keys on :func:`current_version`, which runs the refreshers first.

    >>> import torch
    >>> from hybridfp.utils.rewrites import note_rewrite, version
    >>> t = torch.zeros(4)
    >>> before = version(t)
    >>> with torch.autograd._unsafe_preserve_version_counter(t):
    ...     _ = t.fill_(1.0)
    >>> t._version == before[0], version(t) == before
    (True, True)
    >>> note_rewrite(t)
    >>> version(t) == before
    False
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Sequence

import torch

#: id(untyped storage) -> (a weak reference to that storage, the stamp of its latest rewrite with
#: its version counter preserved). Keyed on the storage (its views share it; FSDP2 frees and
#: re-allocates it in place, so it stays the same object) and weakly: an entry is dropped when
#: its storage dies, and a lookup matches only while the reference still gives the very storage
#: asked about (a recycled id never matches). A plain dict read with C-level calls only: every
#: weight of every module call is looked up (an MoE layer's experts), where torch's
#: ``WeakIdKeyDictionary`` would run three Python functions a lookup.
_REWRITES: dict[int, tuple[weakref.ref, int]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    """The storage behind ``ref`` died: drop its entry (unless a new one took the id since)."""
    entry = _REWRITES.get(key)
    if entry is not None and entry[0] is ref:
        _REWRITES.pop(key, None)  # another thread's callback may have dropped it meanwhile


def _stamp(storage: torch.UntypedStorage) -> int:
    """The stamp of ``storage``'s latest noted rewrite (0: none)."""
    entry = _REWRITES.get(id(storage))
    return entry[1] if entry is not None and entry[0]() is storage else 0


#: each rewrite's stamp is new to the process (``next`` on a count is atomic under the GIL): two
#: threads rewriting one storage at once cannot leave it at a value a cache has already seen,
#: as a read-add-write count could (both reading n, both writing n + 1)
_STAMPS = itertools.count(1)


def note_rewrite(t: torch.Tensor) -> None:
    """Record that ``t``'s memory was written in place with its version counter preserved.

    Parameters
    ----------
    t:
        The tensor written (any view of the storage: the whole storage counts as rewritten).
    """
    storage = t.untyped_storage()
    key = id(storage)
    entry = _REWRITES.get(key)
    # the storage's own reference kept; a new one (with its callback) for a new or recycled id
    ref = entry[0] if entry is not None and entry[0]() is storage else weakref.ref(
        storage, lambda r, key=key: _forget(key, r))
    _REWRITES[key] = (ref, next(_STAMPS))


def version(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s version for a cache: its version counter and its storage's rewrites.

    Parameters
    ----------
    t:
        A tensor with a version counter (not an inference tensor).

    Returns
    -------
    tuple[int, int]
        ``(t._version, the stamp of the latest rewrite noted for t's storage)``: changes with every in-place write,
        including those that preserve the version counter and call :func:`note_rewrite`.
    """
    return t._version, _stamp(t.untyped_storage())


#: called by :func:`current_versions` with the tensors about to be read: each notes a rewrite
#: of memory its library refilled since (``integration/fsdp.py``: FSDP2's unsharded parameters)
_REFRESHERS: list[Callable[[Sequence[torch.Tensor]], None]] = []


def register_refresher(fn: Callable[[Sequence[torch.Tensor]], None]) -> None:
    """Have :func:`current_versions` call ``fn(ts)`` before it reads the tensors' versions.

    Parameters
    ----------
    fn:
        Calls :func:`note_rewrite` on each tensor of ``ts`` whose memory was refilled with other
        values since ``fn`` last saw it; cheap for tensors it does not manage (it runs at every
        quantized-weight cache lookup, once for all of a call's weights). Registered once however
        often this is called.
    """
    if fn not in _REFRESHERS:
        _REFRESHERS.append(fn)


def current_versions(ts: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """:func:`version` of each of ``ts`` after the registered refreshers looked at them: what a
    cache of values computed from weights keys on, where a library may refill a weight's memory
    between two reads without moving its version counter. One call for all the weights of a
    module call (an MoE layer's experts): no Python call per weight beyond the list's own.

    Parameters
    ----------
    ts:
        Tensors with version counters (not inference tensors).

    Returns
    -------
    list[tuple[int, int]]
        As :func:`version`, one per tensor.
    """
    for fn in _REFRESHERS:
        fn(ts)
    if not _REWRITES:  # none noted (or all their storages gone): skip the storage lookups
        return [(t._version, 0) for t in ts]
    get = _REWRITES.get
    # _stamp inlined: no Python call per tensor
    return [(t._version, e[1] if (e := get(id(s := t.untyped_storage()))) is not None and e[0]() is s else 0)
            for t in ts]
