"""NVFP4 quantize kernels (numerics §2.5): an amax pass, then one cast pass per tensor.

Pass 1 (``_nvfp4_amax_kernel``): the global amax of x, the per-row amaxes (row-scaled), and
the amax of RHT(xᵀ) rounded to the input dtype (post-RHT amax), all from one read, as int32
atomic maxima of the amax bits. The post-RHT amax is taken over the raw butterfly sums and
scaled and rounded once per tile (rounding is monotone, so that is the amax of the rounded
transform), not per element.

Pass 2 (``_nvfp4_1d_kernel``, one [16 BT, BC] tile per program): the rowwise 1x16 copy and the
columnwise 16x1 copy (optionally RHT'd) of the tile, by ``triton_nvfp4_tile``'s
``row_copy`` / ``col_copy_words`` / ``col_copy_bytes`` (the 16 row slices and the transform:
``triton_nvfp4_rht``). ``_nvfp4_2d_kernel``: 16x16 tiles; the columnwise copy is the rowwise
one transposed.

Bitwise equal to ``formats.nvfp4`` / ``formats.rht``, with tile-local int32 offsets and the
hardware E4M3 conversion on the GPU (``_common``, ``_common_encode``). Stochastic rounding draws
its uniforms in the kernel (Philox, ``triton_sr``: the stream is defined there and is not
the reference's ``torch.rand`` stream, for the reasons given there); with the same draws
(``triton_sr.reference_draws`` passed as ``rand=``) the codes equal the reference's bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (DTYPE_CODE, amax_bits, amax_nan, check_int32_tiles, empty, kernel_input, load_f32,
                      program_tile, tile_offsets)
from ._common_encode import bf16_nan_bits, hw_fp8
from .triton_nvfp4_rht import amax16, rht16, rht_prescale, round_in, saturate, tile_slices
from .triton_nvfp4_tile import (BLOCK, RCP6, block_scales, col_copy_bytes, col_copy_words, e2m1_code_sat_or_sr,
                                global_scales, pack_last, row_copy, tile_1d)
from .triton_sr import draw_at, sr_key

@triton.jit
def _nvfp4_amax_kernel(x_ptr, amax_ptr, row_amax_ptr, rht_amax_ptr, R, C, sxr, sxc: tl.constexpr,
                       AMAX: tl.constexpr, ROW_AMAX: tl.constexpr, RHT_AMAX: tl.constexpr,
                       DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, BT: tl.constexpr,
                       BC: tl.constexpr, HW: tl.constexpr = False):
    """Tile amaxes folded (int32 atomic max of the bits) into the global / per-row / post-RHT
    amax buffers. Tiles are [16 BT, BC]."""
    BR: tl.constexpr = 16 * BT
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    cmask = (c0 + lc) < C
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    if AMAX or ROW_AMAX:
        mask = ((r0 + lr) < R)[:, None] & cmask[None, :]
        if DTYPE == 1:
            # BF16: max of the raw magnitude bits (BF16 orders like its bits, as FP32 does), no
            # widening of each element to FP32 first (one AND per element, not three ops)
            raw = tl.load(xbase + tile_offsets(lr, lc, sxr, sxc), mask=mask, other=0)
            mb = tl.max(raw.to(tl.int32) & 0x7FFF, axis=1)
            ra = tl.where(mb > 0x7F80, 0x7FC00000, mb << 16).to(tl.float32, bitcast=True)  # NaN: canonical
        else:
            ra = amax_nan(load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE), 1)
        if AMAX:
            tl.atomic_max(amax_ptr, amax_bits(amax_nan(ra, 0)))
        if ROW_AMAX:
            tl.atomic_max(row_amax_ptr + r0 + lr, amax_bits(ra), mask=(r0 + lr) < R)
    if RHT_AMAX:
        # Scaling, saturation and rounding are monotone, so max|round(sat(S * q))| =
        # round(sat(max(max|S| * q))): the butterfly sums S are reduced raw per 16-element
        # tile, scaled by that tile's q, and the tile's amax is saturated and rounded once.
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = tile_slices(
            xbase, tl.arange(0, BT), lc, R - r0, cmask, sxr, sxc, False, DTYPE, BF16_NAN, HW)
        p, q, m = rht_prescale(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, DTYPE)
        h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15 = rht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, p, q, m, DTYPE, BF16_NAN, HW,
            True)
        t = saturate(amax16(h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15) * q, m)
        a = amax_nan(amax_nan(t, 1), 0)
        tl.atomic_max(rht_amax_ptr, amax_bits(round_in(a, DTYPE, BF16_NAN, HW)))


@triton.jit(do_not_specialize=["rk0", "rk1", "ck0", "ck1"])
def _nvfp4_1d_kernel(x_ptr, ramax_ptr, camax_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr,
                     R, C, sxr, sxc: tl.constexpr, RCP6, rk0, rk1, ck0, ck1, ROW: tl.constexpr, COL: tl.constexpr,
                     ROW_SCALED: tl.constexpr, SR: tl.constexpr, RHT: tl.constexpr,
                     ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr, HW: tl.constexpr,
                     DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr):
    r0, c0, lr, lc, xbase, mask = tile_1d(x_ptr, R, C, sxr, sxc, BT, BC)
    if ROW or (COL and not COL_WORDS):
        x = load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE)
    if ROW:
        if ROW_SCALED:
            s_enc, s_dec = global_scales(ramax_ptr + tl.minimum(r0 + lr, R - 1))
            s_enc = s_enc[:, None]
            s_dec = s_dec[:, None]
        else:
            s_enc, s_dec = global_scales(ramax_ptr)
        row_copy(x, r0, c0, lr, lc, R, C, s_enc, s_dec, rd_ptr, rs_ptr, rk0, rk1, RCP6,
                  SR, ROW_WORDS, HW, 16 * BT, BC)
    if COL:
        s_enc, s_dec = global_scales(camax_ptr)
        if COL_WORDS:
            col_copy_words(xbase, r0, c0, lc, R, C, sxr, sxc, s_enc, s_dec,
                            cd_ptr.to(tl.pointer_type(tl.int64)), cs_ptr, ck0, ck1, RCP6, SR, RHT, HW,
                            DTYPE, BF16_NAN, BT)
        else:
            col_copy_bytes(x, r0, c0, lr, lc, R, C, s_enc, s_dec, cd_ptr, cs_ptr, ck0, ck1, RCP6,
                            SR, HW, BT, BC)


@triton.jit(do_not_specialize=["k0", "k1"])
def _nvfp4_2d_kernel(x_ptr, amax_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr,
                     RCP6, k0, k1, ROW: tl.constexpr, COL: tl.constexpr, SR: tl.constexpr,
                     HW: tl.constexpr, DTYPE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    BR: tl.constexpr = 16 * BT
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    rows = r0 + lr
    cols = c0 + lc
    cmask = cols < C
    mask = (rows < R)[:, None] & cmask[None, :]
    x = load_f32(x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc + tile_offsets(lr, lc, sxr, sxc),
                 mask, DTYPE)
    s_enc, s_dec = global_scales(amax_ptr)
    xb = tl.reshape(x, [BT, 16, BC // 16, 16])
    sdb, enc = block_scales(amax_nan(amax_nan(xb, 3), 1), s_enc, s_dec, RCP6, HW)  # [BT, BC/16]
    v = tl.reshape(xb * enc[:, None, :, None], [BR, BC])
    if SR:
        u = draw_at(rows[:, None], cols[None, :], k0, k1)  # 2D SR (no recipe uses it): per element
    else:
        u = v
    codes = tl.where(mask, e2m1_code_sat_or_sr(v, u, SR), 0)
    nbr = tl.cdiv(R, 16)
    nbc = tl.cdiv(C, 16)
    sr = pr * BT + tl.arange(0, BT)
    sc = pc * (BC // 16) + tl.arange(0, BC // 16)
    smask = (sr < nbr)[:, None] & (sc < nbc)[None, :]
    if ROW:
        nb = (C + 1) // 2
        lb = tl.arange(0, BC // 2)
        tl.store(rd_ptr + r0.to(tl.int64) * nb + c0 // 2 + tile_offsets(lr, lb, nb, 1),
                 pack_last(codes, BR, BC), mask=(rows < R)[:, None] & ((c0 // 2 + lb) < nb)[None, :])
        tl.store(rs_ptr + sr[:, None] * nbc + sc[None, :], sdb, mask=smask)
    if COL:
        nb = (R + 1) // 2
        lb = tl.arange(0, BR // 2)
        tl.store(cd_ptr + c0.to(tl.int64) * nb + r0 // 2 + tile_offsets(lc, lb, nb, 1),
                 pack_last(tl.trans(codes), BC, BR), mask=cmask[:, None] & ((r0 // 2 + lb) < nb)[None, :])
        tl.store(cs_ptr + sc[:, None] * nbr + sr[None, :], tl.trans(sdb), mask=tl.trans(smask))


def _launch_args(x2: torch.Tensor, bt: int, bc: int) -> tuple[tuple[int], dict[str, int]]:
    rows, cols = x2.shape
    return (triton.cdiv(rows, 16 * bt) * triton.cdiv(cols, bc),), {"BT": bt, "BC": bc}


def amaxes(x2: torch.Tensor, *, amax: bool = True, row_amax: bool = False, rht_amax: bool = False,
           block: Optional[tuple[int, int]] = None, num_warps: Optional[int] = None
           ) -> tuple[Optional[torch.Tensor], ...]:
    """Pass 1 on non-empty 2D ``x2``: (global amax 0-d, per-row amax [R], amax of
    ``rht.apply_rht(x2.t(), x2.dtype)`` 0-d), each FP32 or None when not asked for.
    ``block``: (16-row tiles, columns) per program. Defaults: with the post-RHT amax (2, 256) /
    4 warps, the fastest on the H200 (the wider tile loads the post-RHT slices as vectors); without it (4, 64) / 8."""
    if block is None:
        block = (2, 256) if rht_amax else (4, 64)
    if num_warps is None:
        num_warps = 4 if rht_amax else 8
    rows, cols = x2.shape
    check_int32_tiles(rows, cols, *x2.stride())
    dev = x2.device
    out = [torch.zeros(shape, dtype=torch.int32, device=dev) if on else None
           for on, shape in ((amax, ()), (row_amax, (rows,)), (rht_amax, ()))]
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    grid, blk = _launch_args(x2, *block)
    _nvfp4_amax_kernel[grid](kernel_input(x2), *(o if o is not None else dummy for o in out), rows, cols,
                             x2.stride(0), x2.stride(1), AMAX=amax, ROW_AMAX=row_amax,
                             RHT_AMAX=rht_amax, DTYPE=DTYPE_CODE[x2.dtype],
                             BF16_NAN=bf16_nan_bits(dev), HW=hw_fp8(dev), **blk, num_warps=num_warps)
    return tuple(o.view(torch.float32) if o is not None else None for o in out)


def quantize_1d(x2: torch.Tensor, row_amax: Optional[torch.Tensor], col_amax: Optional[torch.Tensor],
                *, rht: bool = False, seed: Optional[int] = None, block: Optional[tuple[int, int]] = None,
                num_warps: Optional[int] = None):
    """Pass 2 of 1D NVFP4 on non-empty 2D ``x2``: rowwise copy when ``row_amax`` is given (0-d,
    or [R] for row-scaled), columnwise copy (of ``x2.t()``, RHT'd with ``rht``) when
    ``col_amax`` is given. Returns ``(row, col)``, each ``(packed data, E4M3 scales)`` or None,
    equal to ``formats.nvfp4.quantize_1d(x2, row_amax)`` and
    ``quantize_1d(apply_rht(x2.t(), x2.dtype) if rht else x2.t(), col_amax)``.
    ``seed``: stochastic rounding with the Philox stream of ``triton_sr`` (rowwise copy:
    direction 0, columnwise: 1), i.e. the reference with ``rand=triton_sr.reference_draws``.
    ``block``: (16-row tiles, columns) per program; default (2, 128) / 4 warps, the fastest with
    and without RHT / stochastic rounding on an NVIDIA H200."""
    rows, cols = x2.shape
    check_int32_tiles(rows, cols, *x2.stride())
    dev = x2.device
    row = col = None
    if row_amax is not None:
        row = (empty((rows, (cols + 1) // 2), dtype=torch.uint8, device=dev),
               empty((rows, triton.cdiv(cols, BLOCK)), dtype=torch.float8_e4m3fn, device=dev))
    if col_amax is not None:
        length = triton.cdiv(rows, BLOCK) * BLOCK if rht else rows
        col = (empty((cols, (length + 1) // 2), dtype=torch.uint8, device=dev),
               empty((cols, triton.cdiv(rows, BLOCK)), dtype=torch.float8_e4m3fn, device=dev))
    dummy = torch.empty(1, dtype=torch.int64, device=dev)
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
    sr = seed is not None
    rk = sr_key(seed, 0) if sr else (0, 0)
    ck = sr_key(seed, 1) if sr else (0, 0)
    grid, blk = _launch_args(x2, *(block or (2, 128)))
    extra = {"num_warps": num_warps or 4}
    _nvfp4_1d_kernel[grid](
        kernel_input(x2), row_amax.float().contiguous() if row else dummy_f,
        col_amax.float().contiguous() if col else dummy_f,
        row[0] if row else dummy, row[1].view(torch.uint8) if row else dummy,
        col[0] if col else dummy, col[1].view(torch.uint8) if col else dummy,
        rows, cols, x2.stride(0), x2.stride(1), RCP6, *rk, *ck, ROW=row is not None, COL=col is not None,
        ROW_SCALED=row_amax is not None and row_amax.dim() == 1, SR=sr, RHT=rht,
        ROW_WORDS=cols % 8 == 0, COL_WORDS=rht or rows % 16 == 0, HW=hw_fp8(dev),
        DTYPE=DTYPE_CODE[x2.dtype], BF16_NAN=bf16_nan_bits(dev), **blk, **extra)
    return row, col


def quantize_2d(x2: torch.Tensor, amax: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                seed: Optional[int] = None, block: tuple[int, int] = (4, 64),
                num_warps: Optional[int] = None):
    """16x16-tile NVFP4 of non-empty 2D ``x2`` with global ``amax`` (0-d): ``(row, col)``, each
    ``(packed data, E4M3 scales)`` or None; ``row`` equals ``formats.nvfp4.quantize_2d(x2, amax)``,
    ``col`` its transpose (codes and tile scales). ``seed``: stochastic rounding with the
    Philox stream of ``triton_sr`` (direction 0; one quantization serves both copies, as in
    the reference)."""
    rows, cols = x2.shape
    check_int32_tiles(rows, cols, *x2.stride())
    dev = x2.device
    nbr, nbc = triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK)
    row = col = None
    if rowwise:
        row = (empty((rows, (cols + 1) // 2), dtype=torch.uint8, device=dev),
               empty((nbr, nbc), dtype=torch.float8_e4m3fn, device=dev))
    if columnwise:
        col = (empty((cols, (rows + 1) // 2), dtype=torch.uint8, device=dev),
               empty((nbc, nbr), dtype=torch.float8_e4m3fn, device=dev))
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    grid, blk = _launch_args(x2, *block)
    extra = {"num_warps": num_warps or 8}
    _nvfp4_2d_kernel[grid](
        kernel_input(x2), amax.float().contiguous(), row[0] if row else dummy,
        row[1].view(torch.uint8) if row else dummy,
        col[0] if col else dummy, col[1].view(torch.uint8) if col else dummy,
        rows, cols, x2.stride(0), x2.stride(1), RCP6, *(sr_key(seed, 0) if seed is not None else (0, 0)),
        ROW=rowwise, COL=columnwise, SR=seed is not None, HW=hw_fp8(dev), DTYPE=DTYPE_CODE[x2.dtype],
        **blk, **extra)
    return row, col


__all__ = ["amaxes", "quantize_1d", "quantize_2d"]
