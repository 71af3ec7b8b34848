"""``quantize_grouped``: quantize the row groups of one tensor (an MoE layer's experts), each
with its own quantizer, in as few calls as the formats allow.

Expert e owns rows ``[o_e, o_e + m_e)`` of ``x`` and quantizes them with ``quantizers[e]``
(usage flags as set on it). The result is, bit for bit, what ``quantizers[e].quantize(x_e)``
gives, but a copy whose scaling is *row-local* — every row's codes and scales depend on that
row alone: blocks along the row, no per-tensor scale, no random draws — is encoded once for
all experts and handed to each expert as row-slice views (no copy). Row-local rowwise copies
(``ROW_LOCAL``): Identity, MXFP8 1x32, FP8 block 1x128, row-scaled NVFP4; for a hybrid, its
rowwise child's. Columnwise copies (blocks run along the rows, across what would be expert
boundaries) and per-tensor-scaled formats (FP8 per-tensor, NVFP4 with a global amax: each
expert's own amax) are encoded per expert, exactly as before; a hybrid with
``columnwise_source="rowwise_dequantized"`` dequantizes the shared rowwise copy once.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..formats.common import check_input
from ..tensors import HybridStorage, QuantizedStorage, QuantizedTensor
from ..tensors.storage import COLUMNWISE, ROWWISE
from .base import Quantizer
from .float8_block import Float8BlockQuantizer
from .hybrid import HybridQuantizer
from .identity import IdentityQuantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer

#: How a quantizer's rowwise copy relates to its rows: ``SEPARATE`` — row-local, and the
#: columnwise copy is a separate encoding; ``SHARED`` — row-local, and both copies are the same
#: payload (Identity); None — not row-local (per-tensor or 2D scales).
SEPARATE, SHARED = "separate", "shared"
ROW_LOCAL: dict[type, Callable[[Quantizer], Optional[str]]] = {
    IdentityQuantizer: lambda q: SHARED,
    MXFP8Quantizer: lambda q: None if q.with_2d_quantization else SEPARATE,
    Float8BlockQuantizer: lambda q: SEPARATE if q.block_scaling_dim == 1 else None,
    # row scaling excludes RHT, 2D and stochastic rounding (the quantizer refuses them)
    NVFP4Quantizer: lambda q: SEPARATE if q.row_scaled_nvfp4 else None,
}


def row_local_mode(q: Quantizer) -> Optional[str]:
    """``SEPARATE`` / ``SHARED`` if ``q``'s rowwise copy is row-local (see ``ROW_LOCAL``), else None."""
    if q.uses_randomness():  # random draws are laid out per tensor, not per row
        return None
    rule = ROW_LOCAL.get(type(q))
    return None if rule is None else rule(q)


def quantize_grouped(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor,
                     splits: Sequence[int]) -> list[Optional[QuantizedTensor]]:
    """``[quantizers[e].quantize(x_e) for each row group x_e of x]``, bitwise, with shared
    row-local rowwise encodings (module docstring). ``quantizers[e] is None``: expert e needs no
    copy (its entry is None). ``x``: [Σ splits, K] high-precision, no autograd (call it inside an
    autograd.Function or under no_grad)."""
    if len(quantizers) != len(splits):
        raise ValueError(f"quantize_grouped: {len(quantizers)} quantizers for {len(splits)} row groups; "
                         "pass one (or None) per expert.")
    if x.dim() != 2 or x.shape[0] != sum(splits):
        raise ValueError(f"quantize_grouped: x must be [{sum(splits)}, K] (the row groups stacked); "
                         f"got {tuple(x.shape)}.")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("quantize_grouped does not record autograd; call it with grad disabled "
                         "(inside an autograd.Function) or on x.detach().")
    used = [q for q in quantizers if q is not None]
    row_q = _shared_rowwise_quantizer(used)
    if row_q is None:
        return [None if q is None else q.quantize(xe) for q, xe in zip(quantizers, torch.split(x, list(splits)))]
    for q in used:
        if not (q.rowwise_usage or q.columnwise_usage):
            raise ValueError(f"{q!r} has rowwise_usage=False and columnwise_usage=False: "
                             "enable at least one with set_usage().")
    check_input(x, f"input of {used[0]!r}" + (f" (role: {used[0].label})" if used[0].label else ""))
    return _quantize_shared_rows(quantizers, row_q, x, splits)


def _rowwise_child(q: Quantizer) -> Quantizer:
    return q.rowwise_quantizer if isinstance(q, HybridQuantizer) else q


def _shared_rowwise_quantizer(used: Sequence[Quantizer]) -> Optional[Quantizer]:
    """The quantizer that can encode every expert's rowwise copy in one call (expert 0's
    rowwise quantizer), or None when the experts' rowwise copies are not all row-local with
    the same settings (then each expert quantizes on its own)."""
    if not used or any(q.uses_randomness() for q in used):
        return None
    if any("quantize" in vars(q) for q in used):
        return None  # quantize() wrapped on the instance (hooks, spies): it must see every call
    if not any(q.rowwise_usage or _derives_columnwise(q) for q in used):
        return None  # nobody reads the rows: a shared encoding would be wasted work
    kinds = {(type(q), getattr(q, "columnwise_source", None)) for q in used}
    rows = [_rowwise_child(q) for q in used]
    first = rows[0]
    if len(kinds) > 1 or row_local_mode(first) is None:
        return None
    if any(type(r) is not type(first) or r.settings() != first.settings() for r in rows):
        return None
    return first


def _quantize_shared_rows(quantizers: Sequence[Optional[Quantizer]], row_q: Quantizer, x: torch.Tensor,
                          splits: Sequence[int]) -> list[Optional[QuantizedTensor]]:
    """One rowwise encoding of x for all experts, sliced by rows; columnwise copies per expert."""
    rows = row_q.encode(x, True, False, None)
    derived: Optional[torch.Tensor] = None  # rowwise_dequantized sources, all experts at once
    out: list[Optional[QuantizedTensor]] = []
    start = 0
    for q, m in zip(quantizers, splits):
        stop = start + m
        if q is not None and _derives_columnwise(q) and derived is None:
            # the forward's value exactly, in FP32 (as HybridQuantizer.reference_encode)
            derived = rows.dequantize(torch.float32, ROWWISE)
        out.append(None if q is None else
                   QuantizedTensor(_expert_storage(q, rows, x, derived, start, stop), q))
        start = stop
    return out


def _derives_columnwise(q: Quantizer) -> bool:
    return (isinstance(q, HybridQuantizer) and q.columnwise_usage
            and q.columnwise_source == "rowwise_dequantized")


def _expert_storage(q: Quantizer, rows: QuantizedStorage, x: torch.Tensor, derived: Optional[torch.Tensor],
                    start: int, stop: int) -> QuantizedStorage:
    """Expert storage: rows [start, stop) of the shared rowwise encoding (if q asks for the
    rowwise copy) and its own columnwise copy (if asked), as ``q.encode(x_e, ...)`` builds it.
    ``derived``: the shared encoding dequantized (rowwise_dequantized hybrids)."""
    shape = torch.Size((stop - start, x.shape[1]))
    row_part = _row_slice(rows, start, stop, _rowwise_child(q).label) if q.rowwise_usage else None
    if isinstance(q, HybridQuantizer):
        col_part = None
        if q.columnwise_usage:
            src = derived[start:stop] if _derives_columnwise(q) else x[start:stop]
            col_part = q.columnwise_quantizer.encode(src, False, True, None)
        elif q.columnwise_source == "original":
            q.columnwise_quantizer.observe(x[start:stop])  # as the hybrid does for its idle child
        if row_part is None and not _derives_columnwise(q):  # a derived copy made a transient rowwise one
            q.rowwise_quantizer.observe(x[start:stop])
        return HybridStorage(shape, x.dtype, row_part, col_part, label=q.label)
    if row_local_mode(q) == SHARED:  # one payload serves both copies
        part = row_part if row_part is not None else _row_slice(rows, start, stop, q.label)
        p = part.payloads[ROWWISE]
        return _rebuild(part, p if q.rowwise_usage else None, p if q.columnwise_usage else None, q.label)
    col = q.encode(x[start:stop], False, True, None).payloads[COLUMNWISE] if q.columnwise_usage else None
    row = row_part.payloads[ROWWISE] if row_part is not None else None
    return _rebuild(rows, row, col, q.label, shape)


def _row_slice(rows: QuantizedStorage, start: int, stop: int, label: str) -> QuantizedStorage:
    """Rows [start, stop) of the shared rowwise encoding as a storage of their own."""
    part = rows.slice_dim0(start, stop)
    return _rebuild(part, part.payloads[ROWWISE], None, label)


def _rebuild(like: QuantizedStorage, row, col, label: str, shape: Optional[torch.Size] = None) -> QuantizedStorage:
    """A storage of ``like``'s class, dtype and options (and shape, unless given) with these
    payloads: an expert's own storage, not marked as a slice (row-local formats hold no
    per-tensor entries that a slice would share)."""
    return type(like)(like.shape if shape is None else shape, like.dtype, row, col, label=label, **like.meta)
