"""Triton helpers shared by the quantize kernels: exact FP8 / E2M1 / BF16 rounding done in
integer and FP32 arithmetic, NaN-propagating block amaxes, the scale rules of SPEC §2, and a
global-amax kernel.

Why no framework casts: under ``TRITON_INTERPRET=1`` Triton's ``.to(float8)`` mis-rounds
values that round across a power of two, its E5M2 casts differ from torch's, overflow does not
saturate, and ``.to(bfloat16)`` truncates (DESIGN.md, checked here too). So every kernel
clamps, rounds to the grid with the integer code below and stores the code bytes (uint8
views of the FP8 outputs): the same bits under the interpreter and on the GPU. FP16 is the
exception: ``.to(float16)`` rounds correctly in both, so :func:`round_to_dtype` uses it.

Arithmetic is IEEE FP32 everywhere the reference divides (``tl.math.div_rn``; Triton's ``/``
is an approximate division on NVIDIA GPUs) and mirrors the reference's operation order. No
helper contracts a multiply with an add (the only ``a * b + c`` shapes have an exact
product), so FMA contraction cannot change a bit.

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
def store_transposed_u8(ptr, code, rows, cols, R, C, PACK: tl.constexpr):
    """Store a [BR, BC] uint8 tile ``code`` (rows ``rows``, columns ``cols`` of an [R, C] tensor)
    into the transposed [C, R] byte array at ``ptr``. With ``PACK`` (R % 4 == 0, ``ptr`` 4-byte
    aligned) four consecutive rows go as one little-endian int32, so the transposition moves
    32-bit words instead of bytes."""
    if PACK:
        BR: tl.constexpr = code.shape[0]
        BC: tl.constexpr = code.shape[1]
        w = tl.reshape(code.to(tl.int32), [BR // 4, 4, BC])
        w = tl.sum(w << (tl.arange(0, 4) * 8)[None, :, None], axis=1)  # disjoint bits: sum == or
        r4 = tl.max(tl.reshape(rows.to(tl.int64), [BR // 4, 4]), axis=1) // 4
        wmask = (r4 < R // 4)[:, None] & (cols < C)[None, :]
        wptr = ptr.to(tl.pointer_type(tl.int32)) + cols.to(tl.int64)[None, :] * (R // 4) + r4[:, None]
        tl.store(wptr, w, mask=wmask)
    else:
        bmask = (rows < R)[:, None] & (cols < C)[None, :]
        tl.store(ptr + cols.to(tl.int64)[None, :] * R + rows.to(tl.int64)[:, None], code, mask=bmask)


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
    """max|x| over ``axis`` in FP32; the positive quiet NaN where the slice holds a NaN."""
    a = tl.max(tl.abs(x), axis=axis)
    has_nan = tl.max((x != x).to(tl.int32), axis=axis)
    return tl.where(has_nan > 0, float("nan"), a)


@triton.jit
def amax_bits(a):
    """int32 bits of a non-negative amax (or NaN), ordered like the values: NaN canonicalized to
    0x7FC00000, which sorts above +inf, so an integer atomic max propagates NaN."""
    return tl.where(a != a, 0x7FC00000, a.to(tl.int32, bitcast=True))


@triton.jit
def fp8_code(v, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """FP8 code byte (uint8) of FP32 ``v`` rounded to nearest even.

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
def e4m3_value(code):
    """FP32 value of E4M3 code bytes (0x7F / 0xFF: NaN)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9, exact
    v = tl.where(e == 0, sub, normal)
    v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def e2m1_code(v):
    """E2M1 code (int32, bit 3 = sign) of FP32 ``v`` (|v| <= 6), round to nearest even: the
    midpoint comparator chain of ``formats.nvfp4.encode_e2m1``; NaN -> magnitude 0."""
    a = tl.abs(v)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e2m1_value(k):
    """E2M1 magnitude of codes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) in FP32."""
    return tl.where(k <= 4, k.to(tl.float32) * 0.5, tl.where(k == 5, 3.0, tl.where(k == 6, 4.0, 6.0)))


@triton.jit
def e2m1_code_sr(v, rand):
    """E2M1 code (int32) of FP32 ``v`` (|v| <= 6) by stochastic rounding with uniform draws
    ``rand``: ``formats.nvfp4.encode_e2m1(v, rand)`` step by step (lo = largest grid value
    <= |v|, round up iff rand < (|v| - lo) / (hi - lo), an IEEE division); NaN -> magnitude 0."""
    a = tl.abs(v)
    lo = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    lo += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    lo += (a >= 6.0).to(tl.int32)
    hi = tl.minimum(lo + 1, 7)
    lo_v = _e2m1_value(lo)
    frac = tl.math.div_rn(a - lo_v, _e2m1_value(hi) - lo_v)
    frac = tl.where(hi > lo, frac, 0.0)
    code = lo + (rand < frac).to(tl.int32)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


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
def current_scale(amax, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """``formats.fp8_tensorwise.current_scale``: fp8_max / max(amax, eps); 1 where that amax
    is 0 or not finite; FP32_MAX where the division overflows; optionally rounded down to a
    power of two (mantissa cleared)."""
    a = tl.where(amax < eps, eps, amax)
    scale = tl.math.div_rn(tl.full(a.shape, FP8_MAX, tl.float32), a)
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    bad = (a == 0) | (a != a) | (a == float("inf"))
    scale = tl.where(bad, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def amax_kernel(x_ptr, out_ptr, R, C, sxr, sxc, DTYPE: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr):
    """Global max|x| of a strided 2D tensor: one tile per program, an int32 atomic max of the
    amax bits into ``out_ptr`` (zeroed by the caller)."""
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    rows = (pid // nc) * BR + tl.arange(0, BR)
    cols = (pid % nc) * BC + tl.arange(0, BC)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * sxr + cols.to(tl.int64)[None, :] * sxc
    x = load_f32(ptrs, mask, DTYPE)
    a = amax_nan(amax_nan(x, 1), 0)
    tl.atomic_max(out_ptr, amax_bits(a))


def global_amax(x2: torch.Tensor, *, block: tuple[int, int] = (64, 128)) -> torch.Tensor:
    """max|x2| (FP32 0-d, NaN-propagating) of a non-empty 2D tensor with one launch."""
    rows, cols = x2.shape
    out = torch.zeros((), dtype=torch.int32, device=x2.device)
    br, bc = block
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    amax_kernel[grid](kernel_input(x2), out, rows, cols, x2.stride(0), x2.stride(1),
                      DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc, num_warps=8)
    return out.view(torch.float32)
