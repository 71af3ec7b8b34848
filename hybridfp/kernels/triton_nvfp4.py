"""NVFP4 quantize kernels (SPEC §2.5): an amax pass, then one cast pass per tensor.

Pass 1 (``_nvfp4_amax_kernel``): the global amax of x, the per-row amaxes (row-scaled), and
the amax of RHT(xᵀ) rounded to the input dtype (post-RHT amax), all from one read, as int32
atomic maxima of the amax bits.

Pass 2:
- ``_nvfp4_1d_kernel``: rowwise 1x16 blocks from a natural [BR, BC] tile; columnwise 16x1
  blocks of the same tile, packed along the rows and stored transposed; or, with RHT, the
  columnwise copy from 16 row slices of the tile (row ``16 t + i`` of slice i; re-read from
  cache, not from device memory) on which the 16-point transform is plain elementwise FP32
  arithmetic in ``formats.rht``'s exact butterfly order, rounded to the input dtype, then
  block-quantized along the rows and written as one int64 word (16 codes) per column and tile.
- ``_nvfp4_2d_kernel``: 16x16 tiles; the columnwise copy is the rowwise one transposed.

Bitwise equal to ``formats.nvfp4`` / ``formats.rht`` (FP32 order of SPEC §2.5, IEEE divisions,
E4M3 block scales by ``_common.fp8_code``, E2M1 by the midpoint comparator chain). Stochastic
rounding takes the reference's uniform draws as input tensors (``torch.rand`` of each copy's
shape from the same per-direction generator), so it is bitwise too; the draws cost an extra
FP32 write and read per element.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (empty, DTYPE_CODE, FP32_MAX, amax_bits, amax_nan, bf16_nan_bits, clamp_max,
                      clamp_sym, e2m1_code, e2m1_code_sr, e4m3_value, f32_div, fp8_code, kernel_input,
                      load_f32,
                      round_to_dtype)

BLOCK = 16
#: fp32(1/6): the C++ ``1.0f / 6.0f`` of SPEC §2.5.
RCP6 = f32_div(1.0, 6.0)


@triton.jit
def _global_scales(amax_ptr):
    """(S_enc, S_dec) from the global amax(es) at ``amax_ptr`` (``global_encode_scale``)."""
    g = tl.load(amax_ptr)
    s = clamp_max(tl.math.div_rn(tl.full(g.shape, 2688.0, tl.float32), g), 3.4028234663852886e38)
    s_enc = tl.where((g == 0) | (s == 0) | (g != g), 1.0, s)
    return s_enc, tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), s_enc)


@triton.jit
def _block_scales(block_amax, s_enc, s_dec, RCP6):
    """(E4M3 S_dec_b code byte, FP32 encode scale) of block amaxes (SPEC §2.5 order)."""
    sdb = fp8_code(clamp_sym(block_amax * (s_enc * RCP6), 448.0), 3, 7)
    enc = tl.math.div_rn(tl.full(block_amax.shape, 1.0, tl.float32), e4m3_value(sdb) * s_dec)
    return sdb, clamp_max(enc, 3.4028234663852886e38)


@triton.jit
def _pack_last(codes, N: tl.constexpr, M: tl.constexpr):
    """[N, M] int32 codes -> [N, M/2] uint8, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, [N, M // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
           DTYPE: tl.constexpr, BF16_NAN: tl.constexpr):
    """``formats.rht.apply_rht`` on 16 elementwise slices: signs, butterfly h = 1, 2, 4, 8,
    * 0.25, round to the input dtype (every step in the reference's FP32 order)."""
    x0, x1, x2, x3 = x0 * 1.0, x1 * 1.0, x2 * 1.0, x3 * -1.0
    x4, x5, x6, x7 = x4 * 1.0, x5 * -1.0, x6 * -1.0, x7 * -1.0
    x8, x9, x10, x11 = x8 * -1.0, x9 * -1.0, x10 * -1.0, x11 * 1.0
    x12, x13, x14, x15 = x12 * -1.0, x13 * 1.0, x14 * -1.0, x15 * -1.0
    x0, x1 = _bf(x0, x1)
    x2, x3 = _bf(x2, x3)
    x4, x5 = _bf(x4, x5)
    x6, x7 = _bf(x6, x7)
    x8, x9 = _bf(x8, x9)
    x10, x11 = _bf(x10, x11)
    x12, x13 = _bf(x12, x13)
    x14, x15 = _bf(x14, x15)
    x0, x2 = _bf(x0, x2)
    x1, x3 = _bf(x1, x3)
    x4, x6 = _bf(x4, x6)
    x5, x7 = _bf(x5, x7)
    x8, x10 = _bf(x8, x10)
    x9, x11 = _bf(x9, x11)
    x12, x14 = _bf(x12, x14)
    x13, x15 = _bf(x13, x15)
    x0, x4 = _bf(x0, x4)
    x1, x5 = _bf(x1, x5)
    x2, x6 = _bf(x2, x6)
    x3, x7 = _bf(x3, x7)
    x8, x12 = _bf(x8, x12)
    x9, x13 = _bf(x9, x13)
    x10, x14 = _bf(x10, x14)
    x11, x15 = _bf(x11, x15)
    x0, x8 = _bf(x0, x8)
    x1, x9 = _bf(x1, x9)
    x2, x10 = _bf(x2, x10)
    x3, x11 = _bf(x3, x11)
    x4, x12 = _bf(x4, x12)
    x5, x13 = _bf(x5, x13)
    x6, x14 = _bf(x6, x14)
    x7, x15 = _bf(x7, x15)
    return (round_to_dtype(x0 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x1 * 0.25, DTYPE, BF16_NAN),
            round_to_dtype(x2 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x3 * 0.25, DTYPE, BF16_NAN),
            round_to_dtype(x4 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x5 * 0.25, DTYPE, BF16_NAN),
            round_to_dtype(x6 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x7 * 0.25, DTYPE, BF16_NAN),
            round_to_dtype(x8 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x9 * 0.25, DTYPE, BF16_NAN),
            round_to_dtype(x10 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x11 * 0.25, DTYPE, BF16_NAN),
            round_to_dtype(x12 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x13 * 0.25, DTYPE, BF16_NAN),
            round_to_dtype(x14 * 0.25, DTYPE, BF16_NAN), round_to_dtype(x15 * 0.25, DTYPE, BF16_NAN))


@triton.jit
def _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, I: tl.constexpr, DTYPE: tl.constexpr):
    """Rows ``base + 16 t + I`` of the tile's columns as a [BT, BC] FP32 slice (0 past R)."""
    r = base + t * 16 + I
    m = (r < R)[:, None] & cmask[None, :]
    return load_f32(x_ptr + r.to(tl.int64)[:, None] * sxr + c64[None, :] * sxc, m, DTYPE)


@triton.jit
def _rht_tile(x_ptr, base, t, c64, cmask, R, sxr, sxc, DTYPE: tl.constexpr,
              BF16_NAN: tl.constexpr):
    """The 16 RHT'd slices of a tile (16 tiles of 16 rows along t, columns c)."""
    return _rht16(_slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 0, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 1, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 2, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 3, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 4, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 5, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 6, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 7, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 8, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 9, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 10, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 11, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 12, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 13, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 14, DTYPE),
                  _slice(x_ptr, base, t, c64, cmask, R, sxr, sxc, 15, DTYPE), DTYPE, BF16_NAN)


@triton.jit
def _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15):
    """Elementwise NaN-propagating max|y_i| over the 16 slices."""
    a = tl.maximum(tl.maximum(tl.maximum(tl.abs(y0), tl.abs(y1)), tl.maximum(tl.abs(y2), tl.abs(y3))),
                   tl.maximum(tl.maximum(tl.abs(y4), tl.abs(y5)), tl.maximum(tl.abs(y6), tl.abs(y7))))
    b = tl.maximum(tl.maximum(tl.maximum(tl.abs(y8), tl.abs(y9)), tl.maximum(tl.abs(y10), tl.abs(y11))),
                   tl.maximum(tl.maximum(tl.abs(y12), tl.abs(y13)), tl.maximum(tl.abs(y14), tl.abs(y15))))
    n = ((y0 != y0) | (y1 != y1) | (y2 != y2) | (y3 != y3) | (y4 != y4) | (y5 != y5) | (y6 != y6)
         | (y7 != y7) | (y8 != y8) | (y9 != y9) | (y10 != y10) | (y11 != y11) | (y12 != y12)
         | (y13 != y13) | (y14 != y14) | (y15 != y15))
    return tl.where(n, float("nan"), tl.maximum(a, b))


@triton.jit
def _codes(v, rand_ptrs, mask, SR: tl.constexpr):
    """E2M1 codes of scaled, clamped values: RNE, or stochastic with draws at ``rand_ptrs``."""
    if SR:
        return e2m1_code_sr(v, tl.load(rand_ptrs, mask=mask, other=0.0))
    else:
        return e2m1_code(v)


@triton.jit
def _pair_word(ya, yb, enc, rc_ptr, c64, rr, L, SR: tl.constexpr, SHIFT: tl.constexpr):
    """Codes of rows ``rr + 2 SHIFT`` and ``+ 1`` of the RHT'd copy (a [BT, BC] slice each)
    packed in one byte, placed at byte SHIFT of an int64. SR draws: rand [C, L] at (c, row)."""
    m = (rr < L)[:, None]
    pa = rc_ptr + c64[None, :] * L + (rr + 2 * SHIFT)[:, None]
    ca = _codes(clamp_sym(ya * enc, 6.0), pa, m, SR)
    cb = _codes(clamp_sym(yb * enc, 6.0), pa + 1, m, SR)
    return (ca | (cb << 4)).to(tl.int64) << (8 * SHIFT)


@triton.jit
def _nvfp4_amax_kernel(x_ptr, amax_ptr, row_amax_ptr, rht_amax_ptr, R, C, sxr, sxc,
                       AMAX: tl.constexpr, ROW_AMAX: tl.constexpr, RHT_AMAX: tl.constexpr,
                       DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, BT: tl.constexpr,
                       BC: tl.constexpr):
    """Tile amaxes folded (int32 atomic max of the bits) into the global / per-row / post-RHT
    amax buffers. Tiles are [16 BT, BC]."""
    BR: tl.constexpr = 16 * BT
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    pr = pid // nc
    rows = pr * BR + tl.arange(0, BR)
    cols = (pid % nc) * BC + tl.arange(0, BC)
    c64 = cols.to(tl.int64)
    cmask = cols < C
    if AMAX or ROW_AMAX:
        mask = (rows < R)[:, None] & cmask[None, :]
        x = load_f32(x_ptr + rows.to(tl.int64)[:, None] * sxr + c64[None, :] * sxc, mask, DTYPE)
        ra = amax_nan(x, 1)
        if AMAX:
            tl.atomic_max(amax_ptr, amax_bits(amax_nan(ra, 0)))
        if ROW_AMAX:
            tl.atomic_max(row_amax_ptr + rows, amax_bits(ra), mask=rows < R)
    if RHT_AMAX:
        t = tl.arange(0, BT)
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht_tile(
            x_ptr, pr * BR, t, c64, cmask, R, sxr, sxc, DTYPE, BF16_NAN)
        a = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
        tl.atomic_max(rht_amax_ptr, amax_bits(amax_nan(amax_nan(a, 1), 0)))


@triton.jit
def _nvfp4_1d_kernel(x_ptr, ramax_ptr, camax_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, rr_ptr, rc_ptr,
                     R, C, sxr, sxc, RCP6, ROW: tl.constexpr, COL: tl.constexpr,
                     ROW_SCALED: tl.constexpr, SR: tl.constexpr,
                     RHT: tl.constexpr, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
    BR: tl.constexpr = 16 * BT
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    pr = pid // nc
    pc = pid % nc
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    cmask = cols < C
    mask = (rows < R)[:, None] & cmask[None, :]
    if ROW or (COL and not RHT):
        x = load_f32(x_ptr + r64[:, None] * sxr + c64[None, :] * sxc, mask, DTYPE)
    if ROW:
        if ROW_SCALED:
            s_enc, s_dec = _global_scales(ramax_ptr + tl.minimum(rows, R - 1))
            s_enc = s_enc[:, None]
            s_dec = s_dec[:, None]
        else:
            s_enc, s_dec = _global_scales(ramax_ptr)
        xb = tl.reshape(x, [BR, BC // 16, 16])
        sdb, enc = _block_scales(amax_nan(xb, 2), s_enc, s_dec, RCP6)
        v = tl.reshape(clamp_sym(xb * enc[:, :, None], 6.0), [BR, BC])
        codes = tl.where(mask, _codes(v, rr_ptr + r64[:, None] * C + c64[None, :], mask, SR), 0)
        nb = (C + 1) // 2
        bcols = pc * (BC // 2) + tl.arange(0, BC // 2)
        tl.store(rd_ptr + r64[:, None] * nb + bcols[None, :], _pack_last(codes, BR, BC),
                 mask=(rows < R)[:, None] & (bcols < nb)[None, :])
        nbc = tl.cdiv(C, 16)
        sb = pc * (BC // 16) + tl.arange(0, BC // 16)
        tl.store(rs_ptr + r64[:, None] * nbc + sb[None, :], sdb,
                 mask=(rows < R)[:, None] & (sb < nbc)[None, :])
    if COL:
        s_enc, s_dec = _global_scales(camax_ptr)
        if RHT:
            t = tl.arange(0, BT)
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht_tile(
                x_ptr, pr * BR, t, c64, cmask, R, sxr, sxc, DTYPE, BF16_NAN)
            sdb, enc = _block_scales(
                _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15),
                s_enc, s_dec, RCP6)  # [BT, BC]
            ntiles = tl.cdiv(R, 16)
            rr = pr * BR + t * 16  # first row of each tile in the RHT'd (padded) copy
            L = ntiles * 16
            w = _pair_word(y0, y1, enc, rc_ptr, c64, rr, L, SR, 0)
            w |= _pair_word(y2, y3, enc, rc_ptr, c64, rr, L, SR, 1)
            w |= _pair_word(y4, y5, enc, rc_ptr, c64, rr, L, SR, 2)
            w |= _pair_word(y6, y7, enc, rc_ptr, c64, rr, L, SR, 3)
            w |= _pair_word(y8, y9, enc, rc_ptr, c64, rr, L, SR, 4)
            w |= _pair_word(y10, y11, enc, rc_ptr, c64, rr, L, SR, 5)
            w |= _pair_word(y12, y13, enc, rc_ptr, c64, rr, L, SR, 6)
            w |= _pair_word(y14, y15, enc, rc_ptr, c64, rr, L, SR, 7)
            tix = pr * BT + t
            tmask = cmask[:, None] & (tix < ntiles)[None, :]
            tl.store(cd_ptr + c64[:, None] * ntiles + tix[None, :], tl.trans(w), mask=tmask)
            tl.store(cs_ptr + c64[:, None] * ntiles + tix[None, :], tl.trans(sdb), mask=tmask)
        else:
            xb = tl.reshape(x, [BT, 16, BC])
            sdb, enc = _block_scales(amax_nan(xb, 1), s_enc, s_dec, RCP6)  # [BT, BC]
            v = tl.reshape(clamp_sym(xb * enc[:, None, :], 6.0), [BR, BC])
            codes = _codes(v, rc_ptr + c64[None, :] * R + r64[:, None], mask, SR)  # rand [C, R]
            codes = tl.trans(tl.where(mask, codes, 0))  # [BC, BR]
            nb = (R + 1) // 2
            brows = pr * (BR // 2) + tl.arange(0, BR // 2)
            tl.store(cd_ptr + c64[:, None] * nb + brows[None, :], _pack_last(codes, BC, BR),
                     mask=cmask[:, None] & (brows < nb)[None, :])
            nbr = tl.cdiv(R, 16)
            sb = pr * BT + tl.arange(0, BT)
            tl.store(cs_ptr + c64[:, None] * nbr + sb[None, :], tl.trans(sdb),
                     mask=cmask[:, None] & (sb < nbr)[None, :])


@triton.jit
def _nvfp4_2d_kernel(x_ptr, amax_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, rand_ptr, R, C, sxr, sxc,
                     RCP6, ROW: tl.constexpr, COL: tl.constexpr, SR: tl.constexpr,
                     DTYPE: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr):
    BR: tl.constexpr = 16 * BT
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    pr = pid // nc
    pc = pid % nc
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    cmask = cols < C
    mask = (rows < R)[:, None] & cmask[None, :]
    x = load_f32(x_ptr + r64[:, None] * sxr + c64[None, :] * sxc, mask, DTYPE)
    s_enc, s_dec = _global_scales(amax_ptr)
    xb = tl.reshape(x, [BT, 16, BC // 16, 16])
    sdb, enc = _block_scales(amax_nan(amax_nan(xb, 3), 1), s_enc, s_dec, RCP6)  # [BT, BC/16]
    v = tl.reshape(clamp_sym(xb * enc[:, None, :, None], 6.0), [BR, BC])
    codes = tl.where(mask, _codes(v, rand_ptr + r64[:, None] * C + c64[None, :], mask, SR), 0)
    nbr = tl.cdiv(R, 16)
    nbc = tl.cdiv(C, 16)
    sr = pr * BT + tl.arange(0, BT)
    sc = pc * (BC // 16) + tl.arange(0, BC // 16)
    smask = (sr < nbr)[:, None] & (sc < nbc)[None, :]
    if ROW:
        nb = (C + 1) // 2
        bcols = pc * (BC // 2) + tl.arange(0, BC // 2)
        tl.store(rd_ptr + r64[:, None] * nb + bcols[None, :], _pack_last(codes, BR, BC),
                 mask=(rows < R)[:, None] & (bcols < nb)[None, :])
        tl.store(rs_ptr + sr[:, None] * nbc + sc[None, :], sdb, mask=smask)
    if COL:
        nb = (R + 1) // 2
        brows = pr * (BR // 2) + tl.arange(0, BR // 2)
        tl.store(cd_ptr + c64[:, None] * nb + brows[None, :], _pack_last(tl.trans(codes), BC, BR),
                 mask=cmask[:, None] & (brows < nb)[None, :])
        tl.store(cs_ptr + sc[:, None] * nbr + sr[None, :], tl.trans(sdb), mask=tl.trans(smask))


def _launch_args(x2: torch.Tensor, bt: int, bc: int) -> tuple[tuple[int], dict[str, int]]:
    rows, cols = x2.shape
    return (triton.cdiv(rows, 16 * bt) * triton.cdiv(cols, bc),), {"BT": bt, "BC": bc}


def amaxes(x2: torch.Tensor, *, amax: bool = True, row_amax: bool = False, rht_amax: bool = False,
           block: tuple[int, int] = (4, 64)) -> tuple[Optional[torch.Tensor], ...]:
    """Pass 1 on non-empty 2D ``x2``: (global amax 0-d, per-row amax [R], amax of
    ``rht.apply_rht(x2.t(), x2.dtype)`` 0-d), each FP32 or None when not asked for.
    ``block``: (16-row tiles, columns) per program."""
    rows, cols = x2.shape
    dev = x2.device
    out = [torch.zeros(shape, dtype=torch.int32, device=dev) if on else None
           for on, shape in ((amax, ()), (row_amax, (rows,)), (rht_amax, ()))]
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    grid, blk = _launch_args(x2, *block)
    _nvfp4_amax_kernel[grid](kernel_input(x2), *(o if o is not None else dummy for o in out), rows, cols,
                             x2.stride(0), x2.stride(1), AMAX=amax, ROW_AMAX=row_amax,
                             RHT_AMAX=rht_amax, DTYPE=DTYPE_CODE[x2.dtype],
                             BF16_NAN=bf16_nan_bits(dev), **blk, num_warps=8)
    return tuple(o.view(torch.float32) if o is not None else None for o in out)


def _check_rand(rand: Optional[torch.Tensor], shape: tuple[int, int], what: str) -> None:
    if rand is None or rand.dtype != torch.float32 or tuple(rand.shape) != shape or not rand.is_contiguous():
        raise ValueError(f"stochastic rounding needs contiguous FP32 draws of shape {shape} for the "
                         f"{what} copy (torch.rand of the quantized tensor's shape).")


def quantize_1d(x2: torch.Tensor, row_amax: Optional[torch.Tensor], col_amax: Optional[torch.Tensor],
                *, rht: bool = False, stochastic_rounding: bool = False,
                row_rand: Optional[torch.Tensor] = None, col_rand: Optional[torch.Tensor] = None,
                block: tuple[int, int] = (4, 64), num_warps: Optional[int] = None):
    """Pass 2 of 1D NVFP4 on non-empty 2D ``x2``: rowwise copy when ``row_amax`` is given (0-d,
    or [R] for row-scaled), columnwise copy (of ``x2.t()``, RHT'd with ``rht``) when
    ``col_amax`` is given. Returns ``(row, col)``, each ``(packed data, E4M3 scales)`` or None,
    equal to ``formats.nvfp4.quantize_1d(x2, row_amax)`` and
    ``quantize_1d(apply_rht(x2.t(), x2.dtype) if rht else x2.t(), col_amax)``.
    ``stochastic_rounding``: the reference's ``rand=`` draws per copy, ``row_rand`` [R, C] and
    ``col_rand`` [C, R] (RHT: [C, ceil16(R)]), FP32."""
    rows, cols = x2.shape
    dev = x2.device
    row = col = None
    if row_amax is not None:
        row = (empty((rows, (cols + 1) // 2), dtype=torch.uint8, device=dev),
               empty((rows, triton.cdiv(cols, BLOCK)), dtype=torch.float8_e4m3fn, device=dev))
    if col_amax is not None:
        length = triton.cdiv(rows, BLOCK) * BLOCK if rht else rows
        col = (empty((cols, (length + 1) // 2), dtype=torch.uint8, device=dev),
               empty((cols, triton.cdiv(rows, BLOCK)), dtype=torch.float8_e4m3fn, device=dev))
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
    if stochastic_rounding:
        if row:
            _check_rand(row_rand, (rows, cols), "rowwise")
        if col:
            _check_rand(col_rand, (cols, triton.cdiv(rows, BLOCK) * BLOCK if rht else rows), "columnwise")
    # The RHT copy is written as int64 words (16 codes each); its rows are 8 * ntiles bytes.
    cd = (col[0].view(torch.int64) if rht else col[0]) if col else dummy
    grid, blk = _launch_args(x2, *block)
    extra = {"num_warps": num_warps or 8}
    _nvfp4_1d_kernel[grid](
        kernel_input(x2), row_amax.float().contiguous() if row else dummy_f,
        col_amax.float().contiguous() if col else dummy_f,
        row[0] if row else dummy, row[1].view(torch.uint8) if row else dummy, cd,
        col[1].view(torch.uint8) if col else dummy,
        row_rand if stochastic_rounding and row else dummy_f,
        col_rand if stochastic_rounding and col else dummy_f,
        rows, cols, x2.stride(0), x2.stride(1), RCP6, ROW=row is not None, COL=col is not None,
        ROW_SCALED=row_amax is not None and row_amax.dim() == 1, SR=stochastic_rounding, RHT=rht,
        DTYPE=DTYPE_CODE[x2.dtype], BF16_NAN=bf16_nan_bits(dev), **blk, **extra)
    return row, col


def quantize_2d(x2: torch.Tensor, amax: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                rand: Optional[torch.Tensor] = None, block: tuple[int, int] = (4, 64),
                num_warps: Optional[int] = None):
    """16x16-tile NVFP4 of non-empty 2D ``x2`` with global ``amax`` (0-d): ``(row, col)``, each
    ``(packed data, E4M3 scales)`` or None; ``row`` equals ``formats.nvfp4.quantize_2d(x2, amax)``,
    ``col`` its transpose (codes and tile scales). ``rand`` [R, C] FP32: stochastic rounding
    with those draws (one quantization serves both copies, as in the reference)."""
    rows, cols = x2.shape
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
    if rand is not None:
        _check_rand(rand, (rows, cols), "2D")
    grid, blk = _launch_args(x2, *block)
    extra = {"num_warps": num_warps or 8}
    _nvfp4_2d_kernel[grid](
        kernel_input(x2), amax.float().contiguous(), row[0] if row else dummy,
        row[1].view(torch.uint8) if row else dummy,
        col[0] if col else dummy, col[1].view(torch.uint8) if col else dummy,
        rand if rand is not None else dummy, rows, cols, x2.stride(0), x2.stride(1), RCP6,
        ROW=rowwise, COL=columnwise, SR=rand is not None, DTYPE=DTYPE_CODE[x2.dtype],
        **blk, **extra)
    return row, col


__all__ = ["FP32_MAX", "RCP6", "amaxes", "quantize_1d", "quantize_2d"]
