"""The 16 row slices of an NVFP4 tile (row ``16 t + i`` of slice i), loaded and optionally
transformed by the 16-point random Hadamard transform, and their elementwise amax.

The transform is plain elementwise FP32 arithmetic across the slices in ``formats.rht``'s exact
butterfly order, with its pre-scale of tiles whose max |x| reaches 2**124, saturated and
rounded to the input dtype: a 16x1 block is elementwise across the slices, so there is no
cross-thread reduction (``triton_nvfp4_tile.col_copy_words``; the post-RHT amax of
``triton_nvfp4.amaxes``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import load_f32, tile_offsets
from ._common_encode import round_to_dtype

@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def round_in(y, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, HW: tl.constexpr):
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
def rht_prescale(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                  DTYPE: tl.constexpr):
    """Per 16-element tile (elementwise over the slices), as ``formats.rht._butterfly_scaled``:
    (p, q) = (2**-4, 4) where the tile's max |x| reaches ``formats.rht.PRESCALE_FROM`` (2**124:
    the butterfly's sums could overflow), else (1, 0.25); the saturation bound m: the input
    dtype's max (DTYPE code), inf for a tile holding ±inf (not saturated). NaN: (1, 0.25, max)."""
    a = amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    big = a >= 2.0**124
    if DTYPE == 1:
        top = 3.3895313892515355e38  # BF16 max (0x7F7F)
    elif DTYPE == 2:
        top = 65504.0
    else:
        top = 3.4028234663852886e38
    return tl.where(big, 0.0625, 1.0), tl.where(big, 4.0, 0.25), tl.where(a == float("inf"), float("inf"), top)


@triton.jit
def saturate(y, m):
    """clamp(y, -m, m), NaN kept (``formats.rht._butterfly_scaled``'s saturation)."""
    return tl.minimum(tl.maximum(y, -m, propagate_nan=tl.PropagateNan.ALL), m,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rht_out(y, q, m, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, HW: tl.constexpr):
    """A butterfly sum's output: * q, saturated at ±m, rounded to the input dtype."""
    return round_in(saturate(y * q, m), DTYPE, BF16_NAN, HW)


@triton.jit
def rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, p, q, m,
           DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, HW: tl.constexpr, RAW: tl.constexpr = False):
    """``formats.rht.apply_rht`` on 16 elementwise slices: signs times the pre-scale ``p``
    (exact, one rounding of x s p as the reference's (x s) p), butterfly h = 1, 2, 4, 8, * ``q``
    (0.25 / p), saturated at ±m and rounded to the input dtype (every step in the reference's
    FP32 order; (p, q, m) from :func:`rht_prescale`). ``RAW``: the butterfly's FP32 sums only (no
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
def tile_slices(xbase, lt, lc, rmax, cmask, sxr, sxc, RHT: tl.constexpr, DTYPE: tl.constexpr,
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
        p, q, m = rht_prescale(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, DTYPE)
        return rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, p, q, m, DTYPE,
                      BF16_NAN, HW)
    else:
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _mx(a, b):
    """max(|a|, |b|) propagating NaN (``max.NaN``, one ``FMNMX.NAN`` with |.| operands; the
    interpreter's ``np.maximum``): a NaN result is a positive NaN."""
    return tl.maximum(tl.abs(a), tl.abs(b), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15):
    """Elementwise NaN-propagating max|y_i| over the 16 slices (a NaN result is a positive NaN
    of unspecified payload: ``block_scales`` and ``amax_nan`` read only that it is NaN)."""
    a = tl.maximum(tl.maximum(_mx(y0, y1), _mx(y2, y3), propagate_nan=tl.PropagateNan.ALL),
                   tl.maximum(_mx(y4, y5), _mx(y6, y7), propagate_nan=tl.PropagateNan.ALL),
                   propagate_nan=tl.PropagateNan.ALL)
    b = tl.maximum(tl.maximum(_mx(y8, y9), _mx(y10, y11), propagate_nan=tl.PropagateNan.ALL),
                   tl.maximum(_mx(y12, y13), _mx(y14, y15), propagate_nan=tl.PropagateNan.ALL),
                   propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
