"""The run-to-run floor of a convergence study: the same runs (recipe and seed) trained twice.

    python -m bench.convergence_replicates --first A.metrics.jsonl --second B.metrics.jsonl [C.metrics.jsonl] \\
        [--steps N] [--recipe bf16] [--json out.json]

``--first`` and ``--second`` name the metrics files of two studies (each side one or several files
of disjoint runs) that both trained some runs ``RECIPE@seed=K`` (e.g. ``bf16`` at seeds 3-9 on
each side). For every such run complete on both sides:

- the **replicate gap** ``d_s = 100 (L_second,s - L_first,s) / L_first,s`` of the final validation
  losses, with the mean, standard deviation and 95 % Student-t interval over the seeds (the
  statistics ``bench.convergence_report`` gives a recipe against BF16);
- the first training step whose loss differs between the two (none: one trajectory, bit for bit).

Why: a recipe's per-seed gap to BF16 is the difference of two training runs, and it can be no
steadier than the difference of two runs of the *same* recipe and seed. When a repeated BF16 run
moves its final loss as much as a recipe does, the spread of the study's per-seed gaps is the
training's own run-to-run variation (kernels that add in a varying order, amplified over hundreds
of steps), not the recipe's; and ``seeds_to_meet`` at the replicates' standard deviation is the
fewest seeds any study at this length needs for a target, measured rather than assumed.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from bench.convergence_report import failed_runs, read_records, split_label
from bench.convergence_stats import CONFIDENCE, gap_pct, paired_gap, seeds_to_meet

#: the targets a floor is stated against (%): the study's three target widths
TARGET_WIDTHS = (0.25, 0.5, 1.0)


def _runs(paths: Sequence[Path], steps: Optional[int]) -> tuple[dict[str, dict[int, dict]], set[str]]:
    """One side's complete runs: label -> step -> merged record, and the corpus fingerprints seen."""
    failed = failed_runs(paths, steps)
    runs: dict[str, dict[int, dict]] = defaultdict(dict)
    corpora: set[str] = set()
    for r in read_records(paths):
        if "data" in r:
            corpora.add(r["data"])
        if r["recipe"] not in failed:
            runs[r["recipe"]].setdefault(r["step"], {}).update(r)
    return dict(runs), corpora


def first_difference(a: dict[int, dict], b: dict[int, dict]) -> Optional[int]:
    """The first step at which two runs' training losses differ (None: the same at every step both
    logged, which for runs of one recipe, seed and length means one trajectory bit for bit).

    Example
    -------
    >>> first_difference({1: {"train_loss": 2.0}, 2: {"train_loss": 1.5}}, {1: {"train_loss": 2.0}, 2: {"train_loss": 1.6}})
    2
    """
    for step in sorted(set(a) & set(b)):
        la, lb = a[step].get("train_loss"), b[step].get("train_loss")
        if la is not None and lb is not None and la != lb:
            return step
    return None


def replicate_gaps(first: Sequence[Path], second: Sequence[Path], steps: Optional[int] = None,
                   recipes: Optional[Sequence[str]] = None, confidence: float = CONFIDENCE) -> dict[str, dict]:
    """Per recipe, the final-loss gaps between the runs both files trained, and their statistics.

    Parameters
    ----------
    first, second : metrics.jsonl(.gz) files of two studies (a side's files hold disjoint runs).
    steps : the planned steps: runs whose last evaluation is elsewhere (stopped, diverged) are left
        out; None: every run that did not diverge, which must end at one step in both files.
    recipes : only these recipes (None: every recipe with a run in both files).
    confidence : two-sided level of the interval.

    Returns
    -------
    dict : recipe -> ``{"seeds", "first": {seed: loss}, "second": {seed: loss}, "gaps": {seed: %},
        "first_difference": {seed: step or None}, "gap_pct", "sd", "lo", "hi",
        "seeds_to_meet": {"0.25": n, ...}}`` (``sd`` / ``lo`` / ``hi`` None with one seed;
        ``seeds_to_meet`` the paired seeds a recipe with a true zero gap needs for each target width
        if its per-seed gaps vary as much as these replicates do).

    Raises
    ------
    ValueError : the two sides recorded different corpora, their runs end at different steps
        (``steps`` None), a run is in two files of one side, or no run is complete on both sides.
    """
    (runs_a, corpus_a), (runs_b, corpus_b) = _runs(first, steps), _runs(second, steps)
    sides = f"{', '.join(map(str, first))} / {', '.join(map(str, second))}"
    if corpus_a and corpus_b and corpus_a != corpus_b:
        raise ValueError(f"{sides}: the first side read corpus {sorted(corpus_a)}, the second {sorted(corpus_b)}: "
                         "replicates "
                         "must read the same text (the same --data on the same installed packages).")
    finals: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
    differ: dict[str, dict[int, Optional[int]]] = defaultdict(dict)
    ends = set()
    for label in sorted(set(runs_a) & set(runs_b)):
        recipe, seed = split_label(label)
        if recipes is not None and recipe not in recipes:
            continue
        a, b = runs_a[label], runs_b[label]
        end_a = max((s for s, r in a.items() if "val_loss" in r), default=None)
        end_b = max((s for s, r in b.items() if "val_loss" in r), default=None)
        if end_a is None or end_b is None:
            continue
        ends.update((end_a, end_b))
        finals[recipe][seed] = (a[end_a]["val_loss"], b[end_b]["val_loss"])
        differ[recipe][seed] = first_difference(a, b)
    if len(ends) > 1:
        raise ValueError(f"{sides}: the shared runs ended at different steps ({sorted(ends)}); give "
                         "--steps (the planned steps) to leave out the short ones.")
    if not finals:
        raise ValueError(f"{sides}: no run (RECIPE@seed=K) is complete on both sides"
                         + (f" among {', '.join(recipes)}" if recipes else "") + ".")
    out: dict[str, dict] = {}
    for recipe, by_seed in finals.items():
        g = paired_gap({s: v[1] for s, v in by_seed.items()}, {s: v[0] for s, v in by_seed.items()}, confidence)
        out[recipe] = {"seeds": len(by_seed), "first": {s: v[0] for s, v in sorted(by_seed.items())},
                       "second": {s: v[1] for s, v in sorted(by_seed.items())},
                       "gaps": {s: gap_pct(v[1], v[0]) for s, v in sorted(by_seed.items())},
                       "first_difference": dict(sorted(differ[recipe].items())),
                       "gap_pct": g.gap_pct, "sd": g.sd, "lo": g.lo, "hi": g.hi,
                       "seeds_to_meet": {str(w): (seeds_to_meet(g.sd, w, confidence) if g.sd is not None else None)
                                         for w in TARGET_WIDTHS}}
    return out


def to_markdown(result: dict[str, dict]) -> str:
    """A summary row per recipe, then each seed's pair of final losses."""
    lines = ["Runs trained twice (same recipe, seed, corpus and steps): the second run's final validation "
             "loss against the first's.", "",
             "| recipe | seeds | replicate gap (mean) | 95 % interval | sd of the per-seed gaps | same trajectory "
             "| seeds to meet ± 0.25 / 0.5 / 1.0 % at this sd |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for recipe, r in result.items():
        interval = f"[{r['lo']:+.2f}, {r['hi']:+.2f}] %" if r["lo"] is not None else ""
        sd = f"{r['sd']:.2f} %" if r["sd"] is not None else ""
        same = sum(step is None for step in r["first_difference"].values())
        meet = " / ".join("—" if n is None else str(n) for n in r["seeds_to_meet"].values())
        lines.append(f"| `{recipe}` | {r['seeds']} | {r['gap_pct']:+.2f} % | {interval} | {sd} | "
                     f"{same} of {r['seeds']} | {meet} |")
    lines += ["", "| recipe | seed | first run | second run | gap | first step whose loss differs |",
              "|---|---:|---:|---:|---:|---:|"]
    for recipe, r in result.items():
        for seed, gap in r["gaps"].items():
            step = r["first_difference"][seed]
            lines.append(f"| `{recipe}` | {seed} | {r['first'][seed]:.4f} | {r['second'][seed]:.4f} | {gap:+.2f} % | "
                         f"{'none' if step is None else step} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    """Print the replicates' tables (and write their JSON with ``--json``).

    Raises
    ------
    SystemExit : the files cannot be compared (see :func:`replicate_gaps`).
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--first", type=Path, nargs="+", required=True, help="metrics.jsonl(.gz) files of the first study")
    p.add_argument("--second", type=Path, nargs="+", required=True, help="metrics.jsonl(.gz) files of the second study")
    p.add_argument("--steps", type=int, default=None, help="the planned steps: runs that did not reach them are left out")
    p.add_argument("--recipe", action="append", default=None,
                   help="only this recipe (repeatable; default: every recipe with runs in both files)")
    p.add_argument("--json", type=Path, default=None, help="also write the statistics here as JSON")
    args = p.parse_args(argv)
    try:
        result = replicate_gaps(args.first, args.second, args.steps, args.recipe)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(to_markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


__all__ = ["TARGET_WIDTHS", "first_difference", "replicate_gaps", "to_markdown"]


if __name__ == "__main__":
    main()
