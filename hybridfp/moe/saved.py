"""What a ``GroupedLinear`` step saves for backward: the experts' tensors in few plain tensors.

Every expert saves what its wgrad / dgrad read (x's columnwise copy or x itself, W's copies),
as ``linear_function.pack`` does for one ``Linear``: plain payload tensors, so saved-tensor
hooks (CPU offload, recompute) see ordinary tensors. With 64 experts, packing each expert
separately would be 128 packs and unpacks and a few hundred saved tensors a step, all host
work. Most of those tensors are
views of a few shared buffers (``quantize_grouped``'s joined copies, the rows of x), so the
experts' own tensors are saved per *slot* (the j-th payload tensor of every expert) as one
tensor where their layout allows:

- ``SAME``: every expert holds the same tensor (saved once);
- ``ROWS``: the experts' plain tensors are the row blocks of one tensor the caller names (the
  rows of x kept with ``save_original_input``): that tensor, re-split by rows;
- ``OWN``: anything else, one saved tensor per expert.

Each expert's storage is described by a small record (class, shape, options, payload slots)
instead of a skeleton storage object, and rebuilt once in backward. Experts held as a
``GroupedTensor`` are saved as its joined copies' tensors and handed back as a
``GroupedTensor`` again: joined only, with no per-expert record at all; built, with a record
per expert whose payload tensors of a joined direction are marked as cuts of the joined copy
(rebuilt as the same views of it) and only the experts' own tensors saved by slot. The rebuilt
tensors are views of the same memory as the forward's, with the same shapes, strides and
options, so the backward GEMMs compute bitwise what they computed on the forward's objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ..tensors import HybridStorage, IdentityStorage, QuantizedStorage, QuantizedTensor
from .grouped_tensor import Cutter, GroupedTensor, JoinedCopy
from .joined import column_slices
from ..tensors.storage import COLUMNWISE, DIRECTIONS, ROWWISE

SAME, ROWS, OWN = "same", "rows", "own"


@dataclass
class SavedExperts:
    """How to rebuild the experts' tensors from the saved plain tensors: ``items`` one record
    per expert (None: nothing saved), ``slots`` one (kind, split sizes) per payload slot."""

    items: list[Optional[tuple]]
    slots: Optional[list[tuple[str, Any]]]  # None: experts of different layouts, saved in order


@dataclass
class SavedJoined:
    """How to rebuild a ``GroupedTensor`` from its saved joined copies: per direction (the
    index of its storage's skeleton, the group starts); per skeleton the count of its tensors."""

    splits: list[int]
    cut: Optional[Cutter]
    skeletons: list[tuple[QuantizedStorage, int]]
    directions: dict[str, tuple[int, Optional[list[int]]]]
    #: per direction, the index among the saved tensors of its per-expert ``scales`` (if any)
    scales: Optional[dict[str, int]] = None
    #: built form (``cut`` None): the experts' records and own tensors, saved after the copies'
    experts: Optional[SavedExperts] = None


def save_experts(ts: Sequence[Optional[torch.Tensor]], rows_of: Optional[torch.Tensor] = None
                 ) -> tuple[list[torch.Tensor], "SavedExperts | SavedJoined"]:
    """The plain tensors to save for the experts' ``ts`` and the record that
    ``restore_experts`` rebuilds them from.

    Parameters
    ----------
    ts:
        The experts' tensors: None, plain or quantized tensors, or a ``GroupedTensor``.
    rows_of:
        The tensor whose consecutive row blocks the experts' plain tensors ``ts`` are (every
        expert present), saved instead of them; None: no such tensor.

    Returns
    -------
    (tensors to save, record)."""
    if isinstance(ts, GroupedTensor):
        return _save_joined(ts)
    if rows_of is not None:
        return [rows_of], SavedExperts([("t",)] * len(ts), [(ROWS, [t.shape[0] for t in ts])])
    return _save_items(ts, frozenset())


def _save_items(ts: Sequence[Optional[torch.Tensor]], cut: frozenset
                ) -> tuple[list[torch.Tensor], SavedExperts]:
    """The experts' records and their tensors by slot; payload tensors of the directions in
    ``cut`` (held as joined copies, saved on their own) are marked, not saved."""
    flats: list[list[torch.Tensor]] = []
    items: list[Optional[tuple]] = []
    for t in ts:
        if t is None:
            items.append(None)
            continue
        if isinstance(t, QuantizedTensor):
            flat: list[torch.Tensor] = []
            items.append(("q", _describe(t.qstorage, flat, cut), t.quantizer))
        else:
            flat = [t]
            items.append(("t",))
        flats.append(flat)
    if not flats:
        return [], SavedExperts(items, [])
    width = len(flats[0])
    if any(len(f) != width for f in flats):  # experts of different layouts: every tensor its own
        return [t for f in flats for t in f], SavedExperts(items, None)
    saved: list[torch.Tensor] = []
    slots = [_save_slot([f[j] for f in flats], saved) for j in range(width)]
    return saved, SavedExperts(items, slots)


def restore_experts(rec: "SavedExperts | SavedJoined", tensors: Sequence[torch.Tensor]
                    ) -> "list[Optional[torch.Tensor]] | GroupedTensor":
    """Inverse of :func:`save_experts`, from the saved tensors (as saved-tensor hooks return them)."""
    if isinstance(rec, SavedJoined):
        return _restore_joined(rec, tensors)
    return _restore_items(rec, iter(tensors), None)


def _restore_items(rec: SavedExperts, it: Iterator[torch.Tensor], cut: Optional["_Cuts"]
                   ) -> list[Optional[torch.Tensor]]:
    """The experts of :func:`_save_items`, their marked payload tensors cut by ``cut``."""
    n = sum(item is not None for item in rec.items)
    columns = None if rec.slots is None else [_restore_slot(kind, arg, it, n) for kind, arg in rec.slots]
    out: list[Optional[torch.Tensor]] = []
    e = 0
    for expert, item in enumerate(rec.items):
        if item is None:
            out.append(None)
            continue
        # this expert's tensors: its entry of every slot, or the next ones in order
        mine = iter([c[e] for c in columns]) if columns is not None else it
        e += 1
        out.append(next(mine) if item[0] == "t" else
                   QuantizedTensor(_build(item[1], mine, cut, expert), item[2]))
    return out


def _save_joined(ts: GroupedTensor) -> tuple[list[torch.Tensor], SavedJoined]:
    """The joined copies' payload tensors (a storage shared by both directions once) and
    skeletons; for a built ``GroupedTensor`` then the experts' records and own tensors."""
    saved: list[torch.Tensor] = []
    skeletons: list[tuple[QuantizedStorage, int]] = []
    index: dict[int, int] = {}
    directions: dict[str, tuple[int, Optional[list[int]]]] = {}
    for d in DIRECTIONS:
        j = ts.joined(d)
        if j is None:
            continue
        if id(j.storage) not in index:
            flat, skeleton = j.storage.split_tensors()
            index[id(j.storage)] = len(skeletons)
            skeletons.append((skeleton, len(flat)))
            saved.extend(flat)
        directions[d] = (index[id(j.storage)], j.starts)
    # per-expert scales (FP8 current scaling) after the storages' tensors, one per direction
    scales = {}
    for d in directions:
        if ts.joined(d).scales is not None:
            scales[d] = len(saved)
            saved.append(ts.joined(d).scales)
    experts = None
    if not ts.joined_only:  # built: the experts' records, their own tensors after the copies'
        own, experts = _save_items(ts.experts(), frozenset(directions))
        saved.extend(own)
    return saved, SavedJoined(ts.splits, ts.cutter, skeletons, directions, scales or None, experts)


def _restore_joined(rec: SavedJoined, tensors: Sequence[torch.Tensor]) -> GroupedTensor:
    it = iter(tensors)
    storages = [skeleton.with_tensors([next(it) for _ in range(n)]) for skeleton, n in rec.skeletons]
    scales = rec.scales or {}
    joined = {d: JoinedCopy(storages[i], starts, tensors[scales[d]] if d in scales else None)
              for d, (i, starts) in rec.directions.items()}
    if rec.experts is None:
        return GroupedTensor(rec.splits, joined, rec.cut)
    for _ in scales:  # the scales were read by index above
        next(it)
    experts = _restore_items(rec.experts, it, _Cuts(joined, rec.splits))
    return GroupedTensor(rec.splits, joined, experts=experts)


class _Cuts:
    """Expert e's payload tensors of a joined direction: the views of the joined copy's tensor
    that ``quantize_grouped`` handed out (its group from ``starts[e]``, or back to back), cut
    for every expert at once per tensor (one split, as ``assemble`` cuts them)."""

    def __init__(self, joined: dict[str, JoinedCopy], splits: list[int]) -> None:
        self.joined, self.splits = joined, splits
        self._views: dict[tuple[str, str], list[torch.Tensor]] = {}

    def __call__(self, expert: int, direction: str, name: str, axis: int, div: int) -> torch.Tensor:
        views = self._views.get((direction, name))
        if views is None:
            j = self.joined[direction]
            t = j.storage.payload(direction)[name]
            widths = [-(-m // div) for m in self.splits]
            if j.starts is None:  # back to back: one split
                views = list(torch.split(t, widths, dim=axis))
            elif axis == 0:  # rows from each group start (padding rows between)
                views = [t.narrow(0, s // div, w) for s, w in zip(j.starts, widths)]
            else:  # columns from each group start: the gaps split off too
                views = column_slices(t, [s // div for s in j.starts], widths)
            self._views[(direction, name)] = views
        return views[expert]


# ---------------------------------------------------------------------------- slots
def _save_slot(col: list[torch.Tensor], saved: list[torch.Tensor]) -> tuple[str, Any]:
    """Save one slot's tensors (one per expert) into ``saved``; returns (kind, split sizes)."""
    first = col[0]
    if all(t is first for t in col):
        saved.append(first)
        return SAME, None
    saved.extend(col)
    return OWN, len(col)


def _restore_slot(kind: str, arg: Any, it: Iterator[torch.Tensor], n: int) -> list[torch.Tensor]:
    """One slot's per-expert tensors from what ``_save_slot`` saved."""
    if kind == SAME:
        return [next(it)] * n
    if kind == ROWS:
        return list(torch.split(next(it), arg))
    return [next(it) for _ in range(arg)]


# ---------------------------------------------------------------------------- storages
def _describe(s: QuantizedStorage, flat: list[torch.Tensor], cut: frozenset = frozenset()) -> tuple:
    """A record of ``s`` without its tensors (appended to ``flat`` in ``tensors()`` order). A
    slot of a direction in ``cut`` indexed by rows is recorded as a cut (direction, name, axis,
    div) of that direction's joined copy and not appended."""
    if isinstance(s, HybridStorage):
        parts = {d: (_describe(p, flat, cut) if p is not None else None) for d, p in s.parts.items()}
        return (HybridStorage, s.shape, s.dtype, s.label, parts[ROWWISE], parts[COLUMNWISE])
    if isinstance(s, IdentityStorage):  # one data tensor for every held direction
        groups = [[(d, "data") for d in s.directions()]]
    else:
        groups = s._tensor_slots()
    payloads, cuts = s.payloads, []
    index = s._row_index if cut else None
    for g in groups:
        spec = None
        for d, n in g if cut else ():  # a plain loop: no generator frame per expert and slot
            if d in cut and index[d].get(n) is not None:
                spec = (d, n, *index[d][n])
                break
        cuts.append(spec)
        if spec is None:
            flat.append(payloads[g[0][0]][g[0][1]])
    return (type(s), s.shape, s.dtype, s.label, s.meta, groups, s.is_dim0_slice,
            s.columnwise_zero_tail, cuts)


def _build(desc: tuple, it: Iterator[torch.Tensor], cut: Optional["_Cuts"] = None, expert: int = 0
           ) -> QuantizedStorage:
    """The storage ``desc`` describes, its payload tensors taken from ``it`` (as ``with_tensors``),
    its marked slots cut out of the joined copies (``cut``, for ``expert``)."""
    if desc[0] is HybridStorage:
        _, shape, dtype, label, row, col = desc
        rows = _build(row, it, cut, expert) if row is not None else None
        cols = _build(col, it, cut, expert) if col is not None else None
        return HybridStorage(shape, dtype, rows, cols, label=label)
    cls, shape, dtype, label, meta, groups, dim0_slice, zero_tail, cuts = desc
    held = {d for g in groups for d, _ in g}
    payloads: dict[str, Optional[dict]] = {d: ({} if d in held else None) for d in DIRECTIONS}
    for g, spec in zip(groups, cuts):
        t = next(it) if spec is None else cut(expert, *spec)
        for d, name in g:
            payloads[d][name] = t
    out = cls(shape, dtype, payloads[ROWWISE], payloads[COLUMNWISE], label=label, **meta)
    out._slot_groups = groups
    out.is_dim0_slice = dim0_slice
    out.columnwise_zero_tail = zero_tail
    return out
