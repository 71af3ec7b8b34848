"""A torch.distributed.checkpoint of FSDP2's quantized primary weights under delayed scaling
loads bitwise: the weight quantizer a rank encodes its shard with takes the loaded state at the
model's load, so ``quantize_sharded_weights`` re-encodes each shard from its loaded master with
the saved scale (a quantizer still at its own scale would give other codes).

The model is built as a trainer builds it on resume: its modules build their quantizers outside
a forward, while FSDP2 holds the weights sharded (so they have not adopted the weights' own
quantizers when the state is loaded). An evaluation, then ``MasterWeightOptimizer.load_state_dict``,
leaves the loaded shards as they are, and the next step is the uninterrupted run's. 2 gloo ranks, the same batch on each (as in
test_fsdp2_primary_weights.py, whose model this is).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridfp as hf
from hybridfp.nn import QuantizedModule
from hybridfp.recipes import AutocastState

from spawn_ranks import run_ranks
from test_fsdp2_primary_weights import RECIPES, _digest, _payloads, _sharded, _width

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

RECIPE, ROWS, STEPS = "delayed", 16, 2


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    d = _width(RECIPE)
    return torch.randn(ROWS, d, generator=g), torch.randn(ROWS, d, generator=g)


def _loss(model: nn.Module, group) -> float:
    x, target = _batch()
    with torch.no_grad(), hf.autocast(recipe=RECIPES[RECIPE](), amax_reduction_group=group):
        return nn.functional.mse_loss(model(x).float(), target).item()


def _held(model: nn.Module) -> dict:
    """Digests of both weights' gathered quantized payloads and of every quantizer state entry."""
    states = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedModule):
            for key, entry in m.get_extra_state()["quantizers"].items():
                states[f"{name}.{key}"] = {k: _digest(v) if torch.is_tensor(v) else v for k, v in entry["state"].items()}
    return {"weights": [_payloads(hf.full_quantized_weight(layer.weight)) for layer in (model[0], model[2])],
            "states": states}


def _worker(rank: int, world: int, ckpt: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    group = dist.group.WORLD
    model = _sharded(RECIPE)
    opt = hf.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    x, target = _batch()
    for _ in range(STEPS):
        with hf.autocast(recipe=RECIPES[RECIPE](), amax_reduction_group=group):
            loss = nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    scale = model[0].weight.to_local()._slot.quantizer.scale.item()
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    opt_state = copy.deepcopy(opt.state_dict())
    saved = {**_held(model), "loss": _loss(model, group)}  # an evaluation: the scales move

    other = _sharded(RECIPE)
    state = AutocastState(RECIPES[RECIPE](), group)
    for m in other.modules():  # DCP loads into the state the modules hold: built, weights sharded
        if isinstance(m, QuantizedModule):
            m.quantizers(state)
    sd = {"model": other.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    other.load_state_dict(sd["model"])
    hf.quantize_sharded_weights(other)
    loaded = {**_held(other), "loss": _loss(other, group)}
    # the optimizer's state loaded after that evaluation: the shards stay as loaded, and the
    # next step is the uninterrupted run's (re-encoded with the moved scale, it was not)
    other_opt = hf.MasterWeightOptimizer(torch.optim.AdamW, other.parameters(), lr=1e-3)
    other_opt.load_state_dict(opt_state)
    kept = _held(other)["weights"] == loaded["weights"]
    steps = []
    for m, o in ((model, opt), (other, other_opt)):
        with hf.autocast(recipe=RECIPES[RECIPE](), amax_reduction_group=group):
            loss = nn.functional.mse_loss(m(x).float(), target)
        loss.backward()
        o.step()
        o.zero_grad()
        steps.append((loss.item(), _held(m)["weights"]))
    return {"saved": saved, "loaded": loaded, "scale": scale, "kept": kept, "steps": steps}


def test_sharded_delayed_weights_load_with_their_saved_scale(tmp_path) -> None:
    for got in run_ranks(_worker, 2, (str(tmp_path / "ckpt"),), tmp_path / "ranks"):
        assert got["scale"] != 1.0  # the trained weights' scale: a fresh quantizer's would differ
        assert got["loaded"]["weights"] == got["saved"]["weights"]
        assert got["loaded"]["states"] == got["saved"]["states"]
        assert got["loaded"]["loss"] == got["saved"]["loss"]
        assert got["kept"]
        assert got["steps"][0] == got["steps"][1]
