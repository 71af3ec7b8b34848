"""Tests for FP8 per-tensor current and delayed scaling (numerics §2.1, §2.2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridfp.formats.common import FP32_MAX, amax_nan
from hybridfp.formats.fp8_tensorwise import (
    current_scale,
    delayed_update,
    dequantize,
    quantize,
    record_amax,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
# Half an ulp relative to |y| for normals (2^-(mantissa bits + 1)) and half the smallest
# subnormal step, per element type: the worst RNE error of one cast.
REL_HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SUB_HALF_STEP = {E4M3: 2.0**-10, E5M2: 2.0**-17}


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def bits32(t: torch.Tensor) -> list[int]:
    return t.float().contiguous().view(torch.int32).flatten().tolist()


def bits8(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def current(x: torch.Tensor, dtype: torch.dtype, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(x, current_scale(amax_nan(x), dtype, **kw), dtype)


def fp8_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """All finite non-negative FP8 values (float64) and their codes, by enumeration."""
    codes = torch.arange(128, dtype=torch.uint8)
    vals = codes.view(dtype).double()
    keep = torch.isfinite(vals)
    return vals[keep], codes[keep].long()


def reference_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating RNE to FP8 by nearest-neighbour search over the enumerated grid (codes)."""
    vals, codes = fp8_grid(dtype)
    a = y.double().abs().clamp(max=vals.max().item()).flatten()
    d = (vals[None, :] - a[:, None]).abs()
    nearest = d == d.min(dim=1, keepdim=True).values
    # Ties go to the even code: the code's LSB is the mantissa's LSB.
    score = nearest.long() * (2 - (codes[None, :] & 1))
    code = codes[score.argmax(dim=1)]
    code = code | (torch.signbit(y.flatten()).long() << 7)
    return code.to(torch.uint8).view(dtype).reshape(y.shape)


def sqnr_db(x: torch.Tensor, d: torch.Tensor) -> float:
    return 10 * math.log10(x.pow(2).sum().item() / (x - d).pow(2).sum().item())


# ---------------------------------------------------------------- current_scale


@pytest.mark.parametrize(
    "dtype, amax, pow2, expected",
    [
        (E4M3, 448.0, False, 1.0),
        (E5M2, 57344.0, False, 1.0),
        (E4M3, 1.0, False, 448.0),
        (E4M3, 1.0, True, 256.0),  # 448 rounded down
        (E5M2, 1.0, False, 57344.0),
        (E5M2, 1.0, True, 32768.0),
        (E4M3, 2.0, True, 128.0),  # 224 rounded down
        (E4M3, 0.875, True, 512.0),  # 448 / 0.875 = 512 exactly: already a power of two
        (E4M3, 3.0, False, 448.0 / 3.0),  # float64 quotient rounds to the FP32 quotient
        (E4M3, 3.0, True, 128.0),
        (E4M3, 0.0, False, 1.0),
        (E4M3, 0.0, True, 1.0),
        (E5M2, math.inf, False, 1.0),
        (E4M3, math.nan, False, 1.0),
        (E4M3, math.nan, True, 1.0),
        (E4M3, 1e-45, False, FP32_MAX),  # 448 / min subnormal overflows
        (E4M3, 1e-45, True, 2.0**127),
        (E5M2, 1e-38, False, FP32_MAX),
    ],
)
def test_current_scale_hand_values(dtype, amax, pow2, expected):
    s = current_scale(f32(amax), dtype, power_2_scale=pow2)
    assert s.dtype == torch.float32 and s.shape == ()
    assert bits32(s) == bits32(f32(expected))


def test_current_scale_is_elementwise():
    amax = torch.tensor([[448.0, 0.0, 1.0], [math.inf, 2.0, 3.0]])
    s = current_scale(amax, E4M3, power_2_scale=True)
    assert s.shape == (2, 3)
    assert s.tolist() == [[1.0, 1.0, 256.0], [1.0, 128.0, 128.0]]


def test_current_scale_eps():
    eps = 1e-3
    expected = bits32(f32(448.0) / f32(eps))
    # eps replaces an amax below it, zero included (TE applies eps before the zero test).
    assert bits32(current_scale(f32(0.0), E4M3, eps=eps)) == expected
    assert bits32(current_scale(f32(1e-5), E4M3, eps=eps)) == expected
    assert current_scale(f32(1.0), E4M3, eps=eps).item() == 448.0
    assert current_scale(f32(math.inf), E4M3, eps=eps).item() == 1.0
    assert current_scale(f32(math.nan), E4M3, eps=eps).item() == 1.0
    assert current_scale(f32(0.0), E4M3, eps=eps, power_2_scale=True).item() == 2.0**18


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_ties_saturation_subnormals(device):
    x = torch.tensor(
        [448.0, 17.0, 19.0, -17.0, -19.0, 232.0, 248.0, 464.0, 470.0, 1e30, math.inf,
         -math.inf, 2.0**-10, 3 * 2.0**-10, 2.0**-9, 0.0, -0.0],
        device=device,
    )
    expected = [448.0, 16.0, 20.0, -16.0, -20.0, 224.0, 256.0, 448.0, 448.0, 448.0, 448.0,
                -448.0, 0.0, 2.0**-8, 2.0**-9, 0.0, -0.0]
    data, scale_inv = quantize(x, f32(1.0), E4M3)
    assert data.dtype == E4M3 and data.device.type == device
    assert data.float().tolist() == expected
    assert bits8(data)[0] == 0x7E and bits8(data)[11] == 0xFE  # ±448, not the NaN code
    assert bits8(data)[-1] == 0x80  # -0 keeps its sign
    assert scale_inv.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_e5m2_ties_saturation_subnormals(device):
    x = torch.tensor(
        [57344.0, 18.0, 22.0, -18.0, 61440.0, 1e6, math.inf, -math.inf, 2.0**-17,
         3 * 2.0**-17, 2.0**-16, 0.0],
        device=device,
    )
    expected = [57344.0, 16.0, 24.0, -16.0, 57344.0, 57344.0, 57344.0, -57344.0, 0.0,
                2.0**-15, 2.0**-16, 0.0]
    data, _ = quantize(x, f32(1.0), E5M2)
    assert data.float().tolist() == expected
    assert bits8(data)[0] == 0x7B and bits8(data)[6] == 0x7B  # max, not the inf code


@pytest.mark.parametrize("dtype", FP8)
def test_scale_applied_and_scale_inv_is_ieee_reciprocal(dtype):
    x = torch.tensor([[3.0, -1.5], [0.75, 0.0]])
    data, scale_inv = current(x, dtype)
    s = f32(448.0 if dtype == E4M3 else 57344.0) / f32(3.0)
    assert bits8(data) == bits8(reference_cast(x * s, dtype))
    assert bits8(data)[0] == bits8(torch.tensor(448.0 if dtype == E4M3 else 57344.0).to(dtype))[0]
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == ()
    assert bits32(scale_inv) == bits32(f32(1.0) / s)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("device", DEVICES)
def test_zeros_tensor(dtype, device):
    x = torch.zeros(4, 5, device=device)
    data, scale_inv = current(x, dtype)
    assert bits8(data) == [0] * 20 and scale_inv.item() == 1.0
    assert dequantize(data, scale_inv).abs().sum().item() == 0.0


@pytest.mark.parametrize("dtype", FP8)
def test_inf_and_nan_inputs(dtype):
    m = 448.0 if dtype == E4M3 else 57344.0
    data, scale_inv = current(torch.tensor([[math.inf, -2.0, 1.0]]), dtype)
    assert scale_inv.item() == 1.0  # non-finite amax -> scale 1
    assert data.float().tolist() == [[m, -2.0, 1.0]]
    data, scale_inv = current(torch.tensor([[math.nan, -2.0, 1.0]]), dtype)
    assert scale_inv.item() == 1.0
    out = data.float()
    assert math.isnan(out[0, 0].item()) and out[0, 1:].tolist() == [-2.0, 1.0]


@pytest.mark.parametrize("dtype", FP8)
def test_amax_element_never_nan(dtype):
    # Non-power-of-two scales can push amax * scale a hair past fp8_max; the clamp keeps it.
    g = torch.Generator().manual_seed(1)
    for amax in torch.rand(200, generator=g) * 1000 + 1e-3:
        x = torch.stack([amax, -amax, amax / 3])[None]
        data, _ = current(x, dtype)
        assert torch.isfinite(data.float()).all()
        assert data.float().abs().max().item() == (448.0 if dtype == E4M3 else 57344.0)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (257, 33), (0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("device", DEVICES)
def test_input_dtypes_and_shapes(in_dtype, shape, device):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 7).to(in_dtype).to(device)
    data, scale_inv = current(x, E4M3)
    assert data.shape == shape and data.dtype == E4M3 and data.device.type == device
    expected = reference_cast(x.float().cpu() * current_scale(amax_nan(x).cpu(), E4M3), E4M3)
    assert bits8(data.cpu()) == bits8(expected)
    out = dequantize(data, scale_inv, out_dtype=in_dtype)
    assert out.dtype == in_dtype and out.shape == shape and out.device.type == device


def test_dequantize_hand_values():
    data = torch.tensor([[448.0, -3.0, 0.0]]).to(E4M3)
    out = dequantize(data, f32(0.5))
    assert out.dtype == torch.float32 and out.tolist() == [[224.0, -1.5, 0.0]]
    out = dequantize(data, f32(1.0 / 3.0), out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert bits32(out.float()) == bits32((data.float() * f32(1.0 / 3.0)).bfloat16().float())


def test_dequantize_saturates_near_fp32_max():
    # 3.2965e38 * 2^-120 = 248 would tie to 256 (even), and 256 * 2^120 = 2^128 overflows FP32:
    # power-of-two scales stay >= min_pow2_scale (2^-119 for E4M3), so the value saturates to
    # 448 * 2^119 instead.
    x = torch.tensor([[3.2964854295465914e38]])
    data, scale_inv = current(x, E4M3, power_2_scale=True)
    assert data.float().item() == 448.0 and scale_inv.item() == 2.0**119
    assert dequantize(data, scale_inv).item() == 448.0 * 2.0**119


@pytest.mark.parametrize("dtype, floor_db", [(E4M3, 30.0), (E5M2, 24.0)])
@pytest.mark.parametrize("pow2", [False, True])
def test_sqnr_gaussian(dtype, floor_db, pow2):
    # 3 (2) mantissa bits give ~31.5 (~25.5) dB on N(0, 1): each bit is ~6 dB.
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(3))
    data, scale_inv = current(x, dtype, power_2_scale=pow2)
    db = sqnr_db(x, dequantize(data, scale_inv))
    assert floor_db < db < floor_db + 3.0


# ---------------------------------------------------------------- properties

# |x| <= 2^127: values near FP32_MAX saturate (test_dequantize_saturates_near_fp32_max), which
# the bound below does not cover.
finite32 = st.floats(min_value=-(2.0**127), max_value=2.0**127, width=32)


@settings(max_examples=80, deadline=None)
@given(
    vals=st.lists(finite32, min_size=1, max_size=64),
    dtype=st.sampled_from(FP8),
    pow2=st.booleans(),
)
def test_property_bound_and_reference(vals, dtype, pow2):
    x = torch.tensor(vals, dtype=torch.float32)[None]
    scale = current_scale(amax_nan(x), dtype, power_2_scale=pow2)
    data, scale_inv = quantize(x, scale, dtype)
    assert bits8(data) == bits8(reference_cast(x * scale, dtype))
    out = dequantize(data, scale_inv)
    # y = x*scale (rel. error 2^-24) is rounded by at most half an FP8 ulp (REL_HALF_ULP*|y|
    # for normals, SUB_HALF_STEP below), then multiplied by scale_inv (rel. error 2^-24,
    # plus 2^-149-sized steps when the product is FP32-subnormal); 1 + 2^-20 covers the
    # FP32 roundings.
    bound = (REL_HALF_ULP[dtype] * x.abs() + SUB_HALF_STEP[dtype] * scale_inv) * (1 + 2.0**-20)
    assert ((out - x).abs() <= bound + 2.0**-147).all()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    log2_mag=st.integers(-40, 40),
    dtype=st.sampled_from(FP8),
    pow2=st.booleans(),
)
def test_property_idempotence(seed, log2_mag, dtype, pow2):
    x = torch.randn(7, 19, generator=torch.Generator().manual_seed(seed)) * 2.0**log2_mag
    scale = current_scale(amax_nan(x), dtype, power_2_scale=pow2)
    data, scale_inv = quantize(x, scale, dtype)
    deq = dequantize(data, scale_inv)
    # Same scale: the same bits (deq * scale is within 2 FP32 ulps of an FP8 grid point).
    again, again_inv = quantize(deq, scale, dtype)
    assert bits8(again) == bits8(data) and bits32(again_inv) == bits32(scale_inv)
    data2, inv2 = current(deq, dtype, power_2_scale=pow2)
    if pow2:
        # Scale recomputed from the dequantized tensor: exactly the same values; the same
        # bits too unless the scale doubled because amax rounded down onto fp8_max / 2.
        assert bits32(dequantize(data2, inv2)) == bits32(deq)
        assert inv2.item() == scale_inv.item() or inv2.item() * 2 == scale_inv.item()
        if inv2.item() == scale_inv.item():
            assert bits8(data2) == bits8(data)
    else:
        # amax always lands on fp8_max, so the data bits repeat; fp8_max / (fp8_max * s_inv)
        # is the old scale up to a couple of FP32 roundings.
        assert bits8(data2) == bits8(data)
        assert abs(inv2.item() - scale_inv.item()) <= 2.0**-22 * scale_inv.item()


# ---------------------------------------------------------------- delayed scaling


def test_record_amax_in_place():
    h = torch.tensor([1.0, 5.0, 2.0])
    record_amax(h, f32(3.0))
    assert h.tolist() == [3.0, 5.0, 2.0]
    record_amax(h, f32(2.0))  # a smaller amax keeps the larger one (several calls per step)
    assert h.tolist() == [3.0, 5.0, 2.0]
    record_amax(h, f32(math.nan))
    assert math.isnan(h[0].item()) and h[1:].tolist() == [5.0, 2.0]
    h2 = torch.zeros(4, 2)
    record_amax(h2, torch.tensor([1.0, 7.0]))
    assert h2[0].tolist() == [1.0, 7.0] and h2[1:].abs().sum().item() == 0.0


@pytest.mark.parametrize(
    "algo, margin, expected_scale",
    [("max", 0, 56.0), ("max", 1, 28.0), ("max", -1, 112.0), ("most_recent", 0, 89.6)],
)
def test_delayed_update_hand_values(algo, margin, expected_scale):
    h = torch.tensor([5.0, 2.0, 8.0, 1.0])
    s = f32(3.0)
    new_h, new_s = delayed_update(h, s, E4M3, margin=margin, algo=algo)
    amax = 8.0 if algo == "max" else 5.0
    assert bits32(new_s) == bits32((f32(448.0) / f32(amax)) / f32(2.0**margin))
    assert new_s.item() == pytest.approx(expected_scale, rel=1e-6)
    # Roll by -1, zero slot 0: the just-recorded 5 moves to the end, the oldest (2) drops.
    assert new_h.tolist() == [0.0, 8.0, 1.0, 5.0]
    assert h.tolist() == [5.0, 2.0, 8.0, 1.0] and s.item() == 3.0  # inputs untouched


@pytest.mark.parametrize("bad_amax", [0.0, math.nan, math.inf])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_update_keeps_old_scale(bad_amax, algo):
    # most_recent looks at slot 0 only, even when an older slot holds a usable amax.
    h = torch.tensor([bad_amax, 3.0 if algo == "most_recent" else 0.0, 0.0])
    _, new_s = delayed_update(h, f32(7.5), E5M2, algo=algo)
    assert new_s.item() == 7.5


def test_delayed_update_inf_scale_is_clamped():
    _, new_s = delayed_update(torch.tensor([1e-45, 0.0]), f32(1.0), E4M3, margin=2)
    assert bits32(new_s) == bits32(f32(FP32_MAX))


def test_delayed_update_per_column_history():
    h = torch.tensor([[1.0, 0.0, 448.0], [4.0, 0.0, math.nan], [2.0, 0.0, 1.0]])
    new_h, new_s = delayed_update(h, torch.tensor([9.0, 9.0, 9.0]), E4M3)
    assert new_s.tolist() == [112.0, 9.0, 9.0]  # 448/4; zero column and NaN column keep 9
    assert bits32(new_h) == bits32(torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 1.0], [1.0, 0.0, 448.0]]))


def test_delayed_update_rejects_unknown_algo():
    with pytest.raises(ValueError, match="most_recent"):
        delayed_update(torch.ones(2), f32(1.0), E4M3, algo="mean")


def test_delayed_scaling_loop():
    # Each step quantizes with the previous step's scale and records its own amax.
    h, scale = torch.zeros(3), f32(1.0)
    used, outs = [], []
    for m in [2.0, 8.0, 1.0, 1.0, 1.0]:
        x = torch.tensor([[m, -m / 2]])
        data, scale_inv = quantize(x, scale, E4M3)
        used.append(scale.item())
        outs.append(dequantize(data, scale_inv).tolist())
        record_amax(h, amax_nan(x))
        h, scale = delayed_update(h, scale, E4M3)
    # The jump to 8 is quantized with the stale scale 224 and saturates (448 / 224 = 2).
    assert used == [1.0, 224.0, 56.0, 56.0, 56.0]
    assert outs == [[[2.0, -1.0]], [[2.0, -2.0]], [[1.0, -0.5]], [[1.0, -0.5]], [[1.0, -0.5]]]
    assert scale.item() == 448.0  # a history of length 3 forgets the 8 at the 5th update
