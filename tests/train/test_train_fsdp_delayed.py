"""``hybridfp train --fsdp`` with delayed scaling: evaluating leaves training as it was.

Why bitwise: the compared runs are the same processes doing the same arithmetic in the same
order (2 gloo ranks, each on its rows of the same batches); only how often a run evaluates
differs. Evaluation restores every quantizer's state (the amax history and scale) as it
found it.
"""

from __future__ import annotations

import pytest

from torchrun_runs import records, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

STEPS = 4


def _run(text, out, *argv: str) -> None:
    torchrun(2, "--fsdp", "--preset", "test", "--recipe", "fp8-delayed", "--data", str(text), "--out", str(out),
             "--lr-decay-steps", str(STEPS), "--eval-iters", "2", "--no-progress", *argv)


def _train_losses(out) -> list:
    return [(r["step"], r.get("train_loss")) for r in records(out, "fp8-delayed")]


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


def test_sharded_quantized_weights_train_as_high_precision_weights(tmp_path, text, full) -> None:
    """``--quantized-weights`` (FSDP2's quantized primary weights, encoded once per step after
    the optimizer step with the scale a high-precision weight is encoded with in the next
    forward): the training losses are bitwise the high-precision run's, so the modules adopt
    the weights' delayed-scaling quantizers and update them at every region's end (the
    validation losses differ: see test_train_quantized_weights.py)."""
    _run(text, tmp_path, "--steps", str(STEPS), "--eval-interval", "1000", "--quantized-weights")
    assert _train_losses(tmp_path) == _train_losses(full)
