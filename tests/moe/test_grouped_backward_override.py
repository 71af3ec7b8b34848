"""``backward_override`` for GroupedLinear, with Linear's meaning per expert: dgrad and wgrad
run unquantized on the mode's operands ("high_precision": the saved input rows and the
high-precision weight; "dequantized": the forward's rowwise copies, dequantized), dy
unquantized; the forward is unchanged and only what the mode reads is saved.

The reference runs each expert's GEMMs as Linear's backward does for plain FP32 operands
(``F.linear`` on the same tensors, same shapes and layouts: gemm's identity path), so the
comparisons are bitwise (tests/README.md: same operation, same shapes and layouts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridfp as hf
from hybridfp.quantizers import NVFP4Quantizer
from hybridfp.tensors import ROWWISE

E, IN, OUT, ROWS = 3, 64, 32, 48
SPLITS = [0, 19, ROWS - 19]  # an empty expert; sizes not multiples of 16 / 32
RECIPES = {
    "fp8_current": hf.Float8CurrentScaling,
    "fp8_block": hf.Float8BlockScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid": lambda **kw: hf.CustomRecipe(hf.factories.nvfp4_row_scaled_fwd_mxfp8_bwd, **kw),
}
MODES = ("high_precision", "dequantized")


@pytest.fixture(autouse=True, params=["auto", "always"], ids=["decoded_auto", "decoded_always"])
def decoded_copies_mode(request):
    """Also on copies held as their BF16 decodes (the policy's ``decoded_copies``)."""
    with hf.policy(decoded_copies=request.param):
        yield request.param


def make(quantized_with=None, **kw) -> hf.GroupedLinear:
    torch.manual_seed(0)
    with hf.quantized_model_init(enabled=quantized_with is not None, recipe=quantized_with):
        return hf.GroupedLinear(E, IN, OUT, name="experts", **kw)


def data(x_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, IN, generator=g).requires_grad_(x_grad), torch.randn(ROWS, OUT, generator=g)


def step(m: hf.GroupedLinear, x: torch.Tensor, dy: torch.Tensor, recipe: hf.Recipe):
    """(y, dx, {param name: grad}) of one forward / backward."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    m.zero_grad(set_to_none=True)
    with hf.autocast(recipe=recipe):
        y = m(x, SPLITS)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def _rowwise_dequantized(recipe: hf.Recipe, tensor_type: str, t: torch.Tensor) -> torch.Tensor:
    """The forward's rowwise copy of ``t`` (a fresh quantizer of the expert's role: the forward
    quantizers are deterministic, and the grouped quantization is bitwise each expert's own),
    dequantized."""
    if isinstance(t, hf.QuantizedTensor):  # a held weight: its own rowwise copy
        return t.dequantize(direction=ROWWISE)
    q = recipe.quantizer(hf.QuantizerRole("grouped_linear", tensor_type, "experts"))
    q.set_usage(rowwise=True, columnwise=False)
    return q.quantize(t.detach()).dequantize(direction=ROWWISE)


def reference(m: hf.GroupedLinear, x: torch.Tensor, dy: torch.Tensor, recipe: hf.Recipe, mode: str):
    """dx, {param name: grad} with every expert's backward GEMMs on the mode's operands."""
    dxs, grads = [], {}
    for e, (xe, dye) in enumerate(zip(torch.split(x.detach(), SPLITS), torch.split(dy, SPLITS))):
        w = m.weights()[e].detach()
        if mode == "dequantized":
            x_op, w_op = _rowwise_dequantized(recipe, "input", xe), _rowwise_dequantized(recipe, "weight", w)
        else:
            x_op, w_op = xe, w
        dye = dye.contiguous()
        dxs.append(F.linear(dye, w_op.t()))         # dgrad: dy W (gemm "NN" on plain operands)
        grads[f"weight{e}"] = F.linear(dye.t(), x_op.t())  # wgrad: dyᵀ x (gemm "NT")
        grads[f"bias{e}"] = dye.float().sum(0)
    return torch.cat(dxs), grads


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: max |diff| {(a.double() - b.double()).abs().max().item()}"


@pytest.mark.parametrize("fmt", RECIPES)
@pytest.mark.parametrize("mode", MODES)
def test_backward_gemms_on_the_modes_operands(mode, fmt):
    m = make()
    x, dy = data()
    recipe = RECIPES[fmt](backward_override=mode)
    y, dx, grads = step(m, x, dy, recipe)
    want_dx, want = reference(m, x, dy, recipe, mode)
    assert_bitwise(dx, want_dx, f"{fmt}/{mode} dx")
    assert sorted(grads) == sorted(want)
    for n in want:
        assert_bitwise(grads[n], want[n], f"{fmt}/{mode} {n}.grad")
    # the forward is the quantized one, unchanged by the option
    y0, _, grads0 = step(m, x, dy, RECIPES[fmt]())
    assert_bitwise(y, y0, f"{fmt}/{mode} output")
    assert not torch.equal(grads["weight1"], grads0["weight1"])  # the option took effect


@pytest.mark.parametrize("mode", MODES)
def test_single_parameter_gives_the_per_expert_layouts_gradients(mode):
    recipe = hf.MXFP8BlockScaling(backward_override=mode)
    x, dy = data()
    _, dx, grads = step(make(), x, dy, recipe)
    _, dx1, grads1 = step(make(single_parameter=True), x, dy, recipe)
    assert_bitwise(dx1, dx, "dx")
    assert_bitwise(grads1["weight"], torch.stack([grads[f"weight{e}"] for e in range(E)]), "weight.grad")
    assert_bitwise(grads1["bias"], torch.stack([grads[f"bias{e}"] for e in range(E)]), "bias.grad")


@pytest.mark.parametrize("fmt", ("fp8_current", "mxfp8", "nvfp4"))
def test_dequantized_reads_the_held_weights_rowwise_copies(fmt):
    """quantized_model_init: "dequantized" reads the held weight's rowwise copy."""
    recipe = RECIPES[fmt](backward_override="dequantized")
    m = make(quantized_with=RECIPES[fmt]())
    x, dy = data()
    _, dx, grads = step(m, x, dy, recipe)
    want_dx, want = reference(m, x, dy, recipe, "dequantized")
    assert_bitwise(dx, want_dx, "dx")
    for n in want:
        assert_bitwise(grads[n], want[n], f"{n}.grad")


def test_high_precision_with_held_weights_is_a_clear_error():
    m = make(quantized_with=hf.MXFP8BlockScaling())
    x, dy = data()
    with pytest.raises(ValueError, match="experts.*backward_override='high_precision'.*QuantizedTensor.*'dequantized'"):
        step(m, x, dy, hf.MXFP8BlockScaling(backward_override="high_precision"))
    # without dgrad the weight is not read in backward: allowed, as for Linear
    step(m, x.detach(), dy, hf.MXFP8BlockScaling(backward_override="high_precision"))


def test_stochastic_rounding_inputs_take_the_per_expert_path_with_the_override():
    """An input quantizer that draws random numbers quantizes expert by expert; the override
    still holds there (high_precision: the backward reads x and W themselves)."""
    def factory(role):
        return NVFP4Quantizer(stochastic_rounding=role.tensor_type != "weight")
    recipe = hf.CustomRecipe(factory, backward_override="high_precision")
    m = make()
    x, dy = data()
    _, dx, grads = step(m, x, dy, recipe)
    want_dx, want = reference(m, x, dy, recipe, "high_precision")
    assert_bitwise(dx, want_dx, "dx")
    for n in want:
        assert_bitwise(grads[n], want[n], f"{n}.grad")


def _saved(m: hf.GroupedLinear, x: torch.Tensor, recipe: hf.Recipe) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), hf.autocast(recipe=recipe):
        y = m(x, SPLITS)
    y.sum().backward()
    return seen


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("fmt", ("fp8_current", "mxfp8"))
@pytest.mark.parametrize("x_grad", [True, False])
def test_high_precision_saves_the_original_input_and_weights_only(fmt, x_grad):
    m = make()
    x = data(x_grad)[0]
    saved = _saved(m, x, RECIPES[fmt](backward_override="high_precision"))
    ws = m.weights()
    want = [x, *ws] if x_grad else [x]  # dgrad reads W only when x needs a gradient
    assert len(saved) == len(want), [(tuple(t.shape), t.dtype) for t in saved]
    for t, w in zip(saved, want):
        assert _shares(t, w) and t.dtype == torch.float32 and t.shape == w.shape


@pytest.mark.parametrize("fmt", ("fp8_current", "mxfp8"))
def test_dequantized_saves_the_rowwise_copies_only(fmt):
    m = make()
    x = data()[0]
    saved = _saved(m, x, RECIPES[fmt](backward_override="dequantized"))
    assert not any(_shares(t, x) or any(_shares(t, w) for w in m.weights()) for t in saved), "no high-precision copy"
    assert all(t.dtype != torch.float32 for t in saved if t.dim() == 2 and t.shape[-1] == IN), \
        [(tuple(t.shape), t.dtype) for t in saved]
    # no columnwise copy: nothing stored transposed ([IN, rows] / [IN, OUT] payloads)
    assert not any(t.dim() == 2 and t.shape[0] == IN for t in saved), [tuple(t.shape) for t in saved]


def test_delayed_scaling_refuses_an_override():
    with pytest.raises(ValueError, match="DelayedScaling: backward_override='dequantized' is not"):
        hf.DelayedScaling(backward_override="dequantized")
