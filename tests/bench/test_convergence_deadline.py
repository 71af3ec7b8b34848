"""bench.convergence keeps its time budget and always writes its report; the probe plans from
achieved throughput. Workers are fakes (a plain Python process writing ``metrics.jsonl`` records
at a set pace), so the driver's timing is tested without training anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from bench import convergence as conv

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "fake-0123456789abcdef"

# One worker: every label in turn, a step every STEP_S seconds, each record claiming a per-step
# rate CLAIM times the rate it achieves (evaluation, stalls and sharing left out, as the trainer's
# per-step tokens_per_s does).
FAKE_WORKER = r"""
import json, os, signal, sys, time
labels, steps, out, step_s, claim, tokens, ignore_term, fp = json.loads(sys.argv[1])
if ignore_term:  # a worker that does not stop on SIGTERM: the driver must kill it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "pid"), "w").write(str(os.getpid()))
open(os.path.join(out, "summary.md"), "w").write("# runs\n\nData: fake corpus " + fp + ".\n")
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    for label in labels:
        f.write(json.dumps({"step": 0, "recipe": label, "val_loss": 2.0, "elapsed": 0.0}) + "\n")
        f.flush()
        for s in range(1, steps + 1):
            time.sleep(step_s)
            rec = {"step": s, "recipe": label, "train_loss": 1.5, "tokens_per_s": claim * tokens / step_s,
                   "elapsed": s * step_s}
            if s == steps:
                rec["val_loss"] = 1.0 + 0.01 * labels.index(label)
            f.write(json.dumps(rec) + "\n")
            f.flush()
"""


def fake_start_worker(step_s: float, claim: float = 1.0, ignore_term: str = ""):
    """A stand-in for ``conv.start_worker``; the worker named ``ignore_term`` ignores SIGTERM."""
    def start(cmp, labels, out, steps, device, args, eval_interval, eval_iters, **schedule):
        payload = [list(labels), steps, str(out), step_s, claim, cmp.tokens_per_step, out.name == ignore_term,
                   FINGERPRINT]
        out.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen([sys.executable, "-c", FAKE_WORKER, json.dumps(payload)],
                                stdout=open(out / "driver.log", "w"), stderr=subprocess.STDOUT)
    return start


def fake_data(spec, cache_dir=None):
    return types.SimpleNamespace(describe=lambda: "fake corpus", source="fake", fingerprint=FINGERPRINT,
                                 train=[0] * 1000, val=[0] * 100)


def argv(out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--dense-preset", "test", "--dense-recipes", "bf16,fp8", "--moe-recipes", "",
            "--seeds", "2", "--jobs", "2", "--device", "cpu", "--eval-iters", "1", "--json",
            str(out / "results.json"), *extra]


def drive(args: list[str], step_s: float, claim: float = 1.0, ignore_term: str = "", monkeypatch=None) -> None:
    """The driver with fake data and fake workers (in a test: through ``monkeypatch``; in the
    subprocess of the interrupt test: set directly)."""
    set_ = monkeypatch.setattr if monkeypatch is not None else setattr
    set_(conv, "load_data", fake_data)
    set_(conv, "start_worker", fake_start_worker(step_s, claim, ignore_term))
    conv.main(args)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (already exited, not yet reaped by its parent) counts as stopped
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_a_worker_that_overruns_is_stopped_at_the_deadline(tmp_path, monkeypatch):
    out = tmp_path / "conv"
    t0 = time.time()
    # each worker needs 2 runs x 300 steps x 0.05 s = 30 s; the budget is 5 s; w1 ignores SIGTERM
    drive(argv(out, "--steps", "300", "--budget-s", "5", "--grace-s", "1"), 0.05, ignore_term="w1",
          monkeypatch=monkeypatch)
    took = time.time() - t0
    assert took < 5 + 1 + 6, took  # the budget, the grace, and slack for a loaded machine
    pids = [int((out / "dense" / w / "pid").read_text()) for w in ("w0", "w1")]
    assert not [p for p in pids if alive(p)]  # w1 ignored SIGTERM and was killed
    result = json.loads((out / "results.json").read_text())
    study = result["studies"]["dense"]
    assert sorted(study["failed_runs"]) == ["bf16@seed=0", "bf16@seed=1", "fp8@seed=0", "fp8@seed=1"]
    for label, why in study["failed_runs"].items():
        assert "budget" in why, (label, why)
    first = [g[0] for g in result["plan"]["comparisons"]["dense"]["workers"]]
    assert all(study["failed_runs"][label].startswith("stopped at step") for label in first)
    ends = {w["worker"]: w for w in study["workers"]}
    assert sorted(ends) == ["w0", "w1"] and all("budget" in w["stopped"] for w in ends.values())
    md = (out / "report.md").read_text()
    assert "budget" in md and (out / "plan.json").is_file() and (out / "report.json").is_file()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_reports_are_written_when_the_driver_is_interrupted(tmp_path, sig):
    out = tmp_path / "conv"
    args = argv(out, "--steps", "400", "--budget-s", "300", "--grace-s", "1")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {Path(__file__).stem} as t; "
            f"t.drive({args!r}, 0.05)")
    # SIGINT's default action in the driver: a shell's background job (a test run started with
    # `&`) inherits SIGINT ignored, and Python keeps an inherited ignore
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = [out / "dense" / w / "metrics.jsonl" for w in ("w0", "w1")]
    deadline = time.time() + 60
    while not all(m.is_file() and m.read_text().count("\n") > 3 for m in metrics):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(sig)  # the driver alone: its workers get nothing from outside
    try:  # a loaded 2-core machine: generous, and the driver's output if it ever hangs
        text, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the driver did not exit within 90 s of the signal:\n" + proc.communicate()[0])
    assert proc.returncode != 0, text
    assert "interrupted" in text, text
    pids = [int((out / "dense" / w / "pid").read_text()) for w in ("w0", "w1")]
    assert not [p for p in pids if alive(p)]
    study = json.loads((out / "results.json").read_text())["studies"]["dense"]
    assert (out / "report.md").is_file() and len(study["failed_runs"]) == 4
    assert all("interrupted" in why for why in study["failed_runs"].values()), study["failed_runs"]


def test_the_probe_plans_from_achieved_throughput(tmp_path, monkeypatch):
    out = tmp_path / "conv"
    claim = 3.0  # each step's tokens_per_s says three times what the worker achieves
    drive(argv(out, "--budget-s", "12", "--grace-s", "1", "--poll-s", "0.05", "--probe-window-s", "2"), 0.1, claim,
          monkeypatch=monkeypatch)
    plan = json.loads((out / "plan.json").read_text())
    probe, dense = plan["probe"], plan["comparisons"]["dense"]
    achieved, per_step = probe["rates"]["dense"], probe["per_step_rates"]["dense"]
    tokens_per_step = 8 * 64
    for recipe in ("bf16", "fp8"):
        # the fake's achieved rate is at most a step per 0.1 s (a loaded machine is slower)
        assert achieved[recipe] <= 1.05 * tokens_per_step / 0.1
        assert 2.4 < per_step[recipe] / achieved[recipe] < 4.5, (per_step, achieved)
    # what the per-step rates would have bought in the same seconds: about 3x the tokens planned
    before = conv.plan_tokens(dense["workers"], {r: 1 / v for r, v in per_step.items()}, probe["train_s"])
    now = conv.plan_tokens(dense["workers"], {r: 1 / v for r, v in achieved.items()}, probe["train_s"])
    assert 2.4 < before / now < 4.5
    # the fake evaluates only at its last step: no evaluation cost measured, a training step each
    assert probe["eval_s"]["dense"] == {}
    evals = {r: conv.EVALS_MAX * 1 * tokens_per_step / v for r, v in achieved.items()}
    now = conv.plan_tokens(dense["workers"], {r: 1 / v for r, v in achieved.items()}, probe["train_s"], evals)
    assert dense["steps"] == int(now / tokens_per_step)
    assert probe["safety_margin"] > 0 and len(dense["predicted_s"]) == len(dense["workers"])
    study = json.loads((out / "results.json").read_text())["studies"]["dense"]
    assert [w["predicted_s"] for w in study["workers"]] == dense["predicted_s"]
    assert all(w["actual_s"] > 0 for w in study["workers"])
    assert "predicted" in (out / "report.md").read_text()
