"""Each quantizer against hybridfp.formats (numerics §2), usage flags (numerics §3), delayed-scaling
state (numerics §2.2), stochastic rounding, make_empty, update_quantized, copy and the
straight-through gradient."""

from __future__ import annotations

import math

import pytest
import torch
from quantizer_cases import (CASES, DTYPES, EMPTY_LAST_DIM_SHAPES, ROWWISE_ONLY, SHAPES, amax,
                             assert_bitwise, assert_payload, assert_same_quantized, bits, f32_div, flat2d,
                             make_input, reference, reference_decode, seed_all)

from hybridfp import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                      IdentityQuantizer, MissingDirectionError, MXFP8Quantizer, NVFP4Quantizer,
                      QuantizedTensor)
from hybridfp.quantizers import NonFiniteAmaxWarning
from hybridfp.formats import nvfp4, rht
from hybridfp.tensors import COLUMNWISE, DIRECTIONS, ROWWISE

NAMES = sorted(CASES)
STATEFUL = {"fp8_delayed", "fp8_delayed_e5m2"}
RANDOM = {n for n in NAMES if "_sr" in n}


def _quantize_and_reference(name, x, rowwise=True, columnwise=True, seed=1234):
    q = CASES[name]()
    q.set_usage(rowwise=rowwise, columnwise=columnwise)
    scale = q.scale.clone() if isinstance(q, Float8Quantizer) else None
    seed_all(q, seed)
    y = q(x)
    seed_all(q, seed)
    return q, y, reference(q, x, rowwise, columnwise, delayed_scale=scale)


def _check_against_reference(q, x, y, ref):
    assert isinstance(y, QuantizedTensor) and y.quantizer is q
    assert y.shape == x.shape and y.dtype == x.dtype
    assert y.directions() == tuple(d for d in DIRECTIONS if ref[d] is not None)
    rows, cols = flat2d(x).shape
    for d in y.directions():
        assert_payload(y.qstorage.payload(d), ref[d], d)
        want = reference_decode(q, ref[d], d, rows, cols).reshape(x.shape).to(x.dtype)
        assert_bitwise(y.dequantize(direction=d), want, f"{d} dequantized")


# ---------------------------------------------------------------- parity with formats
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_matches_formats_reference(name, shape, dtype):
    x = make_input(shape, dtype, seed=len(shape) * 100 + sum(shape))
    q, y, ref = _quantize_and_reference(name, x, columnwise=name not in ROWWISE_ONLY)
    _check_against_reference(q, x, y, ref)


@pytest.mark.parametrize("special", ["nan_inf", "inf", "huge", "zeros"])
@pytest.mark.parametrize("name", NAMES)
def test_edge_values_match_formats_reference(name, special):
    """NaN/inf handling, saturation and all-zero tensors are the formats' (numerics §2): the
    quantizer must not add its own (e.g. in the global amax it computes)."""
    x = make_input((33, 50), torch.bfloat16, seed=4)
    if special == "zeros":
        x.zero_()
    elif special == "huge":
        x[3, :20] = 3.0e38  # near FP32/BF16 max: saturating, scales clamp
    else:
        x[1, 7], x[20, 40] = math.inf, -math.inf
        if special == "nan_inf":
            x[0, 5] = math.nan
    q, y, ref = _quantize_and_reference(name, x, columnwise=name not in ROWWISE_ONLY)
    _check_against_reference(q, x, y, ref)


@pytest.mark.parametrize("shape", EMPTY_LAST_DIM_SHAPES, ids=str)
@pytest.mark.parametrize("name", ["fp8cs_e4m3", "fp8blk_1d", "mxfp8", "nvfp4_rht", "identity"])
def test_zero_width_last_dim(name, shape):
    x = make_input(shape)
    q, y, ref = _quantize_and_reference(name, x)
    _check_against_reference(q, x, y, ref)


# ---------------------------------------------------------------- usage
# A forward-only format's columnwise request is an error (test_quantizer_errors.py).
@pytest.mark.parametrize("name,direction", [(n, d) for n in NAMES for d in DIRECTIONS
                                            if not (d == COLUMNWISE and n in ROWWISE_ONLY)])
def test_single_direction_usage(name, direction):
    x = make_input((33, 50), torch.bfloat16, seed=3)
    q, y, ref = _quantize_and_reference(name, x, direction == ROWWISE, direction == COLUMNWISE)
    assert y.directions() == (direction,)
    _check_against_reference(q, x, y, ref)
    other = COLUMNWISE if direction == ROWWISE else ROWWISE
    with pytest.raises(MissingDirectionError, match=f"no {other} copy"):
        y.dequantize(direction=other)


def test_set_usage_keeps_unspecified_flag():
    q = MXFP8Quantizer(columnwise=False)
    q.set_usage(rowwise=False)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, False)
    q.set_usage(columnwise=True)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)
    assert q(make_input((4, 32))).directions() == (COLUMNWISE,)
    q.set_usage(rowwise=True, columnwise=None)
    assert q(make_input((4, 32))).directions() == (ROWWISE, COLUMNWISE)


# ---------------------------------------------------------------- concrete numbers
def test_fp8_current_scale_numbers():
    x = torch.tensor([[3.5, -1.0, 0.0, 2.0**-12]])
    y = Float8CurrentScalingQuantizer()(x)
    p = y.qstorage.payload(ROWWISE)
    assert p["scale_inv"].item() == 1 / 128  # 448 / 3.5 = 128 exactly
    assert p["data"].float().tolist() == [[448.0, -128.0, 0.0, 2.0**-5]]
    x = torch.tensor([[3.0, 1.0]])
    assert Float8CurrentScalingQuantizer(force_pow_2_scales=True)(x).qstorage.payload(
        ROWWISE)["scale_inv"].item() == 1 / 128  # 149.33 rounded down to 128
    assert Float8CurrentScalingQuantizer("e5m2")(x).qstorage.payload(ROWWISE)["scale_inv"].item() == \
        torch.tensor(1.0).div(torch.tensor(57344.0).div(3.0)).item()
    # eps: max(amax, eps) = 4 -> scale 112; an all-zero tensor without eps -> scale 1.
    assert Float8CurrentScalingQuantizer(amax_epsilon=4.0)(x).qstorage.payload(
        ROWWISE)["scale_inv"].item() == f32_div(1.0, 112.0)
    assert Float8CurrentScalingQuantizer()(torch.zeros(2, 3)).qstorage.payload(ROWWISE)["scale_inv"].item() == 1.0


def test_nvfp4_rht_columnwise_layout_and_amax():
    x = make_input((33, 50), torch.bfloat16, seed=5)
    y = NVFP4Quantizer(with_rht=True)(x)
    col, row = y.qstorage.payload(COLUMNWISE), y.qstorage.payload(ROWWISE)
    assert col["data"].shape == (50, 24)  # 33 rows padded to 48 transformed entries, 2 per byte
    assert col["scale"].shape == (50, 3)
    assert col["amax"].item() == amax(rht.apply_rht(flat2d(x).t(), torch.bfloat16)).item()
    assert col["amax"].item() != row["amax"].item()  # the post-RHT amax is another number here
    pre = NVFP4Quantizer(with_rht=True, with_post_rht_amax=False)(x).qstorage.payload(COLUMNWISE)
    assert pre["amax"].item() == row["amax"].item()
    # Columnwise-only: the pre-RHT amax is still the input's, although no rowwise copy is made.
    only = NVFP4Quantizer(with_rht=True, with_post_rht_amax=False, rowwise=False)(x)
    assert only.qstorage.payload(COLUMNWISE)["amax"].item() == row["amax"].item()


def test_nvfp4_2d_columnwise_equals_2d_quantization_of_transpose():
    x = make_input((33, 50), seed=6)
    col = NVFP4Quantizer(with_2d_quantization=True)(x).qstorage.payload(COLUMNWISE)
    d, s = nvfp4.quantize_2d(x.t(), amax(x))
    assert_bitwise(col["data"], d)
    assert_bitwise(col["scale"], s)


def test_nvfp4_row_scaled_amax_per_row():
    x = make_input((2, 3, 64), seed=7)
    x[0, 1] = 0.0
    p = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)(x).qstorage.payload(ROWWISE)
    assert p["amax"].shape == (6,)
    assert_bitwise(p["amax"], flat2d(x).abs().amax(dim=1))
    assert p["amax"][1].item() == 0.0


# ---------------------------------------------------------------- delayed scaling
def _const(value: float, shape=(4, 8)) -> torch.Tensor:
    x = torch.full(shape, value / 2)
    x[1, 3] = -value
    return x


@pytest.mark.parametrize("algo,margin,scales", [
    ("max", 0, [56.0, 56.0, 224.0]),      # window of 2: max(8), max(8, 2), max(2, 1)
    ("most_recent", 0, [56.0, 224.0, 448.0]),
    ("max", 1, [28.0, 28.0, 112.0]),      # (448 / amax) / 2**margin
])
def test_delayed_scaling_steps(algo, margin, scales):
    q = Float8Quantizer(amax_history_len=2, amax_compute_algo=algo, margin=margin)
    prev = 1.0  # the initial scale
    for amax_t, want in zip([8.0, 2.0, 1.0], scales):
        x = _const(amax_t)
        y = q(x)
        # Quantizing uses the scale from the previous update ...
        p = y.qstorage.payload(ROWWISE)
        assert p["scale_inv"].item() == f32_div(1.0, prev)
        assert_bitwise(p["data"], (x * prev).clamp(-448, 448).to(torch.float8_e4m3fn))
        assert_bitwise(y.qstorage.payload(COLUMNWISE)["data"], p["data"].t().contiguous())
        # ... and records this tensor's amax in slot 0.
        assert q.amax_history[0].item() == amax_t
        q.update_scale()
        assert q.scale.item() == want
        assert q.amax_history[0].item() == 0.0  # rolled: slot 0 is fresh for the next step
        prev = want
    assert q.amax_history.tolist() == [0.0, 1.0]


def test_delayed_records_max_within_a_step_and_keeps_scale_on_zero_amax():
    q = Float8Quantizer(amax_history_len=4)
    q(_const(3.0))
    q(_const(5.0))
    q(_const(4.0))
    assert q.amax_history[0].item() == 5.0
    q.update_scale()
    assert q.scale.item() == f32_div(448.0, 5.0) and q.amax_history.tolist() == [0.0, 0.0, 0.0, 5.0]
    q.update_scale()  # the 5 is still in the window
    assert q.scale.item() == f32_div(448.0, 5.0)
    q2 = Float8Quantizer(amax_history_len=1)
    q2(torch.zeros(3, 3))
    q2.update_scale()
    assert q2.scale.item() == 1.0  # amax 0 keeps the old scale
    q2(torch.tensor([[math.nan, 1.0]]))
    with pytest.warns(NonFiniteAmaxWarning):
        q2.update_scale()
    assert q2.scale.item() == 1.0  # so does a NaN amax


def test_delayed_default_history_length():
    q = Float8Quantizer()
    assert q.amax_history.shape == (1024,) and q.scale.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,margin", [("e4m3", 0), ("e5m2", 2)])
def test_delayed_matches_reference_across_steps(fmt, margin, dtype):
    q = Float8Quantizer(fmt, amax_history_len=3, margin=margin)
    m = 448.0 if fmt == "e4m3" else 57344.0
    amaxes: list[float] = []
    for step in range(5):
        x = make_input((3, 130), dtype, seed=step) * (4.0**step)
        before = q.scale.clone()
        _check_against_reference(q, x, q(x), reference(q, x, delayed_scale=before))
        amaxes.append(amax(x).item())
        q.update_scale()
        window = torch.tensor(max(amaxes[-3:]))
        assert q.scale.item() == (torch.tensor(m) / window / 2.0**margin).item()


# ---------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_reproducible_with_manual_seed():
    x = make_input((64, 64), seed=8)
    q = NVFP4Quantizer(stochastic_rounding=True, with_rht=True)
    torch.manual_seed(11)
    a = q(x)
    torch.manual_seed(11)
    b = q(x)
    assert_same_quantized(a, b)
    c = q(x)  # the stream moved on: other draws
    for d in DIRECTIONS:
        assert not torch.equal(bits(a.qstorage.payload(d)["data"]), bits(c.qstorage.payload(d)["data"]))


def test_stochastic_rounding_with_own_generator():
    x = make_input((64, 64), seed=9)
    q = NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = q(x)
    assert torch.equal(torch.get_rng_state(), state)  # the default stream is not touched
    q.generator.manual_seed(5)
    torch.manual_seed(123)  # and does not matter
    assert_same_quantized(a, q(x))


def test_stochastic_rounding_differs_from_nearest_but_stays_adjacent():
    x = make_input((64, 64), seed=10)
    torch.manual_seed(0)
    sr = NVFP4Quantizer(stochastic_rounding=True, columnwise=False)(x).dequantize(torch.float32)
    rn = NVFP4Quantizer(columnwise=False)(x).dequantize(torch.float32)
    assert not torch.equal(sr, rn)
    # Both pick one of the two E2M1 neighbours of x * encode_scale: at most one grid step
    # (<= 2 in E2M1 units, i.e. 1/3 of the block max 6) apart, times the block's decode scale.
    block_amax = flat2d(x).abs().reshape(64, 4, 16).amax(-1, keepdim=True).expand(64, 4, 16)
    assert ((sr - rn).abs().reshape(64, 4, 16) <= block_amax / 3 * 1.2).all()


# ---------------------------------------------------------------- make_empty, update_quantized
@pytest.mark.parametrize("shape", [(2, 3, 64), (33, 50), (1, 1)], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_make_empty_matches_quantize_layout(name, shape):
    q = CASES[name]()
    e = q.make_empty(shape, dtype=torch.bfloat16)
    y = q(make_input(shape, torch.bfloat16))
    assert isinstance(e, QuantizedTensor)
    assert e.shape == y.shape and e.dtype == y.dtype and e.directions() == y.directions()
    for d in y.directions():
        got, want = e.qstorage.payload(d), y.qstorage.payload(d)
        assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == \
               {k: (tuple(v.shape), v.dtype) for k, v in want.items()}
    assert q.make_empty(shape, requires_grad=True).requires_grad


@pytest.mark.parametrize("from_empty", [False, True], ids=["from_quantize", "from_empty"])
@pytest.mark.parametrize("name", NAMES)
def test_update_quantized_in_place(name, from_empty):
    q = CASES[name]()
    x0, x1 = make_input((33, 50), seed=1), make_input((33, 50), seed=2)
    dst = q.make_empty(x0.shape) if from_empty else q(x0)
    ptrs = [t.data_ptr() for t in dst.qstorage.tensors()]
    fresh_q = q.copy()  # same state (delayed scale / history) as q has now
    seed_all(q, 77)
    out = q.update_quantized(x1, dst)
    assert out is dst
    assert [t.data_ptr() for t in dst.qstorage.tensors()] == ptrs
    seed_all(fresh_q, 77)
    assert_same_quantized(dst, fresh_q(x1))


# ---------------------------------------------------------------- copy, requantization
@pytest.mark.parametrize("name", NAMES)
def test_copy_is_independent_with_equal_settings(name):
    q = CASES[name]()
    q.role = "linear.fc1:input"
    c = q.copy()
    assert c is not q and type(c) is type(q)
    assert c.settings() == q.settings() and c.role == q.role
    assert (c.rowwise_usage, c.columnwise_usage) == (q.rowwise_usage, q.columnwise_usage)
    x = make_input((33, 50), seed=12)
    if isinstance(q, Float8Quantizer):
        assert torch.equal(c.scale, q.scale) and torch.equal(c.amax_history, q.amax_history)
    seed_all(q, 3)
    a = q(x)
    seed_all(c, 3)
    assert_same_quantized(a, c(x))
    c.set_usage(rowwise=not q.rowwise_usage)
    assert c.rowwise_usage != q.rowwise_usage
    if isinstance(q, Float8Quantizer):
        scale, hist = q.scale.clone(), q.amax_history.clone()
        c(x * 100)
        c.update_scale()
        assert torch.equal(q.scale, scale) and torch.equal(q.amax_history, hist)
        assert not torch.equal(c.scale, scale)


@pytest.mark.parametrize("name", NAMES)
def test_is_requantization_safe(name):
    assert CASES[name]().is_requantization_safe() == (name not in STATEFUL | RANDOM)


# ---------------------------------------------------------------- straight-through gradient
@pytest.mark.filterwarnings("ignore:hybridfp. aten")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["fp8cs_e4m3", "fp8_delayed", "fp8blk_2d", "mxfp8", "nvfp4_sr_rht",
                                  "nvfp4_row_scaled", "identity", "identity_bf16"])
def test_quantize_straight_through_gradient(name, dtype):
    q = CASES[name]()
    x = make_input((2, 3, 64), dtype, seed=13).requires_grad_()
    y = q(x)
    assert y.requires_grad and y.grad_fn is not None
    w = make_input((2, 3, 64), dtype, seed=14)
    (y * w).sum().backward()
    assert_bitwise(x.grad, w, "gradient")  # d(sum(q(x) * w))/dx = w, straight through q
    with torch.no_grad():
        assert not q(x).requires_grad
    assert not q(x.detach()).requires_grad


def test_identity_without_cast_aliases_and_with_cast_copies():
    x = make_input((3, 130), torch.bfloat16)
    same = IdentityQuantizer()(x)
    assert same.qstorage.payload(ROWWISE)["data"].data_ptr() == x.data_ptr()
    assert same.qstorage.payload(COLUMNWISE) is same.qstorage.payload(ROWWISE)
    cast = IdentityQuantizer(torch.float32)(x)
    assert cast.qstorage.payload(ROWWISE)["data"].dtype == torch.float32
    assert cast.dtype == torch.bfloat16 and cast.dequantize().dtype == torch.bfloat16


@pytest.mark.parametrize("q", [Float8BlockQuantizer(block_scaling_dim=1), MXFP8Quantizer(),
                               NVFP4Quantizer(with_rht=True)], ids=["fp8blk_1d", "mxfp8", "nvfp4_rht"])
def test_non_contiguous_input(q):
    base = make_input((50, 33), seed=15)
    x = base.t()  # [33, 50], not contiguous
    y = q(x)
    assert_same_quantized(y, q(x.contiguous()))
