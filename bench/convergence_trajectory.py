"""When a recipe's per-seed gap to BF16 is set: the paired gaps at every evaluation, not only the last.

    python -m bench.convergence_trajectory runs/c0/dense/metrics.jsonl [more files] [--steps N] [--json out.json]

``bench.convergence_report`` judges the final validation loss. Its interval is as narrow as the
per-seed gaps are steady, and whether a longer run would make them steadier is a question about
the runs' history: if the gaps' standard deviation falls from one evaluation to the next, longer
runs help; if each seed's gap is fixed early and carried to the end, only more seeds (or a
calmer start: a lower learning rate, larger batches) narrow the interval. This prints, per
recipe and evaluation step, the mean and standard deviation of the per-seed gaps
``100 (L_recipe,s - L_bf16,s) / L_bf16,s`` over the seeds both have, and how strongly each
evaluation's gaps agree with the final ones (Pearson correlation across seeds, given from
five seeds on and not for the first or the last evaluation: near 1 means the seeds' final
gaps were largely present there).

Only complete runs count (the report's :func:`bench.convergence_report.failed_runs` rule), so
every step is averaged over the same seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Collection, Optional, Sequence

from bench.convergence_report import BASELINE, failed_runs, read_records, split_label
from bench.convergence_stats import gap_pct


#: seeds from which a correlation is shown (with fewer, r is mostly noise: at 3 seeds +-1 is common)
MIN_SEEDS_FOR_R = 5


def _pearson(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Correlation of two equally long sequences; None where either is constant or shorter than
    :data:`MIN_SEEDS_FOR_R`."""
    if len(a) < MIN_SEEDS_FOR_R:
        return None
    try:
        return statistics.correlation(a, b)
    except statistics.StatisticsError:  # a constant sequence: no correlation
        return None


def gaps_by_step(paths: Sequence[Path], steps: Optional[int] = None,
                 exclude: Collection[str] = ()) -> dict[str, list[dict]]:
    """Per recipe, the paired gaps to ``bf16`` at each evaluation step of its complete runs.

    Parameters
    ----------
    paths : metrics.jsonl(.gz) files of one comparison (several studies' files together, as the
        report takes them).
    steps : the planned steps (runs that did not reach them are left out); None: every run that
        did not fail, which must all have ended at the same step.
    exclude : recipes to leave out (e.g. those the report judges failed: their surviving seeds
        are not a sample of the recipe).

    Returns
    -------
    dict : recipe -> ``[{"step", "seeds", "gap_pct", "sd", "r_final"}, ...]`` in step order, at the
        steps every shared seed evaluated (``sd`` None with one seed; ``r_final`` the correlation
        of that step's per-seed gaps with the final step's: None at the first and the final
        step, and under :data:`MIN_SEEDS_FOR_R` seeds).

    Raises
    ------
    ValueError : no complete ``bf16`` run, no recipe sharing a seed with it, or (``steps`` None)
        runs that ended at different steps.
    """
    failed = failed_runs(paths, steps)
    vals: dict[str, dict[int, float]] = defaultdict(dict)
    for r in read_records(paths):
        if "val_loss" in r and r["recipe"] not in failed and split_label(r["recipe"])[0] not in exclude:
            vals[r["recipe"]][r["step"]] = r["val_loss"]
    if steps is not None:  # runs without an evaluation at the planned step are incomplete
        vals = {k: v for k, v in vals.items() if steps in v}
    ends = {max(curve) for curve in vals.values()}
    if len(ends) > 1:
        raise ValueError(f"{', '.join(map(str, paths))}: the runs ended at different steps ({sorted(ends)}); "
                         "give --steps (the planned steps) to leave out the short ones.")
    by_recipe: dict[str, dict[int, dict[int, float]]] = defaultdict(dict)
    for label, curve in vals.items():
        recipe, seed = split_label(label)
        by_recipe[recipe][seed] = curve
    base = by_recipe.pop(BASELINE, None)
    if not base:
        raise ValueError(f"{', '.join(map(str, paths))}: no complete {BASELINE} run to compare against.")
    out: dict[str, list[dict]] = {}
    for recipe, runs in by_recipe.items():
        seeds = sorted(set(runs) & set(base))
        if not seeds:
            continue
        common = set.intersection(*(set(runs[s]) & set(base[s]) for s in seeds))  # holds the final step
        gaps = {st: [gap_pct(runs[s][st], base[s][st]) for s in seeds] for st in sorted(common)}
        first, last = min(gaps), max(gaps)
        out[recipe] = [{"step": st, "seeds": len(d), "gap_pct": statistics.fmean(d),
                        "sd": statistics.stdev(d) if len(d) > 1 else None,
                        "r_final": _pearson(d, gaps[last]) if first < st < last else None}
                       for st, d in gaps.items()]
    if not out:
        raise ValueError(f"{', '.join(map(str, paths))}: no recipe shares a seed with {BASELINE}.")
    return out


def to_markdown(trajectories: dict[str, list[dict]]) -> str:
    """One table: a row per recipe and evaluation step."""
    lines = [f"Per-seed gaps to `{BASELINE}` at each evaluation (mean, standard deviation across seeds, "
             "correlation with the final evaluation's gaps):", "",
             "| recipe | step | seeds | mean gap | sd of the per-seed gaps | r with the final gaps |",
             "|---|---:|---:|---:|---:|---:|"]
    for recipe, rows in trajectories.items():
        for r in rows:
            sd = f"{r['sd']:.2f} %" if r["sd"] is not None else ""
            rf = f"{r['r_final']:.2f}" if r["r_final"] is not None else "—"
            lines.append(f"| `{recipe}` | {r['step']} | {r['seeds']} | {r['gap_pct']:+.2f} % | {sd} | {rf} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m bench.convergence_trajectory``: print the table (and write the JSON).

    Parameters
    ----------
    argv : the options (None: ``sys.argv[1:]``).

    Raises
    ------
    SystemExit : unreadable or unusable metrics (the message says why).
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", type=Path, nargs="+", help="metrics.jsonl(.gz) files of one comparison")
    p.add_argument("--steps", type=int, default=None, help="the planned steps: shorter runs are left out")
    p.add_argument("--json", type=Path, default=None, help="also write the trajectories here")
    args = p.parse_args(argv)
    try:
        result = gaps_by_step(args.metrics, args.steps)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.convergence_trajectory: {e}") from None
    print(to_markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
