"""FSDP2 (``fully_shard``) with hybridfp modules: every rank quantizes the weight it runs with.

FSDP2 copies the all-gathered weight into the same unsharded Parameter before each forward,
under ``torch.autograd._unsafe_preserve_version_counter``: its version counter never moves
and its address may or may not repeat, differently on each rank. A weight cache keyed on those
served the previous step's weight on some ranks, and with an amax reduction group (delayed
scaling) ranks then disagreed on cache hits and waited forever in the amax all-reduce.

Two gloo processes on the CPU train a two-Linear MLP (converted with ``hybridfp.convert``) for
four SGD steps; their losses must equal one process training the same model on the same data.

Why equality is exact: every rank trains on the *same* batch, so both ranks' gradients are the
same numbers; the reduce-scatter's sum of two equal FP32 values is an exact doubling and
FSDP2's averaging divides by the world size 2 (exact), so the averaged gradient is bitwise the
single process's. The forward reads the gathered (bitwise) weights through the same hybridfp
code on the same shapes, and SGD is elementwise: the losses are bitwise equal, step after step.
A deadlock fails the test through the process group's timeout and the join timeout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridfp as hfp

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

WORLD = 2
STEPS = 4
D_IN, D_HID, D_OUT, ROWS = 64, 96, 32, 16


def _recipe(name: str) -> hfp.Recipe:
    return hfp.MXFP8BlockScaling() if name == "mxfp8" else hfp.DelayedScaling()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return hfp.convert(nn.Sequential(nn.Linear(D_IN, D_HID), nn.GELU(), nn.Linear(D_HID, D_OUT)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, D_IN, generator=g), torch.randn(ROWS, D_OUT, generator=g)


def _train(model: nn.Module, recipe_name: str, group=None) -> list[float]:
    """``STEPS`` steps of SGD on one batch (the step-n quantization sees step n's weights)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, target = _data()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with hfp.autocast(recipe=_recipe(recipe_name), amax_reduction_group=group):
            y = model(x)
        loss = nn.functional.mse_loss(y.float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int, recipe_name: str, decoded_mode: str) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)  # reshard_after_forward=True: re-gathered for backward, each step
    fully_shard(model)
    group = dist.group.WORLD if recipe_name == "delayed" else None
    # the parent's decoded-copies mode (a spawned process starts with the default policy)
    with hfp.policy(decoded_copies=decoded_mode):
        return _train(model, recipe_name, group)


@pytest.mark.parametrize("recipe_name", ["mxfp8", "delayed"])
def test_fsdp2_ranks_match_single_process(recipe_name, tmp_path, decoded_copies_mode):
    want = _train(_model(), recipe_name)
    assert len(set(want)) == STEPS, "the weights must change from step to step"
    for rank, got in enumerate(run_ranks(_worker, WORLD, (recipe_name, decoded_copies_mode), tmp_path)):
        assert got == want, f"rank {rank}: losses {got} vs single process {want}"
