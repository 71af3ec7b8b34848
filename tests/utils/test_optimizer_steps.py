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


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_step_whose_closure_makes_the_gradients_is_seen(impl):
    """``step(closure)`` after ``zero_grad``: no gradient when the step begins, one at its end."""
    torch.manual_seed(0)
    m, x = hf.Linear(64, 64, bias=False), torch.randn(16, 64)
    opt = _optimizer(m.parameters(), impl, zero_grad_hook=False)

    def closure():
        with hf.autocast(recipe=RECIPE):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        return loss
    for _ in range(2):  # the second step runs with the hooks registered before it began
        with hf.weight_caching():
            opt.zero_grad()
            opt.step(closure)
            with torch.no_grad(), hf.autocast(recipe=RECIPE):
                after = m(x)
        with torch.no_grad(), hf.autocast(recipe=RECIPE):
            assert torch.equal(after, m(x))


def test_steps_inside_backward_over_views_of_one_buffer_still_train():
    """Per-parameter fused steps run from post-accumulate-grad hooks (optimizer in backward) over
    parameters viewing one flat buffer, which share one version counter: the cache's step
    notes must not move autograd's counters, or autograd would refuse the backward."""
    with hf.autocast(recipe=RECIPE):
        hf.Linear(64, 64)(torch.randn(4, 64))  # a cache entry exists in the process
    flat = torch.randn(2, 64, 64) * 0.1
    w1, w2 = torch.nn.Parameter(flat[0]), torch.nn.Parameter(flat[1])
    opts = {w: torch.optim.Adam([w], lr=1e-3, fused=True) for w in (w1, w2)}

    def step(p):
        opts[p].step()
        opts[p].zero_grad()
    for w in (w1, w2):
        w.register_post_accumulate_grad_hook(step)
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(3):
        (torch.tanh(x @ w1.t()) @ w2.t()).pow(2).mean().backward()


def _ignore(params):
    pass


def test_a_raising_step_leaves_nothing_alive():
    import gc
    import weakref

    on_stepped_parameters(_ignore)  # the hooks installed, whichever tests ran before
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.SGD([p], lr=0.1)

    def closure():
        raise ValueError("in the closure")
    with pytest.raises(ValueError):
        opt.step(closure)
    ref = weakref.ref(p)
    del opt, p, closure
    gc.collect()
    assert ref() is None
