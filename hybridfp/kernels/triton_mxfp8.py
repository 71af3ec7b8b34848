"""MXFP8 quantize kernels (numerics §2.4): one read of the input writes every requested copy.

- 1D: rowwise 1x32 blocks ``[R, C]`` + E8M0 ``[R, ceil(C/32)]``, and columnwise 32x1 blocks
  stored transposed ``[C, R]`` + ``[C, ceil(R/32)]``, from the same [BR, BC] tile (read from
  device memory once; the columnwise copy re-reads it from cache as transposed [BC, 32]
  tiles whose 32 rows sit in one thread: ``_common.load_rows32_t``; ``method="slices"``, the
  default with the rowwise copy). ``method="natural"`` (:func:`col_copy_natural`; the default
  for a columnwise-only copy of 16-bit input, faster there): the columnwise pass re-reads each
  32-row block in natural [ROW_SLICE, BC] slices instead (row-major vector loads, as FP8 block's
  "natural"), the 32x1 amax is a running max over the slices, and the codes of four rows of a
  column join into one int32 word inside a thread, so the transposed stores stay wide.
- 2D: 32x32 tiles; the columnwise copy is the rowwise one transposed (data and scales).

Bitwise equal to ``formats.mxfp8`` (tests/kernels/test_kernels_mxfp8.py; "natural" against
"slices" too: test_kernels_mxfp8_natural.py): the E8M0 byte is computed from the FP32 amax
bits exactly as ``e8m0_from_amax``; ``x / 2**k`` is computed as
``x * 2**-k`` with the reciprocal built from bits (both are the correctly rounded value of the
same real number, and every 2**-k for a valid byte is an FP32 number), then clamped and
rounded to the FP8 grid by ``_common_encode.fp8_encode``. Data are written as uint8 code bytes into
the FP8 outputs (on the GPU the hardware conversion gives those bytes; tile-local int32
offsets; ``_common`` says why).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (program_tile, load_tile, DTYPE_CODE, Copies, amax_nan, check_int32_tiles, empty, kernel_input,
                      load_f32, load_rows32_t, store_code_words_t, store_transposed_u8, store_words_t, tile_grid,
                      tile_offsets)
from ._common_encode import bf16_nan16, e4m3_words_t, f32, fp8_encode, fp8_encode_rowwise, fp8_params, fp8_word4, hw_fp8
from .triton_decode import fp8_f32, e8m0_scaled_bits
from .triton_fp8_block import abs_bits, bits_amax

BLOCK = 32
_BLOCK = tl.constexpr(BLOCK)  # the same, visible inside kernels


@triton.jit
def _e8m0_byte(amax, RCEIL: tl.constexpr, EMAX: tl.constexpr, RCP):
    """``formats.mxfp8.e8m0_from_amax`` (int32 byte) of non-negative block amaxes."""
    if RCEIL:
        # the exponent of v = amax * RCP rounded up: adding 2**23 - 1 carries into the exponent
        # field iff the mantissa is non-zero (normal v). A subnormal v's byte is 1 iff
        # v > 2**-127 (mantissa above 0x400000): add 0x3FFFFF there instead. A finite amax's
        # byte is at most 254 - EMAX (fp8_max * scale finite: saturation near the FP32
        # maximum); inf gets 0xFE (numerics §2.4). NaN (bits above inf's; the sum wraps negative) ->
        # 0xFF. Integer tests only: ~8 instructions a scale instead of ~17, and in the natural
        # passes every thread holding a column computes it.
        bits = (amax * RCP).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        cap = tl.where(bits >= 0x7F800000, 0xFE, 254 - EMAX)
        e = tl.minimum((bits + tl.where(bits < 0x800000, 0x3FFFFF, 0x7FFFFF)) >> 23, cap)
        e = tl.where(bits > 0x7F800000, 0xFF, e)
    else:
        exp = (amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >> 23
        e = tl.minimum(tl.maximum(exp - EMAX, 0), 0xFE)
        e = tl.where(amax == float("inf"), 0xFE, e)
        e = tl.where(amax != amax, 0xFF, e)
    return e


@triton.jit
def _e8m0_inverse(e):
    """FP32 ``2**(127 - e)`` (exact: 2**127 .. 2**-127) of E8M0 bytes; NaN for 0xFF."""
    bits = tl.where(e == 0xFE, 0x400000, (254 - e) << 23)
    return tl.where(e == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def col_block_32(xt, RCEIL: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                 FP8_MAX: tl.constexpr, RCP, HW: tl.constexpr):
    """(E8M0 bytes [BC] int32, FP8 codes [BC, 32] uint8) of the 32x1 blocks of a transposed
    FP32 tile ``xt`` [BC, 32] (one block per column; see ``_common.load_rows32_t``)."""
    e = _e8m0_byte(amax_nan(xt, 1), RCEIL, EMAX, RCP)
    return e, fp8_encode(xt * _e8m0_inverse(e)[:, None], FP8_MAX, MBITS, BIAS, HW)


@triton.jit
def decoded_values(y, e, MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, HW: tl.constexpr,
                   NAN16: tl.constexpr):
    """What a decoded copy stores for the scaled elements ``y`` (FP32, ``x * 2**(127 - e)``) of
    blocks with E8M0 bytes ``e`` (int32, ``y``'s shape): ``bf16(fp32(fp8(y) * 2**(e - 127)))``.
    On the GPU (``HW``) a BF16 tensor: the hardware's satfinite FP8 conversion and its exact
    widening back, one IEEE FP32 multiply (subnormals kept: no ``.ftz``) and the hardware's
    round-to-nearest-even BF16 conversion (NaN as torch's GPU cast gives it), in the compiler's
    own FP8 / BF16 types, about 5 instructions an element. Elsewhere (the interpreter, whose
    BF16 cast truncates) int16 BF16 bits by the integer rounding of ``fp8_encode`` and
    ``triton_decode.e8m0_scaled_bits``."""
    if HW:
        f8 = y.to(tl.float8e4nv) if MBITS == 3 else y.to(tl.float8e5)
        s = tl.where(e == 255, 0x7FC00000, tl.where(e == 0, 0x400000, e << 23)).to(tl.float32, bitcast=True)
        out = (f8.to(tl.float32) * s).to(tl.bfloat16)
    else:
        code = fp8_encode(y, FP8_MAX, MBITS, BIAS, HW)
        out = e8m0_scaled_bits(fp8_f32(code.to(tl.int32), MBITS == 2), e, NAN16).to(tl.int16)
    return out


@triton.jit
def col_decoded_32(xt, cd_ptr, lc, c0, r, R, C, RCEIL: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                   BIAS: tl.constexpr, FP8_MAX: tl.constexpr, RCP, HW: tl.constexpr, NAN16: tl.constexpr):
    """The BF16 decode of the 32x1 blocks of a transposed FP32 tile ``xt`` [BC, 32] (rows
    ``r .. r + 31`` of columns ``c0 + lc`` of an [R, C] input) stored transposed into the [C, R]
    BF16 (GPU) / int16 (interpreter) array at ``cd_ptr``: each thread's column leaves as 64
    contiguous bytes."""
    e = _e8m0_byte(amax_nan(xt, 1), RCEIL, EMAX, RCP)
    vals = decoded_values(xt * _e8m0_inverse(e)[:, None], tl.broadcast_to(e[:, None], xt.shape), MBITS, BIAS,
                          FP8_MAX, HW, NAN16)
    l32 = tl.arange(0, _BLOCK)
    tl.store(cd_ptr + c0.to(tl.int64) * R + r + tile_offsets(lc, l32, R, 1), vals,
             mask=((c0 + lc) < C)[:, None] & ((r + l32) < R)[None, :])


@triton.jit
def row_copy(x, mask, r0, c0, R, C, rd_ptr, rs_ptr, RCEIL: tl.constexpr, EMAX: tl.constexpr,
             MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, RCP, HW: tl.constexpr,
             src=None, MAP: tl.constexpr = False, DECODED: tl.constexpr = False, NAN16: tl.constexpr = 0):
    """Rowwise 1x32 copy of the FP32 tile ``x`` [BR, BC] (origin (r0, c0) of an [R, C] input,
    ``c0`` a multiple of BC; ``mask`` its in-bounds elements): FP8 codes into ``rd_ptr``
    [R, C], E8M0 bytes into ``rs_ptr`` [R, ceil(C / 32)]. A block's 32 columns sit in a few
    neighbouring threads. ``MAP``: tile row i goes to output row ``src[i]`` instead (skipped
    where negative: a padding row of a row map). ``DECODED``: the copy's BF16 decode instead
    (into ``rd_ptr``: BF16 on the GPU, int16 bits in the interpreter, :func:`decoded_values`;
    no scales)."""
    BR: tl.constexpr = x.shape[0]
    BC: tl.constexpr = x.shape[1]
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    xb = tl.reshape(x, [BR, BC // _BLOCK, _BLOCK])
    e = _e8m0_byte(amax_nan(xb, 2), RCEIL, EMAX, RCP)
    y = tl.reshape(xb * _e8m0_inverse(e)[:, :, None], [BR, BC])
    if DECODED:
        ee = tl.reshape(tl.broadcast_to(e[:, :, None], [BR, BC // _BLOCK, _BLOCK]), [BR, BC])
        code = decoded_values(y, ee, MBITS, BIAS, FP8_MAX, HW, NAN16)
    else:
        code = fp8_encode_rowwise(y, FP8_MAX, MBITS, BIAS, HW)
    nbc = tl.cdiv(C, _BLOCK)
    b0 = c0 // _BLOCK
    lb = tl.arange(0, BC // _BLOCK)
    if MAP:
        rows = src.to(tl.int64)
        tl.store(rd_ptr + c0 + rows[:, None] * C + lc[None, :], code, mask=mask)
        if not DECODED:
            smask = (src >= 0)[:, None] & ((b0 + lb) < nbc)[None, :]
            tl.store(rs_ptr + b0 + rows[:, None] * nbc + lb[None, :], e.to(tl.uint8), mask=smask)
    else:
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
        if not DECODED:
            smask = ((r0 + lr) < R)[:, None] & ((b0 + lb) < nbc)[None, :]
            tl.store(rs_ptr + r0.to(tl.int64) * nbc + b0 + tile_offsets(lr, lb, nbc, 1), e.to(tl.uint8),
                     mask=smask)


@triton.jit
def natural_rows(xbase, lr, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    """Tile rows ``lr`` ([N], tile-local; ``rmax`` rows left from the tile origin) of columns
    ``lc`` as a natural [N, BC] FP32 slice (row-major: vector loads along the columns), zeros
    past the tensor. ``MAP``: tile row i is source row ``mbase[i]`` of the source whose column
    base is ``xbase`` (zeros where negative), as in ``_common.load_rows32_t``."""
    ok = lr < rmax
    if MAP:
        src = tl.load(mbase + lr, mask=ok, other=-1)
        return load_f32(xbase + src.to(tl.int64)[:, None] * sxr + (lc * sxc)[None, :],
                        (src >= 0)[:, None] & cmask[None, :], DTYPE)
    else:
        return load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), ok[:, None] & cmask[None, :], DTYPE)


@triton.jit
def natural_rows4(xbase, l4, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    """The four natural slices of tile rows ``4 * l4 + k``, k = 0..3 (:func:`natural_rows`)."""
    return (natural_rows(xbase, l4 * 4, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
            natural_rows(xbase, l4 * 4 + 1, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
            natural_rows(xbase, l4 * 4 + 2, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
            natural_rows(xbase, l4 * 4 + 3, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))


@triton.jit
def _codes(x, inv, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr):
    """FP8 codes (int32) of a natural slice ``x`` [N, BC] scaled by its columns' ``inv`` [BC]."""
    return fp8_encode(x * inv[None, :], FP8_MAX, MBITS, BIAS, HW).to(tl.int32)


@triton.jit
def _store_words4_t(cd_ptr, w, l4, lc, cmask, c0, pr, R, BR: tl.constexpr):
    """Store the int32 code words ``w`` [N, BC] (rows ``4 * l4 .. + 3`` of the tile's columns, little
    endian) transposed into the [C, R] byte array (R % 4 == 0)."""
    # word (c, r / 4) of the [C, R / 4] view; pr * (BR // 4) keeps the 16-byte alignment visible
    wbase = cd_ptr.to(tl.pointer_type(tl.int32)) + c0.to(tl.int64) * (R // 4) + pr * (BR // 4)
    # the row test on word indices: constant over runs of 4 words, so the stores stay vectors
    wmask = ((pr * (BR // 4) + l4) < R // 4)[:, None] & cmask[None, :]
    tl.store(wbase + tile_offsets(l4, lc, 1, R // 4), w, mask=wmask)


@triton.jit
def _codes_rows4_t(cd_ptr, x0, x1, x2, x3, inv, l4, lc, cmask, r0, c0, pr, R, FP8_MAX: tl.constexpr,
                   MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr, BR: tl.constexpr,
                   PACK: tl.constexpr):
    """The FP8 codes of the four natural slices ``xk`` (tile rows ``4 * l4 + k``) scaled by their
    columns' ``inv``, stored transposed. Packed: one word per four rows (``_common_encode.fp8_word4``:
    E4M3 on the GPU from two paired conversions; sm90: about 3 instructions per element fewer
    than four conversions, their NaN selects and the byte packing)."""
    if PACK:
        w = fp8_word4(x0 * inv[None, :], x1 * inv[None, :], x2 * inv[None, :], x3 * inv[None, :], FP8_MAX, MBITS,
                      BIAS, HW)
        _store_words4_t(cd_ptr, w, l4, lc, cmask, c0, pr, R, BR)
    else:
        _store_bytes4_t(cd_ptr, _codes(x0, inv, FP8_MAX, MBITS, BIAS, HW), _codes(x1, inv, FP8_MAX, MBITS, BIAS, HW),
                        _codes(x2, inv, FP8_MAX, MBITS, BIAS, HW), _codes(x3, inv, FP8_MAX, MBITS, BIAS, HW),
                        l4, lc, cmask, r0, c0, R)


@triton.jit
def _store_bytes4_t(cd_ptr, q0, q1, q2, q3, l4, lc, cmask, r0, c0, R):
    """Store the codes ``qk`` (int32, [N, BC], natural layout) of tile rows ``4 * l4 + k`` (tile
    origin (r0, c0) of an [R, C] input) transposed into the [C, R] byte array, byte by byte (R % 4
    != 0; packed words go through :func:`_store_words4_t`: the four rows of a word sit in one
    thread, same register position of four slices, so they join without data exchange and the
    word tile leaves transposed through the compiler's shared-memory layout conversion)."""
    lr4 = l4 * 4
    bbase = cd_ptr + c0.to(tl.int64) * R + r0
    off = tile_offsets(lr4, lc, 1, R)
    tl.store(bbase + off, q0.to(tl.uint8), mask=((r0 + lr4) < R)[:, None] & cmask[None, :])
    tl.store(bbase + off + 1, q1.to(tl.uint8), mask=((r0 + lr4 + 1) < R)[:, None] & cmask[None, :])
    tl.store(bbase + off + 2, q2.to(tl.uint8), mask=((r0 + lr4 + 2) < R)[:, None] & cmask[None, :])
    tl.store(bbase + off + 3, q3.to(tl.uint8), mask=((r0 + lr4 + 3) < R)[:, None] & cmask[None, :])


@triton.jit
def col_block_rows4(x0, x1, x2, x3, cd_ptr, l4, lc, cmask, r0, c0, pr, R, RCEIL: tl.constexpr,
                    EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, RCP,
                    HW: tl.constexpr, BR: tl.constexpr, PACK: tl.constexpr):
    """The 32x1 blocks of one 32-row block of a [BR, BC] tile held as four natural FP32 slices
    ``xk`` [8, BC] of tile rows ``4 * l4 + k`` (zeros past the tensor): codes stored transposed
    (:func:`_codes_rows4_t`), E8M0 bytes [BC] returned. The amax is a max of the |x| bits over
    the four slices in registers and one reduction across the slice rows."""
    m = tl.maximum(tl.maximum(abs_bits(x0), abs_bits(x1)), tl.maximum(abs_bits(x2), abs_bits(x3)))
    e = _e8m0_byte(bits_amax(tl.max(m, 0)), RCEIL, EMAX, RCP)
    inv = _e8m0_inverse(e)
    _codes_rows4_t(cd_ptr, x0, x1, x2, x3, inv, l4, lc, cmask, r0, c0, pr, R, FP8_MAX, MBITS, BIAS, HW, BR, PACK)
    return e


@triton.jit
def store_scales_t(cs_ptr, e_first, e, b: tl.constexpr, pr, c0, lc, cmask, nbr, NBR, BR: tl.constexpr,
                   PAIR: tl.constexpr):
    """Store the E8M0 bytes ``e`` [BC] of 32-row block ``b`` of row tile ``pr`` (BR rows) into the
    [C, nbr] scale array. ``nbr`` and ``NBR`` are the same value, ceil(R / 32): the unpaired store
    uses ``nbr`` in the form each caller computes it (an in-kernel ``cdiv`` or the argument), so
    that each caller's compiled code is the one its GPU tests cover. ``PAIR`` with 64-row tiles:
    nothing at b = 0, and at b = 1 both blocks' bytes of a column (``e_first``, ``e``) in one
    2-byte store, one L2 request instead of two (``NBR``, the scale row length, is then an
    argument so that the compiler sees its alignment)."""
    if PAIR and BR == 2 * _BLOCK:
        if b == 1:
            blk2 = pr * 2 + tl.arange(0, 2)
            tl.store(cs_ptr + (c0 + lc).to(tl.int64)[:, None] * NBR + blk2[None, :],
                     tl.join(e_first, e).to(tl.uint8), mask=cmask[:, None] & (blk2 < NBR)[None, :])
    else:
        blk = pr * (BR // _BLOCK) + b
        tl.store(cs_ptr + (c0 + lc).to(tl.int64) * nbr + blk, e.to(tl.uint8),
                 mask=cmask & ((lc * 0 + blk) < nbr))  # a vector test: see _common._row


@triton.jit
def col_copy_natural(xbase, r0, c0, pr, R, C, sxr, sxc, cd_ptr, cs_ptr, mbase, RCEIL: tl.constexpr,
                     EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, RCP,
                     HW: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                     RS: tl.constexpr, PACK: tl.constexpr, MAP: tl.constexpr, NBR=0,
                     PAIR_SCALES: tl.constexpr = False):
    """Columnwise 32x1 copy of the [BR, BC] tile at (r0, c0) = (pr * BR, c0) (``xbase`` points at
    it; ``MAP``: at the source's column c0, rows through ``mbase``, the map at r0), stored
    transposed, and its E8M0 bytes, from natural [RS, BC] slices (``RS`` rows, 4 .. 32, dividing
    32) of each 32-row block, each read as four [RS / 4, BC] slices of rows 4i + k.

    The block amax is a running max of the |x| bits over those slices (one integer max per
    element in registers) and one reduction across rows per block. With RS = 32 the block's
    slices stay in registers for the codes (one read); smaller slices read the block twice (amax,
    then codes) but hold fewer registers. ``PAIR_SCALES`` (64-row tiles; ``NBR`` the scale row
    length, an argument so that the compiler sees its alignment): both blocks' scale bytes of a
    column leave in one 2-byte store (one L2 request instead of two)."""
    lc = tl.arange(0, BC)
    cmask = (c0 + lc) < C
    rmax = R - r0
    nbr = tl.cdiv(R, _BLOCK)
    N: tl.constexpr = RS // 4
    for b in tl.static_range(BR // _BLOCK):
        if RS == _BLOCK:  # the whole block in registers: amax and codes from one read
            l4 = b * N + tl.arange(0, N)
            x0, x1, x2, x3 = natural_rows4(xbase, l4, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP)
            e = col_block_rows4(x0, x1, x2, x3, cd_ptr, l4, lc, cmask, r0, c0, pr, R, RCEIL, EMAX, MBITS, BIAS,
                                FP8_MAX, RCP, HW, BR, PACK)
        else:
            m = tl.zeros([N, BC], tl.int32)
            for s in tl.static_range(_BLOCK // RS):
                l4 = (b * _BLOCK + s * RS) // 4 + tl.arange(0, N)
                for k in tl.static_range(4):
                    m = tl.maximum(m, abs_bits(natural_rows(xbase, l4 * 4 + k, lc, rmax, cmask, sxr, sxc, DTYPE,
                                                             mbase, MAP)))
            e = _e8m0_byte(bits_amax(tl.max(m, 0)), RCEIL, EMAX, RCP)
            inv = _e8m0_inverse(e)
            for s in tl.static_range(_BLOCK // RS):
                l4 = (b * _BLOCK + s * RS) // 4 + tl.arange(0, N)
                x0, x1, x2, x3 = natural_rows4(xbase, l4, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP)
                _codes_rows4_t(cd_ptr, x0, x1, x2, x3, inv, l4, lc, cmask, r0, c0, pr, R, FP8_MAX, MBITS, BIAS, HW,
                               BR, PACK)
        if b == 0:
            e_first = e
        store_scales_t(cs_ptr, e_first, e, b, pr, c0, lc, cmask, nbr, NBR, BR, PAIR_SCALES)


@triton.jit
def _mxfp8_1d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, NBR, sxr, sxc: tl.constexpr, RCP,
                     ROW: tl.constexpr, COL: tl.constexpr, RCEIL: tl.constexpr,
                     EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                     FP8_MAX: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, PACK: tl.constexpr, HW: tl.constexpr, map_ptr,
                     MAP: tl.constexpr, NATURAL: tl.constexpr = False, RS: tl.constexpr = 32,
                     WIDE: tl.constexpr = 0, GRID2: tl.constexpr = False, DECODED: tl.constexpr = False,
                     NAN16: tl.constexpr = 0):
    """One [BR, BC] tile per program. Rowwise 1x32 blocks from the natural tile (a block's 32
    columns sit in a few neighbouring threads); columnwise 32x1 blocks from transposed
    [BC, 32] tiles re-read from cache (``_common.load_rows32_t``: register-local block amax,
    word stores), one per 32 rows. (Transposing each 32-row slice in registers instead,
    ``tl.trans``, is slower on an NVIDIA H200.) ``MAP``: the R rows
    are ``x[map_ptr[r]]`` (zero where negative), and the rowwise copy goes to the source's own
    rows. ``NATURAL``: the columnwise copy from natural [RS, BC] slices instead
    (:func:`col_copy_natural`). ``GRID2``: launched on ``_common.tile_grid``'s 2D grid.
    ``DECODED`` ("slices" only): both copies as their BF16 decodes (BF16 on the GPU, int16 bits in the
    interpreter, into ``rd_ptr`` /
    ``cd_ptr``, no scales; ``NAN16`` the NaN bits a BF16 cast gives on the device)."""
    pr, pc = program_tile(C, BR, BC, GRID2)
    r0, c0 = pr * BR, pc * BC
    lc = tl.arange(0, BC)
    if MAP:  # rows come through the map: the base is the source's column c0
        xbase = x_ptr + c0.to(tl.int64) * sxc
    else:
        xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    if ROW:
        lr = tl.arange(0, BR)
        if MAP:  # tile row i is source row src[i]; the rowwise copy keeps the source's rows
            src = tl.load(map_ptr + r0 + lr, mask=(r0 + lr) < R, other=-1)
            mask = (src >= 0)[:, None] & ((c0 + lc) < C)[None, :]
            x = load_f32(xbase + src.to(tl.int64)[:, None] * sxr + (lc * sxc)[None, :], mask, DTYPE)
            row_copy(x, mask, r0, c0, R, C, rd_ptr, rs_ptr, RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW, src, MAP,
                     DECODED, NAN16)
        else:
            mask = ((r0 + lr) < R)[:, None] & ((c0 + lc) < C)[None, :]
            x = load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE)
            row_copy(x, mask, r0, c0, R, C, rd_ptr, rs_ptr, RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW,
                     DECODED=DECODED, NAN16=NAN16)
    if COL and NATURAL:
        col_copy_natural(xbase, r0, c0, pr, R, C, sxr, sxc, cd_ptr, cs_ptr, map_ptr + r0, RCEIL, EMAX, MBITS, BIAS,
                         FP8_MAX, RCP, HW, DTYPE, BR, BC, RS, PACK, MAP, NBR, WIDE == 2)
    elif COL:
        cmask = (c0 + lc) < C
        for b in tl.static_range(BR // _BLOCK):
            xt = load_rows32_t(xbase, b * _BLOCK, lc, R - r0, cmask, sxr, sxc, DTYPE, map_ptr + r0, MAP)
            if DECODED:
                col_decoded_32(xt, cd_ptr, lc, c0, r0 + b * _BLOCK, R, C, RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW,
                               NAN16)
            elif PACK and MBITS == 3:  # E4M3 words of explicitly paired conversions (_common_encode.e4m3_words_t)
                e = _e8m0_byte(amax_nan(xt, 1), RCEIL, EMAX, RCP)
                store_code_words_t(cd_ptr, e4m3_words_t(xt * _e8m0_inverse(e)[:, None], HW), lc, c0,
                                   r0 + b * _BLOCK, R, C, WIDE != 0)
            else:
                e, code = col_block_32(xt, RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW)
                store_words_t(cd_ptr, code, lc, c0, r0 + b * _BLOCK, R, C, PACK, WIDE != 0)
            if not DECODED:
                if b == 0:
                    e_first = e
                store_scales_t(cs_ptr, e_first, e, b, pr, c0, lc, cmask, NBR, NBR, BR, WIDE == 2)


@triton.jit
def _mxfp8_2d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr, RCP,
                     ROW: tl.constexpr, COL: tl.constexpr, RCEIL: tl.constexpr,
                     EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                     FP8_MAX: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, PACK: tl.constexpr, HW: tl.constexpr):
    x, mask, lr, lc, r0, c0, pr, pc = load_tile(x_ptr, R, C, sxr, sxc, DTYPE, BR, BC)
    xb = tl.reshape(x, [BR // _BLOCK, _BLOCK, BC // _BLOCK, _BLOCK])
    e = _e8m0_byte(amax_nan(amax_nan(xb, 3), 1), RCEIL, EMAX, RCP)  # [BR/32, BC/32]
    y = tl.reshape(xb * _e8m0_inverse(e)[:, None, :, None], [BR, BC])
    code = fp8_encode(y, FP8_MAX, MBITS, BIAS, HW)
    nbr = tl.cdiv(R, _BLOCK)
    nbc = tl.cdiv(C, _BLOCK)
    sr = pr * (BR // _BLOCK) + tl.arange(0, BR // _BLOCK)
    sc = pc * (BC // _BLOCK) + tl.arange(0, BC // _BLOCK)
    smask = (sr < nbr)[:, None] & (sc < nbc)[None, :]
    e8 = e.to(tl.uint8)
    if ROW:
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
        tl.store(rs_ptr + sr[:, None] * nbc + sc[None, :], e8, mask=smask)
    if COL:
        store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
        tl.store(cs_ptr + sc[None, :] * nbr + sr[:, None], e8, mask=smask)


#: "slices" store width (``quantize``'s ``wide_stores``): 0, 1 or 2. With narrow stores the
#: row+col kernel is bound by the L2's request rate, not by DRAM (Nsight Compute): each
#: thread's 16-byte code stores to its own column are one L2 request per half sector, and each
#: scale byte one request. 2 is the fastest width for row+col,
#: columnwise-only and row-mapped copies on an NVIDIA H200.
WIDE_STORES = 2

#: 1D columnwise methods: "slices" (transposed [BC, 32] slices, ``_common.load_rows32_t``) and
#: "natural" (:func:`col_copy_natural`).
METHODS = ("slices", "natural")
#: ``fp8_encode``'s HW for the "natural" method on GPUs with the FP8 conversion: 2, conversions
#: by inline PTX whose pairing is explicit: packed E4M3 words from two paired conversions
#: (``_common_encode.e4m3_word4``), else one per element. With Triton's own paired conversion (1) the
#: H200 gives wrong columnwise bytes at (64, 256) / 4 warps for BF16 input (the default tile is
#: right).
NATURAL_HW = 2


#: the columnwise-only default of 16-bit inputs: "natural" on (64, 128) tiles over 2 warps, one
#: 32-row block per slice: faster than "slices" for a plain and for a row-mapped MoE copy; both
#: copies together are faster on "slices" (NVIDIA H200).
COL_ONLY_NATURAL = ((64, 128), 2)


#: decoded copies' default tile and warps: the fastest row+col tile on an NVIDIA H200,
#: near device-copy bandwidth and well ahead of quantizing to codes plus the two decodes the
#: GEMMs then run.
DECODED_TILE = ((32, 128), 4)


def _default_method(x2: torch.Tensor, rowwise: bool, columnwise: bool, block_2d: bool,
                    block: Optional[tuple[int, int]], num_warps: Optional[int]):
    """(method, block, num_warps) when the caller names no method: "natural" with its benchmarked
    tile for a columnwise-only 1D copy of BF16 / FP16 input and no tile asked for, else "slices"
    with the caller's tile (FP32 input: "natural" is not benchmarked there)."""
    if (columnwise and not rowwise and not block_2d and block is None and num_warps is None
            and x2.dtype in (torch.bfloat16, torch.float16)):
        return ("natural", *COL_ONLY_NATURAL)
    return "slices", block, num_warps


def quantize(x2: torch.Tensor, dtype: torch.dtype, *, rule: str = "rceil", block_2d: bool = False,
             rowwise: bool = True, columnwise: bool = True, block: Optional[tuple[int, int]] = None,
             num_warps: Optional[int] = None, pack: bool = True,
             row_map: Optional[torch.Tensor] = None, method: Optional[str] = None,
             row_slice: Optional[int] = None, maxnreg: Optional[int] = None,
             wide_stores: Optional[int] = None, decoded: bool = False) -> Copies:
    """MXFP8-quantize 2D ``x2`` (any strides); returns ``(row, col)``, each ``(data, scale)`` or
    None: the same tensors as ``formats.mxfp8.quantize_1d(x2)`` / ``quantize_1d(x2.t())``
    (``block_2d``: ``quantize_2d(x2)`` and its transpose). ``block``: the tile (multiples of 32;
    default 1D (64, 128) with BC / 32 warps: one column per thread in the columnwise copy, the
    layout it is written for; 2D (64, 64) / 8 warps, the fastest of the H200 sweep); ``pack``: write
    the transposed copy as int32 words of 4 rows when R % 4 == 0 (same bytes).
    ``row_map`` (1D; contiguous int32 on x2's device, each source row exactly once, entries <
    x2's rows; not checked: a device sync): the columnwise copy is that of the
    [len(row_map), C] tensor whose row r is ``x2[row_map[r]]``, zeros where ``row_map[r] < 0``
    (``kernels.moe.triton_pad_rows.pad_rows``'s output), without writing that tensor: the
    zero-padded expert groups of a grouped columnwise copy. The rowwise copy stays x2's own
    ([R, C], from the same read of each row).
    ``method`` (1D columnwise copy; the same bytes either way; default: :func:`_default_method`,
    "natural" for a columnwise-only copy of 16-bit input, else "slices"): "slices" re-reads each 32-row
    block as a transposed [BC, 32] tile, one column per thread; "natural" re-reads it in natural
    ``row_slice``-row slices (4, 8, 16 or 32; default 32: the block stays in registers) with
    vector loads and packs four rows' codes into an int32 word per thread (inline-PTX FP8
    conversions, ``NATURAL_HW``: E4M3 words from two paired conversions; FP32 input needs
    explicit pairing for its packed stores: ``triton_fp8_block.natural_hw``). ``maxnreg``: a register cap per thread for the compiled
    kernel (more programs per SM; the same bytes; CUDA only), default none (or 0). ``wide_stores``
    (1D; the 2D path ignores it): 1, each column's packed codes leave in one store two threads
    wide (whole 32-byte sectors per L2 request, ``_common.store_words_t``; "slices"; "natural"
    stores whole sectors anyway); 2, also both 32-row blocks' scale bytes of a column in one
    store (64-row tiles, both methods); 0 neither; default ``WIDE_STORES``. ``decoded`` (1D,
    "slices"): each copy as its BF16 decode instead, ``(values, None)``:
    ``formats.mxfp8.dequantize_1d`` of the codes and scales above rounded to BF16 (exact;
    ``tensors.decoded``), in the layout of the codes, from the same pass."""
    if rule not in ("rceil", "floor"):
        raise ValueError(f"rule={rule!r} is unknown; use 'rceil' or 'floor'.")
    if wide_stores not in (None, 0, 1, 2):
        raise ValueError(f"wide_stores={wide_stores!r} must be 0, 1 or 2 (or None for WIDE_STORES).")
    if decoded and (block_2d or method == "natural"):
        raise ValueError("decoded=True writes 1D copies by the 'slices' method; pass block_2d=False and "
                         "method=None or 'slices'.")
    if method is None:
        method, block, num_warps = (("slices", block or DECODED_TILE[0], num_warps or DECODED_TILE[1]) if decoded
                                    else _default_method(x2, rowwise, columnwise, block_2d, block, num_warps))
    if method not in METHODS or (method == "natural" and block_2d):
        raise ValueError(f"method={method!r} is unknown for block_2d={block_2d}; use 'slices' or "
                         "'natural' (1D only).")
    natural = method == "natural"
    rslice = 32 if row_slice is None else row_slice
    if row_slice is not None and not natural:
        raise ValueError("row_slice is for method='natural'; leave it out for 'slices'.")
    if rslice not in (4, 8, 16, 32):
        raise ValueError(f"row_slice={row_slice} must be 4, 8, 16 or 32 (rows per natural slice of a "
                         "32-row block).")
    rows, cols = x2.shape
    src_rows = rows
    if row_map is not None:
        if block_2d:
            raise ValueError("row_map is for 1D blocks (a 32x32 tile would straddle two row groups); "
                             "pass block_2d=False.")
        if (row_map.dtype != torch.int32 or row_map.dim() != 1 or row_map.device != x2.device
                or not row_map.is_contiguous()):
            raise ValueError(f"row_map must be a contiguous 1D int32 tensor on {x2.device}; got "
                             f"{row_map.dtype}, {tuple(row_map.shape)} on {row_map.device}.")
        rows = row_map.shape[0]  # >= the source's rows: the check below covers its offsets too
    br, bc = block or ((64, 64) if block_2d else (64, 128))
    if br % BLOCK or bc % BLOCK:
        raise ValueError(f"block={block} must be multiples of {BLOCK}.")
    mbits, bias, fmax = fp8_params(dtype)
    check_int32_tiles(rows, cols, *x2.stride())
    dev = x2.device
    nbr, nbc = triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK)
    row = col = None
    if decoded:
        row = (empty((src_rows, cols), dtype=torch.bfloat16, device=dev), None) if rowwise else None
        col = (empty((cols, rows), dtype=torch.bfloat16, device=dev), None) if columnwise else None
    else:
        if rowwise:
            row = (empty((src_rows, cols), dtype=dtype, device=dev),
                   empty((nbr if block_2d else src_rows, nbc), dtype=torch.uint8, device=dev))
        if columnwise:
            col = (empty((cols, rows), dtype=dtype, device=dev),
                   empty((nbc, nbr) if block_2d else (cols, nbr), dtype=torch.uint8, device=dev))
    if rows * cols == 0:
        return row, col
    # decoded: BF16 on the GPU, BF16 bits as int16 in the interpreter (its BF16 cast truncates)
    view = (torch.bfloat16 if hw_fp8(dev) else torch.int16) if decoded else torch.uint8
    if x2.numel() == 0:  # a map of padding rows only (an empty rowwise copy)
        if col is not None:
            col[0].view(view).zero_()
            if col[1] is not None:
                col[1].zero_()  # E8M0 0x00 (2**-127): the reference's byte for an all-zero block
        return row, col
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    rd, rs = (row[0].view(view), dummy if row[1] is None else row[1]) if row else (dummy, dummy)
    cd, cs = (col[0].view(view), dummy if col[1] is None else col[1]) if col else (dummy, dummy)
    kernel = _mxfp8_2d_kernel if block_2d else _mxfp8_1d_kernel
    mapped = {} if block_2d else {"map_ptr": row_map if row_map is not None else dummy, "MAP": row_map is not None}
    # word stores need R % 4 == 0; packed E4M3 words come from explicitly paired conversions
    # (_common_encode.e4m3_word4 / e4m3_words_t) in both methods; "natural" converts E5M2 and unpacked
    # codes one element at a time (NATURAL_HW), with which FP32 packed stores are right too
    # (triton_fp8_block.natural_hw)
    packed = pack and rows % 4 == 0
    method_args = {"NATURAL": True, "RS": rslice} if natural else {}
    if decoded:
        method_args.update(DECODED=True, NAN16=bf16_nan16(dev))
    if not block_2d:  # "natural": 2 pairs its scale bytes (its codes already leave as whole sectors)
        method_args["WIDE"] = WIDE_STORES if wide_stores is None else wide_stores
        grid, method_args["GRID2"] = tile_grid(rows, cols, br, bc)
    else:
        grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    extra = {"num_warps": num_warps or (8 if block_2d else min(max(bc // 32, 1), 8))}
    if maxnreg and dev.type == "cuda":  # a compile option of the GPU backend only; 0: no cap
        extra["maxnreg"] = maxnreg
    hw = (NATURAL_HW if natural else True) if hw_fp8(dev) else False
    kernel[grid](kernel_input(x2), rd, rs, cd, cs, rows, cols, *(() if block_2d else (nbr,)), x2.stride(0),
                 x2.stride(1), f32(1.0 / fmax),
                 ROW=rowwise, COL=columnwise, RCEIL=rule == "rceil",
                 EMAX={3: 8, 2: 15}[mbits], MBITS=mbits, BIAS=bias, FP8_MAX=fmax,
                 DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc,
                 PACK=packed, HW=hw, **mapped, **method_args, **extra)
    return row, col
