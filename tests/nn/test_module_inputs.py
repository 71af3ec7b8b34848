"""Module inputs and options: ``save_original_input`` with every kind of input quantizer,
``GroupedLinear``'s ``m_splits``, and empty GEMM dimensions (in_features = 0, no rows)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from nn_cases import FORMATS, assert_bitwise, assert_grads_bitwise, make_data, make_module, run_step

from hybridfp import (CustomRecipe, DelayedScaling, GroupedLinear, HybridQuantizer, LayerNormLinear,
                      Linear, MXFP8BlockScaling, MXFP8Quantizer, NVFP4Quantizer, QuantizerRole, autocast)
from hybridfp.factories import mxfp8_fwd_high_precision_bwd
from hybridfp.nn import SaveOriginalInputIgnoredWarning
from hybridfp.quantizers import Float8Quantizer

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected
KINDS = ["linear", "layernorm", "grouped"]


def _splits(module: torch.nn.Module, rows: int) -> list[int]:
    return [0, 19, rows - 19] if isinstance(module, GroupedLinear) else []


def _forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x, _splits(module, x.shape[0])) if isinstance(module, GroupedLinear) else module(x)


def sr_input(role: QuantizerRole):
    """An input quantizer that is not requantization-safe (stochastic rounding)."""
    return NVFP4Quantizer(stochastic_rounding=True) if role.tensor_type == "input" else MXFP8Quantizer()


def delayed_child_input(role: QuantizerRole):
    """A hybrid input quantizer with a delayed-scaling child."""
    if role.tensor_type == "input":
        return HybridQuantizer(MXFP8Quantizer(), Float8Quantizer())
    return MXFP8Quantizer()


# ---------------------------------------------------------------- save_original_input
@pytest.mark.parametrize("kind", KINDS)
def test_rowwise_dequantized_input_keeps_the_original_and_matches(kind):
    """A rowwise_dequantized hybrid of safe children re-makes its columnwise copy bit for bit
    from the kept input: the hint is honoured, and the step equals saving the quantized copy."""
    base = make_module(kind)
    keep = make_module(kind, save_original_input=True)
    x, dy = make_data(seed=5)
    recipe = CustomRecipe(mxfp8_fwd_high_precision_bwd)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SaveOriginalInputIgnoredWarning)  # not ignored
        got = run_step(keep, x, dy, recipe, seed=3)
    assert keep._quantizers["input"][0].is_requantization_safe()
    want = run_step(base, x, dy, recipe, seed=3)
    assert_bitwise(got.y, want.y, "output")
    assert_bitwise(got.dx, want.dx, "dx")
    assert_grads_bitwise(got.grads, want.grads, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_ignored_save_original_input_warns_once_per_module(kind):
    m = make_module(kind, name="blocks.0.fc", save_original_input=True)
    x, dy = make_data(seed=5)
    with pytest.warns(SaveOriginalInputIgnoredWarning,
                      match=r"blocks\.0\.fc.*save_original_input=True.*not requantization-safe") as rec:
        run_step(m, x, dy, CustomRecipe(sr_input))
    assert len([w for w in rec if w.category is SaveOriginalInputIgnoredWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", SaveOriginalInputIgnoredWarning)
        run_step(m, x, dy, CustomRecipe(sr_input))  # the same module: said once
    other = make_module(kind, name="blocks.1.fc", save_original_input=True)
    with pytest.warns(SaveOriginalInputIgnoredWarning, match=r"blocks\.1\.fc"):
        run_step(other, x, dy, CustomRecipe(sr_input))


@pytest.mark.parametrize("recipe", [DelayedScaling, lambda: CustomRecipe(delayed_child_input)],
                         ids=["DelayedScaling", "delayed_child"])
@pytest.mark.parametrize("kind", KINDS)
def test_save_original_input_with_delayed_scaling_is_refused(kind, recipe):
    m = make_module(kind, name="blocks.0.fc", save_original_input=True)
    x, _ = make_data(seed=5)
    with autocast(recipe=recipe()):
        with pytest.raises(ValueError, match=r"blocks\.0\.fc.*save_original_input=True.*delayed scaling"):
            _forward(m, x.clone().requires_grad_())


def test_delayed_scaling_without_save_original_input_runs():
    m = make_module("linear")
    x, dy = make_data(seed=5)
    run_step(m, x, dy, DelayedScaling())


# ---------------------------------------------------------------- GroupedLinear m_splits
def _grouped() -> GroupedLinear:
    torch.manual_seed(0)
    return GroupedLinear(3, 32, 16, name="moe.experts")


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("bad, what", [
    ([4.5, 4.5, 4], r"m_splits.*\[4\.5, 4\.5, 4\].*int"),
    ([4.0, 4.0, 5.0], r"m_splits.*int"),
    ("445", r"m_splits.*'445'.*sequence of ints"),
    (None, r"m_splits.*None.*sequence of ints"),
    (13, r"m_splits.*13.*sequence of ints"),
    ([4, True, 8], r"m_splits.*True.*int"),
    (torch.tensor([4.0, 4.0, 5.0]), r"m_splits.*float32.*int64"),
    (torch.tensor([[4, 4, 5]]), r"m_splits.*one-dimensional"),
    (np.array([4.0, 4.0, 5.0]), r"m_splits.*numpy.*float64.*integer"),
    ([4, 4], r"m_splits has 2 entries.*3"),
    ([4, -1, 10], r"m_splits.*negative"),
    ([4, 4, 4], r"m_splits sum to 12.*13 rows"),
], ids=lambda v: repr(v)[:20])
def test_bad_m_splits_are_refused_naming_them(bad, what, quantized):
    m = _grouped()
    x = torch.randn(13, 32)
    with autocast(enabled=quantized, recipe=MXFP8BlockScaling()):
        with pytest.raises((TypeError, ValueError), match=r"moe\.experts.*" + what):
            m(x, bad)


@pytest.mark.parametrize("splits", [[4, 4, 5], (4, 4, 5), torch.tensor([4, 4, 5]),
                                    torch.tensor([4, 4, 5], dtype=torch.int32), np.array([4, 4, 5]),
                                    [np.int64(4), np.int64(4), np.int64(5)]],
                         ids=["list", "tuple", "int64_tensor", "int32_tensor", "numpy", "numpy_ints"])
def test_good_m_splits_forms_agree(splits):
    m = _grouped()
    x = torch.randn(13, 32)
    with autocast(recipe=MXFP8BlockScaling()):
        got = m(x, splits)
        want = m(x, [4, 4, 5])
    assert_bitwise(got, want, "output")


# ---------------------------------------------------------------- empty GEMM dimensions
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fmt", [None, *FORMATS])
def test_linear_with_no_input_features_is_the_bias(fmt, bias):
    """As torch's nn.Linear: y = bias broadcast (zeros without one), dx of shape [..., 0]."""
    torch.manual_seed(0)
    m = Linear(0, 8, bias=bias, name="fc")
    ref = torch.nn.Linear(0, 8, bias=bias)
    if bias:
        with torch.no_grad():
            ref.bias.copy_(m.bias)
    x = torch.randn(2, 3, 0, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    dy = torch.randint(-8, 9, (2, 3, 8)).float() * 0.25  # exact sums in any order: bias grads compare bitwise
    with autocast(enabled=fmt is not None, recipe=FORMATS[fmt]() if fmt else None):
        y = m(x)
    want = ref(xr)
    assert_bitwise(y, want, "output")
    y.backward(dy)
    want.backward(dy)
    assert x.grad.shape == (2, 3, 0)
    assert m.weight.grad.shape == (8, 0)
    if bias:
        assert_bitwise(m.bias.grad, ref.bias.grad, "bias grad")


@pytest.mark.parametrize("quantized", [False, True])
def test_layernorm_linear_with_no_input_features(quantized):
    torch.manual_seed(0)
    m = LayerNormLinear(0, 8, name="fc")
    x = torch.randn(5, 0, requires_grad=True)
    with autocast(enabled=quantized, recipe=MXFP8BlockScaling()):
        y = m(x)
    assert_bitwise(y, m.bias.detach().expand(5, 8), "output")
    y.sum().backward()
    assert x.grad.shape == (5, 0)
    assert_bitwise(m.bias.grad, torch.full((8,), 5.0), "bias grad")


@pytest.mark.parametrize("kind", ["linear", "layernorm"])
def test_no_rows(kind):
    m = make_module(kind)
    x = torch.randn(0, 64, requires_grad=True)
    with autocast(recipe=MXFP8BlockScaling()):
        y = m(x)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert x.grad.shape == (0, 64)
    assert torch.count_nonzero(m.weight.grad) == 0 and torch.count_nonzero(m.bias.grad) == 0


def test_grouped_with_no_rows():
    m = _grouped()
    x = torch.randn(0, 32, requires_grad=True)
    with autocast(recipe=MXFP8BlockScaling()):
        y = m(x, [0, 0, 0])
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 32)
