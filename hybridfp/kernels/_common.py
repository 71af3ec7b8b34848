"""Triton helpers shared by the quantize kernels: exact FP8 / E2M1 / BF16 rounding done in
integer and FP32 arithmetic, NaN-propagating block amaxes, the scale rules of numerics §2, and a
global-amax kernel.

Why no framework casts under the interpreter: with ``TRITON_INTERPRET=1`` Triton's
``.to(float8)`` mis-rounds values that round across a power of two, its E5M2 casts differ from
torch's, overflow does not saturate, and ``.to(bfloat16)`` truncates. So under the
interpreter every kernel clamps, then rounds to the grid with the integer code of
:func:`fp8_code` and stores the code bytes (uint8 views of the FP8 outputs). On the GPU
:func:`fp8_encode` uses the hardware conversion instead (``HW``, a constexpr chosen by the
device: :func:`hw_fp8`): sm89+ ``cvt.rn.satfinite.e4m3x2/e5m2x2.f32`` is a correctly rounded
RNE cast that also saturates, so it needs no clamp and gives the integer code's bits in ~1
instruction instead of ~20 (the GPU bitwise tests cover every grid point, midpoint +- 2**-20,
subnormals, ±inf and NaN). E2M1 codes saturate in integers (:func:`e2m1_code_sat`). FP16 is
the exception: ``.to(float16)`` rounds correctly in both, so :func:`round_to_dtype` uses it.

Addressing: kernels form one 64-bit base pointer per program (tile origin) and int32 offsets
inside the tile (:func:`tile_offsets`); 64-bit arithmetic on every element cost more than the
quantization itself. The wrappers check that a tile's offsets fit in int32
(:func:`check_int32_tiles`).

Arithmetic is IEEE FP32 everywhere the reference divides (``tl.math.div_rn``; Triton's ``/``
is an approximate division on NVIDIA GPUs) and mirrors the reference's operation order. No
helper contracts a multiply with an add (the only ``a * b + c`` shapes have an exact
product), so FMA contraction cannot change a bit.

Signs: never negate a float that can be zero to give it a sign (``-v``): Triton 3.6 compiles
unary minus as ``0 - v``, so -(+0.0) is +0.0 on the GPU while the interpreter (newer Triton)
gives -0.0. Signs are OR-ed into the bits (:func:`e4m3_value`, :func:`e2m1_value`); a negation
gives wrong zero signs on the GPU alone, which interpreter tests cannot catch.

NaN: Triton's max reductions drop NaN on the GPU, so block amaxes carry a separate NaN flag
(:func:`amax_nan`) and a NaN amax becomes the positive quiet NaN, as ``torch.amax`` of
``|x|`` gives.
"""

from __future__ import annotations

import struct
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch
import triton
import triton.language as tl

FP32_MAX: float = float(torch.finfo(torch.float32).max)
#: Bits of the positive quiet NaN (torch's ``float('nan')``) and of +inf.
NAN_BITS: int = 0x7FC00000
INF_BITS: int = 0x7F800000
#: Integer stand-ins for the FP8 element types inside kernels: (mantissa bits, bias, max).
FP8_FORMATS: dict[torch.dtype, tuple[int, int, float]] = {
    torch.float8_e4m3fn: (3, 7, 448.0),
    torch.float8_e5m2: (2, 15, 57344.0),
}
#: Input dtype -> constexpr code for :func:`round_to_dtype` (0 = FP32, no rounding).
DTYPE_CODE: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: BF16 NaN bits torch's ``.to(bfloat16)`` produces (CPU: 0xFFFF; CUDA: 0x7FFF), as int32
#: bits of the FP32 value, so an RHT'd NaN is the same NaN as the reference's.
BF16_NAN_BITS: dict[str, int] = {"cpu": -65536, "cuda": 0x7FFF0000}


#: What the quantize entry points return: (rowwise, columnwise), each (data, scales) or None.
Copies = Tuple[Optional[Tuple[torch.Tensor, torch.Tensor]], Optional[Tuple[torch.Tensor, torch.Tensor]]]

_POISON: list[Optional[int]] = [None]


@contextmanager
def poisoned_outputs(byte: int = 0x7F) -> Iterator[None]:
    """Inside the block every kernel output is filled with ``byte`` before its launch, so a test
    sees any element a kernel fails to write."""
    old = _POISON[0]
    _POISON[0] = byte
    try:
        yield
    finally:
        _POISON[0] = old


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs (poisoned inside :func:`poisoned_outputs`)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _POISON[0] is not None and t.numel():
        t.reshape(-1).view(torch.uint8).fill_(_POISON[0])
    return t


def f32(value: float) -> float:
    """``value`` rounded once (RNE) to FP32, as a Python float (exact kernel argument)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def f32_div(a: float, b: float) -> float:
    """``a / b`` as one IEEE FP32 division of FP32 operands (e.g. the ``1.0f / 6.0f`` constant)."""
    return torch.div(torch.tensor(f32(a)), torch.tensor(f32(b))).item()


def fp8_params(dtype: torch.dtype) -> tuple[int, int, float]:
    """(mantissa bits, exponent bias, finite max) of an FP8 element dtype."""
    return FP8_FORMATS[dtype]


def bf16_nan_bits(device: torch.device) -> int:
    """The NaN bits torch's BF16 cast gives on ``device``'s type (see BF16_NAN_BITS)."""
    return BF16_NAN_BITS["cuda" if device.type == "cuda" else "cpu"]


def bf16_nan16(device: torch.device) -> int:
    """The same NaN as the int16 a kernel stores for a BF16 output (-1 on CPU, 0x7FFF on CUDA)."""
    return bf16_nan_bits(device) >> 16


def hw_fp8(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use the hardware FP32 -> FP8 conversion: compiled CUDA
    code on sm89+ (the interpreter runs on CPU tensors and keeps the integer rounding)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


#: Largest tile extent (rows or columns) any kernel uses; bounds the int32 tile offsets.
MAX_TILE: int = 256


def check_int32_tiles(*extents: int) -> None:
    """Raise if an int32 offset inside a tile could overflow: every kernel's in-tile offset is
    below ``MAX_TILE * (sum of the tensor extents and strides it multiplies)``."""
    if MAX_TILE * (sum(abs(e) for e in extents) + 1) >= 2**31:
        raise ValueError(f"tensor extents/strides {extents} are too large for the int32 in-tile "
                         "offsets of the Triton quantize kernels.")


def kernel_input(x2: torch.Tensor) -> torch.Tensor:
    """What a kernel reads for ``x2``: BF16 as its raw int16 bits (see :func:`load_f32`)."""
    return x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2


@triton.jit
def load_f32(ptrs, mask, DTYPE: tl.constexpr):
    """Load an input tile as FP32. BF16 (``DTYPE == 1``) comes as int16 bits and is widened
    by a shift: the interpreter's BF16 -> FP32 conversion flushes BF16 subnormals to zero."""
    if DTYPE == 1:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def tile_offsets(rows, cols, sr, sc):
    """int32 offsets ``rows * sr + cols * sc`` of a tile (``rows`` [BR], ``cols`` [BC] are
    tile-local indices; the caller adds the tile origin to a 64-bit base pointer)."""
    return rows[:, None] * sr + cols[None, :] * sc


@triton.jit
def store_transposed_u8(ptr, code, lr, lc, r0, c0, R, C, PACK: tl.constexpr):
    """Store a [BR, BC] uint8 tile ``code`` (tile-local rows ``lr``, columns ``lc``; tile origin
    (r0, c0) of an [R, C] tensor) into the transposed [C, R] byte array at ``ptr``. With
    ``PACK`` (R % 4 == 0) four consecutive rows go as one little-endian int32, so the
    transposition moves 32-bit words instead of bytes."""
    store_transposed_rows_u8(ptr, code, lr, lc, r0, c0, R, R, C, PACK)


@triton.jit
def store_transposed_rows_u8(ptr, code, lr, lc, l0, c0, LD, LIMIT, C, PACK: tl.constexpr):
    """Store a [BR, BC] uint8 tile ``code`` as rows ``l0 + lr`` (those below ``LIMIT``) and
    columns ``c0 + lc`` (below ``C``) of a transposed byte array with row stride ``LD``: element
    (r, c) at ``ptr + c * LD + r``. ``PACK`` (LD and l0 multiples of 4, ``ptr`` 4-byte
    aligned): four consecutive rows go as one little-endian int32 word (a word whose first row
    is below LIMIT is stored whole)."""
    cmask = (c0 + lc) < C
    if PACK:
        BR: tl.constexpr = code.shape[0]
        BC: tl.constexpr = code.shape[1]
        w = tl.reshape(code.to(tl.int32), [BR // 4, 4, BC])
        w = tl.sum(w << (tl.arange(0, 4) * 8)[None, :, None], axis=1)  # disjoint bits: sum == or
        l4 = tl.arange(0, BR // 4)
        wmask = ((l0 // 4 + l4) < (LIMIT + 3) // 4)[:, None] & cmask[None, :]
        base = ptr.to(tl.pointer_type(tl.int32)) + c0.to(tl.int64) * (LD // 4) + l0 // 4
        tl.store(base + tile_offsets(l4, lc, 1, LD // 4), w, mask=wmask)
    else:
        base = ptr + c0.to(tl.int64) * LD + l0
        tl.store(base + tile_offsets(lr, lc, 1, LD), code, mask=((l0 + lr) < LIMIT)[:, None] & cmask[None, :])


@triton.jit
def _cat_rows(a, b):
    """[BC, N] and [BC, N] -> [BC, 2N] (a's rows first); the joined axis stays in each thread."""
    BC: tl.constexpr = a.shape[0]
    N: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [BC, 2 * N])


@triton.jit
def _row(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    """Tile row ``r`` (tile-local; ``rmax`` rows left in the tensor) of columns ``lc``: [BC].
    The row test is a vector (``lc * 0 + r``): the interpreter rejects a scalar & vector mask.
    ``MAP``: the row is source row ``mbase[r]`` of ``xbase`` (then the column base of the whole
    source), zeros where that entry is negative (a row map: ``load_rows32_t``)."""
    ok = (lc * 0 + r) < rmax
    if MAP:
        src = tl.load(mbase + lc * 0 + r, mask=ok, other=-1)  # one address per row: a broadcast
        return load_f32(xbase + src.to(tl.int64) * sxr + lc * sxc, cmask & ok & (src >= 0), DTYPE)
    else:
        return load_f32(xbase + r * sxr + lc * sxc, cmask & ok, DTYPE)


@triton.jit
def _rows4(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    a = tl.join(_row(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                _row(xbase, r + 1, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    b = tl.join(_row(xbase, r + 2, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                _row(xbase, r + 3, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    return _cat_rows(a, b)


@triton.jit
def _rows16(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    a = _cat_rows(_rows4(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                  _rows4(xbase, r + 4, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    b = _cat_rows(_rows4(xbase, r + 8, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                  _rows4(xbase, r + 12, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    return _cat_rows(a, b)


@triton.jit
def load_rows32_t(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase=None, MAP: tl.constexpr = False):
    """Tile rows ``r .. r + 31`` of columns ``lc`` as a TRANSPOSED [BC, 32] FP32 tile (0 past
    the tensor: ``rmax`` rows left from the tile origin, ``cmask`` the column mask). ``MAP``:
    tile row i is source row ``mbase[i]`` (``mbase`` the row map at the tile origin; negative:
    a zero row) of the source whose column base is ``xbase``, so a zero-padded copy of row
    groups is read without being written first.

    Why: a 32x1 (or 128x1) columnwise block reduced over a natural [rows, BC] tile is a
    cross-warp reduction (shared memory, barriers) plus a byte transpose for the store. Here
    the tile is built from 32 row loads joined along a new minor axis, and ``tl.join`` keeps
    that axis inside each thread: with BC = 32 * num_warps every thread holds the 32 rows of
    one column, so the block amax is register-local and the transposed codes leave as
    contiguous words (:func:`store_words_t`). Each row load is still coalesced across the warp
    (consecutive threads, consecutive columns)."""
    return _cat_rows(_rows16(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                     _rows16(xbase, r + 16, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))


@triton.jit
def nan_max(a, b):
    """Elementwise max that propagates NaN (``tl.maximum`` drops it on the GPU)."""
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def store_words_t(ptr, code, lc, c0, r, R, C, PACK: tl.constexpr, WIDE: tl.constexpr = False):
    """Store a transposed [BC, 32] uint8 code tile (rows ``r .. r + 31`` of columns ``c0 + lc``
    of an [R, C] tensor; ``r`` absolute) into the [C, R] byte array at ``ptr``. With ``PACK``
    (R % 4 == 0) each column's 32 codes go as eight little-endian int32 words: two 16-byte
    stores per thread, or with ``WIDE`` one [BC, 8] word store, which the compiler lays out
    two threads per column (through shared memory) so that each L2 write request carries a
    whole 32-byte sector instead of half of one (Nsight Compute: the transposed copies are
    bound by the L2's request rate, not by bytes); else bytewise."""
    BC: tl.constexpr = code.shape[0]
    cmask = (c0 + lc) < C
    if PACK:
        w = tl.reshape(code.to(tl.int32), [BC, 8, 4])
        w = tl.sum(w << (tl.arange(0, 4) * 8)[None, None, :], axis=2)  # disjoint bits: sum == or
        store_code_words_t(ptr, w, lc, c0, r, R, C, WIDE)
    else:
        l32 = tl.arange(0, 32)
        base = ptr + c0.to(tl.int64) * R + r
        tl.store(base + tile_offsets(lc, l32, R, 1), code, mask=cmask[:, None] & ((r + l32) < R)[None, :])


@triton.jit
def store_code_words_t(ptr, w, lc, c0, r, R, C, WIDE: tl.constexpr = False):
    """Store [BC, 8] int32 code words (rows ``r .. r + 31`` of columns ``c0 + lc``, word j = rows
    4j .. 4j + 3; R % 4 == 0) into the [C, R] byte array at ``ptr``, as :func:`store_words_t`
    does (``WIDE``: one [BC, 8] store, else two 16-byte stores per thread)."""
    BC: tl.constexpr = w.shape[0]
    cmask = (c0 + lc) < C
    base = ptr.to(tl.pointer_type(tl.int32)) + c0.to(tl.int64) * (R // 4) + r // 4
    if WIDE:
        l8 = tl.arange(0, 8)
        tl.store(base + tile_offsets(lc, l8, R // 4, 1), w, mask=cmask[:, None] & ((r // 4 + l8) < R // 4)[None, :])
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(w, [BC, 2, 4]), (0, 2, 1)))  # words 0-3, 4-7
        l4 = tl.arange(0, 4)
        off = tile_offsets(lc, l4, R // 4, 1)
        tl.store(base + off, lo, mask=cmask[:, None] & ((r // 4 + l4) < R // 4)[None, :])
        tl.store(base + off + 4, hi, mask=cmask[:, None] & ((r // 4 + 4 + l4) < R // 4)[None, :])


@triton.jit
def clamp_sym(v, m):
    """clamp(v, -m, m) that keeps NaN (as ``torch.clamp`` does; ``tl.minimum`` would drop it)."""
    return tl.where(v > m, m, tl.where(v < -m, -m, v))


@triton.jit
def clamp_max(v, m):
    """clamp(v, max=m) keeping NaN."""
    return tl.where(v > m, m, v)


@triton.jit
def amax_nan(x, axis: tl.constexpr):
    """max|x| over ``axis`` in FP32; the positive quiet NaN where the slice holds a NaN.

    One integer reduction of the magnitude bits ``bits & 0x7FFFFFFF``: non-negative FP32
    numbers order like their bits, and every NaN's bits lie above +inf's, so the max is the
    amax, or a NaN (made the canonical quiet NaN). Half the cross-thread work of a float max
    plus a separate NaN flag."""
    m = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=axis)
    return tl.where(m > 0x7F800000, 0x7FC00000, m).to(tl.float32, bitcast=True)


@triton.jit
def amax_bits(a):
    """int32 bits of a non-negative amax (or NaN), ordered like the values: NaN canonicalized to
    0x7FC00000, which sorts above +inf, so an integer atomic max propagates NaN."""
    return tl.where(a != a, 0x7FC00000, a.to(tl.int32, bitcast=True))


@triton.jit
def fp8_code(v, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """FP8 code byte (uint8) of FP32 ``v`` rounded to nearest even by integer arithmetic (the
    interpreter's path; on the GPU :func:`fp8_encode` uses the hardware conversion).

    ``v`` must already be clamped to the finite range (NaN allowed: 0x7F | sign, torch's
    encoding for both E4M3 and E5M2). Exact integer work on the FP32 bits: the value is
    ``mant * 2**(ea - 23)``; the FP8 quantum is ``2**(max(ea, emin) - MBITS)``, so the code's
    integer significand is ``mant >> s`` rounded half-even on the shifted-out bits. A normal
    result's code is ``(ea + BIAS) << MBITS`` plus the significand's fraction bits (a carry
    into the next binade falls out of the addition); a subnormal's code is the significand.
    """
    EMIN: tl.constexpr = 1 - BIAS
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    abits = bits & 0x7FFFFFFF
    e = abits >> 23
    mant = (abits & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    ea = tl.maximum(e, 1) - 127
    s = tl.minimum(23 - MBITS + tl.maximum(ea, EMIN) - ea, 25)
    q = mant >> s
    rem = mant & ((1 << s) - 1)
    half = 1 << (s - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(ea >= EMIN, ((ea + BIAS) << MBITS) + q - (1 << MBITS), q)
    code = tl.where(abits > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _hw_fp8_code(v, MBITS: tl.constexpr):
    """The hardware's ``cvt.rn.satfinite.e4m3x2 / e5m2x2.f32`` byte of FP32 ``v`` (sm89+),
    NaN as 0x7F | sign (torch's byte; the hardware's E5M2 NaN byte can be 0x7E).

    The conversion rounds to nearest even and saturates by itself (finite overflow and ±inf
    give ±max), so callers need no clamp (``fp8_encode``): the clamp would be ~10 % of the FP8
    per-tensor cast kernel's instructions (sm90 SASS: 912 vs 816 for a 32x128 tile). The NaN
    select stays although NaN products are the canonical NaN (byte 0x7F either way): without
    it (651 instructions) Triton 3.6 on the H200 gives wrong bytes in the transposed copies
    (about half of those packed by ``store_transposed_u8``, an eighth of the grouped kernel's
    byte stores) while the rowwise copies stay right; the cause, presumably the handling of the
    converted byte pairs in layout conversions, is not established."""
    if MBITS == 3:
        hw = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        hw = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return _fp8_nan_select(v, hw)


@triton.jit
def _fp8_nan_select(v, hw):
    """``hw`` (uint8 codes of FP32 ``v``) with NaNs as 0x7F | sign, torch's byte."""
    nan = (((v.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
    return tl.where(v != v, nan, hw)


@triton.jit
def _asm_fp8_code(v, MBITS: tl.constexpr):
    """The same byte as :func:`_hw_fp8_code`, one ``cvt.rn.satfinite.e4m3x2 / e5m2x2.f32`` per
    element (the other half of the pair is 0.0) through inline PTX instead of Triton's own
    conversion, which pairs neighbouring register elements. Why: with Triton 3.6 on the H200
    some tile / layout combinations of the "natural" columnwise passes (4-row int32 words stored
    transposed) give wrong bytes with Triton's conversion while the software encode is right
    (docs/design/quantize-kernels.md); one conversion per element leaves nothing
    to pair. Costs one more ``F2FP`` per two elements."""
    return _fp8_nan_select(v, asm_fp8_bits(v, MBITS))


@triton.jit
def asm_fp8_bits(v, MBITS: tl.constexpr):
    """The hardware's saturating FP8 byte of FP32 ``v`` (uint8; a NaN gives the hardware's NaN
    byte), one ``cvt`` per element: see :func:`_asm_fp8_code`."""
    if MBITS == 3:
        b = tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, 0f00000000, $1; cvt.u32.u16 $0, t; }",
            "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    else:
        b = tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e5m2x2.f32 t, 0f00000000, $1; cvt.u32.u16 $0, t; }",
            "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    return b.to(tl.uint8)


@triton.jit
def fp8_encode(v, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr = False):
    """FP8 code bytes of FP32 ``v`` saturated to ±FP8_MAX (numerics §2: round to nearest even,
    saturate): the hardware conversion on the GPU, which saturates itself (``HW`` 1: Triton's
    conversion; 2: one inline-PTX conversion per element, :func:`_asm_fp8_code`); elsewhere
    (``HW`` 0) :func:`clamp_sym` then :func:`fp8_code`'s integer rounding."""
    if HW == 2:
        return _asm_fp8_code(v, MBITS)
    if HW:
        return _hw_fp8_code(v, MBITS)
    return fp8_code(clamp_sym(v, FP8_MAX), MBITS, BIAS)


@triton.jit
def fp8_encode_rowwise(v, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr = False):
    """:func:`fp8_encode` of products ``v`` computed on the GPU, for a copy stored in the natural
    (rowwise) layout. E4M3 with Triton's conversion (``HW`` 1): the hardware byte alone, no NaN
    select. A NaN product on the GPU is the canonical NaN (positive), whose satfinite E4M3 byte is
    0x7F, torch's byte for it, so the select changed nothing; it cost the byte unpacking around
    each converted pair (sm90: 16 -> 10 instructions per element for the MXFP8 rowwise copy). The
    select stays for E5M2 (the hardware's NaN byte can be 0x7E), for the per-element conversion
    (HW 2) and in :func:`fp8_encode` for transposed copies of Triton's paired conversion
    (:func:`_hw_fp8_code` says why); transposed E4M3 words whose rows sit in one thread go
    without it through :func:`e4m3_word4`."""
    if HW == 1 and MBITS == 3:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return fp8_encode(v, FP8_MAX, MBITS, BIAS, HW)


@triton.jit
def e4m3_word4(y0, y1, y2, y3):
    """The little-endian int32 of the satfinite E4M3 bytes of FP32 products ``y0 .. y3`` computed
    on the GPU (byte k from ``yk``): two paired ``cvt.rn.satfinite.e4m3x2.f32`` (the first operand
    goes to the upper byte) and one move, instead of four per-element conversions, their byte
    extraction and shifts. No NaN select, as :func:`fp8_encode_rowwise`: a NaN product on the
    GPU is the canonical (positive) NaN, whose byte is 0x7F, torch's. The pairs are explicit
    operands here, so the pairing of Triton's own conversion (:func:`_hw_fp8_code`) plays no
    part. For packed transposed stores whose four rows of a word sit in one thread."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [y0, y1, y2, y3], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def e4m3_words_t(y, HW: tl.constexpr):
    """The int32 code words of a transposed [BC, 32] FP32 tile ``y`` (a column's 32 rows: with
    ``load_rows32_t``'s layout all in one thread): [BC, 8], word j holding rows 4j .. 4j + 3
    little endian, E4M3 saturated. The four rows of each word are split out in registers, so on
    the GPU (``HW``) a word is :func:`e4m3_word4`'s two paired conversions with no NaN select
    (the transposed copies' select stays only with Triton's own pairing); elsewhere the
    interpreter's :func:`fp8_code` bytes, packed."""
    BC: tl.constexpr = y.shape[0]
    ev, od = tl.split(tl.reshape(y, [BC, 8, 2, 2]))  # rows 4j + 2a and 4j + 2a + 1
    y0, y2 = tl.split(ev)
    y1, y3 = tl.split(od)
    return fp8_word4(y0, y1, y2, y3, 448.0, 3, 7, HW)


@triton.jit
def fp8_word4(y0, y1, y2, y3, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr):
    """The little-endian int32 of the FP8 codes of ``y0 .. y3`` (byte k from ``yk``): E4M3 on the
    GPU by :func:`e4m3_word4` (explicit pairs, no NaN select), else :func:`fp8_encode`'s bytes
    packed (the interpreter; E5M2 keeps its select)."""
    if HW and MBITS == 3:
        return e4m3_word4(y0, y1, y2, y3)
    return (fp8_encode(y0, FP8_MAX, MBITS, BIAS, HW).to(tl.int32)
            | (fp8_encode(y1, FP8_MAX, MBITS, BIAS, HW).to(tl.int32) << 8)
            | (fp8_encode(y2, FP8_MAX, MBITS, BIAS, HW).to(tl.int32) << 16)
            | (fp8_encode(y3, FP8_MAX, MBITS, BIAS, HW).to(tl.int32) << 24))


@triton.jit
def e4m3_value(code):
    """FP32 value of E4M3 code bytes (0x7F / 0xFF: NaN)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9, exact
    v = tl.where(e == 0, sub, normal)
    v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    # The sign is OR-ed into the bits, not applied by negation: Triton 3.6 compiles ``-v`` as
    # ``0 - v``, which gives +0.0 for code 0x80 (-0.0).
    return (v.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_value(code):
    """FP32 value of E2M1 codes (int32 0..15, bit 3 = sign), as ``formats.nvfp4.decode_e2m1``
    (code 8 is -0.0). The magnitude bits m = 2e + f placed at FP32 bits 22-24 (exponent field e,
    one fraction bit f: E2M1's own layout) read as E2M1(m) * 2**-126: m = 1 is the subnormal
    2**-127, m >= 2 the normal 2**(e - 127) * (1 + f / 2). One exact multiply by 2**126 gives
    0, 0.5, 1, 1.5, 2, 3, 4, 6, instead of compares and selects on m (Triton lowers a float32
    multiply without flushing subnormals; the GPU decode tests check every code)."""
    bits = ((code & 7) << 22) | ((code << 28) & -0x80000000)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126


@triton.jit
def e2m1_code(v):
    """E2M1 code (int32, bit 3 = sign) of FP32 ``v`` (|v| <= 6), round to nearest even, equal to
    the midpoint comparator chain of ``formats.nvfp4.encode_e2m1``; NaN -> magnitude 0.

    For |v| >= 1 the E2M1 grid is FP32 with one fraction bit, so the FP32 bits rounded (RNE,
    integer add of the half-ulp minus one plus the kept bit) to one fraction bit give the code
    directly: ``(bits >> 22) - 252`` maps 1, 1.5, 2, 3, 4, 6 to 2..7 and a carry lands in the
    next binade's code. Below 1 the grid is 0, 0.5, 1: ties at 0.25 and 0.75 go to the even
    codes 0 and 2."""
    bits = v.to(tl.int32, bitcast=True)
    abits = bits & 0x7FFFFFFF
    a = abits.to(tl.float32, bitcast=True)
    big = ((abits + 0x1FFFFF + ((abits >> 22) & 1)) >> 22) - 252
    small = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32)
    code = tl.where(a >= 1.0, big, small)  # NaN fails every comparison: magnitude 0
    return code | ((bits >> 28) & 8)


@triton.jit
def e2m1_code_sat(v):
    """:func:`e2m1_code` of ``clamp(v, -6, 6)`` for any FP32 ``v`` (NaN -> magnitude 0),
    without the float clamp: the magnitude bits saturate at 6.0's by one integer min, and a
    NaN (whose bits the min would also turn into 6.0's) fails the ``>= 1`` test and takes the
    small-value branch, which gives 0 — as the clamp (which keeps NaN) followed by
    :func:`e2m1_code` does. Saves the clamp's two compares and two selects per element."""
    bits = v.to(tl.int32, bitcast=True)
    abits = bits & 0x7FFFFFFF
    a = abits.to(tl.float32, bitcast=True)
    sat = tl.minimum(abits, 0x40C00000)
    big = ((sat + 0x1FFFFF + ((sat >> 22) & 1)) >> 22) - 252
    small = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32)
    code = tl.where(a >= 1.0, big, small)
    return code | ((bits >> 28) & 8)


@triton.jit
def e2m1_code_sr(v, rand):
    """E2M1 code (int32) of FP32 ``v`` (|v| <= 6) by stochastic rounding with uniform draws
    ``rand`` in [0, 1): ``formats.nvfp4.encode_e2m1(v, rand)`` (lo = largest grid value <= |v|,
    up iff rand < (|v| - lo) / (hi - lo)); NaN -> magnitude 0.

    The step hi - lo is a power of two (0.5 below 2, else half |v|'s binade), so the test is
    evaluated as ``rand * step < |v| - lo``: both sides are the reference's scaled by the same
    power of two exactly (the subtraction is exact by Sterbenz), hence the same decision with
    no division. For |v| >= 1, lo is |v| truncated to one fraction bit and its code
    ``(bits >> 22) - 252`` (see :func:`e2m1_code`); at 6 the step is 2 and |v| - lo = 0, so it
    never rounds up."""
    bits = v.to(tl.int32, bitcast=True)
    abits = bits & 0x7FFFFFFF
    a = abits.to(tl.float32, bitcast=True)
    big = a >= 1.0
    half = a >= 0.5
    lo_v = tl.where(big, (abits & 0x7FC00000).to(tl.float32, bitcast=True), tl.where(half, 0.5, 0.0))
    step = tl.where(big, ((abits & 0x7F800000) - 0x800000).to(tl.float32, bitcast=True), 0.5)
    lo = tl.where(big, (abits >> 22) - 252, half.to(tl.int32))
    code = lo + (rand * step < a - lo_v).to(tl.int32)  # NaN: False
    return code | ((bits >> 28) & 8)


@triton.jit
def round_to_dtype(y, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr):
    """FP32 ``y`` rounded (RNE) to the input dtype and back: FP32 as is, BF16 by bit rounding
    (the interpreter's BF16 cast truncates), FP16 by a cast (correct in both modes)."""
    if DTYPE == 1:
        b = y.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        r = tl.where(y != y, BF16_NAN, r)
        return r.to(tl.float32, bitcast=True)
    elif DTYPE == 2:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y


@triton.jit
def min_pow2_scale(FP8_MAX: tl.constexpr):
    """``formats.common.min_pow2_scale``: 2**(E - 127) for FP8_MAX = m 2**E, the smallest
    power-of-two scale whose inverse keeps ``FP8_MAX * scale_inv`` finite (folded by the
    compiler: E4M3 2**-119, E5M2 2**-112)."""
    fb = tl.full([], FP8_MAX, tl.float32).to(tl.int32, bitcast=True)
    return ((((fb >> 23) & 0xFF) - 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def current_scale(amax, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """``formats.fp8_tensorwise.current_scale``: fp8_max / max(amax, eps); 1 where that amax
    is 0 or not finite; FP32_MAX where the division overflows; optionally rounded down to a
    power of two (mantissa cleared) and then at least :func:`min_pow2_scale` (near the FP32
    maximum the tensor saturates instead of decoding to inf)."""
    a = tl.where(amax < eps, eps, amax)
    scale = tl.math.div_rn(tl.full(a.shape, FP8_MAX, tl.float32), a)
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    bad = (a == 0) | (a != a) | (a == float("inf"))
    scale = tl.where(bad, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        scale = tl.maximum(scale, min_pow2_scale(FP8_MAX))  # never NaN: a bad amax gave 1
    return scale


@triton.jit
def program_tile(C, BR: tl.constexpr, BC: tl.constexpr, GRID2: tl.constexpr = False):
    """(pr, pc): the [BR, BC] tile of this program, tiles numbered row-major over C columns;
    ``GRID2``: launched on :func:`tile_grid`'s 2D grid (column tile, row tile), where no integer
    division is needed (~30 instructions a thread, ~1 an element for 32-element threads)."""
    if GRID2:
        return tl.program_id(1), tl.program_id(0)
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    return pid // nc, pid % nc


#: the most row tiles :func:`tile_grid` puts on a 2D grid (CUDA's limit of the grid's y extent)
GRID_Y_MAX = 65535


def tile_grid(rows: int, cols: int, br: int, bc: int) -> tuple[tuple[int, ...], bool]:
    """(launch grid, GRID2 for :func:`program_tile`) of [br, bc] tiles: (column tiles, row tiles)
    while the row tiles fit the grid's y extent (the x index runs fastest, so programs start in the
    same row-major order as on a 1D grid), else one dimension of all tiles."""
    nr, nc = triton.cdiv(rows, br), triton.cdiv(cols, bc)
    if nr <= GRID_Y_MAX:
        return (nc, nr), True
    return (nr * nc,), False


@triton.jit
def load_tile(x_ptr, R, C, sxr, sxc, DTYPE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """This program's [BR, BC] FP32 tile: (x, mask, tile-local rows and columns, origin, (pr, pc))."""
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    mask = ((r0 + lr) < R)[:, None] & ((c0 + lc) < C)[None, :]
    x = load_f32(x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc + tile_offsets(lr, lc, sxr, sxc),
                 mask, DTYPE)
    return x, mask, lr, lc, r0, c0, pr, pc


@triton.jit
def amax_kernel(x_ptr, out_ptr, R, C, sxr, sxc: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr):
    """Global max|x| of a strided 2D tensor: one tile per program, an int32 atomic max of the
    amax bits into ``out_ptr`` (zeroed by the caller)."""
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    mask = ((r0 + lr) < R)[:, None] & ((c0 + lc) < C)[None, :]
    base = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    x = load_f32(base + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE)
    a = amax_nan(amax_nan(x, 1), 0)
    tl.atomic_max(out_ptr, amax_bits(a))


def global_amax(x2: torch.Tensor, *, block: tuple[int, int] = (64, 128)) -> torch.Tensor:
    """max|x2| (FP32 0-d, NaN-propagating) of a non-empty 2D tensor with one launch."""
    rows, cols = x2.shape
    check_int32_tiles(*x2.stride())
    out = torch.zeros((), dtype=torch.int32, device=x2.device)
    br, bc = block
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    amax_kernel[grid](kernel_input(x2), out, rows, cols, x2.stride(0), x2.stride(1),
                      DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc, num_warps=8)
    return out.view(torch.float32)


@triton.jit
def swizzled_tile(pid, T, N, BN: tl.constexpr, GROUP: tl.constexpr):
    """(row tile t of a T-entry tile table, column tile j) of program ``pid`` in a grid of
    T x cdiv(N, BN) programs, swizzled: GROUP consecutive row tiles sweep the column tiles
    together, so a wave's operands stay in L2 (the grouped GEMMs)."""
    per_group = GROUP * tl.cdiv(N, BN)
    first = (pid // per_group) * GROUP
    size = tl.minimum(T - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def expert_row_tile(meta_ptr, t, E, EP: tl.constexpr):
    """(expert e, its row tile index) of row tile ``t`` of a grouped GEMM whose per-expert tile
    counts are given as the prefix sums ``meta_ptr[0 .. E]`` (non-decreasing, ``meta_ptr[E]`` the
    total T > t; ``EP`` a power of two > E). One vector load and a count instead of a per-tile
    table: e is the last expert whose first tile is at or before t (experts without tiles share
    their neighbour's prefix and are skipped), so the host builds E + 1 numbers, not T rows."""
    i = tl.arange(0, EP)
    firsts = tl.load(meta_ptr + i, mask=i <= E, other=t + 1)
    e = tl.sum((firsts <= t).to(tl.int32), 0) - 1
    return e, t - tl.load(meta_ptr + e)
