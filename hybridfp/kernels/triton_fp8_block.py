"""FP8 block-scaling quantize kernels (numerics §2.3, DeepSeek-V3 style), one read per tile.

- 1D: rowwise 1xB blocks (``data [R, C]``, ``scale_inv [R, ceil(C/B)]``) and columnwise Bx1
  blocks re-quantized from the same tile, stored transposed (``[C, R]``, ``[C, ceil(R/B)]``).
  ``method="natural"`` (:func:`_fp8_block_1d_kernel`, the default): the tile is read from device
  memory once in natural [RW, B] slices (vector loads) for the rowwise copy, and the same pass
  keeps a register-local running max of |x| per column, reduced once per tile to the Bx1 block
  amaxes; the columnwise pass then re-reads the tile from cache, also in natural slices, and
  packs four rows' codes of a column into an int32 word inside each thread
  (:func:`columnwise_1d`). ``method="slices"`` (:func:`_fp8_block_1d_t_kernel`): the columnwise pass
  over transposed [CW, 32] sub-tiles (``_common.load_rows32_t``, read twice).
- 2D: BxB tiles; the columnwise copy is the rowwise one transposed (data and scale_inv).

Tile-local int32 offsets, the hardware FP8 conversion on the GPU and int32-packed transposed
stores (``_common`` says why). The kernels are instruction-issue bound
(docs/design/quantize-kernels.md), so the 1D path also avoids IEEE divisions for power-of-two
scales (:func:`block_scale`, :func:`block_inv`) and masks on interior tiles (``EVEN``).

B = 128 by default (any power of two >= 32 works). Bitwise equal to ``formats.fp8_block``:
the block scale is ``_common_encode.current_scale`` of the NaN-propagating block amax (FP32 IEEE
division, optional power-of-two round-down, then at least ``_common_encode.min_pow2_scale``:
saturation near the FP32 maximum), ``scale_inv = 1 / scale`` (IEEE), data
``fp8(clamp(x * scale))`` by ``_common_encode.fp8_encode``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (DTYPE_CODE, program_tile, Copies, amax_nan, check_int32_tiles, empty, kernel_input, load_f32,
                      load_rows32_t, nan_max, store_transposed_u8, store_words_t, tile_offsets)
from ._common_encode import (current_scale, e4m3_word4, f32, asm_fp8_bits, fp8_encode, fp8_encode_rowwise, fp8_params,
                             hw_fp8)


@triton.jit
def _chunk(xbase, lr, rmask, lc0, c0, C, sxr, sxc, DTYPE: tl.constexpr, CW: tl.constexpr):
    """A [B, CW] FP32 chunk of the tile (tile-local columns lc0 .. lc0 + CW; tile origin column
    c0), its tile-local columns and mask."""
    lc = lc0 + tl.arange(0, CW)
    mask = rmask[:, None] & ((c0 + lc) < C)[None, :]
    return load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE), lc, mask


@triton.jit
def columnwise_1d_t(xbase, r0, c0, R, C, sxr, sxc, eps, cd_ptr, cs_ptr, pr, POW2: tl.constexpr,
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
def _fp8_block_1d_t_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr, eps,
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
            columnwise_1d_t(xbase + j * CW * sxc, r0, c0 + j * CW, R, C, sxr, sxc, eps, cd_ptr,
                            cs_ptr, pr, POW2, MBITS, BIAS, FP8_MAX, B, CW, DTYPE, HW, PACK)


@triton.jit
def abs_bits(x):
    """int32 bits of |x| (FP32): non-negative floats order like their bits and every NaN's bits
    lie above +inf's, so an integer max of them is the amax or a NaN (:func:`bits_amax`)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def bits_amax(m):
    """The FP32 amax whose :func:`abs_bits` maximum is ``m``; NaN as the positive quiet NaN."""
    return tl.where(m > 0x7F800000, 0x7FC00000, m).to(tl.float32, bitcast=True)


@triton.jit
def block_scale(amax, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """``_common_encode.current_scale`` ``(amax, eps, FP8_MAX, POW2)``, bit for bit; with ``POW2`` by integer
    arithmetic on the exponents instead of an IEEE division (a division is ~15 instructions and a
    thread computes one per block row or column it touches).

    Why it is exact (a = max(amax, eps) normal, FP8_MAX = mF 2**eF, a = ma 2**ea, mantissas in
    [1, 2)): the quotient is (mF / ma) 2**(eF - ea). If ma <= mF, the ratio lies in [1, mF] and
    rounds (RNE) to a value in [1, 2), so the power-of-two floor is 2**(eF - ea). If ma > mF, then
    ma >= mF + 2**-23, the ratio is below 1 - 2**-24 and rounds below 1: 2**(eF - ea - 1). An
    exponent above 127 is the division's overflow (inf -> FP32_MAX -> 2**127), and a subnormal a
    (biased exponent 0) always lands there (FP8_MAX >= 4 is assumed: every FP8 format). a = 0,
    inf or NaN give 1."""
    if POW2:
        a = tl.where(amax < eps, eps, amax)
        ab = a.to(tl.int32, bitcast=True)
        fb = tl.full([], FP8_MAX, tl.float32).to(tl.int32, bitcast=True)  # folded by the compiler
        e = ((fb >> 23) & 0xFF) - (ab >> 23) + 127 - ((ab & 0x7FFFFF) > (fb & 0x7FFFFF)).to(tl.int32)
        # at least min_pow2_scale's biased exponent E (FP8_MAX = m 2**E): a finite decode
        e = tl.maximum(tl.minimum(e, 254), ((fb >> 23) & 0xFF) - 127)
        scale = (e << 23).to(tl.float32, bitcast=True)
        return tl.where((a == 0) | (ab >= 0x7F800000), 1.0, scale)
    return current_scale(amax, eps, FP8_MAX, POW2)


@triton.jit
def block_inv(scale, POW2: tl.constexpr):
    """``scale_inv = 1 / scale`` (IEEE, as the reference); with ``POW2`` the scale is a power of
    two 2**(E - 127), E in [1, 254], whose reciprocal is exact: biased exponent 254 - E, or the
    subnormal 2**-127 for E = 254."""
    if POW2:
        e = scale.to(tl.int32, bitcast=True) >> 23
        return tl.where(e >= 254, 0x400000, (254 - e) << 23).to(tl.float32, bitcast=True)
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def fp8_bytes(v, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr,
              ROWWISE: tl.constexpr = False):
    """``_common_encode.fp8_encode`` of products ``v = x * scale`` computed on the device, with a
    cheaper NaN byte on the GPU: a NaN product there is the canonical NaN (positive; the GPU
    tests feed -NaN inputs and pass with ``0x7F | sign``), so its byte is the constant 0x7F and
    the per-element sign extraction goes (~2 instructions per element). The select itself stays
    for transposed copies (see ``_common_encode._hw_fp8_code``: without it they are wrong on the H200);
    ``ROWWISE`` (codes stored in the natural layout): E4M3 without it
    (``_common_encode.fp8_encode_rowwise``). The natural columnwise pass packs E4M3 words by
    ``_common_encode.e4m3_word4`` instead (:func:`columnwise_1d`)."""
    if ROWWISE and HW == 1 and MBITS == 3:
        return fp8_encode_rowwise(v, FP8_MAX, MBITS, BIAS, HW)
    if HW == 2:  # one inline-PTX conversion per element (_common_encode._asm_fp8_code)
        return tl.where(v != v, tl.full(v.shape, 0x7F, tl.uint8), asm_fp8_bits(v, MBITS))
    if HW:
        if MBITS == 3:
            hw = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            hw = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
        return tl.where(v != v, tl.full(v.shape, 0x7F, tl.uint8), hw)
    return fp8_encode(v, FP8_MAX, MBITS, BIAS, HW)


@triton.jit
def load_x(ptrs, mask, DTYPE: tl.constexpr, EVEN: tl.constexpr):
    """An FP32 input slice; ``EVEN`` (interior tiles only): no mask, so no predicates."""
    if EVEN:
        if DTYPE == 1:  # BF16 bits, widened by a shift (see _common.load_f32)
            return (tl.load(ptrs).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(ptrs).to(tl.float32)
    return load_f32(ptrs, mask, DTYPE)


@triton.jit
def row_pass_1d(xbase, r0, c0, R, C, sxr, sxc, eps, rd_ptr, rs_ptr, pc, POW2: tl.constexpr,
                MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr,
                RW: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr, ROW: tl.constexpr,
                EVEN: tl.constexpr, COLAMAX: tl.constexpr = True):
    """The BxB tile at (r0, c0) in natural [RW, B] row slices (vector loads, read from device
    memory): with ``ROW`` its 1xB rowwise blocks (a block's row lies in one warp: a shuffle
    reduction) and their scale_inv. With ``COLAMAX`` returns the B column amaxes of the tile
    (else an unused zero vector).

    Why the column amaxes here: each thread keeps a register-local running max of the |x| bits
    it loads (one integer max per element), and one reduction across rows and warps per tile
    gives the Bx1 block amaxes, so the columnwise pass reads the tile only once more."""
    lc = tl.arange(0, B)
    cmask = (c0 + lc) < C
    rbase = rd_ptr + r0.to(tl.int64) * C + c0
    cacc = tl.zeros([RW, B], tl.int32)
    for j in tl.range(0, B // RW, loop_unroll_factor=1):
        lr = j * RW + tl.arange(0, RW)
        rmask = (r0 + lr) < R
        mask = rmask[:, None] & cmask[None, :]
        x = load_x(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE, EVEN)
        a = abs_bits(x)
        if COLAMAX:
            cacc = tl.maximum(cacc, a)
        if ROW:
            scale = block_scale(bits_amax(tl.max(a, 1)), eps, FP8_MAX, POW2)  # [RW]
            code = fp8_bytes(x * scale[:, None], FP8_MAX, MBITS, BIAS, HW, True)
            inv = block_inv(scale, POW2)
            if EVEN:
                tl.store(rbase + tile_offsets(lr, lc, C, 1), code)
                tl.store(rs_ptr + (r0 + lr).to(tl.int64) * tl.cdiv(C, B) + pc, inv)
            else:
                tl.store(rbase + tile_offsets(lr, lc, C, 1), code, mask=mask)
                tl.store(rs_ptr + (r0 + lr).to(tl.int64) * tl.cdiv(C, B) + pc, inv, mask=rmask)
    if COLAMAX:
        return bits_amax(tl.max(cacc, 0))
    else:  # unused; Triton 3.6 cannot return None from one branch of a jit function
        return tl.zeros([B], tl.float32)


@triton.jit
def _col_x4(xbase, lr4, lc, mask, k, scale, sxr, sxc, DTYPE: tl.constexpr, EVEN: tl.constexpr):
    """Column-scaled FP32 values of tile rows ``lr4 + k`` ([CR / 4, B], natural layout)."""
    return load_x(xbase + tile_offsets(lr4 + k, lc, sxr, sxc), mask, DTYPE, EVEN) * scale[None, :]


@triton.jit
def _col_code4(y, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr):
    """The FP8 codes (int32) of the column-scaled values ``y``."""
    return fp8_bytes(y, FP8_MAX, MBITS, BIAS, HW).to(tl.int32)


@triton.jit
def columnwise_1d(xbase, r0, c0, R, C, sxr, sxc, amax, eps, cd_ptr, cs_ptr, pr, POW2: tl.constexpr,
                  MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr,
                  CR: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr, PACK: tl.constexpr,
                  EVEN: tl.constexpr):
    """The Bx1 columnwise blocks of the BxB tile at (r0, c0) (``xbase`` points at it), given
    their amaxes (``amax`` [B], from :func:`row_pass_1d`), stored transposed, and scale_inv.

    The tile is re-read (from cache) in natural [CR, B] slices as four [CR / 4, B] loads of
    rows 4i + k (vector loads, no mask arithmetic per element); the four codes of rows 4i..4i+3
    of a column sit in one thread, so they join into one little-endian int32 word without any
    data exchange (``PACK``, R % 4 == 0), and the word tile leaves transposed through the
    compiler's shared-memory layout conversion. Without PACK, four byte stores."""
    lc = tl.arange(0, B)
    cmask = (c0 + lc) < C
    scale = block_scale(amax, eps, FP8_MAX, POW2)
    for j in tl.range(0, B // CR, loop_unroll_factor=1):
        l4 = j * (CR // 4) + tl.arange(0, CR // 4)  # tile-local word rows
        lr4 = l4 * 4
        mask = ((r0 + lr4) < R)[:, None] & cmask[None, :]
        y0 = _col_x4(xbase, lr4, lc, mask, 0, scale, sxr, sxc, DTYPE, EVEN)
        y1 = _col_x4(xbase, lr4, lc, mask & ((r0 + lr4 + 1) < R)[:, None], 1, scale, sxr, sxc, DTYPE, EVEN)
        y2 = _col_x4(xbase, lr4, lc, mask & ((r0 + lr4 + 2) < R)[:, None], 2, scale, sxr, sxc, DTYPE, EVEN)
        y3 = _col_x4(xbase, lr4, lc, mask & ((r0 + lr4 + 3) < R)[:, None], 3, scale, sxr, sxc, DTYPE, EVEN)
        if PACK:
            if HW and MBITS == 3:  # two paired conversions a word, no NaN select (_common_encode.e4m3_word4)
                w = e4m3_word4(y0, y1, y2, y3)
            else:
                w = (_col_code4(y0, FP8_MAX, MBITS, BIAS, HW) | (_col_code4(y1, FP8_MAX, MBITS, BIAS, HW) << 8)
                     | (_col_code4(y2, FP8_MAX, MBITS, BIAS, HW) << 16)
                     | (_col_code4(y3, FP8_MAX, MBITS, BIAS, HW) << 24))
            # word (c, r / 4) of the [C, R / 4] int32 view; pr * (B // 4) keeps the 16-byte alignment visible
            wbase = cd_ptr.to(tl.pointer_type(tl.int32)) + c0.to(tl.int64) * (R // 4) + pr * (B // 4)
            if EVEN:
                tl.store(wbase + tile_offsets(l4, lc, 1, R // 4), w)
            else:
                tl.store(wbase + tile_offsets(l4, lc, 1, R // 4), w, mask=mask)
        else:
            bbase = cd_ptr + c0.to(tl.int64) * R + r0
            off = tile_offsets(lr4, lc, 1, R)
            tl.store(bbase + off, _col_code4(y0, FP8_MAX, MBITS, BIAS, HW).to(tl.uint8), mask=mask)
            tl.store(bbase + off + 1, _col_code4(y1, FP8_MAX, MBITS, BIAS, HW).to(tl.uint8),
                     mask=mask & ((r0 + lr4 + 1) < R)[:, None])
            tl.store(bbase + off + 2, _col_code4(y2, FP8_MAX, MBITS, BIAS, HW).to(tl.uint8),
                     mask=mask & ((r0 + lr4 + 2) < R)[:, None])
            tl.store(bbase + off + 3, _col_code4(y3, FP8_MAX, MBITS, BIAS, HW).to(tl.uint8),
                     mask=mask & ((r0 + lr4 + 3) < R)[:, None])
    inv = block_inv(scale, POW2)
    if EVEN:
        tl.store(cs_ptr + (c0 + lc).to(tl.int64) * tl.cdiv(R, B) + pr, inv)
    else:
        tl.store(cs_ptr + (c0 + lc).to(tl.int64) * tl.cdiv(R, B) + pr, inv, mask=cmask)


@triton.jit
def _fp8_block_1d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr, eps,
                         ROW: tl.constexpr, COL: tl.constexpr, POW2: tl.constexpr,
                         MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                         B: tl.constexpr, DTYPE: tl.constexpr, CR: tl.constexpr,
                         HW: tl.constexpr, PACK: tl.constexpr, RW: tl.constexpr, EVEN: tl.constexpr):
    """One BxB tile per program, two reads in natural row slices: [RW, B] slices give the
    rowwise copy and the column amaxes (:func:`row_pass_1d`), [CR, B] slices the columnwise
    copy (:func:`columnwise_1d`). ``EVEN``: R and C are multiples of B (no masks)."""
    pr, pc = program_tile(C, B, B)
    r0, c0 = pr * B, pc * B
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    amax = row_pass_1d(xbase, r0, c0, R, C, sxr, sxc, eps, rd_ptr, rs_ptr, pc, POW2, MBITS, BIAS, FP8_MAX,
                       B, RW, DTYPE, HW, ROW, EVEN, COL)
    if COL:
        columnwise_1d(xbase, r0, c0, R, C, sxr, sxc, amax, eps, cd_ptr, cs_ptr, pr, POW2, MBITS, BIAS,
                      FP8_MAX, B, CR, DTYPE, HW, PACK, EVEN)


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


#: 1D defaults (rows per columnwise slice, rows per rowwise slice), the fastest of a
#: tile sweep on an NVIDIA H200:
#: "natural" 128 / 32 (also the fused FP8-current + block kernel's), "slices" 128 columns / 16.
NATURAL_SLICES = (128, 32)
SLICES_SLICES = (128, 16)


def natural_pack(pack: bool, x2: torch.Tensor) -> bool:
    """Whether the "natural" columnwise pass may store 4-row int32 words (else byte stores,
    the same bytes): R % 4 == 0. FP32 input needs :func:`natural_hw`'s conversion for it."""
    return pack and x2.shape[0] % 4 == 0


def natural_hw(x2: torch.Tensor):
    """``fp8_encode``'s HW for the "natural" passes on ``x2``'s device: for FP32 input one
    inline-PTX conversion per element (2). With Triton's paired conversion (1) the H200 (Triton
    3.6) leaves wrong bytes at odd input columns in the packed stores of FP32 input; with one
    conversion per element every tested configuration is bitwise. BF16 / FP16 keep Triton's
    conversion (bitwise there at the tested tiles; 2 costs one more ``cvt`` per two elements).
    Packed E4M3 words take ``_common_encode.e4m3_word4`` (explicitly paired) under either.
    ``test_fp8_block_gpu_options``
    guards both."""
    hw = hw_fp8(x2.device)
    return 2 if hw and x2.dtype == torch.float32 else hw


def quantize(x2: torch.Tensor, dtype: torch.dtype, *, block_dim: int = 1, block_size: int = 128,
             power_2_scale: bool = True, eps: float = 0.0, rowwise: bool = True,
             columnwise: bool = True, chunk: Optional[int] = None, row_slice: Optional[int] = None,
             num_warps: Optional[int] = None, pack: bool = True, method: Optional[str] = None) -> Copies:
    """FP8-block-quantize 2D ``x2`` (any strides); returns ``(row, col)``, each
    ``(data, scale_inv)`` or None, equal to ``formats.fp8_block.quantize_1d(x2)`` /
    ``quantize_1d(x2.t())`` (``block_dim=2``: ``quantize_2d(x2)`` and its transpose).
    One ``block_size``-square tile per program. 1D, ``method="natural"`` (the 1D default):
    rowwise copy and column amaxes from ``row_slice``-row slices (default 32), columnwise copy from
    ``chunk``-row slices (default 128; at least 4 rows, and 32 * num_warps / (B / 8) rows keep every
    thread busy); 4 warps by default. ``method="slices"``: columnwise copy in ``chunk``-column passes
    of transposed sub-tiles read twice (default min(128, B) columns, 16-row slices, 4 warps: one
    column per thread). 2D: walked in ``chunk``-column slices (default 16 / 4 warps).
    ``pack``: transposed stores as int32 words of four rows when R % 4 == 0 (same bytes).
    ``method="tile"``: one whole tile in registers instead (``chunk`` / ``row_slice`` unused;
    :func:`_fp8_block_tile_kernel`); the same bits. The defaults (2D "tile" on 8 warps, 1D
    "natural" 128 / 32 rows on 4 warps) are the fastest row+col methods and tiles on an NVIDIA H200
    (``python -m bench.bench_quantize_kernels`` measures the defaults' bandwidth).
    """
    method = method or ("tile" if block_dim == 2 else "natural")
    if method not in ("natural", "slices", "tile") or (method == "natural" and block_dim == 2):
        raise ValueError(f"method={method!r} is unknown for block_dim={block_dim}; use 'natural' (1D), "
                         "'slices' or 'tile'.")
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim={block_dim} must be 1 or 2.")
    b = block_size
    if b < 32 or b & (b - 1):
        raise ValueError(f"block_size={b} must be a power of two >= 32.")
    chunk_d, rows_d = NATURAL_SLICES if method == "natural" else SLICES_SLICES
    cw = min(chunk or (16 if block_dim == 2 and method != "natural" else chunk_d), b)
    rw = min(row_slice or rows_d, b)
    if b % cw or b % rw or (method == "natural" and cw < 4):
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
    if method == "natural":
        _fp8_block_1d_kernel[grid](
            kernel_input(x2), rd, rs, cd, cs, rows, cols, x2.stride(0), x2.stride(1), f32(eps), ROW=rowwise,
            COL=columnwise, POW2=power_2_scale, MBITS=mbits, BIAS=bias, FP8_MAX=fmax, B=b,
            DTYPE=DTYPE_CODE[x2.dtype], CR=cw, HW=natural_hw(x2), PACK=natural_pack(pack, x2), RW=rw,
            EVEN=rows % b == 0 and cols % b == 0, num_warps=num_warps or 4)
        return row, col
    kernel = _fp8_block_2d_kernel if block_dim == 2 else _fp8_block_1d_t_kernel
    kernel[grid](kernel_input(x2), rd, rs, cd, cs, rows, cols, x2.stride(0), x2.stride(1), f32(eps),
                 ROW=rowwise, COL=columnwise, POW2=power_2_scale, MBITS=mbits, BIAS=bias,
                 FP8_MAX=fmax, B=b, DTYPE=DTYPE_CODE[x2.dtype], CW=cw, HW=hw_fp8(dev),
                 PACK=pack and rows % 4 == 0, RW=rw, num_warps=num_warps or 4)
    return row, col
