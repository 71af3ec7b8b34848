"""Fused hybrid quantize: MXFP8 1D rowwise + NVFP4 1D columnwise (optionally RHT'd) from one read.

The input role of ``factories.mxfp8_fwd_nvfp4_bwd`` (and ``per_gemm`` with an MXFP8 fprop and an
NVFP4 wgrad): the forward GEMM reads x's MXFP8 rowwise copy, the wgrad reads its NVFP4
columnwise copy, RHT'd. After the NVFP4 amax pass (``triton_nvfp4.amaxes``: the global amax,
or the post-RHT amax), one cast pass per [16 BT, BC] tile writes both copies:

- MXFP8 1x32 rowwise blocks from the natural tile (``triton_mxfp8.row_copy``);
- NVFP4 16x1 columnwise blocks from the tile's 16 row slices, re-read from cache and RHT'd in
  registers, stored as int64 words of 16 codes (``triton_nvfp4_tile``'s columnwise path, the same
  code the plain NVFP4 kernel runs); without RHT and with R % 16 != 0, from the natural tile
  packed bytewise.

Bitwise equal to the two children run one after the other (their own kernels and the
``formats`` references): each copy is computed by the same code as in its own kernel.
Stochastic rounding is not taken (the kernel key of an SR NVFP4 quantizer is None).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import DTYPE_CODE, Copies, check_int32_tiles, empty, kernel_input, load_f32, tile_offsets
from ._common_encode import bf16_nan_bits, f32, fp8_params, hw_fp8
from .triton_mxfp8 import row_copy
from .triton_nvfp4_tile import BLOCK, RCP6, col_copy_bytes, col_copy_words, global_scales, tile_1d


@triton.jit
def _mxfp8_nvfp4_kernel(x_ptr, camax_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr,
                        RCP, RCP6, RCEIL: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                        BIAS: tl.constexpr, FP8_MAX: tl.constexpr, RHT: tl.constexpr, COL_WORDS: tl.constexpr,
                        HW: tl.constexpr, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, BT: tl.constexpr,
                        BC: tl.constexpr):
    r0, c0, lr, lc, xbase, mask = tile_1d(x_ptr, R, C, sxr, sxc, BT, BC)
    x = load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE)
    row_copy(x, mask, r0, c0, R, C, rd_ptr, rs_ptr, RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW)
    s_enc, s_dec = global_scales(camax_ptr)
    if COL_WORDS:
        col_copy_words(xbase, r0, c0, lc, R, C, sxr, sxc, s_enc, s_dec, cd_ptr.to(tl.pointer_type(tl.int64)),
                       cs_ptr, 0, 0, RCP6, False, RHT, HW, DTYPE, BF16_NAN, BT)
    else:
        col_copy_bytes(x, r0, c0, lr, lc, R, C, s_enc, s_dec, cd_ptr, cs_ptr, 0, 0, RCP6, False, HW, BT, BC)


def quantize(x2: torch.Tensor, col_amax: torch.Tensor, row_dtype: torch.dtype, *, rule: str = "rceil",
             rht: bool = False, block: Optional[tuple[int, int]] = None,
             num_warps: Optional[int] = None) -> Copies:
    """Both copies of non-empty 2D ``x2``: ``(row, col)`` with ``row`` = (FP8 data [R, C], E8M0
    bytes [R, ceil(C/32)]) equal to ``triton_mxfp8.quantize(x2, row_dtype, rule=rule,
    columnwise=False)`` and ``col`` = (packed E2M1 [C, ceil(L/2)], E4M3 scales [C, ceil(R/16)])
    equal to ``triton_nvfp4.quantize_1d(x2, None, col_amax, rht=rht)`` (L = R, or R rounded up
    to 16 with RHT). ``col_amax``: the NVFP4 global amax (0-d; the post-RHT amax with RHT).
    ``block``: (16-row tiles, columns) per program, columns a multiple of 32; default (2, 128),
    the plain NVFP4 kernel's tile (faster than (2, 64) with RHT on the H200); 4 warps."""
    if rule not in ("rceil", "floor"):
        raise ValueError(f"rule={rule!r} is unknown; use 'rceil' or 'floor'.")
    rows, cols = x2.shape
    bt, bc = block or (2, 128)
    if bc % 32:
        raise ValueError(f"block={block}: the column count must be a multiple of 32 (MXFP8 blocks).")
    check_int32_tiles(rows, cols, *x2.stride())
    dev = x2.device
    mbits, bias, fmax = fp8_params(row_dtype)
    row = (empty((rows, cols), dtype=row_dtype, device=dev),
           empty((rows, triton.cdiv(cols, 32)), dtype=torch.uint8, device=dev))
    length = triton.cdiv(rows, BLOCK) * BLOCK if rht else rows
    col = (empty((cols, (length + 1) // 2), dtype=torch.uint8, device=dev),
           empty((cols, triton.cdiv(rows, BLOCK)), dtype=torch.float8_e4m3fn, device=dev))
    grid = (triton.cdiv(rows, 16 * bt) * triton.cdiv(cols, bc),)
    _mxfp8_nvfp4_kernel[grid](
        kernel_input(x2), col_amax.float().contiguous(), row[0].view(torch.uint8), row[1], col[0],
        col[1].view(torch.uint8), rows, cols, x2.stride(0), x2.stride(1), f32(1.0 / fmax), RCP6,
        RCEIL=rule == "rceil", EMAX={3: 8, 2: 15}[mbits], MBITS=mbits, BIAS=bias, FP8_MAX=fmax, RHT=rht,
        COL_WORDS=rht or rows % 16 == 0, HW=hw_fp8(dev), DTYPE=DTYPE_CODE[x2.dtype],
        BF16_NAN=bf16_nan_bits(dev), BT=bt, BC=bc, num_warps=num_warps or 4)
    return row, col


__all__ = ["quantize"]
