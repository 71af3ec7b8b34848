"""Delayed scaling's region-end amax reduction is one all-reduce per region, whatever the
number of quantizers (TransformerEngine coalesces it the same way; one per quantizer cost six
a step for two Linears), and trains as one process does.

Two gloo ranks run the same replicated model on the same batch (so the reduced amaxes are the
local ones and the losses must be bitwise the single process's); the collectives are counted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridfp as hf
from hybridfp import factories

from spawn_ranks import counting_all_reduces, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

STEPS = 3
RECIPES = {
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
    # delayed-scaling weights, MXFP8 activations and gradients
    "delayed_weights": lambda: hf.CustomRecipe(qfactory=lambda role: (
        hf.Float8Quantizer(amax_history_len=2) if role is not None and role.tensor_type == "weight"
        else factories.per_gemm("mxfp8", "mxfp8", "mxfp8")(role))),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(hf.Linear(64, 96), nn.GELU(), hf.Linear(96, 64), hf.LayerNormMLP(64, 128))


def _train(recipe: str, group=None, calls: list | None = None) -> list[float]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with hf.autocast(recipe=RECIPES[recipe](), amax_reduction_group=group):
            y = model(x)
        loss = nn.functional.mse_loss(y.float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if calls is not None:
            calls.append(0)
    return losses


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    with counting_all_reduces() as calls:
        for recipe in RECIPES:
            del calls[:]
            calls.append(0)  # step 1's count (the loop appends the next step's)
            out[recipe] = {"losses": _train(recipe, dist.group.WORLD, calls), "calls": calls[:STEPS]}
    return out


def test_one_all_reduce_per_region(tmp_path) -> None:
    want = {r: _train(r) for r in RECIPES}
    for got in run_ranks(_worker, 2, (), tmp_path):
        for recipe in RECIPES:
            assert got[recipe]["losses"] == want[recipe], recipe
            assert got[recipe]["calls"] == [1] * STEPS, (recipe, got[recipe]["calls"])
