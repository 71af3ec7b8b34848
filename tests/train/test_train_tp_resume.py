"""A ``hybridfp train --tp K`` checkpoint holds the single-process layout, so it resumes.

Each rank computes with the q/k/v (and SwiGLU gate/up) rows of its own heads grouped together;
the sharded checkpoint stores those weights, and their AdamW moments, in one process's row
order. Resumed at the same ``--tp`` and world size the run continues with the same arithmetic
in the same order: its losses equal a straight run's bitwise. Resumed under ``--fsdp`` alone,
and that run's checkpoint under ``--tp`` again, the losses stay within ``test_train_tp``'s
bounds of one process (another FP32 summation order, see there) over 6 steps.
"""

from __future__ import annotations

import shutil

import pytest

from hybridfp.train import cli
from test_train_tp import _assert_close
from torchrun_runs import COMMON, losses, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

RECIPES = ("bf16", "mxfp8", "fp8-delayed")


def test_tensor_parallel_run_resumes_bitwise_and_across_layouts(tmp_path, text) -> None:
    """2 steps + resume for 2 more equals 4 straight steps checkpointed after each (``--tp 2``, 2 ranks, BF16, MXFP8
    and FP8 delayed scaling, whose gradient amaxes of the last backward are reduced over the
    ranks before the checkpoint is written), and the straight run trains as one process; the
    2-step ``--tp`` checkpoint resumes under ``--fsdp`` alone, and that run's
    checkpoint (written by FSDP2) under ``--tp 2`` again, as one process trains."""
    run = ["--preset", "test", "--lr-decay-steps", "4", "--data", str(text), *COMMON,
           "--compare", ",".join(RECIPES)]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run, "--steps", "6"]) == 0
    # a checkpoint every step: writing one leaves the live optimizer state as it was
    torchrun(2, "--tp", "2", "--out", str(tmp_path / "straight"), *run, "--steps", "4", "--checkpoint-interval", "1")
    torchrun(2, "--tp", "2", "--out", str(tmp_path / "tp"), *run, "--steps", "2")
    shutil.copytree(tmp_path / "tp", tmp_path / "cross")
    resume = ["--resume", "--no-progress", "--steps"]
    torchrun(2, "--tp", "2", "--out", str(tmp_path / "tp"), *resume, "4")
    for recipe in RECIPES:
        assert losses(tmp_path / "tp", recipe) == losses(tmp_path / "straight", recipe), recipe
        _assert_close(records(tmp_path / "straight", recipe), records(tmp_path / "one", recipe)[:5])
    torchrun(2, "--fsdp", "--out", str(tmp_path / "cross"), *resume, "4")  # --tp -> --fsdp
    torchrun(2, "--tp", "2", "--out", str(tmp_path / "cross"), *resume, "6")  # --fsdp -> --tp
    for recipe in RECIPES:
        _assert_close(records(tmp_path / "cross", recipe), records(tmp_path / "one", recipe))
