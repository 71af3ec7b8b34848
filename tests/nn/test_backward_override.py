"""``backward_override`` in the module path (Linear, LayerNormLinear): dgrad and wgrad run in
high precision on the operands the mode names, the forward is unchanged, and only what the
mode's backward reads is saved.

The references run the GEMM exactly as the module's backward does for plain FP32 operands
(``F.linear`` on the same tensors, same shapes and layouts: gemm's identity path), so the
comparisons are bitwise (tests/README.md: same operation, same shapes and layouts)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from nn_cases import IN, OUT, ROWS, assert_bitwise, make_data, make_module, run_step

import hybridfp as hf
from hybridfp.tensors import ROWWISE

RECIPES = {
    "fp8_current": hf.Float8CurrentScaling,
    "fp8_block": hf.Float8BlockScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
}
DENSE = ("linear", "layernorm", "rmsnorm")
MODES = ("high_precision", "dequantized")


def _gemm_input(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the module's GEMM reads: x, or the norm's output (differentiable in x)."""
    return x if isinstance(m, hf.Linear) else m.norm(x)


def _rowwise_dequantized(recipe: hf.Recipe, tensor_type: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """The forward's rowwise copy of ``t`` (a fresh quantizer of the same role: the recipes'
    forward quantizers are deterministic), dequantized."""
    q = recipe.quantizer(hf.QuantizerRole("linear", tensor_type, name))
    q.set_usage(rowwise=True, columnwise=False)
    return q.quantize(t.detach()).dequantize(direction=ROWWISE)


def _reference(m: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: hf.Recipe, mode: str):
    """dx, {param: grad} with the backward GEMMs on the mode's operands, by F.linear."""
    xx = x.detach().clone().requires_grad_()
    h = _gemm_input(m, xx)
    h2, dy2 = h.reshape(-1, h.shape[-1]), dy.reshape(-1, dy.shape[-1]).contiguous()
    w = m.weight.detach()
    if mode == "dequantized":
        x_op = _rowwise_dequantized(recipe, "input", m.name, h2)
        w_op = _rowwise_dequantized(recipe, "weight", m.name, w)
    else:
        x_op, w_op = h2.detach(), w
    dh = F.linear(dy2, w_op.t())           # dgrad: dy W (gemm "NN" on plain operands)
    dw = F.linear(dy2.t(), x_op.t())       # wgrad: dyᵀ x (gemm "NT" on plain operands)
    grads = {"weight": dw, "bias": dy2.float().sum(0)}
    norm_params = [p for n, p in m.named_parameters() if n.startswith("layer_norm")]
    if norm_params:
        got = torch.autograd.grad(h, [xx, *norm_params], dh.reshape(h.shape))
        dx = got[0]
        names = [n for n, _ in m.named_parameters() if n.startswith("layer_norm")]
        grads.update(dict(zip(names, got[1:])))
    else:
        dx = dh.reshape(x.shape)
    return dx, grads


@pytest.mark.parametrize("fmt", RECIPES)
@pytest.mark.parametrize("kind", DENSE)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(ROWS, IN), (2, 24, IN)], ids=["2d", "3d"])
def test_backward_gemms_on_the_modes_operands(mode, kind, fmt, shape):
    m = make_module(kind)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(*shape[:-1], OUT, generator=torch.Generator().manual_seed(4))
    recipe = RECIPES[fmt](backward_override=mode)
    got = run_step(m, x, dy, recipe)
    want_dx, want = _reference(m, x, dy, recipe, mode)
    where = f"{kind}/{fmt}/{mode}"
    assert_bitwise(got.dx, want_dx, f"{where} dx")
    assert sorted(got.grads) == sorted(want)
    for n in want:
        assert_bitwise(got.grads[n], want[n], f"{where} {n}.grad")
    # the forward is the quantized one, unchanged by the option
    base = run_step(copy.deepcopy(m), x, dy, RECIPES[fmt]())
    assert_bitwise(got.y, base.y, f"{where} output")
    assert not torch.equal(got.grads["weight"], base.grads["weight"])  # the option took effect


@pytest.mark.parametrize("fmt", RECIPES)
def test_modes_differ_from_each_other(fmt):
    """high_precision reads the original values, dequantized the forward's: different wgrads."""
    m = make_module("linear")
    x, dy = make_data()
    hp = run_step(m, x, dy, RECIPES[fmt](backward_override="high_precision"))
    dq = run_step(m, x, dy, RECIPES[fmt](backward_override="dequantized"))
    assert_bitwise(hp.y, dq.y, "output")
    assert not torch.equal(hp.grads["weight"], dq.grads["weight"])


@pytest.mark.parametrize("factory", ["mxfp8", "nvfp4_row_scaled_fwd_mxfp8_bwd"])
@pytest.mark.parametrize("mode", MODES)
def test_custom_recipe_override(factory, mode):
    """A CustomRecipe's factory, a hybrid input (row-scaled NVFP4 rowwise copy) included."""
    m = make_module("rmsnorm")
    x, dy = make_data()
    r = hf.CustomRecipe(getattr(hf.factories, factory), backward_override=mode)
    got = run_step(m, x, dy, r)
    want_dx, want = _reference(m, x, dy, r, mode)
    assert_bitwise(got.dx, want_dx, "dx")
    for n in want:
        assert_bitwise(got.grads[n], want[n], f"{n}.grad")


def _saved(m: torch.nn.Module, x: torch.Tensor, recipe: hf.Recipe) -> list[torch.Tensor]:
    """The tensors the forward saved for backward."""
    seen: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), hf.autocast(recipe=recipe):
        y = m(x)
    y.sum().backward()  # the saved tensors serve the backward
    return seen


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("fmt", ("fp8_current", "mxfp8"))
@pytest.mark.parametrize("x_grad", [True, False])
def test_high_precision_saves_the_original_input_and_weight_only(fmt, x_grad):
    m = make_module("linear")
    x = make_data()[0].requires_grad_(x_grad)
    saved = _saved(m, x, RECIPES[fmt](backward_override="high_precision"))
    want = [x, m.weight] if x_grad else [x]  # dgrad reads W only when x needs a gradient
    assert len(saved) == len(want), [(tuple(t.shape), t.dtype) for t in saved]
    for t, w in zip(saved, want):
        assert _shares(t, w) and t.dtype == torch.float32


@pytest.mark.parametrize("fmt", ("fp8_current", "mxfp8"))
def test_dequantized_saves_the_rowwise_copies_only(fmt):
    m = make_module("linear")
    x = make_data()[0].requires_grad_()
    saved = _saved(m, x, RECIPES[fmt](backward_override="dequantized"))
    assert not any(_shares(t, x) or _shares(t, m.weight) for t in saved), "no high-precision copy"
    shapes = {tuple(t.shape) for t in saved if t.dim() == 2 and t.shape[1] > 8}
    # payloads: x's rowwise [ROWS, IN] and W's rowwise [OUT, IN]; no columnwise [IN, ROWS] / [IN, OUT]
    assert (ROWS, IN) in shapes and (OUT, IN) in shapes, shapes
    assert (IN, ROWS) not in shapes and (IN, OUT) not in shapes, shapes
    assert all(t.dtype != torch.float32 for t in saved if tuple(t.shape) in ((ROWS, IN), (OUT, IN)))


def test_grouped_linear_honours_an_override():
    """GroupedLinear runs the override (per expert; its references: tests/moe)."""
    m = make_module("grouped")
    x, dy = make_data()
    got, base = [], []
    for recipe, out in ((hf.MXFP8BlockScaling(backward_override="dequantized"), got), (hf.MXFP8BlockScaling(), base)):
        m.zero_grad(set_to_none=True)
        with hf.autocast(recipe=recipe):
            y = m(x, [0, 19, ROWS - 19])
        y.backward(dy)
        out.extend([y.detach(), m.weight1.grad])
    assert_bitwise(got[0], base[0], "output")
    assert not torch.equal(got[1], base[1])


def test_a_user_recipe_with_an_unknown_override_is_refused_at_forward():
    class Mine(hf.Recipe):
        backward_override = "bf16"

        def quantizer(self, role):
            return hf.MXFP8Quantizer()
    m = make_module("linear")
    with pytest.raises(ValueError, match="backward_override='bf16'"):
        with hf.autocast(recipe=Mine()):
            m(make_data()[0])


def test_checkpoint_with_an_override_matches_the_plain_run():
    m = make_module("layernorm")
    x, dy = make_data()
    recipe = hf.MXFP8BlockScaling(backward_override="dequantized")
    want = run_step(m, x, dy, recipe)
    xx = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with hf.autocast(recipe=recipe):
        y = hf.checkpoint(m, xx)
    y.backward(dy)
    assert_bitwise(y.detach(), want.y, "output")
    assert_bitwise(xx.grad, want.dx, "dx")
    assert_bitwise(m.weight.grad, want.grads["weight"], "weight.grad")


def test_bf16_activations_high_precision_backward_has_their_dtypes():
    m = make_module("linear")
    x, dy = make_data(torch.bfloat16)
    got = run_step(m, x, dy, hf.Float8CurrentScaling(backward_override="high_precision"))
    assert got.dx.dtype == torch.bfloat16 and got.grads["weight"].dtype == torch.float32
    # FP32 accumulation of the exact products: within the bf16 rounding of the result
    ref = (dy.float() @ m.weight.detach()).to(torch.bfloat16)
    assert torch.allclose(got.dx.float(), ref.float(), rtol=2**-7, atol=1e-6)
