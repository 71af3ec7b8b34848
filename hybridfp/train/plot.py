"""loss.png: every compared recipe on one plot, and its gap to the BF16 baseline below.

Top: training loss (exponential moving average; the raw curve is noisy at small batch
sizes) as lines, validation loss as markers. Bottom: relative gap to ``bf16`` in percent,
100 * (loss - loss_bf16) / loss_bf16, for the smoothed training loss and at each evaluation,
against the bf16 run at the run's own seed (as summary.md pairs them): both see the same
batches from the same weights, so the per-step gap is a paired comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .loop import RunResult
from .report import BASELINE, baselines_by_seed, reference_run, relative_gap


def ema(values: Sequence[float], span: int) -> list[float]:
    """Bias-corrected exponential moving average with the given span (in steps)."""
    alpha, avg, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def _series(r: RunResult, key: str) -> tuple[list[int], list[float]]:
    pts = [(rec["step"], rec[key]) for rec in r.records if key in rec]
    return [p[0] for p in pts], [p[1] for p in pts]


def _span(results: Sequence[RunResult]) -> int:
    """The EMA span: a twentieth of the longest run."""
    return max(1, max((s for r in results for s in _series(r, "train_loss")[0]), default=1) // 20)


def gap_series(results: Sequence[RunResult], default_seed: int = 0, span: int = 0
               ) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Each run's gap to its reference run (``report.reference_run``: the bf16 run at its seed),
    in percent: ``{label: {"train": (steps, gaps of the EMA), "val": (steps, gaps)}}``. Runs
    without a reference (the bf16 run at ``default_seed``, a seed with no bf16 run) are absent.

    Parameters
    ----------
    results : the runs of one comparison.
    default_seed : the seed of a label without ``@seed=`` (the run's ``--seed``).
    span : the training loss's EMA span in steps (0: a twentieth of the longest run).

    Returns
    -------
    dict
        label -> "train" / "val" -> (steps, gaps in percent).
    """
    span = span or _span(results)
    bases = baselines_by_seed(results, default_seed)
    out: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for r in results:
        ref = reference_run(r, bases, default_seed)
        if ref is None:
            continue
        curves = {}
        for key, smooth in (("train", True), ("val", False)):
            s, v = _series(r, f"{key}_loss")
            rs, rv = _series(ref, f"{key}_loss")
            mine, theirs = (ema(v, span), ema(rv, span)) if smooth else (v, rv)
            at = dict(zip(rs, theirs))
            gaps = [(st, relative_gap(x, at[st])) for st, x in zip(s, mine) if st in at]
            pts = [(st, g) for st, g in gaps if g is not None]
            curves[key] = ([p[0] for p in pts], [p[1] for p in pts])
        out[r.label] = curves
    return out


def plot_losses(results: Sequence[RunResult], path: Path, title: str = "", default_seed: int = 0) -> Path:
    """Write the two-panel loss plot to ``path`` and return it (needs matplotlib: the ``train``
    extra, ``pip install 'hybridfp[train]'``); ``default_seed`` is the seed of a label without
    ``@seed=`` (the run's ``--seed``), for pairing each run with its bf16 run.

    Raises
    ------
    ImportError
        Without matplotlib.
    """
    # the object API renders with Agg: no pyplot, no display
    from matplotlib.figure import Figure
    span = _span(results)
    gaps = gap_series(results, default_seed, span)
    fig = Figure(figsize=(9, 7.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for i, r in enumerate(results):
        color = f"C{i}"
        s, v = _series(r, "train_loss")
        top.plot(s, ema(v, span), color=color, lw=1.6, label=f"{r.label} (train, EMA)")
        vs, vv = _series(r, "val_loss")
        top.plot(vs, vv, "o--", color=color, ms=4, lw=0.8, label=f"{r.label} (val)")
        if r.label in gaps:
            bottom.plot(*gaps[r.label]["train"], color=color, lw=1.4, label=f"{r.label} (train)")
            bottom.plot(*gaps[r.label]["val"], "o--", color=color, ms=4, lw=0.8, label=f"{r.label} (val)")
    top.set_ylabel("loss (nats/token)")
    top.set_title(title or "training loss by recipe")
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(0.0, color="k", lw=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"gap vs {BASELINE} (%)")
    bottom.grid(alpha=0.3)
    if not gaps:
        bottom.text(0.5, 0.5, f"no run has a {BASELINE} run at its seed to compare with", ha="center", va="center",
                    transform=bottom.transAxes)
    else:
        bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
