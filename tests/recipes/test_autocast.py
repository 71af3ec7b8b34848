"""``autocast``: enabled / disabled / nested regions, the default recipe, and the end-of-region
step of stateful quantizers (delayed scaling, numerics §2.2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridfp as hf
from hybridfp import CustomRecipe, factories
from hybridfp.recipes import current_autocast, default_recipe

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 32, generator=g), torch.randn(6, 16, generator=g)


def _run(module, x, dy):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    out = (y.detach(), x.grad, module.weight.grad.clone(), module.bias.grad.clone())
    module.zero_grad()
    return out


def _plain(module, x, dy):
    x = x.clone().requires_grad_()
    w, b = module.weight.detach().clone().requires_grad_(), module.bias.detach().clone().requires_grad_()
    y = F.linear(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


# ------------------------------------------------------------------ enabled=False, nesting
def test_disabled_region_is_plain_high_precision_bitwise():
    lin, (x, dy) = hf.Linear(32, 16), _inputs()
    with hf.autocast(enabled=False, recipe=hf.MXFP8BlockScaling()) as state:
        assert state is None and current_autocast() is None
        got = _run(lin, x, dy)
    for a, b in zip(got, _plain(lin, x, dy)):
        assert torch.equal(a, b)
    assert lin._quantizers == {}  # nothing was built


def test_disabled_inside_enabled_runs_high_precision():
    lin, (x, dy) = hf.Linear(32, 16), _inputs()
    with hf.autocast(recipe=hf.MXFP8BlockScaling()) as outer:
        quantized = lin(x)
        with hf.autocast(enabled=False):
            assert current_autocast() is None
            got = _run(lin, x, dy)
        assert current_autocast() is outer
    for a, b in zip(got, _plain(lin, x, dy)):
        assert torch.equal(a, b)
    assert not torch.equal(quantized.detach(), got[0])  # MXFP8 does change the numbers


def test_outside_any_region_is_high_precision():
    lin, (x, dy) = hf.Linear(32, 16), _inputs()
    assert current_autocast() is None
    for a, b in zip(_run(lin, x, dy), _plain(lin, x, dy)):
        assert torch.equal(a, b)


def test_nested_regions_use_the_innermost_recipe():
    lin, (x, dy) = hf.Linear(32, 16), _inputs()
    fresh = {}
    for name, recipe in (("mx", hf.MXFP8BlockScaling()), ("fp8", hf.Float8CurrentScaling())):
        m = hf.Linear(32, 16)
        m.load_state_dict(lin.state_dict())
        with hf.autocast(recipe=recipe):
            fresh[name] = m(x).detach()
    with hf.autocast(recipe=hf.MXFP8BlockScaling()) as outer:
        a = lin(x).detach()
        with hf.autocast(recipe=hf.Float8CurrentScaling()) as inner:
            assert current_autocast() is inner and inner is not outer
            b = lin(x).detach()
            assert type(lin._quantizers["input"][0]).__name__ == "Float8CurrentScalingQuantizer"
        assert current_autocast() is outer
        c = lin(x).detach()
        assert type(lin._quantizers["input"][0]).__name__ == "MXFP8Quantizer"
    assert current_autocast() is None
    assert torch.equal(a, fresh["mx"]) and torch.equal(c, fresh["mx"]) and torch.equal(b, fresh["fp8"])


def test_default_recipe_is_fp8_current_scaling():
    assert default_recipe() == hf.Float8CurrentScaling()
    lin, (x, _) = hf.Linear(32, 16), _inputs()
    with hf.autocast() as state:
        assert state.recipe == hf.Float8CurrentScaling()
        y = lin(x)
    twin = hf.Linear(32, 16)
    twin.load_state_dict(lin.state_dict())
    with hf.autocast(recipe=CustomRecipe(factories.current_scaling)):
        assert torch.equal(y, twin(x))


def test_recipe_must_be_a_recipe():
    with pytest.raises(TypeError, match="CustomRecipe"):
        with hf.autocast(recipe=factories.mxfp8):  # a factory, not a recipe
            pass
    assert current_autocast() is None


def test_stack_is_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            with hf.autocast(enabled=False):
                raise RuntimeError("boom")
    assert current_autocast() is None


# ------------------------------------------------------------------ delayed scaling steps
def test_delayed_scaling_updates_at_region_end_and_grads_one_region_later():
    """Forward quantizers update when their region ends; the grad_output quantizer, used in a
    backward that runs after the region, updates at the next region's end. Every update sets
    scale = fp8_max / max(amax history) (history of 3: the last 3 recorded steps)."""
    torch.manual_seed(0)
    lin = hf.Linear(32, 16)
    recipe = hf.DelayedScaling(amax_history_len=3)
    amps = [1.0, 8.0, 2.0, 0.5, 0.25]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 32, generator=g) * a for a in amps]
    dys = [torch.randn(6, 16, generator=g) * a * 3 for a in amps]
    x_amax = [x.abs().max().item() for x in xs]
    dy_amax = [d.abs().max().item() for d in dys]
    w_amax = lin.weight.detach().abs().max().item()
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    for k in range(len(amps)):
        with hf.autocast(recipe=recipe):
            y = lin(xs[k].requires_grad_())
            qs = lin._quantizers
            if k > 0:  # this step quantizes with the previous update's scale
                xq = hf.Float8Quantizer(torch.float8_e4m3fn)
                xq.scale = qs["input"][0].scale.clone()
                wq = hf.Float8Quantizer(torch.float8_e4m3fn)
                wq.scale = qs["weight"][0].scale.clone()
                want = hf.gemm.gemm(xq(xs[k].detach()), wq(lin.weight.detach()), "TN",
                                    out_dtype=torch.float32, bias=lin.bias.detach())
                assert torch.equal(y.detach(), want)
        qin, qw, qg = qs["input"][0], qs["weight"][0], qs["grad_output"][0]
        window = x_amax[max(0, k - 2):k + 1]
        assert torch.equal(qin.scale, f32(E4M3_MAX) / f32(max(window)))
        assert torch.equal(qw.scale, f32(E4M3_MAX) / f32(w_amax))
        # grad_output: updated from backwards 0..k-1 (the backward of step k runs below).
        if k == 0:
            assert qg.scale.item() == 1.0
        else:
            gwin = dy_amax[max(0, k - 3):k]
            assert torch.equal(qg.scale, f32(E5M2_MAX) / f32(max(gwin)))
        y.backward(dys[k])
        assert qg.amax_history[0].item() == torch.tensor(dy_amax[k], dtype=torch.float32).item()
        lin.zero_grad()


def test_delayed_scaling_margin_and_most_recent():
    torch.manual_seed(0)
    lin = hf.Linear(32, 16)
    recipe = hf.DelayedScaling(margin=2, amax_compute_algo="most_recent")
    amaxes = []
    for a in (4.0, 1.0):
        x = torch.randn(6, 32) * a
        amaxes.append(x.abs().max())
        with hf.autocast(recipe=recipe):
            lin(x)
    want = (torch.tensor(E4M3_MAX) / amaxes[-1].float()) / 4.0
    assert torch.equal(lin._quantizers["input"][0].scale, want)


def test_only_modules_that_ran_in_a_region_finish_there():
    a, b = hf.Linear(32, 16), hf.Linear(32, 16)
    x = torch.randn(4, 32)
    recipe = hf.DelayedScaling()
    with hf.autocast(recipe=recipe):
        a(x)
        b(x)
    before = b._quantizers["input"][0].scale.clone()
    with hf.autocast(recipe=recipe):
        a(x * 10)
        with hf.autocast(recipe=recipe) as inner:
            b(x * 100)
            assert inner.modules == [b]
        # b finished when the inner region ended; a has not finished yet
        assert not torch.equal(b._quantizers["input"][0].scale, before)
        assert a._quantizers["input"][0]._recorded
    assert not a._quantizers["input"][0]._recorded
