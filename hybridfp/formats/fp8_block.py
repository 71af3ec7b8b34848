"""FP8 block scaling, DeepSeek-V3 style (numerics §2.3).

- 1D: ``1 x block`` blocks along the last dim (inputs, gradients); scale_inv [R, ceil(C/block)].
- 2D: ``block x block`` tiles (weights); scale_inv [ceil(R/block), ceil(C/block)].

Each block's scale is :func:`fp8_tensorwise.current_scale` of the block amax (same rule as
per-tensor current scaling, TE's ``compute_scale_from_amax``), power-of-two by default
(rounded down, so the block max never saturates); ``scale_inv = 1 / scale`` (IEEE FP32
division, exact for power-of-two scales). ``data = saturating_cast_fp8(x * scale)``.

The columnwise copies are built by the caller: the 1D columnwise copy is
``quantize_1d(x.t())`` (128 x 1 blocks, stored transposed); the 2D columnwise copy is the
rowwise result transposed, since ``quantize_2d(x.t())`` equals it bit for bit.

Shapes not divisible by the block are zero-padded for the amax only (zeros never raise a
block amax); ``data`` keeps the logical [R, C] shape.

Behaviour where numerics §2.3 leaves a choice (same rules as :mod:`fp8_tensorwise`):

- A block of zeros gets scale 1 (scale_inv 1) and zero data.
- A block containing NaN gets scale 1: the NaN element stays NaN and the block's other
  elements are quantized (saturating) with scale 1. TE's kernel would give a NaN scale and
  an all-NaN block; numerics §2.1's "not finite -> scale 1" is followed instead. A block
  containing ±inf likewise gets scale 1 and the inf saturates to ±fp8_max.
- Near the FP32 maximum, power-of-two scales saturate instead of decoding to inf: the scale
  is at least :func:`common.min_pow2_scale` (E4M3 2**-119, E5M2 2**-112), the smallest power
  of two with ``fp8_max * scale_inv`` finite. Only blocks with amax above
  ``fp8_max / min_pow2_scale`` (about 2.98e38) are affected; their elements beyond that
  saturate to ±fp8_max, decoding to ±fp8_max * 2**119 (E4M3) / * 2**112 (E5M2), about
  ±2.98e38. (Without the bound, amax 3.4e38 would get scale 2**-120 and its element would
  round up to 256, which decodes to 2**128 = inf.) Scales that are not powers of two need no bound:
  ``fp8_max * (1 / (fp8_max / amax))`` is within a few ulps of amax and stays finite for
  every finite amax. Decode is the FP32 product ``data * scale_inv`` (a pair whose value is
  beyond FP32's range would give ±inf); a finite input never produces such a pair.
- ``quantize(dequantize(q))`` reproduces the dequantized values bit for bit, and the same
  data bits wherever the block scale is unchanged. With power-of-two scales a block whose
  amax rounded DOWN onto fp8_max / 2 (e.g. E4M3 amax 225 -> 224) gets twice the scale on
  re-quantization: other bits, same values.
"""

from __future__ import annotations

import torch

from .common import (amax_nan, blocks_2d, ceil_div, check_2d, expand_blocks_2d, min_pow2_scale,
                     saturating_cast_fp8)
from .fp8_tensorwise import current_scale

DEFAULT_BLOCK: int = 128


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}.")


def _check_scale_shape(scale_inv: torch.Tensor, expected: tuple[int, int], what: str) -> None:
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{what}: scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for this "
            "data shape and block size; pass the block size used to quantize."
        )


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    # Explicit IEEE division (numerics §2), not torch.reciprocal.
    return torch.ones_like(scale) / scale


def _quantize(x: torch.Tensor, dtype: torch.dtype, br: int, bc: int, power_2_scale: bool,
              eps: float, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with ``br x bc`` tiles (br = 1: 1D blocks along the last dim)."""
    check_2d(x, f"{what} input")
    _check_block(bc)
    xf = x.float()
    rows, cols = xf.shape
    amax = amax_nan(blocks_2d(xf, br, bc), dim=-1)
    # with power_2_scale, at least min_pow2_scale: a smaller one would decode the largest code to inf
    scale = current_scale(amax, dtype, eps=eps, power_2_scale=power_2_scale)
    data = saturating_cast_fp8(xf * expand_blocks_2d(scale, br, bc, rows, cols), dtype)
    return data, _reciprocal(scale)


def _dequantize(data: torch.Tensor, scale_inv: torch.Tensor, br: int, bc: int,
                out_dtype: torch.dtype, what: str) -> torch.Tensor:
    """``data * scale_inv`` per ``br x bc`` tile in FP32 (exact for power-of-two scales)."""
    check_2d(data, f"{what} data")
    _check_block(bc)
    rows, cols = data.shape
    _check_scale_shape(scale_inv, (ceil_div(rows, br), ceil_div(cols, bc)), what)
    s = expand_blocks_2d(scale_inv.float().to(data.device), br, bc, rows, cols)
    return (data.float() * s).to(out_dtype)


def quantize_1d(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block: int = DEFAULT_BLOCK,
    power_2_scale: bool = True,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 2D ``x`` with ``1 x block`` blocks; returns ``(data [R, C], scale_inv [R, nb])``."""
    return _quantize(x, dtype, 1, block, power_2_scale, eps, "quantize_1d")


def quantize_2d(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block: int = DEFAULT_BLOCK,
    power_2_scale: bool = True,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 2D ``x`` with ``block x block`` tiles; returns ``(data [R, C], scale_inv [nr, nc])``."""
    _check_block(block)
    return _quantize(x, dtype, block, block, power_2_scale, eps, "quantize_2d")


def dequantize_1d(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``data * scale_inv`` per ``1 x block`` block in FP32 (exact for power-of-two scales), cast to out_dtype."""
    return _dequantize(data, scale_inv, 1, block, out_dtype, "dequantize_1d")


def dequantize_2d(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``data * scale_inv`` per ``block x block`` tile in FP32, cast to out_dtype."""
    _check_block(block)
    return _dequantize(data, scale_inv, block, block, out_dtype, "dequantize_2d")
