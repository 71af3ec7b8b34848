"""``hybridfp train --tp K`` on an MoE preset trains like one process.

The attention is tensor-parallel as in ``test_train_tp``; each MoE layer is replicated over the
tensor-parallel group: its input is the whole residual stream on every rank, each rank routes
every token and runs every expert on the full hidden size, as one process does. The only
difference from one process is then ``test_train_tp``'s: the attention's row-parallel output
projection sums its features in K FP32 partial GEMMs, all-reduced (bounds there). The router's
top-k choice could amplify that (a token whose two best experts' scores tie to the last bit
would switch experts); it did not here: BF16's losses differed by at most 4.5e-6 relative,
MXFP8's and FP8 delayed scaling's not at all, within the same bounds.
"""

from __future__ import annotations

import pytest

from hybridfp.train import cli
from test_train_tp import _assert_close
from torchrun_runs import COMMON, records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


def test_tensor_parallel_moe_trains_as_one_process(tmp_path, text) -> None:
    """``--preset test-moe`` (4 experts, top-2, load-balancing loss), 4 steps, each block's
    attention over 2 ranks and its MoE layer whole on both, BF16, MXFP8 and FP8 delayed
    scaling (the experts' amaxes reduced with the others'), and MXFP8 on a
    (dp=2, tp=2) mesh under ``--fsdp``: within the bounds of one process's losses."""
    run = ["--preset", "test-moe", "--lr-decay-steps", "4", "--steps", "4", "--data", str(text), *COMMON,
           "--compare", "bf16,mxfp8,fp8-delayed"]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *run]) == 0
    proc = torchrun(2, "--tp", "2", "--out", str(tmp_path / "tp"), *run)
    assert "tensor parallel over 2 ranks" in proc.stdout
    for recipe in ("bf16", "mxfp8", "fp8-delayed"):
        _assert_close(records(tmp_path / "tp", recipe), records(tmp_path / "one", recipe))
    # 4 ranks, (dp=2, tp=2) under FSDP2: the experts' gradients averaged over dp, the
    # load-balancing loss counting the dp ranks' rows (3.1e-5 relative seen)
    torchrun(4, "--tp", "2", "--fsdp", "--out", str(tmp_path / "fsdp"), *run[:-2], "--recipe", "mxfp8")
    _assert_close(records(tmp_path / "fsdp", "mxfp8"), records(tmp_path / "one", "mxfp8"))
