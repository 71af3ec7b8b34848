"""The convergence study's probe: what each recipe achieves while every worker shares the GPU.

The plan is only as good as the rates it divides by, and the rate that matters is the one of
the real run: every worker training at once. A probe of a fixed step count cannot promise that.
On one H100 eight workers started up to ~30 s apart (data, model and kernel set-up at different
speeds) while a 20-step probe run lasted ~9 s: no two-second stretch had every worker training,
every rate was timed with the GPU nearly to itself (dense BF16 131k tokens/s; 43.6k in the real
run), and the plan overran its budget by half.

So the probe is *time-based*: each worker trains one recipe with no step limit to speak of
(:data:`PROBE_MAX_STEPS`) and the driver stops them all once it has seen every live worker past
its warm-up (:data:`PROBE_WARMUP_STEPS` steps: first-call compilation) for ``--probe-window-s``
seconds (:class:`Window`). Start-up skew then only delays the window, it cannot remove it. A
rate is measured inside that window alone (:func:`window_rates`): training tokens over the
training seconds, from the records' ``elapsed`` (the trainer times each step up to a host sync),
and the rest of the window's wall time charged to the evaluations in it (the probe evaluates
every :data:`PROBE_EVAL_INTERVAL` steps), as seconds per evaluation batch. The plan then counts
each run's evaluations (:func:`evaluations`) at that cost: on the H100 they were over half of a
36-step MoE run's time, far beyond a flat fraction.

Every probe worker trains one recipe: a comparison with fewer workers than recipes gets one probe
worker per recipe, more sharing than its real run (pessimistic, never optimistic). Its learning
rate follows the schedule of a real run of :data:`PROBE_LR_DECAY_STEPS` steps (warm-up a tenth),
not one of :data:`PROBE_MAX_STEPS`, so it trains at the rates a real run reaches and a recipe
that diverges there is dropped at the probe.

A recipe is dropped naming why, in the log and ``plan.json``'s ``probe.failed``, when a run of it
diverged or crashed, when its worker hung after its warm-up (no record for longer than the
window: it alone held the window open, and the no-window message names it), or when it got no
rate at all (still in its first step when the probe stopped: ``no training step timed``).

When the window is not reached by ``--probe-max-s`` (default half of ``--budget-s``), the probe
stops its workers and plans from a conservative model (:func:`shared_rates`): each rate a worker
reached over its own records, divided by the number of workers of the real run (the GPU shared
with no gain from overlap), and an evaluation batch costing a whole training step. The basis
of each rate says so (``shared: ...``) and the log names the options to change.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from bench.convergence_report import failed_runs, split_label
from bench.convergence_workers import Progress, clear_worker_dirs, interrupt_cause, run_workers, stop_workers
from hybridfp.train.parallel import worker_devices

#: Steps a probe run is given: never reached, the driver stops the run (the window decides).
PROBE_MAX_STEPS = 1_000_000
#: Training steps before a probe worker counts as warm (first-call compilation, autotuning).
PROBE_WARMUP_STEPS = 3
#: The probe runs' learning-rate schedule: the warm-up and cosine length of a real run of this many
#: steps (warm-up a tenth), the order of the real runs' size, so the probe trains at the learning
#: rate a real run reaches and a recipe that diverges there can diverge in the probe (the schedule
#: of :data:`PROBE_MAX_STEPS` steps would warm up for 100,000 steps: a learning rate near zero).
PROBE_LR_DECAY_STEPS = 100
PROBE_LR_WARMUP_STEPS = PROBE_LR_DECAY_STEPS // 10
#: Default ``--probe-window-s``: seconds every worker must train at once.
PROBE_WINDOW_S = 10.0
#: The probe's evaluations: every this many steps, over this many batches (their cost per batch).
PROBE_EVAL_INTERVAL = 5
PROBE_EVAL_ITERS = 2
#: Evaluations of one run at most (step 0, every ``steps // 4`` steps, the last step).
EVALS_MAX = 7
WINDOW_CAUSE = "the probe's window was measured"
BASIS_WINDOW = "all workers training"


def eval_interval(steps: int) -> int:
    """Steps between a study run's evaluations: a quarter of the run (at least 1).

    Example
    -------
    >>> eval_interval(190), eval_interval(3)
    (47, 1)
    """
    return max(1, steps // 4)


def evaluations(steps: int) -> int:
    """Evaluations of a run of ``steps`` steps evaluated every :func:`eval_interval` steps (as
    ``bench.convergence.run_plan`` starts them): step 0, each multiple, and the last step.

    Example
    -------
    >>> evaluations(190), evaluations(36)
    (6, 5)
    """
    every = eval_interval(steps)
    return 1 + steps // every + (steps % every != 0)


def probe_groups(runs_by_comparison: dict[str, list[str]], recipes: dict[str, Sequence[str]],
                 workers: dict[str, int]) -> dict[str, list[list[str]]]:
    """One run per probe worker: every recipe at seed 0, and as many more runs (seed 1, ...) as
    the comparison has workers beyond its recipes, so the probe shares the GPU at least as much
    as the real run.

    Example
    -------
    >>> probe_groups({"d": ["a@seed=0", "b@seed=0", "a@seed=1"]}, {"d": ["a", "b"]}, {"d": 3})
    {'d': [['a@seed=0'], ['b@seed=0'], ['a@seed=1']]}
    """
    return {name: [[label] for label in runs[:max(workers[name], len(recipes[name]))]]
            for name, runs in runs_by_comparison.items()}


class Window:
    """The probe's stop rule, called at every check of :func:`bench.convergence_workers.run_workers`:
    ``WINDOW_CAUSE`` once every live worker's records span ``window_s`` seconds after the last of
    them came past its warm-up, a no-window cause at ``give_up_at``, else None. The no-window
    cause names each live worker past its warm-up that has written nothing for longer than
    ``window_s`` (hung: it alone holds the window open); :attr:`stalled` keeps them.

    Parameters
    ----------
    watch : out dir -> :class:`bench.convergence_workers.Progress` of each worker.
    alive : out dir -> a function telling whether that worker still runs.
    window_s : the window's length.
    give_up_at : ``time.time()`` seconds at which the probe stops without a window.
    """

    def __init__(self, watch: dict[Path, Progress], alive: dict[Path, Callable[[], bool]], window_s: float,
                 give_up_at: float) -> None:
        self.watch, self.alive, self.window_s, self.give_up_at = watch, alive, window_s, give_up_at
        #: out dir -> ``COMPARISON/wK: no record for N s after step S``, set when the probe gives up
        self.stalled: dict[Path, str] = {}

    def stalls(self, now: float) -> dict[Path, str]:
        """Live workers past their warm-up whose last record is older than ``window_s`` at ``now``.

        Parameters
        ----------
        now : ``time.time()`` seconds.

        Returns
        -------
        dict : out dir -> ``COMPARISON/wK: no record for N s after step S``.
        """
        found: dict[Path, str] = {}
        for out, running in self.alive.items():
            stamps = self.watch[out].stamps
            # a first step that compiles for long is not a hang: only workers past their warm-up
            if running() and warm_time(stamps) is not None and now - stamps[-1][0] > self.window_s:
                name = f"{out.parent.name}/{out.name}" if isinstance(out, Path) else str(out)
                found[out] = f"{name}: no record for {now - stamps[-1][0]:.0f} s after step {stamps[-1][1]['step']}"
        return found

    def __call__(self) -> Optional[str]:
        live = [out for out, running in self.alive.items() if running()]
        warm = [warm_time(self.watch[out].stamps) for out in live]
        if live and None not in warm:
            # by the records, not the clock: every worker has written a step past the window's end
            last = min(self.watch[out].stamps[-1][0] for out in live)
            if last - max(w for w in warm if w is not None) >= self.window_s:
                return WINDOW_CAUSE
        now = time.time()
        if now >= self.give_up_at:
            self.stalled = self.stalls(now)
            hung = f"; hung: {'; '.join(self.stalled.values())}" if self.stalled else ""
            return f"no window of every worker training within --probe-max-s ({len(live)} still running{hung})"
        return None


def warm_time(stamps: Sequence[tuple[float, dict]]) -> Optional[float]:
    """When a worker's records first show it past :data:`PROBE_WARMUP_STEPS` training steps.

    Example
    -------
    >>> warm_time([(1.0, {"step": 1, "tokens_per_s": 1.0}), (2.0, {"step": 4, "tokens_per_s": 1.0})])
    2.0
    """
    return next((t for t, r in stamps if "tokens_per_s" in r and r["step"] >= PROBE_WARMUP_STEPS), None)


def window_rates(stamps: dict[str, list[tuple[float, dict]]], records: dict[str, list[dict]],
                 tokens_per_step: dict[str, int], lo: float, hi: float, eval_iters: int
                 ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], dict[str, dict[str, str]]]:
    """Each probed recipe's training rate and evaluation cost inside the window ``[lo, hi]``.

    Between a worker's first and last stamped training record in the window: the training rate is
    the steps times ``tokens_per_step`` over the records' ``elapsed`` difference (training
    seconds); the wall seconds beyond that, over the evaluation batches of the evaluations in
    between (``records`` with a ``val_loss``), are the seconds of one evaluation batch. Records
    without ``elapsed`` give the wall rate and no evaluation cost. A recipe probed by several
    workers keeps its slowest figures; one with fewer than two stamps in the window has none.

    Parameters
    ----------
    stamps : worker (``COMPARISON/wK``) -> (write time, record), as ``Progress`` stamps them.
    records : worker -> every record of its ``metrics.jsonl``.
    tokens_per_step : comparison -> tokens of one training step.
    lo, hi : the window (``time.time()`` seconds).
    eval_iters : batches of each probe evaluation.

    Returns
    -------
    (comparison -> recipe -> training tokens/s, comparison -> recipe -> seconds per evaluation
    batch, comparison -> recipe -> basis).

    Example
    -------
    >>> rec = lambda step, el: {"step": step, "recipe": "a", "tokens_per_s": 1.0, "elapsed": el}
    >>> window_rates({"d/w0": [(1.0, rec(3, 0.3)), (3.0, rec(13, 1.3))]}, {"d/w0": [{"step": 8, "val_loss": 1}]},
    ...              {"d": 100}, 0.0, 9.0, 2)
    ({'d': {'a': 1000.0}}, {'d': {'a': 0.5}}, {'d': {'a': 'all workers training'}})
    """
    rates: dict[str, dict[str, float]] = {}
    eval_s: dict[str, dict[str, float]] = {}
    basis: dict[str, dict[str, str]] = {}
    for w, pts in stamps.items():
        cmp = w.split("/")[0]
        inside = [(t, r) for t, r in pts if "tokens_per_s" in r and lo <= t <= hi]
        if len(inside) < 2 or inside[-1][1]["step"] <= inside[0][1]["step"]:
            continue
        (ta, a), (tb, b) = inside[0], inside[-1]
        steps, wall = b["step"] - a["step"], tb - ta
        recipe = split_label(a["recipe"])[0]
        train, per_batch = wall, None
        if "elapsed" in a and "elapsed" in b:
            train = max(b["elapsed"] - a["elapsed"], 1e-9)
            n = sum(1 for r in records.get(w, []) if "val_loss" in r and a["step"] < r["step"] <= b["step"])
            if n:
                per_batch = max(wall - train, 0.0) / (n * eval_iters)
            else:
                train = max(train, wall)  # no evaluation in between: host time is training time
        rate = steps * tokens_per_step[cmp] / train
        if rate < rates.setdefault(cmp, {}).get(recipe, float("inf")):
            rates[cmp][recipe] = rate
            basis.setdefault(cmp, {})[recipe] = BASIS_WINDOW
        if per_batch is not None and per_batch > eval_s.setdefault(cmp, {}).get(recipe, -1.0):
            eval_s[cmp][recipe] = per_batch
    return rates, eval_s, basis


def shared_rates(stamps: dict[str, list[tuple[float, dict]]], tokens_per_step: dict[str, int], workers: int
                 ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], dict[str, dict[str, str]]]:
    """The conservative model when no window had every worker training: each recipe's rate over
    its own records after warm-up (less sharing than the real run), divided by ``workers`` (the
    real run's workers on one GPU, no gain from overlap assumed); an evaluation batch costs a
    training step at that rate.

    Parameters
    ----------
    stamps : worker (``COMPARISON/wK``) -> (write time, record).
    tokens_per_step : comparison -> tokens of one training step.
    workers : the real run's worker processes sharing the GPU.

    Returns
    -------
    (rates, seconds per evaluation batch, basis) as :func:`window_rates`.

    Example
    -------
    >>> rec = lambda step: {"step": step, "recipe": "a", "tokens_per_s": 1.0}
    >>> rates, eval_s, basis = shared_rates({"d/w0": [(1.0, rec(3)), (2.0, rec(13))]}, {"d": 100}, 4)
    >>> rates, eval_s
    ({'d': {'a': 250.0}}, {'d': {'a': 0.4}})
    """
    rates: dict[str, dict[str, float]] = {}
    eval_s: dict[str, dict[str, float]] = {}
    basis: dict[str, dict[str, str]] = {}
    for w, pts in stamps.items():
        cmp = w.split("/")[0]
        own = [(t, r) for t, r in pts if "tokens_per_s" in r and r["step"] >= PROBE_WARMUP_STEPS]
        if len(own) < 2 or own[-1][0] <= own[0][0]:
            own = [(t, r) for t, r in pts if "tokens_per_s" in r]
        if len(own) < 2 or own[-1][0] <= own[0][0] or own[-1][1]["step"] <= own[0][1]["step"]:
            continue
        rate = (own[-1][1]["step"] - own[0][1]["step"]) * tokens_per_step[cmp] / (own[-1][0] - own[0][0]) / workers
        recipe = split_label(own[0][1]["recipe"])[0]
        if rate < rates.setdefault(cmp, {}).get(recipe, float("inf")):
            rates[cmp][recipe] = rate
            eval_s.setdefault(cmp, {})[recipe] = tokens_per_step[cmp] / rate
            basis.setdefault(cmp, {})[recipe] = f"shared: its own rate / {workers} workers (no window)"
    return rates, eval_s, basis


def _fail(failed: dict[str, dict[str, str]], name: str, why_failed: dict[str, str]) -> None:
    """Record the probe runs of comparison ``name`` that failed, and say so in the log."""
    for label, why in why_failed.items():
        failed[name].setdefault(label, why)
        print(f"probe {name}/{label}: {why}; {split_label(label)[0]} is dropped from the study", flush=True)


def _kept(jobs: dict, folders: dict, failed: dict[str, dict[str, str]]) -> list[Path]:
    """The probe workers whose recipe no failed probe run drops."""
    dropped = {(name, split_label(label)[0]) for name, labels in failed.items() for label in labels}
    return [out for out in jobs if (out.parent.name, split_label(folders[out][1][0])[0]) not in dropped]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def measure(comparisons: Sequence, workers: dict[str, int], args: argparse.Namespace, deadline: Optional[float],
            start_worker: Callable) -> dict:
    """Run the probe (the module's docstring says how) and return plain data for ``plan.json``.

    Parameters
    ----------
    comparisons : ``bench.convergence.Comparison`` objects.
    workers : comparison -> workers of the real run.
    args : the driver's options (``out``, ``device``, ``probe_window_s``, ``probe_max_s``,
        ``grace_s``, ``poll_s``, ``budget_s``).
    deadline : ``time.time()`` at which the budget is spent (None: none).
    start_worker : ``bench.convergence.start_worker`` (its signature).

    Returns
    -------
    dict : ``rates`` (comparison -> recipe -> training tokens/s), ``eval_s`` (-> seconds per
    evaluation batch), ``basis``, ``per_step_rates`` (the trainer's median ``tokens_per_s`` after
    warm-up, for comparison), ``window_s``, ``startup_s`` (to the slowest worker's first training
    step) and ``failed`` (comparison -> probe run -> why it failed: diverged, crashed, hung after
    its warm-up, or no training step timed; its recipe is dropped).

    Raises
    ------
    SystemExit : the driver was interrupted, or the budget ran out, during the probe (the workers
        started so far are stopped first; the message names ``--probe-max-s`` when it is not
        shorter than what the budget left the probe).
    """
    t0 = time.time()
    by_name = {c.name: c for c in comparisons}
    groups = probe_groups({c.name: c.runs() for c in comparisons}, {c.name: c.recipes for c in comparisons}, workers)
    folders = {args.out / "probe" / name / f"w{k}": (by_name[name], g)
               for name, gs in groups.items() for k, g in enumerate(gs)}
    devices = iter(worker_devices(args.device, len(folders)))
    clear_worker_dirs(list(folders))
    jobs: dict = {}
    try:
        for out, (cmp, group) in folders.items():
            jobs[out] = start_worker(cmp, group, out, PROBE_MAX_STEPS, next(devices), args, PROBE_EVAL_INTERVAL,
                                     PROBE_EVAL_ITERS, warmup=PROBE_LR_WARMUP_STEPS,
                                     lr_decay_steps=PROBE_LR_DECAY_STEPS)
    except KeyboardInterrupt as e:  # as run_plan does: stop what started
        stop_workers(jobs, args.grace_s)
        raise SystemExit(f"{interrupt_cause(e)} while the probe started its workers: no run was planned.") from None
    watch = {out: Progress(out) for out in jobs}
    window = Window(watch, {out: (lambda p=p: p.poll() is None) for out, p in jobs.items()}, args.probe_window_s,
                    t0 + args.probe_max_s)
    cause = f"the time budget ran out during the probe (--budget-s {args.budget_s:g})"
    fix = "give a larger --budget-s or fixed --steps"
    if deadline is not None and args.probe_max_s >= deadline - t0:  # the probe may wait past the budget
        cause = (f"the time budget ran out during the probe (--budget-s {args.budget_s:g}; --probe-max-s "
                 f"{args.probe_max_s:g} is not shorter than the {deadline - t0:.0f} s the budget left it)")
        fix = "give a shorter --probe-max-s, a larger --budget-s or fixed --steps"
    done, interrupted = run_workers(jobs, deadline, cause, args.grace_s, args.poll_s, watch, window)
    if interrupted or any(end.stopped == cause for end in done.values()):
        raise SystemExit(f"{interrupted or cause}: no run was planned (the probe is in {args.out / 'probe'}); "
                         f"{fix}.")
    key = {out: f"{out.parent.name}/{out.name}" for out in jobs}
    records = {key[out]: _records(out) for out in jobs}
    failed: dict[str, dict[str, str]] = {c.name: {} for c in comparisons}
    for out, end in done.items():
        # a run that diverged, or whose worker ended before the driver stopped it (a crash), fails
        metrics = [out / "metrics.jsonl"] if (out / "metrics.jsonl").is_file() else []
        why_failed = failed_runs(metrics, None if end.stopped else PROBE_MAX_STEPS, folders[out][1],
                                 cut={label: f"the probe stopped it ({end.stopped})" for label in folders[out][1]
                                      if end.stopped})
        if why_failed and end.exit and not end.stopped:
            print(f"probe {out}: exit {end.exit}\n" + (out / "driver.log").read_text()[-3000:], flush=True)
        _fail(failed, out.parent.name, why_failed)
    ok = _kept(jobs, folders, failed)
    warm = [warm_time(watch[out].stamps) for out in ok]
    lo = max((w for w in warm if w is not None), default=0.0)
    hi = min((watch[out].stamps[-1][0] for out in ok if watch[out].stamps), default=lo)
    window_s = max(0.0, hi - lo) if ok and None not in warm else 0.0
    for out in ok:  # hung after its warm-up: the rate of its records before the hang is not a rate
        if out in window.stalled:
            stall = window.stalled[out].split(": ", 1)[1]
            _fail(failed, out.parent.name, {label: f"hung after its warm-up ({stall}): the probe stopped it"
                                            for label in folders[out][1]})
    ok = _kept(jobs, folders, failed)
    stamps = {key[out]: watch[out].stamps for out in ok}
    tps = {c.name: c.tokens_per_step for c in comparisons}
    if any(end.stopped == WINDOW_CAUSE for end in done.values()):
        rates, eval_s, basis = window_rates(stamps, records, tps, lo, hi, PROBE_EVAL_ITERS)
    else:
        rates, eval_s, basis = {}, {}, {}
    real_workers = sum(workers.values())
    fallback = shared_rates(stamps, tps, real_workers)
    missing = [(name, r) for name, rs in fallback[0].items() for r in rs if r not in rates.get(name, {})]
    for name, r in missing:
        for table, source in zip((rates, eval_s, basis), fallback):
            table.setdefault(name, {})[r] = source[name][r]
    conservative = (f"planned as if the {real_workers} workers shared the GPU with no gain from overlap "
                    "(conservative: fewer steps)")
    if missing and any(end.stopped == WINDOW_CAUSE for end in done.values()):  # never silent
        inside = {(out.parent.name, split_label(folders[out][1][0])[0]):
                  sum(1 for t, r in watch[out].stamps if "tokens_per_s" in r and lo <= t <= hi) for out in ok}
        told = "; ".join(f"{name}/{r}: {inside.get((name, r), 0)} training record"
                         f"{'' if inside.get((name, r), 0) == 1 else 's'} inside the {window_s:.1f} s window"
                         for name, r in missing)
        print(f"probe: the window came, but too few records to time a rate in it ({told}): {conservative}. A "
              "worker that writes its records in bursts (long steps, evaluations) needs a longer "
              "--probe-window-s.", flush=True)
    elif missing:
        hint = ("A worker that stopped writing records held the window open (named above), not too short a probe"
                if window.stalled else "Give the probe more time (--probe-max-s, a larger --budget-s) or a "
                "shorter --probe-window-s")
        print(f"probe: no window of every worker training for {args.probe_window_s:g} s (measured "
              f"{window_s:.1f} s) to time {', '.join(f'{n}/{r}' for n, r in missing)}: {conservative}. {hint}.",
              flush=True)
    for out in ok:  # records but no rate (still in its first step): dropped by name, never silently
        name, recipe = out.parent.name, split_label(folders[out][1][0])[0]
        if recipe not in rates.get(name, {}):
            end = done[out]
            how = f"the probe stopped it ({end.stopped})" if end.stopped else f"its worker ended (exit {end.exit})"
            _fail(failed, name, {label: f"no training step timed: {how}" for label in folders[out][1]})
    ok = _kept(jobs, folders, failed)
    per_step: dict[str, dict[str, float]] = {c.name: {} for c in comparisons}
    for out in ok:
        v = sorted(r["tokens_per_s"] for r in records[key[out]]
                   if "tokens_per_s" in r and r["step"] > PROBE_WARMUP_STEPS)
        if v:
            per_step[out.parent.name].setdefault(split_label(folders[out][1][0])[0], v[len(v) // 2])
    firsts = [next(t for t, r in w.stamps if "tokens_per_s" in r) for w in watch.values()
              if any("tokens_per_s" in r for _, r in w.stamps)]
    return {"rates": {c.name: rates.get(c.name, {}) for c in comparisons},
            "eval_s": {c.name: eval_s.get(c.name, {}) for c in comparisons}, "per_step_rates": per_step,
            "basis": basis, "window_s": window_s, "startup_s": max(firsts, default=t0) - t0, "failed": failed,
            "window_target_s": args.probe_window_s, "eval_iters": PROBE_EVAL_ITERS}


__all__ = ["BASIS_WINDOW", "EVALS_MAX", "PROBE_EVAL_INTERVAL", "PROBE_EVAL_ITERS", "PROBE_LR_DECAY_STEPS",
           "PROBE_LR_WARMUP_STEPS", "PROBE_MAX_STEPS",
           "PROBE_WARMUP_STEPS", "PROBE_WINDOW_S", "Window", "evaluations", "measure", "probe_groups",
           "shared_rates", "warm_time", "window_rates"]
