"""``hybridfp train --ep K [--fsdp] --quantized-weights`` under torchrun (gloo, CPU): each rank
holds its experts' weights quantized (FP32 masters in ``MasterWeightOptimizer``; with --fsdp
quantized primary weights sharded over the experts' replicas) and trains like the
single-process ``--quantized-weights`` run; a resumed run (same world size) continues bit for bit.

Why a bound against one process and not bitwise: as in ``test_train_fsdp.py``, the global batch
is split over the ranks, so the gradients are the ranks' GEMM sums added by an all-reduce (an
FP32 summation order other than one process's). The bounds are that test's. The resume is
bitwise: the same ranks run the same arithmetic in the same order, from the masters, AdamW's
moments and quantizer states the checkpoint holds.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from spawn_ranks import run_ranks
from torchrun_runs import COMMON, records, torchrun
from test_train_fsdp import _assert_close, _single

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

KEYS = ("train_loss", "val_loss", "aux_loss")


def test_ep_quantized_weights_train_as_one_process_and_resume_bitwise(tmp_path, text) -> None:
    """The MoE preset's 4 experts (MXFP8 weights held quantized) over expert-parallel groups of
    2 ranks: 4 steps within the bounds of one process; 2 steps, a sharded checkpoint (the
    experts' FP32 masters under their global names) and 2 more resumed give the 4-step run's
    records exactly. The same checkpoint resumed under FSDP2 on a (dp=2, ep=2) mesh of 4 ranks
    (each expert a quantized primary weight sharded over its 2 replicas) stays within the bounds."""
    run = ["--preset", "test-moe", "--lr-decay-steps", "4", "--data", str(text), "--recipe", "mxfp8",
           "--quantized-weights", *COMMON]
    _single(tmp_path / "one", *run, "--steps", "4")
    one = records(tmp_path / "one", "mxfp8")
    full, split, fsdp = tmp_path / "full", tmp_path / "split", tmp_path / "fsdp"
    torchrun(2, "--ep", "2", "--steps", "4", "--out", str(full), *run)
    _assert_close(records(full, "mxfp8"), one, KEYS)
    torchrun(2, "--ep", "2", "--steps", "2", "--out", str(split), *run)
    shutil.copytree(split, fsdp)
    proc = torchrun(2, "--ep", "2", "--resume", "--steps", "4", "--out", str(split), *run)
    assert "at step 2" in proc.stdout
    want, got = records(full, "mxfp8"), records(split, "mxfp8")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert {k: g.get(k) for k in KEYS} == {k: w.get(k) for k in KEYS}, (g, w)
    proc = torchrun(4, "--fsdp", "--ep", "2", "--resume", "--steps", "4", "--out", str(fsdp), *run)
    assert "at step 2" in proc.stdout
    _assert_close(records(fsdp, "mxfp8"), one, KEYS)


def _quantized_moe_model():
    import hybridfp as hf
    from hybridfp.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling(), preserve_high_precision_init_val=True):
        return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, mlp_hidden=64, block_size=32, n_experts=4,
                             top_k=2, moe_hidden=64))


def _ep_masters_worker(rank: int, world: int) -> list[list]:
    """Each local expert weight of this rank under --ep 2: (name, held quantized, its FP32 master
    bitwise the one-process model's master of the same global expert)."""
    import hybridfp as hf
    from torch.distributed.device_mesh import init_device_mesh
    from hybridfp.integration.fsdp_primary import is_primary_shard
    from hybridfp.train.distributed import Parallel, shard_model

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    one = _quantized_moe_model()
    want = hf.MasterWeightOptimizer(torch.optim.AdamW, one.parameters(), lr=1e-3)
    model = _quantized_moe_model()
    shard_model(model, Parallel(rank=rank, world=world, device="cpu", fsdp=False, ep=2, ep_mesh=mesh),
                hf.MXFP8BlockScaling())
    got = hf.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    out = []
    for name, p in model.named_parameters():
        if ".expert_parallel.experts." in name:
            moe = model.get_submodule(name.split(".expert_parallel.")[0])
            fc, local = name.rsplit(".", 2)[-2], int(name.rsplit("weight", 1)[1])
            full = one.get_submodule(name.split(".expert_parallel.")[0] + "." + fc)
            w = getattr(full, f"weight{moe.expert_parallel.local_experts[local]}")
            master = got.master_of(p)
            out.append([name, isinstance(p, hf.QuantizedTensor),
                        master is not None and torch.equal(master, want.master_of(w))])
    # with --fsdp: each expert's parameter is its FP32 master, beside its quantized shard
    model = _quantized_moe_model()
    shard_model(model, Parallel(rank=rank, world=world, device="cpu", fsdp=True, ep=2, ep_mesh=mesh),
                hf.MXFP8BlockScaling())
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    out.append(["fsdp", len(experts) == 4 and all(is_primary_shard(p) for p in experts)])
    return out


def test_ep_keeps_each_experts_weight_quantized_with_its_one_process_master(tmp_path) -> None:
    """--ep moves each kept expert's quantized parameter (not a copy of its decoded value): it
    stays a QuantizedTensor, and its FP32 master is bitwise the one-process run's; with --fsdp
    each expert is a quantized primary weight (its parameter the FP32 master shard)."""
    for got in run_ranks(_ep_masters_worker, 2, (), tmp_path):
        assert got[-1] == ["fsdp", True]
        got = got[:-1]
        assert len(got) == 4 and all(quantized and same for _, quantized, same in got), got
