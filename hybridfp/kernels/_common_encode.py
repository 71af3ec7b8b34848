"""Triton helpers shared by the kernels: exact FP8 / E2M1 / BF16 rounding done in integer and
FP32 arithmetic, and the scale rules of numerics §2 (tiles, loads, stores and amaxes are in
:mod:`._common`).

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

Arithmetic is IEEE FP32 everywhere the reference divides (``tl.math.div_rn``; Triton's ``/``
is an approximate division on NVIDIA GPUs) and mirrors the reference's operation order. No
helper contracts a multiply with an add (the only ``a * b + c`` shapes have an exact
product), so FMA contraction cannot change a bit.

Signs: never negate a float that can be zero to give it a sign (``-v``): Triton 3.6 compiles
unary minus as ``0 - v``, so -(+0.0) is +0.0 on the GPU while the interpreter (newer Triton)
gives -0.0. Signs are OR-ed into the bits (:func:`e4m3_value`, :func:`e2m1_value`); a negation
gives wrong zero signs on the GPU alone, which interpreter tests cannot catch.
"""

from __future__ import annotations

import struct

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
#: BF16 NaN bits torch's ``.to(bfloat16)`` produces (CPU: 0xFFFF; CUDA: 0x7FFF), as int32
#: bits of the FP32 value, so an RHT'd NaN is the same NaN as the reference's.
BF16_NAN_BITS: dict[str, int] = {"cpu": -65536, "cuda": 0x7FFF0000}


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


@triton.jit
def clamp_sym(v, m):
    """clamp(v, -m, m) that keeps NaN (as ``torch.clamp`` does; ``tl.minimum`` would drop it)."""
    return tl.where(v > m, m, tl.where(v < -m, -m, v))


@triton.jit
def clamp_max(v, m):
    """clamp(v, max=m) keeping NaN."""
    return tl.where(v > m, m, v)


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
