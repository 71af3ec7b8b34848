"""bench_train_step: the train command's step with the fused SwiGLU paired against the eager one.
CPU smoke runs (``common.DEVICE = "cpu"``, the ``test`` / ``test-moe`` presets); off CUDA
``hybridfp.swiglu`` runs the eager ops, so both models' first steps agree bit for bit."""

from __future__ import annotations

import json

import pytest

from bench import bench_train_step as bts, common

FAST = ["--quick", "--rounds", "2", "--samples", "1"]


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")


def test_quick_run_writes_every_row_with_its_paired_ratio(cpu, tmp_path):
    out = tmp_path / "train_step.json"
    bts.main(FAST + ["--out", str(out)])
    result = json.loads(out.read_text())
    assert result["name"] == "train_step" and result["failures"] == []
    assert result["protocol"]["rounds"] == 2 and not result["protocol"]["reportable"]
    rows = {(r["preset"], r["recipe"]): r for r in result["rows"]}
    assert set(rows) == {(p, r) for p in bts.QUICK_PRESETS for r in bts.RECIPE_NAMES}
    for row in rows.values():
        p = row["fused_vs_eager"]
        assert len(p["rounds"]) == 2 and p["low"] <= p["ratio"] <= p["high"]
        assert row["ms_eager"] == p["baseline_ms"] and row["ms_fused"] == p["candidate_ms"]
        assert row["tokens_per_step"] == 8 * 64
        assert row["tokens_per_s_fused"] == pytest.approx(512 / row["ms_fused"] * 1e3)
        assert row["loss_rel_diff"] == 0.0 and row["grad_norm_rel_diff"] == 0.0  # eager ops on both sides
    assert "| test-moe | mxfp8 | 512 |" in result["markdown"]


def test_presets_and_recipes_pick_the_rows_and_unknown_names_are_refused(cpu, tmp_path, capsys):
    out = tmp_path / "one.json"
    bts.main(FAST + ["--presets", "test", "--recipes", "fp8", "--out", str(out)])
    assert [(r["preset"], r["recipe"]) for r in json.loads(out.read_text())["rows"]] == [("test", "fp8")]
    for bad in (["--recipes", "fp8,nvfp4"], ["--presets", "gpt-1t"]):
        with pytest.raises(SystemExit) as stop:
            bts.main(FAST + bad)
        assert stop.value.code == 2
    assert "--presets: gpt-1t" in capsys.readouterr().err


def test_the_step_is_the_loops_step(cpu):
    """Forward, backward, clip, optimizer and scheduler step, gradients cleared; from the same
    initial weights, eager and fused take the same first step."""
    batch = bts.fixed_batch("test")
    eager, fused = (bts.TrainStep("test", "bf16", batch, fused=f) for f in (False, True))
    assert not eager.model.cfg.fused_swiglu and fused.model.cfg.fused_swiglu
    assert eager() == fused() and eager.first == fused.first and eager.first[1] > 0
    assert all(p.grad is None for p in fused.model.parameters())
    assert fused.sched.last_epoch == 1 and fused.opt.state  # AdamW has taken its first step
    assert fused() < fused.first[0]  # the second step sees updated weights


def test_first_steps_that_differ_beyond_the_bound_fail():
    got = bts.check_first_step("w", (5.5, 0.5), (5.5 * (1 + 0.5 * bts.BOUND), 0.5))
    assert got["loss_rel_diff"] == pytest.approx(0.5 * bts.BOUND) and got["grad_norm_rel_diff"] == 0.0
    with pytest.raises(common.AccuracyError, match="train_step test fp8: the first step's loss"):
        bts.check_first_step("train_step test fp8", (5.5, 0.5), (5.5 * (1 + 2 * bts.BOUND), 0.5))
    with pytest.raises(common.AccuracyError, match="grad_norm"):
        bts.check_first_step("w", (5.5, 0.5), (5.5, 0.6))
    with pytest.raises(common.AccuracyError, match="nan"):
        bts.check_first_step("w", (5.5, 0.5), (float("nan"), 0.5))


def test_a_fused_step_off_the_eager_one_fails_the_run(cpu, monkeypatch, tmp_path):
    real = bts.TrainStep.__call__

    def off(self):  # the fused model's loss reported 5 % high
        value = real(self)
        if self.cfg.model.fused_swiglu and self.first[0] == value:
            self.first = (value * 1.05, self.first[1])
        return value
    monkeypatch.setattr(bts.TrainStep, "__call__", off)
    out = tmp_path / "bad.json"
    with pytest.raises(SystemExit, match="train_step failed:\ntest bf16: train_step test bf16: the first step's loss"):
        bts.main(FAST + ["--presets", "test", "--recipes", "bf16", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert "fused_vs_eager" not in row and "differs from the eager one's" in row["error"]


def test_an_eager_baseline_that_cannot_be_built_fails_by_name(cpu, monkeypatch, tmp_path):
    real = bts.build_model

    def build(cfg, vocab, recipe=None):
        if not cfg.model.fused_swiglu:
            raise RuntimeError("out of memory")
        return real(cfg, vocab, recipe)
    monkeypatch.setattr(bts, "build_model", build)
    with pytest.raises(common.MissingBaselineError, match=r"train_step test mxfp8: baseline 'the eager SwiGLU step"):
        bts.step_row("test", "mxfp8", bts.Protocol(rounds=2, samples=1, warmup=0))
    out = tmp_path / "missing.json"
    with pytest.raises(SystemExit, match="train_step failed"):
        bts.main(FAST + ["--presets", "test", "--recipes", "bf16", "--out", str(out)])
    assert "RuntimeError: out of memory" in json.loads(out.read_text())["rows"][0]["error"]


def test_help_prints(capsys):
    with pytest.raises(SystemExit) as stop:
        bts.main(["--help"])
    assert stop.value.code == 0 and "--presets" in capsys.readouterr().out
