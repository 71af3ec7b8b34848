"""Quantized primary weights (``quantized_model_init``) under hybridfp's tensor-parallel styles.

2 gloo ranks, each holding the same batch, train a tiny model (two Linears column- then
row-parallel; a SwiGLU LayerNormMLP, whose fc1 shard is [gate_r; up_r]) three SGD steps in four
ways: one process and tensor-parallel, each with high-precision weights and with quantized
primary weights (``hybridfp.MasterWeightOptimizer``).

Bitwise (the same arithmetic in the same order): tensor parallelism with quantized primary
weights against tensor parallelism with high-precision weights — every loss and every trained
parameter (``full_tensor()`` of the FP32 master): a rank's quantized shard is encoded with the
amax the tensor-parallel layer reduces over the group for a high-precision shard, from the same
FP32 values. And each rank's quantized shard decodes (both copies) to exactly the slice of the
whole master's quantization: scales of the whole weight, no block straddling two ranks.

Bounded: against one process with quantized primary weights, the tensor-parallel GEMMs sum in
another FP32 order (a row-parallel fprop, a column-parallel dgrad add 2 partial sums), the bound
test_tensor_parallel.py derives: relative L2 error of each trained parameter, and each loss,
within 2e-3 (FP8 / MXFP8) and 2e-2 (a recipe with NVFP4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

H, F, ROWS, STEPS, LR = 64, 128, 64, 3, 0.05
RECIPES = {
    "current": hf.Float8CurrentScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    # weight: NVFP4 rowwise (a per-tensor global amax), MXFP8 columnwise
    "hybrid_nvfp4_mxfp8": lambda: hf.CustomRecipe(qfactory=hf.factories.per_gemm(
        fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")),
}
BOUND = {"current": 2e-3, "mxfp8": 2e-3, "hybrid_nvfp4_mxfp8": 2e-2}
MODELS = ("mlp", "swiglu_mlp")


def _model(kind: str, out: int = F) -> nn.Module:
    torch.manual_seed(0)
    if kind == "swiglu_mlp":
        return nn.Sequential(hf.LayerNormMLP(H, out, activation="swiglu", name="mlp"))
    return nn.Sequential(hf.Linear(H, out, name="fc1"), nn.GELU(), hf.Linear(out, H, name="fc2"))


def _quantized_model(kind: str, recipe, out: int = F) -> nn.Module:
    with hf.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        return _model(kind, out)


def _plan(kind: str) -> dict:
    if kind == "swiglu_mlp":
        return {"0": hf.LayerNormMLPParallel()}
    return {"0": hf.ColwiseParallel(), "2": hf.RowwiseParallel()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _train(model: nn.Module, opt, recipe, x, c) -> list[float]:
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with hf.autocast(recipe=recipe):
            y = model(x)
        loss = (y.float() * c).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _shards_are_slices(model: nn.Module, rank: int, world: int, recipe) -> bool:
    """Each quantized shard decodes to the rank's slice of the whole master's quantization."""
    from hybridfp.integration.tensor_parallel_primary import SLOT_ATTR
    from torch.distributed.tensor.placement_types import _StridedShard
    ok, seen = True, 0
    for p in model.parameters():
        slot = getattr(p, SLOT_ATTR, None)
        if slot is None:
            continue
        seen += 1
        q = slot.quantizer.copy()
        q.set_amax_reduction_group(None)
        q.set_usage(rowwise=True, columnwise=True)
        whole = q.quantize(p.full_tensor().detach())
        pl = p.placements[0]
        for d in ("rowwise", "columnwise"):
            full = whole.dequantize(direction=d)
            if isinstance(pl, _StridedShard):
                want = torch.cat([h.chunk(world)[rank] for h in full.chunk(2)])
            else:
                want = full.chunk(world, dim=pl.dim)[rank]
            ok = ok and torch.equal(slot.shard.dequantize(direction=d), want)
    return ok and seen > 0


def _case(rank: int, world: int, kind: str, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    recipe = RECIPES[name]()
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(ROWS, H, generator=g), torch.randn(ROWS, H, generator=g)
    tp_hp = parallelize_module(_model(kind), mesh, _plan(kind))
    tp_qw = parallelize_module(_quantized_model(kind, recipe), mesh, _plan(kind))
    one_qw = _quantized_model(kind, recipe)
    out = {"held": sorted(type(p.to_local()).__name__ for p in tp_qw.parameters())}
    out["loss_tp"] = _train(tp_hp, torch.optim.SGD(tp_hp.parameters(), lr=LR), recipe, x, c)
    out["loss_tp_qw"] = _train(tp_qw, hf.MasterWeightOptimizer(torch.optim.SGD, tp_qw.parameters(), lr=LR),
                               recipe, x, c)
    opt_one = hf.MasterWeightOptimizer(torch.optim.SGD, one_qw.parameters(), lr=LR)
    out["loss_one_qw"] = _train(one_qw, opt_one, recipe, x, c)
    hp = dict(tp_hp.named_parameters())
    out["params_bitwise"] = all(torch.equal(p.full_tensor(), hp[n].full_tensor()) for n, p in tp_qw.named_parameters())
    out["shards_are_slices"] = _shards_are_slices(tp_qw, rank, world, recipe)
    one = dict(one_qw.named_parameters())
    masters = {n: opt_one.master_of(p) if isinstance(p, hf.QuantizedTensor) else p for n, p in one.items()}
    out["param_rel"] = {n: _rel(p.full_tensor(), masters[n]) for n, p in tp_qw.named_parameters()}
    return out


def _refusals(rank: int, world: int) -> dict:
    """What a tensor-parallel quantized primary weight refuses, by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    out = {}

    def message(fn) -> str:
        try:
            fn()
        except (ValueError, RuntimeError) as e:
            return str(e)
        return ""
    # 48 rows of fc1 over 2 ranks: 24 each, MXFP8's columnwise blocks span 32 rows
    mx = hf.MXFP8BlockScaling()
    out["straddle"] = message(lambda: parallelize_module(_quantized_model("mlp", mx, out=48), mesh, _plan("mlp")))
    delayed = hf.DelayedScaling()
    out["delayed"] = message(lambda: parallelize_module(_quantized_model("mlp", delayed), mesh, _plan("mlp")))
    model = parallelize_module(_quantized_model("mlp", mx), mesh, _plan("mlp"))
    x = torch.randn(8, H)

    def run(recipe) -> None:
        with hf.autocast(recipe=recipe):
            model(x).sum().backward()
    run(mx)
    torch.optim.SGD(model.parameters(), lr=LR).step()  # a plain optimizer: masters stepped, shards not
    out["stale"] = message(lambda: run(mx))
    out["requantized"] = hf.quantize_tensor_parallel_weights(model)
    out["after"] = message(lambda: run(mx))
    out["other_recipe"] = message(lambda: run(hf.Float8CurrentScaling()))
    return out


def _run(rank: int, world: int, cases: list) -> dict:
    return {"cases": [_case(rank, world, *case) for case in cases], "refusals": _refusals(rank, world)}


def test_tensor_parallel_quantized_primary_weights(tmp_path):
    cases = [(kind, name) for kind in MODELS for name in RECIPES]
    results = run_ranks(_run, 2, (cases,), tmp_path)
    for i, (kind, name) in enumerate(cases):
        what = f"{kind} {name}"
        for rank, res in enumerate(r["cases"][i] for r in results):
            assert set(res["held"]) == {"Tensor"}, f"{what}: the parameters are the FP32 master shards"
            assert res["loss_tp_qw"] == res["loss_tp"], f"{what} rank {rank}: {res['loss_tp_qw']} vs {res['loss_tp']}"
            assert res["params_bitwise"], f"{what} rank {rank}: trained masters differ from --tp's weights"
            assert res["shards_are_slices"], f"{what} rank {rank}: a quantized shard is not the whole weight's slice"
            bound = BOUND[name]
            for lt, lo in zip(res["loss_tp_qw"], res["loss_one_qw"]):
                assert abs(lt - lo) <= bound * abs(lo), f"{what} rank {rank}: {res['loss_tp_qw']} vs {res['loss_one_qw']}"
            worst = max(res["param_rel"].items(), key=lambda kv: kv[1])
            assert worst[1] <= bound, f"{what} rank {rank}: parameter {worst[0]} rel error {worst[1]}"
    for r in results:
        ref = r["refusals"]
        assert "block would straddle two ranks" in ref["straddle"] and "fc1.weight" in ref["straddle"], ref
        assert "keeps state (delayed scaling)" in ref["delayed"], ref
        assert "Run the model under the recipe given to quantized_model_init" in ref["other_recipe"], ref
        assert "changed after its quantized shard was encoded" in ref["stale"], ref
        assert ref["requantized"] == 2 and ref["after"] == "", ref
