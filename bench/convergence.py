"""The convergence study: every recipe trained on the same data, side by side, within a time budget.

Two comparisons run at once, each through ``hybridfp train --jobs`` (one worker process per
recipe, spread over the visible GPUs):

- dense: preset ``gpt-50m`` — BF16 at two seeds (the noise floor), FP8 current, FP8 block,
  MXFP8, full NVFP4 (2D weights, RHT, SR), NVFP4-fwd / MXFP8-bwd, MXFP8-fwd / NVFP4-bwd;
- MoE: preset ``moe-small`` — BF16 and the Composer-2 factory
  (``nvfp4_row_scaled_fwd_mxfp8_bwd``).

The step count is not guessed: a short probe of every recipe (all workers at once, so the
measured rates include the sharing of the GPUs) gives each one's tokens/s, and the runs then
get as many steps as the slowest recipe of each comparison completes in the time budget
(every recipe of a comparison trains the same steps, so the cosine schedules match).

    python -m bench.convergence --out runs/convergence --budget-s 470 [--json results.json]

``--json``: the plan and each comparison's report (``bench.convergence_report``) as one JSON file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hybridfp.train.model import PRESETS
from hybridfp.train.recipes_by_name import parse_recipe_list

DENSE = ("bf16,bf16@seed=1,fp8,fp8-block,mxfp8,nvfp4,per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8,"
         "mxfp8-fwd-nvfp4-bwd")
MOE = "bf16,nvfp4-row-scaled-fwd-mxfp8-bwd"
PROBE_STEPS = 25


def train(preset: str, recipes: str, out: Path, steps: int, device: str, extra: list[str]) -> subprocess.Popen:
    """Start one ``hybridfp train --compare`` with one worker per recipe."""
    n = len(parse_recipe_list(recipes))
    argv = [sys.executable, "-m", "hybridfp.train", "--preset", preset, "--compare", recipes, "--device", device,
            "--jobs", str(n), "--steps", str(steps), "--out", str(out), "--no-progress", *extra]
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, stdout=open(out / "driver.log", "w"), stderr=subprocess.STDOUT)


def probe_rates(out: Path) -> dict[str, float]:
    """Tokens/s of each recipe over the probe's later steps (compilation and warm-up excluded)."""
    rates: dict[str, list[float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("step", 0) > PROBE_STEPS // 2 and "tokens_per_s" in r:
            rates.setdefault(r["recipe"], []).append(r["tokens_per_s"])
    return {k: sorted(v)[len(v) // 2] for k, v in rates.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/convergence"))
    p.add_argument("--budget-s", type=float, default=470.0, help="wall time for the full runs")
    p.add_argument("--eval-fraction", type=float, default=0.12,
                   help="share of the budget kept for evaluations and start-up")
    p.add_argument("--dense-preset", default="gpt-50m")
    p.add_argument("--moe-preset", default="moe-small")
    p.add_argument("--dense-recipes", default=DENSE)
    p.add_argument("--moe-recipes", default=MOE)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dense-steps", type=int, default=None,
                   help="with --moe-steps: fixed step counts instead of the probe (no time estimate)")
    p.add_argument("--moe-steps", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the plan and the reports here")
    args = p.parse_args(argv)
    studies = {"dense": (args.dense_preset, args.dense_recipes), "moe": (args.moe_preset, args.moe_recipes)}
    t0 = time.time()
    if args.dense_steps and args.moe_steps:
        # Fixed step counts (from an earlier run) plan more reliably than the probe's rates, which
        # vary with the GPUs' sharing (a plan for 450 s can run past 570 s).
        plan = {name: {"steps": steps, "recipes": studies[name][1]}
                for name, steps in (("dense", args.dense_steps), ("moe", args.moe_steps))}
        return run_plan(args, studies, plan, t0)
    probes = {name: train(preset, recipes, args.out / f"probe-{name}", PROBE_STEPS, args.device,
                          ["--eval-interval", "1000", "--eval-iters", "1"])
              for name, (preset, recipes) in studies.items()}
    for name, proc in probes.items():
        if proc.wait():  # some recipe failed: the study goes on without it (see the log)
            print(f"probe {name}: a run failed\n" + (args.out / f"probe-{name}" / "driver.log").read_text()[-4000:])
    print(f"probe done in {time.time() - t0:.0f} s", flush=True)
    budget = args.budget_s - (time.time() - t0)
    plan = {}
    for name, (preset, recipes) in studies.items():
        rates = probe_rates(args.out / f"probe-{name}")
        if not rates:
            raise SystemExit(f"{name}: every probe run failed; see {args.out / f'probe-{name}'}.")
        slowest = min(rates, key=rates.get)
        tokens_per_step = PRESETS[preset].batch_size * PRESETS[preset].seq_len
        steps = int(rates[slowest] * budget * (1 - args.eval_fraction) / tokens_per_step)
        if steps < 10:
            raise SystemExit(f"{name}: the budget left after the probe ({budget:.0f} s) buys {steps} steps of "
                             f"{slowest} at {rates[slowest]:,.0f} tokens/s; give a larger --budget-s.")
        # the recipes that ran in the probe, in the study's order (labels parse back)
        plan[name] = {"steps": steps, "rates": rates, "slowest": slowest,
                      "recipes": ",".join(r.label for r in parse_recipe_list(recipes) if r.label in rates)}
        print(f"{name}: {steps} steps ({steps * tokens_per_step / 1e6:.1f}M tokens); probe tokens/s: "
              + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()), flush=True)
    run_plan(args, studies, plan, t0)


def run_plan(args: argparse.Namespace, studies: dict, plan: dict, t0: float) -> None:
    """Train every comparison of ``plan`` at once and print each driver's log tail."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1))
    runs = {name: train(preset, plan[name]["recipes"], args.out / name, plan[name]["steps"], args.device,
                        ["--eval-interval", str(max(1, plan[name]["steps"] // 8))])
            for name, (preset, recipes) in studies.items()}
    for name, proc in runs.items():
        rc = proc.wait()
        log = (args.out / name / "driver.log").read_text()
        print(f"\n== {name} (rc {rc}, {time.time() - t0:.0f} s) ==\n" + log[-3500:], flush=True)
    if args.json is not None:
        write_json(args.json, args.out, plan)


def write_json(path: Path, out: Path, plan: dict) -> None:
    """The plan and, per comparison, its report's Markdown (or why there is none)."""
    from bench.common import environment
    from bench.convergence_report import report
    studies = {}
    for name in plan:
        try:
            studies[name] = {"report": report(out / name / "metrics.jsonl")}
        except (OSError, SystemExit, ValueError) as e:
            studies[name] = {"error": f"{type(e).__name__}: {e}"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": "convergence", "env": environment(), "plan": plan, "studies": studies,
                                "markdown": "\n\n".join(f"### {k}\n\n{v.get('report', v.get('error'))}"
                                                         for k, v in studies.items())}, indent=1, default=str))


if __name__ == "__main__":
    main()
