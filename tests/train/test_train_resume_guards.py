"""``hybridfp train`` guards: ``--jobs`` workers get every training option, a resume keeps the
layout (``--jobs`` or not) and the data it began with, and a bad ``--device``, ``--seed`` or
token-file ``meta.json`` is one error line before anything is written."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from test_cli_robust import _one_error_line, _run  # the same smallest run and one-line error check

from hybridfp.train import cli
from hybridfp.train.data import DataError, load_data
from hybridfp.train.loop import RunResult
from hybridfp.train.parallel import NOT_FORWARDED, gather_records, worker_argv
from hybridfp.train.recipes_by_name import parse_recipe

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")




def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cli.add_train_args(p)
    return p


# ---------------------------------------------------------------- --jobs workers' options
#: Every training option set away from its default (a new option must be added here or to
#: parallel.NOT_FORWARDED: the test below fails otherwise).
_NON_DEFAULT = ["--preset", "test", "--steps", "7", "--batch-size", "3", "--seq-len", "17", "--lr", "0.002",
                "--warmup", "2", "--lr-decay-steps", "9", "--eval-interval", "3", "--eval-iters", "2",
                "--checkpoint-interval", "2", "--quantized-weights", "--recompute", "--eager-swiglu", "--dtype", "fp32",
                "--seed", "5"]


def test_worker_argv_carries_every_training_option(tmp_path, text):
    parser = _train_parser()
    args = parser.parse_args([*_NON_DEFAULT, "--data", str(text)])
    cfg = cli.config_from_args(args)
    argv = worker_argv(cfg, parse_recipe("mxfp8"), tmp_path, "cpu", False, "/cache")
    given = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(NOT_FORWARDED) <= given, "NOT_FORWARDED names an option the CLI no longer has"
    for action in parser._actions:
        if action.dest in given and action.dest not in NOT_FORWARDED:
            assert set(action.option_strings) & set(argv), f"{action.option_strings} not forwarded"
    # the worker parses its command line back to the same settings (its own device and out)
    worker = cli.config_from_args(parser.parse_args(argv[3:]))
    assert worker.to_dict() == cli.config_from_args(args).to_dict()


def test_resumed_workers_keep_recompute(tmp_path, text):
    cfg = cli.config_from_args(_train_parser().parse_args([*_NON_DEFAULT, "--data", str(text)]))
    argv = worker_argv(cfg, parse_recipe("bf16"), tmp_path, "cpu", True, None)
    assert "--resume" in argv and "--recompute" in argv


# ---------------------------------------------------------------- --jobs layout on resume
def test_resume_with_jobs_of_a_run_without_is_refused(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert _run(text, out, "--compare", "bf16,fp8", "--steps", "2") == 0
    before = (out / "metrics.jsonl").read_text(), (out / "summary.md").read_text()
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "4", "--jobs", "2") == 2
    assert "without --jobs" in _one_error_line(capsys)
    assert ((out / "metrics.jsonl").read_text(), (out / "summary.md").read_text()) == before
    assert not (out / "parts").exists()


@pytest.mark.parametrize("recorded", [True, None])  # None: a run.json from before "jobs" was kept
def test_resume_without_jobs_of_a_jobs_run_is_refused(tmp_path, text, capsys, recorded):
    out = tmp_path / "run"
    assert _run(text, out, "--compare", "bf16,fp8", "--steps", "2") == 0
    run = json.loads((out / "run.json").read_text())
    assert run["jobs"] is False
    if recorded is None:
        del run["jobs"]
        (out / "parts").mkdir()
    else:
        run["jobs"] = True
    (out / "run.json").write_text(json.dumps(run))
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "4") == 2
    assert "--jobs" in _one_error_line(capsys)
    assert (out / "metrics.jsonl").read_text() == before


def test_gathering_keeps_the_records_of_failed_and_untrained_recipes(tmp_path):
    old = [{"step": s, "recipe": r} for r in ("a", "b", "c") for s in (0, 1)]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "recipe": "b"}) + "\n"
                                                         for s in (0, 1, 2)))
    done = RunResult("a", "", records=[{"step": s, "recipe": "a"} for s in (0, 1, 2, 3)])
    got = gather_records(old, [done], {"b": tmp_path / "b", "d": tmp_path / "d"})
    steps = {r: [x["step"] for x in got if x["recipe"] == r] for r in "abcd"}
    assert steps == {"a": [0, 1, 2, 3], "b": [0, 1, 2], "c": [0, 1], "d": []}


# ---------------------------------------------------------------- data identity
def test_resume_on_changed_text_is_refused(tmp_path, text, capsys, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(text.read_bytes())
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert _run("corpus.txt", out, "--recipe", "bf16", "--steps", "2", "--lr-decay-steps", "4") == 0
    assert json.loads((out / "run.json").read_text())["config"]["data"] == str(corpus)  # absolute
    monkeypatch.chdir(out)  # another directory: the stored path still names the same file
    assert cli.main(["train", "--resume", "--out", str(out), "--no-progress", "--steps", "3"]) == 0
    corpus.write_bytes(text.read_bytes().upper())
    capsys.readouterr()
    assert cli.main(["train", "--resume", "--out", str(out), "--no-progress", "--steps", "4"]) == 2
    assert "began on corpus" in _one_error_line(capsys)


def test_user_data_fingerprints_follow_the_content(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello world " * 100)
    (tmp_path / "d" / "b.txt").write_text("other text " * 100)
    first = load_data(tmp_path / "d").fingerprint
    assert first and load_data(tmp_path / "d").fingerprint == first
    (tmp_path / "d" / "b.txt").write_text("other text!" * 100)
    assert load_data(tmp_path / "d").fingerprint not in ("", first)


# ---------------------------------------------------------------- token files' meta.json
@pytest.mark.parametrize("meta, field", [('{"vocab": 300}', "vocab_size"), ('{"vocab_size": "abc"}', "vocab_size"),
                                         ('{"vocab_size": 100}', "at least 300"), ("[1]", "vocab_size"),
                                         ("{not json", "JSON")])
def test_bad_meta_json_is_a_data_error(tmp_path, meta, field):
    for name in ("train", "val"):
        np.arange(300, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
    (tmp_path / "meta.json").write_text(meta)
    with pytest.raises(DataError, match=field) as e:
        load_data(tmp_path)
    assert str(tmp_path / "meta.json") in str(e.value)
    (tmp_path / "meta.json").write_text('{"vocab_size": 300}')
    assert load_data(tmp_path).vocab_size == 300


# ---------------------------------------------------------------- --device, --seed, --preset
@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:x"])
def test_bad_device_is_refused_before_anything_is_written(tmp_path, text, capsys, device):
    assert _run(text, tmp_path / "new", "--recipe", "bf16", "--steps", "1", "--device", device) == 2
    assert "--device" in _one_error_line(capsys)
    assert not (tmp_path / "new").exists()
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    before = (out / "run.json").read_text()
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "2", "--device", device) == 2
    assert "--device" in _one_error_line(capsys)
    assert (out / "run.json").read_text() == before


@pytest.mark.parametrize("seed", [str(2**64), str(2**63 - 1), str(-2**63 - 1)])
def test_seed_out_of_range_is_refused_before_anything_is_written(tmp_path, text, capsys, seed):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1", "--seed", seed) == 2
    assert "--seed" in _one_error_line(capsys)
    assert not out.exists()
    assert _run(text, out, "--recipe", f"bf16@seed={seed}", "--steps", "1") == 2
    assert "@seed=" in _one_error_line(capsys)
    assert not out.exists()


def test_largest_seed_trains(tmp_path, text):
    assert _run(text, tmp_path / "run", "--compare", f"bf16,bf16@seed={-2**63}", "--steps", "1",
                "--seed", str(2**63 - 2)) == 0


def test_resume_notes_an_ignored_preset(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    capsys.readouterr()
    assert cli.main(["train", "--resume", "--out", str(out), "--no-progress", "--steps", "2",
                     "--preset", "test-moe"]) == 0
    assert "keeps preset='test'" in capsys.readouterr().err
    assert cli.main(["train", "--resume", "--out", str(out), "--no-progress", "--steps", "3"]) == 0
    assert "keeps preset" not in capsys.readouterr().err
