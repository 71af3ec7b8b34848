"""MXFP8: OCP microscaling FP8 with E8M0 block scales (numerics §2.4).

- 1D: ``1 x 32`` blocks along the last dim; scale [R, ceil(C/32)] as uint8 E8M0 bytes
  (value ``2**(byte - 127)``, 0xFF = NaN). The columnwise ``32 x 1`` copy is built by the
  caller as ``quantize_1d(x.t())``.
- 2D: ``32 x 32`` tiles (weights); scale [ceil(R/32), ceil(C/32)]. ``quantize_2d(x.t())`` is
  the transpose of ``quantize_2d(x)`` bit for bit.

Scale rules (:func:`e8m0_from_amax`):

- ``"rceil"`` (default; TE / cuBLAS): ``v = block_amax * fp32(1/fp8_max)`` (one FP32 rounding),
  then the E8M0 byte is v's biased FP32 exponent, plus one if v's mantissa is non-zero
  (round toward +inf), with satfinite at 0xFE; a subnormal v <= 2**-127 gives byte 0, a
  subnormal v > 2**-127 gives byte 1. The block max then never saturates: ``amax / scale`` is
  at most about ``fp8_max * (1 + 2**-23)``, which the RNE cast returns as fp8_max.
- ``"floor"`` (OCP spec): byte = floor(log2(block_amax)) + 127 - emax_elem clamped to
  [0, 254], emax_elem = 8 (E4M3) / 15 (E5M2). The block max may saturate (E4M3 amax 480 ->
  scale 1 -> 448).

``data = saturating_cast_fp8(x / scale)``: dividing by a power of two is exact in FP32 except
where the quotient is an FP32 subnormal (rounded once, far below the FP8 grid). Dequantize is
``data.float() * scale``, exact in FP32 (an inf block gives 448 * 2**127 = inf back).

Behaviour where numerics §2.4 leaves a choice:

- Zeros: a block of zeros (amax 0) gets byte 0 (2**-127, "the smallest E8M0 scale") and
  zero data, under both rules. Zero padding of partial blocks never raises an amax.
- NaN: a block with any NaN gets byte 0xFF and all-NaN data (``x / NaN``); other blocks
  are untouched. ±inf (no NaN): byte 0xFE (2**127) under both rules; the inf saturates to
  ±fp8_max (dequantizing back to ±inf) and the block's finite elements become 0.
- Near the FP32 maximum a finite block saturates instead of decoding to inf: a finite
  amax's byte is at most ``254 - emax_elem`` (E4M3 246, E5M2 239), the largest scale with
  ``fp8_max * scale`` finite. Under rceil an amax above ``fp8_max * 2**(127 - emax_elem)``
  (about 2.98e38) would get byte 247 / 240, and an element rounding up to the next power of
  two (amax 3.4e38: 3.4e38 / 2**120 -> 256) would decode to 2**128 = inf; with the cap its
  elements beyond fp8_max * 2**119 (E4M3) / 2**112 (E5M2) saturate to ±fp8_max, decoding to
  about ±2.98e38. Floor never exceeds the cap (FP32_MAX gives 246 / 239). The rceil 0xFE
  clamp is only reachable from inf; it is kept (and unit-tested) for fidelity with TE.
- Decode is the exact FP32 product ``data * 2**(byte - 127)``; a pair beyond FP32's range
  gives ±inf. Only 0xFE (from an inf amax) makes such pairs: an inf input decodes to inf.
- Tiny blocks (rceil byte 0 with 0 < amax <= 448 * 2**-127): we divide by 2**-127 as numerics
  §2.4 says. TE's kernel multiplies by ``exp2f_rcp(0) == 1`` instead, which turns such blocks into
  zeros; our data can be non-zero there. Only blocks with amax < 2**-118 are affected.
- ``quantize(dequantize(q))`` reproduces the dequantized values bit for bit. With rceil the
  bytes can change: a block whose max rounded DOWN onto fp8_max / 2 (E4M3 amax 225 -> data
  224, scale 1) re-quantizes to data 448 with scale 0.5 (same values); one more round trip
  is then a fixed point. With floor the bytes are identical.
"""

from __future__ import annotations

import torch

from hybridfp.formats.common import (
    check_2d,
    FP8_MAX,
    amax_nan,
    blocks_1d,
    blocks_2d,
    ceil_div,
    check_input,
    expand_blocks_1d,
    expand_blocks_2d,
    fp8_dtype,
    saturating_cast_fp8,
)

BLOCK: int = 32

#: floor(log2(fp8_max)): the exponent of the largest power of two in the element type.
EMAX_ELEM: dict[torch.dtype, int] = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}

E8M0_NAN: int = 0xFF
E8M0_MAX: int = 0xFE
#: Largest E8M0 byte of a finite amax, per element type: fp8_max * 2**(byte - 127) finite.
E8M0_MAX_FINITE: dict[torch.dtype, int] = {t: E8M0_MAX - e for t, e in EMAX_ELEM.items()}
_E8M0_BIAS: int = 127
_MANT_MASK: int = 0x7FFFFF
_HALF_SUBNORMAL: int = 0x400000  # mantissa bits of 2**-127 as an FP32 subnormal
_NAN_BITS: int = 0x7FC00000
_RULES: tuple[str, ...] = ("rceil", "floor")


def _fp32_bits(x: torch.Tensor) -> torch.Tensor:
    """Raw IEEE bits of FP32 ``x`` as int32 with the sign bit cleared."""
    return x.float().contiguous().view(torch.int32) & 0x7FFFFFFF


def _e8m0_ceil(v: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (int32) of the smallest power of two >= finite non-negative FP32 ``v``, satfinite.

    TE's ``float_to_e8m0`` round-up branch, bit for bit. Separate so the 0xFE clamp, which no
    finite amax reaches through :func:`e8m0_from_amax`, can be tested.
    """
    bits = _fp32_bits(v)
    exp = bits >> 23
    man = bits & _MANT_MASK
    # A subnormal v <= 2**-127 rounds up to 2**-127, which is byte 0 itself.
    tiny = (exp == 0) & (man <= _HALF_SUBNORMAL)
    round_up = (man != 0) & (exp != E8M0_MAX) & ~tiny
    return exp + round_up.to(torch.int32)


def e8m0_from_amax(
    block_amax: torch.Tensor, dtype: torch.dtype, rule: str = "rceil"
) -> torch.Tensor:
    """E8M0 scale bytes (uint8, same shape) for non-negative block amaxes (numerics §2.4).

    ``rule="rceil"``: TE / cuBLAS, the block max never saturates. ``rule="floor"``: OCP spec,
    ``2**(floor(log2(amax)) - emax_elem)`` clamped to E8M0's range. Under both: amax 0 -> 0,
    NaN -> 0xFF, inf -> 0xFE, a finite amax at most ``E8M0_MAX_FINITE[dtype]`` (saturation
    near the FP32 maximum). Everything is exact integer work on the FP32 bits.
    """
    dtype = fp8_dtype(dtype)
    if rule not in _RULES:
        raise ValueError(
            f"rule={rule!r} is unknown; use 'rceil' (TE / cuBLAS, default) or 'floor' (OCP)."
        )
    a = block_amax.float()
    if rule == "rceil":
        # fp32(1/fp8_max) as a 0-d FP32 tensor, so the multiply is one FP32 rounding on every
        # backend (1/448 and 1/57344 are not halfway cases, so double->float rounds once).
        rcp = torch.full((), 1.0 / FP8_MAX[dtype], dtype=torch.float32, device=a.device)  # no host copy
        e = _e8m0_ceil(a * rcp)  # v == 0 has exponent and mantissa 0 -> byte 0
        # A larger byte could decode the block's largest code to inf (the inf amax is set below).
        e = e.clamp(max=E8M0_MAX_FINITE[dtype])
    else:
        # floor(log2(a)) + 127 = a's exponent field for normal a. A subnormal a (field 0) has
        # floor(log2(a)) <= -127, so the exact result is negative and clamps to 0 just as the
        # field-based one does; a == 0 also lands on 0.
        exp = _fp32_bits(a) >> 23
        e = (exp - EMAX_ELEM[dtype]).clamp(0, E8M0_MAX)
    e = torch.where(torch.isinf(a), E8M0_MAX, e)
    e = torch.where(torch.isnan(a), E8M0_NAN, e)
    return e.to(torch.uint8)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """FP32 value ``2**(e - 127)`` of E8M0 bytes, built from bits (exact everywhere); 0xFF -> NaN.

    Byte 0 is 2**-127, an FP32 subnormal (mantissa 0x400000).
    """
    ei = e.to(torch.int32)
    bits = torch.where(ei == 0, _HALF_SUBNORMAL, ei << 23)
    bits = torch.where(ei == E8M0_NAN, _NAN_BITS, bits)
    return bits.view(torch.float32)


def _check_scale(scale: torch.Tensor, expected: tuple[int, int], what: str) -> None:
    if scale.dtype != torch.uint8:
        raise TypeError(f"{what}: scale must be uint8 E8M0 bytes, got {scale.dtype}.")
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{what}: scale has shape {tuple(scale.shape)}, expected {expected} for data of this "
            f"shape with {BLOCK}-element blocks."
        )


def quantize_1d(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 2D ``x`` with 1x32 blocks.

    Returns ``(data [R, C] in dtype, scale uint8 E8M0 [R, ceil(C/32)])``.
    """
    check_input(x, "mxfp8.quantize_1d input")
    check_2d(x, "mxfp8.quantize_1d input")
    dtype = fp8_dtype(dtype)
    xf = x.float()
    rows, cols = xf.shape
    blocks = blocks_1d(xf, BLOCK)  # zero padding never raises an amax
    scale = e8m0_from_amax(amax_nan(blocks, dim=-1), dtype, rule)
    y = (blocks / e8m0_to_float(scale).unsqueeze(-1)).reshape(rows, blocks.shape[1] * BLOCK)
    data = saturating_cast_fp8(y[:, :cols], dtype)
    return data.contiguous(), scale


def quantize_2d(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 2D ``x`` with 32x32 tiles.

    Returns ``(data [R, C] in dtype, scale uint8 E8M0 [ceil(R/32), ceil(C/32)])``.
    """
    check_input(x, "mxfp8.quantize_2d input")
    check_2d(x, "mxfp8.quantize_2d input")
    dtype = fp8_dtype(dtype)
    xf = x.float()
    rows, cols = xf.shape
    scale = e8m0_from_amax(amax_nan(blocks_2d(xf, BLOCK, BLOCK), dim=-1), dtype, rule)
    s = expand_blocks_2d(e8m0_to_float(scale), BLOCK, BLOCK, rows, cols)
    return saturating_cast_fp8(xf / s, dtype), scale


def dequantize_1d(
    data: torch.Tensor, scale: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``data * 2**(scale - 127)`` per 1x32 block in FP32 (exact), cast to ``out_dtype``."""
    check_2d(data, "mxfp8.dequantize_1d data")
    rows, cols = data.shape
    _check_scale(scale, (rows, ceil_div(cols, BLOCK)), "mxfp8.dequantize_1d")
    s = expand_blocks_1d(e8m0_to_float(scale.to(data.device)), BLOCK, cols)
    return (data.float() * s).to(out_dtype)


def dequantize_2d(
    data: torch.Tensor, scale: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``data * 2**(scale - 127)`` per 32x32 tile in FP32 (exact), cast to ``out_dtype``."""
    check_2d(data, "mxfp8.dequantize_2d data")
    rows, cols = data.shape
    _check_scale(scale, (ceil_div(rows, BLOCK), ceil_div(cols, BLOCK)), "mxfp8.dequantize_2d")
    s = expand_blocks_2d(e8m0_to_float(scale.to(data.device)), BLOCK, BLOCK, rows, cols)
    return (data.float() * s).to(out_dtype)
