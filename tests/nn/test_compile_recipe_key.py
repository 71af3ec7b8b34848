"""torch.compile: the recipe key a graph is traced for, and the memo of its saved copies' plans.

The key (``hybridfp.nn.ops.config_key``) is read twice: by Dynamo while tracing, before the
module builds its quantizers, and by the forward op when it runs, after the build called the
factory. It must be the same both times for a recipe that did not change, even when calling the
factory changes the factory, and differ (tracing again) for one that did. Compiled calls run
with ``backend="aot_eager"``, so results are bitwise the eager ones (see tests/nn/test_compile.py).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import hybridfp as hf
from hybridfp.analyze import PlanFactory
from hybridfp.nn import ops


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _LazyFactory:
    """Compares by its format name; makes a list of the quantizers it handed out on its first
    call (an attribute that is not there when the graph is traced)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _LazyFactory) and other.fmt == self.fmt

    def __hash__(self) -> int:
        return hash(self.fmt)

    def __call__(self, role):
        if not hasattr(self, "made"):
            self.made = []
        q = hf.MXFP8Quantizer() if self.fmt == "mxfp8" else hf.Float8CurrentScalingQuantizer()
        self.made.append(q)
        return q


class _CountingFactory(_LazyFactory):
    """As _LazyFactory, with a plain attribute set when made that each call changes."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self.calls = 0

    def __call__(self, role):
        self.calls += 1
        return super().__call__(role)


def _compiled_and_eager(seed: int):
    torch.manual_seed(seed)
    eager = hf.Linear(64, 32)
    twin = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    return eager, torch.compile(twin, fullgraph=True, backend=counter), twin, counter


@pytest.mark.parametrize("factory", [_LazyFactory, _CountingFactory])
def test_factory_changed_by_its_calls_runs_its_graph(factory) -> None:
    """A factory comparing by value that changes itself when called (its first call happens
    while the graph is traced) runs the graph traced for it, bitwise eager, with gradients."""
    eager, compiled, twin, counter = _compiled_and_eager(20)
    recipe = hf.CustomRecipe(factory("mxfp8"))
    for step in range(3):
        xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).requires_grad_() for _ in range(2)]
        with hf.autocast(recipe=recipe):
            ys = [compiled(xs[0]), eager(xs[1])]
        for y in ys:
            y.sum().backward()
        assert torch.equal(ys[0], ys[1]) and torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(twin.weight.grad, eager.weight.grad)
    assert counter.frame_count == 1


def test_other_factory_of_a_user_class_traces_again() -> None:
    """A factory of a class hybridfp does not know is keyed by identity: another one, equal or
    not, traces again (bitwise eager each time) and never runs a graph of the previous one."""
    eager, compiled, _, counter = _compiled_and_eager(21)
    x = torch.randn(8, 64)
    for factory in (_LazyFactory("mxfp8"), _LazyFactory("fp8"), _LazyFactory("mxfp8")):
        with torch.no_grad(), hf.autocast(recipe=hf.CustomRecipe(factory)):
            assert torch.equal(compiled(x), eager(x))
    assert counter.frame_count == 3


def test_equal_plan_factory_made_each_step_compiles_once() -> None:
    """PlanFactory is keyed by its plan and default: an equal one made each step passes the
    guards; one differing inside the plan, or in the default only, traces again."""
    eager = hf.Linear(64, 32, name="fc")
    twin = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, fullgraph=True, backend=counter)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(22))
    same = ({"fc": ("mxfp8",) * 3}, ("mxfp8",) * 3)
    other = ({"fc": ("mxfp8", "mxfp8", "nvfp4_1d")}, ("mxfp8",) * 3)
    for plan, default in [same] * 3 + [other, (other[0], ("mxfp8", "mxfp8", "nvfp4_1d"))]:
        with torch.no_grad(), hf.autocast(recipe=hf.CustomRecipe(PlanFactory(plan, default))):
            assert torch.equal(compiled(x), eager(x))
    assert counter.frame_count == 3


def test_plans_go_with_the_quantizers_they_were_made_for(monkeypatch) -> None:
    """Alternating two recipes rebuilds the quantizers each step: the plan memo keeps the
    plans of quantizer sets still alive only (here the current one and those of the last
    _RECENT call records), and holds none of the quantizers itself."""
    monkeypatch.setattr(ops, "_RECENT", 2)
    m = hf.Linear(64, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    recipes = (hf.Float8CurrentScaling(), hf.MXFP8BlockScaling())
    first = None
    for step in range(12):
        x = torch.randn(8, 64, requires_grad=True)
        with hf.autocast(recipe=recipes[step % 2]):
            y = compiled(x)
        y.sum().backward()
        if first is None:
            first = weakref.ref(m._quantizers["input"][0])
    gc.collect()
    assert first() is None
    assert len(ops._PLANS[m]) <= ops._RECENT + 1
