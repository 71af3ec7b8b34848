"""Expert copies that are consecutive row blocks of one buffer, viewed as one storage.

``quantizers.grouped.quantize_grouped`` encodes a row-local rowwise copy once for all experts
and hands out row-slice views; the grouped GEMM paths then decode that copy in one call,
straight into their grouped operand, instead of decoding per expert and concatenating.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..tensors.storage import ROWWISE, QuantizedStorage


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
        t = _adjacent_rows([p[name] for p in payloads])
        if t is None:
            return None
        joined[name] = t
    rows = sum(p.rows for p in parts)
    return type(first)(torch.Size((rows, first.cols)), first.dtype, joined, None, label=first.label, **first.meta)


def _adjacent_rows(ts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The view covering ``ts`` stacked by rows if each starts where the previous one ends in
    one contiguous buffer (so the view equals ``torch.cat(ts)``), else None."""
    t0 = ts[0]
    for prev, t in zip(ts, ts[1:]):
        if (not (prev.is_contiguous() and t.is_contiguous()) or t.dtype != t0.dtype
                or t.shape[1:] != t0.shape[1:] or t.device != t0.device
                or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()
                or t.data_ptr() != prev.data_ptr() + prev.numel() * prev.element_size()):
            return None
    if not t0.is_contiguous():
        return None
    size = (sum(t.shape[0] for t in ts), *t0.shape[1:])
    strides, step = [], 1  # row-major strides of ``size`` (a 1-row t0 may report any row stride)
    for d in reversed(size):
        strides.insert(0, step)
        step *= max(d, 1)
    return t0.as_strided(size, strides, t0.storage_offset())
