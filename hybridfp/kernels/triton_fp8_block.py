"""FP8 block-scaling quantize kernels (SPEC §2.3, DeepSeek-V3 style), one read per tile.

- 1D: rowwise 1xB blocks (``data [R, C]``, ``scale_inv [R, ceil(C/B)]``) and columnwise Bx1
  blocks re-quantized from the same tile, stored transposed (``[C, R]``, ``[C, ceil(R/B)]``).
- 2D: BxB tiles; the columnwise copy is the rowwise one transposed (data and scale_inv).

Tile-local int32 offsets, the hardware FP8 conversion on the GPU and int32-packed transposed
stores (``_common`` says why).

B = 128 by default (any power of two >= 16 works). Bitwise equal to ``formats.fp8_block``:
the block scale is ``_common.current_scale`` of the NaN-propagating block amax (FP32 IEEE
division, optional power-of-two round-down), ``scale_inv = 1 / scale`` (IEEE), data
``fp8(clamp(x * scale))`` with the integer RNE of ``_common.fp8_code``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (DTYPE_CODE, Copies, amax_nan, check_int32_tiles, clamp_sym, current_scale, empty, f32,
                      fp8_code, fp8_params, hw_fp8, kernel_input, load_f32, store_transposed_u8,
                      tile_offsets)


@triton.jit
def _chunk(xbase, lr, rmask, lc0, c0, C, sxr, sxc, DTYPE: tl.constexpr, CW: tl.constexpr):
    """A [B, CW] FP32 chunk of the tile (tile-local columns lc0 .. lc0 + CW; tile origin column
    c0), its tile-local columns and mask."""
    lc = lc0 + tl.arange(0, CW)
    mask = rmask[:, None] & ((c0 + lc) < C)[None, :]
    return load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE), lc, mask


@triton.jit
def _fp8_block_1d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc, eps,
                         ROW: tl.constexpr, COL: tl.constexpr, POW2: tl.constexpr,
                         MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                         B: tl.constexpr, DTYPE: tl.constexpr, CW: tl.constexpr,
                         HW: tl.constexpr, PACK: tl.constexpr):
    """One BxB tile per program, walked in [B, CW] column chunks: each chunk completes its Bx1
    columnwise blocks at once; the 1xB rowwise blocks need the whole tile's row amax, so the
    chunks are read again (from cache) to write the rowwise copy."""
    pid = tl.program_id(0)
    nc = tl.cdiv(C, B)
    pr = pid // nc
    pc = pid % nc
    r0 = pr * B
    c0 = pc * B
    lr = tl.arange(0, B)
    rmask = (r0 + lr) < R
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    ramax = tl.zeros([B], tl.float32)
    rnan = tl.zeros([B], tl.int32)
    nbr = tl.cdiv(R, B)
    for j in tl.range(0, B // CW, loop_unroll_factor=1):
        x, lc, mask = _chunk(xbase, lr, rmask, j * CW, c0, C, sxr, sxc, DTYPE, CW)
        if COL:
            scale = current_scale(amax_nan(x, 0), eps, FP8_MAX, POW2)  # [CW]
            code = fp8_code(clamp_sym(x * scale[None, :], FP8_MAX), MBITS, BIAS, HW)
            store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
            tl.store(cs_ptr + (c0 + lc).to(tl.int64) * nbr + pr,
                     tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=(c0 + lc) < C)
        if ROW:
            ramax = tl.maximum(ramax, tl.max(tl.abs(x), axis=1))
            rnan = tl.maximum(rnan, tl.max((x != x).to(tl.int32), axis=1))
    if ROW:
        scale = current_scale(tl.where(rnan > 0, float("nan"), ramax), eps, FP8_MAX, POW2)  # [B]
        rbase = rd_ptr + r0.to(tl.int64) * C + c0
        for j in tl.range(0, B // CW, loop_unroll_factor=1):
            x, lc, mask = _chunk(xbase, lr, rmask, j * CW, c0, C, sxr, sxc, DTYPE, CW)
            code = fp8_code(clamp_sym(x * scale[:, None], FP8_MAX), MBITS, BIAS, HW)
            tl.store(rbase + tile_offsets(lr, lc, C, 1), code, mask=mask)
        tl.store(rs_ptr + (r0 + lr).to(tl.int64) * tl.cdiv(C, B) + pc,
                 tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=rmask)


@triton.jit
def _fp8_block_2d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc, eps,
                         ROW: tl.constexpr, COL: tl.constexpr, POW2: tl.constexpr,
                         MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                         B: tl.constexpr, DTYPE: tl.constexpr, CW: tl.constexpr,
                         HW: tl.constexpr, PACK: tl.constexpr):
    """One BxB tile per program: its amax over [B, CW] chunks, then the chunks again (from
    cache) to write both copies (the columnwise one transposed)."""
    pid = tl.program_id(0)
    nc = tl.cdiv(C, B)
    pr = pid // nc
    pc = pid % nc
    r0 = pr * B
    c0 = pc * B
    lr = tl.arange(0, B)
    rmask = (r0 + lr) < R
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    amax = tl.zeros([CW], tl.float32)
    nan = tl.zeros([CW], tl.int32)
    for j in tl.range(0, B // CW, loop_unroll_factor=1):
        x, lc, mask = _chunk(xbase, lr, rmask, j * CW, c0, C, sxr, sxc, DTYPE, CW)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=0))
    a = tl.where(tl.max(nan, axis=0) > 0, float("nan"), tl.max(amax, axis=0))
    scale = current_scale(a, eps, FP8_MAX, POW2)
    rbase = rd_ptr + r0.to(tl.int64) * C + c0
    for j in tl.range(0, B // CW, loop_unroll_factor=1):
        x, lc, mask = _chunk(xbase, lr, rmask, j * CW, c0, C, sxr, sxc, DTYPE, CW)
        code = fp8_code(clamp_sym(x * scale, FP8_MAX), MBITS, BIAS, HW)
        if ROW:
            tl.store(rbase + tile_offsets(lr, lc, C, 1), code, mask=mask)
        if COL:
            store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if ROW:
        tl.store(rs_ptr + pr * nc + pc, inv)
    if COL:
        tl.store(cs_ptr + pc * tl.cdiv(R, B) + pr, inv)


def quantize(x2: torch.Tensor, dtype: torch.dtype, *, block_dim: int = 1, block_size: int = 128,
             power_2_scale: bool = True, eps: float = 0.0, rowwise: bool = True,
             columnwise: bool = True, chunk: int = 16, num_warps: Optional[int] = None,
             pack: bool = True) -> Copies:
    """FP8-block-quantize 2D ``x2`` (any strides); returns ``(row, col)``, each
    ``(data, scale_inv)`` or None, equal to ``formats.fp8_block.quantize_1d(x2)`` /
    ``quantize_1d(x2.t())`` (``block_dim=2``: ``quantize_2d(x2)`` and its transpose).
    One ``block_size``-square tile per program, walked in ``chunk``-column slices. ``pack``:
    transposed stores as int32 words of four rows when R % 4 == 0 (same bytes).
    """
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim={block_dim} must be 1 or 2.")
    b = block_size
    if b < 16 or b & (b - 1):
        raise ValueError(f"block_size={b} must be a power of two >= 16.")
    cw = min(chunk, b)
    if b % cw:
        raise ValueError(f"chunk={chunk} must divide block_size={b}.")
    rows, cols = x2.shape
    check_int32_tiles(rows, cols, *x2.stride())
    mbits, bias, fmax = fp8_params(dtype)
    dev = x2.device
    nbr, nbc = triton.cdiv(rows, b), triton.cdiv(cols, b)
    row = col = None
    if rowwise:
        row = (empty((rows, cols), dtype=dtype, device=dev),
               empty((nbr if block_dim == 2 else rows, nbc), dtype=torch.float32, device=dev))
    if columnwise:
        col = (empty((cols, rows), dtype=dtype, device=dev),
               empty((nbc, nbr) if block_dim == 2 else (cols, nbr), dtype=torch.float32, device=dev))
    if x2.numel() == 0:
        return row, col
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
    rd, rs = (row[0].view(torch.uint8), row[1]) if row else (dummy, dummy_f)
    cd, cs = (col[0].view(torch.uint8), col[1]) if col else (dummy, dummy_f)
    kernel = _fp8_block_2d_kernel if block_dim == 2 else _fp8_block_1d_kernel
    grid = (triton.cdiv(rows, b) * triton.cdiv(cols, b),)
    extra = {"num_warps": num_warps or 4}  # chunk 16 / 4 warps: fastest of the H200 sweep
    kernel[grid](kernel_input(x2), rd, rs, cd, cs, rows, cols, x2.stride(0), x2.stride(1), f32(eps),
                 ROW=rowwise, COL=columnwise, POW2=power_2_scale, MBITS=mbits, BIAS=bias,
                 FP8_MAX=fmax, B=b, DTYPE=DTYPE_CODE[x2.dtype], CW=cw, HW=hw_fp8(dev),
                 PACK=pack and rows % 4 == 0, **extra)
    return row, col
