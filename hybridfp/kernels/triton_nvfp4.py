"""NVFP4 quantize kernels (numerics §2.5): an amax pass, then one cast pass per tensor.

Pass 1 (``_nvfp4_amax_kernel``): the global amax of x, the per-row amaxes (row-scaled), and
the amax of RHT(xᵀ) rounded to the input dtype (post-RHT amax), all from one read, as int32
atomic maxima of the amax bits. The post-RHT amax is taken over the raw butterfly sums and
scaled and rounded once per tile (rounding is monotone, so that is the amax of the rounded
transform), not per element.

Pass 2 (``_nvfp4_1d_kernel``, one [16 BT, BC] tile per program):
- rowwise 1x16 blocks from the natural tile; the codes are taken as 8 column lanes
  (columns 8 g + m, register-local splits) and stored as one int32 per 8 columns;
- columnwise 16x1 blocks from 16 row slices of the tile (row ``16 t + i`` of slice i; re-read
  from cache, not from device memory), optionally RHT'd (the 16-point transform is plain
  elementwise FP32 arithmetic in ``formats.rht``'s exact butterfly order, with its pre-scale
  of tiles whose max |x| reaches 2**124, saturated and rounded to the input dtype): a block is
  elementwise across the slices, so there is no cross-thread
  reduction, and its 16 codes are one int64 word stored transposed. Without RHT and with
  R % 16 != 0 (rows not whole words) the natural tile is transposed and packed bytewise.
- ``_nvfp4_2d_kernel``: 16x16 tiles; the columnwise copy is the rowwise one transposed.

Bitwise equal to ``formats.nvfp4`` / ``formats.rht`` (FP32 order of numerics §2.5, IEEE divisions,
E4M3 block scales by ``_common_encode.fp8_encode``, E2M1 by ``_common_encode.e2m1_code_sat`` / ``e2m1_code_sr``,
computed here by the equivalent integer forms :func:`_code_rne` / :func:`_code_sr`), tile-local int32
offsets and the hardware E4M3 conversion on the GPU (``_common``). Stochastic rounding draws
its uniforms in the kernel (Philox, ``triton_sr``: the stream is defined there and is not
the reference's ``torch.rand`` stream, for the reasons given there); with the same draws
(``triton_sr.reference_draws`` passed as ``rand=``) the codes equal the reference's bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (program_tile, empty, DTYPE_CODE, amax_bits, amax_nan, check_int32_tiles, kernel_input, load_f32,
                      tile_offsets)
from ._common_encode import (FP32_MAX, bf16_nan_bits, clamp_max, clamp_sym, e2m1_code_sat, e2m1_code_sr, e4m3_value,
                             f32_div, fp8_encode, hw_fp8, round_to_dtype)
from .triton_sr import draw_at, draws8_u16, sr_key

BLOCK = 16
#: fp32(1/6): the C++ ``1.0f / 6.0f`` of numerics §2.5.
RCP6 = f32_div(1.0, 6.0)


@triton.jit
def global_scales(amax_ptr):
    """(S_enc, S_dec) from the global amax(es) at ``amax_ptr`` (``global_encode_scale``)."""
    g = tl.load(amax_ptr)
    s = clamp_max(tl.math.div_rn(tl.full(g.shape, 2688.0, tl.float32), g), 3.4028234663852886e38)
    s_enc = tl.where((g == 0) | (s == 0) | (g != g), 1.0, s)
    return s_enc, tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), s_enc)


@triton.jit
def _row_scales_kernel(amax_ptr, out_ptr, N, B: tl.constexpr):
    """``out[i] = (S_enc, S_dec)`` of ``amax[i]`` (:func:`global_scales`), for i < N."""
    i = tl.program_id(0) * B + tl.arange(0, B)
    s_enc, s_dec = global_scales(amax_ptr + tl.minimum(i, N - 1))
    tl.store(out_ptr + 2 * i, s_enc, mask=i < N)
    tl.store(out_ptr + 2 * i + 1, s_dec, mask=i < N)


def row_scales(amax: torch.Tensor) -> torch.Tensor:
    """[N, 2] FP32 (S_enc, S_dec) of the [N] FP32 amaxes, by :func:`global_scales` (bitwise the
    kernels' own): a row-scaled kernel then loads a row's scales instead of dividing twice in
    every thread that holds part of the row (~9 instructions an element in the fused NVFP4 +
    MXFP8 kernel's (32, 64) tiles)."""
    n = amax.numel()
    out = torch.empty((n, 2), dtype=torch.float32, device=amax.device)
    if n:
        _row_scales_kernel[(triton.cdiv(n, 1024),)](amax.float().contiguous(), out, n, B=1024, num_warps=4)
    return out


@triton.jit
def block_scales(block_amax, s_enc, s_dec, RCP6, HW: tl.constexpr):
    """(E4M3 S_dec_b code byte, FP32 encode scale) of block amaxes (numerics §2.5 order)."""
    sdb, enc, _ = block_scales_dec(block_amax, s_enc, s_dec, RCP6, HW)
    return sdb, enc


@triton.jit
def block_scales_dec(block_amax, s_enc, s_dec, RCP6, HW: tl.constexpr):
    """:func:`block_scales` and the FP32 value of S_dec_b (exact; NaN for 0x7F / 0xFF)."""
    sdb = fp8_encode(block_amax * (s_enc * RCP6), 448.0, 3, 7, HW)
    if HW:  # the hardware's exact E4M3 -> FP32 conversion (0x7F / 0xFF: NaN), not the bit decode
        dec = sdb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        dec = e4m3_value(sdb)
    enc = tl.math.div_rn(tl.full(block_amax.shape, 1.0, tl.float32), dec * s_dec)
    return sdb, clamp_max(enc, 3.4028234663852886e38), dec


@triton.jit
def pack_last(codes, N: tl.constexpr, M: tl.constexpr):
    """[N, M] int32 codes -> [N, M/2] uint8, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, [N, M // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _round_in(y, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, HW: tl.constexpr):
    """``round_to_dtype``; on the GPU (``HW``) BF16 by the hardware's RNE conversion
    (``cvt.rn.bf16.f32``: subnormals kept, ±inf on overflow) without the NaN select: a NaN
    stays a NaN whose bits no consumer reads (the block amax is a NaN-propagating max made
    the canonical NaN, and GPU arithmetic on a NaN gives the canonical NaN, so the scaled
    NaNs, and with them the codes, do not depend on the payload)."""
    if HW and DTYPE == 1:
        return y.to(tl.bfloat16).to(tl.float32)
    else:
        return round_to_dtype(y, DTYPE, BF16_NAN)


@triton.jit
def _rht_prescale(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                  DTYPE: tl.constexpr):
    """Per 16-element tile (elementwise over the slices), as ``formats.rht._butterfly_scaled``:
    (p, q) = (2**-4, 4) where the tile's max |x| reaches ``formats.rht.PRESCALE_FROM`` (2**124:
    the butterfly's sums could overflow), else (1, 0.25); the saturation bound m: the input
    dtype's max (DTYPE code), inf for a tile holding ±inf (not saturated). NaN: (1, 0.25, max)."""
    a = _amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    big = a >= 2.0**124
    if DTYPE == 1:
        top = 3.3895313892515355e38  # BF16 max (0x7F7F)
    elif DTYPE == 2:
        top = 65504.0
    else:
        top = 3.4028234663852886e38
    return tl.where(big, 0.0625, 1.0), tl.where(big, 4.0, 0.25), tl.where(a == float("inf"), float("inf"), top)


@triton.jit
def _saturate(y, m):
    """clamp(y, -m, m), NaN kept (``formats.rht._butterfly_scaled``'s saturation)."""
    return tl.minimum(tl.maximum(y, -m, propagate_nan=tl.PropagateNan.ALL), m,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rht_out(y, q, m, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, HW: tl.constexpr):
    """A butterfly sum's output: * q, saturated at ±m, rounded to the input dtype."""
    return _round_in(_saturate(y * q, m), DTYPE, BF16_NAN, HW)


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, p, q, m,
           DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, HW: tl.constexpr, RAW: tl.constexpr = False):
    """``formats.rht.apply_rht`` on 16 elementwise slices: signs times the pre-scale ``p``
    (exact, one rounding of x s p as the reference's (x s) p), butterfly h = 1, 2, 4, 8, * ``q``
    (0.25 / p), saturated at ±m and rounded to the input dtype (every step in the reference's
    FP32 order; (p, q, m) from :func:`_rht_prescale`). ``RAW``: the butterfly's FP32 sums only (no
    * q, no rounding: the amax pass scales its per-tile amaxes and rounds once)."""
    n = -p
    x0, x1, x2, x3 = x0 * p, x1 * p, x2 * p, x3 * n
    x4, x5, x6, x7 = x4 * p, x5 * n, x6 * n, x7 * n
    x8, x9, x10, x11 = x8 * n, x9 * n, x10 * n, x11 * p
    x12, x13, x14, x15 = x12 * n, x13 * p, x14 * n, x15 * n
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
    if RAW:
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15
    return (_rht_out(x0, q, m, DTYPE, BF16_NAN, HW), _rht_out(x1, q, m, DTYPE, BF16_NAN, HW),
            _rht_out(x2, q, m, DTYPE, BF16_NAN, HW), _rht_out(x3, q, m, DTYPE, BF16_NAN, HW),
            _rht_out(x4, q, m, DTYPE, BF16_NAN, HW), _rht_out(x5, q, m, DTYPE, BF16_NAN, HW),
            _rht_out(x6, q, m, DTYPE, BF16_NAN, HW), _rht_out(x7, q, m, DTYPE, BF16_NAN, HW),
            _rht_out(x8, q, m, DTYPE, BF16_NAN, HW), _rht_out(x9, q, m, DTYPE, BF16_NAN, HW),
            _rht_out(x10, q, m, DTYPE, BF16_NAN, HW), _rht_out(x11, q, m, DTYPE, BF16_NAN, HW),
            _rht_out(x12, q, m, DTYPE, BF16_NAN, HW), _rht_out(x13, q, m, DTYPE, BF16_NAN, HW),
            _rht_out(x14, q, m, DTYPE, BF16_NAN, HW), _rht_out(x15, q, m, DTYPE, BF16_NAN, HW))


@triton.jit
def _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, I: tl.constexpr, DTYPE: tl.constexpr):
    """Tile rows ``16 lt + I`` (tile-local; ``rmax`` rows left in the tensor from the tile
    origin) of the tile's columns ``lc`` as a [BT, BC] FP32 slice (0 past the end)."""
    r = lt * 16 + I
    m = (r < rmax)[:, None] & cmask[None, :]
    return load_f32(xbase + tile_offsets(r, lc, sxr, sxc), m, DTYPE)


@triton.jit
def _tile_slices(xbase, lt, lc, rmax, cmask, sxr, sxc, RHT: tl.constexpr, DTYPE: tl.constexpr,
                 BF16_NAN: tl.constexpr, HW: tl.constexpr):
    """The 16 row slices of a tile (16-row groups along lt, columns lc), RHT'd with ``RHT``."""
    x0 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 0, DTYPE)
    x1 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 1, DTYPE)
    x2 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 2, DTYPE)
    x3 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 3, DTYPE)
    x4 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 4, DTYPE)
    x5 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 5, DTYPE)
    x6 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 6, DTYPE)
    x7 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 7, DTYPE)
    x8 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 8, DTYPE)
    x9 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 9, DTYPE)
    x10 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 10, DTYPE)
    x11 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 11, DTYPE)
    x12 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 12, DTYPE)
    x13 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 13, DTYPE)
    x14 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 14, DTYPE)
    x15 = _slice(xbase, lt, lc, rmax, cmask, sxr, sxc, 15, DTYPE)
    if RHT:
        p, q, m = _rht_prescale(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, DTYPE)
        return _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, p, q, m, DTYPE,
                      BF16_NAN, HW)
    else:
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _zero_like(y):
    """Zeros shaped like FP32 ``y`` that the layout passes see as computed from ``y`` (LLVM folds
    them away): index tensors built on them get ``y``'s register layout, so values computed
    from those indices (the Philox draws) need no shared-memory conversion to meet ``y``."""
    return tl.minimum(y.to(tl.int32, bitcast=True) & 1, 0)


@triton.jit
def _mx(a, b):
    """max(|a|, |b|) propagating NaN (``max.NaN``, one ``FMNMX.NAN`` with |.| operands; the
    interpreter's ``np.maximum``): a NaN result is a positive NaN."""
    return tl.maximum(tl.abs(a), tl.abs(b), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15):
    """Elementwise NaN-propagating max|y_i| over the 16 slices (a NaN result is a positive NaN
    of unspecified payload: ``block_scales`` and ``amax_nan`` read only that it is NaN)."""
    a = tl.maximum(tl.maximum(_mx(y0, y1), _mx(y2, y3), propagate_nan=tl.PropagateNan.ALL),
                   tl.maximum(_mx(y4, y5), _mx(y6, y7), propagate_nan=tl.PropagateNan.ALL),
                   propagate_nan=tl.PropagateNan.ALL)
    b = tl.maximum(tl.maximum(_mx(y8, y9), _mx(y10, y11), propagate_nan=tl.PropagateNan.ALL),
                   tl.maximum(_mx(y12, y13), _mx(y14, y15), propagate_nan=tl.PropagateNan.ALL),
                   propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _code(v, u, SR: tl.constexpr):
    """E2M1 code of a scaled value (not yet clamped to ±6): RNE (``e2m1_code_sat``: the
    saturation in integers), or stochastic with the draw ``u`` (clamped first)."""
    if SR:
        return e2m1_code_sr(clamp_sym(v, 6.0), u)
    else:
        return e2m1_code_sat(v)


@triton.jit
def _e2m1_mag(v):
    """E2M1 magnitude code (0..7, RNE, saturating at 6) of FP32 ``v``, equal to
    ``e2m1_code_sat(v) & 7`` for every non-NaN ``v``; NaN gives 7 (the caller clears NaN
    blocks: :func:`_nan_words`).

    ``s = min(|v|, 6)`` (minnum: NaN -> 6 on the GPU and in the interpreter); with
    ``E = 2**max(e, 0)`` (e: s's binade), ``s * 2**-22 + E`` is rounded once (RNE) to E's ulp,
    ``2**(e' - 23)``, i.e. s to a multiple of ``2**(e' - 1)``: 0.5 below 2 (the E2M1 grid's
    0, 0.5, 1, 1.5 with the ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2 to the even
    multiple), one fraction bit above. The product is exact (a power-of-two scaling; a
    subnormal product is below E's ulp, so an FMA gives the same sum) and the sum stays in
    E's binade, so its bits are ``E + k`` with k = s / 2**(e' - 1) rounded, and the code is
    ``k + 2 e'``. ~7 instructions instead of the comparator and select chains."""
    e, r = _e2m1_round(v)
    return _e2m1_mag_of(e, r)


@triton.jit
def _e2m1_mag_of(e, r):
    """The magnitude code k + 2 e' from :func:`_e2m1_round`'s (E, r) bits."""
    return r - e + ((e >> 22) - 254)


@triton.jit
def _e2m1_round(v):
    """(E's bits, the rounded sum's bits) of :func:`_e2m1_mag`'s rounding."""
    s = tl.minimum(tl.abs(v), 6.0)
    e = tl.maximum(s.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    r = (s * 2.384185791015625e-07 + e.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return e, r


@triton.jit
def e2m1_rne(v):
    """(E2M1 code (int32, bit 3 = sign), ``q * 2**-22``) of FP32 ``v`` by RNE, saturating at ±6:
    the code is ``e2m1_code_sat(v)`` and q its value (``e2m1_value``), for every non-NaN ``v``
    (NaN: the caller's). ``q * 2**-22`` is the rounded magnitude read back from
    :func:`_e2m1_mag`'s sum, ``r - E`` (exact: r and E share a binade), with v's sign: one
    instruction instead of the code's bit decode. The caller multiplies it by its factor
    times 2**22 (an exact power-of-two scaling), which gives the same product as q times the
    factor: one real number, rounded once."""
    e, r = _e2m1_round(v)
    sign = v.to(tl.int32, bitcast=True) & -0x80000000
    code = _e2m1_mag_of(e, r) | ((sign >> 28) & 8)
    mag = r.to(tl.float32, bitcast=True) - e.to(tl.float32, bitcast=True)
    return code, (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _code_rne(v):
    """:func:`_e2m1_mag` with the sign bit of ``v`` (bit 3): ``e2m1_code_sat(v)`` except NaN."""
    return _e2m1_mag(v) | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _add1_ru(s, HW: tl.constexpr):
    """``s + 1`` rounded toward +inf, for FP32 ``0 <= s <= 6``: on the GPU one ``add.rp.f32``;
    elsewhere the round-to-nearest sum, bumped one ulp where it fell below ``s + 1`` (``t - 1``
    is exact for t in [1, 7], so ``t - 1 < s`` says the rounding went down)."""
    if HW:
        return tl.inline_asm_elementwise("add.rp.f32 $0, $1, 0f3F800000;", "=f,f", [s],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        t = s + 1.0
        return (t.to(tl.int32, bitcast=True) + ((t - 1.0) < s).to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _sr_mag(v, u, HW: tl.constexpr):
    """E2M1 magnitude code (0..7) of FP32 ``v`` by stochastic rounding with the 16-bit draw
    ``u`` (the uniform ``r = u * 2**-16``): ``e2m1_code_sr(clamp_sym(v, 6), r) & 7`` for every
    non-NaN ``v``; NaN gives 7 (the caller clears NaN blocks: :func:`_nan_words`).

    ``s = min(|v|, 6)`` (inf and, on the GPU's minnum, NaN -> 6). With P(x) the position of x
    on the code axis (``2 + 2e + (x - 2**e) / 2**(e - 1)`` in x's binade e, so the FP32 bits of
    x are ``2**22 (P + 252)``), ``big(x) = ((bits(x) + 0x3FFFFF - 64 u) >> 22) - 252`` is
    ``ceil(P(x) - r)``, monotone in P(x); for s >= 1 that is the reference's decision
    ``r * step < s - lo`` (both sides in units of s's ulp: up iff the low 22 bits exceed 64 u).
    Below 1 the grid is fixed-point (step 0.5, code ``ceil(2 s - r)``): with ``t = RU(s + 1)``
    (rounded up to the 2**-23 grid, which the thresholds ``(n + r) / 2`` lie on, so the ceiling
    does not move), ``big(t) - 2 = ceil(2 (t - 1) - r)`` is the code. Each form is at most the
    code where it is not exact (below 1, ``big(s) <= ceil(2 s - r)``; above, P(t) - 2 <= P(s) as
    P's slope is <= 2 on [s, s + 1]), so the code is their max: one rounding add, two integer
    adds and a max instead of the compare-and-select chain."""
    if HW:
        s = tl.minimum(tl.abs(v), 6.0)  # min.f32: NaN -> 6
    else:
        s = tl.minimum(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x40C00000).to(tl.float32, bitcast=True)
    d = -0x3EC00001 - u * 64  # 0x3FFFFF - 64 u - (252 << 22)
    a = s.to(tl.int32, bitcast=True) + d
    b = _add1_ru(s, HW).to(tl.int32, bitcast=True) + (d - 0x800000)
    return tl.maximum(a, b) >> 22


@triton.jit
def _code_sr(v, u, HW: tl.constexpr):
    """:func:`_sr_mag` with the sign bit of ``v`` (bit 3): ``e2m1_code_sr(clamp_sym(v, 6),
    u * 2**-16)`` except NaN."""
    return _sr_mag(v, u, HW) | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _nan_words(w, v):
    """Clear the magnitudes (keep the sign bits) of int32 code words ``w`` whose block's scaled
    element ``v`` is NaN. A scaled value is NaN iff its block's encode scale is NaN (the block
    amax is NaN: the scale is finite and positive otherwise, so no 0 * inf or inf * 0), so
    one element decides a word of one block; the codes of NaN are magnitude 0, as
    ``e2m1_code_sat`` gives."""
    return tl.where(v != v, w & -0x77777778, w)  # 0x88888888


@triton.jit
def _col_half(y0, y1, y2, y3, y4, y5, y6, y7, u0, u1, u2, u3, u4, u5, u6, u7, enc, SR: tl.constexpr,
              HW: tl.constexpr):
    """int32 word of the codes of slices y_i * enc at nibble i (8 elements of a columnwise
    block: a [BT, BC] slice each), RNE or stochastic with draws u_i."""
    if SR:
        v0 = y0 * enc
        w = _code_sr(v0, u0, HW) | (_code_sr(y1 * enc, u1, HW) << 4)
        w |= (_code_sr(y2 * enc, u2, HW) << 8) | (_code_sr(y3 * enc, u3, HW) << 12)
        w |= (_code_sr(y4 * enc, u4, HW) << 16) | (_code_sr(y5 * enc, u5, HW) << 20)
        w |= (_code_sr(y6 * enc, u6, HW) << 24) | (_code_sr(y7 * enc, u7, HW) << 28)
        return _nan_words(w, v0)
    else:
        v0 = y0 * enc
        w = _code_rne(v0) | (_code_rne(y1 * enc) << 4)
        w |= (_code_rne(y2 * enc) << 8) | (_code_rne(y3 * enc) << 12)
        w |= (_code_rne(y4 * enc) << 16) | (_code_rne(y5 * enc) << 20)
        w |= (_code_rne(y6 * enc) << 24) | (_code_rne(y7 * enc) << 28)
        return _nan_words(w, v0)


@triton.jit
def _split8(v, N: tl.constexpr, M: tl.constexpr):
    """[N, M] -> the 8 [N, M/8] tensors of columns 8 g + m, m = 0..7 (register-local splits)."""
    a0, a1 = tl.split(tl.reshape(v, [N, M // 8, 2, 2, 2]))  # last index q of m = 4 h + 2 p + q
    a00, a01 = tl.split(a0)
    a10, a11 = tl.split(a1)
    v0, v4 = tl.split(a00)
    v2, v6 = tl.split(a01)
    v1, v5 = tl.split(a10)
    v3, v7 = tl.split(a11)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _nib(code, col, C, M: tl.constexpr, WORDS: tl.constexpr):
    """Code ``code`` of column ``col`` at nibble M; 0 past C (the odd-width padding nibble)
    unless ``WORDS`` (C % 8 == 0: a stored word never holds a column past C)."""
    if WORDS:
        return code << (4 * M)
    return tl.where(col < C, code, 0) << (4 * M)


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
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _tile_slices(
            xbase, tl.arange(0, BT), lc, R - r0, cmask, sxr, sxc, False, DTYPE, BF16_NAN, HW)
        p, q, m = _rht_prescale(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, DTYPE)
        h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15 = _rht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, p, q, m, DTYPE, BF16_NAN, HW,
            True)
        t = _saturate(_amax16(h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15) * q, m)
        a = amax_nan(amax_nan(t, 1), 0)
        tl.atomic_max(rht_amax_ptr, amax_bits(_round_in(a, DTYPE, BF16_NAN, HW)))


@triton.jit
def _row_copy(x, r0, c0, lr, lc, R, C, s_enc, s_dec, rd_ptr, rs_ptr, k0, k1, RCP6,
              SR: tl.constexpr, WORDS: tl.constexpr, HW: tl.constexpr, BR: tl.constexpr,
              BC: tl.constexpr):
    """Rowwise 1x16 copy of the [BR, BC] tile ``x``: scales, then the codes as 8 column
    lanes (columns 8 g + m), so each Philox call's 8 draws meet their elements without a
    shuffle, packed as one int32 per 8 columns (``WORDS``: C % 8 == 0) or as 4 bytes."""
    rmask = (r0 + lr) < R
    xb = tl.reshape(x, [BR, BC // 16, 16])
    # NaN-propagating max (a NaN block amax: some positive NaN; block_scales reads only that)
    sdb, enc = block_scales(tl.reduce(tl.abs(xb), 2, _max_nan), s_enc, s_dec, RCP6, HW)
    v = tl.reshape(xb * enc[:, :, None], [BR, BC])
    v0, v1, v2, v3, v4, v5, v6, v7 = _split8(v, BR, BC)
    lg = tl.arange(0, BC // 8)
    col = c0 + lg[None, :] * 8  # column of lane 0
    if SR:
        u0, u1, u2, u3, u4, u5, u6, u7 = draws8_u16((r0 + lr)[:, None], (c0 // 8 + lg)[None, :], k0, k1)
    else:
        u0, u1, u2, u3, u4, u5, u6, u7 = v0, v1, v2, v3, v4, v5, v6, v7  # unused
    if SR:
        c0_, c1_ = _code_sr(v0, u0, HW), _code_sr(v1, u1, HW)
        c2_, c3_ = _code_sr(v2, u2, HW), _code_sr(v3, u3, HW)
        c4_, c5_ = _code_sr(v4, u4, HW), _code_sr(v5, u5, HW)
        c6_, c7_ = _code_sr(v6, u6, HW), _code_sr(v7, u7, HW)
    else:
        c0_, c1_, c2_, c3_ = _code_rne(v0), _code_rne(v1), _code_rne(v2), _code_rne(v3)
        c4_, c5_, c6_, c7_ = _code_rne(v4), _code_rne(v5), _code_rne(v6), _code_rne(v7)
    w = (_nib(c0_, col, C, 0, WORDS) | _nib(c1_, col + 1, C, 1, WORDS) | _nib(c2_, col + 2, C, 2, WORDS)
         | _nib(c3_, col + 3, C, 3, WORDS) | _nib(c4_, col + 4, C, 4, WORDS) | _nib(c5_, col + 5, C, 5, WORDS)
         | _nib(c6_, col + 6, C, 6, WORDS) | _nib(c7_, col + 7, C, 7, WORDS))
    w = _nan_words(w, v0)  # the 8 columns lie in one 16-column block
    nb = (C + 1) // 2
    if WORDS:
        wbase = rd_ptr.to(tl.pointer_type(tl.int32)) + r0.to(tl.int64) * (C // 8) + c0 // 8
        tl.store(wbase + tile_offsets(lr, lg, C // 8, 1), w,
                 mask=rmask[:, None] & ((c0 // 8 + lg) < C // 8)[None, :])
    else:
        bbase = rd_ptr + r0.to(tl.int64) * nb + c0 // 2
        boff = tile_offsets(lr, lg, nb, 4)
        bcol = (c0 // 2 + lg * 4)[None, :]
        tl.store(bbase + boff, w.to(tl.uint8), mask=rmask[:, None] & (bcol < nb))
        tl.store(bbase + boff + 1, (w >> 8).to(tl.uint8), mask=rmask[:, None] & (bcol + 1 < nb))
        tl.store(bbase + boff + 2, (w >> 16).to(tl.uint8), mask=rmask[:, None] & (bcol + 2 < nb))
        tl.store(bbase + boff + 3, (w >> 24).to(tl.uint8), mask=rmask[:, None] & (bcol + 3 < nb))
    nbc = tl.cdiv(C, 16)
    lb = tl.arange(0, BC // 16)
    tl.store(rs_ptr + r0.to(tl.int64) * nbc + c0 // 16 + tile_offsets(lr, lb, nbc, 1), sdb,
             mask=rmask[:, None] & ((c0 // 16 + lb) < nbc)[None, :])


@triton.jit
def col_copy_words(xbase, r0, c0, lc, R, C, sxr, sxc, s_enc, s_dec, cd_ptr, cs_ptr, k0, k1, RCP6,
                    SR: tl.constexpr, RHT: tl.constexpr, HW: tl.constexpr, DTYPE: tl.constexpr,
                    BF16_NAN: tl.constexpr, BT: tl.constexpr):
    """Columnwise copy of the tile from its 16 row slices (row ``16 t + i`` of slice i; re-read
    from cache, not from device memory), RHT'd with ``RHT``: its 16x1 blocks are elementwise
    across the slices (no cross-thread reduction) and each block's 16 codes are one int64
    word, stored transposed. The copy's rows must be whole words (RHT: padded to 16; else
    R % 16 == 0)."""
    lt = tl.arange(0, BT)
    cmask = (c0 + lc) < C
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _tile_slices(
        xbase, lt, lc, R - r0, cmask, sxr, sxc, RHT, DTYPE, BF16_NAN, HW)
    sdb, enc = block_scales(
        _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15),
        s_enc, s_dec, RCP6, HW)  # [BT, BC]
    t = r0 // 16 + lt  # 16-element group of the copy's columns
    if SR:
        ci = (c0 + lc)[None, :] + _zero_like(y0)  # the draws in the slices' layout
        a0, a1, a2, a3, a4, a5, a6, a7 = draws8_u16(ci, (2 * t)[:, None], k0, k1)
        b0, b1, b2, b3, b4, b5, b6, b7 = draws8_u16(ci, (2 * t + 1)[:, None], k0, k1)
    else:
        a0, a1, a2, a3, a4, a5, a6, a7 = y0, y1, y2, y3, y4, y5, y6, y7  # unused
        b0, b1, b2, b3, b4, b5, b6, b7 = y0, y1, y2, y3, y4, y5, y6, y7
    lo = _col_half(y0, y1, y2, y3, y4, y5, y6, y7, a0, a1, a2, a3, a4, a5, a6, a7, enc, SR, HW)
    hi = _col_half(y8, y9, y10, y11, y12, y13, y14, y15, b0, b1, b2, b3, b4, b5, b6, b7, enc, SR, HW)
    w = (hi.to(tl.int64) << 32) | lo.to(tl.uint32).to(tl.int64)
    ntiles = tl.cdiv(R, 16)
    tmask = cmask[:, None] & (t < ntiles)[None, :]
    off = c0.to(tl.int64) * ntiles + r0 // 16 + tile_offsets(lc, lt, ntiles, 1)
    tl.store(cd_ptr + off, tl.trans(w), mask=tmask)
    tl.store(cs_ptr + off, tl.trans(sdb), mask=tmask)


@triton.jit
def col_copy_bytes(x, r0, c0, lr, lc, R, C, s_enc, s_dec, cd_ptr, cs_ptr, k0, k1, RCP6,
                    SR: tl.constexpr, HW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Columnwise copy without RHT when R % 16 != 0 (rows not whole int64 words): 16x1 blocks
    of the natural tile, codes transposed and packed bytewise; one Philox call per draw."""
    BR: tl.constexpr = 16 * BT
    rows = r0 + lr
    cols = c0 + lc
    cmask = cols < C
    mask = (rows < R)[:, None] & cmask[None, :]
    xb = tl.reshape(x, [BT, 16, BC])
    sdb, enc = block_scales(amax_nan(xb, 1), s_enc, s_dec, RCP6, HW)  # [BT, BC]
    v = tl.reshape(xb * enc[:, None, :], [BR, BC])
    if SR:
        u = draw_at(cols[None, :], rows[:, None], k0, k1)  # copy element (c, r)
    else:
        u = v
    codes = tl.trans(tl.where(mask, _code(v, u, SR), 0))  # [BC, BR]
    nb = (R + 1) // 2
    lb = tl.arange(0, BR // 2)
    tl.store(cd_ptr + c0.to(tl.int64) * nb + r0 // 2 + tile_offsets(lc, lb, nb, 1), pack_last(codes, BC, BR),
             mask=cmask[:, None] & ((r0 // 2 + lb) < nb)[None, :])
    nbr = tl.cdiv(R, 16)
    lt = tl.arange(0, BT)
    tl.store(cs_ptr + c0.to(tl.int64) * nbr + r0 // 16 + tile_offsets(lc, lt, nbr, 1), tl.trans(sdb),
             mask=cmask[:, None] & ((r0 // 16 + lt) < nbr)[None, :])


@triton.jit
def tile_1d(x_ptr, R, C, sxr, sxc, BT: tl.constexpr, BC: tl.constexpr):
    """This program's [16 BT, BC] tile of an [R, C] input: (row and column origin, tile-local
    row and column indices, 64-bit base pointer of the tile, in-bounds mask)."""
    BR: tl.constexpr = 16 * BT
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    return r0, c0, lr, lc, xbase, ((r0 + lr) < R)[:, None] & ((c0 + lc) < C)[None, :]


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
        _row_copy(x, r0, c0, lr, lc, R, C, s_enc, s_dec, rd_ptr, rs_ptr, rk0, rk1, RCP6,
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
    codes = tl.where(mask, _code(v, u, SR), 0)
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


__all__ = ["FP32_MAX", "RCP6", "amaxes", "quantize_1d", "quantize_2d"]
