"""``hybridfp train --tp 2 --quantized-weights`` under torchrun (gloo, CPU).

Bitwise against ``--tp 2`` without quantized weights: each rank's quantized shard is encoded
once per step from its FP32 master shard with the amax the tensor-parallel layer reduces for a
high-precision shard, so every GEMM reads the same codes (FP8 current scaling, MXFP8 and a
hybrid: NVFP4 fprop, MXFP8 backward). Against one process with ``--quantized-weights``: the
bounds of test_train_tp.py (a row-parallel layer's FP32 partial sums add in another order).
A run stopped at step 2 resumes from its checkpoint (the --tp format: one process's row order)
bit for bit.
"""

from __future__ import annotations

import pytest

from hybridfp.train import cli
from test_train_tp import _assert_close
from torchrun_runs import COMMON, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

HYBRID = "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"
RECIPES = ("fp8", "mxfp8", HYBRID)
RUN = ["--preset", "test", "--lr-decay-steps", "4", *COMMON]


def _losses(out, recipe: str) -> list[tuple]:
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in records(out, recipe)]


def test_tp_quantized_weights_train_as_tp_and_resume(tmp_path, text) -> None:
    run = [*RUN, "--data", str(text), "--compare", ",".join(RECIPES)]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run, "--steps", "4", "--quantized-weights"]) == 0
    torchrun(2, "--tp", "2", "--out", str(tmp_path / "tp"), *run, "--steps", "4")
    torchrun(2, "--tp", "2", "--out", str(tmp_path / "qw"), *run, "--steps", "4", "--quantized-weights")
    for recipe in RECIPES:
        got = _losses(tmp_path / "qw", recipe)
        assert got and got == _losses(tmp_path / "tp", recipe), recipe
        _assert_close(records(tmp_path / "qw", recipe), records(tmp_path / "one", recipe))
    split = tmp_path / "split"
    torchrun(2, "--tp", "2", "--out", str(split), *RUN, "--data", str(text), "--recipe", HYBRID, "--steps", "2",
             "--quantized-weights")
    torchrun(2, "--tp", "2", "--resume", "--out", str(split), "--steps", "4", "--no-progress")
    assert _losses(split, HYBRID) == _losses(tmp_path / "qw", HYBRID)


def test_tp_fsdp_quantized_weights_refused(tmp_path, text, capsys) -> None:
    base = ["train", "--out", str(tmp_path / "x"), "--data", str(text), "--no-progress", "--steps", "1"]
    assert cli.main([*base, "--tp", "2", "--fsdp", "--quantized-weights"]) == 2
    assert "--tp --fsdp --quantized-weights" in capsys.readouterr().err
