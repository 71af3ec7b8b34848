"""Validation: do recipes rank the same by ``hybridfp analyze``'s predicted error and by the
loss gap they measure in training?

``python -m hybridfp.analyze.validate --presets test,test-moe --seeds 0,1,2`` analyzes each
preset's model (per seed), recommends a plan under ``--budget-db``, trains five plans (high
precision: Identity without a cast, the analysis' exact reference; MXFP8, NVFP4, NVFP4 forward
/ MXFP8 backward, the recommended one) from the same init and data, and prints the Spearman
rank correlation of the predicted error against the final validation-loss gap to the
high-precision plan (averaged over seeds), and whether the recommended plan stays
within its budget on a held-out batch. Every plan is a ``PlanFactory``, so the recipe trained
is the recipe scored.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..recipes import CustomRecipe
from ..train.data import get_batch, load_data
from ..train.loop import TrainConfig, train_recipe
from ..train.model import GPT, PRESETS, GPTConfig
from ..train.recipes_by_name import NamedRecipe
from .candidates import GEMMS
from .recommend import Budget, Choice, PlanFactory, recommend
from .run import Analysis, analyze

#: The fixed plans compared with the recommended one: (fprop, dgrad, wgrad) for every layer.
FIXED: dict[str, Choice] = {
    # no cast: FP32 master weights give FP32 GEMMs, the reference the analysis measures against
    "high_precision": ("high_precision",) * 3,
    "mxfp8": ("mxfp8",) * 3,
    "nvfp4": ("nvfp4_1d", "nvfp4_sr", "nvfp4_rht"),
    "nvfp4-fwd-mxfp8-bwd": ("nvfp4_1d", "mxfp8", "mxfp8"),
}


def predicted_error(analysis: Analysis, plan: dict[str, Choice]) -> float:
    """Mean relative error energy (10^(-SQNR/10)) of the plan's GEMM outputs; 0 when exact.

    Parameters
    ----------
    analysis:
        From ``analyze``.
    plan:
        layer name -> (fprop, dgrad, wgrad) format names, for every layer of ``analysis``.

    Returns
    -------
    float
        The mean over layers and GEMMs; nan where a chosen format was not measured.

    Raises
    ------
    KeyError
        ``plan`` lacks a layer of ``analysis``.
    """
    terms = [10 ** (-analysis.output_db(layer, gemm, plan[layer][i]) / 10)
             for layer in analysis.layers for i, gemm in enumerate(GEMMS)]
    return sum(terms) / len(terms)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties).

    Parameters
    ----------
    a, b:
        Two samples of the same length (at least 1).

    Returns
    -------
    float
        In [-1, 1]; nan when either sample is constant.

    Raises
    ------
    ZeroDivisionError
        Empty samples.

    Example
    -------
    >>> from hybridfp.analyze.validate import spearman
    >>> spearman([1, 2, 3], [10, 30, 20])
    0.5
    """
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return math.nan if var == 0 else cov / var


def _analysis(preset: str, seed: int, data, index: int, max_rows: Optional[int]) -> Analysis:
    p = PRESETS[preset]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**p.model.to_dict()), torch.float32)
    batch = get_batch(data.train, p.batch_size, p.seq_len, seed, index)
    return analyze(model, [batch], max_rows=max_rows, seed=seed)


def validate_preset(preset: str, seeds: Sequence[int], steps: int, budget: Budget, data_path: Optional[str],
                    max_rows: Optional[int] = 128) -> dict:
    """Predicted errors, loss gaps (mean over seeds), their rank correlation, budget check.

    Per seed: analyzes one batch, recommends a plan within ``budget``, trains it and the fixed
    plans (``FIXED``) for ``steps`` steps, and checks the plan's budget on a held-out batch.

    Parameters
    ----------
    preset:
        A training preset name (``hybridfp.train.model.PRESETS``).
    seeds:
        Seeds to average over.
    steps:
        Training steps per plan.
    budget:
        The budget the recommended plan meets.
    data_path:
        Token data as for ``hybridfp train``; None: the stdlib corpus.
    max_rows:
        As ``analyze``'s.

    Returns
    -------
    dict
        preset, names, predicted, gap, gaps (per seed), spearman, within_budget (per seed).

    Raises
    ------
    KeyError
        An unknown preset.
    """
    p = PRESETS[preset]
    data = load_data(data_path)
    preds: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    within: list[float] = []
    for seed in seeds:
        a = _analysis(preset, seed, data, 0, max_rows)
        plans = {name: {layer: choice for layer in a.layers} for name, choice in FIXED.items()}
        plans["recommended"] = recommend(a, budget)
        held = _analysis(preset, seed, data, 1, max_rows)  # a batch the plan was not chosen on
        ok = [held.output_db(layer, g, plans["recommended"][layer][i]) >= budget.threshold(
              held.output_db(layer, g, budget.like) if budget.like else math.nan)
              for layer in held.layers for i, g in enumerate(GEMMS)]
        within.append(sum(ok) / len(ok))
        losses = {}
        for name, plan in plans.items():
            preds.setdefault(name, []).append(predicted_error(a, plan))
            cfg = TrainConfig(preset=preset, model=GPTConfig(**p.model.to_dict()), steps=steps,
                              batch_size=p.batch_size, seq_len=p.seq_len, lr=p.lr, warmup=min(p.warmup, steps),
                              lr_decay_steps=steps, eval_interval=steps, eval_iters=p.eval_iters, seed=seed,
                              data=data_path)
            named = NamedRecipe(name, CustomRecipe(qfactory=PlanFactory(plan)), f"plan {name}")
            with tempfile.TemporaryDirectory() as tmp:
                losses[name] = train_recipe(cfg, named, data, Path(tmp), progress=False).final_val_loss
        for name in plans:
            gaps.setdefault(name, []).append(losses[name] - losses["high_precision"])
    names = list(preds)
    mean_pred = [sum(preds[n]) / len(preds[n]) for n in names]
    mean_gap = [sum(gaps[n]) / len(gaps[n]) for n in names]
    return {"preset": preset, "names": names, "predicted": mean_pred, "gap": mean_gap,
            "gaps": gaps, "spearman": spearman(mean_pred, mean_gap), "within_budget": within}


def markdown(results: list[dict], budget: Budget, seeds: Sequence[int], steps: int) -> str:
    """The validation table.

    Parameters
    ----------
    results:
        ``validate_preset`` results.
    budget, seeds, steps:
        What they were run with (the heading).

    Returns
    -------
    str
        Markdown: a heading line, then per preset its rank correlation and table.
    """
    lines = [f"Budget {budget.describe()}; seeds {', '.join(map(str, seeds))}; {steps} steps.", ""]
    for r in results:
        lines += [f"**{r['preset']}**: Spearman rank correlation {r['spearman']:.2f}; the recommended plan "
                  f"meets its budget on {', '.join(f'{100 * w:.0f} %' for w in r['within_budget'])} of the "
                  "GEMMs of a held-out batch (per seed).", "",
                  "| plan | predicted error (mean 10^(-dB/10)) | val loss gap to high_precision (mean) | per seed |",
                  "|---|---|---|---|"]
        for n, pe, g in zip(r["names"], r["predicted"], r["gap"]):
            lines.append(f"| {n} | {pe:.4f} | {g:+.4f} | {', '.join(f'{x:+.4f}' for x in r['gaps'][n])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """CLI entry point (``python -m hybridfp.analyze.validate``): prints each preset's table.

    Parameters
    ----------
    argv:
        Arguments (default: ``sys.argv[1:]``).

    Raises
    ------
    SystemExit
        An unknown preset or a bad argument.
    """
    ap = argparse.ArgumentParser(prog="python -m hybridfp.analyze.validate", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="test,test-moe")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--budget-db", type=float, default=20.0)
    ap.add_argument("--data", help="token data (default: the stdlib corpus)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    for name in args.presets.split(","):
        if name not in PRESETS:
            raise SystemExit(f"--presets: {name!r} is unknown; use {', '.join(PRESETS)}.")
    budget = Budget(db=args.budget_db)
    for name in args.presets.split(","):  # each preset's table as soon as it is done
        print(markdown([validate_preset(name, seeds, args.steps, budget, args.data)], budget, seeds, args.steps),
              flush=True)


if __name__ == "__main__":
    main()
