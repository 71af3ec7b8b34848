"""Show: the Markdown table, the heatmap PNG and the one-paragraph summary of an analysis."""

from __future__ import annotations

import math
from pathlib import Path

from .candidates import CANDIDATES, GEMMS
from .recommend import Budget, Choice
from .run import Analysis

#: Exact results are drawn at this many dB in the heatmap (the colour scale's top).
HEATMAP_CAP_DB = 60.0


def _cell(v: float) -> str:
    return "—" if math.isnan(v) else "exact" if math.isinf(v) else f"{v:.1f}"


def markdown_table(analysis: Analysis, plan: dict[str, Choice]) -> str:
    """GEMM output SQNR (dB) per layer, GEMM and format, the chosen format in bold; then the
    operands' outlier statistics.

    Parameters
    ----------
    analysis:
        From ``hybridfp.analyze``.
    plan:
        From ``recommend`` (may be empty: nothing marked).

    Returns
    -------
    str
    """
    fmts = list(analysis.formats)
    lines = ["| layer | GEMM | " + " | ".join(fmts) + " | chosen |", "|---|---|" + "---|" * (len(fmts) + 1)]
    for layer in analysis.layers:
        for i, gemm in enumerate(GEMMS):
            chosen = plan.get(layer, ("",) * 3)[i]
            cells = []
            for f in fmts:
                c = _cell(analysis.output_db(layer, gemm, f))
                cells.append(f"**{c}**" if f == chosen else c)
            lines.append(f"| {layer} | {gemm} | " + " | ".join(cells) + f" | {chosen} |")
    lines += ["", "Outliers (excess kurtosis; octaves from the mean to the largest 16-element block amax; "
              "fraction of nonzero blocks NVFP4 1D flushes to zero in the operand's first GEMM):", "",
              "| layer | operand | kurtosis | block amax spread | NVFP4 flushed |", "|---|---|---|---|---|"]
    first = {"input": ("fprop", 0), "weight": ("fprop", 1), "grad_output": ("dgrad", 0)}
    for layer in analysis.layers:
        for t, (gemm, _) in first.items():
            s = analysis.operands.get((layer, t))
            if s is None:
                continue
            e = analysis.errors.get((layer, gemm, "nvfp4_1d"))
            flushed = "—" if e is None else f"{100 * e.flushed_fraction:.2f} %"
            lines.append(f"| {layer} | {t} | {s.kurtosis:.2f} | {s.block_spread:.2f} | {flushed} |")
    lines += ["", "Cost (bytes per element the GEMMs read, measured over every GEMM, high_precision in the "
              "analysis' FP32; GEMM speed vs BF16 as "
              "hybridfp runs the pair on Hopper, from bench/RESULTS.md):", "",
              "| format | bits | bytes / element | speed vs BF16 |", "|---|---|---|---|"]
    for f in fmts:
        sums = [e for (_, _, g), e in analysis.errors.items() if g == f]
        nbytes, numel = sum(e.nbytes for e in sums), sum(e.numel for e in sums)
        c = CANDIDATES[f]
        lines.append(f"| {f} | {c.tier} | {nbytes / max(numel, 1):.3f} | {c.speed:.2f}x |")
    return "\n".join(lines)


def summary(analysis: Analysis, plan: dict[str, Choice], budget: Budget) -> str:
    """One paragraph: where low precision hurts and how much of each GEMM NVFP4 serves.

    Parameters
    ----------
    analysis, plan, budget:
        From ``hybridfp.analyze`` and ``recommend``.

    Returns
    -------
    str
    """
    parts = [f"Budget: {budget.describe()}, over {len(analysis.layers)} layers and {analysis.batches} "
             f"batch{'es' if analysis.batches != 1 else ''}."]
    for i, gemm in enumerate(GEMMS):
        tiers = [CANDIDATES[plan[layer][i]].tier for layer in analysis.layers]
        fp4 = sum(t == 4 for t in tiers)
        needs = [layer for layer, t in zip(analysis.layers, tiers) if t > 4]
        text = f"{gemm}: a 4-bit format is within budget for {100 * fp4 / max(len(tiers), 1):.0f} % of the layers"
        if needs:
            shown = ", ".join(f"{layer} ({plan[layer][i]})" for layer in needs[:6])
            more = f" and {len(needs) - 6} more" if len(needs) > 6 else ""
            text += f"; {shown}{more} need{'s' if len(needs) == 1 else ''} a wider format"
        parts.append(text + ".")
    worst = sorted(((s.kurtosis, layer, t) for (layer, t), s in analysis.operands.items()
                    if not math.isnan(s.kurtosis)), reverse=True)[:1]
    if worst:
        k, layer, t = worst[0]
        parts.append(f"The heaviest-tailed operand is {layer}'s {t} (excess kurtosis {k:.1f}).")
    return " ".join(parts)


def heatmap(analysis: Analysis, path: str | Path) -> Path:
    """A PNG heatmap: rows layer x GEMM, columns formats, colour = output SQNR (dB).

    Parameters
    ----------
    analysis:
        From ``hybridfp.analyze``.
    path:
        The PNG to write.

    Returns
    -------
    Path

    Raises
    ------
    ModuleNotFoundError
        matplotlib is missing (``pip install 'hybridfp[train]'``).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("hybridfp analyze: the heatmap needs matplotlib; pip install "
                                  "'hybridfp[train]'.") from e
    fmts = list(analysis.formats)
    rows = [(layer, gemm) for layer in analysis.layers for gemm in GEMMS]
    grid = [[min(analysis.output_db(layer, gemm, f), HEATMAP_CAP_DB) for f in fmts] for layer, gemm in rows]
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(fmts), 1.5 + 0.22 * len(rows)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=HEATMAP_CAP_DB)
    ax.set_xticks(range(len(fmts)), fmts, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{layer} {gemm}" for layer, gemm in rows], fontsize=6)
    fig.colorbar(im, ax=ax, label=f"GEMM output SQNR (dB, exact drawn at {HEATMAP_CAP_DB:g})")
    ax.set_title("hybridfp analyze: GEMM output error per layer, GEMM and format", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
