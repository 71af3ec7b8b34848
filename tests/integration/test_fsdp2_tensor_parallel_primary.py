"""Tensor-parallel quantized primary weights sharded by FSDP2 over dp (a 2-D mesh, dp 2 x tp 2).

Four gloo ranks form a (dp, tp) mesh. Each trains a tiny ``quantized_model_init`` model (fc1
column-parallel, fc2 row-parallel: two Linears; a SwiGLU LayerNormMLP, whose fc1 tp shard is
[gate_r; up_r]) on the same batch three SGD steps (``hybridfp.MasterWeightOptimizer``), twice:
tensor-parallel only (``parallelize_module`` on ``mesh["tp"]``), and 2-D (the same, then
``enable_quantized_all_gather`` and ``fully_shard(..., mesh=mesh["dp"])`` per layer).

Why the 2-D run is bitwise the tensor-parallel one: each (dp, tp) rank holds its rows of its
tp shard's FP32 master and encodes them with the amax reduced over dp and then tp (the maximum
over the whole weight: the number the tensor-parallel run reduces over tp), each block whole
(one starting in a dp piece and ending in the next is encoded where it starts, from the next
rank's first rows), so the dp all-gather of the codes gives bitwise the tensor-parallel run's
quantized shard (checked directly: ``full_quantized_weight``); the GEMMs then run the same code
on the same operands. The dp ranks' gradients are equal (same batch), so FSDP2's reduce-scatter
average is exact; SGD is elementwise, on the same FP32 master values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

H, F, ROWS, STEPS, LR = 64, 128, 32, 3, 0.05
RECIPES = {
    "current": hf.Float8CurrentScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    # weight: NVFP4 rowwise (a per-tensor global amax), MXFP8 columnwise
    "hybrid_nvfp4_mxfp8": lambda: hf.CustomRecipe(qfactory=hf.factories.per_gemm(
        fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")),
}
MODELS = ("mlp", "swiglu")
#: fc1's tp shard is 96 rows, 48 a dp piece: MXFP8's 32-row blocks straddle the dp pieces
WIDE = 192


def _model(kind: str, recipe) -> nn.Module:
    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        if kind == "swiglu":
            return nn.Sequential(hf.LayerNormMLP(H, F, activation="swiglu", name="mlp"))
        f = WIDE if kind == "wide" else F
        return nn.Sequential(hf.Linear(H, f, name="fc1"), nn.GELU(), hf.Linear(f, H, name="fc2"))


def _plan(kind: str) -> dict:
    if kind == "swiglu":
        return {"0": hf.LayerNormMLPParallel()}
    return {"0": hf.ColwiseParallel(), "2": hf.RowwiseParallel()}


def _tp(kind: str, recipe, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(_model(kind, recipe), mesh["tp"], _plan(kind))


def _two_d(kind: str, recipe, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _tp(kind, recipe, mesh)
    assert hf.enable_quantized_all_gather(model) == 2
    for layer in ([model[0]] if kind == "swiglu" else [model[0], model[2]]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _train(model: nn.Module, recipe) -> list[float]:
    opt = hf.MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(ROWS, H, generator=g), torch.randn(ROWS, H, generator=g)
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


def _weights(model: nn.Module) -> dict:
    return {n: p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2}


def _compare(tp: nn.Module, two_d: nn.Module, dp_rank: int) -> dict:
    """Which weights differ: the FP32 master rows this dp rank holds, and the whole tp shard's
    quantized copies (gathered over dp) against the tensor-parallel run's quantized shard."""
    from hybridfp.integration.tensor_parallel_primary import SLOT_ATTR
    masters, codes = [], []
    ref = _weights(tp)
    for name, p in _weights(two_d).items():
        local = p.to_local()
        hp = getattr(local, "_hp", None)
        if hp is None:
            masters.append(f"{name}: not a quantized primary weight ({type(local).__name__})")
            continue
        want = ref[name].to_local().detach()
        if not torch.equal(hp, torch.chunk(want, 2, dim=0)[dp_rank]):
            masters.append(name)
        whole = hf.full_quantized_weight(p)
        shard = getattr(ref[name], SLOT_ATTR).shard
        for d in ("rowwise", "columnwise"):
            if not torch.equal(whole.dequantize(direction=d), shard.dequantize(direction=d)):
                codes.append(f"{name} {d}")
    return {"masters": masters, "codes": codes}


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return ""


def _refusals(mesh) -> dict:
    """What stays refused by name: a stale master (a plain optimizer stepped it, no re-encode),
    and another recipe's weight format than the one the weights are held in."""
    mx = hf.Float8CurrentScaling()
    model = _two_d("mlp", mx, mesh)
    x = torch.randn(8, H)

    def run(recipe) -> None:
        with hf.autocast(recipe=recipe):
            model(x).float().sum().backward()
    run(mx)
    torch.optim.SGD(model.parameters(), lr=LR).step()  # the masters stepped, their codes not
    out = {"stale": _message(lambda: run(mx))}
    out["requantized"] = hf.quantize_sharded_weights(model)
    out["after"] = _message(lambda: run(mx))
    out["other_recipe"] = _message(lambda: run(hf.MXFP8BlockScaling()))
    return out


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict = {}
    for kind in (*MODELS, "wide"):
        for name, make in RECIPES.items():
            if kind == "wide" and name != "mxfp8":
                continue
            tp, two_d = _tp(kind, make(), mesh), _two_d(kind, make(), mesh)
            out[f"{kind}-{name}"] = {"tp": _train(tp, make()), "two_d": _train(two_d, make()),
                                     **_compare(tp, two_d, rank // 2)}
    out["rowwise_dequantized"] = _rowwise_dequantized(mesh, rank // 2)
    out["refusals"] = _refusals(mesh)
    return out


def _rowwise_dequantized(mesh, dp_rank: int) -> dict:
    """A hybrid whose columnwise child (FP8 current) reads the dequantized MXFP8 rowwise copy:
    that child's amax is reduced over dp, then tp (one process: the tp shard's, over tp)."""
    from hybridfp.integration.tensor_parallel_primary import SLOT_ATTR

    def hybrid():
        return hf.HybridQuantizer(hf.MXFP8Quantizer(), hf.Float8CurrentScalingQuantizer(),
                                  columnwise_source="rowwise_dequantized")
    mx = hf.MXFP8BlockScaling()
    tp, two_d = _tp("mlp", mx, mesh), _two_d("mlp", mx, mesh)
    for i in (0, 2):
        q = hybrid()
        q.set_amax_reduction_group(mesh["tp"].get_group())
        getattr(tp[i].weight, SLOT_ATTR).quantizer = q
        two_d[i].weight.to_local()._slot.quantizer = hybrid()
    hf.quantize_tensor_parallel_weights(tp)
    return {"reduces": hf.quantize_sharded_weights(two_d), **_compare(tp, two_d, dp_rank)}


def test_two_d_quantized_primary_weights_train_as_tensor_parallel(tmp_path) -> None:
    """FP8 current scaling, MXFP8 and a hybrid (NVFP4 fprop, MXFP8 backward), two Linears and a
    SwiGLU MLP, and MXFP8 blocks straddling the dp pieces of a tp shard: the 2-D run's losses,
    FP32 masters and quantized copies are bitwise the tensor-parallel run's; so are the codes of
    a hybrid whose columnwise side reads the dequantized rowwise copy. What stays refused: a
    stale master, another recipe's weight format."""
    results = run_ranks(_worker, 4, (), tmp_path)
    for rank, res in enumerate(results):
        # 2 weights x (over dp, over tp), each its own all-reduce (the side's amax is its own)
        assert res.pop("rowwise_dequantized") == {"reduces": 4, "masters": [], "codes": []}, rank
        for case, got in res.items():
            if case == "refusals":
                continue
            assert got["two_d"] == got["tp"], (rank, case, got["two_d"], got["tp"])
            assert got["masters"] == [] and got["codes"] == [], (rank, case, got)
        ref = res["refusals"]
        assert "changed after its quantized shard was encoded" in ref["stale"], ref
        assert "quantize_sharded_weights" in ref["stale"], ref
        # two weights, one coalesced amax all-reduce over dp, then one over tp
        assert ref["requantized"] == 2 and ref["after"] == "", ref
        assert "quantized_model_init" in ref["other_recipe"], ref


def test_hsdp_of_a_tensor_parallel_primary_weight_is_refused_by_name() -> None:
    """One process (a 1-rank gloo group): FSDP2 with a replicate dimension (HSDP over a
    (replicate, shard) mesh) of a tensor-parallel quantized primary weight is refused, naming
    the weight and the 1-D dp mesh to use, at its first gather and at a re-encode."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("rep", "shard", "tp"))
        recipe = hf.Float8CurrentScaling()
        model = _tp("mlp", recipe, mesh)
        assert hf.enable_quantized_all_gather(model) == 2
        fully_shard(model, mesh=mesh["rep", "shard"])
        with pytest.raises(ValueError, match=r"weight: a tensor-parallel quantized primary weight sharded over "
                                             r"a 3-D mesh \(HSDP\).*mesh\['dp'\]"):
            hf.quantize_sharded_weights(model)
        with pytest.raises(ValueError, match=r"Linear\.weight: .* 3-D mesh \(HSDP\)"):
            with hf.autocast(recipe=recipe):
                model(torch.randn(4, H))
    finally:
        dist.destroy_process_group()
