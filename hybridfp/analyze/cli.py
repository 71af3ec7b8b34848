"""``hybridfp analyze``: per-layer, per-GEMM precision analysis of a model and a recommended recipe.

    hybridfp analyze --preset tiny                       # writes runs/analyze-tiny/
    hybridfp analyze --preset tiny-moe --budget-like mxfp8
    hybridfp analyze --hf-config qwen3-moe-tiny --budget-db 20 --batches 4

Outputs under ``--out`` (default ``runs/analyze-<preset>``): analysis.md (table, outliers,
summary), heatmap.png, and recommended_recipe.py, whose ``factory`` trains with
``hybridfp train --recipe recommended_recipe:factory`` (the folder on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

import torch

from ..train.data import get_batch, load_data
from ..train.model import GPT, PRESETS, GPTConfig
from .candidates import CANDIDATES
from .recommend import BUDGET_LIKE, Budget, recommend, write_factory
from .run import Analysis, analyze
from .show import heatmap, markdown_table, summary

FACTORY_FILE = "recommended_recipe.py"


def add_analyze_args(p: argparse.ArgumentParser) -> None:
    """Add the options of ``hybridfp analyze`` to ``p``.

    Parameters
    ----------
    p:
        The parser (or subcommand parser) to extend.

    Returns
    -------
    None
    """
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape (default: tiny); with --hf-config, only the batch size and sequence "
                        "length defaults")
    p.add_argument("--hf-config", dest="hf_config_path", metavar="PATH",
                   help="a transformers config.json (or a shipped config's name) instead of --preset (hf extra)")
    p.add_argument("--data", help="token data as for hybridfp train (default: the stdlib corpus)")
    p.add_argument("--batches", type=int, default=1, help="forward + backward steps to measure (default 1)")
    p.add_argument("--batch-size", type=int, help="default: the preset's")
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    p.add_argument("--max-rows", type=int, default=128,
                   help="measure N evenly spaced tokens of each GEMM (default 128, which keeps the CPU "
                        "reference quantizers within a minute on the tiny preset; 0: every token)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--budget-db", type=float, help="every GEMM output's SQNR must reach this many dB")
    g.add_argument("--budget-like", choices=sorted(BUDGET_LIKE),
                   help="every GEMM output no worse than under this format (default: mxfp8); formats "
                        "that serve some GEMMs only (nvfp4_rht, nvfp4_row_scaled) set no bar for the others")
    p.add_argument("--formats", help=f"comma-separated candidates (default all: {','.join(CANDIDATES)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="output directory (default runs/analyze-<preset>)")


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1; got {value}.")


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, int, int, int]:
    """The model and batch shape the arguments ask for.

    Parameters
    ----------
    args:
        Parsed ``add_analyze_args`` options (preset, hf_config_path, batch_size, seq_len, seed,
        device).

    Returns
    -------
    tuple
        (model in FP32, vocabulary size, batch size, sequence length).

    Raises
    ------
    ValueError
        ``--seq-len`` beyond the preset's block size, or a config ``check_hf_config`` refuses.
    """
    preset = PRESETS[args.preset]
    batch_size = args.batch_size or preset.batch_size
    seq_len = args.seq_len or preset.seq_len
    if args.hf_config_path:
        from ..train.hf_model import build_hf_model, check_hf_config, read_hf_config
        _, config = read_hf_config(args.hf_config_path)
        vocab = 256
        check_hf_config(config, vocab, seq_len)
        return build_hf_model(config, args.seed, torch.float32, args.device), vocab, batch_size, seq_len
    torch.manual_seed(args.seed)
    cfg = GPTConfig(**preset.model.to_dict())
    if seq_len > cfg.block_size:
        raise ValueError(f"--seq-len {seq_len} exceeds the preset's block_size={cfg.block_size}.")
    return GPT(cfg, torch.float32).to(args.device), cfg.vocab_size, batch_size, seq_len


def run_analyze(args: argparse.Namespace) -> int:
    """Run ``hybridfp analyze`` for parsed arguments; print the summary and the files written.

    Parameters
    ----------
    args:
        Parsed ``add_analyze_args`` options.

    Returns
    -------
    int
        The exit status, 0.

    Raises
    ------
    ValueError
        A non-positive count, a negative ``--max-rows``, an unknown format or a bad model option.
    """
    for name in ("batches", "batch_size", "seq_len"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.max_rows < 0:
        raise ValueError(f"--max-rows must be at least 0 (0: every token); got {args.max_rows}.")
    budget = Budget(db=args.budget_db) if args.budget_db is not None else Budget(like=args.budget_like or "mxfp8")
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip()) if args.formats else None
    if formats is not None and "high_precision" not in formats:
        formats = ("high_precision", *formats)  # the fallback every budget admits
    if budget.like is not None and formats is not None and budget.like not in formats:
        formats = (*formats, budget.like)
    t0 = time.time()
    model, _, batch_size, seq_len = build_model(args)
    data = load_data(args.data)
    batches = [tuple(t.to(args.device) for t in get_batch(data.train, batch_size, seq_len, args.seed, i))
               for i in range(args.batches)]
    result = analyze(model, batches, formats=formats, max_rows=args.max_rows or None, seed=args.seed)
    out = Path(args.out or f"runs/analyze-{'hf' if args.hf_config_path else args.preset}")
    written = write_outputs(result, budget, out)
    print(written["summary"])
    for key in ("table", "heatmap", "factory"):
        print(f"{key}: {written[key]}")
    print(f"({time.time() - t0:.1f} s)")
    return 0


def write_outputs(result: Analysis, budget: Budget, out: Path) -> dict:
    """Write analysis.md, heatmap.png and the factory file under ``out`` (created if missing).

    Parameters
    ----------
    result:
        From ``analyze``.
    budget:
        The budget the recommendation meets.
    out:
        The output directory.

    Returns
    -------
    dict
        summary (str), plan, and the paths table, heatmap, factory.

    Raises
    ------
    ValueError
        From ``recommend``: the budget's reference format was not measured.
    """
    out.mkdir(parents=True, exist_ok=True)
    plan = recommend(result, budget)
    text = summary(result, plan, budget)
    table = out / "analysis.md"
    table.write_text(f"# hybridfp analyze\n\n{text}\n\nGEMM output SQNR in dB against high precision; "
                     f"bold: the recommended format ({budget.describe()}).\n\n{markdown_table(result, plan)}\n")
    return {"summary": text, "plan": plan, "table": table, "heatmap": heatmap(result, out / "heatmap.png"),
            "factory": write_factory(out / FACTORY_FILE, plan, budget, text)}
