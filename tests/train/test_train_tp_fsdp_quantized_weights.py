"""``hybridfp train --tp 2 --fsdp --quantized-weights`` under torchrun (4 gloo ranks, CPU).

A (dp=2, tp=2) mesh: each tensor-parallel weight's FP32 master shard is sharded again by FSDP2
over dp; each rank keeps its piece's quantized copies, encoded once a step with the whole
weight's amax (over dp, then tp), and the all-gathers send those codes. Against ``--tp 2
--quantized-weights`` on the same 4 ranks (the same global batch): every GEMM reads the same
codes (FP8 current scaling, MXFP8 and a hybrid: NVFP4 fprop, MXFP8 backward), so the records
before any update (step 0's validation loss, step 1's training loss) are bitwise the same; after
it, the clipping norm is summed from other pieces (FSDP2's dp shards of each tp shard), which
moves the clipping factor by an ulp, so the later records are held to the bounds of
test_train_tp.py (bitwise training on the same batch, without clipping:
tests/integration/test_fsdp2_tensor_parallel_primary.py). The 2-D run stops at step 2 and resumes from its checkpoint
(the --tp format: one process's row order) to step 4; its records equal a straight 2-D run's
bit for bit, so the resume loses nothing.
"""

from __future__ import annotations

import pytest

from hybridfp.train.distributed import check_parallel_args
from test_train_tp import _assert_close
from torchrun_runs import COMMON, losses, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

HYBRID = "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"
RECIPES = ("fp8", "mxfp8", HYBRID)
RUN = ["--preset", "test", "--lr-decay-steps", "4", *COMMON]


def test_tp_fsdp_quantized_weights_train_as_tp_and_resume(tmp_path, text) -> None:
    run = [*RUN, "--data", str(text), "--compare", ",".join(RECIPES)]
    torchrun(4, "--tp", "2", "--out", str(tmp_path / "tp"), *run, "--steps", "4", "--quantized-weights")
    torchrun(4, "--tp", "2", "--fsdp", "--out", str(tmp_path / "straight"), *run, "--steps", "4",
             "--quantized-weights")
    two_d = tmp_path / "two_d"
    torchrun(4, "--tp", "2", "--fsdp", "--out", str(two_d), *run, "--steps", "2", "--quantized-weights")
    torchrun(4, "--tp", "2", "--fsdp", "--resume", "--out", str(two_d), "--steps", "4", "--no-progress")
    for recipe in RECIPES:
        got = losses(two_d, recipe)
        assert [s for s, _, _ in got] == [0, 1, 2, 3, 4], (recipe, got)  # resumed after step 2
        assert got == losses(tmp_path / "straight", recipe), recipe
        tp = losses(tmp_path / "tp", recipe)
        assert got[:2] == tp[:2], (recipe, got, tp)  # before any update: the same codes, the same GEMMs
        _assert_close(records(two_d, recipe), records(tmp_path / "tp", recipe))


def test_tp_fsdp_quantized_weights_accepted() -> None:
    """The option check takes the combination; what stays refused is refused by name."""
    check_parallel_args(True, 1, True, 1, tp=2)
    with pytest.raises(ValueError, match="--jobs with --tp"):
        check_parallel_args(True, 1, True, 2, tp=2)
