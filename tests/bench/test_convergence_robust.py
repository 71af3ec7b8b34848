"""bench.convergence under adverse conditions: leftovers of an earlier study in ``--out``, signals
while workers start, stop or the reports are written, mixed fixed and probed comparisons, probe
runs that fail part-way, workers that exit just as the deadline comes. Workers are fakes (a plain
Python process writing ``metrics.jsonl`` records), as in test_convergence_deadline.py."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench import convergence as conv
from bench import convergence_workers as cw
from test_convergence_deadline import alive, argv, fake_data, fake_start_worker

SLEEPER = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
          "time.sleep(30)"

# A worker whose runs of recipe ``stop_recipe`` end after ``stop_at`` steps with exit code 3.
FAILING_WORKER = r"""
import json, os, sys, time
labels, steps, out, step_s, tokens, stop_recipe, stop_at = json.loads(sys.argv[1])
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    for label in labels:
        f.write(json.dumps({"step": 0, "recipe": label, "val_loss": 2.0}) + "\n")
        f.flush()
        for s in range(1, steps + 1):
            time.sleep(step_s)
            rec = {"step": s, "recipe": label, "train_loss": 1.5, "tokens_per_s": tokens / step_s}
            if s == steps:
                rec["val_loss"] = 1.0
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if label.split("@")[0] == stop_recipe and s == stop_at:
                sys.exit(3)
"""


def capture_plan(monkeypatch) -> dict:
    """Replace ``run_plan`` by a recorder of the plan (no study runs)."""
    seen: dict = {}
    monkeypatch.setattr(conv, "run_plan", lambda args, comparisons, plan, t0: seen.update(plan))
    monkeypatch.setattr(conv, "load_data", fake_data)
    return seen


def main_catching(args: list[str]) -> None:
    """``conv.main`` with an escaped KeyboardInterrupt turned into a test failure (pytest would
    otherwise stop the whole test run on it)."""
    try:
        conv.main(args)
    except KeyboardInterrupt as e:
        pytest.fail(f"the interrupt escaped the driver: {e!r}")


def interrupting_start(after: int, step_s: float):
    """A fake ``start_worker`` that raises :class:`Interrupted` (SIGTERM) on its call ``after``."""
    real, procs = fake_start_worker(step_s), []

    def start(cmp, labels, out, steps, device, args, eval_interval, eval_iters, **schedule):
        if len(procs) == after:
            raise cw.Interrupted("SIGTERM")
        procs.append(real(cmp, labels, out, steps, device, args, eval_interval, eval_iters))
        return procs[-1]
    return start, procs


# ---------------------------------------------------------------- leftovers of an earlier study
def test_leftovers_of_an_earlier_study_are_not_read_as_new(tmp_path, monkeypatch):
    out = tmp_path / "conv"
    old = out / "dense" / "w0"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"step": 3, "recipe": "bf16@seed=0", "val_loss": 0.125}) + "\n")
    (old / "stale.txt").write_text("an earlier study")
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "start_worker", fake_start_worker(0.01))
    conv.main(argv(out, "--steps", "3", "--budget-s", "60"))
    assert not (old / "stale.txt").exists()
    merged = (out / "dense" / "metrics.jsonl").read_text()
    assert "0.125" not in merged and merged.count('"step": 3') == 4


def test_progress_skips_an_old_file_and_restarts_on_a_new_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "recipe": "old"}) + "\n" for s in range(5)))
    os.utime(path, (time.time() - 100, time.time() - 100))
    progress = cw.Progress(tmp_path)
    progress.poll()
    assert progress.stamps == []  # written before the worker started: not this study's
    path.unlink()  # the worker replaces it
    path.write_text(json.dumps({"step": 0, "recipe": "new"}) + "\n")
    progress.poll()
    assert [r["recipe"] for _, r in progress.stamps] == ["new"]


def test_progress_restarts_on_a_rewritten_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    progress = cw.Progress(tmp_path)
    path.write_text("".join(json.dumps({"step": s, "recipe": "a"}) + "\n" for s in range(3)))
    progress.poll()
    path.write_text(json.dumps({"step": 0, "recipe": "b"}) + "\n")  # shorter: read from its start
    progress.poll()
    path.write_text("".join(json.dumps({"step": s, "recipe": "c", "pad": "x" * s}) + "\n" for s in range(9)))
    progress.poll()  # longer, the old offset mid-line: read from its start
    assert [(r["recipe"], r["step"]) for _, r in progress.stamps] == [("a", 2), ("b", 0), ("c", 8)]


def test_progress_names_the_file_and_offset_of_a_bad_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*offset 12"):
        cw.Progress(tmp_path).poll()


def test_run_workers_stops_the_workers_on_any_error(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()

    class Broken:
        def poll(self) -> None:
            raise RuntimeError("unreadable progress")
    try:
        with pytest.raises(RuntimeError, match="unreadable"):
            cw.run_workers({tmp_path: proc}, None, "", 0.5, 0.01, {tmp_path: Broken()})
        assert proc.poll() is not None
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- interrupts
def test_an_interrupt_while_the_probe_starts_workers_stops_the_started_ones(tmp_path, monkeypatch):
    start, procs = interrupting_start(1, 1.0)
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "start_worker", start)
    with pytest.raises(SystemExit, match="interrupted"):
        main_catching(argv(tmp_path / "conv", "--budget-s", "60", "--grace-s", "1"))
    assert len(procs) == 1 and not alive(procs[0].pid)


def test_a_second_signal_while_stopping_workers_is_ignored(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    previous = signal.signal(signal.SIGTERM, cw.raise_interrupted)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        try:
            cw.stop_workers({tmp_path: proc}, 1.5)
        except KeyboardInterrupt as e:
            pytest.fail(f"the second signal escaped stop_workers: {e!r}")
        assert proc.poll() is not None
        assert signal.getsignal(signal.SIGTERM) is cw.raise_interrupted  # restored afterwards
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
        proc.kill()
        proc.wait()


def test_a_signal_while_the_reports_are_written_leaves_them_whole(tmp_path, monkeypatch):
    out = tmp_path / "conv"
    table = conv.workers_table

    def signalled_table(workers):
        os.kill(os.getpid(), signal.SIGTERM)  # the driver's handler is installed by main
        return table(workers)
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "start_worker", fake_start_worker(0.01))
    monkeypatch.setattr(conv, "workers_table", signalled_table)
    main_catching(argv(out, "--steps", "2", "--budget-s", "60"))
    assert "| worker | runs |" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["studies"]["dense"]["failed_runs"] == {}


def test_workers_never_started_for_an_interrupt_name_it(tmp_path, monkeypatch):
    out = tmp_path / "conv"
    old = out / "dense" / "w1"  # the never-started worker's folder holds an earlier study's runs
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"step": 9, "recipe": "fp8@seed=1", "val_loss": 0.5}) + "\n")
    start, procs = interrupting_start(1, 0.2)
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "start_worker", start)
    with pytest.raises(SystemExit, match="interrupted"):
        main_catching(argv(out, "--steps", "50", "--budget-s", "60", "--grace-s", "1"))
    result = json.loads((out / "results.json").read_text())
    later = result["plan"]["comparisons"]["dense"]["workers"][1]
    failed = result["studies"]["dense"]["failed_runs"]
    assert all(failed[label] == "never started: the driver was interrupted (SIGTERM)" for label in later), failed
    assert "0.5" not in (out / "dense" / "metrics.jsonl").read_text()


# ---------------------------------------------------------------- the plan
def test_a_fixed_comparison_beside_a_probed_one_has_no_prediction(tmp_path, monkeypatch):
    plan = capture_plan(monkeypatch)
    monkeypatch.setattr(conv, "probe", lambda comparisons, workers, args, deadline: {
        "rates": {"dense": {"bf16": 1e4}, "moe": {"bf16": 1e4}}, "startup_s": 0.0, "window_s": 1.0})
    conv.main(argv(tmp_path / "conv", "--dense-steps", "5", "--moe-preset", "test", "--moe-recipes", "bf16",
                   "--budget-s", "100"))
    assert plan["comparisons"]["dense"]["steps"] == 5 and plan["comparisons"]["dense"]["predicted_s"] == [None]
    assert plan["comparisons"]["moe"]["steps"] > 0
    assert all(isinstance(s, float) for s in plan["comparisons"]["moe"]["predicted_s"])


def test_a_recipe_whose_probe_run_stopped_early_is_dropped(tmp_path, monkeypatch, capsys):
    plan = capture_plan(monkeypatch)

    def start(cmp, labels, out, steps, device, args, eval_interval, eval_iters, **schedule):
        out.mkdir(parents=True, exist_ok=True)
        payload = [list(labels), steps, str(out), 0.03, cmp.tokens_per_step, "fp8", 5]
        with open(out / "driver.log", "w") as log:
            return subprocess.Popen([sys.executable, "-c", FAILING_WORKER, json.dumps(payload)],
                                    stdout=log, stderr=subprocess.STDOUT)
    monkeypatch.setattr(conv, "start_worker", start)
    conv.main(argv(tmp_path / "conv", "--budget-s", "60", "--poll-s", "0.05"))
    dense = plan["comparisons"]["dense"]
    assert dense["dropped"] == ["fp8"] and dense["recipes"] == ["bf16"]
    assert "fp8" not in plan["probe"]["rates"]["dense"]
    text = capsys.readouterr().out
    assert "fp8@seed=0" in text and "stopped at step 5" in text


def test_fixed_steps_warn_that_the_default_budget_cuts_them(tmp_path, monkeypatch, capsys):
    capture_plan(monkeypatch)
    conv.main(argv(tmp_path / "conv", "--steps", "2"))
    assert "--budget-s" in capsys.readouterr().out
    conv.main(argv(tmp_path / "conv", "--steps", "2", "--budget-s", "900"))
    assert "--budget-s" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        conv.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--steps STEPS", "--dense-steps DENSE_STEPS", "--moe-steps MOE_STEPS"):
        assert "--budget-s" in text.rsplit(flag, 1)[1][:120], flag  # its help, not the usage line


# ---------------------------------------------------------------- stopping at the deadline
class ExitsWhenChecked:
    """A worker that exits between the driver's last check and the deadline."""

    def __init__(self) -> None:
        self.calls, self.returncode, self.signalled = 0, None, False

    def poll(self):
        self.calls += 1
        if self.calls > 1:
            self.returncode = 0
        return self.returncode

    def terminate(self) -> None:
        self.signalled = True

    kill = terminate

    def wait(self):
        return self.returncode


def test_a_worker_that_exits_at_the_deadline_is_not_marked_stopped(tmp_path):
    proc = ExitsWhenChecked()
    done, interrupted = cw.run_workers({tmp_path: proc}, time.time() - 1, "the budget ran out", 0.2, 0.01)
    assert not proc.signalled and interrupted is None
    assert done[tmp_path].exit == 0 and done[tmp_path].stopped is None
    exited = ExitsWhenChecked()
    exited.poll()
    assert cw.stop_workers({tmp_path: exited}, 0.1) == {} and not exited.signalled


# ---------------------------------------------------------------- documentation and handles
def test_the_expected_size_is_not_a_stale_figure():
    assert "2M tokens per dense run" not in conv.__doc__ and "unmeasured" in conv.__doc__


def test_docstrings_of_the_public_names():
    need = {cw.raise_interrupted: "Parameters Raises", cw.interrupt_cause: "Parameters Returns",
            cw.stop_workers: "Parameters Returns", cw.run_workers: "Parameters Returns",
            cw.Progress.poll: "Raises", conv.Comparison: "Raises", conv.start_worker: "Parameters Returns",
            conv.plan_and_run: "Parameters Raises", conv.run_plan: "Parameters Raises",
            conv.write_reports: "Parameters Returns", conv.workers_table: "Parameters Returns",
            conv.main: "Parameters Raises"}
    for obj, sections in need.items():
        for section in sections.split():
            assert f"{section}\n" in inspect.getdoc(obj), (obj.__qualname__, section)


def test_start_worker_closes_its_log_handle(tmp_path, monkeypatch):
    handles = []

    def popen(argv, stdout=None, stderr=None):
        handles.append(stdout)
        return "process"
    monkeypatch.setattr(conv.subprocess, "Popen", popen)
    args = conv.argparse.Namespace(data="packages", cache_dir=None)
    cmp = conv.Comparison("dense", "test", ("bf16",), 1)
    assert conv.start_worker(cmp, ["bf16@seed=0"], tmp_path / "w0", 2, "cpu", args, 1, 1) == "process"
    assert handles[0].closed


# ---------------------------------------------------------------- one rule for labels
def test_labels_without_a_seed_suffix_are_seed_zero():
    assert conv.plan_tokens([["a", "b@seed=1"]], {"a": 1e-5, "b": 3e-5}, 100.0) == 2500000.0
    for module in (conv, cw):
        assert '"@seed="' not in inspect.getsource(module), module.__name__
