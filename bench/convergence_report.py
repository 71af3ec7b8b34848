"""Statistics of a convergence study: each recipe's gap to BF16 over seeds, with a 95 % interval.

    python -m bench.convergence_report runs/convergence/dense/metrics.jsonl [--json report.json]
    python -m bench.convergence_report A/metrics.jsonl B/metrics.jsonl BF16-AGAIN/metrics.jsonl --baseline-replicates

Input: ``metrics.jsonl`` files of ``hybridfp train`` whose run labels are ``RECIPE@seed=K``
(a label without ``@seed=`` is seed 0, the training default). Per recipe: the final validation
loss of every seed, their mean and sample standard deviation; the gap to ``bf16`` in percent
with a confidence interval, and a verdict against the recipe's target (:data:`TARGETS`):

- **paired by seed** (used when the recipe and BF16 share at least two seeds): a seed fixes
  the initial weights *and* the data order for every recipe, so the seed-to-seed noise is
  largely common to a recipe and BF16 at the same seed; the per-seed relative differences
  ``d_s = 100 (L_recipe,s - L_bf16,s) / L_bf16,s`` cancel it, and their Student-t interval
  ``mean(d) +- t(0.975, n-1) sd(d) / sqrt(n)`` is much narrower than an unpaired one.
- **Welch** otherwise (fewer than two shared seeds, both sides with two or more): the
  difference of the means with the Welch-Satterthwaite degrees of freedom, relative to the
  BF16 mean (whose own uncertainty is not propagated).

Verdict for a target of ``x`` % (the recipe within ``x`` % of BF16, either side): ``met`` when
the whole interval lies in ``[-x, +x]``, ``missed`` when it lies wholly outside, ``unresolved``
when it straddles a bound or there is no interval (one seed). ``failed`` when any of the
recipe's planned runs diverged, stopped before the planned step, never started or was dropped
(:func:`failed_runs`; the report names each run and why): pairing over the seeds that happened
to survive would hide the failure.

``--baseline-replicates`` (``analyze(baseline_replicates=True)``): the baseline's runs
``bf16@seed=K`` may be in several files (BF16 trained again at seeds of an earlier study, in a
file of its own); at each seed the baseline's loss is the mean of its runs there (one or more),
each recipe is paired against that mean, and the report says how many seeds have how many runs
and gives the run-to-run floor (:func:`bench.convergence_stats.replicate_floor`). Without it a
run label in two files is refused, the baseline's as any other; with it, still any other's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

from bench.convergence_stats import (CONFIDENCE, SEEDS_LIMIT, gap_pct, paired_gap, replicate_floor, replicate_means,
                                     resolvable_sd, seeds_to_meet, t_quantile, verdict, welch_gap)

#: Relative final val-loss gap targets vs BF16 (%), by recipe name.
TARGETS = {"fp8": 0.25, "fp8-block": 0.25, "mxfp8": 0.25, "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8": 1.0,
           "mxfp8-fwd-nvfp4-bwd": 0.5}
BASELINE = "bf16"


# ---------------------------------------------------------------------------- metrics
def split_label(label: str) -> tuple[str, int]:
    """``RECIPE@seed=K`` -> (RECIPE, K); no numeric suffix -> (label, 0): the trainer's own rule
    (``hybridfp.train.report.split_seed``), which named the runs, at its default seed."""
    from hybridfp.train.report import split_seed  # lazily: the tables above need no torch
    return split_seed(label, 0)


def read_runs(paths: Iterable[Path], baseline_replicates: bool = False) -> Iterable[tuple[str, dict]]:
    """Every record of ``paths`` in order (``.gz`` files decompressed), with the name of its run:
    its label (``RECIPE@seed=K``), or with ``baseline_replicates`` for a :data:`BASELINE` run
    ``"LABEL in PATH"``, since the baseline's runs of one seed may then come from several files.

    Parameters
    ----------
    paths : metrics.jsonl(.gz) files of one comparison.
    baseline_replicates : let a :data:`BASELINE` run label be in several files, each file's
        records of it one run (a replicate).

    Returns
    -------
    Iterable[tuple[str, dict]] : (run, record), file by file, line by line (blank lines skipped).

    Raises
    ------
    ValueError : a run label found in two files (with ``baseline_replicates``, a label of another
        recipe than the baseline), or starting twice in one file (two step-0 records): the same run
        trained twice (e.g. studies run one after the other with overlapping seeds, or their files
        concatenated) would mix two trajectories into one.
    """
    owner: dict[str, Path] = {}
    for path in map(Path, paths):
        names: dict[str, str] = {}  # label -> run, in this file
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    label = record["recipe"]
                    run = names.get(label)
                    if run is None:
                        run = names[label] = _run_name(label, path, owner.setdefault(label, path), baseline_replicates)
                    elif record["step"] == 0:
                        # the trainer writes one step-0 record a run (a resumed run truncates to its
                        # step): a second is another run's, concatenated into this file
                        raise ValueError(f"{path}: run {label} starts twice (two step-0 records): two runs of one "
                                         "label concatenated into one file would mix their trajectories; keep "
                                         "each run's metrics in a file of its own (BF16 trained again: its own "
                                         "file, with --baseline-replicates).")
                    yield run, record


def _run_name(label: str, path: Path, first: Path, baseline_replicates: bool) -> str:
    """The run of ``label``'s records in ``path`` (``first``: the first file that has the label).

    Raises
    ------
    ValueError : the label is in two files and is not a baseline run with ``baseline_replicates``.
    """
    if baseline_replicates and split_label(label)[0] == BASELINE:
        return f"{label} in {path}"
    if first != path:
        if baseline_replicates:
            hint = f" Only {BASELINE}'s runs may be in several files (--baseline-replicates)."
        elif split_label(label)[0] == BASELINE:
            hint = (f" To pair every recipe with the mean of {BASELINE} runs trained again at the same seeds, "
                    "pass --baseline-replicates (python -m bench.convergence_report).")
        else:
            hint = ""
        raise ValueError(f"run {label} is in both {first} and {path}: each run must come from one file (give the "
                         "studies disjoint seeds: python -m bench.convergence --first-seed)." + hint)
    return label


def read_records(paths: Iterable[Path]) -> Iterable[dict]:
    """Every record of ``paths`` in order (``.gz`` files decompressed).

    Parameters
    ----------
    paths : metrics.jsonl(.gz) files of one comparison.

    Returns
    -------
    Iterable[dict] : the records, file by file, line by line (blank lines skipped).

    Raises
    ------
    ValueError : a run label found in two files: the same run trained twice (e.g. studies run one
        after the other with overlapping seeds) would mix two trajectories into one.
    """
    for _, record in read_runs(paths):
        yield record


def _one_corpus(corpus: dict[str, set[str]], paths: Sequence[Path]) -> Optional[str]:
    """The one corpus fingerprint the runs recorded (None: none recorded one).

    Raises
    ------
    ValueError : two fingerprints: the runs read different text (another set of installed
        packages, another cap), so their losses are not comparable; the message names a run of each.
    """
    by_fp: dict[str, list[str]] = defaultdict(list)
    for label, fps in sorted(corpus.items()):
        for fp in sorted(fps):  # a run with two (records of two launches) shows under both
            by_fp[fp].append(label)
    if len(by_fp) > 1:
        seen = "; ".join(f"`{fp}` ({', '.join(labels[:3])}{', ...' if len(labels) > 3 else ''})"
                         for fp, labels in by_fp.items())
        raise ValueError(f"{', '.join(map(str, paths))}: the runs read different corpora ({seen}); compare "
                         "runs of one corpus only (the same --data on the same installed packages).")
    return next(iter(by_fp), None)


def failed_runs(paths: Sequence[Path], steps: Optional[int] = None, expected: Sequence[str] = (),
                dropped: Optional[dict[str, str]] = None, cut: Optional[dict[str, str]] = None,
                baseline_replicates: bool = False) -> dict[str, str]:
    """The runs of a comparison that cannot count, each with why: a non-finite loss
    (``diverged at step N``), no validation loss at the planned ``steps`` (``stopped at step N``:
    a crash, a kill, a time-out), an ``expected`` label with no record (``never started``: its
    worker stopped first), and the ``dropped`` ones the caller names (e.g. at the probe). A run in
    ``cut`` (its worker was stopped by the driver) that did not complete has the cut's reason
    appended (``stopped at step N: the time budget ran out ...``).

    Parameters
    ----------
    paths : metrics.jsonl(.gz) files of one comparison.
    steps : the planned steps (None: only divergence and missing runs are detected).
    expected : every run label the plan trains.
    dropped : label -> reason of runs the plan left out.
    cut : label -> why the driver stopped the run's worker (the budget ran out, an interrupt).
    baseline_replicates : the baseline's runs may be in several files (:func:`read_runs`), each
        judged on its own and named ``"LABEL in PATH"``.

    Returns
    -------
    dict : run (label, or :func:`read_runs`' name) -> reason, sorted.

    Example
    -------
    >>> import json, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = Path(d) / "metrics.jsonl"
    ...     _ = path.write_text(json.dumps({"step": 3, "recipe": "bf16@seed=0", "train_loss": 2.0}) + "\\n")
    ...     failed_runs([path], 10, ["bf16@seed=0", "bf16@seed=1"], cut={"bf16@seed=0": "the budget ran out"})
    {'bf16@seed=0': 'stopped at step 3: the budget ran out', 'bf16@seed=1': 'never started'}
    """
    cut = cut or {}

    def why(text: str, label: str) -> str:
        return f"{text}: {cut[label]}" if label in cut else text

    nonfinite, last_val, last_step, label_of = {}, {}, {}, {}
    for run, r in read_runs(paths, baseline_replicates):
        label_of[run] = r["recipe"]
        last_step[run] = max(last_step.get(run, -1), r["step"])
        bad = [k for k in ("train_loss", "val_loss") if k in r and not math.isfinite(r[k])]
        if bad and run not in nonfinite:
            nonfinite[run] = r["step"]
        if "val_loss" in r:
            last_val[run] = max(last_val.get(run, -1), r["step"])
    dropped = dropped or {}
    # with baseline_replicates a run's name is not its label: a dropped label drops each of its runs
    renamed = {run: label for run, label in label_of.items() if run != label and label in dropped}
    out = {label: reason for label, reason in dropped.items() if label not in renamed.values()}
    out.update({run: dropped[label] for run, label in renamed.items()})
    for run, step in last_step.items():
        if run in nonfinite:
            out[run] = f"diverged at step {nonfinite[run]}"
        elif steps is not None and last_val.get(run) != steps:
            out[run] = why(f"stopped at step {step}", label_of[run])
    started = set(label_of.values())
    out.update({label: why("never started", label) for label in expected if label not in started})
    return dict(sorted(out.items()))


def analyze(paths: Sequence[Path], targets: Optional[dict[str, float]] = None,
            confidence: float = CONFIDENCE, steps: Optional[int] = None, expected: Sequence[str] = (),
            dropped: Optional[dict[str, str]] = None, cut: Optional[dict[str, str]] = None,
            train_window: Optional[int] = None, baseline_replicates: bool = False) -> dict:
    """Per recipe: final validation losses by seed, mean +- std, gap to BF16 with its interval
    and the verdict; plain data (JSON-able).

    ``train_window``: compare instead each run's mean training loss over its last
    ``train_window`` steps (up to the final evaluation). On a corpus no run reads twice every
    training batch is new to the model when its loss is taken, so the window is a held-out
    estimate over many more tokens than the validation batches: whether the seed-to-seed spread
    of the gaps is noise at the end point or a difference between the trained models.

    A recipe with any run in :func:`failed_runs` (diverged, stopped early, never started, or
    ``dropped``) gets the verdict ``failed`` and its ``failed_runs`` (label -> reason): a gap
    over the surviving seeds would judge the recipe on the seeds it happened to survive. Its
    row is there even when no run of it completed.

    ``baseline_replicates``: the baseline's runs ``bf16@seed=K`` may be in several files (BF16
    trained again at seeds already trained, in a file of its own); each seed's baseline loss is
    the mean of its complete runs there, each recipe is paired against that mean (its method says
    so, with how many seeds have how many runs), and the result gains ``"baseline_replicates"``.
    Each run is judged on its own (:func:`failed_runs`): a failed replicate fails the baseline row
    and is left out of its seed's mean. A label of another recipe in two files is still refused.

    Parameters
    ----------
    paths : metrics.jsonl(.gz) files of one comparison (e.g. one per worker process).
    targets : recipe -> target gap in % (default :data:`TARGETS`).
    confidence : two-sided confidence level of the intervals.
    steps : the planned steps: runs that did not evaluate at that step are left out and listed
        under ``"incomplete"``; None: every run must end at the same step.
    expected : every run label the plan trains (those without a record are ``never started``).
    dropped : label -> reason of runs the plan left out (e.g. ``"dropped at the probe"``).
    cut : label -> why the driver stopped the run's worker (:func:`failed_runs`).
    train_window : steps of training loss to average instead of the final validation loss.
    baseline_replicates : pair every recipe with the mean of the baseline's runs per seed, which
        may come from several files (their runs named ``"LABEL in PATH"``; :func:`read_runs`).

    Returns
    -------
    dict : ``{"final_step", "metric", "confidence", "rows": [...], "seeds": {recipe: {seed: loss}},
        "incomplete": [labels], "failed": {recipe: [labels]}, "corpus": fingerprint or None,
        "runs_without_corpus": [labels]}`` (``runs_without_corpus``: compared runs whose metrics
        record no corpus: files written before the trainer recorded it, or data without a
        fingerprint, such as a plain text file). With ``baseline_replicates`` the baseline's
        ``seeds`` are the per-seed means and the result has ``"baseline_replicates": {"recipe",
        "runs_per_seed": {k: seeds}, "losses": {seed: [loss per run]}, "runs": {seed: [run]},
        "floor"}`` (``floor``: :func:`bench.convergence_stats.replicate_floor` as ``{"seeds",
        "gaps": {seed: %}, "gap_pct", "lo", "hi", "sd"}``, None without a seed of two runs).

    Raises
    ------
    ValueError : no validation loss, no complete ``bf16`` run, runs that read different corpora
        (their first records' ``data`` fingerprints differ; replicates included), or (``steps``
        None) runs that ended at different steps, or (``train_window``) a run missing a training
        loss in its window, or a run label in two files (:func:`read_runs`).
    """
    if train_window is not None and train_window < 1:
        raise ValueError(f"train_window (--train-window) must be >= 1 steps, got {train_window}.")
    targets = TARGETS if targets is None else targets
    failed = failed_runs(paths, steps, expected, dropped, cut, baseline_replicates)
    last: dict[str, tuple[int, float]] = {}
    rates: dict[str, list[tuple[int, float]]] = defaultdict(list)
    corpus: dict[str, set[str]] = defaultdict(set)
    train: dict[str, dict[int, float]] = defaultdict(dict)
    label_of: dict[str, str] = {}
    for run, r in read_runs(paths, baseline_replicates):
        label_of[run] = r["recipe"]
        if "train_loss" in r:
            train[run][r["step"]] = r["train_loss"]
        if "data" in r:
            corpus[run].add(r["data"])
        if "val_loss" in r and r["step"] >= last.get(run, (-1, 0.0))[0]:
            last[run] = (r["step"], r["val_loss"])
        if "tokens_per_s" in r:
            rates[run].append((r["step"], r["tokens_per_s"]))
    corpora = _one_corpus(corpus, paths)
    incomplete = sorted(k for k in last if k in failed)
    last = {k: v for k, v in last.items() if k not in failed}
    if not last:
        raise ValueError(f"{', '.join(map(str, paths))}: no validation loss recorded"
                         + (f" at step {steps}" if steps is not None else "")
                         + (f"; failed runs: {', '.join(failed)}." if failed else "."))
    ends = {s for s, _ in last.values()}
    if len(ends) > 1:
        by_step = {s: sorted(k for k, (st, _) in last.items() if st == s) for s in sorted(ends)}
        raise ValueError(f"the runs ended at different steps ({by_step}); a run stopped early? Compare "
                         "complete runs only (rerun or drop the short ones).")
    final_step = next(iter(ends))
    metric = "final validation loss"
    if train_window is not None:
        window = range(final_step - train_window + 1, final_step + 1)
        for label in last:
            missing = [s for s in window if s not in train[label]]
            if missing:
                raise ValueError(f"{label}: no training loss recorded at step(s) {missing[:5]} of the "
                                 f"{train_window}-step window ending at step {final_step}; use a shorter "
                                 f"train_window (--train-window; at most {final_step}, the steps a run "
                                 "records from step 1).")
            last[label] = (final_step, statistics.fmean(train[label][s] for s in window))
        metric = f"mean training loss over steps {window[0]}-{final_step}"
    seeds: dict[str, dict[int, float]] = defaultdict(dict)
    speed: dict[str, list[float]] = defaultdict(list)
    replicates: dict[int, list[tuple[str, float]]] = defaultdict(list)  # seed -> (run, loss), in file order
    for run, (_, loss) in last.items():
        recipe, seed = split_label(label_of[run])
        if baseline_replicates and recipe == BASELINE:
            replicates[seed].append((run, loss))
        seeds[recipe][seed] = loss
        pts = rates[run]
        speed[recipe] += [t for s, t in pts if pts and s > pts[-1][0] // 2]
    if BASELINE not in seeds:
        raise ValueError(f"{', '.join(map(str, paths))}: no {BASELINE} run to compare against"
                         + (f" (failed runs: {', '.join(failed)})." if failed else "."))
    if baseline_replicates:
        seeds[BASELINE] = replicate_means({s: [loss for _, loss in v] for s, v in replicates.items()})
    by_recipe: dict[str, dict[str, str]] = defaultdict(dict)
    for run, why in failed.items():
        by_recipe[split_label(label_of.get(run, run))[0]][run] = why
    base = seeds[BASELINE]
    rows = []
    for recipe in [*seeds, *(r for r in by_recipe if r not in seeds)]:
        by_seed = seeds.get(recipe, {})
        losses = [by_seed[s] for s in sorted(by_seed)]
        row = {"recipe": recipe, "seeds": sorted(by_seed), "mean": statistics.fmean(losses) if losses else None,
               "std": statistics.stdev(losses) if len(losses) > 1 else None,
               "tokens_per_s": statistics.median(speed[recipe]) if speed[recipe] else None,
               "target_pct": targets.get(recipe)}
        if recipe != BASELINE and by_seed:
            shared = set(by_seed) & set(base)
            if len(shared) >= 2 or (shared and (len(by_seed) < 2 or len(base) < 2)):
                g = paired_gap(by_seed, base, confidence)
            else:  # unpaired: fewer than two seeds in common
                g, shared = welch_gap(losses, list(base.values()), confidence), set(base)
            method = g.method
            if baseline_replicates:  # the method must say what the baseline was
                note = _runs_note(shared, replicates)
                if g.method.startswith("paired"):
                    method = f"paired vs mean of {BASELINE} replicates ({note})"
                elif g.method == "Welch":
                    method = f"Welch vs per-seed means of {BASELINE} replicates ({note})"
                else:
                    method = f"{g.method}; vs mean of {BASELINE} replicates ({note})"
            row.update(gap_pct=g.gap_pct, ci_lo=g.lo, ci_hi=g.hi, method=method,
                       verdict=verdict(g.lo, g.hi, row["target_pct"]), gap_sd=g.sd,
                       seeds_to_meet=(seeds_to_meet(g.sd, row["target_pct"], confidence)
                                      if g.sd is not None and row["target_pct"] is not None else None),
                       seeds_to_meet_at_gap=(seeds_to_meet(g.sd, row["target_pct"], confidence, g.gap_pct)
                                             if g.sd is not None and row["target_pct"] is not None else None))
        elif recipe != BASELINE:
            row.update(gap_pct=None, ci_lo=None, ci_hi=None, method="no complete run")
        else:
            row["verdict"] = ""
            if baseline_replicates:
                row.update(method=f"mean of its runs per seed ({_runs_note(base, replicates)})",
                           runs=sum(map(len, replicates.values())))
        if recipe in by_recipe:
            row.update(verdict="failed", failed_runs=by_recipe[recipe])
        rows.append(row)
    result = {"final_step": final_step, "metric": metric, "confidence": confidence, "rows": rows,
              "incomplete": incomplete, "corpus": corpora, "runs_without_corpus": sorted(set(last) - set(corpus)),
              "failed": {r: sorted(d) for r, d in by_recipe.items()},
              "seeds": {k: {str(s): v for s, v in sorted(d.items())} for k, d in seeds.items()}}
    if baseline_replicates:
        result["baseline_replicates"] = _replicates_summary(replicates, confidence)
    return result


def _runs_note(seeds: Iterable[int], replicates: dict[int, list[tuple[str, float]]]) -> str:
    """How many of ``seeds`` have how many baseline runs: ``"36 seeds, 26 with 2 runs"``
    (the seeds not named have one), ``"3 seeds, each with 2 runs"``."""
    seeds = sorted(seeds)
    counts = Counter(len(replicates[s]) for s in seeds)
    if len(counts) == 1:
        k = next(iter(counts))
        tail = f"each with {k} run{'s' if k != 1 else ''}"
    else:
        tail = ", ".join(f"{n} with {k} runs" for k, n in sorted(counts.items()) if k > 1)
    return f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}, {tail}"


def _replicates_summary(replicates: dict[int, list[tuple[str, float]]], confidence: float) -> dict:
    """The JSON of the baseline's runs per seed: counts, losses, run names and the floor."""
    losses = {s: [loss for _, loss in replicates[s]] for s in sorted(replicates)}
    floor = replicate_floor(losses, confidence)
    counts = Counter(map(len, losses.values()))
    return {"recipe": BASELINE, "runs_per_seed": {str(k): counts[k] for k in sorted(counts)},
            "losses": {str(s): v for s, v in losses.items()},
            "runs": {str(s): [run for run, _ in replicates[s]] for s in sorted(replicates)},
            "floor": None if floor is None else {
                "seeds": floor.n, "gaps": {str(s): gap_pct(v[1], v[0]) for s, v in losses.items() if len(v) > 1},
                "gap_pct": floor.gap_pct, "lo": floor.lo, "hi": floor.hi, "sd": floor.sd}}


def to_markdown(result: dict) -> str:
    """The tables of one :func:`analyze` result."""
    pct = round(100 * result["confidence"])
    metric = result.get("metric", "final validation loss")
    head = "final val loss" if metric == "final validation loss" else metric
    what = f"Final validation loss at step {result['final_step']}" if head == "final val loss" \
        else f"{metric[0].upper()}{metric[1:]}"
    replicated = result.get("baseline_replicates")
    versus = f"the mean of the `{BASELINE}` runs at the same seed" if replicated else f"`{BASELINE}`"
    lines = [f"{what}; gap = recipe vs {versus} in %, {pct} % interval.", "",
             f"| recipe | seeds | {head} (mean ± std) | gap vs {'mean of ' if replicated else ''}{BASELINE}"
             f"{' runs' if replicated else ''} | {pct} % interval | method "
             "| target | verdict | seeds to meet at gap 0 | at its gap | tokens/s |",
             "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in result["rows"]:
        std = f" ± {r['std']:.4f}" if r["std"] is not None else ""
        mean = f"{r['mean']:.4f}{std}" if r["mean"] is not None else "—"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else ""
        target = f"± {r['target_pct']} %" if r["target_pct"] is not None else ""
        need = need_here = ""
        count = str(len(r["seeds"]))
        if r["recipe"] == BASELINE:
            gap, interval, method, verdict_ = "baseline", "", r.get("method", ""), r.get("verdict", "")
            if replicated:
                gap, count = "baseline: mean of runs", f"{count} ({r['runs']} runs)"
        else:
            gap = f"{r['gap_pct']:+.2f} %" if r["gap_pct"] is not None else "—"
            interval = f"[{r['ci_lo']:+.2f}, {r['ci_hi']:+.2f}] %" if r["ci_lo"] is not None else "—"
            method, verdict_ = r["method"], r["verdict"]
            if r.get("gap_sd") is not None and r["target_pct"] is not None and verdict_ != "failed":
                need = str(r["seeds_to_meet"]) if r.get("seeds_to_meet") is not None else f"> {SEEDS_LIMIT}"
                if abs(r["gap_pct"]) >= r["target_pct"]:
                    need_here = "never"  # a mean gap beyond the target is met at no seed count
                else:
                    at = r.get("seeds_to_meet_at_gap")
                    need_here = str(at) if at is not None else f"> {SEEDS_LIMIT}"
        lines.append(f"| `{r['recipe']}` | {count} | {mean} | {gap} | {interval} | "
                     f"{method} | {target} | {verdict_} | {need} | {need_here} | {tps} |")
    if replicated:
        lines += _replicate_lines(result)
    seeds = sorted({int(s) for d in result["seeds"].values() for s in d})
    n = max((len(r["seeds"]) for r in result["rows"]), default=0)
    targets = sorted({r["target_pct"] for r in result["rows"] if r["target_pct"] is not None})
    if n >= 2 and targets:  # what a "met" needs at this seed count: readers expect "unresolved" otherwise
        t = t_quantile(0.5 + result["confidence"] / 2, n - 1)
        more = "; ".join(f"± {x} %: below {resolvable_sd(x, n, result['confidence']):.2f} %" for x in targets[1:])
        lines += ["", f"With {n} seeds (t = {t:.2f}), a row meets ± {targets[0]} % only if its per-seed gaps' "
                  f"standard deviation is below {resolvable_sd(targets[0], n, result['confidence']):.2f} %"
                  + (f" ({more})" if more else "") + ", and then only at a mean gap of zero; an unresolved row "
                  "needs more seeds or a steadier gap (docs/convergence.md). \"Seeds to meet at gap 0\": the "
                  "paired seeds at which a recipe whose true gap is zero would meet its target if its per-seed "
                  "gaps kept this standard deviation (a planning figure: a few seeds' standard deviation is itself "
                  "uncertain); \"at its gap\": the same if its true gap were its mean gap now."]
    if result.get("corpus"):
        missing = result.get("runs_without_corpus", [])
        lines += ["", f"Corpus fingerprint `{result['corpus']}`, recorded by every run"
                  + (f" but {len(missing)} that record none ({', '.join(missing[:4])}"
                     f"{', ...' if len(missing) > 4 else ''}: metrics written before runs recorded their "
                     "corpus, or data without a fingerprint)." if missing else ".")]
    lines += ["", f"{metric[0].upper()}{metric[1:]} by seed:", "",
              "| recipe | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---:|" * len(seeds)]
    for recipe, d in result["seeds"].items():
        name = f"`{recipe}` (mean of runs)" if replicated and recipe == BASELINE else f"`{recipe}`"
        lines.append(f"| {name} | " + " | ".join(f"{d[str(s)]:.4f}" if str(s) in d else "" for s in seeds) + " |")
        if replicated and recipe == BASELINE:  # each run under the mean, in the order of the files
            losses = replicated["losses"]
            for i in range(max(map(len, losses.values()))):
                lines.append(f"| `{recipe}` run {i + 1} | " + " | ".join(
                    f"{losses[str(s)][i]:.4f}" if len(losses.get(str(s), ())) > i else "" for s in seeds) + " |")
    failed = {label: why for r in result["rows"] for label, why in r.get("failed_runs", {}).items()}
    if failed:  # the rows above with these recipes are judged failed, whatever their other seeds say
        lines += ["", "Failed runs (their recipes' verdict is failed; the seeds that completed are shown, "
                  "not judged): " + ", ".join(f"`{k}` ({why})" for k, why in failed.items()) + "."]
    return "\n".join(lines)


def _replicate_lines(result: dict) -> list[str]:
    """The paragraph under the table of a result with ``baseline_replicates``: how many seeds have
    how many baseline runs, and the run-to-run floor beside the recipes' per-seed spreads."""
    replicated = result["baseline_replicates"]
    counts = replicated["runs_per_seed"]
    runs = sum(int(k) * n for k, n in counts.items())
    per_seed = ", ".join(f"{n} with {k} run{'s' if k != '1' else ''}" for k, n in counts.items())
    lines = ["", f"Baseline: at each seed `{BASELINE}` is the **mean of its runs** at that seed, and every recipe "
             f"is paired with that mean, not with one run ({sum(counts.values())} seeds: {per_seed}; {runs} runs)."]
    floor = replicated["floor"]
    if floor is None:
        return lines + ["No seed has two runs: no run-to-run floor."]
    if floor["sd"] is None:
        return lines + [f"Run-to-run floor: at the one seed with two runs the second differs from the first by "
                        f"{floor['gap_pct']:+.2f} %; one seed gives no standard deviation."]
    spreads = ", ".join(f"`{r['recipe']}` {r['gap_sd']:.2f} %" for r in result["rows"] if r.get("gap_sd") is not None)
    return lines + [f"Run-to-run floor: at the {floor['seeds']} seeds with two or more runs, the second run (in the "
                    f"order of the files) differs from the first by {floor['gap_pct']:+.2f} % "
                    f"[{floor['lo']:+.2f}, {floor['hi']:+.2f}] % on average, with a standard deviation of "
                    f"**{floor['sd']:.2f} %**: the spread of the difference of two runs of one recipe and seed; "
                    f"one run's own share is about {floor['sd'] / math.sqrt(2):.2f} % (÷ √2), "
                    "a mean of k runs' that ÷ √k"
                    + (f". The recipes' per-seed gaps' standard deviations: {spreads}." if spreads else ".")]


def report(*paths: Path) -> str:
    """The Markdown tables for one comparison's metrics files (see :func:`analyze`)."""
    return to_markdown(analyze(list(paths)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", type=Path, nargs="+", help="metrics.jsonl(.gz) files of one comparison")
    p.add_argument("--json", type=Path, default=None, help="also write the statistics here as JSON")
    p.add_argument("--steps", type=int, default=None,
                   help="the planned steps: runs that did not reach them are named and fail their recipe")
    p.add_argument("--train-window", type=int, default=None, metavar="N",
                   help="compare each run's mean training loss over its last N steps (new batches: a "
                        "held-out estimate) instead of its final validation loss")
    p.add_argument("--baseline-replicates", action="store_true",
                   help=f"{BASELINE} runs of one seed may be in several files (trained again): pair every recipe "
                        f"with the mean of its seed's {BASELINE} runs, and report their run-to-run floor")
    args = p.parse_args(argv)
    try:
        result = analyze(args.metrics, steps=args.steps, train_window=args.train_window,
                         baseline_replicates=args.baseline_replicates)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(to_markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


__all__ = ["BASELINE", "TARGETS", "analyze", "failed_runs", "read_records", "read_runs", "report", "split_label",
           "to_markdown"]


if __name__ == "__main__":
    main()
