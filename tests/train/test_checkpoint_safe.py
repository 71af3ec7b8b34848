"""Training checkpoints are tensors and plain data: ``--resume`` loads them with
``torch.load(weights_only=True)``, refuses anything else (a crafted pickle runs nothing) and
refuses a checkpoint that does not belong to the run, with one line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hybridfp.train import cli

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


def _run(text, out, *extra, preset="test"):
    """``hybridfp train`` at the smallest size; returns its exit status."""
    return cli.main(["train", "--preset", preset, "--data", str(text), "--out", str(out), "--no-progress",
                     "--seq-len", "16", "--batch-size", "2", "--eval-iters", "1", "--eval-interval", "2",
                     *extra])


def _one_error_line(capsys) -> str:
    """The stderr of a failed command: exactly one ``hybridfp train: error:`` line."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridfp train: error: "), lines
    return lines[0]


def _records(out, label):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["recipe"] == label]


class _RunsAShellCommand:
    """Unpickling this runs ``os.system(command)`` (what a crafted checkpoint can do)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_checkpoint_is_tensors_and_plain_data(tmp_path, text):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "fp8-delayed", "--steps", "2") == 0
    ck = torch.load(out / "checkpoints" / "fp8-delayed.pt", weights_only=True)
    assert ck["step"] == 2 and ck["recipe"] == "fp8-delayed"
    assert ck["config"]["preset"] == "test" and isinstance(ck["config"]["model"], dict)
    assert isinstance(ck["rng"]["cpu"], torch.Tensor) and "quantizers" not in ck


def test_crafted_checkpoint_runs_nothing_and_is_refused(tmp_path, text, capsys):
    out, marker = tmp_path / "run", tmp_path / "marker"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    ckpt = out / "checkpoints" / "bf16.pt"
    torch.save({"step": _RunsAShellCommand(f"touch {marker}")}, ckpt)
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "2") == 2
    line = _one_error_line(capsys)
    assert str(ckpt) in line and "tensors and plain data" in line
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not-a-dict"])
def test_damaged_checkpoint_is_one_line(tmp_path, text, capsys, damage):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    ckpt = out / "checkpoints" / "bf16.pt"
    if damage == "garbage":
        ckpt.write_bytes(b"this is not a checkpoint")
    elif damage == "truncated":
        ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    else:
        torch.save([1, 2, 3], ckpt)
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "2") == 2
    assert str(ckpt) in _one_error_line(capsys)
    assert [r["step"] for r in _records(out, "bf16")] == [0, 1]  # nothing restarted or rewritten


def test_checkpoint_of_another_preset_is_refused(tmp_path, text, capsys):
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    assert _run(text, dense, "--recipe", "bf16", "--steps", "1") == 0
    assert _run(text, moe, "--recipe", "bf16", "--steps", "1", preset="test-moe") == 0
    shutil.copy(dense / "checkpoints" / "bf16.pt", moe / "checkpoints" / "bf16.pt")
    capsys.readouterr()
    assert _run(text, moe, "--resume", "--steps", "2", preset="test-moe") == 2  # the run's own preset: no note
    line = _one_error_line(capsys)
    assert "preset" in line and "'test'" in line and "'test-moe'" in line


def test_checkpoint_of_another_recipe_is_refused(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert _run(text, out, "--compare", "bf16,fp8", "--steps", "1") == 0
    shutil.copy(out / "checkpoints" / "bf16.pt", out / "checkpoints" / "fp8.pt")
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "2") == 2
    line = _one_error_line(capsys)
    assert "'bf16'" in line and "'fp8'" in line


def test_missing_checkpoint_is_not_a_silent_restart(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert _run(text, out, "--compare", "bf16,fp8", "--steps", "2") == 0
    (out / "checkpoints" / "fp8.pt").unlink()
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "3") == 2
    line = _one_error_line(capsys)
    assert "'fp8'" in line and "fp8.pt" in line and "step 2" in line
    assert (out / "metrics.jsonl").read_text() == before  # checked before any recipe trains


def test_resume_without_any_checkpoint_or_metrics_starts_the_recipe(tmp_path, text, capsys):
    """A recipe added to a run (no checkpoint, no metrics) starts at step 0: nothing is lost."""
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    assert _run(text, out, "--resume", "--compare", "bf16,fp8", "--steps", "2") == 0
    assert [r["step"] for r in _records(out, "fp8")] == [0, 1, 2]
    assert [r["step"] for r in _records(out, "bf16")] == [0, 1, 2]


def test_delayed_scaling_resume_is_bitwise(tmp_path, text):
    """The amax history and scale of delayed scaling travel in the model's state_dict."""
    full, split = tmp_path / "full", tmp_path / "split"
    assert _run(text, full, "--recipe", "fp8-delayed", "--steps", "6") == 0
    assert _run(text, split, "--recipe", "fp8-delayed", "--steps", "4", "--lr-decay-steps", "6") == 0
    assert _run(text, split, "--resume", "--steps", "6") == 0
    strip = lambda recs: [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in recs]
    assert strip(_records(split, "fp8-delayed")) == strip(_records(full, "fp8-delayed"))
