"""Expert copies that are consecutive blocks of one buffer, viewed as one storage (joined).

``joined_view`` / ``column_slices``: the tensor-level views (tensors that lie back to back in
one buffer as one view; column slices of one tensor in one op).

``moe.quantize.quantize_grouped`` encodes a row-local rowwise copy once for all experts
and hands out row-slice views (``joined_rows``); an MXFP8 columnwise copy (32x1 blocks) is
encoded once from the groups zero-padded to whole blocks and handed out as column-slice views
of its transposed tensors (``joined_columns``; FP8 block copies go to per-expert cuBLAS GEMMs
as contiguous copies instead). The grouped GEMM paths then
decode such a copy in one call, straight into their grouped operand, instead of decoding per
expert and concatenating.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..tensors.storage import COLUMNWISE, ROWWISE, QuantizedStorage
from .grouped_tensor import GroupedTensor, JoinedCopy


def joined_view(ts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The view joining ``ts`` by rows if each starts where the previous one ends in one
    contiguous buffer (so the view equals ``torch.cat(ts)``), else None."""
    t0 = ts[0]
    if not t0.is_contiguous():
        return None
    # one pass reading each tensor's attributes once (called per grouped GEMM operand on 64
    # experts' slices); a tensor's storage start is data_ptr - offset, not a storage object
    # made per tensor. The span must lie in t0's storage (the view is taken on it).
    dtype, inner, device, size = t0.dtype, t0.shape[1:], t0.device, t0.element_size()
    base = t0.data_ptr() - t0.storage_offset() * size
    end = t0.data_ptr() + t0.numel() * size
    for t in ts[1:]:
        if (t.data_ptr() != end or t.dtype != dtype or t.shape[1:] != inner or not t.is_contiguous()
                or t.device != device or end - t.storage_offset() * size != base):
            return None
        end += t.numel() * size
    if end > base + t0.untyped_storage().nbytes():
        return None
    size = (sum(t.shape[0] for t in ts), *t0.shape[1:])
    strides, step = [], 1  # row-major strides of ``size`` (a 1-row t0 may report any row stride)
    for d in reversed(size):
        strides.insert(0, step)
        step *= max(d, 1)
    return t0.as_strided(size, strides, t0.storage_offset())


def column_slices(t: torch.Tensor, begins: Sequence[int], widths: Sequence[int]) -> list[torch.Tensor]:
    """Columns [begin_e, begin_e + width_e) of 2D ``t`` for every e (in order, not overlapping)
    as views, from one ``split`` over the slices and the gaps between them (one op for all MoE
    experts instead of a ``narrow`` each)."""
    sizes, at = [], 0
    for b, w in zip(begins, widths):
        sizes += [b - at, w]
        at = b + w
    sizes.append(t.shape[1] - at)
    return list(torch.split(t, sizes, dim=1)[1::2])


def joined_rows(storages: Sequence[QuantizedStorage], direction: str) -> Optional[QuantizedStorage]:
    """One storage holding the experts' ``direction`` copies joined by rows, WITHOUT copying —
    when they are consecutive row blocks of one buffer (``quantize_grouped``'s shared row-local
    encodings): the rowwise copy, every payload tensor indexed by row (``_row_index`` (0, 1)),
    contiguous and joined in memory, one class and options. None otherwise."""
    found = _rowwise_parts(storages, direction)
    if found is None:
        return None
    parts, all_payloads, index = found
    first = parts[0]
    payloads = [pl for p, pl in zip(parts, all_payloads) if p.rows > 0]
    if not payloads or any(index.get(n) != (0, 1) for n in payloads[0]):
        return None
    joined: dict[str, torch.Tensor] = {}
    for name in payloads[0]:
        t = joined_view([p[name] for p in payloads])
        if t is None:
            return None
        joined[name] = t
    rows = sum(p.rows for p in parts)
    return type(first)(torch.Size((rows, first.cols)), first.dtype, joined, None, label=first.label, **first.meta)


def joined_columns(storages: Sequence[QuantizedStorage]) -> Optional[tuple[QuantizedStorage, list[int]]]:
    """One storage holding the experts' columnwise copies side by side, WITHOUT copying, and
    each expert's group start in it (logical rows from the first expert's start) — when every
    payload tensor of those copies is a column slice (``_row_index`` (1, div)) of one buffer,
    expert e's slice beginning where expert e-1's *padded* range ends (its rows rounded up to
    the largest ``div``: ``quantize_grouped``'s zero-padded groups, whose padding rows hold
    zero codes and so decode to zeros). None otherwise.

    The joined storage spans the padded ranges, so a grouped GEMM over it runs with the groups
    [start_e, start_e+1): the padding adds only zero products to expert e's FP32 sums."""
    parts = [s.part(COLUMNWISE) for s in storages]
    first = parts[0]
    if any(type(p) is not type(first) or p.meta != first.meta or p.cols != first.cols
           or not p.columnwise_zero_padded for p in parts):
        return None  # only quantize_grouped's padded groups promise zeros between the copies
    index = first._row_index[COLUMNWISE]
    payloads = [p.payload(COLUMNWISE) for p in parts]
    if any(index.get(n) is None or index[n][0] != 1 for n in payloads[0]):
        return None
    block = first.column_group_block()
    starts, row = [], 0
    for p in parts:  # the padded layout the payloads must sit in
        starts.append(row)
        row += -(-p.rows // block) * block
    joined: dict[str, torch.Tensor] = {}
    for name in payloads[0]:
        div = index[name][1]
        t = _joined_columns_view([pl[name] for pl in payloads], [s // div for s in starts], row // div)
        if t is None:
            return None
        joined[name] = t
    storage = type(first)(torch.Size((row, first.cols)), first.dtype, None, joined, label=first.label, **first.meta)
    return storage, starts


def _joined_columns_view(ts: Sequence[torch.Tensor], starts: Sequence[int], width: int) -> Optional[torch.Tensor]:
    """The [rows, width] view that holds ``ts[e]`` at column ``starts[e]`` of one buffer (same
    storage, dtype, row count and row stride, unit column stride), else None."""
    t0 = ts[0]
    if width == 0 or t0.dim() != 2 or t0.stride(1) != 1 and t0.shape[1] > 1:
        return None  # (every expert empty: nothing to join)
    stride = t0.stride(0) if t0.shape[0] > 1 else width
    for t, s in zip(ts, starts):
        if (t.dtype != t0.dtype or t.device != t0.device or t.dim() != 2 or t.shape[0] != t0.shape[0]
                or (t.shape[0] > 1 and t.stride(0) != stride) or (t.shape[1] > 1 and t.stride(1) != 1)
                or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()
                or t.storage_offset() - t0.storage_offset() != s):
            return None
    if stride < width or t0.storage_offset() % stride + width > stride:
        return None  # the view would wrap into the next row
    view = t0.as_strided((t0.shape[0], width), (stride, 1), t0.storage_offset())
    if view.storage_offset() + (view.shape[0] - 1) * stride + width > t0.untyped_storage().nbytes() // t0.element_size():
        return None
    return view


def joined_values(storages: Sequence[QuantizedStorage], direction: str) -> Optional[QuantizedStorage]:
    """One storage whose ``direction`` block decode gives the experts' values joined by rows,
    WITHOUT copying: as :func:`joined_rows`, but a payload entry that is not indexed by rows (a
    per-expert global amax or scale_inv) may differ between experts and is taken from the first,
    so the joined copy's epilogue scale is the first expert's only (callers take each expert's
    from ``epilogue_scale``); row-indexed entries may be blocked (``(0, div)``, every expert a
    whole number of blocks). For the experts' joined weights with per-expert global scales
    (NVFP4), which ``joined_rows`` refuses. None otherwise."""
    found = _rowwise_parts(storages, direction)
    if found is None:
        return None
    parts, payloads, index = found
    if any(p.rows == 0 for p in parts):
        return None
    joined: dict[str, torch.Tensor] = {}
    for name, spec in ((n, index.get(n)) for n in payloads[0]):
        if spec is None:  # per tensor: the first expert's (its scale is not the others')
            joined[name] = payloads[0][name]
            continue
        axis, div = spec
        if axis != 0 or any(p.rows % div for p in parts):
            return None
        t = joined_view([pl[name] for pl in payloads])
        if t is None:
            return None
        joined[name] = t
    first, rows = parts[0], sum(p.rows for p in parts)
    return type(first)(torch.Size((rows, first.cols)), first.dtype, joined, None, label=first.label, **first.meta)


def _rowwise_parts(storages: Sequence[QuantizedStorage], direction: str):
    """(the experts' single-format parts, their ``direction`` payloads, the row index) when
    ``direction`` is rowwise and the parts share class, options, width and payload names;
    else None."""
    if direction != ROWWISE:
        return None
    parts = [s.part(direction) for s in storages]
    first = parts[0]
    if any(type(p) is not type(first) or p.meta != first.meta or p.cols != first.cols for p in parts):
        return None
    payloads = [p.payload(direction) for p in parts]
    if any(set(pl) != set(payloads[0]) for pl in payloads):
        return None
    return parts, payloads, first._row_index[direction]


def joined_row_span(storages: Sequence[QuantizedStorage], direction: str
                 ) -> Optional[tuple[QuantizedStorage, list[int]]]:
    """One storage spanning the experts' ``direction`` copies and each expert's first row in it,
    WITHOUT copying, when every copy is a row block of one buffer, in order, with gaps allowed
    between them (a rowwise copy of zero-padded groups read at the groups' padded starts:
    ``quantize_grouped``'s one hybrid pass) and every payload entry indexed by single rows
    (``(0, 1)``: per-row scales included, no per-tensor entry). The rows in the gaps are other
    rows of the same encoding; callers keep only each expert's own. None otherwise."""
    found = _rowwise_parts(storages, direction)
    if found is None:
        return None
    parts, payloads, index = found
    first = parts[0]
    if any(index.get(n) != (0, 1) for n in payloads[0]):
        return None
    starts: Optional[list[int]] = None
    joined: dict[str, torch.Tensor] = {}
    for name in payloads[0]:
        found = _row_span([pl[name] for pl in payloads])
        if found is None or (starts is not None and found[1] != starts):
            return None
        joined[name], starts = found
    rows = joined[next(iter(joined))].shape[0]
    storage = type(first)(torch.Size((rows, first.cols)), first.dtype, joined, None, label=first.label, **first.meta)
    return storage, starts


def _row_span(ts: Sequence[torch.Tensor]) -> Optional[tuple[torch.Tensor, list[int]]]:
    """The view from the first tensor's first row to the last one's last row of one buffer
    (same storage, dtype and trailing shape, contiguous rows, one row stride, starts in order
    without overlap) and each tensor's first row in it; else None."""
    t0 = ts[0]
    inner = t0.shape[1:]
    width = 1
    for d in inner:
        width *= d
    if not all(t.is_contiguous() for t in ts) or width == 0:
        return None
    base, off0 = t0.untyped_storage().data_ptr(), t0.storage_offset()
    starts, end = [], 0
    for t in ts:
        if (t.dtype != t0.dtype or t.shape[1:] != inner or t.untyped_storage().data_ptr() != base
                or (t.storage_offset() - off0) % width):
            return None
        start = (t.storage_offset() - off0) // width
        if start < end:
            return None
        starts.append(start)
        end = start + t.shape[0]
    if off0 + end * width > t0.untyped_storage().nbytes() // t0.element_size():
        return None
    strides = [width] + list(t0.stride()[1:]) if t0.dim() > 1 else [1]
    return t0.as_strided((end, *inner), strides, off0), starts


# ---------------------------------------------------------------------------- a GroupedTensor's joined copies
def joined_of(ts: Sequence, direction: str) -> Optional[JoinedCopy]:
    """``ts``'s joined ``direction`` copy when ``ts`` is a ``GroupedTensor`` holding one (its
    producer states it); None for a list (separately quantized experts are never joined)."""
    return ts.joined(direction) if isinstance(ts, GroupedTensor) else None


def joined_row_storage(j: Optional[JoinedCopy], direction: str, splits: Sequence[int],
                       single_rows: bool = True) -> Optional[QuantizedStorage]:
    """``j``'s storage when it holds the experts' rowwise copies back to back (no padding between
    the groups; no per-expert ``scales``), with every payload tensor contiguous and indexed by
    rows: by single rows (``single_rows``: per-row scales included) or by blocks of rows that
    every expert fills whole (the experts' joined weights). None otherwise."""
    if j is None or direction != ROWWISE or j.scales is not None or not _unpadded(j, splits):
        return None
    s = j.storage.part(ROWWISE)
    index = s._row_index[ROWWISE]
    if s.rows == 0:
        return None
    for name, t in s.payload(ROWWISE).items():
        spec = index.get(name)
        if spec is None or spec[0] != 0 or not t.is_contiguous():
            return None
        if spec[1] != 1 and (single_rows or any(m % spec[1] for m in splits)):
            return None
    return s


def padded_row_span(j: Optional[JoinedCopy], direction: str) -> Optional[tuple[QuantizedStorage, list[int]]]:
    """(``j``'s storage, each expert's first row in it) when it holds the experts' rowwise
    copies at padded group starts (a rowwise copy of the zero-padded groups; the rows between
    the groups are padding rows the callers skip), every payload tensor contiguous and indexed
    by single rows. None otherwise."""
    if j is None or direction != ROWWISE or j.scales is not None or j.starts is None:
        return None
    s = j.storage.part(ROWWISE)
    index = s._row_index[ROWWISE]
    if any(index.get(n) != (0, 1) or not t.is_contiguous() for n, t in s.payload(ROWWISE).items()):
        return None
    return s, list(j.starts)


def joined_column_storage(j: Optional[JoinedCopy], direction: str) -> Optional[tuple[QuantizedStorage, list[int]]]:
    """(``j``'s storage, each expert's group start in it) when it holds the experts' columnwise
    copies of the zero-padded groups side by side (every payload tensor indexed by columns; no
    per-expert ``scales``). None otherwise (a BF16 Identity copy: the rows, read transposed)."""
    if j is None or direction != COLUMNWISE or j.scales is not None or j.starts is None:
        return None
    s = j.storage.part(COLUMNWISE)
    index = s._row_index[COLUMNWISE]
    if s.rows == 0 or any(index.get(n) is None or index[n][0] != 1 for n in s.payload(COLUMNWISE)):
        return None
    return s, list(j.starts)


def _unpadded(j: JoinedCopy, splits: Sequence[int]) -> bool:
    """Whether ``j``'s groups lie back to back: no starts, or starts at the splits' prefix sums."""
    if j.starts is None:
        return True
    at = 0
    for s, m in zip(j.starts, splits):
        if s != at:
            return False
        at += m
    return j.storage.rows == at
