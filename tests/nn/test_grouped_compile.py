"""torch.compile of a model with a GroupedLinear: one graph break per layer call, results
bitwise the eager ones.

GroupedLinear's experts take their row counts on the host (the grouped GEMMs and the
per-expert quantization are launched per expert or with host offsets), so under compile the
layer runs eagerly between two graphs: one break a call, pinned here. The router and the
permutation around it compile. ``backend="aot_eager"`` runs the compiled graphs' ops as eager
does (the same arithmetic in the same order on the CPU), so bitwise equality is the claim.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybridfp as hf
from hybridfp import factories
from hybridfp.moe import GroupedLinear

RECIPES = {
    "current": hf.Float8CurrentScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid_nvfp4rs_mxfp8": lambda: hf.CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd),
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
}
EXPERTS, D, F = 3, 64, 32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Experts(torch.nn.Module):
    """A top-1 router, the tokens sorted by expert, the experts, and the tokens put back."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(D, EXPERTS)
        self.experts = GroupedLinear(EXPERTS, D, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = self.router(x).argmax(-1)
        order = expert.argsort(stable=True)
        counts = (expert[:, None] == torch.arange(EXPERTS)).sum(0)  # static shape, unlike bincount
        offsets = counts.cumsum(0).to(torch.int32)
        y = self.experts(x[order], offsets=offsets)
        return torch.empty_like(y).index_copy(0, order, y) * 2


def _step(model: torch.nn.Module, x: torch.Tensor, recipe_name: str) -> list[torch.Tensor]:
    torch.manual_seed(1)  # NVFP4's stochastic rounding seeds come from torch's generator
    x = x.clone().requires_grad_()
    with hf.autocast(recipe=RECIPES[recipe_name]()):
        y = model(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.experts.parameters()]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_moe_bitwise(recipe: str) -> None:
    torch.manual_seed(0)
    eager = _Experts()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = torch.randn(24, D)
    want = _step(eager, x, recipe)
    got = _step(compiled, x, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_one_break_per_call() -> None:
    """The break is the layer call (its reason names the disabled forward), once per call."""
    torch.manual_seed(0)
    m = _Experts()
    x = torch.randn(24, D, requires_grad=True)
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        explained = torch._dynamo.explain(m)(x)
    assert explained.graph_break_count == 1, [str(b.reason)[:200] for b in explained.break_reasons]


def test_offsets_equal_m_splits() -> None:
    torch.manual_seed(0)
    m = GroupedLinear(3, D, F)
    x = torch.randn(10, D)
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        a = m(x, [4, 0, 6])
        b = m(x, offsets=torch.tensor([4, 4, 10], dtype=torch.int32))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, error, match", [
    ({}, TypeError, "m_splits=None is not a sequence of ints"),
    ({"m_splits": [4, 0, 6], "offsets": torch.tensor([4, 4, 10])}, TypeError, "exactly one of m_splits"),
    ({"offsets": torch.tensor([4, 3, 10])}, ValueError, "decrease"),
    ({"offsets": torch.tensor([4.0, 4.0, 10.0])}, TypeError, "integer tensor"),
    ({"offsets": torch.tensor([4, 4, 9])}, ValueError, "offsets end at 9"),
    ({"offsets": [4, 4, 10]}, TypeError, "integer tensor"),
])
def test_offsets_errors(kwargs: dict, error: type, match: str) -> None:
    m = GroupedLinear(3, D, F)
    with pytest.raises(error, match=match):
        m(torch.randn(10, D), **kwargs)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_quantized_expert_weights_compile_bitwise(recipe: str) -> None:
    """Experts made under quantized_model_init (their weights QuantizedTensor parameters) run
    in the compiled model as in eager: same outputs and gradients, the weights' gradients plain."""
    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=RECIPES[recipe]()):
        eager = _Experts()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = torch.randn(24, D)
    want, got = _step(eager, x, recipe), _step(compiled, x, recipe)
    for w, g in zip(want, got):
        assert type(g) is torch.Tensor and torch.equal(w, g)
