"""Built-in recipe options (TransformerEngine names): fp8_format, FP8 block dims, MXFP8
scale_rule / weight_2d, NVFP4 disable switches and row-scaled activations. Each option is
checked on the quantizer it builds and on the numbers that quantizer produces."""

from __future__ import annotations

import pytest
import torch
from recipe_cases import (E4M3, E5M2, NV_1D, NV_GRAD, NV_INPUT, NV_ROW, NV_WEIGHT, ROLES, describe,
                          hybrid, nvfp4, role_id)

import hybridfp as hf
from hybridfp import QuantizerRole
from hybridfp.tensors import COLUMNWISE, ROWWISE

FP8_RECIPES = [hf.DelayedScaling, hf.Float8CurrentScaling, hf.Float8BlockScaling, hf.MXFP8BlockScaling]
GRADS = ("grad_output", "grad_input")


def _t(role):
    return None if role is None else role.tensor_type


# ------------------------------------------------------------------ fp8_format
@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("cls", [hf.DelayedScaling, hf.Float8CurrentScaling])
def test_hybrid_format_is_e4m3_forward_e5m2_gradients(cls, role):
    assert cls().fp8_format == "HYBRID"
    q = cls().quantizer(role)
    assert q.dtype == (E5M2 if _t(role) in GRADS else E4M3)


@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("fmt, dtype", [("E4M3", E4M3), ("E5M2", E5M2)])
@pytest.mark.parametrize("cls", FP8_RECIPES)
def test_single_fp8_format_for_every_role(cls, fmt, dtype, role):
    assert cls(fp8_format=fmt).quantizer(role).dtype == dtype


@pytest.mark.parametrize("cls", [hf.Float8BlockScaling, hf.MXFP8BlockScaling])
def test_block_recipes_default_to_e4m3_everywhere(cls):
    assert {cls().quantizer(r).dtype for r in ROLES} == {E4M3}


def test_hybrid_format_numbers():
    """E4M3 (max 448) for the input, E5M2 (max 57344) for the gradient: the current-scaling
    scale of a tensor with amax 7 is fp8_max / 7."""
    r = hf.Float8CurrentScaling()
    x = torch.zeros(4, 8)
    x[1, 2] = -7.0
    for t, fmax in (("input", 448.0), ("grad_output", 57344.0)):
        qx = r.quantizer(QuantizerRole("linear", t))(x)
        # 448 / 7 = 64 and 57344 / 7 = 8192 exactly, so scale_inv = 7 / fmax exactly.
        assert qx.qstorage.payload(ROWWISE)["scale_inv"].item() == 7.0 / fmax
        assert qx.qstorage.payload(ROWWISE)["data"].dtype == (E4M3 if t == "input" else E5M2)


@pytest.mark.parametrize("cls", FP8_RECIPES)
@pytest.mark.parametrize("bad", ["E3M4", "e4m3", "hybrid", "FP8"])
def test_unknown_fp8_format_fails_when_the_recipe_is_made(cls, bad):
    with pytest.raises(ValueError) as e:
        cls(fp8_format=bad)
    msg = str(e.value)
    assert cls.__name__ in msg and repr(bad) in msg
    assert all(f in msg for f in ("E4M3", "E5M2", "HYBRID"))


def test_fp8_format_changed_after_construction_fails_at_build():
    r = hf.DelayedScaling()
    r.fp8_format = "E3M4"
    with pytest.raises(ValueError, match="E3M4"):
        r.quantizer(QuantizerRole("linear", "input"))


# ------------------------------------------------------------------ delayed / current options
def test_delayed_scaling_options_reach_the_quantizer():
    q = hf.DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent").quantizer(None)
    assert q.settings() == {"fp8_dtype": E4M3, "amax_history_len": 16,
                            "amax_compute_algo": "most_recent", "margin": 2}
    with pytest.raises(ValueError, match="amax_compute_algo"):
        hf.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        hf.DelayedScaling(amax_history_len=0)


def test_current_scaling_options_reach_the_quantizer():
    q = hf.Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=0.5).quantizer(None)
    assert q.settings() == {"fp8_dtype": E4M3, "force_pow_2_scales": True, "amax_epsilon": 0.5}
    x = torch.full((2, 4), 3.0)
    s = q(x).qstorage.payload(ROWWISE)["scale_inv"].item()
    assert s == 2.0 ** -7  # 448 / 3 = 149.3 -> rounded down to 128; scale_inv = 1/128


# ------------------------------------------------------------------ Float8BlockScaling
@pytest.mark.parametrize("role", ROLES, ids=role_id)
def test_block_dims_default(role):
    q = hf.Float8BlockScaling().quantizer(role)
    assert q.block_scaling_dim == (2 if _t(role) == "weight" else 1)
    assert q.force_pow_2_scales


@pytest.mark.parametrize("role", ROLES, ids=role_id)
def test_block_dims_configured(role):
    r = hf.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=2,
                              use_power_2_scales=False, amax_epsilon=1e-3)
    q = r.quantizer(role)
    want = 1 if _t(role) == "weight" else 2  # grad dims for grad_output / grad_input, x else
    assert q.block_scaling_dim == want
    assert (q.force_pow_2_scales, q.amax_epsilon) == (False, 1e-3)


def test_block_dims_give_the_scale_grids():
    """1x128 blocks: a scale per row and 128 columns; 128x128: one per tile."""
    r = hf.Float8BlockScaling()
    x = torch.randn(200, 300)
    qw = r.quantizer(QuantizerRole("linear", "weight"))(x).qstorage
    qx = r.quantizer(QuantizerRole("linear", "input"))(x).qstorage
    assert tuple(qw.payload(ROWWISE)["scale_inv"].shape) == (2, 3)
    assert tuple(qx.payload(ROWWISE)["scale_inv"].shape) == (200, 3)
    assert tuple(qx.payload(COLUMNWISE)["scale_inv"].shape) == (300, 2)


@pytest.mark.parametrize("field", ["x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"])
def test_bad_block_dim_names_the_field(field):
    with pytest.raises(ValueError, match=field):
        hf.Float8BlockScaling(**{field: 3})


# ------------------------------------------------------------------ MXFP8BlockScaling
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_scale_rule(rule):
    r = hf.MXFP8BlockScaling(scale_rule=rule)
    assert {r.quantizer(role).scale_rule for role in ROLES} == {rule}
    # A 1x32 block with amax 500: rceil picks 2**ceil(log2(500/448)) = 2 (E8M0 code 128) so
    # nothing saturates; floor (OCP) picks 2**(floor(log2 500) - 8) = 1 (code 127).
    x = torch.zeros(1, 32)
    x[0, 5] = 500.0
    q = r.quantizer(QuantizerRole("linear", "input"))(x).qstorage.payload(ROWWISE)
    assert q["scale"].view(torch.uint8).flatten().tolist() == [128 if rule == "rceil" else 127]


def test_mxfp8_bad_scale_rule():
    with pytest.raises(ValueError, match="scale_rule"):
        hf.MXFP8BlockScaling(scale_rule="ceil")


@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("weight_2d", [False, True])
def test_mxfp8_weight_2d_only_for_weights(weight_2d, role):
    q = hf.MXFP8BlockScaling(weight_2d=weight_2d).quantizer(role)
    assert q.with_2d_quantization == (weight_2d and _t(role) == "weight")


def test_mxfp8_weight_2d_numbers():
    """32x32 tiles: both copies of the weight hold the same values (fprop and dgrad agree).

    With 1x32 blocks they differ only where an element falls below E4M3's normal range in one
    block and not in the other (power-of-two scales leave the rounding of normal values alike),
    so row 0 gets an outlier that pushes its row block's other elements there: random data alone
    holds no such element in about a quarter of draws."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-2, 2, 96)
    w[0, 31] = 1e4
    qw = hf.MXFP8BlockScaling(weight_2d=True).quantizer(QuantizerRole("linear", "weight"))(w)
    assert torch.equal(qw.dequantize(torch.float32, ROWWISE), qw.dequantize(torch.float32, COLUMNWISE))
    q1 = hf.MXFP8BlockScaling().quantizer(QuantizerRole("linear", "weight"))(w)
    assert not torch.equal(q1.dequantize(torch.float32, ROWWISE), q1.dequantize(torch.float32, COLUMNWISE))


# ------------------------------------------------------------------ NVFP4BlockScaling
SWITCHES = ["disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"]


@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("switch", [None, *SWITCHES])
def test_nvfp4_switches(switch, role):
    r = hf.NVFP4BlockScaling(**({switch: True} if switch else {}))
    rht = switch != "disable_rht"
    t = _t(role)
    if t == "weight":
        want = NV_1D if switch == "disable_2d_quantization" else NV_WEIGHT
    elif t in ("grad_output", "grad_input"):  # every backward slot: RHT + SR (TE's recipe)
        want = nvfp4(rht=rht, sr=switch != "disable_stochastic_rounding")
    else:
        want = nvfp4(rht=rht)
    assert describe(r.quantizer(role)) == want


def test_nvfp4_defaults_are_the_nvidia_recipe():
    r = hf.NVFP4BlockScaling()
    assert describe(r.quantizer(QuantizerRole("linear", "weight"))) == NV_WEIGHT
    assert describe(r.quantizer(QuantizerRole("linear", "grad_output"))) == NV_GRAD
    assert describe(r.quantizer(QuantizerRole("linear", "input"))) == NV_INPUT


@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("disable_rht", [False, True])
def test_nvfp4_row_scaled_activation(disable_rht, role):
    """Row-scaled NVFP4 for the input's rowwise copy only; its columnwise copy stays
    per-tensor NVFP4 (RHT unless disabled); other roles unchanged."""
    r = hf.NVFP4BlockScaling(row_scaled_activation=True, disable_rht=disable_rht)
    plain = hf.NVFP4BlockScaling(disable_rht=disable_rht)
    got = describe(r.quantizer(role))
    if _t(role) == "input":
        assert got == hybrid(NV_ROW, nvfp4(rht=not disable_rht))
    else:
        assert got == describe(plain.quantizer(role))


def test_nvfp4_row_scaled_activation_numbers():
    """One global amax per row in the rowwise copy; the columnwise copy's amax is per tensor
    (post-RHT)."""
    x = torch.randn(20, 48) * torch.logspace(-3, 3, 20)[:, None]
    q = hf.NVFP4BlockScaling(row_scaled_activation=True).quantizer(QuantizerRole("linear", "input"))(x)
    row = q.qstorage.part(ROWWISE).payload(ROWWISE)
    col = q.qstorage.part(COLUMNWISE).payload(COLUMNWISE)
    assert torch.equal(row["amax"], x.abs().amax(1))
    assert col["amax"].dim() == 0
    # Row scaling keeps small rows accurate: relative error per row is bounded by the NVFP4
    # element step (<= 1/4 relative for E2M1 values >= 1, block-scale rounding included
    # stays under 0.3 in norm), whatever the row's magnitude.
    d = q.dequantize(torch.float32, ROWWISE)
    rel = (d - x).norm(dim=1) / x.norm(dim=1)
    assert rel.max().item() < 0.3
    # Per-tensor NVFP4 flushes the smallest rows: their block scales underflow E4M3 (a
    # 1e6 dynamic range is beyond E4M3's 448 / 2**-9 = 2.3e5), so they decode to zeros.
    per_tensor = hf.NVFP4Quantizer()(x).dequantize(torch.float32, ROWWISE)
    assert ((per_tensor - x).norm(dim=1) / x.norm(dim=1)).max().item() == 1.0
