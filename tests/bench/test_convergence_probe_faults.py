"""bench.convergence's probe when a worker misbehaves: stuck in its first step, hung after its
warm-up, writing its records in bursts; the probe's options checked; the probe's runs trained at
a learning rate a real run reaches. Workers are the fakes of test_convergence_probe.py (a pretend
GPU shared by plain Python processes), altered where a test needs a fault."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import convergence as conv
from test_convergence_deadline import FINGERPRINT, fake_data
from test_convergence_probe import ALONE, SHARED_WORKER, argv, shared_start_worker

STEP0 = 'f.write(json.dumps({"step": 0, "recipe": label, "val_loss": 2.0, "elapsed": 0.0}) + "\\n")\n        f.flush()\n'


def faulty_start_worker(gpu: Path, script: str):
    """``shared_start_worker`` running ``script`` (SHARED_WORKER with a fault) instead."""
    gpu.mkdir(parents=True, exist_ok=True)

    def start(cmp, labels, out, steps, device, args, eval_interval, eval_iters, **schedule):
        payload = [list(labels), steps, str(out), ALONE, cmp.tokens_per_step, 0.0, str(gpu), eval_interval,
                   eval_iters, FINGERPRINT]
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "driver.log", "w") as log:
            return subprocess.Popen([sys.executable, "-c", script, json.dumps(payload)], stdout=log,
                                    stderr=subprocess.STDOUT)
    return start


def stuck_after_step0(worker: str) -> str:
    """Worker ``worker`` writes its step-0 evaluation, then never finishes its first step."""
    script = SHARED_WORKER.replace(STEP0, STEP0 + f"        if out.endswith({worker!r}): time.sleep(60)\n")
    assert script != SHARED_WORKER
    return script


def test_a_worker_stuck_in_its_first_step_drops_its_recipe_by_name(tmp_path, monkeypatch, capsys):
    """The trainer writes its step-0 evaluation before its first step: a worker still in that step
    when the probe gives up has records but no rate. Its recipe must be dropped naming why, in
    the log and in plan.json, never silently left out of the plan."""
    seen: dict = {}
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "run_plan", lambda args, comparisons, plan, t0: seen.update(plan))
    monkeypatch.setattr(conv, "start_worker", faulty_start_worker(tmp_path / "gpu", stuck_after_step0("w1")))
    conv.main(argv(tmp_path / "conv", "--budget-s", "60", "--probe-window-s", "1", "--probe-max-s", "3"))
    text = capsys.readouterr().out
    why = seen["probe"]["failed"]["dense"].get("fp8@seed=0", "")
    assert why.startswith("no training step timed: the probe stopped it (no window"), seen["probe"]["failed"]
    assert seen["comparisons"]["dense"]["dropped"] == ["fp8"]
    assert "fp8@seed=0: no training step timed" in text and "fp8 is dropped" in text, text
    # bf16 stuck the same way: the driver stops and says why, not only that the probe failed
    monkeypatch.setattr(conv, "start_worker", faulty_start_worker(tmp_path / "gpu", stuck_after_step0("w0")))
    with pytest.raises(SystemExit, match=r"bf16.*no training step timed"):
        conv.main(argv(tmp_path / "conv2", "--budget-s", "60", "--probe-window-s", "1", "--probe-max-s", "3"))


def test_a_worker_that_hangs_after_its_warm_up_is_named_and_its_recipe_dropped(tmp_path, monkeypatch, capsys):
    """w1 trains 7 steps, then hangs inside step 8: it holds the window open until --probe-max-s.
    The give-up must name it and how long it has been silent, and its recipe must be dropped (the
    rate of a hung worker is not a rate), not planned from its records before the hang."""
    script = SHARED_WORKER.replace("            dt = base * live()\n",
                                   "            dt = base * live()\n"
                                   "            if out.endswith('w1') and s == 8: time.sleep(60)\n")
    assert script != SHARED_WORKER
    seen: dict = {}
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "run_plan", lambda args, comparisons, plan, t0: seen.update(plan))
    monkeypatch.setattr(conv, "start_worker", faulty_start_worker(tmp_path / "gpu", script))
    conv.main(argv(tmp_path / "conv", "--budget-s", "60", "--probe-window-s", "1", "--probe-max-s", "4"))
    text = capsys.readouterr().out
    assert re.search(r"dense/w1: no record for \d+ s after step 7", text), text
    why = seen["probe"]["failed"]["dense"].get("fp8@seed=0", "")
    assert re.search(r"no record for \d+ s after step 7", why), seen["probe"]["failed"]
    assert seen["comparisons"]["dense"]["recipes"] == ["bf16"] and "fp8" not in seen["probe"]["rates"]["dense"]
    assert seen["probe"]["basis"]["dense"]["bf16"].startswith("shared")


def test_probe_runs_train_at_a_learning_rate_a_real_run_reaches(tmp_path, monkeypatch):
    """A probe run is given no step limit to speak of; its warm-up and cosine length must still be
    those of a real run's order (tens of steps), or it trains at a learning rate near zero and
    no recipe can diverge there."""
    from hybridfp.train.loop import warmup_cosine
    seen: list[list[str]] = []
    real = subprocess.Popen

    def popen(cmd, *a, **kw):  # the trainer's command line, then a worker that crashes at once
        seen.append(list(cmd))
        return real([sys.executable, "-c", "raise SystemExit(3)"], *a, **kw)
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(SystemExit, match="bf16"):
        conv.main(argv(tmp_path / "conv", "--budget-s", "60", "--probe-window-s", "1", "--probe-max-s", "3"))
    assert seen and all("hybridfp.train" in cmd for cmd in seen)
    for cmd in seen:
        warmup = int(cmd[cmd.index("--warmup") + 1])
        decay = int(cmd[cmd.index("--lr-decay-steps") + 1]) if "--lr-decay-steps" in cmd else \
            int(cmd[cmd.index("--steps") + 1])
        assert warmup <= 50 and decay <= 1000, cmd
        assert all(warmup_cosine(s, 1.0, warmup, decay, 0.1) >= 0.5 for s in range(warmup, warmup + 20)), cmd
    # a real run keeps the schedule of its own length: warm-up a tenth, cosine over its steps
    cmd = []
    monkeypatch.setattr(subprocess, "Popen", lambda c, *a, **kw: cmd.extend(c) or real(["true"], *a, **kw))
    conv.start_worker(conv.Comparison("dense", "test", ("bf16",), 1), ["bf16@seed=0"], tmp_path / "w", 200, "cpu",
                      argv_namespace(), 50, 2).wait()
    assert cmd[cmd.index("--warmup") + 1] == "20" and "--lr-decay-steps" not in cmd


def argv_namespace():
    import argparse
    return argparse.Namespace(data="packages", cache_dir=None)


def test_probe_options_are_checked_naming_both(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(conv, "load_data", fake_data)
    for extra in (["--probe-window-s", "5", "--probe-max-s", "5"], ["--probe-window-s", "10", "--budget-s", "12"]):
        with pytest.raises(SystemExit, match=r"--probe-window-s.*--probe-max-s"):
            conv.main(argv(tmp_path / "conv", *extra))
    with pytest.raises(SystemExit, match="--probe-window-s must be positive"):
        conv.main(argv(tmp_path / "conv", "--probe-window-s", "0"))
    # a probe that may last longer than the budget: the budget's message names --probe-max-s
    monkeypatch.setattr(conv, "start_worker", shared_start_worker(tmp_path / "gpu", {"w0": 30.0, "w1": 30.0}))
    with pytest.raises(SystemExit, match=r"budget ran out during the probe.*--probe-max-s 10"):
        conv.main(argv(tmp_path / "conv", "--budget-s", "3", "--probe-window-s", "1", "--probe-max-s", "10"))


BURSTY = r"""
import json, os, sys, time
labels, steps, out, tokens, fp = json.loads(sys.argv[1])
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "summary.md"), "w").write("# runs\n\nData: fake corpus " + fp + ".\n")
bursty = labels[0].startswith("fp8")
if not bursty:
    time.sleep(1.5)  # fp8 is past its warm-up first: the window starts with bf16's
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    label, elapsed = labels[0], 0.0
    f.write(json.dumps({"step": 0, "recipe": label, "val_loss": 2.0, "elapsed": 0.0}) + "\n")
    f.flush()
    for s in range(1, steps + 1):
        time.sleep(0.02)
        elapsed += 0.02
        f.write(json.dumps({"step": s, "recipe": label, "train_loss": 1.5, "tokens_per_s": tokens / 0.02,
                            "elapsed": elapsed}) + "\n")
        if not bursty or s % 4 == 0:  # fp8 past its warm-up: a burst of records every 4 s
            f.flush()
        if bursty and s >= 4 and s % 4 == 0:
            time.sleep(4.0)
"""


def test_a_recipe_without_records_in_the_window_is_told_as_such(tmp_path, monkeypatch, capsys):
    """The window came, but fp8 wrote a single burst of records inside it: its rate comes from the
    conservative model, and the log says that fp8 had too few records in the window (not that no
    window came)."""
    seen: dict = {}

    def start(cmp, labels, out, steps, device, args, eval_interval, eval_iters, **schedule):
        out.mkdir(parents=True, exist_ok=True)
        payload = [list(labels), steps, str(out), cmp.tokens_per_step, FINGERPRINT]
        with open(out / "driver.log", "w") as log:
            return subprocess.Popen([sys.executable, "-c", BURSTY, json.dumps(payload)], stdout=log,
                                    stderr=subprocess.STDOUT)
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "run_plan", lambda args, comparisons, plan, t0: seen.update(plan))
    monkeypatch.setattr(conv, "start_worker", start)
    conv.main(argv(tmp_path / "conv", "--budget-s", "60", "--probe-window-s", "1", "--probe-max-s", "20"))
    text = capsys.readouterr().out
    probe = seen["probe"]
    assert probe["basis"]["dense"]["bf16"] == "all workers training", probe["basis"]
    assert probe["basis"]["dense"]["fp8"].startswith("shared"), probe["basis"]
    assert "no window of every worker" not in text, text
    assert re.search(r"dense/fp8: [01] training records? inside the [\d.]+ s window", text), text
