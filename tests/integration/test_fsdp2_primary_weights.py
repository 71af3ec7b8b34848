"""Quantized primary weights under FSDP2 train bitwise as one process does.

A 2-layer bias-free MLP is built under ``hybridfp.quantized_model_init`` (weights held
quantized, FP32 masters); ``enable_quantized_all_gather`` + ``fully_shard`` shard the masters
and the quantized weights over 2 and 4 gloo ranks, every rank training on the same batch with
``MasterWeightOptimizer`` (AdamW). Why bitwise: each rank encodes its rows of the weight once
per step from its master shard with the whole weight's amax (one coalesced all-reduce) and
whole blocks (a block straddling two shards is encoded where it starts, from the next rank's
first rows), so the gathered codes are the single-process weight's; the GEMMs then run the
same code on the same operands. The gradients are the same on every rank (same batch), so
FSDP2's reduce-scatter sum and its division by the world size are exact; AdamW is
elementwise on the same FP32 values.

The sizes make blocks straddle shard boundaries: 160 rows over 4 ranks are 40 per rank
(MXFP8's 32-row and NVFP4's 16-row column blocks straddle); FP8 128x128 blocks run on 256 rows
(over 4 ranks a block spans two shards: ranks 0 and 2 encode 128 rows each, 1 and 3 none);
150 rows of FP8 current scaling are sharded unevenly over 4 ranks (38, 38, 38, 36).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

ROWS, STEPS = 16, 3
RECIPES = {
    "current": hf.Float8CurrentScaling,
    "current_uneven": hf.Float8CurrentScaling,  # 150 rows: 38, 38, 38, 36 on 4 ranks
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
    "block": hf.Float8BlockScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid_nvfp4_mxfp8": lambda: hf.CustomRecipe(qfactory=hf.factories.per_gemm(
        fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")),
}
#: weights with a per-tensor scale: their amaxes take one all-reduce per step (block formats none)
PER_TENSOR = {"current", "current_uneven", "delayed", "nvfp4", "hybrid_nvfp4_mxfp8"}


def _width(recipe: str) -> int:
    return {"block": 256, "current_uneven": 150}.get(recipe, 160)


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().reshape(-1)
    return f"{t.dtype}:{t.numel()}:" + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def _payloads(q) -> list[str]:
    return [_digest(t) for t in q.qstorage.tensors()]


def _model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    d = _width(recipe)
    with hf.quantized_model_init(recipe=RECIPES[recipe](), preserve_high_precision_init_val=True):
        return nn.Sequential(hf.Linear(d, d, bias=False), nn.GELU(), hf.Linear(d, d, bias=False))


def _train(model: nn.Module, recipe: str, group=None, hooks=None) -> tuple[list[float], list[str]]:
    """STEPS AdamW steps on one batch: the losses and the last step's master gradients."""
    opt = hf.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    d = _width(recipe)
    x, target = torch.randn(ROWS, d, generator=g), torch.randn(ROWS, d, generator=g)
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(2)  # NVFP4's stochastic rounding (gradients) draws from torch's generator
        if hooks:
            hooks["pass"] = True
        with hf.autocast(recipe=RECIPES[recipe](), amax_reduction_group=group):
            y = model(x)
        loss = nn.functional.mse_loss(y.float(), target)
        loss.backward()
        if hooks:
            hooks["pass"] = False
        grads = [_digest(_master_grad(opt, p)) for p in (model[0].weight, model[2].weight)]
        if hooks:
            hooks["reduces"].append(0)
            hooks["step"] = True
        opt.step()
        if hooks:
            hooks["step"] = False
        losses.append(loss.item())
    return losses, grads


def _master_grad(opt, p) -> torch.Tensor:
    m = opt.master_of(p)
    g = p.grad if m is None else p.grad.float()  # sharded: the parameter is its own FP32 master
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _counting(hooks: dict) -> None:
    """Count all-reduces during optimizer steps and all-gathered bytes during forward / backward."""
    import torch.distributed as dist
    orig_reduce, orig_single, orig_into = dist.all_reduce, dist.all_gather_single, dist.all_gather_into_tensor

    def all_reduce(t, *a, **k):
        if hooks.get("step"):
            hooks["reduces"][-1] += 1
        return orig_reduce(t, *a, **k)

    def all_gather_single(out, inp, *a, **k):  # FSDP2's all-gather
        if hooks.get("pass"):
            hooks["sent"].append(inp.numel() * inp.element_size())
        return orig_single(out, inp, *a, **k)

    def all_gather_into_tensor(out, inp, *a, **k):  # the straddling blocks' rows: at steps only
        if hooks.get("pass"):
            hooks["sent"].append(-1)
        return orig_into(out, inp, *a, **k)
    dist.all_reduce, dist.all_gather_single, dist.all_gather_into_tensor = (
        all_reduce, all_gather_single, all_gather_into_tensor)


def _sharded(recipe: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = _model(recipe)
    assert hf.enable_quantized_all_gather(model) == 2
    for layer in (model[0], model[2]):
        fully_shard(layer)  # resharded after forward: gathered again (columnwise) for backward
    fully_shard(model)
    return model


def _fsdp_worker(rank: int, world: int, recipes: list[str], ckpt: str) -> dict:
    """Train every recipe sharded; at 2 ranks save DCP checkpoints (then the refusals), at 4
    load them."""
    models: dict = {}
    out = _train_sharded(world, recipes, models)
    out.update(_dcp_save(ckpt, models) if world == 2 else _dcp_load(ckpt))
    return out


def _train_sharded(world: int, recipes: list[str], models: dict) -> dict:
    import torch.distributed as dist
    from hybridfp.tensors import COLUMNWISE, ROWWISE

    hooks: dict = {"sent": [], "reduces": [0]}
    _counting(hooks)
    out = {}
    for recipe in recipes:
        model = _sharded(recipe)
        hooks["sent"], hooks["reduces"] = [], []
        initial = hf.quantize_sharded_weights(model)  # the first encoding (else: at the first gather)
        group = dist.group.WORLD if recipe == "delayed" else None
        losses, grads = _train(model, recipe, group, hooks)
        models[recipe] = model
        layouts = []
        for layer in (model[0], model[2]):
            (layout,) = layer.weight.to_local()._slot.layouts.values()
            layouts.append([layout.set_bytes[(ROWWISE,)], layout.set_bytes[(COLUMNWISE,)], list(layout.rank_rows)])
        out[recipe] = {"losses": losses, "grads": grads, "initial_reduces": initial,
                       "reduces": hooks["reduces"], "sent": hooks["sent"], "layouts": layouts,
                       "weights": [_payloads(hf.full_quantized_weight(layer.weight)) for layer in (model[0], model[2])]}
    return out


@pytest.fixture(scope="module")
def one_process() -> dict:
    """Each recipe's single-process run: losses, last master gradients, quantized weights."""
    want = {}
    for recipe in RECIPES:
        model = _model(recipe)
        losses, grads = _train(model, recipe)
        want[recipe] = (losses, grads, [_payloads(model[0].weight), _payloads(model[2].weight)])
    return want


def test_primary_weights_train_as_one_process_and_reshard(tmp_path, one_process) -> None:
    """2 ranks train and save a DCP checkpoint of the stateless recipes, 4 ranks train and load it."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_fsdp_worker, 2, (sorted(RECIPES), ckpt), tmp_path / "two")
    loaded = run_ranks(_fsdp_worker, 4, (sorted(RECIPES), ckpt), tmp_path / "four")
    _check_training(saved, 2, one_process)
    _check_training(loaded, 4, one_process)
    for got in loaded:
        for recipe in DCP_RECIPES:
            assert got["dcp"][recipe] == saved[0]["dcp"][recipe], recipe
    for s in saved:
        assert "changed after its quantized shard was encoded" in s["stale"], s["stale"]
        assert "quantize_sharded_weights" in s["stale"]
        assert s["requantized_loss"] != s["dcp"]["nvfp4"]["loss"]  # the halved master is what is gathered
        assert "rounds stochastically" in s["sr"], s["sr"]
        assert "changed after its quantized shard was encoded" in s["foreach_stale"], s["foreach_stale"]


def _check_training(results: list, world: int, want: dict) -> None:
    for rank, got in enumerate(results):
        for recipe, (losses, grads, weights) in want.items():
            g = got[recipe]
            assert g["losses"] == losses, (rank, recipe, g["losses"], losses)
            assert g["grads"] == grads, (rank, recipe)
            assert g["weights"] == weights, (rank, recipe)
            n = 1 if recipe in PER_TENSOR else 0
            assert g["initial_reduces"] == n and g["reduces"] == [n] * STEPS, (rank, recipe, g["reduces"])
            (fwd, bwd, rank_rows), second = g["layouts"]
            assert second[:2] == [fwd, bwd]
            # per step: fc1 and fc2 forward (rowwise copies), then fc2 and fc1 backward (columnwise)
            assert g["sent"] == [fwd, fwd, bwd, bwd] * STEPS, (rank, recipe, g["sent"][:4])
            d = _width(recipe)
            if recipe in ("current", "current_uneven", "delayed"):  # one FP8 byte per element of the shard
                assert fwd == bwd == -(-d // world) * d
            if recipe in ("mxfp8", "nvfp4") and world == 4:  # a block straddles each boundary
                assert len(set(rank_rows)) > 1, rank_rows


DCP_RECIPES = ("current", "mxfp8", "nvfp4")  # stateless: the loaded masters alone define the weights


def _batch(recipe: str) -> torch.Tensor:
    return torch.randn(ROWS, _width(recipe), generator=torch.Generator().manual_seed(3))


def _forward(model: nn.Module, recipe: str) -> float:
    with torch.no_grad(), hf.autocast(recipe=RECIPES[recipe]()):
        return model(_batch(recipe)).float().square().mean().item()


def _whole(model: nn.Module) -> list:
    """Digests of both weights' gathered quantized payloads and FP32 masters."""
    return [[_payloads(hf.full_quantized_weight(layer.weight)), _digest(layer.weight.full_tensor())]
            for layer in (model[0], model[2])]


def _dcp_save(path: str, models: dict) -> dict:
    """Save the trained models (FP32 master shards) with torch.distributed.checkpoint; a master
    changed without re-encoding is refused at the next gather; a stochastically rounding weight
    quantizer is refused."""
    import torch.distributed.checkpoint as dcp

    out = {"dcp": {}}
    for recipe in DCP_RECIPES:
        model = models[recipe]
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{path}/{recipe}")
        out["dcp"][recipe] = {"whole": _whole(model), "loss": _forward(model, recipe)}
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # a plain update of the master: its quantized shard is now stale
    try:
        _forward(model, recipe)
        out["stale"] = "no error"
    except RuntimeError as e:
        out["stale"] = str(e)
    hf.quantize_sharded_weights(model)
    out["requantized_loss"] = _forward(model, recipe)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    torch.optim.AdamW(model.parameters(), foreach=True).step()  # moves no DTensor version counter
    try:
        _forward(model, recipe)
        out["foreach_stale"] = "no error"
    except RuntimeError as e:
        out["foreach_stale"] = str(e)
    hf.quantize_sharded_weights(model)
    model[0].weight.to_local()._slot.quantizer.stochastic_rounding = True
    try:
        hf.quantize_sharded_weights(model)
        out["sr"] = "no error"
    except ValueError as e:
        out["sr"] = str(e)
    return out


def _dcp_load(path: str) -> dict:
    """Load the checkpoint at another world size: the masters resharded, the quantized shards
    re-encoded from them."""
    import torch.distributed.checkpoint as dcp

    out = {"dcp": {}}
    for recipe in DCP_RECIPES:
        model = _sharded(recipe)
        _forward(model, recipe)  # the modules build their quantizers (their state is in the state_dict)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=f"{path}/{recipe}")
        model.load_state_dict(state["model"])
        hf.quantize_sharded_weights(model)
        out["dcp"][recipe] = {"whole": _whole(model), "loss": _forward(model, recipe)}
    return out
