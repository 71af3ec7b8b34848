"""summary.md: final losses, gaps to BF16, throughput and the GEMMs that ran emulated."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from .files import atomic_write_text
from .loop import RunResult, TrainConfig
from .plot import BASELINE


def relative_gap(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """100 * (value - base) / base, or None when either is missing."""
    if value is None or base is None or base == 0:
        return None
    return 100.0 * (value - base) / base


def _fmt(x: Optional[float], spec: str) -> str:
    return "—" if x is None else format(x, spec)


def summary_markdown(results: Sequence[RunResult], cfg: TrainConfig, info: dict[str, Any]) -> str:
    """The summary as Markdown text. ``info``: data source, parameter count, device name, paths."""
    base = next((r for r in results if r.label == BASELINE), None)
    base_val = base.final_val_loss if base else None
    # the model: a preset's GPT, or ``info["model"]`` (hybridfp train --hf-config)
    model = info.get("model") or f"Preset `{cfg.preset}` ({info.get('params', 0):,} parameters)"
    lines = [
        f"# hybridfp train: {', '.join(r.label for r in results)}",
        "",
        f"{model}, {cfg.steps} steps of "
        f"{cfg.batch_size} x {cfg.seq_len} tokens ({cfg.steps * cfg.tokens_per_step:,} tokens), "
        f"lr {cfg.lr:g}, seed {cfg.seed}, activations {cfg.dtype}, device {info.get('device', cfg.device)}.",
        f"Data: {info.get('data', '?')}.",
        "Every recipe starts from the same weights and sees the same batches.",
        "",
        "| recipe | final val loss | gap vs bf16 | final train loss | tokens/s | what it is |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        gap = relative_gap(r.final_val_loss, base_val)
        gap_s = "baseline" if r is base else ("—" if gap is None else f"{gap:+.2f} %")
        lines.append(f"| `{r.label}` | {_fmt(r.final_val_loss, '.4f')} | {gap_s} | "
                     f"{_fmt(r.final_train_loss, '.4f')} | {r.tokens_per_s:,.0f} | {r.description} |")
    if base is None:
        lines += ["", f"(No `{BASELINE}` run in this comparison: add it to --compare for the gaps.)"]
    lines += ["", "Gap: 100 x (val loss - bf16 val loss) / bf16 val loss, at the last evaluation "
              f"({cfg.eval_iters} fixed validation batches).", "",
              "## GEMMs on the exact emulation path", "",
              "Operand-format pairs with no fast kernel on this device (as recorded in "
              "`hybridfp.gemm.EMULATED`); they are exact but slow, so tokens/s above measures the "
              "emulation, not the formats' speed.", ""]
    for r in results:
        lines.append(f"- `{r.label}`:" + (" none" if not r.emulated else ""))
        lines += [f"  - {e}" for e in r.emulated]
    lines += ["", "## Files", "",
              f"- metrics: `{info.get('metrics', 'metrics.jsonl')}` (one JSON line per step and recipe)",
              f"- plot: `{info.get('plot', 'loss.png')}`",
              *[f"- checkpoint `{r.label}`: `{r.checkpoint}`" for r in results if r.checkpoint],
              "", f"Resume: `{info.get('resume_command', 'hybridfp train --resume --out <dir> --steps N')}`", ""]
    return "\n".join(lines)


def write_summary(path: Path, results: Sequence[RunResult], cfg: TrainConfig, info: dict[str, Any]) -> Path:
    """Write summary.md and return its path."""
    atomic_write_text(path, summary_markdown(results, cfg, info))
    return path
