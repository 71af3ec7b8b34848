"""Module errors: each names what is wrong and what to do (numerics §3-4)."""

from __future__ import annotations

import pytest
import torch
from nn_cases import make_data, make_module

from hybridfp import (CustomRecipe, GroupedLinear, HybridQuantizer, IdentityQuantizer,
                      LayerNormLinear, MissingDirectionError, MXFP8BlockScaling, MXFP8Quantizer,
                      NVFP4Quantizer, QuantizerRole, autocast)
from hybridfp.gemm import gemm

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected


# ---------------------------------------------------------------- GroupedLinear m_splits
@pytest.mark.parametrize("quantized", [False, True], ids=["high_precision", "autocast"])
@pytest.mark.parametrize("splits, match", [
    ([10, 20, 10], r"GroupedLinear experts: m_splits sum to 40 but the input has 48 rows"),
    ([10, 38], r"m_splits has 2 entries; it needs one per expert \(3\)"),
    ([10, 20, 10, 8], r"m_splits has 4 entries; it needs one per expert \(3\)"),
    ([-2, 30, 20], r"m_splits \[-2, 30, 20\] has negative entries"),
])
def test_bad_m_splits(splits, match, quantized):
    m = make_module("grouped", name="experts")
    x, _ = make_data()
    with autocast(enabled=quantized, recipe=MXFP8BlockScaling()):
        with pytest.raises(ValueError, match=match):
            m(x, splits)


def test_m_splits_as_tensor_and_bad_input_rank():
    m = make_module("grouped", name="experts")
    x, _ = make_data()
    assert m(x, torch.tensor([0, 19, 29])).shape == (48, 32)
    with pytest.raises(ValueError, match=r"GroupedLinear experts: input must be \[tokens, 64\]; got \(4, 12, 64\)"):
        m(x.reshape(4, 12, 64), [0, 19, 29])


# ---------------------------------------------------------------- heterogeneous experts
class HalfHybrid:
    """Stateful factory: hybrid for the first expert of a slot, plain for the others."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, role: QuantizerRole):
        i = self.seen[role.tensor_type] = self.seen.get(role.tensor_type, -1) + 1
        if role.tensor_type == "weight" and i == 0:
            return HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer())
        return MXFP8Quantizer()


class MixedSource:
    """Stateful factory: every expert hybrid, but columnwise_source differs between experts."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, role: QuantizerRole):
        if role.tensor_type != "input":
            return MXFP8Quantizer()
        self.n += 1
        source = "original" if self.n % 2 else "rowwise_dequantized"
        return HybridQuantizer(MXFP8Quantizer(), IdentityQuantizer(), source)


def test_experts_mixing_hybrid_and_plain():
    m = make_module("grouped", name="moe.experts")
    x, _ = make_data()
    with autocast(recipe=CustomRecipe(HalfHybrid())):
        with pytest.raises(ValueError, match=r"role moe\.experts\.weight: the factory returned "
                           r"HybridQuantizers for some experts and plain quantizers for others; "
                           r"return the same kind for every expert"):
            m(x, [0, 19, 29])


def test_experts_mixing_columnwise_source():
    m = make_module("grouped", name="moe.experts")
    x, _ = make_data()
    with autocast(recipe=CustomRecipe(MixedSource())):
        with pytest.raises(ValueError, match=r"role moe\.experts\.input: experts use different "
                           r"columnwise_source values \(\['original', 'rowwise_dequantized'\]\); "
                           "use one for every expert"):
            m(x, [0, 19, 29])
    # A homogeneous factory then works with the same module.
    with autocast(recipe=MXFP8BlockScaling()):
        assert m(x, [0, 19, 29]).shape == (48, 32)


# ---------------------------------------------------------------- missing directions
def test_gemm_with_a_missing_copy_names_direction_and_role():
    q = MXFP8Quantizer()
    q.role = QuantizerRole("linear", "weight", "decoder.fc1")
    q.set_usage(rowwise=True, columnwise=False)
    w = q.quantize(torch.randn(32, 64))
    dy = torch.randn(48, 32)
    with pytest.raises(MissingDirectionError, match=r"MXFP8 tensor of shape \(32, 64\) \(role: "
                       r"decoder\.fc1\.weight\) holds no columnwise copy \(it holds: rowwise\)\. "
                       r"Quantize it with columnwise_usage=True"):
        gemm(dy, w, "NN")  # dgrad reads W's columnwise copy


def test_prequantized_weight_without_columnwise_copy_fails_in_forward():
    """A quantized weight given as the parameter is used as is: if it lacks the copy dgrad
    will need, the forward says so before any GEMM runs, naming the role."""
    m = make_module("linear", name="fc2")
    q = MXFP8Quantizer()
    q.role = m.role("weight")
    q.set_usage(rowwise=True, columnwise=False)
    m.weight = torch.nn.Parameter(q.quantize(m.weight.detach()))
    x, _ = make_data()
    with autocast(recipe=MXFP8BlockScaling()):
        with pytest.raises(MissingDirectionError, match=r"role: fc2\.weight\) holds the copies \['rowwise'\]; "
                                                        r"this call needs rowwise and columnwise"):
            m(x.clone().requires_grad_())


# ---------------------------------------------------------------- forward-only formats
def row_scaled_input(role: QuantizerRole):
    if role.tensor_type == "input":
        return NVFP4Quantizer(row_scaled_nvfp4=True)
    return MXFP8Quantizer()


ROW_SCALED = (r"row-scaled NVFP4 \(role: {}\.input\) is forward-only and has no columnwise "
              r"copy\. Use HybridQuantizer\(rowwise_quantizer=NVFP4Quantizer\(row_scaled_nvfp4=True\), "
              r"columnwise_quantizer=<backward format>\)")


@pytest.mark.parametrize("kind", ["linear", "layernorm", "grouped"])
def test_row_scaled_nvfp4_as_plain_input_quantizer(kind):
    m = make_module(kind, name="blk.proj")
    x, _ = make_data()
    args = ([0, 19, 29],) if kind == "grouped" else ()
    with autocast(recipe=CustomRecipe(row_scaled_input)):
        with pytest.raises(ValueError, match=ROW_SCALED.format(r"blk\.proj")):
            m(x, *args)  # wgrad needs x's columnwise copy
        # Without a weight gradient (frozen weight) nothing needs the columnwise copy.
        for p in m.parameters():
            p.requires_grad_(False)
        assert m(x, *args).shape == (48, 32)


def test_row_scaled_nvfp4_with_save_original_input_fails_in_backward():
    """Row scaling is requantization-safe, so the input is kept and quantized columnwise in
    backward: the same clear error, one step later."""
    m = make_module("linear", name="fc", save_original_input=True)
    x, dy = make_data()
    with autocast(recipe=CustomRecipe(row_scaled_input)):
        y = m(x.clone().requires_grad_())
    with pytest.raises(ValueError, match=ROW_SCALED.format("fc")):
        y.backward(dy)


# ---------------------------------------------------------------- construction and shapes
def test_input_features_mismatch_names_the_module():
    x, _ = make_data()
    for kind, cls in (("linear", "Linear"), ("layernorm", "LayerNormLinear")):
        m = make_module(kind, name="fc")
        for quantized in (False, True):
            with autocast(enabled=quantized):
                with pytest.raises(ValueError, match=rf"{cls} fc: the input has shape \(48, 63\); its "
                                   r"last dimension must be in_features=64"):
                    m(x[:, :63])


def test_factory_returning_none():
    m = make_module("linear", name="fc")
    x, _ = make_data()
    with autocast(recipe=CustomRecipe(lambda role: None)):
        with pytest.raises(ValueError, match=r"returned None for role fc\.input; return "
                           r"hybridfp\.IdentityQuantizer\(\)"):
            m(x)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"normalization='BatchNorm' is unknown; use 'LayerNorm' or 'RMSNorm'"):
        LayerNormLinear(64, 32, normalization="BatchNorm")
    with pytest.raises(ValueError, match=r"GroupedLinear needs num_gemms >= 1; got 0"):
        GroupedLinear(0, 64, 32)
