"""precompute_weight_amax: one all-reduce per step for every quantized-gather weight's amax.

Each rank of a gloo group (2 and 4 processes) trains the same two-Linear MLP under
``fully_shard`` with ``enable_quantized_all_gather``, on the same batch in two micro-batches,
once without and once with ``hybridfp.precompute_weight_amax`` after each optimizer step; the
``dist.all_reduce`` calls of each step are counted. Without it every gather of a weight with a
per-tensor scale all-reduces that weight's amax (forward and backward, every micro-batch);
with it the step has the precompute's one all-reduce. The reduced amax is the same number (the
max over the ranks' shards), so losses and gradients are bitwise the run without it's, and
one process's (test_fsdp2_quantized_gather.py gives the reasoning).

A weight changed after the precompute (an optimizer step, an in-place edit, a ``foreach``
optimizer whose writes move no version counter) makes the next gather raise; precomputing
again makes it train on.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

import hybridfp as hf
from hybridfp import factories

from spawn_ranks import counting_all_reduces, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

D, ROWS, STEPS, MICRO = 64, 16, 2, 2
RECIPES = {
    "current": hf.Float8CurrentScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    # NVFP4 rowwise (per-tensor amax) for fprop, MXFP8 columnwise for dgrad
    "hybrid_nvfp4_mxfp8": lambda: hf.CustomRecipe(qfactory=factories.per_gemm(
        fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")),
    # NVFP4 columnwise read from the dequantized MXFP8 copy: its amax is not the weight's
    "hybrid_mxfp8_nvfp4_rd": lambda: hf.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd),
}
#: all-reduces per step (2 weights, 2 micro-batches) without / with the precompute
CALLS = {"current": (8, 1), "nvfp4": (8, 1), "hybrid_nvfp4_mxfp8": (4, 1), "hybrid_mxfp8_nvfp4_rd": (4, 5)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(hf.Linear(D, D, bias=False), nn.GELU(), hf.Linear(D, D, bias=False))


def _digest(t: torch.Tensor) -> str:
    t = t.to_local() if hasattr(t, "to_local") else t
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g)


def _train(model: nn.Module, recipe: str, precompute: bool = False, calls: list | None = None) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, target = _batch()
    losses, grads = [], []
    if precompute:
        hf.precompute_weight_amax(model)
    for _ in range(STEPS):
        if calls is not None:
            calls.append(0)
        opt.zero_grad()
        torch.manual_seed(2)  # NVFP4's stochastic rounding (gradients) draws from torch's generator
        for xs, ts in zip(x.chunk(MICRO), target.chunk(MICRO)):
            with hf.autocast(recipe=RECIPES[recipe]()):
                y = model(xs)
            loss = nn.functional.mse_loss(y.float(), ts)
            loss.backward()
            losses.append(loss.item())
        grads.append([_digest(p.grad) for p in model.parameters()])
        opt.step()
        if precompute:
            hf.precompute_weight_amax(model)
    return {"losses": losses, "grads": grads}


def _sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    assert hf.enable_quantized_all_gather(model) == 2
    for layer in (model[0], model[2]):
        fully_shard(layer)  # resharded after forward: gathered again (columnwise) for backward
    fully_shard(model)
    return model


def _forward_error(model: nn.Module) -> str:
    try:
        with hf.autocast(recipe=RECIPES["current"]()):
            model(_batch()[0])
    except RuntimeError as e:
        return str(e)
    return "no error"


def _stale_cases() -> dict:
    out = {}
    for case in ("sgd_step", "in_place", "foreach_adamw"):
        model = _sharded()
        with hf.autocast(recipe=RECIPES["current"]()):
            model(_batch()[0]).float().pow(2).mean().backward()
        hf.precompute_weight_amax(model)
        if case == "in_place":
            with torch.no_grad():
                model[0].weight.mul_(1.5)
        else:
            opt = (torch.optim.SGD(model.parameters(), lr=0.5) if case == "sgd_step"
                   else torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True))
            opt.step()
        out[case] = _forward_error(model)
        hf.precompute_weight_amax(model)
        out[f"{case}-again"] = _forward_error(model)
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    with counting_all_reduces() as calls:
        for recipe in RECIPES:
            for precompute in (False, True):
                del calls[:]
                got = _train(_sharded(), recipe, precompute, calls)
                out[f"{recipe}-{precompute}"] = {**got, "calls": calls[:STEPS]}
    out["stale"] = _stale_cases()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_one_all_reduce_per_step_bitwise_as_without(world: int, tmp_path) -> None:
    want = {r: _train(_model(), r)["losses"] for r in RECIPES}
    for rank, got in enumerate(run_ranks(_worker, world, (), tmp_path)):
        for recipe, (without, with_) in CALLS.items():
            plain, pre = got[f"{recipe}-False"], got[f"{recipe}-True"]
            assert plain["calls"] == [without] * STEPS, (rank, recipe, plain["calls"])
            assert pre["calls"] == [with_] * STEPS, (rank, recipe, pre["calls"])
            assert pre["losses"] == plain["losses"] == want[recipe], (rank, recipe)
            assert pre["grads"] == plain["grads"], (rank, recipe)
        stale = got["stale"]
        for case in ("sgd_step", "in_place", "foreach_adamw"):
            assert "precompute_weight_amax" in stale[case] and "changed since" in stale[case], (case, stale[case])
            assert stale[f"{case}-again"] == "no error", (case, stale[f"{case}-again"])
        assert "version counter" in stale["sgd_step"] and "amax" in stale["foreach_adamw"]


def test_a_model_without_quantized_gathers_is_refused() -> None:
    with pytest.raises(ValueError, match="enable_quantized_all_gather"):
        hf.precompute_weight_amax(_model())
