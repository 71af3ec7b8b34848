"""``hybridfp train --fsdp`` with delayed scaling: evaluating leaves training as it was, a
sharded checkpoint resumes bitwise at the same number of ranks, and weights held quantized
(``--quantized-weights``) train and resume bitwise as high-precision weights do.

Why bitwise: the compared runs are the same processes doing the same arithmetic in the same
order (2 gloo ranks, each on its rows of the same batches); only where a run evaluates or
stops and resumes differs. Evaluation restores every quantizer's state (the amax history and
scale) as it found it; a checkpoint holds the state every rank holds, its pending amaxes
(the output gradients' of the last backward, each rank's own until the next region end
reduces them) reduced over the ranks first. Weights held quantized are encoded once per step,
after the optimizer step, with the scale a high-precision weight is encoded with in the next
forward, so the training losses are the same (the validation losses are not: see
test_train_quantized_weights.py).
"""

from __future__ import annotations

import pytest

from torchrun_runs import records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

STEPS, SPLIT = 4, 2


def _run(text, out, *argv: str) -> None:
    torchrun(2, "--fsdp", "--preset", "test", "--recipe", "fp8-delayed", "--data", str(text), "--out", str(out),
             "--lr-decay-steps", str(STEPS), "--eval-iters", "2", "--no-progress", *argv)


def _train_losses(out) -> list:
    return [(r["step"], r.get("train_loss")) for r in records(out, "fp8-delayed")]


def _losses(out) -> list:
    """(step, train loss, val loss); none at the step a split run stopped at (the full run did not
    evaluate there)."""
    return [(r["step"], r.get("train_loss"), r.get("val_loss") if r["step"] != SPLIT else None)
            for r in records(out, "fp8-delayed")]


def _resumed(text, out, *flags: str) -> None:
    _run(text, out, "--steps", str(SPLIT), "--eval-interval", "1000", *flags)
    _run(text, out, "--resume", "--steps", str(STEPS), "--eval-interval", "1000")


@pytest.fixture(scope="module")
def full(tmp_path_factory, text):
    """The run evaluated only at its start and end."""
    out = tmp_path_factory.mktemp("full")
    _run(text, out, "--steps", str(STEPS), "--eval-interval", "1000")
    return out


def test_evaluation_leaves_delayed_scaling_training_unchanged(tmp_path, text, full) -> None:
    """Evaluated after every step: the training losses are bitwise those of the run evaluated
    at its start and end only (an evaluation under another amax reduction group than the
    training regions' would rebuild the quantizers and start them fresh)."""
    _run(text, tmp_path, "--steps", str(STEPS), "--eval-interval", "1")
    assert _train_losses(tmp_path) == _train_losses(full)


def test_sharded_delayed_scaling_resumes_bitwise(tmp_path, text, full) -> None:
    """SPLIT steps, a checkpoint, then the rest: every loss bitwise the uninterrupted run's."""
    _resumed(text, tmp_path)
    assert _losses(tmp_path) == _losses(full)


def test_sharded_quantized_weights_train_and_resume_as_high_precision_weights(tmp_path, text, full) -> None:
    """``--quantized-weights`` (FSDP2's quantized primary weights), stopped and resumed: the
    training losses are bitwise the high-precision run's, so the modules adopt the weights'
    delayed-scaling quantizers (updated at every region's end, saved with the module) and the
    resumed run re-encodes each shard with the saved scale."""
    _resumed(text, tmp_path, "--quantized-weights")
    assert _train_losses(tmp_path) == _train_losses(full)
