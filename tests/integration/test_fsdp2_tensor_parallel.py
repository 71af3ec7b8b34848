"""FSDP2's quantized all-gather on tensor-parallel weights (a 2-D mesh, dp 2 x tp 2) trains
as the tensor-parallel run does, sending quantized bytes.

Four gloo ranks form a (dp, tp) mesh. Each trains a tiny model (fc1 column-parallel, fc2
row-parallel: two bias-free Linears, and a SwiGLU LayerNormMLP) on the same batch, twice: tensor
-parallel only (``parallelize_module`` on ``mesh["tp"]``), and 2-D (the same, then
``enable_quantized_all_gather`` and ``fully_shard(..., mesh=mesh["dp"])`` per layer).

Why the 2-D run is bitwise the tensor-parallel one: each dp rank quantizes its rows of the
rank's tensor-parallel shard with the amax reduced over dp and then tp (the maximum over the
whole weight, the number the tensor-parallel layer reduces over tp), and each block is
encoded whole (32 rows a dp shard; in the wide case a block straddling two dp shards is
encoded by the rank where it starts, as FSDP2 alone does), so the gathered codes are the
tensor-parallel layer's own quantization of its shard; the GEMMs then run the same code on the
same operands. The dp ranks'
gradients are equal (same batch), so FSDP2's reduce-scatter average is exact; SGD is
elementwise. Against one process the runs differ by the tensor-parallel sums' order: the bound
of tests/integration/test_tensor_parallel.py (its ``BOUND``, reused).

The bytes of each all-gather of the MLP's weights are counted (one weight a layer): the copy
the GEMMs read, against the BF16 dp shard of the tensor-parallel shard.
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
    "nvfp4": lambda: hf.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "hybrid_nvfp4_mxfp8": lambda: hf.CustomRecipe(qfactory=hf.factories.per_gemm(
        fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")),
}
#: tests/integration/test_tensor_parallel.py's relative bound against one process
BOUND = {"current": 2e-3, "mxfp8": 2e-3, "nvfp4": 2e-2, "hybrid_nvfp4_mxfp8": 2e-2}
_MX, _FP4_2D, _FP4_1D = (1 + 1 / 32) / 2, (0.5 + 1 / 256) / 2, (0.5 + 1 / 16) / 2
#: bytes sent per weight element / a BF16 weight's 2: forward gather, backward gather
RATIOS = {"current": (0.5, 0.5), "mxfp8": (_MX, _MX), "nvfp4": (_FP4_2D, _FP4_2D),
          "hybrid_nvfp4_mxfp8": (_FP4_1D, _MX)}
MODELS = ("mlp", "swiglu")
#: fc1's tp shard is 96 rows, 48 a dp shard: MXFP8's 32-row blocks straddle the dp shards
WIDE = 192


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "swiglu":
        return nn.Sequential(hf.LayerNormMLP(H, F, activation="swiglu", name="mlp"))
    f = WIDE if kind == "wide" else F
    return nn.Sequential(hf.Linear(H, f, bias=False, name="fc1"), nn.GELU(), hf.Linear(f, H, bias=False, name="fc2"))


def _plan(kind: str) -> dict:
    if kind == "swiglu":
        return {"0": hf.LayerNormMLPParallel()}
    return {"0": hf.ColwiseParallel(), "2": hf.RowwiseParallel()}


def _train(model: nn.Module, recipe: str, precompute: bool = False) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(ROWS, H, generator=g), torch.randn(ROWS, H, generator=g)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        if precompute:  # the step's weight amaxes in one reduction (after each optimizer step)
            assert hf.precompute_weight_amax(model) == 2
        with hf.autocast(recipe=RECIPES[recipe]()):
            y = model(x)
        loss = (y.float() * c).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _params(model: nn.Module, dp_rank: int = -1) -> dict:
    """Each parameter's values on this rank: the tensor-parallel shard, or (``dp_rank`` >= 0)
    its rows FSDP2 keeps on that dp rank (``torch.chunk``), compared without another gather."""
    out = {}
    for n, p in model.named_parameters():
        t = p.to_local().detach()
        t = getattr(t, "_hp", t)  # a quantized-gather weight's high-precision shard
        if dp_rank >= 0:
            t = torch.chunk(t, 2, dim=0)[dp_rank]
        out[n] = t.float().reshape(-1).tolist()
    return out


def _count_all_gathers(sent: list) -> None:
    """Record the bytes of every all-gather FSDP2 issues (its collective's input)."""
    import torch.distributed as dist
    for name in ("all_gather_into_tensor", "all_gather_single"):
        orig = getattr(dist, name, None)
        if orig is not None:
            def counting(out, inp, *a, _orig=orig, **k):
                sent.append(inp.numel() * inp.element_size())
                return _orig(out, inp, *a, **k)
            setattr(dist, name, counting)


def _two_d(kind: str, mesh, copies: str = "per_direction") -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = parallelize_module(_model(kind), mesh["tp"], _plan(kind))
    assert hf.enable_quantized_all_gather(model, copies=copies) == 2
    layers = [model[0]] if kind == "swiglu" else [model[0], model[2]]
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sent: list[int] = []
    _count_all_gathers(sent)
    out: dict = {}
    for kind in MODELS:
        for recipe in RECIPES:
            tp = parallelize_module(_model(kind), mesh["tp"], _plan(kind))
            want = _train(tp, recipe)
            model = _two_d(kind, mesh)
            del sent[:]
            got = _train(model, recipe)
            out[f"{kind}-{recipe}"] = {
                "losses": got, "tp_losses": want, "sent": list(sent),
                "diff_params": [n for n, v in _params(model).items() if v != _params(tp, rank // 2)[n]]}
    # the weights' amaxes precomputed once a step (over dp, then tp): the same scales
    for recipe in ("current", "hybrid_nvfp4_mxfp8"):
        tp = parallelize_module(_model("mlp"), mesh["tp"], _plan("mlp"))
        out[f"precompute-{recipe}"] = [_train(_two_d("mlp", mesh), recipe, precompute=True), _train(tp, recipe)]
    # blocks straddling the dp shards of a tp shard: encoded where they start (the halo rows)
    tp = parallelize_module(_model("wide"), mesh["tp"], _plan("wide"))
    model = _two_d("wide", mesh)
    got = _train(model, "mxfp8")
    halo = max(layout.halo for layout in model[0].weight.to_local()._slot.layouts.values())
    out["wide"] = {"losses": got, "tp_losses": _train(tp, "mxfp8"), "halo": halo}
    # a tensor-parallel split whose blocks would straddle tp ranks: refused before the gather
    model = _two_d("mlp", mesh)
    try:
        with hf.autocast(recipe=hf.Float8BlockScaling()):
            model(torch.ones(ROWS, H))
        out["block"] = "trained"
    except ValueError as e:
        out["block"] = str(e)
    return out


def test_two_d_quantized_gather_trains_as_tensor_parallel(tmp_path) -> None:
    """FP8 current scaling, MXFP8, NVFP4 and a hybrid (NVFP4 fprop, MXFP8 backward): the 2-D
    run's losses and trained parameters are bitwise the tensor-parallel run's, within the
    tensor-parallel bound of one process's, and every gather sends the quantized copy; with
    the weights' amaxes precomputed once a step too; with MXFP8 blocks straddling the dp
    shards of a tensor-parallel shard."""
    ref = {f"{k}-{r}": _train(_model(k), r) for k in MODELS for r in RECIPES}
    results = run_ranks(_worker, 4, (), tmp_path)
    shard_bf16 = F // 2 // 2 * H * 2  # a layer's tp shard (64 x 64) split over 2 dp ranks, in BF16
    for rank, res in enumerate(results):
        for case, want in ref.items():
            got, recipe = res[case], case.split("-", 1)[1]
            assert got["losses"] == got["tp_losses"], (rank, case, got["losses"], got["tp_losses"])
            assert got["diff_params"] == [], (rank, case)
            for lt, lr in zip(got["losses"], want):
                assert abs(lt - lr) <= BOUND[recipe] * abs(lr), (rank, case, got["losses"], want)
            if case.startswith("mlp-"):
                fwd, bwd = RATIOS[recipe]
                expected = [round(r * shard_bf16) for r in (fwd, fwd, bwd, bwd)] * STEPS
                assert got["sent"] == expected, (rank, case, got["sent"][:4], expected[:4])
        for recipe in ("current", "hybrid_nvfp4_mxfp8"):
            got, want = res[f"precompute-{recipe}"]
            assert got == want, (rank, recipe, got, want)
        assert res["wide"]["halo"] == 16 and res["wide"]["losses"] == res["wide"]["tp_losses"], res["wide"]
        assert "block would straddle two ranks" in res["block"], res["block"]
        assert "Float8BlockQuantizer" in res["block"], res["block"]


def test_sharded_or_foreign_dtensor_weights_are_refused_by_name() -> None:
    """One process (a 1-rank gloo group): a weight FSDP2 sharded already, tensor-parallel or not,
    is refused with what to do; a tensor-parallel quantized primary weight is taken (its FP32
    master's tp shard wrapped: test_fsdp2_tensor_parallel_primary.py trains it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(_model("mlp"), mesh["tp"], _plan("mlp"))
        fully_shard(model, mesh=mesh["dp"])
        with pytest.raises(ValueError, match=r"Linear\.weight is a DTensor over a 2-D mesh.*before fully_shard"):
            hf.enable_quantized_all_gather(model)
        plain = _model("mlp")
        fully_shard(plain, mesh=mesh["dp"])
        with pytest.raises(ValueError, match="not placed by hybridfp's tensor-parallel styles: either FSDP2 sharded"):
            hf.enable_quantized_all_gather(plain)
        with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
            held = _model("mlp")
        parallelize_module(held, mesh["tp"], _plan("mlp"))
        assert hf.enable_quantized_all_gather(held) == 2
        assert {type(p.to_local()).__name__ for p in held.parameters() if p.dim() == 2} == {"QuantizedPrimaryWeight"}
    finally:
        dist.destroy_process_group()
