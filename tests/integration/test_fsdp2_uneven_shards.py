"""FSDP2's quantized all-gather of a weight whose rows do not divide by the world size.

FSDP2 shards rows as ``torch.chunk`` does (``ceil(N / world)`` per rank, the last ranks fewer)
and takes, on a rank holding padding, only all-gather inputs of the padded shard's shape: the
quantized bytes travel as uint8 tensors of that shape. Each rank encodes the rows from its
first block boundary to the next rank's, taking the rows of a block that straddles shards
(or, where a block is longer than a shard, whole shards) from the following ranks, so the
gathered weight is the whole weight's quantization; padding rows never reach it.

Every rank trains the same model on the same batch, one process the unsharded model: the
losses and the trained weight are bitwise the same (the reasoning of
test_fsdp2_quantized_gather.py: same codes, same GEMMs, exact gradient sums). 35 rows are
uneven on 2 and 4 ranks, 70 on 4 (18, 18, 18, 16), 36 on 4 ranks are 9-row shards (shorter
than MXFP8's 32-row and FP8 block's 128-row blocks: some ranks encode no block), for the
block formats. FP8 current and NVFP4 also train bitwise so with ``precompute_weight_amax``.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import run_ranks
from test_fsdp2_quantized_gather import RECIPES  # every built-in recipe and three hybrids

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

K, BATCH, STEPS = 64, 8, 2
#: (rows, recipes) per world size: every format where shards are uneven; 9-row shards with the
#: block formats only
BLOCK_RECIPES = ("block", "mxfp8", "nvfp4")
CASES = {2: [(35, tuple(RECIPES))], 4: [(70, tuple(RECIPES)), (36, BLOCK_RECIPES)]}
#: also trained with precompute_weight_amax: NVFP4's 16-row blocks straddle these shards, so a
#: rank's encoded rows are not its shard (its amax check reads the shard)
PRECOMPUTED = ("current", "nvfp4")


def _model(rows: int) -> nn.Module:
    """A quantized Linear with ``rows`` outputs (its weight sharded unevenly) and a plain
    Linear back to K (any width: its all-gather is FSDP2's own)."""
    torch.manual_seed(0)
    return nn.Sequential(hf.Linear(K, rows, bias=False), nn.GELU(), nn.Linear(rows, K, bias=False))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _train(model: nn.Module, recipe: str, group=None, precompute: bool = False) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if precompute:
        hf.precompute_weight_amax(model)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(BATCH, K, generator=g), torch.randn(BATCH, K, generator=g)
    x.requires_grad_(True)  # dgrad reads the weight's columnwise copy (the backward gather's)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(2)  # NVFP4's stochastic rounding (gradients) draws from torch's generator
        with hf.autocast(recipe=RECIPES[recipe](), amax_reduction_group=group):
            y = model(x)
        loss = nn.functional.mse_loss(y.float(), target)
        loss.backward()
        opt.step()
        if precompute:
            hf.precompute_weight_amax(model)
        losses.append(loss.item())
    w = model[0].weight
    return {"losses": losses, "weight": _digest(w.full_tensor() if hasattr(w, "full_tensor") else w)}


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    out = {}
    for rows, recipes in CASES[world]:
        for recipe in recipes:
            model = _model(rows)
            assert hf.enable_quantized_all_gather(model) == 1
            for layer in (model[0], model[2]):
                fully_shard(layer)  # resharded after forward: gathered again (columnwise) for backward
            fully_shard(model)
            group = dist.group.WORLD if recipe == "delayed" else None
            out[f"{rows}-{recipe}"] = _train(model, recipe, group)
        for recipe in (r for r in PRECOMPUTED if r in recipes):  # the amax precomputed
            model = _model(rows)
            hf.enable_quantized_all_gather(model)
            fully_shard(model[0])
            fully_shard(model[2])
            fully_shard(model)
            out[f"{rows}-{recipe}-precomputed"] = _train(model, recipe, precompute=True)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_shards_train_as_one_process(world: int, tmp_path) -> None:
    want = {f"{rows}-{r}": _train(_model(rows), r) for rows, recipes in CASES[world] for r in recipes}
    for rank, got in enumerate(run_ranks(_worker, world, (), tmp_path)):
        for case in want:
            assert got[case] == want[case], (rank, case)
        for rows, recipes in CASES[world]:
            for recipe in (r for r in PRECOMPUTED if r in recipes):
                assert got[f"{rows}-{recipe}-precomputed"] == want[f"{rows}-{recipe}"], (rank, rows, recipe)
