"""Double backward (a gradient of a gradient: ``create_graph=True``, then a backward through
that gradient, as a gradient penalty does) through hybridfp's quantized modules.

The quantized backward (output gradient quantized, quantized GEMMs) is not recorded by
autograd, so its results cannot be differentiated again. Without a mark they came back as
constants and a penalty on them silently contributed nothing to the parameters' gradients;
now differentiating through them raises an error naming the module
(``once_differentiable_quantized``). The first-order gradients of a ``create_graph=True``
pass are unchanged, and outside ``hybridfp.autocast`` (high precision, plain torch ops)
double backward works as torch's does.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.utils.checkpoint as tc

import hybridfp as hf
from hybridfp.moe import GroupedLinear

RECIPES = {"fp8_current": hf.Float8CurrentScaling, "mxfp8": hf.MXFP8BlockScaling}
D, F, ROWS = 64, 32, 64
MESSAGE = "double backward is not supported under a quantized recipe"


class _Grouped(torch.nn.Module):
    """A GroupedLinear over two experts of equal row counts (a module of x alone, as the others)."""

    def __init__(self, d: int, f: int, single_parameter: bool = False, **kw) -> None:
        super().__init__()
        self.experts = GroupedLinear(2, d, f, single_parameter=single_parameter, name="moe", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])


#: module -> a builder of (in features, out features, keyword arguments)
MODULES: dict[str, Callable[..., torch.nn.Module]] = {
    "Linear": lambda d, f, **kw: hf.Linear(d, f, name="lin", **kw),
    "LayerNormLinear": lambda d, f, **kw: hf.LayerNormLinear(d, f, name="lnl", **kw),
    "LayerNormMLP": lambda d, f, **kw: hf.LayerNormMLP(d, f, name="mlp", **kw),
    "GroupedLinear": _Grouped,
    "GroupedLinear_single": lambda d, f, **kw: _Grouped(d, f, single_parameter=True, **kw),
}
#: The name each module's error starts with (its class and name).
WHO = {"Linear": "Linear lin", "LayerNormLinear": "LayerNormLinear lnl", "LayerNormMLP": "LayerNormMLP mlp",
       "GroupedLinear": "GroupedLinear moe", "GroupedLinear_single": "GroupedLinear moe"}


def _setup(module: str, d: int = D, f: int = F, rows: int = ROWS, dtype: torch.dtype = torch.float32
           ) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MODULES[module](d, f, params_dtype=dtype), torch.randn(rows, d, dtype=dtype, requires_grad=True)


def _input_grad(m: torch.nn.Module, x: torch.Tensor, recipe: Callable | None,
                loss_of: Callable[[torch.Tensor], torch.Tensor] = lambda y: y.float().square().sum()
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, dloss/dx with create_graph=True), under ``recipe`` (None: outside autocast)."""
    with hf.autocast(enabled=recipe is not None, recipe=recipe() if recipe is not None else None):
        loss = loss_of(m(x))
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss, gx


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("module", sorted(MODULES))
def test_quantized_double_backward_raises(module: str, recipe: str) -> None:
    """A penalty on dL/dx raises naming the module, on its own or added to the loss (not a
    silently unchanged weight gradient)."""
    m, x = _setup(module)
    _, gx = _input_grad(m, x, RECIPES[recipe])
    assert gx.requires_grad  # the error node, not a constant the penalty would drop
    with pytest.raises(RuntimeError, match=f"{WHO[module]}: {MESSAGE}"):
        gx.square().sum().backward()
    loss, gx = _input_grad(m, x, RECIPES[recipe])
    with pytest.raises(RuntimeError, match=MESSAGE):
        (loss + 10.0 * gx.square().sum()).backward()


@pytest.mark.parametrize("module", ["Linear", "GroupedLinear"])
def test_loss_linear_in_output_still_raises(module: str) -> None:
    """With a loss linear in y (a critic's score, as WGAN-GP's) dy is a constant, but dx = dy W
    still depends on W: torch's once_differentiable would let the penalty drop silently."""
    m, x = _setup(module)
    _, gx = _input_grad(m, x, RECIPES["fp8_current"], loss_of=lambda y: y.float().sum())
    with pytest.raises(RuntimeError, match=MESSAGE):
        gx.square().sum().backward()


@pytest.mark.parametrize("module", ["Linear", "GroupedLinear"])
def test_constant_gradients_stay_constant(module: str) -> None:
    """Frozen weights and a loss linear in y: dx = dy W is a constant, as in high precision
    (no error node attached where there is no second-order term)."""
    got = []
    for recipe in (RECIPES["fp8_current"], None):
        m, x = _setup(module)
        m.requires_grad_(False)
        _, gx = _input_grad(m, x, recipe, loss_of=lambda y: y.float().sum())
        got.append(gx.requires_grad)
    assert got == [False, False]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("module", sorted(MODULES))
def test_create_graph_first_order_unchanged(module: str, recipe: str) -> None:
    """create_graph=True gives the first-order gradients of an ordinary backward, bitwise, and
    works as long as they are not differentiated again."""
    grads = []
    for create_graph in (False, True):
        m, x = _setup(module)
        with hf.autocast(recipe=RECIPES[recipe]()):
            loss = m(x).float().square().sum()
        loss.backward(create_graph=create_graph)
        grads.append([x.grad.detach()] + [p.grad.detach() for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_high_precision_double_backward(module: str) -> None:
    """Outside autocast the modules run plain torch ops: double backward is torch's (the
    penalty moves every weight gradient; the second derivatives pass gradgradcheck)."""
    weight_grads = []
    for penalty in (0.0, 10.0):
        m, x = _setup(module)
        loss, gx = _input_grad(m, x, None)
        (loss + penalty * gx.square().sum()).backward()
        weight_grads.append([p.grad.clone() for n, p in m.named_parameters() if "weight" in n and p.dim() > 1])
    for a, b in zip(*weight_grads):
        assert not torch.equal(a, b)

    m, x = _setup(module, d=4, f=3, rows=4, dtype=torch.float64)  # small: gradgradcheck is numerical
    names = [n for n, _ in m.named_parameters()]

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(m, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradgradcheck(f, (x, *m.parameters()))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute(use_reentrant: bool) -> None:
    """Under torch.utils.checkpoint (either kind) the ordinary backward is the unchecked one,
    bitwise; the non-reentrant kind (which allows torch.autograd.grad) raises on double
    backward as without checkpointing."""
    grads = []
    for ckpt in (False, True):
        m, x = _setup("LayerNormMLP")
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            y = tc.checkpoint(m, x, use_reentrant=use_reentrant) if ckpt else m(x)
        y.float().square().sum().backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    if not use_reentrant:
        m, x = _setup("LayerNormMLP")
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            loss = tc.checkpoint(m, x, use_reentrant=False).float().square().sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        with pytest.raises(RuntimeError, match=MESSAGE):
            gx.square().sum().backward()
