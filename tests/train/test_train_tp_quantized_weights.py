"""``hybridfp train --tp 2 --quantized-weights`` under torchrun (gloo, CPU).

Bitwise against ``--tp 2`` without quantized weights: each rank's quantized shard is encoded
once per step from its FP32 master shard with the amax the tensor-parallel layer reduces for a
high-precision shard, so every GEMM reads the same codes (FP8 current scaling, MXFP8 and a
hybrid: NVFP4 fprop, MXFP8 backward). Against one process with ``--quantized-weights``: the
bounds of test_train_tp.py (a row-parallel layer's FP32 partial sums add in another order).
The ``--quantized-weights`` run stops at step 2 and resumes from its checkpoint (the --tp
format: one process's row order) to step 4: its records equal the straight ``--tp`` run's bit
for bit, so the resume loses nothing either (3 launches instead of 4: each costs ~20 s here).
"""

from __future__ import annotations

import pytest

from hybridfp.train import cli
from test_train_tp import _assert_close
from torchrun_runs import COMMON, losses, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

HYBRID = "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"
RECIPES = ("fp8", "mxfp8", HYBRID)
RUN = ["--preset", "test", "--lr-decay-steps", "4", *COMMON]


def test_tp_quantized_weights_train_as_tp_and_resume(tmp_path, text) -> None:
    run = [*RUN, "--data", str(text), "--compare", ",".join(RECIPES)]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run, "--steps", "4", "--quantized-weights"]) == 0
    torchrun(2, "--tp", "2", "--out", str(tmp_path / "tp"), *run, "--steps", "4")
    qw = tmp_path / "qw"
    torchrun(2, "--tp", "2", "--out", str(qw), *run, "--steps", "2", "--quantized-weights")
    torchrun(2, "--tp", "2", "--resume", "--out", str(qw), "--steps", "4", "--no-progress")
    for recipe in RECIPES:
        got = losses(qw, recipe)
        assert [s for s, _, _ in got] == [0, 1, 2, 3, 4], (recipe, got)  # resumed after step 2
        assert got == losses(tmp_path / "tp", recipe), recipe
        _assert_close(records(qw, recipe), records(tmp_path / "one", recipe))
