"""``hybridfp train --no-checkpoint``: no checkpoint written, refused with a checkpoint interval,
passed on to ``--jobs`` workers and by the convergence study's workers."""

from __future__ import annotations

import argparse
import json

import pytest

from hybridfp.train import cli
from hybridfp.train.loop import TrainConfig
from hybridfp.train.model import PRESETS
from hybridfp.train.parallel import worker_argv
from hybridfp.train.recipes_by_name import parse_recipe

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


def _run(text, out, *extra):
    return cli.main(["train", "--preset", "test", "--data", str(text), "--out", str(out), "--no-progress",
                     "--seq-len", "16", "--batch-size", "2", "--eval-iters", "1", "--eval-interval", "2",
                     *extra])


def test_no_checkpoint_trains_and_writes_none(tmp_path, text):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "2", "--no-checkpoint") == 0
    assert list((out / "checkpoints").glob("*")) == []
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 2 and "val_loss" in recs[-1]
    assert "checkpoints/" not in (out / "summary.md").read_text()
    assert json.loads((out / "run.json").read_text())["config"]["save_checkpoints"] is False


def test_no_checkpoint_with_an_interval_is_refused(tmp_path, text, capsys):
    assert _run(text, tmp_path / "run", "--recipe", "bf16", "--steps", "1", "--no-checkpoint",
                "--checkpoint-interval", "1") == 2
    err = capsys.readouterr().err
    assert "--no-checkpoint" in err and "--checkpoint-interval" in err


def test_workers_are_told_to_skip_the_checkpoint(tmp_path):
    cfg = TrainConfig(preset="test", model=PRESETS["test"].model, steps=2, batch_size=2, seq_len=16, lr=1e-3, warmup=1,
                      lr_decay_steps=2, eval_interval=2, eval_iters=1, save_checkpoints=False)
    assert "--no-checkpoint" in worker_argv(cfg, parse_recipe("bf16"), tmp_path, "cpu", False, None)
    assert "--no-checkpoint" in worker_argv(cfg, parse_recipe("bf16"), tmp_path, "cpu", True, None)


def test_convergence_workers_skip_the_checkpoint(tmp_path, monkeypatch):
    from bench import convergence as conv
    seen = []

    class _Popen:
        def __init__(self, argv, **kw):
            seen.append(argv)
    monkeypatch.setattr(conv.subprocess, "Popen", _Popen)
    args = argparse.Namespace(data="packages", cache_dir=None)
    conv.start_worker(conv.Comparison("dense", "test", ("bf16",), 1), ["bf16@seed=0"], tmp_path / "w0", 2, "cpu",
                      args, 1, 1)
    assert "--no-checkpoint" in seen[0]


def test_the_first_record_names_the_corpus_a_run_read(tmp_path, text, monkeypatch):
    """A corpus's fingerprint (the packages / stdlib corpora; a user's files by content) is named in
    each run's step-0 record, so a report can refuse runs of two corpora and a resume other data."""
    from dataclasses import replace

    from hybridfp.train import data as data_mod
    plain = data_mod.load_data(text)
    assert plain.fingerprint
    assert _run(text, tmp_path / "plain", "--recipe", "bf16", "--steps", "1", "--no-checkpoint") == 0
    first = json.loads((tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["data"] == plain.fingerprint
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: replace(plain, fingerprint="packages-abc123"))
    assert _run(text, tmp_path / "fp", "--recipe", "bf16", "--steps", "1", "--no-checkpoint") == 0
    recs = [json.loads(line) for line in (tmp_path / "fp" / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["step"] == 0 and recs[0]["data"] == "packages-abc123"
    assert all("data" not in r for r in recs[1:])  # once a run, not on every step


def test_a_run_resumes_only_on_the_corpus_it_began_on(tmp_path, text, monkeypatch, capsys):
    from dataclasses import replace

    from hybridfp.train import data as data_mod
    plain = data_mod.load_data(text)
    out = tmp_path / "run"
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: replace(plain, fingerprint="packages-aaa"))
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: replace(plain, fingerprint="packages-bbb"))
    capsys.readouterr()
    assert _run(text, out, "--recipe", "bf16", "--steps", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert "began on corpus packages-aaa" in err and "packages-bbb" in err and "--data" in err
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: replace(plain, fingerprint="packages-aaa"))
    assert _run(text, out, "--recipe", "bf16", "--steps", "2", "--resume") == 0  # the same corpus resumes
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2] and recs[0]["data"] == "packages-aaa"
