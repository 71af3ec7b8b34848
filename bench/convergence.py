"""The convergence study: every recipe at several seeds on the packages corpus, in a time budget, on one GPU.

Two comparisons, each a set of runs ``RECIPE@seed=K`` (``--seeds`` values of K from
``--first-seed``, default 0). A seed fixes
the initial weights *and* the data order, the same for every recipe, so the report pairs each
recipe with BF16 seed by seed (``bench.convergence_report``: gap to BF16 with a 95 % interval
and a met / missed / unresolved verdict per target):

- dense, preset ``gpt-100m`` (101.5M parameters: 8 layers x 1024, SwiGLU 2752): BF16, FP8
  current, FP8 block, MXFP8, NVFP4-fwd / MXFP8-bwd, MXFP8-fwd / NVFP4-bwd;
- MoE, preset ``moe-small`` (84.1M: 8 experts top-2): BF16 and the Composer-2-style factory
  ``nvfp4-row-scaled-fwd-mxfp8-bwd``.

Data: ``--data packages`` (``hybridfp.train.corpus``: the installed packages' and the
standard library's sources and text, deduplicated, split by file, ~95M training tokens at the
default 100 MB cap). The driver builds it (or finds it cached) before any run; its fingerprint
goes into ``plan.json``, the report, and every worker's ``summary.md`` (its data line), and the
report flags a worker that trained on another.

Execution: ``--jobs N`` worker processes share the GPU (default 8; split over the two
comparisons in proportion to their runs). Each worker is one ``hybridfp train --compare
--no-checkpoint`` that trains its share of the runs one after the other (one process start and
one kernel compile per worker, not per run; no checkpoint: the study reads only the metrics).
Runs go to workers longest first by their probed cost, so the workers end together.

Failures: a recipe dropped at the probe, and one with any run that diverged, stopped early or
never started, stays in the report with the verdict ``failed`` and its runs named
(``bench.convergence_report.failed_runs``), never judged on the seeds that survived.

Plan: a probe (``bench.convergence_probe``) starts a worker per recipe at once and stops them
when every one has trained for ``--probe-window-s`` seconds together, however far apart they
started; each recipe's training rate and evaluation cost are measured in that window, under the
sharing of the real run (the trainer's per-step ``tokens_per_s`` is kept as ``per_step_rates``).
No window within ``--probe-max-s``: the workers are planned as sharing the GPU with no gain from
overlap (conservative), and the log and ``plan.json``'s ``basis`` say so. Start-up is the time
to the slowest worker's first training step. The steps per run are then the most that let the
most loaded worker train and evaluate its runs in what is left of ``--budget-s``, less
``--eval-fraction`` for set-up and ``--safety-margin`` (15 %) for the probe's error; every run of
a comparison trains the same steps (same cosine schedule, warm-up a tenth of them). The plan
records each worker's predicted seconds and the report sets them beside the actual ones.

Deadline: ``--budget-s`` counts from the driver's start and is hard. Workers still running when
it is spent get SIGTERM, then SIGKILL after ``--grace-s``; their unfinished runs fail with
``stopped at step N: the time budget ran out`` (or ``never started: ...``), and the reports are
written from what finished. SIGTERM or Ctrl-C of the driver does the same (the runs fail as
``the driver was interrupted``) and then exits non-zero, so an outer ``timeout`` loses nothing
measured: give it ``--grace-s`` plus some seconds for the reports beyond ``--budget-s``.

Expected size at the default budget (470 s, probe included): unmeasured with the windowed probe
(``plan.json`` and the report give each study's figure). A run trains a few percent of the
corpus, so no run sees a byte twice.

    python -m bench.convergence --out runs/convergence [--budget-s 470] [--json results.json]
    python -m bench.convergence --steps 200           # fixed steps for both comparisons, no probe
                                                      # (still cut at --budget-s)
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from bench.convergence_report import failed_runs, split_label
from bench.convergence_probe import EVALS_MAX, PROBE_WINDOW_S, eval_interval, evaluations, measure
from bench.convergence_workers import (GRACE_S, POLL_S, WorkerEnd, clear_worker_dirs, interrupt_cause, predict,
                                       raise_interrupted, run_workers, signals_ignored, stop_workers, workers_table)
from hybridfp.train.files import atomic_write_text
from hybridfp.train.data import load_data
from hybridfp.train.model import PRESETS
from hybridfp.train.parallel import worker_devices

DENSE = ("bf16", "fp8", "fp8-block", "mxfp8", "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8", "mxfp8-fwd-nvfp4-bwd")
MOE = ("bf16", "nvfp4-row-scaled-fwd-mxfp8-bwd")
#: Default ``--budget-s``: wall seconds for the probe and every run.
BUDGET_S = 470.0
#: Default ``--safety-margin``: the share of the time left after the probe that the plan does not
#: fill (the probe's rates are measured over a few seconds and can still be off).
SAFETY_MARGIN = 0.15


@dataclass(frozen=True)
class Comparison:
    """One comparison: a preset and its recipes, each trained at every seed.

    Raises
    ------
    ValueError : ``batch_size`` below 1 or ``lr`` not positive (naming the option).

    Example
    -------
    >>> Comparison("dense", "test", ("bf16", "fp8"), 2).runs()
    ['bf16@seed=0', 'fp8@seed=0', 'bf16@seed=1', 'fp8@seed=1']
    >>> Comparison("dense", "test", ("bf16",), 2, first_seed=3).runs()
    ['bf16@seed=3', 'bf16@seed=4']
    """

    name: str
    preset: str
    recipes: tuple[str, ...]
    seeds: int
    #: sequences a step instead of the preset's (``hybridfp train --batch-size``)
    batch_size: Optional[int] = None
    #: peak learning rate instead of the preset's (``hybridfp train --lr``)
    lr: Optional[float] = None
    #: the first seed: a study continued in another process trains seeds that follow on
    first_seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--{self.name}-batch-size (batch_size) must be at least 1; got {self.batch_size}.")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--{self.name}-lr (lr) must be positive; got {self.lr}.")
        if self.first_seed < 0:
            raise ValueError(f"--first-seed (first_seed) must be at least 0; got {self.first_seed}.")

    def runs(self) -> list[str]:
        """Run labels, seed-major (every recipe at the first seed first): ``RECIPE@seed=K``."""
        return [f"{r}@seed={s}" for s in range(self.first_seed, self.first_seed + self.seeds) for r in self.recipes]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one training step of the preset."""
        return (self.batch_size or PRESETS[self.preset].batch_size) * PRESETS[self.preset].seq_len


def split_recipes(text: str) -> tuple[str, ...]:
    """A comma-separated recipe list; commas inside ``per_gemm:fprop=F,dgrad=D,wgrad=W`` stay.

    Example
    -------
    >>> split_recipes("bf16,per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8,fp8")
    ('bf16', 'per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8', 'fp8')
    """
    from hybridfp.train.recipes_by_name import parse_recipe_list
    return tuple(r.label for r in parse_recipe_list(text))


def split_jobs(jobs: int, counts: Sequence[int]) -> list[int]:
    """Workers per comparison: ``jobs`` shared in proportion to the run ``counts`` (at least one
    each, never more than a comparison's runs); 0 gives every run its own worker.

    Example
    -------
    >>> split_jobs(8, [18, 6]), split_jobs(0, [18, 6]), split_jobs(1, [3, 3])
    ([6, 2], [18, 6], [1, 1])
    """
    if jobs <= 0 or jobs >= sum(counts):
        return list(counts)
    share = [jobs * c / sum(counts) for c in counts]
    out = [max(1, int(s)) for s in share]
    while sum(out) < jobs:  # largest remainder first
        i = max((k for k in range(len(out)) if out[k] < counts[k]), key=lambda k: (share[k] - out[k], -k))
        out[i] += 1
    while sum(out) > max(jobs, len(counts)):
        out[max(range(len(out)), key=lambda k: out[k])] -= 1
    return out


def assign(runs: Sequence[str], cost: dict[str, float], workers: int) -> list[list[str]]:
    """Runs per worker, longest first onto the least loaded worker (each worker's runs kept in the
    given order). ``cost``: seconds per token of a run's recipe (missing: 1).

    Example
    -------
    >>> assign(["a@seed=0", "b@seed=0", "a@seed=1", "b@seed=1"], {"a": 2.0, "b": 1.0}, 2)
    [['a@seed=0', 'b@seed=0'], ['a@seed=1', 'b@seed=1']]
    """
    def c(label: str) -> float:
        return cost.get(split_label(label)[0], 1.0)
    load = [0.0] * workers
    chosen: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(runs)), key=lambda i: (-c(runs[i]), i)):
        k = min(range(workers), key=lambda k: (load[k], k))
        load[k] += c(runs[i])
        chosen[k].append(i)
    return [[runs[i] for i in sorted(idx)] for idx in chosen if idx]


def plan_tokens(groups: Sequence[Sequence[str]], cost: dict[str, float], seconds: float,
                run_eval_s: Optional[dict[str, float]] = None) -> float:
    """Tokens per run so that the most loaded worker trains its runs in ``seconds``, after its runs'
    evaluations (``run_eval_s``: recipe -> seconds of one run's evaluations; missing: 0).

    Example
    -------
    >>> plan_tokens([["a@seed=0", "b@seed=0"], ["a@seed=1"]], {"a": 1e-5, "b": 3e-5}, 100.0)
    2500000.0
    >>> plan_tokens([["a@seed=0", "b@seed=0"], ["a@seed=1"]], {"a": 1e-5, "b": 3e-5}, 100.0, {"a": 10.0})
    2250000.0
    """
    def r(label: str) -> str:
        return split_label(label)[0]
    return min((seconds - sum((run_eval_s or {}).get(r(label), 0.0) for label in g))
               / sum(cost[r(label)] for label in g) for g in groups)


# ---------------------------------------------------------------------------- processes
def start_worker(cmp: Comparison, labels: Sequence[str], out: Path, steps: int, device: str,
                 args: argparse.Namespace, eval_interval: int, eval_iters: int, warmup: Optional[int] = None,
                 lr_decay_steps: Optional[int] = None) -> subprocess.Popen:
    """One ``hybridfp train --compare`` training ``labels`` one after the other into ``out``.

    Parameters
    ----------
    cmp : the comparison (preset, batch size and learning rate overrides).
    labels : the runs, ``RECIPE@seed=K``, trained in this order.
    out : the worker's folder (the caller clears it first: :func:`clear_worker_dirs`).
    steps : training steps of every run.
    device : the worker's device (``cuda:K``).
    args : the driver's options (``data``, ``cache_dir``).
    eval_interval, eval_iters : evaluation every ``eval_interval`` steps over ``eval_iters`` batches.
    warmup, lr_decay_steps : the learning rate's warm-up steps and cosine length (None: a tenth of
        ``steps`` and ``steps``, a real run's; the probe, whose ``steps`` is never reached, gives
        those of a real run's size).

    Returns
    -------
    subprocess.Popen : the worker, its output in ``out / "driver.log"``.
    """
    argv = [sys.executable, "-m", "hybridfp.train", "--preset", cmp.preset, "--compare", ",".join(labels),
            "--device", device, "--steps", str(steps),
            "--warmup", str(max(1, steps // 10) if warmup is None else warmup),
            "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters), "--data", args.data,
            "--out", str(out), "--no-progress", "--no-checkpoint",  # the study reads metrics only
            # the activation every committed seed trained with: a study's seeds pool across runs
            "--eager-swiglu"]
    if lr_decay_steps is not None:
        argv += ["--lr-decay-steps", str(lr_decay_steps)]
    if args.cache_dir:
        argv += ["--cache-dir", str(args.cache_dir)]
    if cmp.batch_size is not None:
        argv += ["--batch-size", str(cmp.batch_size)]
    if cmp.lr is not None:
        argv += ["--lr", repr(cmp.lr)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "driver.log", "w") as log:  # the worker holds its own copy of the handle
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def probe(comparisons: Sequence[Comparison], workers: dict[str, int], args: argparse.Namespace,
          deadline: Optional[float] = None) -> dict:
    """Every recipe trained by workers started at once until every worker has trained for
    ``--probe-window-s`` seconds together (``bench.convergence_probe``: the rates under the real
    run's sharing, the evaluations' cost, the conservative model when no such window came).

    Returns
    -------
    dict : ``bench.convergence_probe.measure``'s plain data (``rates``, ``eval_s``, ``basis``,
        ``window_s``, ``startup_s``, ``failed``, ...).

    Raises
    ------
    SystemExit : the driver was interrupted, or the deadline came, during the probe (the workers
        started so far are stopped first).
    """
    return measure(comparisons, workers, args, deadline, start_worker)


def fingerprints_seen(out: Path) -> Optional[str]:
    """The data line of a worker's summary.md (what the training process loaded), if written."""
    summary = out / "summary.md"
    if not summary.is_file():
        return None
    return next((line for line in summary.read_text().splitlines() if line.startswith("Data:")), None)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m bench.convergence``: parse the options, then :func:`plan_and_run` with SIGTERM
    turned into :class:`bench.convergence_workers.Interrupted` (the workers are stopped and the
    reports written).

    Parameters
    ----------
    argv : the options (None: ``sys.argv[1:]``); ``--help`` lists them.

    Raises
    ------
    SystemExit : a bad option (naming it), a plan that cannot be made, or an interrupt (after the
        reports are written); see :func:`plan_and_run`.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/convergence"))
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall time for the probe and the runs, fixed --steps runs included: workers still "
                        f"running then are stopped (default {BUDGET_S:g})")
    p.add_argument("--eval-fraction", type=float, default=0.2,
                   help="share of the time after the probe kept for each run's set-up and host stalls "
                        "(the evaluations are planned from the probe's measurement)")
    p.add_argument("--probe-window-s", type=float, default=PROBE_WINDOW_S,
                   help="seconds every probe worker must train at once: the rates are measured in them")
    p.add_argument("--probe-max-s", type=float, default=None,
                   help="seconds the probe waits for that window (default half of --budget-s); without it "
                        "the plan assumes the workers share the GPU with no gain from overlap")
    p.add_argument("--safety-margin", type=float, default=SAFETY_MARGIN,
                   help="share of the time left after the probe kept unplanned (the probe's error)")
    p.add_argument("--grace-s", type=float, default=GRACE_S,
                   help="seconds a worker gets to exit after SIGTERM (deadline, interrupt) before SIGKILL")
    p.add_argument("--poll-s", type=float, default=POLL_S, help="seconds between reads of the workers' progress")
    p.add_argument("--seeds", type=int, default=3, help="seeds per recipe (init and data order)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first seed (default 0): a study continued in later runs with fixed "
                        "--dense-steps / --moe-steps trains the seeds that follow; bench.convergence_report "
                        "pairs the metrics files of all of them")
    p.add_argument("--jobs", type=int, default=8,
                   help="worker processes sharing the GPU(s), split over the comparisons (0: one per run)")
    p.add_argument("--data", default="packages", help="the training data (hybridfp train --data)")
    p.add_argument("--cache-dir", type=Path, default=None, help="hybridfp train --cache-dir")
    p.add_argument("--dense-preset", default="gpt-100m")
    p.add_argument("--moe-preset", default="moe-small")
    for name in ("dense", "moe"):  # larger batches: less gradient noise, trajectories that part less
        p.add_argument(f"--{name}-batch-size", type=int, default=None,
                       help=f"sequences a step of the {name} runs (default: the preset's)")
        p.add_argument(f"--{name}-lr", type=float, default=None,
                       help=f"peak learning rate of the {name} runs (default: the preset's)")
    p.add_argument("--dense-recipes", default=",".join(DENSE))
    p.add_argument("--moe-recipes", default=",".join(MOE), help="empty: no MoE comparison")
    p.add_argument("--device", default="cuda")
    p.add_argument("--eval-iters", type=int, default=16, help="validation batches per evaluation")
    p.add_argument("--steps", type=int, default=None,
                   help="fixed steps for every comparison (no probe); still cut at --budget-s")
    p.add_argument("--dense-steps", type=int, default=None,
                   help="fixed steps of the dense comparison; still cut at --budget-s")
    p.add_argument("--moe-steps", type=int, default=None,
                   help="fixed steps of the MoE comparison; still cut at --budget-s")
    p.add_argument("--json", type=Path, default=None, help="also write the plan and the reports here")
    args = p.parse_args(argv)
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1; got {args.seeds}.")
    for name in ("eval_fraction", "safety_margin"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [0, 1); got {getattr(args, name)}.")
    for name in ("probe_window_s", "probe_max_s"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive; got {getattr(args, name)}.")
    if args.budget_s is None:
        args.budget_s = BUDGET_S
        fixed = [f for f in ("steps", "dense_steps", "moe_steps") if getattr(args, f) is not None]
        if fixed:  # the deadline is hard for fixed runs too: a long fixed plan would be cut silently
            print(f"warning: {', '.join('--' + f.replace('_', '-') for f in fixed)} given with the default "
                  f"--budget-s {BUDGET_S:g}: runs still training then are stopped and fail; give a --budget-s "
                  "that fits the fixed steps.", flush=True)
    if args.probe_max_s is None:
        args.probe_max_s = args.budget_s / 2
        max_given = f"--probe-max-s (default half of --budget-s {args.budget_s:g})"
    else:
        max_given = "--probe-max-s"
    probed = [n for n in ("dense",) + (("moe",) if args.moe_recipes else ())
              if getattr(args, f"{n}_steps") is None and args.steps is None]
    if probed and not args.probe_window_s < args.probe_max_s:  # the window could never come
        raise SystemExit(f"--probe-window-s ({args.probe_window_s:g}) must be shorter than {max_given} "
                         f"({args.probe_max_s:g}): the probe waits at most --probe-max-s for a window of "
                         "--probe-window-s.")
    t0 = time.time()
    # an outer time-out sends SIGTERM: stop the workers and write the reports (Interrupted)
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        plan_and_run(args, t0)
    finally:
        signal.signal(signal.SIGTERM, previous)


def plan_and_run(args: argparse.Namespace, t0: float) -> None:
    """Plan (probe or fixed steps), write ``plan.json``, run it (:func:`run_plan`).

    Parameters
    ----------
    args : the driver's options (:func:`main`).
    t0 : the driver's start (``time.time()``); ``--budget-s`` counts from it.

    Raises
    ------
    SystemExit : a bad recipe list or override, bf16 missing or dropped at the probe, a budget that
        buys fewer than 10 steps per run, or an interrupt (:func:`probe`, :func:`run_plan`).
    """
    try:
        comparisons = [Comparison("dense", args.dense_preset, split_recipes(args.dense_recipes), args.seeds,
                                  args.dense_batch_size, args.dense_lr, args.first_seed)]
        if args.moe_recipes:
            comparisons.append(Comparison("moe", args.moe_preset, split_recipes(args.moe_recipes), args.seeds,
                                          args.moe_batch_size, args.moe_lr, args.first_seed))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    for c in comparisons:
        if "bf16" not in c.recipes:
            raise SystemExit(f"--{c.name}-recipes: the study compares against bf16; add it to the list.")
    data = load_data(args.data, args.cache_dir)  # built once here, cached for the workers
    print(f"data: {data.describe()}", flush=True)
    workers = dict(zip((c.name for c in comparisons), split_jobs(args.jobs, [len(c.runs()) for c in comparisons])))
    fixed = {c.name: args.steps if getattr(args, f"{c.name}_steps") is None else getattr(args, f"{c.name}_steps")
             for c in comparisons}
    plan: dict = {"data": {"spec": args.data, "source": data.source, "fingerprint": data.fingerprint,
                           "train_tokens": len(data.train), "val_tokens": len(data.val)},
                  "seeds": args.seeds, "first_seed": args.first_seed, "workers": workers, "budget_s": args.budget_s, "comparisons": {}}
    cost: dict[str, dict[str, float]] = {c.name: {} for c in comparisons}
    startup = 0.0
    if any(v is None for v in fixed.values()):
        plan["probe"] = probe(comparisons, workers, args, t0 + args.budget_s)
        startup = plan["probe"]["startup_s"]
        left = args.budget_s - (time.time() - t0) - startup
        seconds = left * (1 - args.eval_fraction) * (1 - args.safety_margin)
        plan["probe"].update(wall_s=time.time() - t0, train_s=seconds, eval_fraction=args.eval_fraction,
                             safety_margin=args.safety_margin)
        print(f"probe done in {time.time() - t0:.0f} s ({plan['probe']['window_s']:.0f} s of all workers training); "
              f"start-up {startup:.0f} s; {seconds:.0f} s to train and evaluate (less {args.eval_fraction:.0%} "
              f"for set-up and a {args.safety_margin:.0%} margin)", flush=True)
        if seconds <= 0:
            raise SystemExit(f"the probe and the workers' start-up took {time.time() - t0 + startup:.0f} s of the "
                             f"{args.budget_s:.0f} s budget; give a larger --budget-s (or fixed --steps).")
        cost = {c.name: {r: 1.0 / v for r, v in plan["probe"]["rates"][c.name].items() if v > 0}
                for c in comparisons}

    def eval_batch_s(c: Comparison) -> dict[str, float]:  # unmeasured: a training step (an upper bound)
        measured = plan.get("probe", {}).get("eval_s", {}).get(c.name, {})
        return {r: measured.get(r, c.tokens_per_step * v) for r, v in cost[c.name].items()}
    for c in comparisons:
        recipes = c.recipes if fixed[c.name] is not None else tuple(r for r in c.recipes if r in cost[c.name])
        if "bf16" not in recipes:
            why = {label: w for label, w in plan.get("probe", {}).get("failed", {}).get(c.name, {}).items()
                   if split_label(label)[0] == "bf16"}
            raise SystemExit(f"{c.name}: the bf16 probe failed" + "".join(f" ({label}: {w})" for label, w in why.items())
                             + f"; see {args.out / 'probe' / c.name}.")
        kept = Comparison(c.name, c.preset, recipes, c.seeds, c.batch_size, c.lr, c.first_seed)
        groups = assign(kept.runs(), cost[c.name], workers[c.name])
        steps = fixed[c.name]
        if steps is None:
            bound = {r: EVALS_MAX * args.eval_iters * v for r, v in eval_batch_s(c).items()}
            steps = int(plan_tokens(groups, cost[c.name], seconds, bound) / c.tokens_per_step)
            if steps < 10:
                evals = max(sum(bound[split_label(label)[0]] for label in g) for g in groups)
                raise SystemExit(f"{c.name}: the budget left after the probe ({seconds:.0f} s to train and evaluate) "
                                 f"buys {max(steps, 0)} steps per run; the evaluations of a worker's runs alone "
                                 f"take up to {evals:.0f} s (at most {EVALS_MAX} per run of --eval-iters "
                                 f"{args.eval_iters} batches). Give a larger --budget-s, a smaller --eval-iters, "
                                 "fewer --seeds or recipes.")
        if fixed[c.name] is None and plan["probe"].get("failed", {}).get(c.name):
            why = plan["probe"]["failed"][c.name]
            print(f"{c.name}: dropped at the probe: " + ", ".join(f"{label} ({why[label]})" for label in why),
                  flush=True)
        plan["comparisons"][c.name] = {
            "preset": c.preset, "batch_size": c.batch_size, "lr": c.lr, "steps": steps,
            "tokens_per_run": steps * c.tokens_per_step,
            "recipes": list(recipes), "dropped": [r for r in c.recipes if r not in recipes], "workers": groups}
        if cost[c.name]:  # wall seconds from the workers' start: start-up, training, evaluations
            run_eval = {r: evaluations(steps) * args.eval_iters * v for r, v in eval_batch_s(c).items()}
            plan["comparisons"][c.name]["predicted_s"] = [predict(g, cost[c.name], startup, steps * c.tokens_per_step,
                                                                  args.eval_fraction, run_eval) for g in groups]
        print(f"{c.name}: {len(kept.runs())} runs x {steps} steps ({steps * c.tokens_per_step / 1e6:.2f}M tokens "
              f"each) on {len(groups)} workers", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "plan.json", json.dumps(plan, indent=1))
    run_plan(args, comparisons, plan, t0)


def run_plan(args: argparse.Namespace, comparisons: Sequence[Comparison], plan: dict, t0: float) -> None:
    """Start every worker of ``plan``, wait until they end or ``--budget-s`` (from ``t0``) is spent,
    stop the rest, merge each comparison's metrics and write the reports. Runs cut short fail with
    the reason; an interrupt of the driver (SIGTERM, KeyboardInterrupt) also writes the reports
    and then exits non-zero. Each worker's folder is cleared before the workers start; a second
    signal while the workers are stopped or the reports written is ignored.

    Parameters
    ----------
    args : the driver's options (:func:`main`): ``out``, ``budget_s``, ``grace_s``, ``poll_s``, ...
    comparisons : the comparisons of the plan.
    plan : ``plan.json``'s content (:func:`plan_and_run`): per comparison its steps and workers.
    t0 : the driver's start (``time.time()``); ``--budget-s`` counts from it.

    Raises
    ------
    SystemExit : the driver was interrupted (after the reports are written).
    """
    jobs: dict[Path, subprocess.Popen] = {}
    started = time.time()
    devices = iter(worker_devices(args.device, sum(len(v["workers"]) for v in plan["comparisons"].values())))
    cause = f"the time budget ran out (--budget-s {args.budget_s:g})"
    planned = [(c, args.out / c.name / f"w{k}", group) for c in comparisons
               for k, group in enumerate(plan["comparisons"][c.name]["workers"])]
    clear_worker_dirs([out for _, out, _ in planned])
    try:
        for c, out, group in planned:
            steps = plan["comparisons"][c.name]["steps"]
            jobs[out] = start_worker(c, group, out, steps, next(devices), args, eval_interval(steps), args.eval_iters)
    except KeyboardInterrupt as e:  # while starting: stop what started, report every run as cut
        with signals_ignored():
            interrupted = interrupt_cause(e)
            signalled = stop_workers(jobs, args.grace_s)
            done = {out: WorkerEnd(p.returncode, time.time() - started, interrupted if out in signalled else None)
                    for out, p in jobs.items()}
            # never started: their runs fail naming the interrupt (not an earlier worker's stop)
            done.update({out: WorkerEnd(None, 0.0, interrupted) for _, out, _ in planned if out not in jobs})
    else:
        done, interrupted = run_workers(jobs, t0 + args.budget_s, cause, args.grace_s, args.poll_s)
    with signals_ignored():  # a second signal must not cut the reports short
        for out, end in sorted(done.items()):
            log = "\n" + (out / "driver.log").read_text()[-3000:] if end.exit and not end.stopped else ""
            print(f"== {out} (exit {end.exit}, {end.wall_s:.0f} s"
                  + (f"; stopped: {end.stopped})" if end.stopped else ")") + log, flush=True)
        ends = {f"{out.parent.name}/{out.name}": {"exit": e.exit, "wall_s": e.wall_s, "stopped": e.stopped}
                for out, e in done.items()}
        write_reports(args.out, plan, args.json, ends)
    if interrupted:
        raise SystemExit(f"{interrupted}: stopped the workers; what finished is in {args.out / 'report.md'}")
    print(f"study done in {time.time() - t0:.0f} s: {args.out / 'report.md'}", flush=True)


def write_reports(out: Path, plan: dict, json_path: Optional[Path] = None,
                  ends: Optional[dict[str, dict]] = None) -> dict:
    """Per comparison: merged ``metrics.jsonl`` and its statistics; ``report.md`` / ``report.json``
    (and ``json_path``) with the plan and the corpus fingerprint each worker trained on.

    ``ends``: ``COMPARISON/wK`` -> ``{"exit", "wall_s", "stopped"}`` (:class:`WorkerEnd`). The runs
    of a worker the driver stopped that did not complete fail with its ``stopped`` reason (the
    budget ran out, the driver was interrupted); each worker's predicted seconds (the plan's
    ``predicted_s``) and actual ones are listed, so the planning error is visible. Every file is
    written atomically (``hybridfp.train.files.atomic_write_text``): a kill leaves the old file or
    the new one, never a part.

    Parameters
    ----------
    out : the study's folder (``--out``): the workers' folders ``COMPARISON/wK`` are read there.
    plan : ``plan.json``'s content (:func:`plan_and_run`).
    json_path : also write ``report.json``'s content here (``--json``).
    ends : ``COMPARISON/wK`` -> how the worker ended (above); None: no workers table.

    Returns
    -------
    dict : ``report.json``'s content: ``plan``, ``env``, ``markdown`` and per comparison ``studies``
        (``stats``, ``failed_runs``, ``workers``, ...).
    """
    from bench.common import environment
    from bench.convergence_report import analyze, to_markdown
    from bench.convergence_trajectory import gaps_by_step
    from bench.convergence_trajectory import to_markdown as trajectory_markdown
    fp = plan["data"]["fingerprint"]
    result: dict = {"name": "convergence", "env": environment(), "plan": plan, "studies": {}}
    md = [f"Corpus: `{plan['data']['spec']}`, fingerprint `{fp}` ({plan['data']['train_tokens']:,} train / "
          f"{plan['data']['val_tokens']:,} validation tokens).", ""]
    first = plan.get("first_seed", 0)
    seeds = range(first, first + plan.get("seeds", 1))  # every seed the plan meant to train
    for name, entry in plan["comparisons"].items():
        outs = [out / name / f"w{k}" for k in range(len(entry["workers"]))]
        merged = "".join((o / "metrics.jsonl").read_text() for o in outs if (o / "metrics.jsonl").is_file())
        (out / name).mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / name / "metrics.jsonl", merged)
        seen = {str(o.name): fingerprints_seen(o) for o in outs}
        worker_ends = [(ends or {}).get(f"{name}/w{k}", {}) for k in range(len(entry["workers"]))]
        cut = {label: e["stopped"] for group, e in zip(entry["workers"], worker_ends) if e.get("stopped")
               for label in group}
        other = sorted(k for k, line in seen.items() if line is None or fp not in line)
        started = {json.loads(line)["recipe"] for line in merged.splitlines() if line.strip()}
        # a worker that stops (a run that diverged raises) never starts its later runs
        missing = [label for group in entry["workers"] for label in group if label not in started]
        # recipes the probe dropped stay in the report, failed: every seed the plan meant to train
        probe_failed = plan.get("probe", {}).get("failed", {}).get(name, {})
        dropped = {f"{r}@seed={s}": "dropped at the probe" + "".join(
                       f" ({label}: {why})" for label, why in probe_failed.items() if split_label(label)[0] == r)
                   for r in entry.get("dropped", [])
                   for s in seeds}
        expected = [label for group in entry["workers"] for label in group]
        study: dict = {"data_lines": seen, "workers_on_other_data": other, "never_started": missing}
        paths = [out / name / "metrics.jsonl"]
        predicted = entry.get("predicted_s", [None] * len(entry["workers"]))
        study["workers"] = [{"worker": f"w{k}", "runs": len(group), "predicted_s": predicted[k],
                             "actual_s": e.get("wall_s"), "exit": e.get("exit"), "stopped": e.get("stopped")}
                            for k, (group, e) in enumerate(zip(entry["workers"], worker_ends))]
        study["failed_runs"] = failed_runs(paths, entry["steps"], expected, dropped, cut)
        try:
            study["stats"] = analyze(paths, steps=entry["steps"], expected=expected, dropped=dropped, cut=cut)
            study["markdown"] = to_markdown(study["stats"])
            study["failed"] = study["stats"]["failed"]
            try:  # when each seed's gap was set: tells longer runs from more seeds (docs/convergence.md)
                study["trajectory"] = gaps_by_step(paths, entry["steps"], exclude=study["failed"])
                study["markdown"] += "\n\n" + trajectory_markdown(study["trajectory"])
            except ValueError:  # no recipe shares a seed with bf16: the table above says so
                study["trajectory"] = {}
        except ValueError as e:
            study["error"] = str(e)
            study["failed"] = {}
            for label in study["failed_runs"]:
                study["failed"].setdefault(split_label(label)[0], []).append(label)
            study["markdown"] = (f"**Not analysed: {e}**" + ("\n\nFailed runs: " + ", ".join(
                f"`{k}` ({why})" for k, why in study["failed_runs"].items()) + "." if study["failed_runs"] else ""))
        result["studies"][name] = study
        warn = (f"\n\n**Workers without the corpus `{fp}` in their summary (failed, or other data): "
                f"{', '.join(other)}.**" if other else "")
        for why in dict.fromkeys(cut.get(m, "their worker stopped first") for m in missing):
            warn += (f"\n\n**Runs never started ({why}): "
                     f"{', '.join(f'`{m}`' for m in missing if cut.get(m, 'their worker stopped first') == why)}.**")
        if ends:
            warn += "\n\n" + workers_table(study["workers"])
        md += [f"### {name}: preset `{entry['preset']}`, {entry['steps']} steps ({entry['tokens_per_run']:,} "
               f"tokens per run)", "", study["markdown"] + warn, ""]
    result["markdown"] = "\n".join(md)
    atomic_write_text(out / "report.md", result["markdown"])
    text = json.dumps(result, indent=1, default=str)
    atomic_write_text(out / "report.json", text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(json_path, text)
    return result


if __name__ == "__main__":
    main()
