"""Grouped per-tensor-scaled quantization for ``quantize_grouped``: the experts (row groups of
one tensor) of a quantizer whose per-tensor scale comes from the tensor's own amax (FP8
current scaling; the rowwise copy of 1D NVFP4 with a global amax) take one segmented amax and
one cast pass that scales each row by its expert's value — bitwise what each expert's own
``quantize`` makes (each expert is a tensor of its own: scales never straddle experts). On CUDA the Triton kernels
(``kernels/moe/triton_grouped_fp8.py``, ``triton_nvfp4``'s row-scaled path); elsewhere the formats.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..config import current_policy
from ..formats import fp8_tensorwise, nvfp4
from ..formats.common import amax_nan, ceil_div, saturating_cast_fp8
from ..utils.device import device_tensor, row_groups
from ..tensors import (DecodedMXFP8Storage, DecodedNVFP4Storage, Float8Storage, MXFP8Storage, NVFP4Storage,
                       QuantizedStorage, known_amax)
from .joined import column_slices
from ..tensors.storage import COLUMNWISE, ROWWISE
from ..quantizers import fast
from ..quantizers.backends import select_quantize_kernel
from ..quantizers.base import Quantizer, all_reduce_amax
from ..quantizers.float8 import Float8CurrentScalingQuantizer
from ..quantizers.hybrid import HybridQuantizer
from ..quantizers.mxfp8 import MXFP8Quantizer
from ..quantizers.nvfp4 import NVFP4Quantizer

#: Which copies a grouped per-tensor-scaled encoding (``GROUP_SCALED``, module end) writes.
ROWS, BOTH = "rowwise", "both"


def _fp8_kernels():
    """``kernels.moe.triton_grouped_fp8``, imported at first use (triton is optional)."""
    from ..kernels.moe import triton_grouped_fp8
    return triton_grouped_fp8


def group_scaled_mode(q: Quantizer) -> Optional[str]:
    """``BOTH`` / ``ROWS`` if ``q``'s per-tensor-scaled copies (both, or the rowwise one) can be
    encoded for all experts at once (see ``GROUP_SCALED``), else None."""
    if q.uses_randomness():
        return None
    entry = GROUP_SCALED.get(type(q))
    return None if entry is None else entry.copies(q)


def _offsets(splits: Sequence[int], block: int) -> list[int]:
    """Start row of each group once every group is padded to whole blocks."""
    out, at = [], 0
    for m in splits:  # ceil_div inlined: this runs for every expert, several times a call
        out.append(at)
        at += -(-m // block) * block
    return out


class GroupScaled(NamedTuple):
    """A grouped per-tensor-scaled encoding: every expert's storage (its own amax and scale; the
    copies asked for; a callable: built when asked) and the rowwise copies dequantized, joined
    [Σ m_e, K] FP32 (a callable: only a derived columnwise source needs it); ``fp8``: the
    joined copies behind the parts of FP8 current scaling (``Fp8Joined``), else None;
    ``whole_rows``: the rowwise copies the parts are row slices of as one row-scaled storage
    (each row with its expert's amax; a callable), where the format has such a storage (NVFP4)."""

    parts: Callable[[], list[QuantizedStorage]]
    rows_fp32: Callable[[], torch.Tensor]
    fp8: Optional["Fp8Joined"] = None
    whole_rows: Optional[Callable[[], QuantizedStorage]] = None


class _GroupScaledRule(NamedTuple):
    copies: Callable[[Quantizer], Optional[str]]  # BOTH / ROWS / None (these settings: per expert)
    encode: Callable[[Quantizer, torch.Tensor, Sequence[int], bool, bool, bool], GroupScaled]


def encode_group_scaled(q: Quantizer, x: torch.Tensor, splits: Sequence[int], rowwise: bool,
                        columnwise: bool, *, kernel: Optional[bool] = None) -> GroupScaled:
    """The copies of every row group of 2D ``x`` as ``q.encode(x_e, rowwise, columnwise)`` makes
    them, bitwise, for a quantizer with ``group_scaled_mode(q)`` (``columnwise`` only for
    ``BOTH``), from one segmented amax and one cast pass. ``kernel``: the Triton kernels
    (``kernels/moe/triton_grouped_fp8.py``, ``triton_nvfp4``) or the PyTorch formats; None: the
    kernels where q's own encode would take one (CUDA), else PyTorch. Labels are left empty."""
    splits = [int(m) for m in splits]
    if kernel is None:
        kernel = x.numel() > 0 and select_quantize_kernel(q, x, rowwise, columnwise) is not None
    with fast.on_device(x):
        return GROUP_SCALED[type(q)].encode(q, x, splits, rowwise, columnwise, kernel)


def _reduced(q: Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """Every expert's amax all-reduced as its own quantizer would (MAX is elementwise)."""
    if getattr(q, "with_amax_reduction", False):
        return all_reduce_amax(amax, q.amax_reduction_group)
    return amax


def _per_row(values: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Each group's value repeated over its rows ([G] -> [rows])."""
    return values.repeat_interleave(counts, output_size=rows)


def _segment_amax(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """max|x| of every row group (FP32 [G]; NaN propagates; 0 for an empty group), as
    ``amax_nan`` of each group alone (a max is exact whatever the order)."""
    return torch.segment_reduce(amax_nan(x, dim=1), "max", lengths=counts, unsafe=True, initial=0.0)


#: Integer dtype of each element size: payloads move as raw bits (any dtype, float8 included).
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _column_matrix(t: torch.Tensor, widths: Sequence[int], starts: Sequence[int], stride: int) -> torch.Tensor:
    """Column groups of ``t`` [K, W] (``widths[e]`` columns each, in order) placed at columns
    ``starts[e]`` of one zero-initialized [K, stride] matrix, written by one scatter (columns
    between the groups hold zeros). With ``t = data.t()`` it is ``triton_grouped_fp8``'s
    joined columnwise layout: each row group's transpose side by side."""
    k, w = t.shape
    meta = device_tensor([_offsets(widths, 1), list(widths), list(starts)], t.device)
    start, width, dst = meta.unbind(0)
    shift = _per_row(dst - start, width, w)  # destination column - source column, per column
    bits = _BITS_DTYPE[t.element_size()]
    out = torch.zeros((k, stride), dtype=bits, device=t.device)
    out.index_copy_(1, torch.arange(w, device=t.device) + shift, t.view(bits))
    return out.view(t.dtype)


def padded_ld(m: int) -> int:
    """Row stride of an expert's [C, m] FP8 columnwise copy: m rounded up to 16 (cuBLAS FP8
    takes a reduction that is a multiple of 16; the tail holds zero codes)."""
    return ceil_div(m, 16) * 16


def column_starts(splits: Sequence[int]) -> tuple[list[int], int]:
    """(first column of each expert's block, total width) of the joined FP8 columnwise matrix:
    blocks ``padded_ld(m_e)`` wide, side by side (16-aligned starts: cuBLAS reads 16-byte
    aligned operands)."""
    starts, at = [], 0
    for m in splits:
        starts.append(at)
        at += -(-m // 16) * 16  # padded_ld(m), inlined: once per expert per call
    return starts, at


class Fp8Joined(NamedTuple):
    """FP8 current scaling of every expert as joined copies: ``rows`` [Σm, C] codes (or None);
    ``cols`` [C, width] codes (or None): expert e's transpose at columns ``col_starts[e]`` ..
    + m_e, then zero codes up to ``padded_ld(m_e)``; ``scale_inv`` FP32 [E], each expert's."""

    rows: Optional[torch.Tensor]
    cols: Optional[torch.Tensor]
    scale_inv: torch.Tensor
    col_starts: list[int]


def fp8_parts(j: Fp8Joined, splits: Sequence[int], dtype: torch.dtype, fp8_dtype: torch.dtype,
              labels: Optional[Sequence[str]] = None) -> list[QuantizedStorage]:
    """Every expert's ``Float8Storage`` cut out of the joined copies (views; its own scale_inv):
    the storage its own ``quantize`` would hold, its columnwise copy a column slice of the joined
    matrix that continues with zero codes to a multiple of 16 (``columnwise_zero_tail``)."""
    cols_n = (j.rows if j.rows is not None else j.cols.t()).shape[1]
    sinvs = j.scale_inv.unbind(0)
    rds = torch.split(j.rows, list(splits)) if j.rows is not None else None
    cds = column_slices(j.cols, j.col_starts, splits) if j.cols is not None else None
    parts: list[QuantizedStorage] = []
    for e, m in enumerate(splits):
        row = {"data": rds[e], "scale_inv": sinvs[e]} if rds is not None else None
        col = {"data": cds[e], "scale_inv": sinvs[e]} if cds is not None else None
        part = Float8Storage(torch.Size((m, cols_n)), dtype, row, col, fp8_dtype=fp8_dtype,
                             label=labels[e] if labels is not None else "")
        part.columnwise_zero_tail = col is not None
        parts.append(part)
    return parts


def _fp8_current_groups(q: Quantizer, x: torch.Tensor, splits: Sequence[int], rowwise: bool,
                        columnwise: bool, kernel: bool) -> GroupScaled:
    """FP8 current scaling per expert (numerics §2.1): scale_e from expert e's amax. Columnwise
    copies: each expert's transpose [C, m_e] as columns of one [C, Σ padded_ld(m_e)] matrix,
    zero codes up to its block's end (``column_starts``, ``columnwise_zero_tail``)."""
    rows, cols = x.shape
    lds = [-(-m // 16) * 16 for m in splits]  # padded_ld, inlined: once per expert per call
    starts, width = column_starts(splits)
    cd: Optional[torch.Tensor] = None
    # each expert's amax as recorded by the kernel that wrote x (the fused SwiGLU given these
    # splits: hybridfp.tensors.known_amax), bitwise the segmented amax pass it saves
    known = known_amax.recall(x, splits) if q.reads_known_amax else None
    if known is not None and getattr(q, "with_amax_reduction", False):
        known = known.clone()  # the all-reduce works in place: the record stays x's own amax
    if kernel:
        k = _fp8_kernels()
        amax = _reduced(q, known if known is not None else k.group_amax(x, row_groups(splits, x.device), len(splits)))
        rd, flat, sinv = k.quantize(x, amax, splits, q.dtype, eps=q.amax_epsilon, power_2_scale=q.force_pow_2_scales,
                                    rowwise=rowwise, columnwise=columnwise, col_offsets=starts, col_lds=lds,
                                    col_numel=cols * width, col_stride=width)
        if flat is not None:  # block tails past m_e written as zero codes by the kernel
            cd = flat.view(cols, width)
    else:
        counts = device_tensor(list(splits), x.device)
        amax = _reduced(q, known if known is not None else _segment_amax(x, counts))
        scale = fp8_tensorwise.current_scale(amax, q.dtype, eps=q.amax_epsilon, power_2_scale=q.force_pow_2_scales)
        sinv = torch.ones_like(scale) / scale  # IEEE division, as fp8_tensorwise.quantize
        data = saturating_cast_fp8(x.float() * _per_row(scale, counts, rows)[:, None], q.dtype)
        rd = data if rowwise else None
        cd = _column_matrix(data.t(), splits, starts, width) if columnwise else None
    joined = Fp8Joined(rd, cd, sinv, starts)

    def rows_fp32() -> torch.Tensor:  # each expert's decode
        return rd.float() * _per_row(sinv, device_tensor(list(splits), x.device), rows)[:, None]
    return GroupScaled(lambda: fp8_parts(joined, splits, x.dtype, q.dtype), rows_fp32, joined)


def _nvfp4_groups(q: Quantizer, x: torch.Tensor, splits: Sequence[int], rowwise: bool,
                  columnwise: bool, kernel: bool) -> GroupScaled:
    """1D NVFP4 rowwise copies, each with its expert's global amax: row-scaled NVFP4 with the
    expert's amax on each of its rows (numerics §2.5's arithmetic is per row either way)."""
    if columnwise or not rowwise:
        raise ValueError("grouped NVFP4 encodes the rowwise copy only; quantize the columnwise copy per expert.")
    rows, cols = x.shape
    if kernel:
        group = row_groups(splits, x.device)
        amax = _reduced(q, _fp8_kernels().group_amax(x, group, len(splits)))
        row_amax = amax[group]
        from ..kernels import triton_nvfp4
        (data, scale), _ = triton_nvfp4.quantize_1d(x, row_amax, None)
    else:
        counts = device_tensor(list(splits), x.device)
        amax = _reduced(q, _segment_amax(x, counts))
        row_amax = _per_row(amax, counts, rows)
        data, scale = nvfp4.quantize_1d(x, row_amax)
    meta = q.storage_meta()

    def parts() -> list[QuantizedStorage]:
        return [NVFP4Storage(torch.Size((m, cols)), x.dtype, {"data": d, "scale": s, "amax": a}, None, **meta)
                for m, d, s, a in zip(splits, torch.split(data, list(splits)), torch.split(scale, list(splits)),
                                      amax.unbind(0))]

    def whole_rows() -> QuantizedStorage:
        return NVFP4Storage(x.shape, x.dtype, {"data": data, "scale": scale, "amax": row_amax}, None,
                            **{**meta, "row_scaled": True})

    def rows_fp32() -> torch.Tensor:
        return whole_rows().decode(ROWWISE)  # q x S_dec_b x S_dec per row: each expert's decode
    # row-scaled NVFP4 takes no RHT option (the RHT concerns the columnwise copy, not written here)
    return GroupScaled(parts, rows_fp32, None, None if meta.get("rht") else whole_rows)


class HybridGroups(NamedTuple):
    """:func:`nvfp4_mxfp8_groups`' result: each expert's NVFP4 rowwise storage (row slices, its
    own amax; a callable: built when asked — the joined path never asks, and 64 experts'
    storages would be most of the Composer-2 step's per-expert objects), the shared MXFP8
    columnwise storage of the padded groups, the padded groups' rowwise copy as one row-scaled NVFP4 storage (each row
    with its expert's amax: the joined copy the experts' rows are slices of) and the experts' amax
    (FP32 [E])."""

    rows: Callable[[], list[QuantizedStorage]]
    cols: QuantizedStorage
    whole_rows: QuantizedStorage
    amax: torch.Tensor


def nvfp4_mxfp8_groups(hq: Quantizer, padded: torch.Tensor, splits: Sequence[int], starts: Sequence[int]
                       ) -> HybridGroups:
    """A Hybrid(NVFP4 1D with a global amax, MXFP8 1D, "rowwise_dequantized") on every row
    group, from the groups zero-padded to 32 rows (``padded``, group e at row ``starts[e]``):
    one segmented amax and ONE fused kernel pass (``kernels.triton_hybrid_nvfp4``, row-scaled
    with each row's expert amax) writing the NVFP4 rowwise copy and the MXFP8 columnwise copy
    of its dequantized value — instead of the rowwise pass, a PyTorch FP32 dequantize of it and
    an MXFP8 pass. Returns each expert's NVFP4 rowwise storage (row slices; its own amax) and
    the shared MXFP8 columnwise storage of the padded groups (FP32 nominal dtype: the reference
    derives it from the FP32 value). CUDA (or the interpreter) only; bitwise each expert's own
    encode: padding rows are zeros (amax and codes unchanged), and numerics §2.5's arithmetic is
    per row, so a row scaled by its expert's amax is encoded as under that global amax."""
    rq, cq = hq.rowwise_quantizer, hq.columnwise_quantizer
    padded_splits = [ceil_div(m, 32) * 32 for m in splits]
    cols = padded.shape[1]
    group = row_groups(padded_splits, padded.device)
    dec_row, dec_col = ROWWISE in hq.hold_decoded, COLUMNWISE in hq.hold_decoded
    from ..kernels import triton_hybrid_nvfp4
    with fast.on_device(padded):
        amax = _reduced(rq, _fp8_kernels().group_amax(padded, group, len(splits)))
        row, col = triton_hybrid_nvfp4.quantize(
            padded, amax[group], cq.dtype, rule=cq.scale_rule, rowwise=True, columnwise=True,
            source="rowwise_dequantized", decoded=(dec_row, dec_col))
    meta = rq.storage_meta()
    # the copies held as their BF16 decodes (``hold_decoded``): the same layout, no block scales
    row_cls, row_pl = (DecodedNVFP4Storage, {"data": row[0]}) if dec_row else (
        NVFP4Storage, {"data": row[0], "scale": row[1]})
    col_cls, col_pl = (DecodedMXFP8Storage, {"data": col[0]}) if dec_col else (
        MXFP8Storage, {"data": col[0], "scale": col[1]})
    rows = partial(expert_nvfp4_rows, row_cls, row_pl, amax, list(splits), list(starts), cols, padded.dtype, meta)
    whole = col_cls(padded.shape, torch.float32, None, col_pl, **cq.storage_meta())
    whole_rows = row_cls(padded.shape, padded.dtype, {**row_pl, "amax": amax[group]}, None, **{**meta, "row_scaled": True})
    return HybridGroups(rows, whole, whole_rows, amax)


def expert_nvfp4_rows(cls: type[QuantizedStorage], payload: dict[str, torch.Tensor], amax: torch.Tensor,
                      splits: Sequence[int], starts: Sequence[int], cols: int, dtype: torch.dtype,
                      meta: dict) -> list[QuantizedStorage]:
    """Each expert's 1D NVFP4 rowwise storage of class ``cls`` (``NVFP4Storage``, or its decoded
    form) ([m_e, cols], its own global ``amax[e]``) as row slices of the padded groups' row-indexed
    ``payload`` tensors (codes and block scales, or decoded values; group e from row ``starts[e]``)."""
    return [cls(torch.Size((m, cols)), dtype, {**{n: t[s:s + m] for n, t in payload.items()}, "amax": a}, None, **meta)
            for m, s, a in zip(splits, starts, amax.unbind(0))]


def fused_nvfp4_mxfp8_supported(hq: Quantizer, x: torch.Tensor) -> bool:
    """Whether :func:`nvfp4_mxfp8_groups` takes these experts' hybrid on ``x``'s device: NVFP4
    1D (global amax, no RHT / 2D / stochastic rounding) -> MXFP8 1D from the rowwise value,
    where the fused hybrid kernel runs."""
    if not (isinstance(hq, HybridQuantizer) and hq.columnwise_source == "rowwise_dequantized"):
        return False
    rq, cq = hq.rowwise_quantizer, hq.columnwise_quantizer
    return (type(rq) is NVFP4Quantizer and group_scaled_mode(rq) == ROWS and not rq.with_rht
            and type(cq) is MXFP8Quantizer and not cq.with_2d_quantization and not cq.uses_randomness()
            and x.numel() > 0 and current_policy().quantize_kernels and fast.device_ok(x))


#: Quantizers whose per-tensor scale comes from the tensor's own amax, so every expert's scale
#: can come from one segmented amax: which copies one grouped encoding writes, and how.
GROUP_SCALED: dict[type, _GroupScaledRule] = {
    Float8CurrentScalingQuantizer: _GroupScaledRule(lambda q: BOTH, _fp8_current_groups),
    # 1D with a global amax: the rowwise copy (RHT concerns the columnwise copy only; row-scaled
    # NVFP4 is row-local already, 2D tiles straddle rows)
    NVFP4Quantizer: _GroupScaledRule(
        lambda q: None if q.with_2d_quantization or q.row_scaled_nvfp4 else ROWS, _nvfp4_groups),
}
