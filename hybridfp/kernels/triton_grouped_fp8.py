"""Grouped per-tensor scaling kernels: an MoE layer's experts (row groups of one tensor), each
with its own per-tensor amax / FP8 scale, in one launch per pass instead of one per expert.

Row r of the [R, C] input belongs to group ``row_group[r]`` (rows of one group consecutive,
groups in order: ``quantizers.grouped.quantize_grouped``'s layout). Two passes:

- :func:`group_amax`: max|x| of every group (NaN-propagating, 0 for an empty group): per tile
  one atomic max of the amax bits when all its rows are one group (the common case: groups of
  hundreds of rows), else one per row. Also serves NVFP4's per-expert global amax.
- :func:`quantize` (FP8 current scaling, SPEC §2.1): the scale of each row's group from its
  amax (``_common.current_scale``), ``fp8(clamp(x * scale))`` by ``_common.fp8_encode``, and
  ``scale_inv = 1 / scale`` per group (IEEE division). The rowwise data is [R, C]; the
  columnwise data is each group's own transpose [C, m_e], written at a given element offset of
  one flat buffer with a given row stride ``ld_e >= m_e`` (the caller starts each block 16-byte
  aligned, as cuBLAS reads its operands) — so every expert's columnwise copy is a view, ready
  for a per-expert TN GEMM, not a column slice of a [C, R] transpose that would need a copy.
  With ``ld_e`` = m_e rounded up to 16, :func:`zero_row_tails` zeroes each row's tail: the
  [C, ld_e] block is then the copy zero-padded along its reduction (the expert's token count),
  which cuBLAS FP8 needs a multiple of 16, with no padded copy per GEMM.

Bitwise equal, per group, to ``triton_fp8_tensorwise`` / ``formats.fp8_tensorwise`` on that
group alone (same helpers, same operation order; the scale depends only on the group's amax).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (DTYPE_CODE, amax_bits, amax_nan, check_int32_tiles, current_scale, empty, f32,
                      fp8_encode, fp8_params, hw_fp8, kernel_input, load_tile, tile_offsets)


@triton.jit
def _group_amax_kernel(x_ptr, group_ptr, out_ptr, R, C, sxr, sxc: tl.constexpr, DTYPE: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr):
    """Fold each tile's row amaxes into ``out_ptr[group]`` (int32 amax bits, zeroed by the caller)."""
    x, mask, lr, lc, r0, c0, pr, pc = load_tile(x_ptr, R, C, sxr, sxc, DTYPE, BR, BC)
    rmask = (r0 + lr) < R
    row = amax_nan(x, 1)
    g = tl.load(group_ptr + r0 + lr, mask=rmask, other=-1)
    first = tl.max(tl.where(rmask, g, -1), 0)
    low = tl.min(tl.where(rmask, g, 2147483647), 0)
    if low == first:  # one group in the tile: one atomic instead of BR
        tl.atomic_max(out_ptr + first, amax_bits(amax_nan(row, 0)))
    else:
        tl.atomic_max(out_ptr + g, amax_bits(row), mask=rmask)


def group_amax(x2: torch.Tensor, row_group: torch.Tensor, groups: int, *,
               block: tuple[int, int] = (64, 128)) -> torch.Tensor:
    """Per-group max|x2| (FP32 [groups], NaN-propagating, 0 for a group without rows) of non-empty
    2D ``x2``; ``row_group``: int32 [R], the group of each row."""
    rows, cols = x2.shape
    check_int32_tiles(rows, cols, *x2.stride())
    out = torch.zeros(groups, dtype=torch.int32, device=x2.device)
    br, bc = block
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    _group_amax_kernel[grid](kernel_input(x2), row_group, out, rows, cols, x2.stride(0), x2.stride(1),
                             DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc, num_warps=8)
    return out.view(torch.float32)


@triton.jit
def _grouped_fp8_kernel(x_ptr, amax_ptr, group_ptr, start_ptr, ld_ptr, off_ptr, rd_ptr, cd_ptr, sinv_ptr,
                        R, C, G,
                        sxr, sxc: tl.constexpr, eps, POW2: tl.constexpr, ROW: tl.constexpr,
                        COL: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                        FP8_MAX: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                        BC: tl.constexpr, BG: tl.constexpr, HW: tl.constexpr):
    """One tile: each row scaled by its group's current scale; rowwise codes at [r, c], columnwise
    codes at ``offset + c * ld + (r - start)`` (the group's own transpose, row stride ``ld``)."""
    x, mask, lr, lc, r0, c0, pr, pc = load_tile(x_ptr, R, C, sxr, sxc, DTYPE, BR, BC)
    rmask = (r0 + lr) < R
    g = tl.load(group_ptr + r0 + lr, mask=rmask, other=0)
    scale = current_scale(tl.load(amax_ptr + g, mask=rmask, other=0.0), eps, FP8_MAX, POW2)
    code = fp8_encode(x * scale[:, None], FP8_MAX, MBITS, BIAS, HW)
    if ROW:
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
    if COL:
        start = tl.load(start_ptr + g, mask=rmask, other=0)
        ld = tl.load(ld_ptr + g, mask=rmask, other=0)
        # 64-bit per row (a group's block may start past 2**31 bytes), int32 inside the tile:
        # lc * ld <= BC * (R + 15) (check_int32_tiles)
        base = tl.load(off_ptr + g, mask=rmask, other=0) + (r0 + lr - start) + c0.to(tl.int64) * ld
        tl.store(cd_ptr + base[:, None] + lc[None, :] * ld[:, None], code, mask=mask)
    if (pr == 0) & (pc == 0):  # every group's 1 / scale, empty groups included
        for g0 in range(0, G, BG):
            lg = g0 + tl.arange(0, BG)
            s = current_scale(tl.load(amax_ptr + lg, mask=lg < G, other=0.0), eps, FP8_MAX, POW2)
            tl.store(sinv_ptr + lg * 4, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=lg < G)


def quantize(x2: torch.Tensor, amax: torch.Tensor, row_group: torch.Tensor, group_start: torch.Tensor,
             group_rows: torch.Tensor, dtype: torch.dtype, *, eps: float = 0.0, power_2_scale: bool = False,
             rowwise: bool = True, columnwise: bool = True, col_offset: Optional[torch.Tensor] = None,
             col_numel: Optional[int] = None, col_ld: Optional[torch.Tensor] = None,
             block: tuple[int, int] = (32, 128), num_warps: Optional[int] = None):
    """FP8 current scaling of the row groups of non-empty 2D ``x2`` (any strides), each with its
    group's scale.

    ``amax``: FP32 [G] per-group amaxes (e.g. :func:`group_amax`, after any all-reduce);
    ``row_group``: int32 [R] group of each row; ``group_start`` / ``group_rows``: int32 [G]
    first row and row count of each group; ``col_offset``: int64 [G] element offset of each
    group's columnwise block in a flat buffer of ``col_numel`` elements (default: blocks end to
    end, ``C * start_e``, R * C elements). Returns ``(row_data or None, col_data or None,
    scale_inv)``: rowwise [R, C] in ``dtype``; columnwise flat [col_numel] in ``dtype`` holding
    group e's transpose [C, m_e] at ``col_offset[e]`` with row stride ``col_ld[e]`` (int32 [G],
    default ``group_rows``: contiguous); ``scale_inv`` FP32 [G]. Row tails past m_e are not
    written (:func:`zero_row_tails`).
    """
    rows, cols = x2.shape
    if x2.numel() == 0:
        raise ValueError("grouped fp8 kernel needs a non-empty input (the caller handles empty).")
    mbits, bias, fmax = fp8_params(dtype)
    check_int32_tiles(rows + 16, cols, *x2.stride())  # + 16: a row stride ld_e <= m_e + 15
    dev = x2.device
    groups = amax.numel()
    rd = empty((rows, cols), dtype=dtype, device=dev) if rowwise else None
    if col_offset is None:
        col_offset, col_numel = group_start.to(torch.int64) * cols, rows * cols
    if col_ld is None:
        col_ld = group_rows
    cd = empty((col_numel,), dtype=dtype, device=dev) if columnwise else None
    # one 16-byte slot per expert: cuBLAS (torch._scaled_mm) rejects a scale pointer that is
    # not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED), and each expert's scale_inv is a view
    sinv = empty((groups, 4), dtype=torch.float32, device=dev)
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    br, bc = block
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    _grouped_fp8_kernel[grid](
        kernel_input(x2), amax.float().contiguous(), row_group, group_start, col_ld, col_offset,
        rd.view(torch.uint8) if rowwise else dummy, cd.view(torch.uint8) if columnwise else dummy, sinv,
        rows, cols, groups, x2.stride(0), x2.stride(1), f32(eps), POW2=power_2_scale, ROW=rowwise,
        COL=columnwise, MBITS=mbits, BIAS=bias, FP8_MAX=fmax, DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc,
        BG=128, HW=hw_fp8(dev), num_warps=num_warps or 4)
    return rd, cd, sinv[:, 0]


@triton.jit
def _zero_tails_kernel(cd_ptr, off_ptr, count_ptr, ld_ptr, C, BC: tl.constexpr, PAD: tl.constexpr):
    """Group ``program_id(1)``, rows ``program_id(0) * BC ..`` of its [C, ld] block: bytes
    ``count .. ld - 1`` of each row set to 0 (``ld - count <= PAD``)."""
    g = tl.program_id(1)
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    count = tl.load(count_ptr + g)
    ld = tl.load(ld_ptr + g)
    j = tl.arange(0, PAD)
    ptrs = cd_ptr + tl.load(off_ptr + g) + c.to(tl.int64)[:, None] * ld + count + j[None, :]
    tl.store(ptrs, tl.zeros([BC, PAD], tl.uint8), mask=(c < C)[:, None] & (count + j < ld)[None, :])


def zero_row_tails(cd: torch.Tensor, col_offset: torch.Tensor, group_rows: torch.Tensor, col_ld: torch.Tensor,
                   cols: int, max_pad: int = 16) -> None:
    """Zero bytes ``m_e .. ld_e - 1`` of each of the ``cols`` rows of every group's columnwise
    block in the flat byte-sized buffer ``cd`` (layout of :func:`quantize`), in one launch;
    ``ld_e - m_e < max_pad`` (a power of two)."""
    groups = group_rows.numel()
    if groups == 0 or cols == 0:
        return
    bc = 256
    _zero_tails_kernel[(triton.cdiv(cols, bc), groups)](cd.view(torch.uint8), col_offset, group_rows, col_ld,
                                                         cols, BC=bc, PAD=max_pad, num_warps=4)
