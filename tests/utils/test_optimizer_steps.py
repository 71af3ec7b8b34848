"""Optimizer steps seen by the quantized-weight cache whatever the step's implementation: a
fused step (``fused=True``) moves no version counter, and an optimizer's own post-hook that
frees the gradients runs before the global one that reports the stepped parameters."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hf
from hybridfp.utils.optimizer_steps import on_stepped_parameters

RECIPE = hf.Float8CurrentScaling()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _optimizer(params, impl: str, zero_grad_hook: bool) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(params, lr=0.05, **{impl: True})
    if zero_grad_hook:  # frees the gradients right after the step, before the global post-hooks
        opt.register_step_post_hook(lambda o, args, kwargs: o.zero_grad(set_to_none=True))
    return opt


def _call(m, x, **kw):
    return m(x, [4] * 4, **kw) if isinstance(m, hf.GroupedLinear) else m(x, **kw)


BUILDS = {
    "linear": lambda: hf.Linear(64, 64, bias=False),
    "grouped": lambda: hf.GroupedLinear(4, 64, 64, bias=False),
    "grouped one Parameter": lambda: hf.GroupedLinear(4, 64, 64, bias=False, single_parameter=True),
}


@pytest.mark.parametrize("zero_grad_hook", [False, True], ids=["", "zero_grad post-hook"])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("build", list(BUILDS))
def test_a_weight_caching_scope_sees_every_kind_of_step(build, impl, zero_grad_hook):
    torch.manual_seed(0)
    m, x = BUILDS[build](), torch.randn(16, 64)
    opt = _optimizer(m.parameters(), impl, zero_grad_hook)
    with hf.weight_caching():
        with hf.autocast(recipe=RECIPE):
            before = _call(m, x)
        before.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad(), hf.autocast(recipe=RECIPE):
            after = _call(m, x)
    with torch.no_grad(), hf.autocast(recipe=RECIPE):
        fresh = _call(m, x)
    assert not torch.equal(after, before.detach())  # the step moved the weights
    assert torch.equal(after, fresh)


@pytest.mark.parametrize("zero_grad_hook", [False, True], ids=["", "zero_grad post-hook"])
def test_is_first_microbatch_false_after_a_fused_step_is_refused(zero_grad_hook):
    torch.manual_seed(0)
    lin, x = hf.Linear(64, 64, bias=False), torch.randn(16, 64)
    opt = _optimizer(lin.parameters(), "fused", zero_grad_hook)
    with hf.autocast(recipe=RECIPE):
        lin(x, is_first_microbatch=True).float().pow(2).mean().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="changed in place"), torch.no_grad(), hf.autocast(recipe=RECIPE):
        lin(x, is_first_microbatch=False)


def test_a_frozen_weight_keeps_its_cached_copy_across_a_step():
    """Only parameters with a gradient count as stepped: a frozen layer is not quantized again."""
    torch.manual_seed(0)
    frozen, trained, x = hf.Linear(64, 64, bias=False), hf.Linear(64, 64, bias=False), torch.randn(16, 64)
    frozen.weight.requires_grad_(False)
    opt = _optimizer([frozen.weight, trained.weight], "fused", zero_grad_hook=True)
    with hf.autocast(recipe=RECIPE):
        trained(frozen(x, is_first_microbatch=True)).float().sum().backward()
    version = frozen.weight._version
    opt.step()
    assert frozen.weight._version == version
    with torch.no_grad(), hf.autocast(recipe=RECIPE):
        frozen(x, is_first_microbatch=False)  # the kept copy is still valid


def test_listeners_get_the_parameters_that_had_a_gradient_when_the_step_began():
    seen = []

    def listener(params):
        seen.append([id(p) for p in params])
    on_stepped_parameters(listener)
    on_stepped_parameters(listener)  # registered once
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = _optimizer([a, b], "fused", zero_grad_hook=True)
    a.grad = torch.ones(3)
    opt.step()
    assert seen == [[id(a)]] and a.grad is None
    from hybridfp.utils import optimizer_steps
    optimizer_steps._LISTENERS.remove(listener)  # the process-wide list: leave it as it was
