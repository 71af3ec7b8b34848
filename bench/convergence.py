"""The convergence study: every recipe at several seeds on the packages corpus, in a time budget, on one GPU.

Two comparisons, each a set of runs ``RECIPE@seed=K`` (K = 0 .. ``--seeds`` - 1). A seed fixes
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

Plan: a probe starts every worker at once for ``PROBE_STEPS`` steps (one run per recipe, so
the measured tokens/s include the GPU's sharing), and measures each worker's start-up. The
token budget per run is then the largest that lets the most loaded worker finish in what is
left of ``--budget-s``, less ``--eval-fraction`` for evaluations; every run of a comparison
trains the same steps (same cosine schedule, warm-up a tenth of them).

Expected size at the default budget (470 s, probe included, one H200): a ~100M model trains
roughly 150-300 k tokens/s in BF16 alone; shared by the 24 runs (the quantized recipes cost
~1.1-2x a BF16 step) that leaves about **2M tokens per dense run** (~250 steps of 16 x 512
tokens) and about 1M per MoE run: a few percent of the corpus, so no run sees a byte twice.

    python -m bench.convergence --out runs/convergence [--budget-s 470] [--json results.json]
    python -m bench.convergence --steps 200           # fixed steps for both comparisons, no probe
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hybridfp.train.data import load_data
from hybridfp.train.model import PRESETS
from hybridfp.train.parallel import worker_devices

DENSE = ("bf16", "fp8", "fp8-block", "mxfp8", "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8", "mxfp8-fwd-nvfp4-bwd")
MOE = ("bf16", "nvfp4-row-scaled-fwd-mxfp8-bwd")
PROBE_STEPS = 20


@dataclass(frozen=True)
class Comparison:
    """One comparison: a preset and its recipes, each trained at every seed."""

    name: str
    preset: str
    recipes: tuple[str, ...]
    seeds: int

    def runs(self) -> list[str]:
        """Run labels, seed-major (every recipe at seed 0 first): ``RECIPE@seed=K``."""
        return [f"{r}@seed={s}" for s in range(self.seeds) for r in self.recipes]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one training step of the preset."""
        return PRESETS[self.preset].batch_size * PRESETS[self.preset].seq_len


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
        return cost.get(label.rpartition("@seed=")[0] or label, 1.0)
    load = [0.0] * workers
    chosen: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(runs)), key=lambda i: (-c(runs[i]), i)):
        k = min(range(workers), key=lambda k: (load[k], k))
        load[k] += c(runs[i])
        chosen[k].append(i)
    return [[runs[i] for i in sorted(idx)] for idx in chosen if idx]


def plan_tokens(groups: Sequence[Sequence[str]], cost: dict[str, float], seconds: float) -> float:
    """Tokens per run so that the most loaded worker trains its runs in ``seconds``.

    Example
    -------
    >>> plan_tokens([["a@seed=0", "b@seed=0"], ["a@seed=1"]], {"a": 1e-5, "b": 3e-5}, 100.0)
    2500000.0
    """
    worst = max(sum(cost[label.rpartition("@seed=")[0]] for label in g) for g in groups)
    return seconds / worst


# ---------------------------------------------------------------------------- processes
def start_worker(cmp: Comparison, labels: Sequence[str], out: Path, steps: int, device: str,
                 args: argparse.Namespace, eval_interval: int, eval_iters: int) -> subprocess.Popen:
    """One ``hybridfp train --compare`` training ``labels`` one after the other into ``out``."""
    argv = [sys.executable, "-m", "hybridfp.train", "--preset", cmp.preset, "--compare", ",".join(labels),
            "--device", device, "--steps", str(steps), "--warmup", str(max(1, steps // 10)),
            "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters), "--data", args.data,
            "--out", str(out), "--no-progress", "--no-checkpoint"]  # the study reads metrics only
    if args.cache_dir:
        argv += ["--cache-dir", str(args.cache_dir)]
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, stdout=open(out / "driver.log", "w"), stderr=subprocess.STDOUT)


def run_workers(jobs: dict[Path, subprocess.Popen]) -> dict[Path, tuple[int, float]]:
    """Wait for every worker: out dir -> (exit code, wall seconds since the call)."""
    t0, done = time.time(), {}
    while len(done) < len(jobs):
        for out, proc in jobs.items():
            if out not in done and proc.poll() is not None:
                done[out] = (proc.returncode, time.time() - t0)
        time.sleep(0.5)
    return done


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def probe(comparisons: Sequence[Comparison], workers: dict[str, int], args: argparse.Namespace
          ) -> tuple[dict[str, dict[str, float]], float]:
    """(comparison -> recipe -> tokens/s under full sharing, start-up seconds of the slowest
    worker to start: its wall time less its training time)."""
    jobs, devices = {}, iter(worker_devices(args.device, sum(workers.values())))
    for cmp in comparisons:
        runs = cmp.runs()[:max(workers[cmp.name], len(cmp.recipes))]  # every recipe once, then seed 1...
        for k, group in enumerate(assign(runs, {}, workers[cmp.name])):
            jobs[args.out / "probe" / cmp.name / f"w{k}"] = start_worker(
                cmp, group, args.out / "probe" / cmp.name / f"w{k}", PROBE_STEPS, next(devices), args, 1000, 1)
    done = run_workers(jobs)
    rates: dict[str, dict[str, float]] = {c.name: {} for c in comparisons}
    startup = 0.0
    for out, (rc, wall) in done.items():
        if rc:  # a recipe that fails to train is dropped from the study (the log says why)
            print(f"probe {out}: exit {rc}\n" + (out / "driver.log").read_text()[-3000:], flush=True)
        recs, per_run = _metrics(out), {}
        samples: dict[str, list[float]] = {}
        for r in recs:
            if "tokens_per_s" in r and r["step"] > PROBE_STEPS // 2:
                samples.setdefault(r["recipe"].rpartition("@seed=")[0], []).append(r["tokens_per_s"])
            if "elapsed" in r:
                per_run[r["recipe"]] = r["elapsed"]
        for recipe, v in samples.items():
            rates[out.parent.name].setdefault(recipe, sorted(v)[len(v) // 2])
        startup = max(startup, wall - sum(per_run.values()))
    return rates, startup


def fingerprints_seen(out: Path) -> Optional[str]:
    """The data line of a worker's summary.md (what the training process loaded), if written."""
    summary = out / "summary.md"
    if not summary.is_file():
        return None
    return next((line for line in summary.read_text().splitlines() if line.startswith("Data:")), None)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/convergence"))
    p.add_argument("--budget-s", type=float, default=470.0, help="wall time for the probe and the runs")
    p.add_argument("--eval-fraction", type=float, default=0.2,
                   help="share of the training time kept for evaluations and each run's set-up")
    p.add_argument("--seeds", type=int, default=3, help="seeds per recipe (init and data order)")
    p.add_argument("--jobs", type=int, default=8,
                   help="worker processes sharing the GPU(s), split over the comparisons (0: one per run)")
    p.add_argument("--data", default="packages", help="the training data (hybridfp train --data)")
    p.add_argument("--cache-dir", type=Path, default=None, help="hybridfp train --cache-dir")
    p.add_argument("--dense-preset", default="gpt-100m")
    p.add_argument("--moe-preset", default="moe-small")
    p.add_argument("--dense-recipes", default=",".join(DENSE))
    p.add_argument("--moe-recipes", default=",".join(MOE), help="empty: no MoE comparison")
    p.add_argument("--device", default="cuda")
    p.add_argument("--eval-iters", type=int, default=16, help="validation batches per evaluation")
    p.add_argument("--steps", type=int, default=None, help="fixed steps for every comparison (no probe)")
    p.add_argument("--dense-steps", type=int, default=None, help="fixed steps of the dense comparison")
    p.add_argument("--moe-steps", type=int, default=None, help="fixed steps of the MoE comparison")
    p.add_argument("--json", type=Path, default=None, help="also write the plan and the reports here")
    args = p.parse_args(argv)
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1; got {args.seeds}.")
    t0 = time.time()
    comparisons = [Comparison("dense", args.dense_preset, split_recipes(args.dense_recipes), args.seeds)]
    if args.moe_recipes:
        comparisons.append(Comparison("moe", args.moe_preset, split_recipes(args.moe_recipes), args.seeds))
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
                  "seeds": args.seeds, "workers": workers, "comparisons": {}}
    cost: dict[str, dict[str, float]] = {c.name: {} for c in comparisons}
    if any(v is None for v in fixed.values()):
        rates, startup = probe(comparisons, workers, args)
        plan["probe"] = {"rates": rates, "startup_s": startup, "wall_s": time.time() - t0}
        seconds = (args.budget_s - (time.time() - t0) - startup) * (1 - args.eval_fraction)
        print(f"probe done in {time.time() - t0:.0f} s; start-up {startup:.0f} s; {seconds:.0f} s to train",
              flush=True)
        if seconds <= 0:
            raise SystemExit(f"the probe and the workers' start-up took {time.time() - t0 + startup:.0f} s of the "
                             f"{args.budget_s:.0f} s budget; give a larger --budget-s (or fixed --steps).")
        for c in comparisons:
            cost[c.name] = {r: 1.0 / v for r, v in rates[c.name].items()}
    for c in comparisons:
        recipes = c.recipes if fixed[c.name] is not None else tuple(r for r in c.recipes if r in cost[c.name])
        if "bf16" not in recipes:
            raise SystemExit(f"{c.name}: the bf16 probe failed; see {args.out / 'probe' / c.name}.")
        kept = Comparison(c.name, c.preset, recipes, c.seeds)
        groups = assign(kept.runs(), cost[c.name], workers[c.name])
        steps = fixed[c.name]
        if steps is None:
            steps = int(plan_tokens(groups, cost[c.name], seconds) / c.tokens_per_step)
            if steps < 10:
                raise SystemExit(f"{c.name}: the budget left after the probe buys {steps} steps per run; "
                                 "give a larger --budget-s, fewer --seeds or recipes.")
        plan["comparisons"][c.name] = {
            "preset": c.preset, "steps": steps, "tokens_per_run": steps * c.tokens_per_step,
            "recipes": list(recipes), "dropped": [r for r in c.recipes if r not in recipes], "workers": groups}
        print(f"{c.name}: {len(kept.runs())} runs x {steps} steps ({steps * c.tokens_per_step / 1e6:.2f}M tokens "
              f"each) on {len(groups)} workers", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1))
    run_plan(args, comparisons, plan, t0)


def run_plan(args: argparse.Namespace, comparisons: Sequence[Comparison], plan: dict, t0: float) -> None:
    """Start every worker of ``plan``, wait, merge each comparison's metrics, write the reports."""
    jobs = {}
    devices = iter(worker_devices(args.device, sum(len(v["workers"]) for v in plan["comparisons"].values())))
    for c in comparisons:
        entry = plan["comparisons"][c.name]
        for k, group in enumerate(entry["workers"]):
            out = args.out / c.name / f"w{k}"
            jobs[out] = start_worker(c, group, out, entry["steps"], next(devices), args,
                                     max(1, entry["steps"] // 4), args.eval_iters)
    done = run_workers(jobs)
    for out, (rc, wall) in sorted(done.items()):
        print(f"== {out} (exit {rc}, {wall:.0f} s)" + ("\n" + (out / "driver.log").read_text()[-3000:] if rc else ""),
              flush=True)
    write_reports(args.out, plan, args.json)
    print(f"study done in {time.time() - t0:.0f} s: {args.out / 'report.md'}", flush=True)


def write_reports(out: Path, plan: dict, json_path: Optional[Path] = None) -> dict:
    """Per comparison: merged ``metrics.jsonl`` and its statistics; ``report.md`` / ``report.json``
    (and ``json_path``) with the plan and the corpus fingerprint each worker trained on."""
    from bench.common import environment
    from bench.convergence_report import analyze, failed_runs, to_markdown
    fp = plan["data"]["fingerprint"]
    result: dict = {"name": "convergence", "env": environment(), "plan": plan, "studies": {}}
    md = [f"Corpus: `{plan['data']['spec']}`, fingerprint `{fp}` ({plan['data']['train_tokens']:,} train / "
          f"{plan['data']['val_tokens']:,} validation tokens).", ""]
    for name, entry in plan["comparisons"].items():
        outs = [out / name / f"w{k}" for k in range(len(entry["workers"]))]
        merged = "".join((o / "metrics.jsonl").read_text() for o in outs if (o / "metrics.jsonl").is_file())
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "metrics.jsonl").write_text(merged)
        seen = {str(o.name): fingerprints_seen(o) for o in outs}
        other = sorted(k for k, line in seen.items() if line is None or fp not in line)
        started = {json.loads(line)["recipe"] for line in merged.splitlines() if line.strip()}
        # a worker that stops (a run that diverged raises) never starts its later runs
        missing = [label for group in entry["workers"] for label in group if label not in started]
        # recipes the probe dropped stay in the report, failed: every seed the plan meant to train
        dropped = {f"{r}@seed={s}": "dropped at the probe" for r in entry.get("dropped", [])
                   for s in range(plan.get("seeds", 1))}
        expected = [label for group in entry["workers"] for label in group]
        study: dict = {"data_lines": seen, "workers_on_other_data": other, "never_started": missing}
        paths = [out / name / "metrics.jsonl"]
        study["failed_runs"] = failed_runs(paths, entry["steps"], expected, dropped)
        try:
            study["stats"] = analyze(paths, steps=entry["steps"], expected=expected, dropped=dropped)
            study["markdown"] = to_markdown(study["stats"])
            study["failed"] = study["stats"]["failed"]
        except ValueError as e:
            study["error"] = str(e)
            study["failed"] = {}
            for label in study["failed_runs"]:
                study["failed"].setdefault(label.rpartition("@seed=")[0] or label, []).append(label)
            study["markdown"] = (f"**Not analysed: {e}**" + ("\n\nFailed runs: " + ", ".join(
                f"`{k}` ({why})" for k, why in study["failed_runs"].items()) + "." if study["failed_runs"] else ""))
        result["studies"][name] = study
        warn = (f"\n\n**Workers without the corpus `{fp}` in their summary (failed, or other data): "
                f"{', '.join(other)}.**" if other else "")
        warn += (f"\n\n**Runs never started (their worker stopped first): "
                 f"{', '.join(f'`{m}`' for m in missing)}.**" if missing else "")
        md += [f"### {name}: preset `{entry['preset']}`, {entry['steps']} steps ({entry['tokens_per_run']:,} "
               f"tokens per run)", "", study["markdown"] + warn, ""]
    result["markdown"] = "\n".join(md)
    (out / "report.md").write_text(result["markdown"])
    text = json.dumps(result, indent=1, default=str)
    (out / "report.json").write_text(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text)
    return result


if __name__ == "__main__":
    main()
