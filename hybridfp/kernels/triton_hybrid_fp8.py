"""Fused hybrid quantize: FP8 per-tensor current scaling rowwise + FP8 block 1D columnwise.

The ``per_gemm(fprop="fp8", dgrad/wgrad="fp8_block")`` operand (numerics §3, columnwise source
"original"). Current scaling needs the global amax before any code is written, so an amax pass
(``_common.global_amax``) is unavoidable; the cast pass then reads each BxB tile once from
device memory and writes both copies:

- rowwise: natural [RW, B] slices, ``fp8(clamp(x * scale))`` with the per-tensor scale computed
  in every program from the amax (``_common_encode.current_scale``), ``scale_inv`` by program 0;
- columnwise: the rowwise pass also keeps the tile's column amaxes (a register-local running
  max, one reduction per tile); ``triton_fp8_block.columnwise_1d`` re-reads the tile from cache
  in natural slices and writes the Bx1-block codes transposed as int32 words.

The two copies may use different FP8 element types (E5M2 current-scaled gradients with E4M3
blocks). Bitwise equal to the two children run separately (the same arithmetic).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import DTYPE_CODE, check_int32_tiles, empty, kernel_input, tile_offsets
from ._common_encode import current_scale, f32, fp8_params, hw_fp8
from .triton_fp8_block import (NATURAL_SLICES, SLICES_SLICES, abs_bits, bits_amax, columnwise_1d, columnwise_1d_t,
                               fp8_bytes, load_x, natural_hw, natural_pack)


@triton.jit
def _rowwise_tensorwise(xbase, r0, c0, R, C, sxr, sxc, scale, rd_ptr, MBITS: tl.constexpr,
                        BIAS: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr, RW: tl.constexpr,
                        DTYPE: tl.constexpr, HW: tl.constexpr, COLAMAX: tl.constexpr = False,
                        EVEN: tl.constexpr = False):
    """Rowwise per-tensor-scaled codes of tile rows r0 .. r0 + B, columns c0 .. c0 + B; with
    ``COLAMAX`` returns the tile's B column amaxes too (a register-local running max of the |x|
    bits, reduced once: see ``triton_fp8_block.row_pass_1d``). ``EVEN``: interior
    tile, no masks."""
    lc = tl.arange(0, B)
    cmask = (c0 + lc) < C
    rbase = rd_ptr + r0.to(tl.int64) * C + c0
    cacc = tl.zeros([RW, B], tl.int32)
    for j in tl.range(0, B // RW, loop_unroll_factor=1):
        lr = j * RW + tl.arange(0, RW)
        mask = ((r0 + lr) < R)[:, None] & cmask[None, :]
        x = load_x(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE, EVEN)
        if COLAMAX:
            cacc = tl.maximum(cacc, abs_bits(x))
        code = fp8_bytes(x * scale, FP8_MAX, MBITS, BIAS, HW, True)
        if EVEN:
            tl.store(rbase + tile_offsets(lr, lc, C, 1), code)
        else:
            tl.store(rbase + tile_offsets(lr, lc, C, 1), code, mask=mask)
    if COLAMAX:
        return bits_amax(tl.max(cacc, 0))
    else:  # unused; Triton 3.6 cannot return None from one branch of a jit function
        return tl.zeros([B], tl.float32)


@triton.jit
def _fp8_current_block_kernel(x_ptr, amax_ptr, rd_ptr, sinv_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr,
                              row_eps, col_eps, ROW_POW2: tl.constexpr, ROW_MBITS: tl.constexpr,
                              ROW_BIAS: tl.constexpr, ROW_MAX: tl.constexpr, COL_POW2: tl.constexpr,
                              COL_MBITS: tl.constexpr, COL_BIAS: tl.constexpr, COL_MAX: tl.constexpr,
                              B: tl.constexpr, CW: tl.constexpr, RW: tl.constexpr, DTYPE: tl.constexpr,
                              HW: tl.constexpr, PACK: tl.constexpr, NATURAL: tl.constexpr = True,
                              EVEN: tl.constexpr = False):
    """One BxB tile per program. ``NATURAL``: the rowwise pass also gives the column amaxes and
    the columnwise copy comes from one more read in natural [CW, B] slices
    (``triton_fp8_block.columnwise_1d``); else from transposed [CW]-column sub-tiles read twice
    (``columnwise_1d_t``). ``EVEN``: R and C are multiples of B (NATURAL only)."""
    pid = tl.program_id(0)
    nc = tl.cdiv(C, B)
    pr = pid // nc
    r0 = pr * B
    c0 = (pid % nc) * B
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    scale = current_scale(tl.load(amax_ptr), row_eps, ROW_MAX, ROW_POW2)
    camax = _rowwise_tensorwise(xbase, r0, c0, R, C, sxr, sxc, scale, rd_ptr, ROW_MBITS, ROW_BIAS, ROW_MAX, B,
                                RW, DTYPE, HW, NATURAL, EVEN and NATURAL)
    if pid == 0:
        tl.store(sinv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
    if NATURAL:
        columnwise_1d(xbase, r0, c0, R, C, sxr, sxc, camax, col_eps, cd_ptr, cs_ptr, pr, COL_POW2, COL_MBITS,
                      COL_BIAS, COL_MAX, B, CW, DTYPE, HW, PACK, EVEN)
    else:
        for j in tl.range(0, B // CW, loop_unroll_factor=1):
            columnwise_1d_t(xbase + j * CW * sxc, r0, c0 + j * CW, R, C, sxr, sxc, col_eps, cd_ptr, cs_ptr,
                            pr, COL_POW2, COL_MBITS, COL_BIAS, COL_MAX, B, CW, DTYPE, HW, PACK)


def quantize(x2: torch.Tensor, amax: torch.Tensor, row_dtype: torch.dtype, col_dtype: torch.dtype, *,
             row_eps: float = 0.0, row_power_2_scale: bool = False, col_eps: float = 0.0,
             col_power_2_scale: bool = True, block_size: int = 128, chunk: Optional[int] = None,
             row_slice: Optional[int] = None, num_warps: Optional[int] = None, pack: bool = True,
             method: str = "natural"):
    """Both copies of non-empty 2D ``x2`` (any strides) in one cast pass.

    ``amax``: the per-tensor amax (0-d FP32, after any all-reduce). Returns
    ``((row_data, scale_inv), (col_data, col_scale_inv))``: ``row_data`` [R, C] and the 0-d
    ``scale_inv`` as ``triton_fp8_tensorwise.quantize(x2, row_dtype, amax=amax, ...)``; the
    columnwise pair as ``triton_fp8_block.quantize(x2, col_dtype, block_dim=1, rowwise=False)``.
    ``row_slice``: rows per rowwise slice. ``method="natural"`` (default; the faster method on
    the H200, fastest at 128 / 32 rows): the rowwise
    pass also accumulates the column amaxes, and the columnwise copy is one more read in
    ``chunk``-row natural slices; ``"slices"``: the columnwise copy from transposed
    ``chunk``-column sub-tiles read twice. Defaults: ``triton_fp8_block.NATURAL_SLICES`` /
    ``SLICES_SLICES``.
    """
    if method not in ("natural", "slices"):
        raise ValueError(f"method={method!r} is unknown; use 'natural' or 'slices'.")
    rows, cols = x2.shape
    if x2.numel() == 0:
        raise ValueError("the fused FP8 kernel needs a non-empty input (the caller handles empty).")
    b = block_size
    if b < 32 or b & (b - 1):
        raise ValueError(f"block_size={b} must be a power of two >= 32.")
    nat = method == "natural"
    chunk_d, rows_d = NATURAL_SLICES if nat else SLICES_SLICES
    cw, rw = min(chunk or chunk_d, b), min(row_slice or rows_d, b)
    if b % cw or b % rw or cw < 4:
        raise ValueError(f"chunk={chunk} and row_slice={row_slice} must divide block_size={b}.")
    check_int32_tiles(rows, cols, *x2.stride())
    rm, rb, rmax = fp8_params(row_dtype)
    cm, cb, cmax = fp8_params(col_dtype)
    dev = x2.device
    rd = empty((rows, cols), dtype=row_dtype, device=dev)
    sinv = empty((), dtype=torch.float32, device=dev)
    cd = empty((cols, rows), dtype=col_dtype, device=dev)
    cs = empty((cols, triton.cdiv(rows, b)), dtype=torch.float32, device=dev)
    grid = (triton.cdiv(rows, b) * triton.cdiv(cols, b),)
    _fp8_current_block_kernel[grid](
        kernel_input(x2), amax.float().contiguous(), rd.view(torch.uint8), sinv, cd.view(torch.uint8), cs,
        rows, cols, x2.stride(0), x2.stride(1), f32(row_eps), f32(col_eps), ROW_POW2=row_power_2_scale,
        ROW_MBITS=rm, ROW_BIAS=rb, ROW_MAX=rmax, COL_POW2=col_power_2_scale, COL_MBITS=cm, COL_BIAS=cb,
        COL_MAX=cmax, B=b, CW=cw, RW=rw, DTYPE=DTYPE_CODE[x2.dtype], HW=natural_hw(x2) if nat else hw_fp8(dev),
        PACK=natural_pack(pack, x2) if nat else pack and rows % 4 == 0, NATURAL=nat,
        EVEN=rows % b == 0 and cols % b == 0, num_warps=num_warps or 4)
    return (rd, sinv), (cd, cs)
