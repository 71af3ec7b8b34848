"""The quantized-weight cache never serves a stale weight.

Writes through ``.data`` (custom optimizers' ``p.data.add_``, EMA swaps, FSDP2's copy of the
all-gathered weight) leave the parameter's version counter as it was, so a cache keyed on it
alone would keep serving the first quantization. Cached entries live for one autocast region
(``AutocastState.token``; a checkpoint replay shares its forward's), and reuse across regions
is explicit: ``is_first_microbatch`` (TransformerEngine's argument) — None quantizes in every
region, True quantizes and keeps the copy, False reuses the kept copy (an error if none is kept
or it no longer matches the recipe, the quantizer state or the weight).

Every comparison is between two runs of the same code on the same shapes (one module with the
cache, one fresh copy quantizing the same values): bitwise equality is the claim.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import CountingFactory, assert_bitwise, call, make_data, make_module, splits_for

import hybridfp as hfp
from hybridfp import (CustomRecipe, DelayedScaling, Float8CurrentScaling, GroupedLinear,
                      MXFP8BlockScaling, autocast)
from hybridfp.factories import current_scaling, mxfp8

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

RECIPES = {"fp8_current": Float8CurrentScaling, "mxfp8": MXFP8BlockScaling}
KINDS = ["linear", "layernorm", "grouped", "grouped_single"]


def _module(kind: str) -> torch.nn.Module:
    if kind == "grouped_single":
        return make_module("grouped", single_parameter=True)
    return make_module(kind)


def _fresh_output(m: torch.nn.Module, kind: str, x: torch.Tensor, recipe) -> torch.Tensor:
    """The output of a never-cached module holding m's current values."""
    fresh = _module(kind)
    values = dict(m.named_parameters())
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(values[n])
    with torch.no_grad(), autocast(recipe=recipe):
        return call(fresh, x)


def _data_sgd(m: torch.nn.Module, lr: float) -> None:
    """A custom optimizer that writes through ``.data`` (no version-counter bump)."""
    for p in m.parameters():
        if p.grad is not None:
            p.data.add_(p.grad, alpha=-lr)
            p.grad = None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_data_add_optimizer_is_seen_every_step(recipe_name, kind):
    recipe = RECIPES[recipe_name]()
    m = _module(kind)
    x, dy = make_data(seed=3)
    for step in range(4):
        with autocast(recipe=recipe):
            y = call(m, x)
        y.backward(dy)
        assert_bitwise(y.detach(), _fresh_output(m, kind, x, recipe), f"{kind} step {step} output")
        _data_sgd(m, lr=0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_ema_swap_through_data_between_steps(kind):
    """Evaluate with EMA weights swapped in through ``.data``, then swap the training weights
    back: each region sees the values it runs with."""
    recipe = MXFP8BlockScaling()
    m = _module(kind)
    x, _ = make_data(seed=5)
    ema = {n: (p.detach() * 0.5).clone() for n, p in m.named_parameters()}
    with torch.no_grad(), autocast(recipe=recipe):
        train_y = call(m, x)
    backup = {n: p.detach().clone() for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        p.data.copy_(ema[n])
    with torch.no_grad(), autocast(recipe=recipe):
        ema_y = call(m, x)
    assert_bitwise(ema_y, _fresh_output(m, kind, x, recipe), f"{kind} EMA output")
    for n, p in m.named_parameters():
        p.data.copy_(backup[n])
    with torch.no_grad(), autocast(recipe=recipe):
        back_y = call(m, x)
    assert_bitwise(back_y, train_y, f"{kind} output after swapping back")


# ---------------------------------------------------------------- is_first_microbatch

def _call(m: torch.nn.Module, x: torch.Tensor, **kw) -> torch.Tensor:
    if isinstance(m, GroupedLinear):
        return m(x, [0, 19, x.shape[0] - 19], **kw)
    return m(x, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_is_first_microbatch_keeps_and_reuses_across_regions(kind):
    counting = CountingFactory(current_scaling)
    recipe = CustomRecipe(counting)
    m = _module(kind)
    experts = 3 if kind.startswith("grouped") else 1
    x, dy = make_data(seed=2)
    with autocast(recipe=recipe):
        first = _call(m, x, is_first_microbatch=True)
    first.backward(dy)
    assert counting.count("weight") == experts
    # The user promises the GEMM weights are unchanged between micro-batches: a .data write
    # is not looked at, the kept copy is used as it is.
    weights = [p for n, p in m.named_parameters() if n.startswith("weight")]
    kept_values = [p.detach().clone() for p in weights]
    for p in weights:
        p.data.mul_(2)
    with autocast(recipe=recipe):
        second = _call(m, x, is_first_microbatch=False)
    second.backward(dy)
    assert counting.count("weight") == experts, "False must reuse the kept copy"
    for p, v in zip(weights, kept_values):
        p.data.copy_(v)
    assert_bitwise(second.detach(), first.detach(), f"{kind}: reused weight")
    # None: quantized again in a new region; True: quantized again and kept.
    with autocast(recipe=recipe):
        _call(m, x, is_first_microbatch=None)
    assert counting.count("weight") == 2 * experts
    with autocast(recipe=recipe):
        _call(m, x, is_first_microbatch=True)
        _call(m, x, is_first_microbatch=False)
        _call(m, x)
    assert counting.count("weight") == 3 * experts


@pytest.mark.parametrize("kind", KINDS)
def test_is_first_microbatch_false_without_a_kept_copy_raises(kind):
    m = _module(kind)
    x, _ = make_data(seed=2)
    with autocast(recipe=MXFP8BlockScaling()), pytest.raises(RuntimeError, match="is_first_microbatch=True"):
        _call(m, x, is_first_microbatch=False)
    # A copy made by a None call is not kept.
    with autocast(recipe=MXFP8BlockScaling()):
        _call(m, x)
    with autocast(recipe=MXFP8BlockScaling()), pytest.raises(RuntimeError, match="none is kept"):
        _call(m, x, is_first_microbatch=False)


def test_is_first_microbatch_false_after_recipe_change_raises():
    m = _module("linear")
    x, _ = make_data(seed=2)
    with autocast(recipe=MXFP8BlockScaling()):
        m(x, is_first_microbatch=True)
    with autocast(recipe=Float8CurrentScaling()), pytest.raises(RuntimeError, match="is_first_microbatch=True"):
        m(x, is_first_microbatch=False)


def test_is_first_microbatch_false_after_delayed_scaling_update_raises():
    """The kept copy used the scale of before the region's end update: reusing it in the next
    region would not be what that region's quantizer makes."""
    m = _module("linear")
    x, _ = make_data(seed=2)
    with autocast(recipe=DelayedScaling()):
        m(x, is_first_microbatch=True)
    with autocast(recipe=DelayedScaling()), pytest.raises(RuntimeError, match="quantizer state"):
        m(x, is_first_microbatch=False)
    # Inside one region the copy is reused (no update in between).
    counting = CountingFactory(lambda role: DelayedScaling().quantizer(role))
    m2 = _module("linear")
    with autocast(recipe=CustomRecipe(counting)):
        m2(x, is_first_microbatch=True)
        m2(x, is_first_microbatch=False)
    assert counting.count("weight") == 1


def test_is_first_microbatch_false_after_in_place_update_raises():
    """An in-place optimizer step (version counter moved) between True and False is caught."""
    m = _module("linear")
    x, dy = make_data(seed=2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with autocast(recipe=MXFP8BlockScaling()):
        y = m(x, is_first_microbatch=True)
    y.backward(dy)
    opt.step()
    with autocast(recipe=MXFP8BlockScaling()), pytest.raises(RuntimeError, match="changed in place"):
        m(x, is_first_microbatch=False)


def test_grouped_refused_reuse_keeps_the_entry_for_a_retry():
    """A refused ``is_first_microbatch=False`` leaves the kept copy in place: a retry reports
    the same cause, not "none is kept"."""
    m = _module("grouped")
    x, _ = make_data(seed=2)
    splits = splits_for(x.shape[0])
    with autocast(recipe=MXFP8BlockScaling()):
        m(x, splits, is_first_microbatch=True)
    with torch.no_grad():
        next(m.parameters()).add_(1.0)  # an in-place step: the version counter moves
    for _ in range(2):
        with autocast(recipe=MXFP8BlockScaling()), pytest.raises(RuntimeError, match="changed in place"):
            m(x, splits, is_first_microbatch=False)


def test_is_first_microbatch_false_missing_columnwise_copy_raises():
    """A copy kept by a forward without dgrad has no columnwise copy for a later backward."""
    m = _module("linear")
    x, _ = make_data(seed=2)
    with autocast(recipe=MXFP8BlockScaling()):
        m(x, is_first_microbatch=True)  # x needs no grad: rowwise copy only
    with autocast(recipe=MXFP8BlockScaling()), pytest.raises(RuntimeError, match="columnwise"):
        m(x.clone().requires_grad_(), is_first_microbatch=False)


def test_is_first_microbatch_rejects_non_bool():
    m = _module("linear")
    x, _ = make_data(seed=2)
    with autocast(recipe=MXFP8BlockScaling()), pytest.raises(TypeError, match="is_first_microbatch"):
        m(x, is_first_microbatch=1)


def test_checkpoint_replay_shares_the_forward_region():
    """The recomputation of a checkpointed forward reuses the forward's quantized weight (its
    replay region has the forward region's token), also after the region ended."""
    counting = CountingFactory(mxfp8)
    m = _module("linear")
    x, dy = make_data(seed=2)
    x = x.requires_grad_()
    with autocast(recipe=CustomRecipe(counting)) as state:
        y = hfp.checkpoint(m, x)
        token = state.token
    y.backward(dy)
    assert counting.count("weight") == 1
    assert m._wcache[0].region is token


def test_region_tokens_differ_between_regions():
    with autocast(recipe=MXFP8BlockScaling()) as a:
        pass
    with autocast(recipe=MXFP8BlockScaling()) as b:
        pass
    assert a.token is not b.token


def test_deepcopy_keeps_no_usable_entry():
    """A deep copy of a module with a cached weight quantizes its own weight (the copied entry's
    region token is a new object)."""
    recipe = MXFP8BlockScaling()
    m = _module("linear")
    x, _ = make_data(seed=2)
    with torch.no_grad(), autocast(recipe=recipe):
        m(x)
        twin = copy.deepcopy(m)
        twin.weight.data.mul_(2)
        got = twin(x)
    assert_bitwise(got, _fresh_output(twin, "linear", x, recipe), "deep copy")
