"""``hybridfp train --tp K`` under torchrun (gloo, CPU) trains like one process.

Why a bound and not bitwise: a row-parallel layer (both ``proj``) sums its input features in K
FP32 partial GEMMs, all-reduced, where one process runs one GEMM over every feature: another
FP32 summation order, rounded to the BF16 activations after it. MXFP8's emulated GEMM happens
to give the same sums here (its losses came out equal), BF16's do not:

- before any update (step 0's validation loss, step 1's training loss) only those output
  roundings differ: a few 1e-7 of the loss were seen, bound ``FIRST_RTOL`` (2e-5);
- after updates the weights differ by the gradients' roundings (and, over dp ranks, the
  order the all-reduce adds their sums), which AdamW passes on at up to the learning rate for
  elements whose gradient is near zero; over 4 steps the losses stayed within 2.1e-5
  relative on 2 and 4 ranks (with and without FSDP2): bound ``LATER_RTOL`` (2e-4, ~10x that).

What each bound catches (seen by breaking the code): q/k/v rows not grouped per rank (rank 0
running q and half of k as its heads) moves step 0's validation loss by 8e-4 relative (40x
``FIRST_RTOL``); gradients not averaged over the dp ranks (each pair training on its half of
the batch) move step 2's training loss by 1.1e-3 (5x ``LATER_RTOL``).
"""

from __future__ import annotations

import pytest

from hybridfp.train import cli
from hybridfp.train.distributed import Parallel, check_batch
from torchrun_runs import COMMON, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

FIRST_RTOL = 2e-5
LATER_RTOL = 2e-4


def _assert_close(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]  # each step logged once (rank 0)
    for g, w in zip(got, want):
        for key in ("train_loss", "val_loss"):
            assert (key in g) == (key in w), (g, w)
            if key in w:
                first = g["step"] == 0 or (g["step"] == 1 and key == "train_loss")  # before any update
                tol = FIRST_RTOL if first else LATER_RTOL
                assert abs(g[key] - w[key]) <= tol * abs(w[key]), (key, g, w)


def test_tensor_parallel_trains_as_one_process(tmp_path, text, capsys) -> None:
    """4 steps of the test preset (2 heads, SwiGLU MLP, gradient clipping) with each block's
    linears over 2 ranks, BF16 and MXFP8: within the bounds of one process's losses. Its
    sharded checkpoint resumes under torchrun (test_train_tp_resume.py), not in one process."""
    run = ["--preset", "test", "--lr-decay-steps", "4", "--steps", "4", "--data", str(text), *COMMON,
           "--compare", "bf16,mxfp8"]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run]) == 0
    out = tmp_path / "tp"
    proc = torchrun(2, "--tp", "2", "--out", str(out), *run)
    assert proc.stdout.count("done in") == 1  # rank 0 logs, the other rank does not
    assert "2 x cpu (1 threads) (tensor parallel over 2 ranks)" in (out / "summary.md").read_text()
    for recipe in ("bf16", "mxfp8"):
        _assert_close(records(out, recipe), records(tmp_path / "one", recipe))
    resume = ["train", "--resume", "--out", str(out), "--steps", "6", "--no-progress"]
    assert cli.main(resume) == 2  # a sharded checkpoint: not by one process
    assert "written by a sharded run" in capsys.readouterr().err


def test_tensor_parallel_with_data_parallel_trains_as_one_process(tmp_path, text) -> None:
    """4 ranks, a (dp=2, tp=2) mesh: each tensor-parallel pair reads its half of the batch and
    the gradients are averaged over the 2 dp ranks, by the trainer (BF16) or by FSDP2 sharding
    the tensor-parallel weights over dp (``--fsdp``, MXFP8): within the bounds of one process."""
    run = ["--preset", "test", "--lr-decay-steps", "4", "--steps", "4", "--data", str(text), *COMMON]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run, "--compare", "bf16,mxfp8"]) == 0
    torchrun(4, "--tp", "2", "--out", str(tmp_path / "tp"), *run, "--recipe", "bf16")
    _assert_close(records(tmp_path / "tp", "bf16"), records(tmp_path / "one", "bf16"))
    proc = torchrun(4, "--tp", "2", "--fsdp", "--out", str(tmp_path / "fsdp"), *run, "--recipe", "mxfp8")
    assert "(FSDP2, tensor parallel over 2 ranks)" in proc.stdout
    _assert_close(records(tmp_path / "fsdp", "mxfp8"), records(tmp_path / "one", "mxfp8"))


def test_tensor_parallel_refuses_what_it_cannot_do(tmp_path, text, monkeypatch, capsys) -> None:
    base = ["train", "--out", str(tmp_path / "x"), "--data", str(text), "--no-progress", "--steps", "1"]
    assert cli.main([*base, "--tp", "2", "--jobs", "2", "--compare", "bf16,fp8"]) == 2
    assert "--jobs with --tp" in capsys.readouterr().err
    assert cli.main([*base, "--tp", "0"]) == 2
    assert "--tp must be at least 1" in capsys.readouterr().err
    assert cli.main([*base, "--tp", "2"]) == 2  # not under torchrun
    assert "start it with torchrun" in capsys.readouterr().err
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    for extra, message in ((["--preset", "test", "--tp", "4"], "--tp 4 does not divide the preset's 2 attention heads"),
                           (["--preset", "test", "--tp", "3"], "--tp 3 does not divide the 4 ranks"),
                           (["--preset", "test-moe", "--tp", "2", "--ep", "2"], "--tp with --ep")):
        assert cli.main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    with pytest.raises(ValueError, match="must be a multiple of the 2 data-parallel ranks"):
        check_batch(7, Parallel(rank=0, world=4, device="cpu", fsdp=False, tp=2))


def test_tensor_parallel_ranks_share_rows() -> None:
    """(dp=2, tp=2): ranks 0, 1 read the first half of the batch, ranks 2, 3 the second."""
    parts = [Parallel(rank=r, world=4, device="cpu", fsdp=False, tp=2).rows(16) for r in range(4)]
    assert [(s.start, s.stop) for s in parts] == [(0, 8), (0, 8), (8, 16), (8, 16)]


def test_tensor_parallel_passes_no_amax_reduction_group() -> None:
    """The tensor-parallel layers refuse ``autocast(amax_reduction_group=...)``: under --tp a
    delayed-scaling run reduces its amaxes itself (test_train_tp_delayed.py)."""
    import torch

    import hybridfp as hf
    from hybridfp.train.loop import amax_group

    model = torch.nn.Sequential(hf.Linear(32, 32))
    par = Parallel(rank=0, world=2, device="cpu", fsdp=False, tp=2)
    assert amax_group(model, hf.DelayedScaling(), par) is None
    assert amax_group(model, hf.MXFP8BlockScaling(), par) is None


def test_group_rows_puts_each_ranks_heads_together() -> None:
    import torch

    from hybridfp.train.tensor_parallel import group_rows

    w = torch.arange(12.0).view(12, 1)  # [q0 q1 | k0 k1 | v0 v1], 2 rows each
    assert group_rows(w, 3, 2).flatten().tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
