"""One tile's NVFP4 copies (numerics §2.5): global and block scales, E2M1 codes (RNE or
stochastic), the rowwise 1x16 copy and the columnwise 16x1 copy; the kernels that call them
are in ``triton_nvfp4`` (and the fused hybrids).

- rowwise 1x16 blocks from the natural tile; the codes are taken as 8 column lanes
  (columns 8 g + m, register-local splits) and stored as one int32 per 8 columns
  (:func:`row_copy`);
- columnwise 16x1 blocks from the tile's 16 row slices (``triton_nvfp4_rht``), optionally
  RHT'd; each block's 16 codes are one int64 word stored transposed (:func:`col_copy_words`).
  Without RHT and with R % 16 != 0 (rows not whole words) the natural tile is transposed and
  packed bytewise (:func:`col_copy_bytes`).

Bitwise equal to ``formats.nvfp4`` (FP32 order of numerics §2.5, IEEE divisions, E4M3 block
scales by ``_common_encode.fp8_encode``, E2M1 by ``_common_encode.e2m1_code_sat`` /
``e2m1_code_sr``, computed here by the equivalent integer forms :func:`_code_rne` /
:func:`_code_sr`). Stochastic rounding draws its uniforms in the kernel (Philox,
``triton_sr``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import amax_nan, program_tile, tile_offsets
from ._common_encode import clamp_max, clamp_sym, e2m1_code_sat, e2m1_code_sr, e4m3_value, f32_div, fp8_encode
from .triton_nvfp4_rht import amax16, tile_slices
from .triton_sr import draw_at, draws8_u16

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
def _zero_like(y):
    """Zeros shaped like FP32 ``y`` that the layout passes see as computed from ``y`` (LLVM folds
    them away): index tensors built on them get ``y``'s register layout, so values computed
    from those indices (the Philox draws) need no shared-memory conversion to meet ``y``."""
    return tl.minimum(y.to(tl.int32, bitcast=True) & 1, 0)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e2m1_code_sat_or_sr(v, u, SR: tl.constexpr):
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
def row_copy(x, r0, c0, lr, lc, R, C, s_enc, s_dec, rd_ptr, rs_ptr, k0, k1, RCP6,
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
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = tile_slices(
        xbase, lt, lc, R - r0, cmask, sxr, sxc, RHT, DTYPE, BF16_NAN, HW)
    sdb, enc = block_scales(
        amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15),
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
    codes = tl.trans(tl.where(mask, e2m1_code_sat_or_sr(v, u, SR), 0))  # [BC, BR]
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
