"""State kept across calls stays made of normal tensors when a call runs under
``torch.inference_mode()``: delayed scaling's amax history and scale (built, updated, restored or
copied there) and the process-wide ``device_constant`` tables. An inference tensor there would
break the next training forward ("Inplace update to inference tensor outside InferenceMode" /
"Inference tensors cannot be saved for backward")."""

from __future__ import annotations

import pytest
import torch

import hybridfp as hf
from hybridfp.utils import device as device_utils

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

MODULES = {
    "Linear": (lambda: hf.Linear(32, 16), lambda m, x: m(x)),
    "LayerNormMLP": (lambda: hf.LayerNormMLP(32, 16), lambda m, x: m(x)),
    "GroupedLinear": (lambda: hf.GroupedLinear(3, 32, 16), lambda m, x: m(x, [4, 0, 6])),
}


def _x(seed):
    return torch.randn(10, 32, generator=torch.Generator().manual_seed(seed))


def _states(module):
    qs = {id(q): q for slot in module._quantizers.values() for q in slot}.values()
    return [v for q in qs for v in q.get_state().values()]


def _live_state_tensors(module):
    qs = {id(q): q for slot in module._quantizers.values() for q in slot}.values()
    return [t for q in qs for t in (q.amax_history, q.scale) if isinstance(q, hf.Float8Quantizer)]


def _train(module, call, recipe, seed):
    x = _x(seed).requires_grad_()
    with hf.autocast(recipe=recipe):
        y = call(module, x)
    y.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return [y.detach()] + grads


def _evaluate(module, call, recipe, seed, ctx):
    with ctx(), hf.autocast(recipe=recipe):
        return [call(module, _x(seed)).clone()]


def _sequence(name, ctx, eval_first=False):
    make, call = MODULES[name]
    torch.manual_seed(0)
    module, recipe = make(), hf.DelayedScaling(amax_history_len=4)
    out = [] if eval_first else _train(module, call, recipe, 1)
    out += _evaluate(module, call, recipe, 2, ctx)
    out += _train(module, call, recipe, 3) + _train(module, call, recipe, 4)
    return module, out + _states(module)


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if torch.is_tensor(u):
            assert u.dtype == v.dtype and torch.equal(u, v)
        else:
            assert u == v


@pytest.mark.parametrize("eval_first", [False, True], ids=["train-eval-train", "eval-first"])
@pytest.mark.parametrize("name", list(MODULES))
def test_delayed_scaling_inference_mode_evaluation_then_training(name, eval_first):
    """An evaluation under inference_mode (between training steps, or before the first one)
    leaves training working and bitwise as with the same evaluation under no_grad (its region's
    end updates the scales alike); the live state stays normal tensors."""
    module, got = _sequence(name, torch.inference_mode, eval_first)
    _, want = _sequence(name, torch.no_grad, eval_first)
    _assert_bitwise(got, want)
    live = _live_state_tensors(module)
    assert live and not any(t.is_inference() for t in live)


def test_float8_quantizer_state_made_under_inference_mode_is_normal():
    """Built, updated, restored and copied under inference_mode: every later in-place amax
    record outside it works, with the values of the same calls outside inference_mode."""
    def run(ctx):
        with ctx():
            q = hf.Float8Quantizer(amax_history_len=4)
            q(torch.full((4, 4), 2.0))
            q.update_scale()
            r = hf.Float8Quantizer(amax_history_len=4)
            r.set_state(q.get_state())
            c = q.copy()
        for k in (q, r, c):
            k(torch.full((4, 4), 3.0))
            k.update_scale()
            k.discard_step()
        return q, r, c

    got, want = run(torch.inference_mode), run(torch.no_grad)
    for g, w in zip(got, want):
        assert not g.scale.is_inference() and not g.amax_history.is_inference()
        _assert_bitwise(list(g.get_state().values()), list(w.get_state().values()))


def test_device_constant_made_under_inference_mode_is_normal():
    device_utils._constant.cache_clear()
    try:
        with torch.inference_mode():
            c = device_utils.device_constant([1.0, 2.0], "cpu")
            assert not c.is_inference()
            assert torch.equal(c * 2, torch.tensor([2.0, 4.0]))  # readable inside inference_mode
        assert device_utils.device_constant([1.0, 2.0], "cpu") is c  # cached, shared outside
    finally:
        device_utils._constant.cache_clear()


def test_grouped_fp8_current_trains_after_an_inference_mode_forward():
    """A GroupedLinear FP8 current-scaling forward under inference_mode in a fresh process state
    (the constants cache empty) leaves later training forwards of any module working."""
    device_utils._constant.cache_clear()
    try:
        recipe = hf.Float8CurrentScaling()
        with torch.inference_mode(), hf.autocast(recipe=recipe):
            hf.GroupedLinear(2, 32, 16)(_x(0)[:6], [3, 3])
        cases = ((hf.GroupedLinear(2, 32, 16), [5, 5]), (hf.GroupedLinear(3, 32, 16), [4, 0, 6]))
        for module, splits in cases:
            x = _x(1).requires_grad_()
            with hf.autocast(recipe=recipe):
                y = module(x, splits)
            y.sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
    finally:
        device_utils._constant.cache_clear()
