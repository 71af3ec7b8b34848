"""FSDP2 with the quantized all-gather trains like one process, sending quantized bytes.

Each rank of a gloo group (2 and 4 processes on the CPU) trains the same bias-free MLP under
``fully_shard`` with ``hybridfp.enable_quantized_all_gather``, on the same batch; one process
trains the unsharded model. Why the losses are bitwise equal: every rank quantizes its shard
with the whole weight's scale (per-tensor amaxes reduced over the shard group; block scales
lie within a shard), so the gathered codes are the whole weight's; the GEMMs then run the same
code on the same operands. The gradients are the same numbers on every rank (same batch), so
the reduce-scatter's sum is exact (a power-of-two multiple) and its division by the world
size too; SGD is elementwise.

The bytes each all-gather sends are counted (the model has no biases, so an all-gather is one
weight's shard): per direction, the copy the GEMMs read, against the BF16 shard's bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridfp as hf
from hybridfp import factories

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

D, H, ROWS, STEPS = 512, 512, 16, 3
RECIPES = {
    "current": hf.Float8CurrentScaling,
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
    "block": hf.Float8BlockScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid_mxfp8_nvfp4": lambda: hf.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd),
    "hybrid_nvfp4_1d": lambda: hf.CustomRecipe(qfactory=factories.nvfp4_1d_weight),
    "hybrid_nvfp4_mxfp8": lambda: hf.CustomRecipe(qfactory=hf.factories.per_gemm(
        fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")),
    # unquantized: one tensor serves both copies (the FP32 weight, twice a BF16 one's bytes)
    "high_precision": lambda: hf.CustomRecipe(qfactory=factories.high_precision),
}
#: bytes sent per weight element / a BF16 weight's 2, forward and backward gathers
_MX, _FP4_2D, _FP4_1D = (1 + 1 / 32) / 2, (0.5 + 1 / 256) / 2, (0.5 + 1 / 16) / 2
RATIOS = {
    "current": (0.5, 0.5), "delayed": (0.5, 0.5), "block": (0.5 + 4 / 128**2 / 2,) * 2,
    "mxfp8": (_MX, _MX), "nvfp4": (_FP4_2D, _FP4_2D),
    # two formats: each gather sends its own copy's bytes
    "high_precision": (2.0, 2.0), "hybrid_mxfp8_nvfp4": (_MX, _FP4_1D), "hybrid_nvfp4_1d": (_FP4_1D, _FP4_1D), "hybrid_nvfp4_mxfp8": (_FP4_1D, _MX),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(hf.Linear(D, H, bias=False), nn.GELU(), hf.Linear(H, D, bias=False))


def _train(model: nn.Module, recipe: str, group=None, steps: int = STEPS, opt=None, width: int = D) -> list[float]:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(ROWS, width, generator=g), torch.randn(ROWS, width, generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        torch.manual_seed(2)  # NVFP4's stochastic rounding (gradients) draws from torch's generator
        with hf.autocast(recipe=RECIPES[recipe](), amax_reduction_group=group):
            y = model(x)
        loss = nn.functional.mse_loss(y.float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


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


def _fsdp_worker(rank: int, world: int, recipes: list[str]) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    sent: list[int] = []
    _count_all_gathers(sent)
    out = {}
    for recipe in recipes:
        model = _model()
        assert hf.enable_quantized_all_gather(model) == 2
        for layer in (model[0], model[2]):
            fully_shard(layer)  # resharded after forward: gathered again (columnwise) for backward
        fully_shard(model)
        del sent[:]
        group = dist.group.WORLD if recipe == "delayed" else None
        out[recipe] = {"losses": _train(model, recipe, group), "sent": list(sent)}
        with torch.no_grad(), hf.autocast(recipe=RECIPES[recipe](), amax_reduction_group=group):
            for _ in range(2):  # forwards without a backward gather between them
                model(torch.ones(ROWS, D))
    return out


class _Checkpointed(nn.Module):
    """The MLP with each Linear's forward recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, mlp: nn.Sequential) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(self.mlp[0], x, use_reentrant=False)
        return checkpoint(self.mlp[2], self.mlp[1](h), use_reentrant=False)


class _Experts(nn.Module):
    """Two GroupedLinear layers of two experts (each expert's weight gathered on its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = hf.GroupedLinear(2, D, H, bias=False), hf.GroupedLinear(2, H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x, [6, 10])), [6, 10])


def _layouts_worker(rank: int, world: int) -> dict:
    """Modules FSDP2 keeps gathered from forward to backward (the root's own) and forwards
    recomputed after the backward gather: per-direction gathers refuse them with a clear
    error, ``copies="both"`` trains them as one process does."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for case in ("root", "checkpoint"):
        for copies in ("per_direction", "both"):
            model = _model()
            hf.enable_quantized_all_gather(model, copies=copies)
            if case == "checkpoint":
                for layer in (model[0], model[2]):
                    fully_shard(layer)
                model = _Checkpointed(model)
            fully_shard(model)  # "root": the Linears' weights are the root's own
            try:
                out[f"{case}-{copies}"] = _train(model, "mxfp8")
            except RuntimeError as e:
                out[f"{case}-{copies}"] = str(e)
    for case in ("experts", "experts_root"):
        model = _Experts()
        assert hf.enable_quantized_all_gather(model) == 4
        if case == "experts":
            fully_shard(model.fc1)
            fully_shard(model.fc2)
        fully_shard(model)
        try:
            out[case] = _train(model, "mxfp8")
        except RuntimeError as e:
            out[case] = str(e)
    return out


def test_modules_gathered_once_need_both_copies(tmp_path) -> None:
    """Also GroupedLinear's experts: gathered per direction they train as one process; the
    root's own refuse per-direction gathers as the dense modules do."""
    want = _train(_model(), "mxfp8")
    want_experts = _train(_Experts(), "mxfp8")
    for got in run_ranks(_layouts_worker, 2, (), tmp_path):
        assert got["experts"] == want_experts, got["experts"]
        assert "columnwise copy has no memory" in got["experts_root"]
        assert got["root-both"] == want, got["root-both"]
        assert got["checkpoint-both"] == want, got["checkpoint-both"]
        assert "columnwise copy has no memory" in got["root-per_direction"]
        assert "copies='both'" in got["root-per_direction"]
        assert "rowwise copy has no memory" in got["checkpoint-per_direction"]


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_quantized_gather_trains_as_one_process(world: int, tmp_path) -> None:
    want = {r: _train(_model(), r) for r in RECIPES}
    results = run_ranks(_fsdp_worker, world, (sorted(RECIPES),), tmp_path)
    shard_bf16 = H // world * D * 2  # both weights are 512 x 512
    for rank, got in enumerate(results):
        for recipe in RECIPES:
            assert got[recipe]["losses"] == want[recipe], (rank, recipe)
            fwd, bwd = RATIOS[recipe]
            # per step: fc1 and fc2 forward, then fc2 and fc1 backward
            expected = [round(r * shard_bf16) for r in (fwd, fwd, bwd, bwd)] * STEPS
            assert got[recipe]["sent"] == expected, (rank, recipe, got[recipe]["sent"][:4], expected[:4])


def _momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _resume_worker(rank: int, world: int, phase: str, ckpt: str, recipe: str) -> list[float]:
    """Phase "save": one step, then a DCP checkpoint of model and optimizer; phase "load" (at
    another world size): load it and train the remaining steps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model()
    hf.enable_quantized_all_gather(model)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = _momentum(model)
    group = dist.group.WORLD if recipe == "delayed" else None
    if phase == "save":
        losses = _train(model, recipe, group, steps=1, opt=opt)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        return losses
    with torch.no_grad(), hf.autocast(recipe=RECIPES[recipe](), amax_reduction_group=group):
        model(torch.zeros(ROWS, D))  # builds the quantizers whose state the checkpoint holds
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _train(model, recipe, group, steps=STEPS - 1, opt=opt)


@pytest.mark.parametrize("recipe", ["mxfp8", "delayed"])
def test_dcp_resume_resharded_from_2_to_4_ranks(recipe: str, tmp_path) -> None:
    """k steps on 2 ranks, a torch.distributed.checkpoint, N - k steps on 4 ranks == N steps
    of one process (the high-precision shards and the quantizers' extra state reshard)."""
    model = _model()
    want = _train(model, recipe, steps=STEPS, opt=_momentum(model))
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(_resume_worker, 2, ("save", ckpt, recipe), tmp_path / "save")
    rest = run_ranks(_resume_worker, 4, ("load", ckpt, recipe), tmp_path / "load")
    for losses in first:
        assert losses == want[:1]
    for losses in rest:
        assert losses == want[1:]


#: (recipe, rows per block) whose blocks straddle shards of one and a half blocks
UNALIGNED = {2: [("block", 128), ("mxfp8", 32), ("nvfp4", 16)], 4: [("mxfp8", 32), ("nvfp4", 16)]}


def _square_mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(hf.Linear(width, width, bias=False), nn.GELU(), hf.Linear(width, width, bias=False))


def _unaligned_worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for recipe, block in UNALIGNED[world]:
        width = world * block * 3 // 2
        model = _square_mlp(width)
        hf.enable_quantized_all_gather(model)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        out[recipe] = _train(model, recipe, steps=2, width=width)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_shards_that_split_a_block_train_as_one_process(world: int, tmp_path) -> None:
    """Each rank's rows are one and a half blocks (FP8 block 128x128, MXFP8 32-row columnwise
    blocks, NVFP4 16x16): a straddling block is encoded by the rank where it starts, from its
    rows and the next rank's first rows, so the gathered weight is still the whole weight's
    quantization (TransformerEngine refuses FP8 block shards like these)."""
    want = {r: _train(_square_mlp(world * b * 3 // 2), r, steps=2, width=world * b * 3 // 2) for r, b in UNALIGNED[world]}
    for got in run_ranks(_unaligned_worker, world, (), tmp_path):
        assert got == want
