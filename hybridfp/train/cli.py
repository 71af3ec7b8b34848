"""``hybridfp train``: train a small GPT under one or several recipes and compare them.

    hybridfp train                                   # tiny preset: bf16 vs fp8 vs NVFP4/MXFP8
    hybridfp train --compare bf16,fp8,mxfp8-fwd-nvfp4-bwd --steps 300
    hybridfp train --recipe per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8 --preset small --device cuda
    hybridfp train --resume --steps 400              # continue runs/tiny to step 400

Outputs under ``--out`` (default ``runs/<preset>``): metrics.jsonl, loss.png, summary.md,
run.json (the settings, used by --resume) and checkpoints/<recipe>.pt.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence, TypeVar

import torch

from ..gemm import EmulatedGemmWarning
from .data import DataError, load_data
from .loop import DTYPES, FIXED_ON_RESUME, RunResult, TrainConfig, count_params, train_recipe
from .model import PRESETS, GPTConfig
from .parallel import RESULTS_FILE, run_parallel, write_results
from .plot import plot_losses
from .recipes_by_name import known_names, parse_recipe, parse_recipe_list
from .report import summary_markdown, write_summary

T = TypeVar("T")
DEFAULT_COMPARE = "bf16,fp8,per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The options of ``hybridfp train`` (None = the preset's value)."""
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model size and training defaults (default: tiny, a CPU demo)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--recipe", help="one recipe: a built-in or zoo name, per_gemm:fprop=F,dgrad=D,wgrad=W, "
                                    "or package.module:function (see --list-recipes)")
    g.add_argument("--compare", help=f"comma-separated recipes, same seed/data/init for each "
                                     f"(default: {DEFAULT_COMPARE})")
    s = p.add_mutually_exclusive_group()
    s.add_argument("--steps", type=int, help="training steps (total, also when resuming)")
    s.add_argument("--tokens", type=int, help="training tokens (rounded up to whole steps)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup", type=int, help="warmup steps")
    p.add_argument("--lr-decay-steps", type=int,
                   help="cosine decay length (default: --steps; fix it to extend a run later)")
    p.add_argument("--eval-interval", type=int, help="evaluate every N steps (and at the end)")
    p.add_argument("--eval-iters", type=int, help="validation batches per evaluation")
    p.add_argument("--checkpoint-interval", type=int, default=0,
                   help="also checkpoint every N steps (default: only at the end)")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="activation dtype (default bf16)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--data", help="DIR with train.bin/val.bin, DIR of text files, or a text/.bin FILE "
                                  "(default: the Python standard library's source)")
    p.add_argument("--cache-dir", help="where the default corpus is cached (default ~/.cache/hybridfp)")
    p.add_argument("--out", help="output directory (default runs/<preset>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the runs in --out from their checkpoints, bit for bit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--jobs", type=int, default=1,
                   help="train the compared recipes in N concurrent worker processes (spread over "
                        "the visible GPUs with --device cuda); default 1: one after the other")
    p.add_argument("--list-recipes", action="store_true", help="print the recipe names and exit")


def build_parser() -> argparse.ArgumentParser:
    """``hybridfp`` with its subcommands."""
    parser = argparse.ArgumentParser(prog="hybridfp", description="hybridfp command line")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a small GPT under one or more recipes and compare them",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(train)
    return parser


def _pick(value: Optional[T], default: T) -> T:
    """An explicit flag's value (zero included), else the default."""
    return default if value is None else value


def _steps(args: argparse.Namespace, tokens_per_step: int) -> Optional[int]:
    if args.steps is not None:
        return args.steps
    return math.ceil(args.tokens / tokens_per_step) if args.tokens is not None else None


def config_from_args(args: argparse.Namespace, saved: Optional[dict] = None) -> TrainConfig:
    """The run's settings: the preset's, overridden by explicit flags.

    When resuming (``saved``: the run's stored settings), the stored settings win except the
    target ``--steps``/``--tokens``, ``--eval-interval``, ``--device`` and ``--checkpoint-interval``.
    """
    if saved:
        cfg = TrainConfig(**{**saved, "model": GPTConfig(**saved["model"])})
        for key in FIXED_ON_RESUME:
            given = getattr(args, key, None)
            if key != "preset" and given is not None and given != saved[key]:
                print(f"note: --resume keeps {key}={saved[key]!r} from the run in progress "
                      f"(ignoring {given!r})", file=sys.stderr)
        cfg.steps = _pick(_steps(args, cfg.tokens_per_step), cfg.steps)
        cfg.eval_interval = _pick(args.eval_interval, cfg.eval_interval)
        cfg.device = _pick(args.device, cfg.device)
        cfg.checkpoint_interval = args.checkpoint_interval
    else:
        preset = PRESETS[args.preset]
        batch_size, seq_len = _pick(args.batch_size, preset.batch_size), _pick(args.seq_len, preset.seq_len)
        steps = _pick(_steps(args, max(1, batch_size * seq_len)), preset.steps)
        cfg = TrainConfig(
            preset=args.preset, model=GPTConfig(**preset.model.to_dict()), steps=steps,
            batch_size=batch_size, seq_len=seq_len, lr=_pick(args.lr, preset.lr),
            warmup=_pick(args.warmup, preset.warmup), lr_decay_steps=_pick(args.lr_decay_steps, steps),
            eval_interval=_pick(args.eval_interval, preset.eval_interval),
            eval_iters=_pick(args.eval_iters, preset.eval_iters), seed=_pick(args.seed, 0),
            device=_pick(args.device, "cpu"), dtype=_pick(args.dtype, "bf16"), data=args.data,
            checkpoint_interval=args.checkpoint_interval)
    for key in ("steps", "batch_size", "seq_len", "eval_interval", "eval_iters", "lr_decay_steps"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1; got {getattr(cfg, key)}.")
    if cfg.lr <= 0 or cfg.warmup < 0:
        raise ValueError(f"--lr must be positive and --warmup non-negative; got {cfg.lr}, {cfg.warmup}.")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device}: CUDA is not available in this torch build "
                         f"({torch.__version__}); use --device cpu.")
    return cfg


def run_train(args: argparse.Namespace) -> int:
    """Run ``hybridfp train`` with parsed arguments; returns the exit status."""
    if args.list_recipes:
        print("\n".join(known_names()))
        print("per_gemm:fprop=F,dgrad=D,wgrad=W   package.module:function")
        return 0
    out = Path(args.out or f"runs/{args.preset}")
    saved_run = None
    if args.resume:
        run_json = out / "run.json"
        if not run_json.is_file():
            raise FileNotFoundError(f"--resume: {run_json} not found; nothing to resume in {out} "
                                    "(pass the --out of the run to continue).")
        saved_run = json.loads(run_json.read_text())
    cfg = config_from_args(args, saved_run["config"] if saved_run else None)
    if args.recipe:
        recipes = [parse_recipe(args.recipe)]
    elif args.compare:
        recipes = parse_recipe_list(args.compare)
    else:
        recipes = parse_recipe_list(",".join(saved_run["recipes"]) if saved_run else DEFAULT_COMPARE)
    data = load_data(cfg.data, args.cache_dir)
    for split, toks in (("train", data.train), ("validation", data.val)):
        if len(toks) < cfg.seq_len + 1:
            raise DataError(f"the {split} split of {data.source} has {len(toks)} tokens; --seq-len "
                            f"{cfg.seq_len} needs at least {cfg.seq_len + 1}.")
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(
        {"config": cfg.to_dict(), "recipes": [r.label for r in recipes]}, indent=1))
    if not args.resume:  # a new run: start a new metrics file (old checkpoints get overwritten)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    params = count_params(cfg, data.vocab_size)
    device_name = (torch.cuda.get_device_name() if cfg.device.startswith("cuda")
                   else f"cpu ({torch.get_num_threads()} threads)")
    print(f"data: {data.describe()}")
    print(f"model: preset {cfg.preset}, {params:,} parameters; {cfg.steps} steps x {cfg.tokens_per_step:,} "
          f"tokens on {device_name}")
    print(f"recipes: {', '.join(r.label for r in recipes)}  ->  {out}/")
    info = {"params": params, "device": device_name, "data": data.source,
            "metrics": str(out / "metrics.jsonl"), "plot": str(out / "loss.png"),
            "resume_command": f"hybridfp train --resume --out {out} --steps {2 * cfg.steps}"
                              + (f" --jobs {args.jobs}" if args.jobs > 1 else "")}
    results: list[RunResult] = []
    t0 = time.perf_counter()
    title = f"hybridfp train, preset {cfg.preset}"
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1; got {args.jobs}.")
    failed: list[str] = []
    parallel = args.jobs > 1 and len(recipes) > 1
    if parallel:
        results, failed = run_parallel(cfg, recipes, out, args.jobs, args.resume, args.cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedGemmWarning)  # listed in summary.md instead
        for named in [] if parallel else recipes:
            resume = args.resume and (out / "checkpoints" / f"{named.slug}.pt").is_file()
            results.append(train_recipe(cfg, named, data, out, resume=resume, progress=not args.no_progress))
            results[-1].model = None  # free memory before the next recipe
            plot_losses(results, out / "loss.png", title=title)
            write_summary(out / "summary.md", results, cfg, info)
            write_results(out / RESULTS_FILE, results)
    plot_losses(results, out / "loss.png", title=title)
    write_summary(out / "summary.md", results, cfg, info)
    print()
    print(summary_markdown(results, cfg, info).split("## GEMMs")[0].rstrip())
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    print(f"plot:    {out / 'loss.png'}")
    print(f"summary: {out / 'summary.md'}")
    print(f"metrics: {out / 'metrics.jsonl'}")
    if failed:
        print("\nthese runs FAILED (the summary has the others):\n" + "\n".join(failed), file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hybridfp`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return run_train(args)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"hybridfp {args.command}: error: {e}", file=sys.stderr)
        return 2


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hybridfp.train``: the same as ``hybridfp train``."""
    return main(["train", *(sys.argv[1:] if argv is None else argv)])
