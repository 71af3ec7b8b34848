"""``hybridfp train --fsdp`` reduces the weights' per-tensor amaxes once per step.

With a recipe whose weights have a per-tensor scale (``fp8``: FP8 current scaling) the loop
calls ``hybridfp.precompute_weight_amax`` after every optimizer step, so each step's quantized
gathers reduce no amax of their own (bitwise the same amax: tests/integration/
test_fsdp2_precompute_amax.py). A call in the wrong place (before the step) would make the
next gather raise and the run fail; block-scaled recipes (``mxfp8``) have nothing to reduce.

Why a loose bound against one process: besides the split batch of test_train_fsdp.py, FP8
current scaling's activation and gradient scales come from each rank's own rows (one process
takes one amax over the whole batch), so the ranks quantize the activations with other scales;
``RTOL`` (2e-2 relative) bounds that, far below a diverged or stalled run.
"""

from __future__ import annotations

import math

import pytest

from hybridfp.train import cli
from torchrun_runs import COMMON, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

RTOL = 2e-2


def test_fsdp_precomputes_weight_amax_after_each_step(tmp_path, text) -> None:
    run = ["--preset", "test", "--lr-decay-steps", "3", "--data", str(text), *COMMON, "--steps", "3"]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run, "--recipe", "fp8"]) == 0
    out = tmp_path / "sharded"
    proc = torchrun(2, "--fsdp", "--out", str(out), *run, "--compare", "fp8,mxfp8")
    logged = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "amaxes reduced" in line]
    assert len(logged) == 1 and "[fp8]" in logged[0] and "reduced once per step, one all-reduce per shard group" in logged[0], logged
    want, got = records(tmp_path / "one", "fp8"), records(out, "fp8")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key in ("train_loss", "val_loss"):
            if key in w:
                assert math.isfinite(g[key]) and abs(g[key] - w[key]) <= RTOL * abs(w[key]), (key, g, w)
