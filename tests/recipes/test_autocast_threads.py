"""``autocast`` regions belong to the thread that entered them (``torch.autocast`` semantics):
two threads in regions with different recipes each see their own, and a thread started
inside a region starts outside any region (high precision).

The threads are interleaved deterministically with barriers: each step is taken by both
threads while the other one is inside its own region."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import hybridfp as hf
from hybridfp import Float8CurrentScalingQuantizer, MXFP8Quantizer
from hybridfp.recipes import current_autocast

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

STEPS = 5


def _run_threads(*targets) -> list[BaseException]:
    """Start one thread per target, join them, and return the exceptions they raised."""
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # re-raised by the test in the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (barrier deadlock)"
    return errors


def test_two_threads_keep_their_own_recipe():
    barrier = threading.Barrier(2, timeout=10)
    recipes = {"a": hf.MXFP8BlockScaling(), "b": hf.Float8CurrentScaling()}
    want_cls = {"a": MXFP8Quantizer, "b": Float8CurrentScalingQuantizer}
    modules = {k: hf.Linear(32, 16, name=k) for k in recipes}
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def worker(name: str) -> None:
        x = torch.randn(4, 32)
        for _ in range(STEPS):
            with hf.autocast(recipe=recipes[name]) as state:
                barrier.wait()  # both threads are inside their regions now
                modules[name](x)
                barrier.wait()  # both have run their forward
                active = current_autocast()
                seen[name].append("own" if active is state and active.recipe is recipes[name] else "other")
                barrier.wait()  # both have looked before either leaves its region
            assert current_autocast() is None

    errors = _run_threads(lambda: worker("a"), lambda: worker("b"))
    assert not errors, errors
    for name in recipes:
        assert seen[name] == ["own"] * STEPS
        q = modules[name]._quantizers["input"][0]
        assert isinstance(q, want_cls[name]), f"module {name} built {type(q).__name__}"


def test_thread_started_inside_a_region_runs_high_precision():
    lin = hf.Linear(32, 16)
    x = torch.randn(4, 32)
    result: dict[str, object] = {}

    def child() -> None:
        result["active"] = current_autocast()
        result["y"] = lin(x)

    with hf.autocast(recipe=hf.Float8CurrentScaling()):
        errors = _run_threads(child)
    assert not errors, errors
    assert result["active"] is None
    assert torch.equal(result["y"], F.linear(x, lin.weight, lin.bias))
    assert lin._quantizers == {}  # the child built no quantizers


def test_region_end_in_one_thread_does_not_end_the_other():
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    active_after: list[bool] = []

    def first_in_first_out() -> None:
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            a_inside.set()
            assert b_inside.wait(10)
        a_left.set()  # left while the other thread is still inside its region

    def second_in_last_out() -> None:
        assert a_inside.wait(10)
        with hf.autocast(recipe=hf.Float8CurrentScaling()) as state:
            b_inside.set()
            assert a_left.wait(10)
            active_after.append(current_autocast() is state)

    errors = _run_threads(first_in_first_out, second_in_last_out)
    assert not errors, errors
    assert active_after == [True]
