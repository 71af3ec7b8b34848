"""``hybridfp train --fsdp --quantized-weights`` under torchrun (gloo, CPU) trains like the
single-process ``--quantized-weights`` run, and resumes at another world size.

Why a bound and not bitwise: as in ``test_train_fsdp.py``, the global batch is split over the
ranks, so the weight gradients are the ranks' GEMM sums added by FSDP2's reduce-scatter (an
FP32 summation order other than one process's). Everything else is the single-process run's
arithmetic: each rank's quantized weight shard is the rows of the whole weight's quantization
of the same FP32 master (tested bitwise in tests/integration/test_fsdp2_primary_weights.py),
so the bounds are that test's: ``FIRST_RTOL`` before any update, ``LATER_RTOL`` after (at most
2.3e-4 relative seen over 4 steps).
"""

from __future__ import annotations

import pytest

from hybridfp.train import cli
from torchrun_runs import COMMON, records, torchrun
from test_train_fsdp import _assert_close, _without_val

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


def test_fsdp_quantized_weights_train_as_one_process_and_resume(tmp_path, text) -> None:
    """2 steps on 2 ranks (MXFP8 and FP8 delayed scaling weights held quantized), a
    torch.distributed.checkpoint of the FP32 master shards and AdamW's moments, 2 more steps of
    FP8 delayed scaling on 4 ranks (the quantized shards re-encoded from the loaded masters):
    within the bounds of 4 steps of one process."""
    run = ["--preset", "test", "--lr-decay-steps", "4", "--data", str(text), "--quantized-weights", *COMMON]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run, "--compare", "mxfp8,fp8-delayed",
                     "--steps", "4"]) == 0
    out = tmp_path / "sharded"
    torchrun(2, "--fsdp", "--out", str(out), *run, "--compare", "mxfp8,fp8-delayed", "--steps", "2")
    for recipe in ("mxfp8", "fp8-delayed"):
        want, got = records(tmp_path / "one", recipe)[:3], records(out, recipe)
        want[2], got[2] = _without_val(want[2]), _without_val(got[2])  # step 2 ends the first part
        _assert_close(got, want)
    # 16 rows per rank at 4 ranks: less than an MXFP8 block, so only the FP8 run goes on there
    proc = torchrun(4, "--fsdp", "--resume", "--recipe", "fp8-delayed", "--out", str(out), "--steps", "4",
                    "--no-progress")
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    want, got = records(tmp_path / "one", "fp8-delayed"), records(out, "fp8-delayed")
    want[2], got[2] = _without_val(want[2]), _without_val(got[2])
    _assert_close(got, want)
