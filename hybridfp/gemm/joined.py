"""Expert copies that are consecutive blocks of one buffer, viewed as one storage.

``quantizers.grouped.quantize_grouped`` encodes a row-local rowwise copy once for all experts
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

from ..tensors.slicing import adjacent_rows
from ..tensors.storage import COLUMNWISE, ROWWISE, QuantizedStorage


def joined_rows(storages: Sequence[QuantizedStorage], direction: str) -> Optional[QuantizedStorage]:
    """One storage holding the experts' ``direction`` copies stacked by rows, WITHOUT copying —
    when they are consecutive row blocks of one buffer (``quantize_grouped``'s shared row-local
    encodings): the rowwise copy, every payload tensor indexed by row (``_row_index`` (0, 1)),
    contiguous and adjacent in memory, one class and options. None otherwise."""
    if direction != ROWWISE:
        return None
    parts = [s.part(direction) for s in storages]
    first = parts[0]
    if any(type(p) is not type(first) or p.meta != first.meta or p.cols != first.cols for p in parts):
        return None
    index = first._row_index[direction]
    payloads = [p.payload(direction) for p in parts if p.rows > 0]
    if not payloads or any(index.get(n) != (0, 1) for n in payloads[0]):
        return None
    joined: dict[str, torch.Tensor] = {}
    for name in payloads[0]:
        t = adjacent_rows([p[name] for p in payloads])
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
    block = max(index[n][1] for n in payloads[0])
    starts, row = [], 0
    for p in parts:  # the padded layout the payloads must sit in
        starts.append(row)
        row += -(-p.rows // block) * block
    joined: dict[str, torch.Tensor] = {}
    for name in payloads[0]:
        div = index[name][1]
        t = _adjacent_columns([pl[name] for pl in payloads], [s // div for s in starts], row // div)
        if t is None:
            return None
        joined[name] = t
    storage = type(first)(torch.Size((row, first.cols)), first.dtype, None, joined, label=first.label, **first.meta)
    return storage, starts


def _adjacent_columns(ts: Sequence[torch.Tensor], starts: Sequence[int], width: int) -> Optional[torch.Tensor]:
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
