"""``hybridfp train --tp 2 --fsdp`` all-gathers the tensor-parallel weights quantized.

4 ranks, a (dp=2, tp=2) mesh, FP8 current scaling, delayed scaling and a hybrid (MXFP8
forward, NVFP4 backward): the losses stay within the bounds of test_train_tp.py against the
same run under ``--tp 2`` alone (the weights' codes are the tensor-parallel layers' own; what
differs is the order in which the dp ranks' gradients and the clipping norm are summed). The
weights are gathered quantized: the trainer precomputes the amaxes of the weights it gathers
quantized with a per-tensor scale (logged with their count: every block's four linears).

A delayed-scaling recipe is refused for a weight gathered quantized that is not
tensor-parallel (an MoE layer's experts): its gather would need the region's amax reduction
group, which the tensor-parallel layers refuse.
"""

from __future__ import annotations

import pytest
import torch

import hybridfp as hf
from hybridfp.train import distributed, tensor_parallel
from hybridfp.train.distributed import Parallel
from hybridfp.train.model import PRESETS, GPT
from test_train_tp import _assert_close
from torchrun_runs import COMMON, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

RECIPES = ("fp8", "fp8-delayed", "mxfp8-fwd-nvfp4-bwd")


def test_tp_fsdp_gathers_quantized_and_trains_as_tp(tmp_path, text) -> None:
    run = ["--preset", "test", "--lr-decay-steps", "4", "--steps", "4", "--data", str(text), *COMMON,
           "--compare", ",".join(RECIPES)]
    torchrun(4, "--tp", "2", "--out", str(tmp_path / "tp"), *run)
    proc = torchrun(4, "--tp", "2", "--fsdp", "--out", str(tmp_path / "fsdp"), *run)
    # 2 blocks x (qkv, proj, fc, proj): every tensor-parallel weight is gathered quantized
    assert "[fp8] 8 weights' amaxes reduced once per step" in proc.stdout + proc.stderr
    for recipe in RECIPES:
        _assert_close(records(tmp_path / "fsdp", recipe), records(tmp_path / "tp", recipe))


def test_tp_fsdp_refuses_delayed_scaling_of_experts(monkeypatch) -> None:
    """The test-moe preset's experts are not tensor-parallel: delayed scaling is refused by
    name before FSDP2 shards anything (the tensor-parallel split itself is skipped here)."""
    monkeypatch.setattr(tensor_parallel, "parallelize_blocks", lambda model, mesh: None)
    torch.manual_seed(0)
    model = GPT(PRESETS["test-moe"].model)
    par = Parallel(rank=0, world=4, device="cpu", fsdp=True, tp=2, tp_mesh={"tp": None})
    with pytest.raises(ValueError, match="--tp --fsdp with a delayed-scaling recipe.*not tensor-parallel"):
        distributed.shard_model(model, par, hf.DelayedScaling())
