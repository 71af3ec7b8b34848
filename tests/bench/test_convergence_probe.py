"""bench.convergence's probe measures the workers under the sharing of the real run, and the plan
it makes fits the budget. Workers are fakes that share a pretend GPU: every step (and every
evaluation batch) takes its recipe's time alone times the number of fake workers training at
that moment, and each worker starts training only after its own start-up delay (the start-up
skew of processes that build data, models and kernels at different speeds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import convergence as conv
from test_convergence_deadline import FINGERPRINT, fake_data

# One worker on the pretend GPU: a file per training worker in ``gpu`` (its pid); a step of
# recipe R sleeps ALONE[R] x (live workers); an evaluation batch half of that.
SHARED_WORKER = r"""
import atexit, json, os, signal, sys, time
labels, steps, out, alone, tokens, delay, gpu, eval_interval, eval_iters, fp = json.loads(sys.argv[1])
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "summary.md"), "w").write("# runs\n\nData: fake corpus " + fp + ".\n")
time.sleep(delay)
me = os.path.join(gpu, str(os.getpid()))
def leave(*_):
    if os.path.exists(me):
        os.unlink(me)
    os._exit(143)
signal.signal(signal.SIGTERM, leave)
atexit.register(lambda: os.path.exists(me) and os.unlink(me))
open(me, "w").close()
def live():
    n = 0
    for name in os.listdir(gpu):
        try:
            os.kill(int(name), 0)
            n += 1
        except (ProcessLookupError, ValueError):
            pass
    return max(1, n)
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    for label in labels:
        base, elapsed = alone[label.split("@")[0]], 0.0
        for _ in range(eval_iters):
            time.sleep(0.5 * base * live())
        f.write(json.dumps({"step": 0, "recipe": label, "val_loss": 2.0, "elapsed": 0.0}) + "\n")
        f.flush()
        for s in range(1, steps + 1):
            dt = base * live()
            time.sleep(dt)
            elapsed += dt
            rec = {"step": s, "recipe": label, "train_loss": 1.5, "tokens_per_s": tokens / base,
                   "elapsed": elapsed}
            if s % eval_interval == 0 or s == steps:
                for _ in range(eval_iters):
                    time.sleep(0.5 * base * live())
                rec["val_loss"] = 1.0 + 0.001 * s
            f.write(json.dumps(rec) + "\n")
            f.flush()
"""

ALONE = {"bf16": 0.02, "fp8": 0.04}  # seconds per step with the pretend GPU to itself


def shared_start_worker(gpu: Path, delays: dict[str, float]):
    """A stand-in for ``conv.start_worker``: worker ``wK`` waits ``delays[wK]`` seconds first."""
    gpu.mkdir(parents=True, exist_ok=True)

    def start(cmp, labels, out, steps, device, args, eval_interval, eval_iters, **schedule):
        payload = [list(labels), steps, str(out), ALONE, cmp.tokens_per_step, delays.get(out.name, 0.0), str(gpu),
                   eval_interval, eval_iters, FINGERPRINT]
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "driver.log", "w") as log:
            return subprocess.Popen([sys.executable, "-c", SHARED_WORKER, json.dumps(payload)],
                                    stdout=log, stderr=subprocess.STDOUT)
    return start


def argv(out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--dense-preset", "test", "--dense-recipes", "bf16,fp8", "--moe-recipes", "",
            "--seeds", "2", "--jobs", "2", "--device", "cpu", "--eval-iters", "1", "--poll-s", "0.05",
            "--grace-s", "1", "--json", str(out / "results.json"), *extra]


def test_a_plan_from_a_skewed_start_fits_its_budget(tmp_path, monkeypatch):
    """w1 starts training 3 s after w0: longer than a short probe run lasts alone. The plan must
    come from rates measured while both train (each at half its alone speed), and every run of
    the study then completes inside the budget."""
    out = tmp_path / "conv"
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "start_worker", shared_start_worker(tmp_path / "gpu", {"w1": 3.0}))
    budget = 30.0
    conv.main(argv(out, "--budget-s", str(budget), "--probe-window-s", "2"))
    plan = json.loads((out / "plan.json").read_text())
    probe = plan["probe"]
    assert set(probe["basis"]["dense"].values()) == {"all workers training"}, probe["basis"]
    assert probe["window_s"] >= 2.0
    tokens_per_step = 8 * 64
    for recipe, alone in ALONE.items():  # shared by two workers: at most half the alone rate
        assert probe["rates"]["dense"][recipe] < 0.6 * tokens_per_step / alone, (recipe, probe["rates"])
    result = json.loads((out / "results.json").read_text())
    study = result["studies"]["dense"]
    assert study["failed_runs"] == {}, study["failed_runs"]
    assert all(w["stopped"] is None and w["exit"] == 0 for w in study["workers"]), study["workers"]
    # the prediction is not optimistic: every worker ends before its predicted seconds (plus slack
    # for a loaded machine), and the study inside the budget
    for w in study["workers"]:
        assert w["actual_s"] <= 1.15 * w["predicted_s"] + 1.0, w
    assert plan["comparisons"]["dense"]["steps"] >= 20


def test_no_window_of_all_workers_is_never_planned_as_alone(tmp_path, monkeypatch, capsys):
    """w1 starts training 2.5 s late and the probe waits 6 s for a 5 s window: no window of both
    workers training. The plan must not take the rates each worker reached alone as if the GPU
    were not shared."""
    out = tmp_path / "conv"
    seen: dict = {}
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "run_plan", lambda args, comparisons, plan, t0: seen.update(plan))
    monkeypatch.setattr(conv, "start_worker", shared_start_worker(tmp_path / "gpu", {"w1": 2.5}))
    conv.main(argv(out, "--budget-s", "60", "--probe-window-s", "5", "--probe-max-s", "6"))
    probe = seen["probe"]
    assert probe["window_s"] < 5
    assert all("alone" not in how or "workers" in how for how in probe["basis"]["dense"].values())
    assert all(how.startswith("shared") for how in probe["basis"]["dense"].values()), probe["basis"]
    tokens_per_step = 8 * 64
    for recipe, alone in ALONE.items():  # two workers on one GPU, no gain from sharing assumed
        assert probe["rates"]["dense"][recipe] <= 0.55 * tokens_per_step / alone, (recipe, probe["rates"])
    text = capsys.readouterr().out
    assert "no window" in text and "--probe-window-s" in text and "--budget-s" in text


def test_a_worker_that_never_trains_in_the_probe_drops_its_recipe_naming_why(tmp_path, monkeypatch, capsys):
    seen: dict = {}
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "run_plan", lambda args, comparisons, plan, t0: seen.update(plan))
    monkeypatch.setattr(conv, "start_worker", shared_start_worker(tmp_path / "gpu", {"w1": 30.0}))
    conv.main(argv(tmp_path / "conv", "--budget-s", "60", "--probe-window-s", "1", "--probe-max-s", "3"))
    dense = seen["comparisons"]["dense"]
    assert dense["dropped"] == ["fp8"] and dense["recipes"] == ["bf16"]
    why = seen["probe"]["failed"]["dense"]["fp8@seed=0"]
    assert why.startswith("never started: the probe stopped it (no window") and "--probe-max-s" in why
    assert seen["probe"]["basis"]["dense"]["bf16"].startswith("shared")


def test_window_rates_split_evaluations_from_training():
    from bench.convergence_probe import window_rates
    rec = lambda step, el, val=False: {"step": step, "recipe": "a@seed=0", "tokens_per_s": 1e9, "elapsed": el,
                                       **({"val_loss": 1.0} if val else {})}
    # 10 steps of 0.1 s and one evaluation of 2 batches (0.5 s) between t=1 and t=2.5
    stamps = {"d/w0": [(0.0, rec(1, 0.1)), (1.0, rec(5, 0.5)), (2.5, rec(15, 1.5))]}
    records = {"d/w0": [rec(s, 0.1 * s, val=s == 10) for s in range(1, 16)]}
    rates, eval_s, basis = window_rates(stamps, records, {"d": 100}, 0.5, 3.0, 2)
    assert rates["d"]["a"] == pytest.approx(1000.0)  # 10 steps x 100 tokens over 1.0 s of training
    assert eval_s["d"]["a"] == pytest.approx(0.25) and basis["d"]["a"] == "all workers training"


def test_planned_seconds_count_the_evaluations():
    from bench.convergence_probe import evaluations
    assert [evaluations(s) for s in (190, 36, 11, 100)] == [6, 5, 7, 5]
    cost = {"a": 1e-3}
    assert conv.plan_tokens([["a@seed=0"]], cost, 10.0, {"a": 4.0}) == pytest.approx(6000.0)


def test_evaluations_that_eat_the_budget_are_named(tmp_path, monkeypatch):
    """A run's evaluations are planned at their measured cost: when they alone fill the time left
    (seven evaluations of 16 batches at 1 s each per run), the driver says so and what to change."""
    seen: dict = {}
    monkeypatch.setattr(conv, "load_data", fake_data)
    monkeypatch.setattr(conv, "run_plan", lambda args, comparisons, plan, t0: seen.update(plan))
    monkeypatch.setattr(conv, "probe", lambda comparisons, workers, args, deadline: {
        "rates": {"dense": {"bf16": 1e4, "fp8": 1e4}}, "eval_s": {"dense": {"bf16": 1.0, "fp8": 1.0}},
        "startup_s": 0.0, "window_s": 10.0})
    base = ["--out", str(tmp_path / "conv"), "--dense-preset", "test", "--dense-recipes", "bf16,fp8",
            "--moe-recipes", "", "--seeds", "2", "--jobs", "2", "--device", "cpu", "--budget-s", "300"]
    with pytest.raises(SystemExit, match=r"evaluations.*--eval-iters 16"):
        conv.main(base + ["--eval-iters", "16"])
    conv.main(base + ["--eval-iters", "1"])  # 7 s of evaluations per run: the rest trains
    dense = seen["comparisons"]["dense"]
    per_run = 300 * 0.8 * 0.85 / 2 - 7  # two runs per worker, each after its evaluations
    assert abs(dense["steps"] - int(per_run * 1e4 / 512)) <= 1  # the driver's clock has moved a little
    evals = 6 if dense["steps"] % (dense["steps"] // 4) else 5  # step 0, every steps // 4, the last
    assert dense["predicted_s"][0] == pytest.approx(
        (2 * dense["steps"] * 512 / 1e4 + 2 * evals * 1.0) / 0.8, rel=1e-6)


def test_docstrings_of_the_probe():
    import inspect

    from bench import convergence_probe as cp
    need = {cp.measure: "Parameters Returns Raises", cp.window_rates: "Parameters Returns",
            cp.shared_rates: "Parameters Returns", cp.Window: "Parameters", conv.probe: "Returns Raises"}
    for obj, sections in need.items():
        for section in sections.split():
            assert f"{section}\n" in inspect.getdoc(obj), (obj.__qualname__, section)
    assert "PROBE_STEPS" not in conv.__doc__ and "--probe-window-s" in conv.__doc__


def test_the_window_closes_by_the_records_not_the_clock():
    import time
    import types

    from bench.convergence_probe import WINDOW_CAUSE, Window
    now = time.time()
    rec = lambda step: {"step": step, "recipe": "a@seed=0", "tokens_per_s": 1.0}
    w0 = types.SimpleNamespace(stamps=[(now - 9, rec(3)), (now - 1, rec(40))])
    w1 = types.SimpleNamespace(stamps=[(now - 5, rec(1)), (now - 4, rec(3))])  # slow to write
    window = Window({"w0": w0, "w1": w1}, {"w0": lambda: True, "w1": lambda: True}, 2.0, now + 60)
    assert window() is None  # both warm 4 s ago, but w1 has written nothing since
    w1.stamps.append((now - 1.5, rec(9)))
    assert window() == WINDOW_CAUSE
    late = Window({"w0": w0, "w1": types.SimpleNamespace(stamps=[])}, {"w0": lambda: True, "w1": lambda: True},
                  2.0, now - 1)
    assert "no window" in late() and "--probe-max-s" in late()
    gone = Window({"w0": w0, "w1": types.SimpleNamespace(stamps=[])}, {"w0": lambda: True, "w1": lambda: False},
                  2.0, now + 60)
    assert gone() == WINDOW_CAUSE  # a worker that ended (a crash) does not hold the window open
