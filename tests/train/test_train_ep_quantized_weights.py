"""``hybridfp train --ep K --quantized-weights`` under torchrun (gloo, CPU): each rank holds its
experts' weights quantized (FP32 masters in ``MasterWeightOptimizer``) and trains like the
single-process ``--quantized-weights`` run; a resumed run (same world size) continues bit for bit.

Why a bound against one process and not bitwise: as in ``test_train_fsdp.py``, the global batch
is split over the ranks, so the gradients are the ranks' GEMM sums added by an all-reduce (an
FP32 summation order other than one process's). The bounds are that test's. The resume is
bitwise: the same ranks run the same arithmetic in the same order, from the masters, AdamW's
moments and quantizer states the checkpoint holds.
"""

from __future__ import annotations

import pytest

from torchrun_runs import COMMON, records, torchrun
from test_train_fsdp import _assert_close, _single

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

KEYS = ("train_loss", "val_loss", "aux_loss")


def test_ep_quantized_weights_train_as_one_process_and_resume_bitwise(tmp_path, text) -> None:
    """The MoE preset's 4 experts (MXFP8 weights held quantized) over expert-parallel groups of
    2 ranks: 4 steps within the bounds of one process; 2 steps, a sharded checkpoint (the
    experts' FP32 masters under their global names) and 2 more resumed give the 4-step run's
    records exactly."""
    run = ["--preset", "test-moe", "--lr-decay-steps", "4", "--data", str(text), "--recipe", "mxfp8",
           "--quantized-weights", *COMMON]
    _single(tmp_path / "one", *run, "--steps", "4")
    full, split = tmp_path / "full", tmp_path / "split"
    torchrun(2, "--ep", "2", "--steps", "4", "--out", str(full), *run)
    _assert_close(records(full, "mxfp8"), records(tmp_path / "one", "mxfp8"), KEYS)
    torchrun(2, "--ep", "2", "--steps", "2", "--out", str(split), *run)
    proc = torchrun(2, "--ep", "2", "--resume", "--steps", "4", "--out", str(split), *run)
    assert "at step 2" in proc.stdout
    want, got = records(full, "mxfp8"), records(split, "mxfp8")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert {k: g.get(k) for k in KEYS} == {k: w.get(k) for k in KEYS}, (g, w)
