"""loss.png: every compared recipe on one plot, and its gap to the BF16 baseline below.

Top: training loss (exponential moving average; the raw curve is noisy at small batch
sizes) as lines, validation loss as markers. Bottom: relative gap to ``bf16`` in percent,
100 * (loss - loss_bf16) / loss_bf16, for the smoothed training loss and at each evaluation.
Both runs see the same batches, so the per-step gap is a paired comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .loop import RunResult

BASELINE = "bf16"


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


def plot_losses(results: Sequence[RunResult], path: Path, title: str = "") -> Path:
    """Write the two-panel loss plot to ``path`` and return it (needs matplotlib: the ``train``
    extra, ``pip install 'hybridfp[train]'``)."""
    # the object API renders with Agg: no pyplot, no display
    from matplotlib.figure import Figure
    base: Optional[RunResult] = next((r for r in results if r.label == BASELINE), None)
    steps_max = max((s for r in results for s in _series(r, "train_loss")[0]), default=1)
    span = max(1, steps_max // 20)
    fig = Figure(figsize=(9, 7.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base_smooth: dict[int, float] = {}
    base_val: dict[int, float] = {}
    if base is not None:
        s, v = _series(base, "train_loss")
        base_smooth = dict(zip(s, ema(v, span)))
        base_val = dict(zip(*_series(base, "val_loss")))
    for i, r in enumerate(results):
        color = f"C{i}"
        s, v = _series(r, "train_loss")
        smooth = ema(v, span)
        top.plot(s, smooth, color=color, lw=1.6, label=f"{r.label} (train, EMA)")
        vs, vv = _series(r, "val_loss")
        top.plot(vs, vv, "o--", color=color, ms=4, lw=0.8, label=f"{r.label} (val)")
        if base is not None and r is not base:
            gs = [(st, 100 * (x - base_smooth[st]) / base_smooth[st])
                  for st, x in zip(s, smooth) if st in base_smooth]
            bottom.plot([g[0] for g in gs], [g[1] for g in gs], color=color, lw=1.4, label=f"{r.label} (train)")
            gv = [(st, 100 * (x - base_val[st]) / base_val[st]) for st, x in zip(vs, vv) if st in base_val]
            bottom.plot([g[0] for g in gv], [g[1] for g in gv], "o--", color=color, ms=4, lw=0.8,
                        label=f"{r.label} (val)")
    top.set_ylabel("loss (nats/token)")
    top.set_title(title or "training loss by recipe")
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(0.0, color="k", lw=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"gap vs {BASELINE} (%)")
    bottom.grid(alpha=0.3)
    if base is None:
        bottom.text(0.5, 0.5, f"add {BASELINE} to --compare to see the gap", ha="center", va="center",
                    transform=bottom.transAxes)
    elif len(results) > 1:
        bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
