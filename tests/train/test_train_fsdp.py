"""``hybridfp train --fsdp [--ep K]`` under torchrun (gloo, CPU) trains like one process.

Why a bound and not bitwise: the global batch is split over the ranks, so each rank's
weight-gradient GEMMs sum its own rows and FSDP2's reduce-scatter adds the ranks' sums: an FP32
summation order other than one process's single GEMM over every row. The forward of a row is
the same arithmetic on either side (same weights; MXFP8 scales its blocks along a row), so:

- before any update (step 0's validation loss, step 1's training loss) the logged losses differ
  only in the mean of the ranks' means against one mean over every row: a few FP32 ulps of
  the loss (bound ``FIRST_RTOL``, 30x the 1e-7 seen);
- after updates the weights differ by those gradient roundings, which AdamW (a per-element
  division by the gradient's RMS) passes on at up to the learning rate for elements whose
  gradient is near zero; over a handful of steps the losses then stay within ``LATER_RTOL``
  (2e-3 relative; at most 6e-4 seen over 6 steps), far below what a wrong split of the batch,
  a lost gradient average or a stale shard makes (a step moves the loss by more than 0.1 here:
  a rank training on the other rank's rows gives another loss at step 1 already).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridfp.train import cli
from hybridfp.train.distributed import Parallel, check_batch
from torchrun_runs import COMMON, records, torchrun
from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

FIRST_RTOL = 3e-6
LATER_RTOL = 2e-3


def _assert_close(got: list[dict], want: list[dict], keys: tuple[str, ...] = ("train_loss", "val_loss")) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]  # each step logged once (rank 0)
    for g, w in zip(got, want):
        for key in keys:
            assert (key in g) == (key in w), (g, w)
            if key in w:
                first = g["step"] == 0 or (g["step"] == 1 and key == "train_loss")  # before any update
                tol = FIRST_RTOL if first else LATER_RTOL
                assert abs(g[key] - w[key]) <= tol * abs(w[key]), (key, g, w)


def _single(out: Path, *argv: str) -> None:
    assert cli.main(["train", "--out", str(out), *argv]) == 0


def _without_val(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "val_loss"}


def test_fsdp_trains_as_one_process_and_resumes_at_another_world_size(tmp_path, text) -> None:
    """3 steps on 2 ranks (blocks recomputed: both copies gathered), a torch.distributed.checkpoint,
    3 more on 4 ranks (DCP reshards the weights, AdamW's moments and delayed scaling's amax
    history): within the bounds of 6 steps of one process."""
    run = ["--preset", "test", "--lr-decay-steps", "6", "--data", str(text), *COMMON]
    _single(tmp_path / "one", *run, "--compare", "mxfp8,fp8-delayed", "--steps", "6")
    out = tmp_path / "sharded"
    proc = torchrun(2, "--fsdp", "--recompute", "--out", str(out), *run, "--compare", "mxfp8,fp8-delayed",
                     "--steps", "3")
    assert proc.stdout.count("done in") == 1  # rank 0 logs, the other rank does not
    assert "2 x cpu" in (out / "summary.md").read_text()
    for recipe in ("mxfp8", "fp8-delayed"):
        want, got = records(tmp_path / "one", recipe)[:4], records(out, recipe)
        want[3], got[3] = _without_val(want[3]), _without_val(got[3])  # step 3 ends the first part
        _assert_close(got, want)
        assert (out / "checkpoints" / f"{recipe}.dcp" / "train_state.json").is_file()
        assert not (out / "checkpoints" / f"{recipe}.pt").exists()  # the single-process format
    # a single process does not resume a sharded checkpoint: it says how to
    assert cli.main(["train", "--resume", "--out", str(out), "--steps", "6", "--no-progress"]) == 2
    # 16 rows per rank at 4 ranks: less than an MXFP8 block, so only the FP8 run goes on there
    proc = torchrun(4, "--fsdp", "--resume", "--recipe", "fp8-delayed", "--out", str(out), "--steps", "6",
                     "--no-progress")
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    want, got = records(tmp_path / "one", "fp8-delayed"), records(out, "fp8-delayed")
    want[3], got[3] = _without_val(want[3]), _without_val(got[3])
    _assert_close(got, want)


def test_expert_parallel_trains_as_one_process_and_resumes(tmp_path, text) -> None:
    """The MoE preset's 4 experts over expert-parallel groups of 2 ranks: 2 steps of --ep alone
    on 2 ranks (BF16 and MXFP8 experts), then BF16 resumed for 2 more under FSDP2 over a (dp=2,
    ep=2) mesh on 4 ranks (the experts sharded over their 2 replicas; the checkpoint names each
    expert globally, so DCP hands every rank its own). The load-balancing loss counts every
    rank's routed rows, so it too is one process's (within the bounds)."""
    run = ["--preset", "test-moe", "--lr-decay-steps", "4", "--data", str(text), *COMMON]
    _single(tmp_path / "one", *run, "--compare", "bf16,mxfp8", "--steps", "4")
    out, keys = tmp_path / "ep", ("train_loss", "val_loss", "aux_loss")
    torchrun(2, "--ep", "2", "--compare", "bf16,mxfp8", "--steps", "2", "--out", str(out), *run)
    for recipe in ("bf16", "mxfp8"):
        _assert_close(records(out, recipe), records(tmp_path / "one", recipe)[:3], keys)
    proc = torchrun(4, "--fsdp", "--ep", "2", "--resume", "--recipe", "bf16", "--steps", "4", "--out", str(out),
                     "--no-progress")
    assert "at step 2" in proc.stdout
    _assert_close(records(out, "bf16"), records(tmp_path / "one", "bf16"), keys)


def test_sharded_runs_refuse_what_they_cannot_do(tmp_path, text, monkeypatch, capsys) -> None:
    base = ["train", "--out", str(tmp_path / "x"), "--data", str(text), "--no-progress", "--steps", "1"]
    assert cli.main([*base, "--fsdp"]) == 2  # not under torchrun
    assert "start it with torchrun" in capsys.readouterr().err
    assert cli.main([*base, "--fsdp", "--jobs", "2", "--compare", "bf16,fp8"]) == 2
    assert "--jobs with --fsdp" in capsys.readouterr().err
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert cli.main([*base, "--preset", "test-moe", "--ep", "3"]) == 2
    assert "does not divide the preset's 4 experts" in capsys.readouterr().err
    assert cli.main([*base, "--preset", "test", "--ep", "3"]) == 2
    assert "the preset is dense" in capsys.readouterr().err
    assert cli.main([*base, "--preset", "test-moe", "--ep", "2"]) == 2
    assert "--ep 2 does not divide the 3 ranks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--batch-size 8 is the global batch: it must be a multiple of the 3"):
        check_batch(8, Parallel(rank=0, world=3, device="cpu", fsdp=True))


def test_each_rank_reads_its_rows_of_the_global_batch() -> None:
    parts = [Parallel(rank=r, world=4, device="cpu", fsdp=True).rows(16) for r in range(4)]
    assert [(s.start, s.stop) for s in parts] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_expert_parallel_refuses_delayed_scaling() -> None:
    """Delayed scaling all-reduces every quantizer's amax at a region's end, in module order:
    under --ep the ranks hold other experts at the same places, so it is refused; a
    stateless recipe reduces nothing (each expert quantizes with its own amax)."""
    import hybridfp as hf
    from hybridfp.train.loop import amax_group

    model = torch.nn.Sequential(hf.Linear(32, 32))
    ep = Parallel(rank=0, world=2, device="cpu", fsdp=False, ep=2)
    with pytest.raises(ValueError, match="--ep with recipe .*delayed-scaling amaxes"):
        amax_group(model, hf.DelayedScaling(), ep)
    assert amax_group(model, hf.MXFP8BlockScaling(), ep) is None


def _moe_model():
    from hybridfp.train.model import GPT, GPTConfig

    torch.manual_seed(0)  # wide enough for whole MXFP8 blocks of rows on each of 4 ranks
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=128, mlp_hidden=128, block_size=32, n_experts=4,
                         top_k=2, moe_hidden=64))


def _moe_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g)


def _gradient_norms(model) -> dict:
    """Each parameter's gradient norm, experts under their global names (mlp.fc1.weight<e>)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if ".expert_parallel.experts." in name:
            moe = model.get_submodule(name.split(".expert_parallel.")[0])
            local = int(name.rsplit("weight", 1)[1])
            name = name.replace("expert_parallel.experts.", "").rsplit("weight", 1)[0] + \
                f"weight{moe.expert_parallel.local_experts[local]}"
        out[name] = g.float().norm().item()
    return out


def _ep_gradients_worker(rank: int, world: int) -> dict:
    """One step's gradients of the MoE GPT spread over 4 ranks, (dp=2, ep=2), with and without
    FSDP2, each rank on its rows of one global batch."""
    import hybridfp as hf
    from torch.distributed.device_mesh import init_device_mesh
    from hybridfp.train.distributed import shard_model, sync_gradients

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    x, y = _moe_batch()
    out = {}
    for fsdp in (True, False):
        par = Parallel(rank=rank, world=world, device="cpu", fsdp=fsdp, ep=2, ep_mesh=mesh)
        model = _moe_model()
        shard_model(model, par, hf.MXFP8BlockScaling())
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            _, loss = model(x[par.rows(8)], y[par.rows(8)])
        loss.backward()
        sync_gradients(model, par)
        out["fsdp" if fsdp else "ep"] = _gradient_norms(model)
    return out


def test_expert_parallel_gradients_are_one_process(tmp_path) -> None:
    """The gradients a sharded step leaves (FSDP2's reduce-scatter over a (dp=2, ep=2) mesh, or
    --ep's own all-reduces) are one process's on the global batch: the replicated weights'
    averaged over the 4 ranks, each expert's summed over its 2 replicas and divided by 4 (an
    expert's gradient already sums its ep group's 2 losses). Within 1e-3 of each parameter's
    gradient norm (other FP32 summation orders; an expert off by its group's size is 2x)."""
    import hybridfp as hf

    model = _moe_model()
    x, y = _moe_batch()
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        _, loss = model(x, y)
    loss.backward()
    want = _gradient_norms(model)
    for got in run_ranks(_ep_gradients_worker, 4, (), tmp_path):
        for mode in ("fsdp", "ep"):
            assert got[mode].keys() >= {k for k in want if ".fc" not in k}, mode
            for name, norm in got[mode].items():
                assert abs(norm - want[name]) <= 1e-3 * want[name], (mode, name, norm, want[name])
