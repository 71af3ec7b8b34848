"""Tables for ``docs/convergence.md`` from a convergence study's ``metrics.jsonl`` files.

    python -m bench.convergence_report docs/convergence/dense.metrics.jsonl.gz [--targets dense]

Prints, in markdown: the final validation loss of every recipe with its gap vs the first
BF16 run and vs the mean of all BF16 runs (``bf16``, ``bf16@seed=K``: their spread is the
noise floor the gaps must be read against), the target where one is given, the
median tokens/s over the second half of the run; then the gap vs BF16 at every evaluation.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

#: relative final val-loss gap targets vs BF16, by recipe label
TARGETS = {"fp8": 0.25, "fp8-block": 0.25, "mxfp8": 0.25, "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8": 1.0,
           "mxfp8-fwd-nvfp4-bwd": 0.5}


def load(path: Path) -> tuple[dict[int, dict[str, float]], dict[str, list[tuple[int, float]]]]:
    """(step -> recipe -> val loss, recipe -> [(step, tokens/s)]) from one metrics file."""
    opener = gzip.open if path.suffix == ".gz" else open
    val: dict[int, dict[str, float]] = defaultdict(dict)
    rate: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with opener(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            if "val_loss" in r:
                val[r["step"]][r["recipe"]] = r["val_loss"]
            if "tokens_per_s" in r:
                rate[r["recipe"]].append((r["step"], r["tokens_per_s"]))
    return val, rate


def gap(x: float, ref: float) -> str:
    """Relative gap in percent, signed."""
    return f"{100 * (x - ref) / ref:+.2f} %"


def report(path: Path) -> str:
    """The markdown tables for one study."""
    val, rate = load(path)
    steps = sorted(val)
    last = val[steps[-1]]
    recipes = list(last)
    bf16 = [r for r in recipes if r == "bf16" or r.startswith("bf16@")]
    if "bf16" not in last:
        raise SystemExit(f"{path}: no bf16 run to compare against.")
    mean = statistics.fmean(last[r] for r in bf16)
    lines = ["| recipe | final val loss | gap vs bf16 | gap vs BF16 mean | target | tokens/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in recipes:
        pts = rate[r]
        tps = statistics.median(t for s, t in pts if s > pts[-1][0] // 2) if pts else float("nan")
        target = f"<= {TARGETS[r]} %" if r in TARGETS else ""
        lines.append(f"| `{r}` | {last[r]:.4f} | {'baseline' if r == 'bf16' else gap(last[r], last['bf16'])} | "
                     f"{gap(last[r], mean)} | {target} | {tps:,.0f} |")
    if len(bf16) > 1:
        spread = max(last[r] for r in bf16) - min(last[r] for r in bf16)
        lines.append(f"\nBF16 runs: {len(bf16)}, final spread {100 * spread / mean:.2f} % of their mean "
                     f"({mean:.4f}).")
    lines += ["", "Gap vs `bf16` (%) at each evaluation:", "",
              "| step | " + " | ".join(f"`{r}`" for r in recipes if r != "bf16") + " |",
              "|---:|" + "---:|" * (len(recipes) - 1)]
    for s in steps[1:]:
        row = val[s]
        if "bf16" not in row:  # an evaluation the BF16 run did not reach
            continue
        lines.append(f"| {s} | " + " | ".join(
            f"{100 * (row[r] - row['bf16']) / row['bf16']:+.2f}" if r in row else "" for r in recipes if r != "bf16")
            + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", type=Path, nargs="+", help="metrics.jsonl(.gz) of a study")
    for path in p.parse_args(argv).metrics:
        print(f"### {path.name}\n\n{report(path)}\n")


if __name__ == "__main__":
    main()
