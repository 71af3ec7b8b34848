"""Quantizer and role semantics shared with TransformerEngine.

- A hybrid is requantization-safe when both children are, whatever its ``columnwise_source``:
  quantizing the same input again reproduces every copy bit for bit (checked here).
- A hybrid with both usages off returns an empty quantized tensor (shape and dtype, no copy);
  reading a value from it is a clear error. A plain quantizer refuses to quantize into nothing.
- ``QuantizerRole`` takes any module / tensor type string and None for each field; factories
  give roles they do not know the forward settings.
- ``update_quantized`` writes the copies of the quantizer's usage; copies it excludes are
  dropped from the destination (never left holding the old value).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from quantizer_cases import CASES, assert_same_quantized, make_input, seed_all

from hybridfp import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                      HybridQuantizer, IdentityQuantizer, MissingDirectionError, MXFP8BlockScaling,
                      MXFP8Quantizer, NVFP4BlockScaling, NVFP4Quantizer, QuantizerRole, factories)
from hybridfp.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer
from hybridfp.tensors import COLUMNWISE, ROWWISE, QuantizedTensor

RD = "rowwise_dequantized"


# ---------------------------------------------------------------- 1. requantization safety
DERIVED = {
    "mxfp8->identity": lambda: HybridQuantizer(MXFP8Quantizer(), IdentityQuantizer(), RD),
    "mxfp8->nvfp4_rht": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True), RD),
    "nvfp4_row_scaled->mxfp8": lambda: HybridQuantizer(CASES["nvfp4_row_scaled"](), MXFP8Quantizer(), RD),
    "nvfp4->nvfp4": lambda: HybridQuantizer(NVFP4Quantizer(), NVFP4Quantizer(), RD),
    "fp8_current->fp8blk": lambda: HybridQuantizer(Float8CurrentScalingQuantizer(),
                                                   Float8BlockQuantizer(block_scaling_dim=1), RD),
}


def _payloads(t: QuantizedTensor, direction: str) -> list[torch.Tensor]:
    return list(t.qstorage.part(direction).payload(direction).values())


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_rowwise_dequantized_requantizes_bitwise(name):
    """The fact the safety rule rests on: quantizing x again (both copies, or the columnwise
    copy alone, as backward does from a kept input) gives the same bits as the forward."""
    h = DERIVED[name]()
    x = make_input((64, 96), torch.bfloat16, seed=3)
    first, again = h(x), h(x)
    h.set_usage(rowwise=False, columnwise=True)
    col_only = h(x)
    for d in (ROWWISE, COLUMNWISE):
        for a, b in zip(_payloads(first, d), _payloads(again, d)):
            assert torch.equal(a, b), f"{name}: {d} copy differs when quantized again"
    for a, b in zip(_payloads(first, COLUMNWISE), _payloads(col_only, COLUMNWISE)):
        assert torch.equal(a, b), f"{name}: the columnwise copy alone differs from the forward's"


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_rowwise_dequantized_hybrid_is_safe_when_both_children_are(name):
    assert DERIVED[name]().is_requantization_safe() is True


@pytest.mark.parametrize("row, col", [("fp8_delayed", "mxfp8"), ("mxfp8", "nvfp4_sr_rht"),
                                      ("nvfp4_sr", "identity")])
def test_rowwise_dequantized_hybrid_with_an_unsafe_child_is_unsafe(row, col):
    assert HybridQuantizer(CASES[row](), CASES[col](), RD).is_requantization_safe() is False


# ---------------------------------------------------------------- 3. empty quantization
def _empty_hybrid() -> HybridQuantizer:
    h = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer())
    h.set_usage(rowwise=False, columnwise=False)
    return h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hybrid_with_no_usage_returns_an_empty_tensor(dtype):
    x = make_input((4, 64), dtype)
    y = _empty_hybrid()(x)
    assert isinstance(y, QuantizedTensor)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert y.directions() == () and y.qstorage.tensors() == []
    assert not y.has_direction(ROWWISE) and not y.has_direction(COLUMNWISE)
    with pytest.raises(MissingDirectionError, match="holds no copy.*set_usage"):
        y.dequantize()
    with pytest.raises(MissingDirectionError, match="columnwise"):
        y.dequantize(direction=COLUMNWISE)


def test_empty_hybrid_keeps_the_straight_through_gradient():
    x = make_input((4, 64), seed=2).requires_grad_()
    y = _empty_hybrid()(x)
    assert y.requires_grad and y.directions() == ()


def test_empty_hybrid_leaves_delayed_children_untouched():
    """Nothing is quantized, so no child records an amax."""
    a, b = Float8Quantizer(), Float8Quantizer()
    h = HybridQuantizer(a, b)
    h.set_usage(rowwise=False, columnwise=False)
    h(make_input((4, 64)) * 100)
    assert a.amax_history.abs().max().item() == 0.0 and b.amax_history.abs().max().item() == 0.0


def test_empty_hybrid_make_empty_matches_quantize():
    e = _empty_hybrid().make_empty((4, 64), dtype=torch.bfloat16)
    assert e.shape == (4, 64) and e.dtype == torch.bfloat16 and e.directions() == ()


@pytest.mark.parametrize("name", ["mxfp8", "fp8cs_e4m3", "nvfp4", "identity"])
def test_plain_quantizer_with_no_usage_is_refused(name):
    q = CASES[name]()
    q.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="rowwise_usage=False and columnwise_usage=False.*set_usage"):
        q(make_input((4, 64)))


# ---------------------------------------------------------------- 4. roles
@pytest.mark.parametrize("args, text", [
    (("dpa", "qkv"), "dpa.qkv"),
    (("attention", "s", "blocks.0.attn"), "blocks.0.attn.s"),
    ((), "(any module).(any tensor)"),
    ((None, None, None), "(any module).(any tensor)"),
    (("linear", None), "linear.(any tensor)"),
    ((None, "input"), "(any module).input"),
    (("", ""), "(any module).(any tensor)"),
])
def test_role_accepts_any_type_and_none(args, text):
    r = QuantizerRole(*args)
    assert str(r) == text
    assert pickle.loads(pickle.dumps(r)) == r and hash(r) == hash(QuantizerRole(*args))


@pytest.mark.parametrize("field", ["module_type", "tensor_type", "name"])
@pytest.mark.parametrize("bad", [3, 1.5, b"input", ("linear",)])
def test_role_fields_must_be_strings_or_none(field, bad):
    kw = {"module_type": "linear", "tensor_type": "input", "name": "fc", field: bad}
    with pytest.raises(TypeError, match=field):
        QuantizerRole(**kw)


RECIPES = [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
           NVFP4BlockScaling(), NVFP4BlockScaling(row_scaled_activation=True)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("args", [("dpa", "qkv"), (), ("linear", None)], ids=str)
def test_builtin_recipes_give_unknown_roles_the_forward_settings(recipe, args):
    got = recipe.quantizer(QuantizerRole(*args))
    want = recipe.quantizer(None)  # a slot whose consumer is unknown: the forward settings
    assert type(got) is type(want) and repr(got) == repr(want)


FACTORIES = [factories.high_precision, factories.delayed_scaling, factories.current_scaling,
             factories.float8_block_scaling, factories.mxfp8, factories.nvfp4,
             factories.high_precision_fwd_mxfp8_bwd, factories.mxfp8_fwd_nvfp4_bwd,
             factories.nvfp4_1d_weight, factories.mxfp8_fwd_high_precision_bwd,
             factories.nvfp4_row_scaled_fwd_mxfp8_bwd, factories.nvfp4_row_scaled_fwd_high_precision_bwd,
             factories.per_gemm("mxfp8", "nvfp4", "fp8")]


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: getattr(f, "__name__", None) or repr(f))
def test_factories_give_unknown_roles_their_default(factory):
    for role in (QuantizerRole("dpa", "qkv"), QuantizerRole(), QuantizerRole(None, "output")):
        got = CustomRecipe(factory).quantizer(role)
        want = CustomRecipe(factory).quantizer(None)
        assert type(got) is type(want) and repr(got) == repr(want), str(role)


# ---------------------------------------------------------------- 5. update_quantized
PLAIN = ["mxfp8", "fp8cs_e4m3", "fp8blk_1d", "nvfp4_rht", "identity"]


def _hybrid(name: str) -> HybridQuantizer:
    return HybridQuantizer(CASES[name](), MXFP8Quantizer())


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("keep", [ROWWISE, COLUMNWISE])
def test_update_quantized_writes_the_usage_and_drops_the_rest(keep, name, kind):
    q = CASES[name]() if kind == "plain" else _hybrid(name)
    x0, x1 = make_input((33, 64), seed=40), make_input((33, 64), seed=41)
    dst = q(x0)
    kept_ptrs = [t.data_ptr() for t in dst.qstorage.part(keep).payload(keep).values()]
    q.set_usage(rowwise=keep == ROWWISE, columnwise=keep == COLUMNWISE)
    fresh = q.copy()
    assert q.update_quantized(x1, dst) is dst
    assert dst.directions() == (keep,), "a copy outside the usage would hold the old value"
    assert [t.data_ptr() for t in dst.qstorage.part(keep).payload(keep).values()] == kept_ptrs
    assert_same_quantized(dst, fresh(x1))


def test_update_quantized_cannot_add_a_copy_in_place():
    q = MXFP8Quantizer(columnwise=False)
    dst = q(make_input((32, 64)))
    q.set_usage(columnwise=True)
    with pytest.raises(MissingDirectionError, match="columnwise"):
        q.update_quantized(make_input((32, 64), seed=1), dst)
    assert dst.directions() == (ROWWISE,)


def test_copy_into_a_quantized_tensor_keeps_its_copies():
    """``dst.copy_(src)`` (torch semantics: dst takes src's value) refreshes every copy dst
    holds, whatever its quantizer's usage is now."""
    q = MXFP8Quantizer()
    x0, x1 = make_input((32, 64), seed=42), make_input((32, 64), seed=43)
    dst = q(x0)
    q.set_usage(columnwise=False)  # e.g. a module quantized something forward-only since
    dst.copy_(x1)
    assert dst.directions() == (ROWWISE, COLUMNWISE)
    assert_same_quantized(dst, MXFP8Quantizer()(x1))


@pytest.mark.parametrize("keep", [ROWWISE, COLUMNWISE])
def test_update_quantized_stochastic_rounding_seeded_like_quantize(keep):
    q = NVFP4Quantizer(stochastic_rounding=True, with_rht=True)
    x0, x1 = make_input((32, 64), seed=44), make_input((32, 64), seed=45)
    dst = q(x0)
    q.set_usage(rowwise=keep == ROWWISE, columnwise=keep == COLUMNWISE)
    fresh = q.copy()
    seed_all(q, 7)
    q.update_quantized(x1, dst)
    seed_all(fresh, 7)
    assert_same_quantized(dst, fresh(x1))
