"""``quantize_grouped``: quantize the row groups of one tensor (an MoE layer's experts), each
with its own quantizer, in as few calls as the formats allow.

Expert e owns rows ``[o_e, o_e + m_e)`` of ``x`` and quantizes them with ``quantizers[e]``
(usage flags as set on it). The result is, bit for bit, what ``quantizers[e].quantize(x_e)``
gives, but a copy whose blocks never need to straddle two experts is encoded once for all
experts and handed out per expert as views. ``plan.py`` decides once per set of quantizers
what is shared and which encoding pass writes it (``Plan.strategy``); ``RUNNERS`` below runs
that pass; ``assemble.py`` builds the experts' tensors from its encodings (row slices of the
rowwise tensors; column slices of the transposed MXFP8 columnwise ones, ``COLUMN_VIEWS``; FP8
block columnwise copies as each expert's own contiguous copy, for its per-expert cuBLAS GEMMs).

A hybrid with ``columnwise_source="rowwise_dequantized"`` derives its columnwise source from
the rowwise copies (dequantized once when they are shared). Columnwise block copies are encoded
from the groups zero-padded to whole blocks (``pad_row_groups``, ``encode_padded_columns``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..config import current_policy
from ..formats.common import ceil_div, check_input
from ..utils.device import device_tensor, step_metadata
from ..tensors import QuantizedStorage
from ..tensors.storage import COLUMNWISE, ROWWISE
from ..quantizers import fast
from ..quantizers.backends import row_mapped_kernel
from ..quantizers.base import Quantizer
from .assemble import GroupedResult, assemble, assemble_scaled, rebuild, scaled_hybrid_group, scaled_joined
from .grouped_tensor import JoinedCopy
from .plan import (BY_DIRECTION, HYBRID_PASS, ONE_ENCODE, PADDED_ENCODE, SCALED, SCALED_HYBRID, Plan, PlanMemo,
                   derives_columnwise, plan_for, rowwise_child)
from .quantize_scaled import _offsets, encode_group_scaled, fused_nvfp4_mxfp8_supported, nvfp4_mxfp8_groups


def quantize_grouped(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor,
                     splits: Sequence[int], plans: Optional[PlanMemo] = None) -> GroupedResult:
    """``[quantizers[e].quantize(x_e) for each row group x_e of x]``, bitwise, with shared
    encodings where the formats allow (module docstring). ``quantizers[e] is None``: expert e
    needs no copy (its entry is None). ``x``: [Σ splits, K] high-precision, no autograd (call it
    inside an autograd.Function or under no_grad).

    Where a copy is shared, the result is a ``GroupedTensor``: a sequence of the same per-expert
    tensors that also hands the shared encodings (its joined copies) to the grouped GEMM and the
    saved-for-backward record (``moe/grouped_tensor.py``); where every expert's tensor is only
    views of them (plain quantizers of one usage, every copy shared: Identity, MXFP8), the
    per-expert tensors are built on first access. Experts each quantized on their own (no
    plan, nothing shared) come back as a list."""
    splits = [int(m) for m in splits]
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
    plan = plan_for(quantizers, splits, plans)
    if plan is None:
        return [None if q is None else q.quantize(xe) for q, xe in zip(quantizers, torch.split(x, splits))]
    for q in used:
        if not (q.rowwise_usage or q.columnwise_usage):
            raise ValueError(f"{q!r} has rowwise_usage=False and columnwise_usage=False: "
                             "enable at least one with set_usage().")
    check_input(x, f"input of {used[0]!r}" + (f" (role: {used[0].label})" if used[0].label else ""))
    return RUNNERS[plan.strategy](quantizers, plan, x, splits)


# ---------------------------------------------------------------------------- the encoding passes
def _run_scaled(quantizers: Sequence[Optional[Quantizer]], plan: Plan, x: torch.Tensor,
                splits: Sequence[int]) -> GroupedResult:
    """``SCALED``: every copy of plain quantizers from one grouped per-tensor-scaled encoding."""
    return assemble_scaled(quantizers, x, splits, plan.row_q)


def _run_hybrid_pass(quantizers: Sequence[Optional[Quantizer]], plan: Plan, x: torch.Tensor,
                     splits: Sequence[int]) -> GroupedResult:
    """``HYBRID_PASS``: one hybrid encode of the zero-padded groups: its rowwise copy (row-local:
    the padding rows change no other row) read at the groups' padded starts, and the columnwise
    copy derived from it in the same kernel pass (the fused hybrid kernel on CUDA), instead of a
    dequantized FP32 copy of the rows written and read back."""
    hybrid = next(q for q in quantizers if q is not None)
    padded, col_starts = pad_row_groups(x, splits, plan.col_block)
    both = hybrid.encode(padded, True, True, None)
    return assemble(quantizers, x, splits, both.part(ROWWISE), both.part(COLUMNWISE), col_starts, [],
                    row_starts=col_starts)


def _run_one_encode(quantizers: Sequence[Optional[Quantizer]], plan: Plan, x: torch.Tensor,
                    splits: Sequence[int]) -> GroupedResult:
    """``ONE_ENCODE``: no padding (e.g. joined weights): one call writes both copies (one
    kernel pass)."""
    both = plan.row_q.encode(x, True, True, None)
    return assemble(quantizers, x, splits, both, both, _offsets(splits, 1), [])


def _run_scaled_hybrid(quantizers: Sequence[Optional[Quantizer]], plan: Plan, x: torch.Tensor,
                       splits: Sequence[int]) -> GroupedResult:
    """``SCALED_HYBRID``: NVFP4 (per-expert global amax) -> MXFP8 from the rowwise value: one
    fused kernel pass over the zero-padded groups writes both copies (no FP32 dequantized copy
    in memory); ``BY_DIRECTION`` where the device has no such kernel."""
    hybrid = next(q for q in quantizers if q is not None)
    if not fused_nvfp4_mxfp8_supported(hybrid, x):
        return _run_by_direction(quantizers, plan, x, splits)
    padded, col_starts = pad_row_groups(x, splits, plan.col_block)
    hg = nvfp4_mxfp8_groups(hybrid, padded, splits, col_starts)
    group = scaled_hybrid_group(quantizers, splits, hg, col_starts, x.dtype)
    if group is not None:
        return group
    own_rows = [rebuild(p, p.payloads[ROWWISE], None, rowwise_child(q).label, m) if q is not None else None
                for q, p, m in zip(quantizers, hg.rows(), splits)]
    return assemble(quantizers, x, splits, None, hg.cols, col_starts, own_rows,
                    own_joined=JoinedCopy(hg.whole_rows, list(col_starts)))


def _run_padded_encode(quantizers: Sequence[Optional[Quantizer]], plan: Plan, x: torch.Tensor,
                       splits: Sequence[int]) -> GroupedResult:
    """``PADDED_ENCODE``: one encode of x writes its rowwise copy and the padded groups'
    columnwise copy (a row-mapped kernel) where one fits."""
    rows, cols, col_starts = encode_padded_columns(plan.row_q, x, splits, plan.col_block, rowwise=True)
    return assemble(quantizers, x, splits, rows, cols, col_starts, [None] * len(splits))


def _run_by_direction(quantizers: Sequence[Optional[Quantizer]], plan: Plan, x: torch.Tensor,
                      splits: Sequence[int]) -> GroupedResult:
    """``BY_DIRECTION``: the rowwise copies (``_rowwise_copies``), then the columnwise copy
    of the padded groups from x or, derived, from the rowwise value."""
    rows, own_rows, scaled_rows, own_joined = _rowwise_copies(quantizers, plan, x, splits)
    cols, col_starts = None, None
    if plan.col_q is not None:
        if plan.derives_any:
            # the forward's value exactly, in FP32 (as HybridQuantizer.reference_encode)
            src = (rows.dequantize(torch.float32, ROWWISE) if rows is not None else scaled_rows
                   if scaled_rows is not None else
                   torch.cat([r.dequantize(torch.float32, ROWWISE) for r in own_rows]))
        else:
            src = x
        _, cols, col_starts = encode_padded_columns(plan.col_q, src, splits, plan.col_block)
    return assemble(quantizers, x, splits, rows, cols, col_starts, own_rows, own_joined=own_joined)


def _rowwise_copies(quantizers: Sequence[Optional[Quantizer]], plan: Plan, x: torch.Tensor, splits: Sequence[int]
                    ) -> tuple[Optional[QuantizedStorage], list[Optional[QuantizedStorage]], Optional[torch.Tensor],
                               Optional[JoinedCopy]]:
    """(the shared rowwise encoding or None, the experts' own rowwise storages where not shared,
    the rows' FP32 value of a per-expert-scaled encoding when a columnwise copy derives from it,
    the joined copy the own rowwise storages are views of when one encoding wrote them all)."""
    rows = plan.row_q.encode(x, True, False, None) if plan.row_q is not None and not plan.scaled else None
    own_rows: list[Optional[QuantizedStorage]] = [None] * len(splits)
    scaled_rows: Optional[torch.Tensor] = None
    own_joined: Optional[JoinedCopy] = None
    if plan.scaled:  # every expert's rowwise copy from one grouped encoding (its own amax)
        scaled = encode_group_scaled(plan.row_q, x, splits, True, False)
        own_rows = [rebuild(p, p.payloads[ROWWISE], None, rowwise_child(q).label, m)
                    if q is not None and (q.rowwise_usage or derives_columnwise(q)) else None
                    for q, p, m in zip(quantizers, scaled.parts(), splits)]
        scaled_rows = scaled.rows_fp32() if plan.derives_any else None
        own_joined = scaled_joined(scaled, x.dtype, getattr(plan.row_q, "dtype", None), True, False).get(ROWWISE)
    elif rows is None:  # per expert, where read (rowwise usage or a derived columnwise source)
        for e, (q, s, m) in enumerate(zip(quantizers, _offsets(splits, 1), splits)):
            if q is not None and (q.rowwise_usage or derives_columnwise(q)):
                own_rows[e] = rowwise_child(q).encode(x[s:s + m], True, False, None)
    return rows, own_rows, scaled_rows, own_joined


#: ``Plan.strategy`` -> the pass that writes the experts' copies.
RUNNERS: dict[str, Callable[[Sequence[Optional[Quantizer]], Plan, torch.Tensor, Sequence[int]], GroupedResult]] = {
    SCALED: _run_scaled, HYBRID_PASS: _run_hybrid_pass, ONE_ENCODE: _run_one_encode,
    SCALED_HYBRID: _run_scaled_hybrid, PADDED_ENCODE: _run_padded_encode, BY_DIRECTION: _run_by_direction,
}


# ---------------------------------------------------------------------------- zero-padded groups


def _pad_rows_kernel():
    """``kernels.moe.triton_pad_rows``, imported at first use (triton is optional)."""
    from ..kernels.moe import triton_pad_rows
    return triton_pad_rows


def pad_row_groups(src: torch.Tensor, splits: Sequence[int], block: int) -> tuple[torch.Tensor, list[int]]:
    """``src`` with each row group zero-padded to a multiple of ``block`` rows (no copy when
    every group already is), and the groups' start rows. On CUDA one Triton pass
    (``kernels/moe/triton_pad_rows.py``); elsewhere a zero fill and an ``index_copy_``."""
    starts = _offsets(splits, block)
    if not any(map(block.__rmod__, splits)):  # every m % block == 0: no padding
        return src, starts
    total = _padded_total(splits, block, starts)
    if current_policy().quantize_kernels and fast.device_ok(src) and (src.shape[1] <= 1 or src.stride(1) == 1):
        with fast.on_device(src):
            return _pad_rows_kernel().pad_rows(src, _row_map(splits, starts, total, src)), starts
    out = src.new_zeros(total, src.shape[1])
    out.index_copy_(0, _padded_rows(src, splits, starts), src)
    return out, starts


def encode_padded_columns(q: Quantizer, src: torch.Tensor, splits: Sequence[int], block: int,
                          rowwise: bool = False) -> tuple[Optional[QuantizedStorage], QuantizedStorage, list[int]]:
    """(``q.encode(src, True, False)`` if ``rowwise`` else None, ``q``'s columnwise-only encode
    of ``pad_row_groups(src, splits, block)``, the groups' start rows). Where a kernel reads
    rows through a row map (``row_mapped_kernel``: MXFP8 1D on CUDA) the padded copy is never
    written and both copies come from one read of ``src`` (one pass instead of three: rowwise,
    padding, columnwise)."""
    starts = _offsets(splits, block)
    if any(map(block.__rmod__, splits)) and src.dim() == 2:  # some m % block: padding
        total = _padded_total(splits, block, starts)
        run = row_mapped_kernel(q, src, total)
        if run is not None:
            rows, cols = run(q, src, _row_map(splits, starts, total, src), rowwise)
            return rows, cols, starts
    rows = q.encode(src, True, False, None) if rowwise else None
    padded, starts = pad_row_groups(src, splits, block)
    return rows, q.encode(padded, False, True, None), starts


def _padded_total(splits: Sequence[int], block: int, starts: Sequence[int]) -> int:
    """Rows of the zero-padded groups (``starts``: their start rows)."""
    return starts[-1] + ceil_div(splits[-1], block) * block


def _padded_rows(src: torch.Tensor, splits: Sequence[int], starts: Sequence[int]) -> torch.Tensor:
    """The destination row in the padded groups of every source row of ``src``."""
    return padded_row_index(splits, starts, src.device)


def padded_row_index(splits: Sequence[int], starts: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 [Σ splits]: for every row of the groups joined unpadded, its row in a layout
    where group e starts at row ``starts[e]`` (zero-padded groups; a padded encode read back),
    in O(1) ops for all groups: row r moves down by the padding before its group. Shared by the
    calls of one routing (``utils.device.step_metadata``): read-only."""
    splits, starts = tuple(map(int, splits)), tuple(starts)

    def build() -> torch.Tensor:
        total = sum(splits)
        shifts, counts = device_tensor([[p - s for p, s in zip(starts, _offsets(splits, 1))], list(splits)],
                                       device).unbind(0)
        return torch.arange(total, device=device) + torch.repeat_interleave(
            shifts, counts, output_size=total)  # output_size: no device sync
    return step_metadata(("padded rows", splits, starts), device, build)


def _row_map(splits: Sequence[int], starts: Sequence[int], total: int, src: torch.Tensor) -> torch.Tensor:
    """int32 [total]: the source row of each padded row, -1 for padding (what the kernels read);
    shared by the calls of one routing (``utils.device.step_metadata``): read-only."""
    def build() -> torch.Tensor:
        row_map = torch.full((total,), -1, dtype=torch.int32, device=src.device)
        row_map[_padded_rows(src, splits, starts)] = torch.arange(src.shape[0], dtype=torch.int32, device=src.device)
        return row_map
    return step_metadata(("row map", tuple(splits), tuple(starts), total), src.device, build)
