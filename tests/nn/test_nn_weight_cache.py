"""Quantized-weight cache and recipe switches (numerics §4).

The weight is quantized once per autocast region however many forwards run in it, and once
per step across the micro-batch regions of a step when they pass ``is_first_microbatch``
(True on the first, False on the others); it is quantized again in every new region otherwise,
when the weight changes (optimizer step: ``weight._version`` moves), when the quantizer's
state changes (delayed scaling's update at the region's end), and when the recipe changes.
A recipe or factory switched between steps takes effect at the next step.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from nn_cases import CountingFactory, assert_bitwise, call, make_data, make_module, run_step, splits_for

from hybridfp import (CustomRecipe, DelayedScaling, Float8CurrentScaling, GroupedLinear, HybridQuantizer,
                      IdentityQuantizer, MXFP8BlockScaling, MXFP8Quantizer, NVFP4BlockScaling,
                      NVFP4Quantizer, autocast)
from hybridfp.factories import current_scaling, mxfp8, nvfp4, per_gemm

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected
KINDS = ["linear", "layernorm", "grouped"]


def _micro_batch(m, recipe, x, dy, is_first_microbatch=None) -> None:
    with autocast(recipe=recipe):
        y = _call(m, x, is_first_microbatch)
    y.backward(dy)


def _call(m, x, is_first_microbatch=None):
    """``call`` with TransformerEngine's ``is_first_microbatch`` forward argument."""
    if isinstance(m, GroupedLinear):
        return m(x, splits_for(x.shape[0]), is_first_microbatch=is_first_microbatch)
    return m(x, is_first_microbatch=is_first_microbatch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("base", [mxfp8, current_scaling, nvfp4], ids=lambda f: f.__name__)
def test_weight_quantized_once_per_step(base, kind):
    counting = CountingFactory(base)
    recipe = CustomRecipe(counting)
    m = make_module(kind)
    experts = 3 if kind == "grouped" else 1
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, dy = make_data(seed=2)
    versions = [w._version for n, w in m.named_parameters() if n.startswith("weight")]
    # Two micro-batches of one step, one autocast region each (gradient accumulation): the
    # second reuses the first's weight when asked to.
    _micro_batch(m, recipe, x, dy, is_first_microbatch=True)
    _micro_batch(m, recipe, x * 0.5, dy, is_first_microbatch=False)
    assert counting.count("weight") == experts
    assert counting.count("input") == 2 * experts  # activations are quantized every time
    # One region with two forwards: still cached.
    with autocast(recipe=recipe):
        call(m, x).sum() + call(m, x).sum()
    assert counting.count("weight") == 2 * experts
    # Without is_first_microbatch a new region quantizes anew (a .data write is then seen).
    _micro_batch(m, recipe, x, dy)
    assert counting.count("weight") == 3 * experts
    opt.step()
    new_versions = [w._version for n, w in m.named_parameters() if n.startswith("weight")]
    assert all(a > b for a, b in zip(new_versions, versions))
    _micro_batch(m, recipe, x, dy)
    assert counting.count("weight") == 4 * experts, "an optimizer step must re-quantize the weight"
    # The cached weight is the updated one: same numbers as a module never cached.
    fresh = copy.deepcopy(m)
    fresh._wcache.clear()
    assert_bitwise(run_step(m, x, dy, recipe).y, run_step(fresh, x, dy, recipe).y, "cached weight")


def test_cached_weight_gains_a_columnwise_copy_when_needed():
    """A forward that needs no dgrad caches only the rowwise copy; a later one that does
    needs the columnwise copy too and re-quantizes (never a MissingDirectionError)."""
    counting = CountingFactory(mxfp8)
    recipe = CustomRecipe(counting)
    m = make_module("linear")
    x, dy = make_data(seed=2)
    with autocast(recipe=recipe):
        m(x)  # x needs no grad: no dgrad
    with autocast(recipe=recipe):
        y = m(x.clone().requires_grad_())
    y.backward(dy)
    assert counting.copies("weight") == [("rowwise",), ("rowwise", "columnwise")]


def test_recipe_switch_between_steps_takes_effect():
    m = make_module("linear")
    x, dy = make_data(seed=4)
    first = run_step(m, x, dy, MXFP8BlockScaling())
    assert isinstance(m._quantizers["weight"][0], MXFP8Quantizer)
    second = run_step(m, x, dy, NVFP4BlockScaling(), seed=9)
    assert all(isinstance(qs[0], NVFP4Quantizer) for qs in m._quantizers.values())
    assert m._quantizers["weight"][0].with_2d_quantization
    # The new format's numbers: equal to a module that only ever ran NVFP4.
    want = run_step(make_module("linear"), x, dy, NVFP4BlockScaling(), seed=9)
    assert_bitwise(second.y, want.y, "output after the switch")
    assert_bitwise(second.dx, want.dx, "dx after the switch")
    assert_bitwise(second.grads["weight"], want.grads["weight"], "dW after the switch")
    assert not torch.equal(first.y, second.y)
    # Edited recipe options count as a switch too.
    run_step(m, x, dy, NVFP4BlockScaling(disable_2d_quantization=True))
    assert not m._quantizers["weight"][0].with_2d_quantization


def test_weight_requantized_after_recipe_switch():
    first, second = CountingFactory(mxfp8), CountingFactory(current_scaling)
    recipes = [CustomRecipe(first), CustomRecipe(second)]
    m = make_module("grouped")
    x, dy = make_data(seed=4)
    last = None
    for r in [0, 0, 1, 1, 0]:
        # micro-batches of one step (no optimizer step): the first of each recipe keeps its weight
        if r != last:
            with autocast(recipe=recipes[r]), pytest.raises(RuntimeError, match="none is kept"):
                _call(m, x, is_first_microbatch=False)  # the switch dropped the kept copy
        _micro_batch(m, recipes[r], x, dy, is_first_microbatch=r != last)
        last = r
    # Each switch rebuilds the quantizers and drops the cache: one quantization per expert
    # at the first step after a switch, none at a repeated step.
    assert first.count("weight") == 2 * 3 and second.count("weight") == 3


def _closure_of(quantizer_cls):
    # Every closure made here has the same __qualname__; only the object tells them apart.
    return lambda role: quantizer_cls()


def test_factory_switch_between_steps_takes_effect():
    """A fresh CustomRecipe with a new factory each step rebuilds the quantizers, even when the
    previous factory was freed and a new closure took its address (a key built from id() and
    the name alone would then look unchanged)."""
    m = make_module("linear")
    x, dy = make_data(seed=4)
    schedule = [MXFP8Quantizer, NVFP4Quantizer, IdentityQuantizer] * 3
    for quantizer_cls in schedule:
        run_step(m, x, dy, CustomRecipe(_closure_of(quantizer_cls)))
        assert type(m._quantizers["input"][0]) is quantizer_cls
    for triple, want in [(("nvfp4",) * 3, NVFP4Quantizer), (("mxfp8", "mxfp8", "nvfp4"), HybridQuantizer),
                         (("mxfp8",) * 3, MXFP8Quantizer)]:
        run_step(m, x, dy, CustomRecipe(per_gemm(*triple)))
        assert type(m._quantizers["input"][0]) is want, triple


def test_same_recipe_configuration_keeps_quantizers():
    """A new but equal recipe object (a fresh DelayedScaling() each step) must not rebuild:
    delayed scaling's amax history lives in the quantizers."""
    m = make_module("linear")
    x, dy = make_data(seed=4)
    run_step(m, x, dy, DelayedScaling())
    q = m._quantizers["input"][0]
    run_step(m, x, dy, DelayedScaling())
    assert m._quantizers["input"][0] is q


def test_delayed_scaling_weight_requantized_after_scale_update():
    counting = CountingFactory(lambda role: DelayedScaling().quantizer(role))
    recipe = CustomRecipe(counting)
    m = make_module("linear")
    x, dy = make_data(seed=4)
    run_step(m, x, dy, recipe)  # step 1: scale 1, records amax(W); update at the region's end
    wq = m._quantizers["weight"][0]
    assert counting.count("weight") == 1
    assert wq.scale.item() == pytest.approx(448.0 / m.weight.abs().max().item(), rel=1e-6)
    run_step(m, x, dy, recipe)  # same weight, new scale: the cache must not serve step 1's
    assert counting.count("weight") == 2
    cached = m._wcache[0][1]
    scale_inv = cached.qstorage.payload("rowwise")["scale_inv"]
    assert scale_inv.item() == pytest.approx(1.0 / wq.scale.item(), rel=1e-6) and scale_inv.item() != 1.0


def test_delayed_scaling_micro_batches_in_one_region_share_the_weight():
    counting = CountingFactory(lambda role: DelayedScaling().quantizer(role))
    m = make_module("linear")
    x, dy = make_data(seed=4)
    with autocast(recipe=CustomRecipe(counting)):
        y = m(x.clone().requires_grad_()) + m(x.clone().requires_grad_())
    y.backward(dy)
    assert counting.count("weight") == 1


def test_no_grad_inference_quantizes_forward_copies_only():
    """Under torch.no_grad() nothing will run backward: no columnwise copies are made."""
    counting = CountingFactory(lambda r: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True)))
    m = make_module("linear")
    x, _ = make_data(seed=4)
    with torch.no_grad(), autocast(recipe=CustomRecipe(counting)):
        y = m(x.clone().requires_grad_())
    assert not y.requires_grad
    assert counting.copies("input") == [("rowwise",)]
    assert counting.copies("weight") == [("rowwise",)]
    # With grad enabled, the same module makes the backward copies.
    with autocast(recipe=CustomRecipe(counting)):
        m(x.clone().requires_grad_())
    assert counting.copies("input")[-1] == ("rowwise", "columnwise")
    assert counting.copies("weight")[-1] == ("rowwise", "columnwise")


def test_frozen_weight_skips_the_input_columnwise_copy():
    counting = CountingFactory(current_scaling)
    m = make_module("linear")
    m.weight.requires_grad_(False)
    x, dy = make_data(seed=4)
    got = run_step(m, x, dy, CustomRecipe(counting))
    assert counting.copies("input") == [("rowwise",)]
    assert "weight" not in got.grads and "bias" in got.grads
    full = make_module("linear")
    assert_bitwise(got.dx, run_step(full, x, dy, Float8CurrentScaling()).dx, "dx with a frozen weight")


def test_data_writes_need_invalidate_weight_cache():
    """Writes through ``.data`` bypass the version counter: invalidate_weight_cache() makes
    the next forward re-quantize the new values."""
    from hybridfp import Linear, MXFP8BlockScaling, autocast
    torch.manual_seed(0)
    lin = Linear(64, 32)
    x = torch.randn(8, 64)
    with autocast(recipe=MXFP8BlockScaling()):
        lin(x)
        new_w = torch.randn(32, 64)
        lin.weight.data.copy_(new_w)
        lin.invalidate_weight_cache()
        y = lin(x)
    with autocast(recipe=MXFP8BlockScaling()):
        fresh = Linear(64, 32)
        fresh.weight.data.copy_(new_w)
        fresh.bias.data.copy_(lin.bias.data)
        want = fresh(x)
    assert torch.equal(y, want)


def test_autocast_without_group_keeps_a_factorys_own_amax_group():
    from hybridfp import CustomRecipe, Float8CurrentScalingQuantizer, Linear, autocast
    sentinel = object()

    def factory(role):
        return Float8CurrentScalingQuantizer(with_amax_reduction=True, amax_reduction_group=sentinel)

    lin = Linear(16, 8)
    state_recipe = CustomRecipe(qfactory=factory)
    with autocast(recipe=state_recipe) as state:
        qs = lin.quantizers(state)
    assert all(q.amax_reduction_group is sentinel and q.with_amax_reduction
               for slot in qs.values() for q in slot)


def test_a_region_gets_its_own_quantizers_while_another_threads_region_rebuilds_them():
    """Autocast regions are per thread: a module run by two threads under two recipes must hand
    each call the quantizers of its own region, even when the other region rebuilds them between
    this call's recipe check and its read (here forced at that point, deterministically)."""
    import hybridfp
    from hybridfp.recipes.autocast import AutocastState
    m = hybridfp.Linear(64, 64)
    with hybridfp.autocast(recipe=hybridfp.MXFP8BlockScaling()):
        mine = hybridfp.recipes.current_autocast()
    with hybridfp.autocast(recipe=Float8CurrentScaling()):
        other = hybridfp.recipes.current_autocast()
    m.quantizers(mine)  # built for this region

    class Interleaved(AutocastState):
        def note_module(self, module):  # runs after the check, before the read
            module.quantizers(other)
            super().note_module(module)

    mine.__class__ = Interleaved
    got = m.quantizers(mine)
    assert isinstance(got["input"][0], MXFP8Quantizer)
    assert not isinstance(m._quantizers["input"][0], MXFP8Quantizer)  # the other region's rebuild


def _interleaving_recipe(interfere):
    """An MXFP8 recipe whose input quantizer runs ``interfere()`` (another thread's call) at
    its first quantize while armed: the interleaving forced at one point, deterministically."""
    import hybridfp

    class Interleaving(hybridfp.MXFP8Quantizer):
        def quantize(self, x):
            if interfere.armed and not interfere.fired:
                interfere.fired = True
                t = threading.Thread(target=interfere)
                t.start()
                t.join()
            return super().quantize(x)

    def factory(role):
        return Interleaving() if role is not None and role.tensor_type == "input" else hybridfp.MXFP8Quantizer()

    return CustomRecipe(qfactory=factory)


def _other_thread_call(m, recipe, x):
    def call():
        with torch.no_grad(), autocast(recipe=recipe):
            m(x)
    call.armed, call.fired = True, False
    return call


def test_a_weight_kept_under_one_recipe_is_not_reused_under_the_recipe_another_thread_built():
    """Another thread's region (another recipe) rebuilds the module's quantizers while this
    call quantizes its input: the weight this call keeps is labelled with its own build, so the
    other recipe's is_first_microbatch=False call refuses it instead of reading MXFP8 codes as
    its own."""
    import hybridfp
    torch.manual_seed(0)
    m = hybridfp.Linear(64, 64, bias=False)
    xa, xb = torch.randn(32, 64), torch.randn(32, 64)
    other = Float8CurrentScaling()
    interfere = _other_thread_call(m, other, xb)
    with torch.no_grad(), autocast(recipe=_interleaving_recipe(interfere)):
        m(xa, is_first_microbatch=True)
    assert interfere.fired and "MXFP8" in type(m._wcache[0].qw.qstorage).__name__
    with torch.no_grad(), autocast(recipe=other), pytest.raises(RuntimeError, match="is_first_microbatch=False"):
        m(xb, is_first_microbatch=False)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_checkpoint_replays_the_quantizers_its_forward_used_while_another_thread_rebuilds(use_reentrant):
    """Another thread's region rebuilds the module's quantizers during a checkpointed forward:
    the recomputation replays the forward's own quantizers, so the gradients are those of the
    run without checkpoint."""
    import hybridfp
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    m = hybridfp.Linear(64, 64, bias=False)
    x, xb = torch.randn(32, 64), torch.randn(32, 64)
    interfere = _other_thread_call(m, Float8CurrentScaling(), xb)
    recipe = _interleaving_recipe(interfere)

    def grads(use_ckpt):
        m.weight.grad = None
        xi = x.clone().requires_grad_()
        with autocast(recipe=recipe):
            y = checkpoint(m, xi, use_reentrant=use_reentrant) if use_ckpt else m(xi)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        return xi.grad, m.weight.grad.clone()

    interfere.armed = False
    want = grads(False)
    interfere.armed = True
    got = grads(True)
    assert interfere.fired
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
