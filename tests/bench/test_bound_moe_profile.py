"""bound_moe's one-step profile: the profiler starts during a step it discards, so the GPU is
not idle when the recorded step begins; only the step after it is recorded."""

from __future__ import annotations

from types import SimpleNamespace

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
    assert not any(k.startswith("ProfilerStep") for k in ops), sorted(ops)


def test_device_time_leaves_out_the_step_range():
    """On CUDA the schedule's ``ProfilerStep#N`` is also a user-annotation device event spanning
    the step: summed with the kernels it would count the step twice, idle gaps included."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(key, device_type, us, annotation=False):
        return SimpleNamespace(key=key, device_type=device_type, device_time_total=us, self_device_time_total=us,
                               is_user_annotation=annotation)
    events = [ev("gemm_kernel", cuda, 3000.0), ev("cast_kernel", cuda, 1000.0),
              ev("ProfilerStep#1", cuda, 9000.0, annotation=True), ev("aten::mm", cpu, 0.0)]
    averages = [ev("gemm_kernel", cuda, 3000.0), ev("ProfilerStep#1", cpu, 500.0), ev("aten::mm", cpu, 3000.0)]
    total, ops = bound_moe.device_times(events, averages)
    assert total == pytest.approx(4.0)
    assert ops == {"gemm_kernel": 3.0, "aten::mm": 3.0}
