"""Finite inputs near the FP32 maximum: every format saturates, a finite input never decodes
to inf or NaN.

What saturation gives, per format (documented in each module's docstring):

- FP8 per-tensor and block, power-of-two scales: the scale is at least 2**(floor(log2 fp8_max) - 127)
  (E4M3 2**-119, E5M2 2**-112), so the block's largest code decodes finite; elements beyond
  fp8_max / scale saturate to ±fp8_max * 2**119 (E4M3) / ±fp8_max * 2**112 (E5M2).
- MXFP8 (rceil): a finite amax's E8M0 byte is at most 254 - emax_elem (E4M3 246, E5M2 239);
  ±inf still gets 0xFE and decodes to ±inf (inf in, inf out).
- RHT: a 16-element tile whose max |x| reaches 2**124 is transformed as
  ``butterfly(u * 2**-4) * 4`` (no intermediate overflows); the output saturates to the
  output dtype's largest finite value.
"""

from __future__ import annotations

import pytest
import torch

from hybridfp.formats import fp8_block, fp8_tensorwise, mxfp8, nvfp4, rht
from hybridfp.formats.common import FP32_MAX, FP8_MAX

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Finite values at the top of the FP32 range (FP32_MAX itself, one below it, 3.4e38, the
#: rounding boundaries 3.3e38 / 3.0e38) and their negatives.
NEAR_MAX = (FP32_MAX, float(torch.tensor(0x7F7FFFFE, dtype=torch.int32).view(torch.float32)),
            3.4e38, 3.3e38, 3.0e38, -FP32_MAX, -3.35e38)
#: FP32_MAX's largest power of two below fp8_max: the saturated block's decode.
SAT_E4M3 = 448.0 * 2.0**119
SAT_E5M2 = 57344.0 * 2.0**112


def _near_max_rows(cols: int) -> torch.Tensor:
    """One row per near-max value: that value first, then a mix of ordinary values."""
    x = torch.zeros(len(NEAR_MAX), cols)
    for i, v in enumerate(NEAR_MAX):
        x[i, 0] = v
        x[i, 1] = -v / 3
        x[i, 2:] = torch.linspace(-1.0, 1.0, cols - 2) * 1e37
    return x


def _assert_saturated(y: torch.Tensor, x: torch.Tensor) -> None:
    """Finite, and never of the opposite sign to x."""
    assert torch.isfinite(y).all(), y[~torch.isfinite(y)]
    assert (torch.sign(y) * torch.sign(x) >= 0).all()


# --------------------------------------------------------------------------- FP8 per tensor
@pytest.mark.parametrize("dtype,sat", [(torch.float8_e4m3fn, SAT_E4M3),
                                       (torch.float8_e5m2, SAT_E5M2)])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_tensorwise_near_max_decodes_finite(dtype, sat, pow2):
    """Current scaling of a tensor whose amax is near FP32_MAX: every element decodes finite;
    with power-of-two scales the largest values saturate to fp8_max * min_pow2_scale**-1."""
    x = _near_max_rows(64)
    amax = x.abs().amax()
    scale = fp8_tensorwise.current_scale(amax, dtype, power_2_scale=pow2)
    data, scale_inv = fp8_tensorwise.quantize(x, scale, dtype)
    y = data.float() * scale_inv
    _assert_saturated(y, x)
    if pow2:
        assert y.abs().max().item() == sat


# --------------------------------------------------------------------------- FP8 block
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dim", [1, 2])
def test_fp8_block_near_max_decodes_finite(dtype, pow2, dim):
    x = _near_max_rows(256)
    quant = fp8_block.quantize_1d if dim == 1 else fp8_block.quantize_2d
    deq = fp8_block.dequantize_1d if dim == 1 else fp8_block.dequantize_2d
    data, scale_inv = quant(x, dtype, power_2_scale=pow2)
    _assert_saturated(deq(data, scale_inv), x)
    # The largest code of the format decodes finite with every scale_inv produced.
    assert torch.isfinite(FP8_MAX[dtype] * scale_inv).all()


@pytest.mark.parametrize("dtype,sat", [(torch.float8_e4m3fn, SAT_E4M3),
                                       (torch.float8_e5m2, SAT_E5M2)])
def test_fp8_block_pow2_saturates_at_the_largest_finite_decode(dtype, sat):
    x = torch.full((1, 128), FP32_MAX)
    data, scale_inv = fp8_block.quantize_1d(x, dtype)
    assert scale_inv.item() == sat / FP8_MAX[dtype]
    assert (fp8_block.dequantize_1d(data, scale_inv) == sat).all()


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_block_min_pow2_scale_changes_only_near_max_blocks(dtype):
    """Blocks whose amax stays below fp8_max / min scale keep the scale they had."""
    from hybridfp.formats.common import min_pow2_scale
    lo = min_pow2_scale(dtype)
    a = torch.tensor([1.0, 1e30, FP8_MAX[dtype] / lo, FP32_MAX])
    x = a.reshape(-1, 1).expand(-1, 128).contiguous()
    _, scale_inv = fp8_block.quantize_1d(x, dtype)
    assert torch.equal(scale_inv[:3, 0],
                       1.0 / fp8_block.current_scale(a[:3], dtype, power_2_scale=True))
    assert scale_inv[3, 0].item() == 1.0 / lo


# --------------------------------------------------------------------------- MXFP8
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dim", [1, 2])
def test_mxfp8_near_max_decodes_finite(dtype, rule, dim):
    x = _near_max_rows(64)
    quant = mxfp8.quantize_1d if dim == 1 else mxfp8.quantize_2d
    deq = mxfp8.dequantize_1d if dim == 1 else mxfp8.dequantize_2d
    data, scale = quant(x, dtype, rule=rule)
    _assert_saturated(deq(data, scale), x)
    assert int(scale.max()) <= 254 - mxfp8.EMAX_ELEM[dtype]


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_finite_amax_byte_cap_and_inf(dtype, rule):
    a = torch.tensor([FP32_MAX, 3.0e38, float("inf"), float("nan"), 448.0])
    e = mxfp8.e8m0_from_amax(a, dtype, rule).tolist()
    cap = 254 - mxfp8.EMAX_ELEM[dtype]
    assert e[0] == cap and e[1] <= cap
    assert e[2] == mxfp8.E8M0_MAX and e[3] == mxfp8.E8M0_NAN  # inf -> 0xFE, NaN -> 0xFF (numerics §2.4)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_mxfp8_decode_of_the_inf_scale_is_inf(dtype):
    """Decode is the exact FP32 product: byte 0xFE (only an inf amax gives it) times the
    saturated code is ±inf, so an inf input comes back as inf."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = float("inf"), -float("inf")
    data, scale = mxfp8.quantize_1d(x, dtype)
    y = mxfp8.dequantize_1d(data, scale)
    assert scale.item() == mxfp8.E8M0_MAX
    assert y[0, 0].item() == float("inf") and y[0, 1].item() == -float("inf")
    assert (y[0, 2:] == 0).all()


# --------------------------------------------------------------------------- NVFP4 / RHT
@pytest.mark.parametrize("dim", [1, 2])
def test_nvfp4_near_max_decodes_finite(dim):
    x = _near_max_rows(64)
    g = x.abs().amax()
    quant = nvfp4.quantize_1d if dim == 1 else nvfp4.quantize_2d
    deq = nvfp4.dequantize_1d if dim == 1 else nvfp4.dequantize_2d
    packed, scale = quant(x, g)
    _assert_saturated(deq(packed, scale, g, 64), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rht_near_max_is_finite(dtype):
    top = torch.finfo(dtype).max
    x = torch.zeros(3, 32)
    x[0, :16] = top                          # every tile sum at its largest
    x[1, :16] = torch.tensor(rht.RHT_SIGNS, dtype=torch.float32) * top  # u = s * x all equal
    x[2] = torch.linspace(-1.0, 1.0, 32) * top
    y = rht.apply_rht(x.to(dtype))
    assert y.dtype == dtype
    assert torch.isfinite(y).all()
    # The tile of equal u saturates at the dtype's max (its true value, 4 * max, is not finite).
    assert y[1, 0].item() == top


def test_rht_saturated_tile_keeps_the_transform_elsewhere():
    """A tile of u = s * x all equal to c: the transform is (4c, 0, ..., 0) exactly."""
    c = 2.0**126  # true value 2**128: saturates
    x = (torch.tensor(rht.RHT_SIGNS, dtype=torch.float32) * c).reshape(1, 16)
    y = rht.apply_rht(x)
    assert y[0, 0].item() == FP32_MAX and (y[0, 1:] == 0).all()
    c = 2.0**124  # pre-scaled path, true value 2**126 representable: exact
    y = rht.apply_rht((torch.tensor(rht.RHT_SIGNS, dtype=torch.float32) * c).reshape(1, 16))
    assert y[0, 0].item() == 2.0**126 and (y[0, 1:] == 0).all()


def test_rht_roundtrip_near_max_is_exact_where_representable():
    """Inputs whose transform stays finite come back (FP32, power-of-two values: exact sums)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 5, (4, 32), generator=g).float() * 2.0**123
    y = rht.apply_rht(x)
    assert torch.isfinite(y).all()
    assert torch.equal(rht.apply_inverse_rht(y, 32), x)


def test_inverse_rht_near_max_is_finite():
    y = torch.full((2, 16), FP32_MAX)
    y[1] = torch.linspace(-1.0, 1.0, 16) * FP32_MAX
    x = rht.apply_inverse_rht(y, 16)
    assert torch.isfinite(x).all()
    assert x[0, 0].item() == FP32_MAX * rht.RHT_SIGNS[0]  # (4 * max) saturated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_with_rht_near_max_decodes_finite(dtype):
    """The columnwise RHT path of NVFP4: transform, post-RHT amax, quantize, decode, inverse."""
    top = torch.finfo(dtype).max
    x = _near_max_rows(32).clamp(-top, top).to(dtype)  # finite in dtype
    xt = rht.apply_rht(x)
    g = xt.float().abs().amax()
    assert torch.isfinite(g)
    packed, scale = nvfp4.quantize_1d(xt, g)
    back = rht.apply_inverse_rht(nvfp4.dequantize_1d(packed, scale, g, xt.shape[1]), 32)
    assert torch.isfinite(back).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rht_ordinary_inputs_unchanged(dtype):
    """Below 2**124 the transform is the plain butterfly, bit for bit (subnormals included)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g)
    x[0] *= 2.0**-130  # subnormal range
    x[1] *= 2.0**120
    x = x.to(dtype)
    u = rht.blocks_1d(x.float(), 16) * torch.tensor(rht.RHT_SIGNS, dtype=torch.float32)
    want = (rht._butterfly(u) * 0.25).reshape(8, 64).to(dtype)
    assert torch.equal(rht.apply_rht(x).view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_rht_inf_tile_is_not_saturated():
    """An inf input is not finite: its tile keeps ±inf results (no silent finite value)."""
    x = torch.zeros(1, 32)
    x[0, 3] = float("inf")
    x[0, 16:] = FP32_MAX  # a finite tile next to it saturates
    y = rht.apply_rht(x)
    assert torch.isinf(y[0, :16]).all()
    assert torch.isfinite(y[0, 16:]).all()
    assert torch.isinf(rht.apply_inverse_rht(y, 32)[0, :16]).any()
