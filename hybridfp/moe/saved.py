"""What a ``GroupedLinear`` step saves for backward: the experts' tensors in few plain tensors.

Every expert saves what its wgrad / dgrad read (x's columnwise copy or x itself, W's copies),
as ``linear_function.pack`` does for one ``Linear``: plain payload tensors, so saved-tensor
hooks (CPU offload, recompute) see ordinary tensors. With 64 experts, packing each expert
separately would be 128 packs and unpacks and a few hundred saved tensors a step, all host
work. Most of those tensors are
views of a few shared buffers (``quantize_grouped``'s shared encodings, the rows of x, the
joined weights' encodings), so the experts' tensors are saved per *slot* (the j-th payload
tensor of every expert) as one tensor where their layout allows:

- ``SAME``: every expert holds the same tensor (saved once);
- ``ROWS``: consecutive row blocks of one buffer (saved as the joined view, re-split by rows);
- ``COLUMNS``: column slices of one buffer in order (saved as the view spanning them, gaps
  included, re-split by columns: the grouped GEMM's ``joined_columns`` finds them joined
  again, also after an offload round trip);
- ``OWN``: anything else, one saved tensor per expert (as before).

Each expert's storage is described by a small record (class, shape, options, payload slots)
instead of a skeleton storage object, and rebuilt once in backward. Experts held as an
``GroupedTensor`` (every expert views of a few joined copies) are saved as those copies'
tensors and handed back as a ``GroupedTensor`` again: no per-expert record at all. The rebuilt tensors are
views of the same memory as the forward's, with the same shapes, strides and options, so the
backward GEMMs compute bitwise what they computed on the forward's objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ..tensors import HybridStorage, IdentityStorage, QuantizedStorage, QuantizedTensor
from .grouped_tensor import Cutter, GroupedTensor, JoinedCopy
from .joined import joined_view
from ..tensors.storage import COLUMNWISE, DIRECTIONS, ROWWISE

SAME, ROWS, COLUMNS, OWN = "same", "rows", "columns", "own"


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
    cut: Cutter
    skeletons: list[tuple[QuantizedStorage, int]]
    directions: dict[str, tuple[int, Optional[list[int]]]]
    #: per direction, the index among the saved tensors of its per-expert ``scales`` (if any)
    scales: Optional[dict[str, int]] = None


def save_experts(ts: Sequence[Optional[torch.Tensor]]
                 ) -> tuple[list[torch.Tensor], "SavedExperts | SavedJoined"]:
    """The plain tensors to save for the experts' ``ts`` (None, plain or quantized tensors, or
    a ``GroupedTensor``) and the record that ``restore_experts`` rebuilds them from."""
    if isinstance(ts, GroupedTensor) and ts.joined_only:
        return _save_joined(ts)
    flats: list[list[torch.Tensor]] = []
    items: list[Optional[tuple]] = []
    for t in ts:
        if t is None:
            items.append(None)
            continue
        if isinstance(t, QuantizedTensor):
            flat: list[torch.Tensor] = []
            items.append(("q", _describe(t.qstorage, flat), t.quantizer))
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
    it = iter(tensors)
    n = sum(item is not None for item in rec.items)
    columns = None if rec.slots is None else [_restore_slot(kind, arg, it, n) for kind, arg in rec.slots]
    out: list[Optional[torch.Tensor]] = []
    e = 0
    for item in rec.items:
        if item is None:
            out.append(None)
            continue
        # this expert's tensors: its entry of every slot, or the next ones in order
        mine = iter([c[e] for c in columns]) if columns is not None else it
        e += 1
        out.append(next(mine) if item[0] == "t" else QuantizedTensor(_build(item[1], mine), item[2]))
    return out


def _save_joined(ts: GroupedTensor) -> tuple[list[torch.Tensor], SavedJoined]:
    """The joined copies' payload tensors (a storage shared by both directions once) and skeletons."""
    saved: list[torch.Tensor] = []
    skeletons: list[tuple[QuantizedStorage, int]] = []
    index: dict[int, int] = {}
    directions: dict[str, tuple[int, Optional[list[int]]]] = {}
    for d in ts.directions():
        j = ts.joined(d)
        if id(j.storage) not in index:
            flat, skeleton = j.storage.split_tensors()
            index[id(j.storage)] = len(skeletons)
            skeletons.append((skeleton, len(flat)))
            saved.extend(flat)
        directions[d] = (index[id(j.storage)], j.starts)
    # per-expert scales (FP8 current scaling) after the storages' tensors, one per direction
    scales = {}
    for d in ts.directions():
        if ts.joined(d).scales is not None:
            scales[d] = len(saved)
            saved.append(ts.joined(d).scales)
    return saved, SavedJoined(ts.splits, ts.cutter, skeletons, directions, scales or None)


def _restore_joined(rec: SavedJoined, tensors: Sequence[torch.Tensor]) -> GroupedTensor:
    it = iter(tensors)
    storages = [skeleton.with_tensors([next(it) for _ in range(n)]) for skeleton, n in rec.skeletons]
    scales = rec.scales or {}
    joined = {d: JoinedCopy(storages[i], starts, tensors[scales[d]] if d in scales else None)
              for d, (i, starts) in rec.directions.items()}
    return GroupedTensor(rec.splits, joined, rec.cut)


# ---------------------------------------------------------------------------- slots
def _save_slot(col: list[torch.Tensor], saved: list[torch.Tensor]) -> tuple[str, Any]:
    """Save one slot's tensors (one per expert) into ``saved``; returns (kind, split sizes)."""
    first = col[0]
    if all(t is first for t in col):
        saved.append(first)
        return SAME, None
    held = [t for t in col if t.numel()]  # an empty tensor's data_ptr() is 0, not its place
    if first.dim() >= 1 and held and all(t.shape[1:] == first.shape[1:] for t in col):
        joined = joined_view(held)
        if joined is not None:
            saved.append(joined)
            return ROWS, [t.shape[0] for t in col]
    span = _column_span(col)
    if span is not None:
        saved.append(span[0])
        return COLUMNS, span[1]
    saved.extend(col)
    return OWN, len(col)


def _restore_slot(kind: str, arg: Any, it: Iterator[torch.Tensor], n: int) -> list[torch.Tensor]:
    """One slot's per-expert tensors from what ``_save_slot`` saved."""
    if kind == SAME:
        return [next(it)] * n
    if kind == ROWS:
        return list(torch.split(next(it), arg))
    if kind == COLUMNS:  # sizes alternate gap, slice, gap, ..., slice
        return list(torch.split(next(it), arg, dim=1)[1::2])
    return [next(it) for _ in range(arg)]


def _column_span(col: list[torch.Tensor]) -> Optional[tuple[torch.Tensor, list[int]]]:
    """The [R, W] view spanning column slices ``col`` of one 2-D buffer (in order, not
    overlapping, one row count R > 1 and row stride, unit column stride) and the split sizes
    (gap before each slice, its width) that give them back; else None."""
    t0 = col[0]
    if t0.dim() != 2 or t0.shape[0] < 2:
        return None
    rows, stride, base = t0.shape[0], t0.stride(0), t0.untyped_storage().data_ptr()
    sizes, at = [], t0.storage_offset()
    for t in col:
        if (t.dim() != 2 or t.shape[0] != rows or t.stride(0) != stride or t.dtype != t0.dtype
                or (t.shape[1] > 1 and t.stride(1) != 1) or t.untyped_storage().data_ptr() != base
                or t.storage_offset() < at):
            return None
        sizes += [t.storage_offset() - at, t.shape[1]]
        at = t.storage_offset() + t.shape[1]
    width = at - t0.storage_offset()
    if width > stride or t0.storage_offset() % stride + width > stride:
        return None  # the span would wrap into the next row
    span = t0.as_strided((rows, width), (stride, 1), t0.storage_offset())
    return span, sizes


# ---------------------------------------------------------------------------- storages
def _describe(s: QuantizedStorage, flat: list[torch.Tensor]) -> tuple:
    """A record of ``s`` without its tensors (appended to ``flat`` in ``tensors()`` order)."""
    if isinstance(s, HybridStorage):
        parts = {d: (_describe(p, flat) if p is not None else None) for d, p in s.parts.items()}
        return (HybridStorage, s.shape, s.dtype, s.label, parts[ROWWISE], parts[COLUMNWISE])
    if isinstance(s, IdentityStorage):  # one data tensor for every held direction
        groups = [[(d, "data") for d in s.directions()]]
    else:
        groups = s._tensor_slots()
    payloads = s.payloads
    flat.extend(payloads[g[0][0]][g[0][1]] for g in groups)
    return (type(s), s.shape, s.dtype, s.label, s.meta, groups, s.is_dim0_slice,
            s.columnwise_zero_padded, s.columnwise_zero_tail)


def _build(desc: tuple, it: Iterator[torch.Tensor]) -> QuantizedStorage:
    """The storage ``desc`` describes, its payload tensors taken from ``it`` (as ``with_tensors``)."""
    if desc[0] is HybridStorage:
        _, shape, dtype, label, row, col = desc
        rows = _build(row, it) if row is not None else None
        cols = _build(col, it) if col is not None else None
        return HybridStorage(shape, dtype, rows, cols, label=label)
    cls, shape, dtype, label, meta, groups, dim0_slice, zero_padded, zero_tail = desc
    held = {d for g in groups for d, _ in g}
    payloads: dict[str, Optional[dict]] = {d: ({} if d in held else None) for d in DIRECTIONS}
    for g in groups:
        t = next(it)
        for d, name in g:
            payloads[d][name] = t
    out = cls(shape, dtype, payloads[ROWWISE], payloads[COLUMNWISE], label=label, **meta)
    out._slot_groups = groups
    out.is_dim0_slice = dim0_slice
    out.columnwise_zero_padded, out.columnwise_zero_tail = zero_padded, zero_tail
    return out
