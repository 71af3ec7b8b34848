"""``evaluate`` of a sharded run with delayed scaling needs the training regions' amax
reduction group: without it the modules would rebuild their quantizers and drop their state."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hf
from hybridfp.train.distributed import Parallel
from hybridfp.train.loop import evaluate


def test_a_sharded_delayed_scaling_evaluation_without_its_group_is_refused():
    model = torch.nn.Sequential(hf.Linear(16, 16))
    with warnings.catch_warnings(), hf.autocast(recipe=hf.DelayedScaling()):
        warnings.simplefilter("ignore")
        model(torch.randn(4, 16))
    state = model[0].get_extra_state()
    with pytest.raises(ValueError, match="amax_reduction_group=amax_group"):
        evaluate(model, None, None, None, Parallel(rank=0, world=2, device="cpu", fsdp=True))
    assert model[0].get_extra_state()["quantizers"].keys() == state["quantizers"].keys()
