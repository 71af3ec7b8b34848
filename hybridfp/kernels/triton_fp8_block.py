"""FP8 block-scaling quantize kernels (SPEC §2.3, DeepSeek-V3 style), one read per tile.

- 1D: rowwise 1xB blocks (``data [R, C]``, ``scale_inv [R, ceil(C/B)]``) and columnwise Bx1
  blocks re-quantized from the same tile, stored transposed (``[C, R]``, ``[C, ceil(R/B)]``).
  The tile is read from device memory once (rowwise pass, natural [RW, B] slices); the
  columnwise pass re-reads it from cache as transposed [CW, 32] sub-tiles whose rows sit in one
  thread (``_common.load_rows32_t``), so the Bx1 block amax needs no cross-warp reduction.
- 2D: BxB tiles; the columnwise copy is the rowwise one transposed (data and scale_inv).

Tile-local int32 offsets, the hardware FP8 conversion on the GPU and int32-packed transposed
stores (``_common`` says why).

B = 128 by default (any power of two >= 32 works). Bitwise equal to ``formats.fp8_block``:
the block scale is ``_common.current_scale`` of the NaN-propagating block amax (FP32 IEEE
division, optional power-of-two round-down), ``scale_inv = 1 / scale`` (IEEE), data
``fp8(clamp(x * scale))`` by ``_common.fp8_encode``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (DTYPE_CODE, program_tile, Copies, amax_nan, check_int32_tiles, current_scale, empty, f32,
                      fp8_encode, fp8_params, hw_fp8, kernel_input, load_f32, load_rows32_t, nan_max,
                      store_transposed_u8, store_words_t, tile_offsets)


@triton.jit
def _chunk(xbase, lr, rmask, lc0, c0, C, sxr, sxc, DTYPE: tl.constexpr, CW: tl.constexpr):
    """A [B, CW] FP32 chunk of the tile (tile-local columns lc0 .. lc0 + CW; tile origin column
    c0), its tile-local columns and mask."""
    lc = lc0 + tl.arange(0, CW)
    mask = rmask[:, None] & ((c0 + lc) < C)[None, :]
    return load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE), lc, mask


@triton.jit
def columnwise_1d(xbase, r0, c0, R, C, sxr, sxc, eps, cd_ptr, cs_ptr, pr, POW2: tl.constexpr,
                  MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr,
                  CW: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr, PACK: tl.constexpr):
    """The Bx1 columnwise blocks of tile rows r0 .. r0 + B and columns c0 .. c0 + CW (``xbase``
    points at (r0, c0)), stored transposed, and their ``scale_inv``.

    The block is read as B / 32 transposed [CW, 32] sub-tiles (``_common.load_rows32_t``, one
    column's rows per thread): the block amax is register-local (no cross-warp reduction), and
    after the scale the sub-tiles are read again (from cache) and written as int32 words."""
    lc = tl.arange(0, CW)
    cmask = (c0 + lc) < C
    amax = tl.zeros([CW], tl.float32)
    for s in tl.range(0, B // 32, loop_unroll_factor=1):
        amax = nan_max(amax, amax_nan(load_rows32_t(xbase, s * 32, lc, R - r0, cmask, sxr, sxc, DTYPE), 1))
    scale = current_scale(amax, eps, FP8_MAX, POW2)
    for s in tl.range(0, B // 32, loop_unroll_factor=1):
        xt = load_rows32_t(xbase, s * 32, lc, R - r0, cmask, sxr, sxc, DTYPE)
        code = fp8_encode(xt * scale[:, None], FP8_MAX, MBITS, BIAS, HW)
        store_words_t(cd_ptr, code, lc, c0, r0 + s * 32, R, C, PACK)
    tl.store(cs_ptr + (c0 + lc).to(tl.int64) * tl.cdiv(R, B) + pr,
             tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=cmask)


@triton.jit
def _rowwise_1d(xbase, r0, c0, R, C, sxr, sxc, eps, rd_ptr, rs_ptr, pc, POW2: tl.constexpr,
                MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr,
                RW: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr):
    """The 1xB rowwise blocks of tile rows r0 .. r0 + B, columns c0 .. c0 + B, in [RW, B]
    natural slices (a block's row lies in one warp: a shuffle reduction)."""
    lc = tl.arange(0, B)
    cmask = (c0 + lc) < C
    rbase = rd_ptr + r0.to(tl.int64) * C + c0
    for j in tl.range(0, B // RW, loop_unroll_factor=1):
        lr = j * RW + tl.arange(0, RW)
        rmask = (r0 + lr) < R
        mask = rmask[:, None] & cmask[None, :]
        x = load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE)
        scale = current_scale(amax_nan(x, 1), eps, FP8_MAX, POW2)  # [RW]
        code = fp8_encode(x * scale[:, None], FP8_MAX, MBITS, BIAS, HW)
        tl.store(rbase + tile_offsets(lr, lc, C, 1), code, mask=mask)
        tl.store(rs_ptr + (r0 + lr).to(tl.int64) * tl.cdiv(C, B) + pc,
                 tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=rmask)


@triton.jit
def _fp8_block_1d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr, eps,
                         ROW: tl.constexpr, COL: tl.constexpr, POW2: tl.constexpr,
                         MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                         B: tl.constexpr, DTYPE: tl.constexpr, CW: tl.constexpr,
                         HW: tl.constexpr, PACK: tl.constexpr, RW: tl.constexpr):
    """One BxB tile per program: the rowwise copy from natural [RW, B] row slices (read from
    device memory), then the columnwise copy from transposed sub-tiles of [CW] columns (read
    again from cache; :func:`columnwise_1d`)."""
    pid = tl.program_id(0)
    nc = tl.cdiv(C, B)
    pr = pid // nc
    pc = pid % nc
    r0 = pr * B
    c0 = pc * B
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    if ROW:
        _rowwise_1d(xbase, r0, c0, R, C, sxr, sxc, eps, rd_ptr, rs_ptr, pc, POW2, MBITS, BIAS, FP8_MAX,
                    B, RW, DTYPE, HW)
    if COL:
        for j in tl.range(0, B // CW, loop_unroll_factor=1):
            columnwise_1d(xbase + j * CW * sxc, r0, c0 + j * CW, R, C, sxr, sxc, eps, cd_ptr,
                          cs_ptr, pr, POW2, MBITS, BIAS, FP8_MAX, B, CW, DTYPE, HW, PACK)


@triton.jit
def _fp8_block_2d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr, eps,
                         ROW: tl.constexpr, COL: tl.constexpr, POW2: tl.constexpr,
                         MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                         B: tl.constexpr, DTYPE: tl.constexpr, CW: tl.constexpr,
                         HW: tl.constexpr, PACK: tl.constexpr, RW: tl.constexpr):
    """One BxB tile per program (``RW`` unused): its amax over [B, CW] chunks, then the chunks again (from
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
        code = fp8_encode(x * scale, FP8_MAX, MBITS, BIAS, HW)
        if ROW:
            tl.store(rbase + tile_offsets(lr, lc, C, 1), code, mask=mask)
        if COL:
            store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if ROW:
        tl.store(rs_ptr + pr * nc + pc, inv)
    if COL:
        tl.store(cs_ptr + pc * tl.cdiv(R, B) + pr, inv)


@triton.jit
def _fp8_block_tile_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr, eps,
                           ROW: tl.constexpr, COL: tl.constexpr, POW2: tl.constexpr, TWO_D: tl.constexpr,
                           MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                           B: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr, PACK: tl.constexpr,
                           ANCHOR: tl.constexpr = False):
    """One BxB tile per program, read from device memory once into registers (vector loads):
    1D: the rowwise 1xB amaxes (axis 1) and columnwise Bx1 amaxes (axis 0) of the same tile;
    2D: one amax for the tile. Rowwise codes leave in the natural layout, columnwise codes
    through ``store_transposed_u8`` (the compiler's shared-memory transpose)."""
    pr, pc = program_tile(C, B, B)
    r0, c0 = pr * B, pc * B
    lr = tl.arange(0, B)
    lc = tl.arange(0, B)
    rmask = (r0 + lr) < R
    cmask = (c0 + lc) < C
    mask = rmask[:, None] & cmask[None, :]
    x = load_f32(x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc + tile_offsets(lr, lc, sxr, sxc),
                 mask, DTYPE)
    if TWO_D:
        scale = current_scale(amax_nan(amax_nan(x, 1), 0), eps, FP8_MAX, POW2)
        code = fp8_encode(x * scale, FP8_MAX, MBITS, BIAS, HW)
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        if ROW:
            tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
            tl.store(rs_ptr + pr * tl.cdiv(C, B) + pc, inv)
        elif ANCHOR:  # never stores (R >= 0): keeps the natural load layout, see triton_fp8_tensorwise
            tl.store(rd_ptr + tile_offsets(lr, lc, C, 1), code, mask=mask & ((lr[:, None] * 0 + R) < 0))
        if COL:
            store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
            tl.store(cs_ptr + pc * tl.cdiv(R, B) + pr, inv)
    else:
        if ROW:
            scale = current_scale(amax_nan(x, 1), eps, FP8_MAX, POW2)  # [B], one per row
            code = fp8_encode(x * scale[:, None], FP8_MAX, MBITS, BIAS, HW)
            tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
            tl.store(rs_ptr + (r0 + lr).to(tl.int64) * tl.cdiv(C, B) + pc,
                     tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=rmask)
        if COL:
            scale = current_scale(amax_nan(x, 0), eps, FP8_MAX, POW2)  # [B], one per column
            code = fp8_encode(x * scale[None, :], FP8_MAX, MBITS, BIAS, HW)
            store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
            tl.store(cs_ptr + (c0 + lc).to(tl.int64) * tl.cdiv(R, B) + pr,
                     tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=cmask)


def quantize(x2: torch.Tensor, dtype: torch.dtype, *, block_dim: int = 1, block_size: int = 128,
             power_2_scale: bool = True, eps: float = 0.0, rowwise: bool = True,
             columnwise: bool = True, chunk: Optional[int] = None, row_slice: int = 16,
             num_warps: Optional[int] = None, pack: bool = True, method: Optional[str] = None) -> Copies:
    """FP8-block-quantize 2D ``x2`` (any strides); returns ``(row, col)``, each
    ``(data, scale_inv)`` or None, equal to ``formats.fp8_block.quantize_1d(x2)`` /
    ``quantize_1d(x2.t())`` (``block_dim=2``: ``quantize_2d(x2)`` and its transpose).
    One ``block_size``-square tile per program. 1D: rowwise copy in ``row_slice``-row slices,
    columnwise copy in ``chunk``-column passes (default min(128, B) / 4 warps: one column per
    thread). 2D: walked in ``chunk``-column slices (default 16 / 4 warps: the H200 sweep's
    fastest). ``pack``: transposed stores as int32 words of four rows when R % 4 == 0 (same bytes).
    ``method="tile"``: one whole tile in registers instead (``chunk`` / ``row_slice`` unused;
    :func:`_fp8_block_tile_kernel`); the same bits. Default: "tile" for 2D (one amax per tile:
    0.110 ms vs 0.239 ms at 16384x4096 BF16 row+col on the H200, 8 warps), "slices" for 1D (the
    whole-tile kernel's per-column amax across warps made it slower: 0.24 vs 0.185 ms).
    (A 1D columnwise pass holding a column's 128 rows in registers, one read instead of two,
    measured 0.198 vs 0.177 ms row+col on the H200: not kept.)
    """
    method = method or ("tile" if block_dim == 2 else "slices")
    if method not in ("slices", "tile"):
        raise ValueError(f"method={method!r} is unknown; use 'slices' or 'tile'.")
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim={block_dim} must be 1 or 2.")
    b = block_size
    if b < 32 or b & (b - 1):
        raise ValueError(f"block_size={b} must be a power of two >= 32.")
    cw = min(chunk or (16 if block_dim == 2 else 128), b)
    rw = min(row_slice, b)
    if b % cw or b % rw:
        raise ValueError(f"chunk={chunk} and row_slice={row_slice} must divide block_size={b}.")
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
    grid = (triton.cdiv(rows, b) * triton.cdiv(cols, b),)
    if method == "tile":
        _fp8_block_tile_kernel[grid](
            kernel_input(x2), rd, rs, cd, cs, rows, cols, x2.stride(0), x2.stride(1), f32(eps), ROW=rowwise,
            COL=columnwise, POW2=power_2_scale, TWO_D=block_dim == 2, MBITS=mbits, BIAS=bias, FP8_MAX=fmax, B=b,
            DTYPE=DTYPE_CODE[x2.dtype], HW=hw_fp8(dev), PACK=pack and rows % 4 == 0, ANCHOR=not rowwise,
            num_warps=num_warps or 8)
        return row, col
    kernel = _fp8_block_2d_kernel if block_dim == 2 else _fp8_block_1d_kernel
    kernel[grid](kernel_input(x2), rd, rs, cd, cs, rows, cols, x2.stride(0), x2.stride(1), f32(eps),
                 ROW=rowwise, COL=columnwise, POW2=power_2_scale, MBITS=mbits, BIAS=bias,
                 FP8_MAX=fmax, B=b, DTYPE=DTYPE_CODE[x2.dtype], CW=cw, HW=hw_fp8(dev),
                 PACK=pack and rows % 4 == 0, RW=rw, num_warps=num_warps or 4)
    return row, col
