"""``save_original_input`` (numerics §3 requantization safety).

With a requantization-safe input quantizer the module keeps the high-precision input for
wgrad and quantizes its columnwise copy in backward: the same numbers as saving the quantized
copy, since that copy is made from the same source either way (a rowwise_dequantized hybrid
of safe children included: it re-makes the same copies). A quantizer that cannot recreate its
output (stochastic rounding) vetoes the hint: the quantized forward value is saved, and
results are unchanged; delayed scaling refuses the option (test_module_inputs.py).

What autograd saved is observed with ``torch.autograd.graph.saved_tensors_hooks``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import (FORMATS, assert_bitwise, assert_grads_bitwise, call, make_data, make_module,
                      run_step)

from hybridfp import (CustomRecipe, HybridQuantizer, IdentityQuantizer,
                      MXFP8Quantizer, NVFP4Quantizer, QuantizerRole, Recipe, autocast)
from hybridfp.factories import mxfp8_fwd_high_precision_bwd
from hybridfp.gemm import gemm
from hybridfp.tensors import QuantizedTensor

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected


def nvfp4_sr_input(role: QuantizerRole):
    """Unsafe input quantizer: NVFP4 with stochastic rounding (MXFP8 elsewhere)."""
    if role.tensor_type == "input":
        return NVFP4Quantizer(stochastic_rounding=True)
    return MXFP8Quantizer()


def mxfp8_then_mxfp8_from_rowwise(role: QuantizerRole):
    """Safe input: a real-format columnwise copy quantized from the rowwise-dequantized value."""
    if role.tensor_type == "input":
        return HybridQuantizer(MXFP8Quantizer(), MXFP8Quantizer(), "rowwise_dequantized")
    return MXFP8Quantizer()


SAFE = {
    "mxfp8": lambda: FORMATS["mxfp8"](),
    "fp8_current": lambda: FORMATS["fp8_current"](),
    "fp8_block": lambda: FORMATS["fp8_block"](),
    "nvfp4_rht_input": lambda: FORMATS["nvfp4"](),  # input: RHT, no SR -> deterministic
    "mxfp8_hybrid_identity_col": lambda: CustomRecipe(
        lambda r: HybridQuantizer(MXFP8Quantizer(), IdentityQuantizer())),
    "rowwise_dequantized_identity": lambda: CustomRecipe(mxfp8_fwd_high_precision_bwd),
    "rowwise_dequantized_mxfp8": lambda: CustomRecipe(mxfp8_then_mxfp8_from_rowwise),
}
UNSAFE = {
    "nvfp4_sr_input": lambda: CustomRecipe(nvfp4_sr_input),
}


def _saved_during_forward(module, x: torch.Tensor, recipe: Recipe) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(recipe=recipe):
            call(module, x)
    return saved


def _high_precision_input_saved(module, x: torch.Tensor, saved: list[torch.Tensor]) -> bool:
    """Whether the GEMM's high-precision input was saved: x itself (or a row-slice of it, for
    experts) for Linear / GroupedLinear, the norm's output for LayerNormLinear (the norm's own
    autograd saves x, not its output)."""
    if hasattr(module, "norm"):
        with torch.no_grad():
            h = module.norm(x)
        return any(t.dtype == h.dtype and t.shape == h.shape and torch.equal(t, h) for t in saved)
    base = x.untyped_storage().data_ptr()
    return any(t.dtype == x.dtype and t.untyped_storage().data_ptr() == base for t in saved)


@pytest.mark.parametrize("kind", ["linear", "layernorm", "grouped"])
@pytest.mark.parametrize("recipe", list(SAFE))
def test_safe_quantizer_saves_original_and_matches(recipe, kind):
    base = make_module(kind)
    keep = make_module(kind, save_original_input=True)  # same seed: same parameters
    x, dy = make_data(seed=5)
    xs = x.clone().requires_grad_()
    saved_keep = _saved_during_forward(copy.deepcopy(keep), xs, SAFE[recipe]())
    saved_base = _saved_during_forward(copy.deepcopy(base), xs, SAFE[recipe]())
    assert _high_precision_input_saved(keep, xs, saved_keep)
    # (The norm saves x for its own backward either way; an Identity columnwise copy is x.)
    if kind != "layernorm" and "identity" not in recipe:
        assert not _high_precision_input_saved(base, xs, saved_base)
    # Fewer bytes saved for the input's columnwise copy is not the point (x may be kept
    # anyway); the numbers are: identical to saving the quantized copy.
    want = run_step(base, x, dy, SAFE[recipe](), seed=3)
    got = run_step(keep, x, dy, SAFE[recipe](), seed=3)
    assert_bitwise(got.y, want.y, "output")
    assert_bitwise(got.dx, want.dx, "dx")
    assert_grads_bitwise(got.grads, want.grads, f"{recipe} {kind}")


@pytest.mark.filterwarnings("ignore::hybridfp.nn.SaveOriginalInputIgnoredWarning")
@pytest.mark.parametrize("kind", ["linear", "layernorm", "grouped"])
@pytest.mark.parametrize("recipe", list(UNSAFE))
def test_unsafe_quantizer_vetoes_and_matches(recipe, kind):
    base = make_module(kind)
    keep = make_module(kind, save_original_input=True)  # same seed: same parameters
    x, dy = make_data(seed=5)
    xs = x.clone().requires_grad_()
    inspected = copy.deepcopy(keep)  # its own quantizers: delayed state must not leak
    saved = _saved_during_forward(inspected, xs, UNSAFE[recipe]())
    assert not _high_precision_input_saved(inspected, xs, saved), "the veto must save the quantized input"
    assert not inspected._quantizers["input"][0].is_requantization_safe()
    # Results: the same as never asking (same seeds for stochastic rounding).
    want = run_step(base, x, dy, UNSAFE[recipe](), seed=3)
    got = run_step(keep, x, dy, UNSAFE[recipe](), seed=3)
    assert_bitwise(got.y, want.y, "output")
    assert_bitwise(got.dx, want.dx, "dx")
    assert_grads_bitwise(got.grads, want.grads, f"{recipe} {kind}")


@pytest.mark.filterwarnings("ignore::hybridfp.nn.SaveOriginalInputIgnoredWarning")
@pytest.mark.parametrize("safe", [True, False])
def test_when_the_input_is_quantized(safe):
    """Safe: forward makes only the rowwise copy, backward the columnwise one from the kept
    input. Vetoed (SR): forward makes both, backward re-uses the forward's copy, so dW is the
    GEMM of dy with exactly that copy (a re-quantization would draw new random numbers)."""
    m = make_module("linear", save_original_input=True, bias=False)
    x, dy = make_data(seed=6)
    fwd_input = NVFP4Quantizer(stochastic_rounding=not safe)
    made: list[QuantizedTensor] = []

    def factory(role: QuantizerRole):
        if role.tensor_type != "input":
            return IdentityQuantizer()
        inner = fwd_input.quantize

        def quantize(t: torch.Tensor) -> QuantizedTensor:
            made.append(inner(t))
            return made[-1]

        fwd_input.quantize = quantize  # type: ignore[method-assign]
        return fwd_input

    xs = x.clone().requires_grad_()
    with autocast(recipe=CustomRecipe(factory)):
        y = m(xs)
    # Vetoed: both copies were made; fprop then dropped the rowwise one (only wgrad needs x).
    assert [t.directions() for t in made] == ([("rowwise",)] if safe else [("columnwise",)])
    y.backward(dy)
    if safe:
        assert [t.directions() for t in made] == [("rowwise",), ("columnwise",)]
    else:
        assert len(made) == 1, "a vetoed input must not be quantized again in backward"
        want = gemm(dy, made[0], "NT", out_dtype=torch.float32)
        assert_bitwise(m.weight.grad, want, "dW from the forward's columnwise copy")
