"""bound_moe's one-step profile: the profiler starts during a step it discards, so the GPU is
not idle when the recorded step begins; only the step after it is recorded."""

from __future__ import annotations

import pytest
import torch

from bench import bound_moe


class _LabelledStep:
    """A step that labels itself in the profile with its call number and the calls since its
    last ``reset``."""

    def __init__(self) -> None:
        self.calls, self.since_reset = 0, 0

    def reset(self) -> None:
        self.since_reset = 0

    def __call__(self) -> None:
        with torch.profiler.record_function(f"call{self.calls}-after-reset{self.since_reset}"):
            torch.ones(4).cumsum(0)
        self.calls += 1
        self.since_reset += 1


@pytest.mark.parametrize("warmup", [0, 2])
def test_profile_records_one_step_after_a_discarded_one(warmup):
    """On the CPU (its activity alone): the labels of the traced calls name only the step after
    the discarded one, routed from the schedule's first step (``reset`` just before it)."""
    step = _LabelledStep()
    _, ops = bound_moe._profile(step, warmup, activities=[torch.profiler.ProfilerActivity.CPU])
    labels = sorted(k for k in ops if k.startswith("call"))
    assert labels == [f"call{warmup + 1}-after-reset0"], labels
    assert step.calls == warmup + 2  # the warm-up, the discarded step, the recorded one
    assert "aten::cumsum" in ops
