"""summary.md: final losses, gaps to the same-seed BF16 run, throughput and the GEMMs that ran
emulated."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from .files import atomic_write_text
from .loop import RunResult, TrainConfig


def relative_gap(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """100 * (value - base) / base, or None when either is missing."""
    if value is None or base is None or base == 0:
        return None
    return 100.0 * (value - base) / base


#: the recipe every gap is measured against
BASELINE = "bf16"


def split_seed(label: str, default_seed: int) -> tuple[str, int]:
    """A run label's recipe and seed.

    Parameters
    ----------
    label : ``"mxfp8@seed=1"``, or a label without ``@seed=`` (it runs at ``default_seed``).
    default_seed : the run's ``--seed``.

    Returns
    -------
    tuple[str, int]
        ``("mxfp8", 1)``; ``(label, default_seed)`` without a seed suffix.
    """
    base, sep, seed = label.rpartition("@seed=")
    if sep and seed.lstrip("-").isdigit():
        return base, int(seed)
    return label, default_seed


def baseline_label(label: str, default_seed: int) -> str:
    """The label of the ``bf16`` run a run's gap is measured against: the same seed.

    Parameters
    ----------
    label : the run's label.
    default_seed : the run's ``--seed`` (the seed of a label without ``@seed=``).

    Returns
    -------
    str
        ``bf16@seed=K``.

    Example
    -------
    >>> from hybridfp.train.report import baseline_label
    >>> baseline_label("mxfp8@seed=1", 0), baseline_label("fp8", 0)
    ('bf16@seed=1', 'bf16@seed=0')
    """
    return f"{BASELINE}@seed={split_seed(label, default_seed)[1]}"


def baselines_by_seed(results: Sequence[RunResult], default_seed: int) -> dict[int, RunResult]:
    """seed -> the bf16 run at that seed (``bf16`` runs at ``default_seed``, ``bf16@seed=K`` at K).

    Parameters
    ----------
    results : the runs of one comparison.
    default_seed : the seed of a label without ``@seed=`` (the run's ``--seed``).

    Returns
    -------
    dict[int, RunResult]
        The first bf16 run of each seed.
    """
    out: dict[int, RunResult] = {}
    for r in results:
        name, seed = split_seed(r.label, default_seed)
        if name == BASELINE:
            out.setdefault(seed, r)
    return out


def reference_run(run: RunResult, bases: dict[int, RunResult], default_seed: int) -> Optional[RunResult]:
    """The run ``run``'s gap is measured against: the bf16 run at its seed; for a bf16 run at
    another seed than ``default_seed``, the one at ``default_seed`` (the seed-to-seed spread, the
    noise floor of every other gap). None for the bf16 run at ``default_seed`` itself, and where
    the same-seed bf16 run is missing.

    Parameters
    ----------
    run : one run of the comparison.
    bases : :func:`baselines_by_seed` of the comparison.
    default_seed : the seed of a label without ``@seed=``.

    Returns
    -------
    Optional[RunResult]
        The reference run, or None.
    """
    if any(run is b for b in bases.values()):
        anchor = bases.get(default_seed)
        return None if run is anchor else anchor
    return bases.get(split_seed(run.label, default_seed)[1])


def _fmt(x: Optional[float], spec: str) -> str:
    return "—" if x is None else format(x, spec)


def summary_markdown(results: Sequence[RunResult], cfg: TrainConfig, info: dict[str, Any]) -> str:
    """The summary as Markdown text. ``info``: data source, parameter count, device name, paths."""
    bases = baselines_by_seed(results, cfg.seed)
    # the model: a preset's GPT, or ``info["model"]`` (hybridfp train --hf-config)
    model = info.get("model") or f"Preset `{cfg.preset}` ({info.get('params', 0):,} parameters)"
    lines = [
        f"# hybridfp train: {', '.join(r.label for r in results)}",
        "",
        f"{model}, {cfg.steps} steps of "
        f"{cfg.batch_size} x {cfg.seq_len} tokens ({cfg.steps * cfg.tokens_per_step:,} tokens), "
        f"lr {cfg.lr:g}, seed {cfg.seed}, activations {cfg.dtype}, device {info.get('device', cfg.device)}.",
        f"Data: {info.get('data', '?')}.",
        "Runs at one seed start from the same weights and see the same batches.",
        "",
        "| recipe | final val loss | gap vs bf16 | final train loss | tokens/s | what it is |",
        "|---|---:|---:|---:|---:|---|",
    ]
    missing: dict[int, list[str]] = {}  # seed -> the runs whose same-seed bf16 run is absent
    for r in results:
        seed = split_seed(r.label, cfg.seed)[1]
        base = reference_run(r, bases, cfg.seed)
        if base is not None:
            gap = relative_gap(r.final_val_loss, base.final_val_loss)
            gap_s = "—" if gap is None else f"{gap:+.2f} %"
        elif any(r is b for b in bases.values()):  # the bf16 run at --seed
            gap_s = "baseline"
        else:
            gap_s = f"no {baseline_label(r.label, cfg.seed)}"
            missing.setdefault(seed, []).append(r.label)
        lines.append(f"| `{r.label}` | {_fmt(r.final_val_loss, '.4f')} | {gap_s} | "
                     f"{_fmt(r.final_train_loss, '.4f')} | {r.tokens_per_s:,.0f} | {r.description} |")
    for seed, labels in missing.items():
        if not bases and all("@seed=" not in x for x in labels):  # one seed, no bf16 at all
            lines += ["", f"(No `{BASELINE}` run in this comparison: add it to --compare for the gaps.)"]
            continue
        lines += ["", f"(No `{BASELINE}@seed={seed}` run in this comparison, so no gap for "
                  f"{', '.join(f'`{x}`' for x in labels)}: add `{BASELINE}@seed={seed}` to --compare "
                  "for them.)"]
    lines += ["", "Gap: 100 x (val loss - bf16 val loss) / bf16 val loss, the bf16 run at the same seed "
              f"(a bf16 run at another seed: to the one at seed {cfg.seed}, the seed-to-seed spread), "
              f"at the last evaluation ({cfg.eval_iters} fixed validation batches).", "",
              "## GEMMs on the exact emulation path", "",
              "Operand-format pairs with no fast kernel on this device (as recorded in "
              "`hybridfp.gemm.EMULATED`), and pairs whose backend cannot take an Identity copy held "
              "in FP32 / FP16 (the copy named in brackets); they are exact but slow, so tokens/s "
              "above measures the emulation, not the formats' speed.", ""]
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
