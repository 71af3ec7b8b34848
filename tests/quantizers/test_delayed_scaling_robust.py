"""Delayed scaling under bad steps and bad options: a non-finite amax stays out of the history
(that step keeps the previous scale, one warning per quantizer), a raising autocast region
commits none of its amaxes, and the recipe / quantizer options are checked when made.

Inputs are small integers times powers of two: every amax and scale below is exact."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import hybridfp as hf
from hybridfp import Float8CurrentScalingQuantizer, Float8Quantizer
from hybridfp.quantizers.float8 import NonFiniteAmaxWarning
from hybridfp.recipes import QuantizerRole

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")
ROLE = QuantizerRole("linear", "input", "blocks.0.fc1")


def _x(amax: float, bad: float | None = None) -> torch.Tensor:
    """A [4, 8] tensor whose max |x| is ``amax`` (exact), with one ``bad`` element if given."""
    x = torch.full((4, 8), amax / 4)
    x[1, 3] = -amax
    if bad is not None:
        x[2, 5] = bad
    return x


def _quantizer(**kw) -> Float8Quantizer:
    q = Float8Quantizer(**kw)
    q.role = ROLE
    return q


# ---------------------------------------------------------------- non-finite amaxes
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_nonfinite_amax_stays_out_of_the_history(bad):
    q = _quantizer()
    q(_x(4.0))
    q.finish_step()
    assert q.scale.item() == 112.0  # 448 / 4
    with pytest.warns(NonFiniteAmaxWarning, match="blocks.0.fc1"):
        q(_x(4.0, bad))
        q.finish_step()
    assert q.scale.item() == 112.0  # that step kept the previous scale
    assert torch.isfinite(q.amax_history).all()
    # the following steps see the window of finite amaxes only: 50 steps of amax 2 later, the
    # scale is still that of the largest finite amax (4, in the window), and nothing saturates
    for _ in range(50):
        y = q(_x(2.0))
        q.finish_step()
        data = y.qstorage.payload("rowwise")["data"].float()
        assert data.abs().max().item() == 224.0  # 2 * 112: in range, no saturation
    assert q.scale.item() == 112.0


def test_nonfinite_amax_in_a_short_history_does_not_freeze_the_scale():
    q = _quantizer(amax_history_len=2)
    with pytest.warns(NonFiniteAmaxWarning):
        q(_x(8.0, math.inf))
        q.finish_step()
    assert q.scale.item() == 1.0  # first step: kept the initial scale
    for amax, want in [(4.0, 112.0), (2.0, 112.0), (1.0, 224.0)]:
        q(_x(amax))
        q.finish_step()
        assert q.scale.item() == want


def test_nonfinite_amax_warns_once_per_quantizer():
    q, other = _quantizer(), _quantizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            q(_x(4.0, math.nan))
            q.finish_step()
        other(_x(4.0, math.inf))
        other.finish_step()
    msgs = [str(w.message) for w in caught if issubclass(w.category, NonFiniteAmaxWarning)]
    assert len(msgs) == 2, msgs
    assert all("blocks.0.fc1" in m and "input" in m for m in msgs)


def test_nonfinite_amax_with_most_recent_algo_keeps_scale():
    q = _quantizer(amax_history_len=4, amax_compute_algo="most_recent")
    q(_x(4.0))
    q.finish_step()
    with pytest.warns(NonFiniteAmaxWarning):
        q(_x(4.0, math.inf))
        q.finish_step()
    assert q.scale.item() == 112.0
    q(_x(2.0))
    q.finish_step()
    assert q.scale.item() == 224.0


def test_linear_recovers_after_an_inf_input():
    torch.manual_seed(0)
    lin = hf.Linear(8, 4, name="fc")
    recipe = hf.DelayedScaling(amax_history_len=16)
    x = _x(4.0)
    with hf.autocast(recipe=recipe):
        lin(x)
    q = lin._quantizers["input"][0]
    scale = q.scale.clone()
    with pytest.warns(NonFiniteAmaxWarning, match="fc"):
        with hf.autocast(recipe=recipe):
            lin(_x(4.0, math.inf))
    assert torch.equal(q.scale, scale) and torch.isfinite(q.amax_history).all()
    for _ in range(3):
        with hf.autocast(recipe=recipe):
            y = lin(x)
        assert torch.isfinite(y).all()
    assert torch.equal(q.scale, scale)


# ---------------------------------------------------------------- a raising region
def _state(lin: hf.Linear) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    return {slot: (qs[0].amax_history.clone(), qs[0].scale.clone(), qs[0].state_version())
            for slot, qs in lin._quantizers.items()}


def _step(lin: hf.Linear, recipe, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    with hf.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    out = (y.detach(), x.grad, lin.weight.grad.clone())
    lin.zero_grad()
    return out


def test_raising_region_commits_no_amax():
    torch.manual_seed(0)
    recipe = hf.DelayedScaling(amax_history_len=4)
    lin = hf.Linear(8, 4, name="fc")
    ref = copy.deepcopy(lin)
    x, dy = _x(2.0), _x(1.0)[:, :4].contiguous()
    for m in (lin, ref):
        _step(m, recipe, x, dy)
    before = _state(lin)
    with pytest.raises(RuntimeError, match="boom"):
        with hf.autocast(recipe=recipe):
            lin(_x(64.0))  # records a large amax in the input quantizer ...
            raise RuntimeError("boom")  # ... which must not be committed
    after = _state(lin)
    for slot in before:
        assert torch.equal(before[slot][0], after[slot][0]), slot
        assert torch.equal(before[slot][1], after[slot][1]), slot
    # the next steps are those of a run without the failed region, bitwise
    for _ in range(2):
        for a, b in zip(_step(lin, recipe, x, dy), _step(ref, recipe, x, dy)):
            assert torch.equal(a, b)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(_state(lin).values(), _state(ref).values()))


def test_discard_step_restores_a_quantizer():
    q = _quantizer(amax_history_len=3)
    q(_x(4.0))
    q.finish_step()
    hist, scale = q.amax_history.clone(), q.scale.clone()
    q(_x(32.0))
    q.discard_step()
    q.finish_step()  # nothing recorded since the discard: no update
    assert torch.equal(q.amax_history, hist) and torch.equal(q.scale, scale)


def test_hybrid_discard_step_reaches_both_children():
    h = hf.HybridQuantizer(Float8Quantizer(amax_history_len=2), Float8Quantizer(amax_history_len=2))
    h(_x(4.0))
    h.discard_step()
    h.finish_step()
    for child in (h.rowwise_quantizer, h.columnwise_quantizer):
        assert child.scale.item() == 1.0 and not child.amax_history.any()


# ---------------------------------------------------------------- option checks
BAD_DELAYED = [
    ("margin", -1), ("margin", 2.5), ("margin", 200), ("margin", True), ("margin", math.nan),
    ("amax_history_len", 0), ("amax_history_len", 2.5), ("amax_history_len", -3),
]


@pytest.mark.parametrize("option,value", BAD_DELAYED, ids=[f"{o}={v}" for o, v in BAD_DELAYED])
def test_delayed_options_are_checked(option, value):
    with pytest.raises(ValueError, match=option):
        Float8Quantizer(**{option: value})
    with pytest.raises(ValueError, match=f"DelayedScaling.*{option}"):
        hf.DelayedScaling(**{option: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, -math.inf])
def test_amax_epsilon_is_checked(value):
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8CurrentScalingQuantizer(amax_epsilon=value)
    with pytest.raises(ValueError, match="Float8CurrentScaling.*amax_epsilon"):
        hf.Float8CurrentScaling(amax_epsilon=value)


def test_margin_error_gives_the_range():
    with pytest.raises(ValueError, match=r"margin=200.*\[0, \d+\]"):
        Float8Quantizer(margin=200)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_largest_margin_keeps_scale_and_inverse_finite(dtype):
    from hybridfp.formats.fp8_tensorwise import max_margin
    m = max_margin(dtype)
    with pytest.raises(ValueError, match="margin"):
        Float8Quantizer(dtype, margin=m + 1)
    q = Float8Quantizer(dtype, margin=m, amax_history_len=1)
    fp32_max = torch.finfo(torch.float32).max
    for amax in (fp32_max, 1.0, 2.0**-140):  # the extremes of the scale
        q(torch.tensor([[amax, 0.0]]))
        q.finish_step()
        scale_inv = q(torch.tensor([[amax, 0.0]])).qstorage.payload("rowwise")["scale_inv"]
        assert q.scale.item() > 0 and math.isfinite(q.scale.item()), amax
        assert math.isfinite(scale_inv.item()), amax
        q.discard_step()


def test_valid_options_still_accepted():
    Float8Quantizer(margin=3, amax_history_len=1)
    hf.DelayedScaling(margin=2, amax_history_len=16)
    hf.Float8CurrentScaling(amax_epsilon=1e-12)
    Float8CurrentScalingQuantizer(amax_epsilon=0)


# ---------------------------------------------------------------- GPU: no host sync per step
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nonfinite_check_needs_no_host_sync_per_step():
    """The update and the non-finite bookkeeping queue device work only: the flag reaches the
    host through a copy read at a later update, once its event has completed."""
    q = _quantizer(amax_history_len=8)
    good, bad = _x(4.0).cuda(), _x(4.0, math.inf).cuda()
    q(good)
    q.finish_step()  # warm-up: state on the device, pinned flag allocated
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (good, bad, good, good):
            q(x)
            torch.cuda.set_sync_debug_mode("error")  # around the step end only
            try:
                q.finish_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for _ in range(2):  # the first queues the copy if none was queued since; the second reads it
            torch.cuda.synchronize()
            q(good)
            q.finish_step()
    found = [w for w in caught if issubclass(w.category, NonFiniteAmaxWarning)]
    assert len(found) == 1
    assert q.scale.item() == 112.0 and torch.isfinite(q.amax_history).all()
