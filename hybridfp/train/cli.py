"""``hybridfp train``: train a small GPT under one or several recipes and compare them.

    hybridfp train                                   # tiny preset: bf16 vs fp8 vs NVFP4/MXFP8
    hybridfp train --compare bf16,fp8,mxfp8-fwd-nvfp4-bwd --steps 300
    hybridfp train --recipe per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8 --preset small --device cuda
    hybridfp train --resume --steps 400              # continue runs/tiny to step 400
    hybridfp train --hf-config qwen3-moe-tiny        # a transformers architecture (hf extra)
    torchrun --nproc-per-node 2 -m hybridfp.train --fsdp --recipe mxfp8   # sharded over 2 ranks

Outputs under ``--out`` (default ``runs/<preset>``; with --hf-config ``runs/<config name>``):
metrics.jsonl, loss.png, summary.md,
run.json (the settings, used by --resume) and checkpoints/<recipe>.pt.

Needs the ``train`` extra (matplotlib, tqdm): ``pip install 'hybridfp[train]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TypeVar

import torch

from ..gemm import EmulatedGemmWarning
from .corpus import CorpusSpecError, parse_corpus_options
from .data import DataError, load_data
from .distributed import Parallel, barrier, check_batch, check_parallel_args, finish, init_parallel
from .files import atomic_write_text
from .hf_model import build_hf_model, check_hf_config, quantized_share, read_hf_config, shipped_configs
from .loop import (DTYPES, FIXED_ON_RESUME, MetricsLog, RunResult, TrainConfig, count_params, plan_resume,
                   train_recipe)
from .model import PRESETS, GPTConfig, saved_model_settings
from .parallel import RESULTS_FILE, run_parallel, write_results
from .plot import plot_losses
from .recipes_by_name import SEED_RANGE, NamedRecipe, known_names, parse_recipe, parse_recipe_list
from .report import summary_markdown, write_summary

T = TypeVar("T")
logger = logging.getLogger(__name__)
#: Modules of the ``train`` extra (pyproject.toml) that ``hybridfp train`` needs.
TRAIN_EXTRA = ("matplotlib", "tqdm")
DEFAULT_COMPARE = "bf16,fp8,per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"
DEFAULT_PRESET = "tiny"
#: Device types a run may use (``torch.device`` accepts more, e.g. ``meta``, that cannot train).
DEVICE_TYPES = ("cpu", "cuda")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The options of ``hybridfp train`` (None = the preset's value)."""
    # default None, resolved to DEFAULT_PRESET: --resume tells an explicit --preset it ignores
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"model size and training defaults (default: {DEFAULT_PRESET}, a CPU demo)")
    p.add_argument("--hf-config", dest="hf_config_path", metavar="PATH",
                   help="train a transformers architecture instead of the GPT: a config.json, or "
                        f"a shipped one ({', '.join(shipped_configs())}); the preset gives the "
                        "training defaults (needs the hf extra: pip install 'hybridfp[hf]')")
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
                   help="also checkpoint every N steps (default 0: only at the end)")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="write no checkpoint, not even the final one (the run cannot be resumed); "
                        "for runs whose metrics are all that is read")
    p.add_argument("--quantized-weights", action="store_true",
                   help="hold the hybridfp layers' weights quantized in the recipe's weight format "
                        "(hybridfp.quantized_model_init) and train FP32 master weights "
                        "(hybridfp.MasterWeightOptimizer); same results as without it")
    p.add_argument("--recompute", action="store_true",
                   help="recompute each transformer block in backward (torch.utils.checkpoint): "
                        "less activation memory, same results")
    p.add_argument("--eager-swiglu", action="store_true",
                   help="run the SwiGLU as eager F.silu(gate) * up instead of hybridfp.swiglu's fused "
                        "kernels (on CUDA they differ in the last bits; the same ops on the CPU)")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model over the ranks with FSDP2 (quantized "
                        "all-gather); --batch-size stays the global batch, split over the ranks")
    p.add_argument("--ep", type=int, default=1,
                   help="under torchrun: spread each MoE layer's experts over groups of EP contiguous "
                        "ranks (hybridfp.ExpertParallel); default 1: every rank holds every expert")
    p.add_argument("--tp", type=int, default=1,
                   help="under torchrun: split each block's linears over groups of TP contiguous ranks "
                        "(tensor parallelism; the heads must divide by TP); the batch is split over "
                        "the world / TP data-parallel ranks")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="activation dtype (default bf16)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--data", help="DIR with train.bin/val.bin, DIR of text files, a text/.bin FILE, or "
                                  "'packages[:SIZE]': the installed packages' and stdlib's sources and "
                                  "text, deduplicated (cap e.g. packages:50M) (default: the Python "
                                  "standard library's source)")
    p.add_argument("--cache-dir", help="where the built-in corpora are cached (default ~/.cache/hybridfp)")
    p.add_argument("--out", help="output directory (default runs/<preset>, or runs/<config name> with --hf-config)")
    p.add_argument("--resume", action="store_true",
                   help="continue the runs in --out from their checkpoints, bit for bit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--jobs", type=int, default=1,
                   help="train the compared recipes in N concurrent worker processes (spread over "
                        "the visible GPUs with --device cuda); default 1: one after the other")
    p.add_argument("--list-recipes", action="store_true", help="print the recipe names and exit")


def _analyze_doc() -> str:
    from ..analyze import cli
    return cli.__doc__ or ""


def build_parser() -> argparse.ArgumentParser:
    """``hybridfp`` with its subcommands."""
    parser = argparse.ArgumentParser(prog="hybridfp", description="hybridfp command line")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a small GPT under one or more recipes and compare them",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(train)
    from ..analyze.cli import add_analyze_args  # here: analyze imports train's model and data
    analyze = sub.add_parser("analyze", help="measure each GEMM's error per format and recommend a recipe",
                             description=_analyze_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_analyze_args(analyze)
    return parser


def _pick(value: Optional[T], default: T) -> T:
    """An explicit flag's value (zero included), else the default."""
    return default if value is None else value


def _steps(args: argparse.Namespace, tokens_per_step: int) -> Optional[int]:
    if args.steps is not None:
        return args.steps
    return math.ceil(args.tokens / tokens_per_step) if args.tokens is not None else None


#: Types a run.json value may have, by the annotation of its TrainConfig / GPTConfig field.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "Optional[str]": (str, type(None)),
    "GPTConfig": (dict,), "Optional[dict]": (dict, type(None)),
}


def _check_fields(cls: type, data: Any, where: str, path: Path) -> None:
    """``data`` (from run.json) has only ``cls``'s fields, each of its type, and every field
    without a default (a field added since the run was started takes its default)."""
    if not isinstance(data, dict):
        raise _damaged(path, f"{where} is a {type(data).__name__}, not an object")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise _damaged(path, f"{where} has unknown setting(s) {', '.join(unknown)}")
    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise _damaged(path, f"{where} lacks {f.name!r}")
            continue
        value, types = data[f.name], _JSON_TYPES.get(str(f.type), (object,))
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise _damaged(path, f"{where}.{f.name} is {value!r}, not of type {f.type}")


def _damaged(path: Path, why: str) -> ValueError:
    return ValueError(f"--resume: {path} is damaged ({why}); hybridfp train writes it when a run starts: "
                      "restore it, or start the run again without --resume.")


def read_run_json(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The settings and recipe labels of the run to resume, checked.

    Parameters
    ----------
    path:
        The run's ``run.json``.

    Returns
    -------
    tuple
        (settings as stored, for :func:`config_from_args`; the recipes' labels).

    Raises
    ------
    FileNotFoundError
        No run.json: nothing to resume there.
    ValueError
        run.json is not JSON, or lacks or mistypes a setting or the recipe list.
    """
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {path} not found; nothing to resume in {path.parent} "
                                "(pass the --out of the run to continue).")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _damaged(path, f"not valid JSON: {' '.join(str(e).split())}") from None
    if not isinstance(saved, dict):
        raise _damaged(path, f"it holds a {type(saved).__name__}, not an object with config and recipes")
    recipes = saved.get("recipes")
    if not (isinstance(recipes, list) and recipes and all(isinstance(r, str) and r.strip() for r in recipes)):
        raise _damaged(path, "'recipes' is not a non-empty list of recipe names")
    config = saved.get("config")
    _check_fields(TrainConfig, config, "config", path)
    _check_fields(GPTConfig, config.get("model"), "config.model", path)
    try:  # the dataclasses' own checks (head sizes...)
        TrainConfig(**{**config, "model": GPTConfig(**config["model"])})
    except (TypeError, ValueError) as e:
        raise _damaged(path, " ".join(str(e).split())) from None
    return config, recipes


def config_from_args(args: argparse.Namespace, saved: Optional[dict] = None) -> TrainConfig:
    """The run's settings: the preset's, overridden by explicit flags.

    When resuming (``saved``: the run's stored settings), the stored settings win except the
    target ``--steps``/``--tokens``, ``--eval-interval``, ``--device`` and ``--checkpoint-interval``.
    """
    if saved:
        # a run started before a model setting existed continues as it trained (the eager SwiGLU)
        cfg = TrainConfig(**{**saved, "model": GPTConfig(**saved_model_settings(saved["model"]))})
        if getattr(args, "eager_swiglu", False) and cfg.model.fused_swiglu:
            logger.warning("note: --resume keeps the fused SwiGLU of the run in progress (ignoring --eager-swiglu)")
        for key in FIXED_ON_RESUME:
            given = getattr(args, key, None)
            if key == "data" and given is not None:
                given = absolute_data(given)  # run.json holds it absolute
            if given is not None and given != getattr(cfg, key):
                logger.warning("note: --resume keeps %s=%r from the run in progress (ignoring %r)",
                               key, getattr(cfg, key), given)
        cfg.steps = _pick(_steps(args, cfg.tokens_per_step), cfg.steps)
        cfg.eval_interval = _pick(args.eval_interval, cfg.eval_interval)
        cfg.device = _pick(args.device, cfg.device)
        cfg.checkpoint_interval = args.checkpoint_interval
        cfg.save_checkpoints = not getattr(args, "no_checkpoint", False)
        cfg.recompute = bool(getattr(args, "recompute", False))
        cfg.fsdp, cfg.ep = bool(getattr(args, "fsdp", False)), getattr(args, "ep", 1)
        cfg.tp = getattr(args, "tp", 1)
        if getattr(args, "quantized_weights", False) and not cfg.quantized_weights:
            logger.warning("note: --resume keeps quantized_weights=False from the run in progress "
                           "(ignoring --quantized-weights)")
    else:
        hf_name, hf_config = (read_hf_config(args.hf_config_path) if getattr(args, "hf_config_path", None)
                              else (None, None))
        preset_name = args.preset or DEFAULT_PRESET
        preset = PRESETS[preset_name]
        batch_size, seq_len = _pick(args.batch_size, preset.batch_size), _pick(args.seq_len, preset.seq_len)
        steps = _pick(_steps(args, max(1, batch_size * seq_len)), preset.steps)
        cfg = TrainConfig(
            preset=preset_name, steps=steps,
            model=GPTConfig(**{**preset.model.to_dict(), "fused_swiglu": not getattr(args, "eager_swiglu", False)}),
            batch_size=batch_size, seq_len=seq_len, lr=_pick(args.lr, preset.lr),
            warmup=_pick(args.warmup, preset.warmup), lr_decay_steps=_pick(args.lr_decay_steps, steps),
            eval_interval=_pick(args.eval_interval, preset.eval_interval),
            eval_iters=_pick(args.eval_iters, preset.eval_iters), seed=_pick(args.seed, 0),
            device=_pick(args.device, "cpu"), dtype=_pick(args.dtype, "bf16"),
            data=None if args.data is None else absolute_data(args.data),
            checkpoint_interval=args.checkpoint_interval, save_checkpoints=not getattr(args, "no_checkpoint", False),
            quantized_weights=bool(getattr(args, "quantized_weights", False)),
            recompute=bool(getattr(args, "recompute", False)),
            fsdp=bool(getattr(args, "fsdp", False)), ep=getattr(args, "ep", 1), tp=getattr(args, "tp", 1),
            hf_config=hf_config, hf_name=hf_name)
    for key in ("steps", "batch_size", "seq_len", "eval_interval", "eval_iters", "lr_decay_steps"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1; got {getattr(cfg, key)}.")
    if cfg.checkpoint_interval < 0:
        raise ValueError(f"--checkpoint-interval must be 0 (checkpoint only at the end) or a positive "
                         f"number of steps; got {cfg.checkpoint_interval}.")
    if cfg.checkpoint_interval and not cfg.save_checkpoints:
        raise ValueError(f"--no-checkpoint and --checkpoint-interval {cfg.checkpoint_interval} contradict each "
                         "other; drop one.")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0) or cfg.warmup < 0:  # NaN compares False either way
        raise ValueError(f"--lr must be a finite positive number and --warmup non-negative; got "
                         f"{cfg.lr}, {cfg.warmup}.")
    check_device(cfg.device)
    check_seed(cfg.seed, "--seed")
    return cfg


def check_seed(seed: int, what: str) -> None:
    """Raise ValueError unless ``seed`` is in :data:`SEED_RANGE` (``what`` names the option),
    before anything is written: torch.manual_seed overflows on larger ones."""
    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise ValueError(f"{what} {seed} is out of range; pass a seed from {low} to {high} "
                         "(a 64-bit integer), e.g. --seed 1.")


def check_device(device: str) -> None:
    """Raise ValueError unless ``device`` is a device a run can train on: ``cpu``, or ``cuda`` /
    ``cuda:N`` with CUDA available (and GPU N present). Called before run.json is written, so a
    mistyped ``--resume --device`` leaves the run as it was."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise ValueError(f"--device {device!r} is not a device hybridfp train can use; pass cpu, cuda "
                         "or cuda:N.")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available in this torch build "
                             f"({torch.__version__}); use --device cpu.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} visible "
                             f"GPU(s); pass cuda:0 to cuda:{torch.cuda.device_count() - 1}, or cuda.")


def absolute_data(data: str) -> str:
    """``--data`` as stored in run.json: a path made absolute (a resume from another directory
    reads the same files); a ``packages[:SIZE]`` corpus spec as given."""
    try:
        if parse_corpus_options(data) is not None:
            return data
    except CorpusSpecError:
        return data  # load_data reports it
    return str(Path(data).expanduser().absolute())


def check_layout(out: Path, parallel: bool, jobs: int) -> None:
    """A resume keeps the layout the run began with: with ``--jobs`` each recipe's checkpoint
    and metrics live under ``<out>/parts/<slug>/``, without it under ``<out>`` (run.json's
    ``jobs``; a run.json from before it was recorded: whether ``parts/`` exists).

    Raises
    ------
    ValueError
        The run was started with ``--jobs`` and is resumed without, or the other way round.
    """
    saved = json.loads((out / "run.json").read_text()).get("jobs")  # read_run_json checked it is JSON
    began_parallel = saved if isinstance(saved, bool) else (out / "parts").is_dir()
    if began_parallel and not parallel:
        raise ValueError(f"--resume: the run in {out} was started with --jobs (its recipes' checkpoints are "
                         f"under {out / 'parts'}); resume it with --jobs 2 or more and at least two recipes.")
    if parallel and not began_parallel:
        raise ValueError(f"--resume --jobs {jobs}: the run in {out} was started without --jobs (its "
                         f"checkpoints are in {out / 'checkpoints'}); resume it without --jobs.")


def parse_recipes(args: argparse.Namespace, saved: Optional[list[str]]) -> list[NamedRecipe]:
    """The recipes to train: ``--recipe``, else ``--compare``, else the resumed run's, else
    :data:`DEFAULT_COMPARE`. An empty ``--recipe`` / ``--compare`` is an error, not the default.

    Raises
    ------
    ValueError
        An empty or unknown recipe.
    """
    if args.recipe is not None:
        if not args.recipe.strip():
            raise ValueError("--recipe is empty; give a recipe name (hybridfp train --list-recipes), "
                             "or leave --recipe out for the default comparison.")
        return [parse_recipe(args.recipe)]
    if args.compare is not None:
        if not args.compare.strip():
            raise ValueError("--compare is empty; give comma-separated recipe names, or leave --compare "
                             "out for the default comparison.")
        return parse_recipe_list(args.compare)
    return parse_recipe_list(",".join(saved) if saved else DEFAULT_COMPARE)


def prepare_out(out: Path) -> None:
    """Create the output folder and check that files can be written there.

    Raises
    ------
    ValueError
        ``out`` is a file, or cannot be created or written to (the message says which).
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory for the run's outputs.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror or e}); pass a writable "
                         "directory.") from None


class MissingExtraError(ImportError):
    """A module of the ``train`` extra is not installed; the message says how to install it."""


def check_train_extra() -> None:
    """Raise :class:`MissingExtraError` unless every module of :data:`TRAIN_EXTRA` imports."""
    missing = []
    for name in TRAIN_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtraError(f"{' and '.join(missing)} {verb} not installed; hybridfp train needs the "
                                "train extra: pip install 'hybridfp[train]'")


def check_hf_args(cfg: TrainConfig, jobs: int, eager_swiglu: bool = False) -> None:
    """Refuse the options an ``--hf-config`` run does not support (each named, with what to do).

    Parameters
    ----------
    cfg:
        The run's settings.
    jobs:
        ``--jobs``.
    eager_swiglu:
        ``--eager-swiglu`` was given.

    Raises
    ------
    ValueError
        ``--fsdp`` / ``--ep`` / ``--tp`` (the sharding plans are the built-in GPT's),
        ``--quantized-weights`` (transformers builds ``nn.Linear`` weights, converted after),
        ``--eager-swiglu`` (the activation is the transformers model's own) or ``--jobs`` above 1.
    MissingExtraError
        transformers is not installed.
    """
    try:
        importlib.import_module("transformers")
    except ImportError:
        raise MissingExtraError("transformers is not installed; --hf-config needs the hf extra: "
                                "pip install 'hybridfp[hf]'") from None
    refused = ["--fsdp"] * cfg.fsdp + [f"--ep {cfg.ep}"] * (cfg.ep > 1) + [f"--tp {cfg.tp}"] * (cfg.tp > 1)
    if refused:
        raise ValueError(f"{' '.join(refused)} with --hf-config: hybridfp train shards only the built-in GPT "
                         "(its own FSDP2 / expert / tensor-parallel plans); train the transformers model in "
                         "one process, or see docs/integrations.md for sharding it yourself.")
    if cfg.quantized_weights:
        raise ValueError("--quantized-weights with --hf-config: transformers builds plain nn.Linear weights, "
                         "converted afterwards, so they are not created quantized; drop --quantized-weights.")
    if eager_swiglu:
        raise ValueError("--eager-swiglu with --hf-config: the transformers model runs its own activation; "
                         "drop --eager-swiglu.")
    if jobs > 1:
        raise ValueError("--jobs with --hf-config: worker processes rebuild only the built-in GPT; "
                         "drop --jobs (the recipes train one after the other).")


def run_train(args: argparse.Namespace, joined: Optional[list[Parallel]] = None) -> int:
    """Run ``hybridfp train`` with parsed arguments; returns the exit status. With ``--fsdp`` /
    ``--ep`` / ``--tp`` every rank of a ``torchrun`` launch runs it; rank 0 writes and logs.
    ``joined`` (if given) receives the process group the run joined, left when it ends."""
    joined = [] if joined is None else joined
    try:
        return _run_train(args, joined)
    finally:
        finish(joined[0] if joined else None)


def _run_train(args: argparse.Namespace, joined: list[Parallel]) -> int:
    if args.list_recipes:  # the command's output, for scripts: stdout, not the log
        print("\n".join(known_names()))
        print("per_gemm:fprop=F,dgrad=D,wgrad=W   package.module:function")
        return 0
    check_train_extra()
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1; got {args.jobs}.")
    hf_path = getattr(args, "hf_config_path", None)
    out = Path(args.out or f"runs/{Path(hf_path).stem if hf_path else (args.preset or DEFAULT_PRESET)}")
    saved_config, saved_recipes = read_run_json(out / "run.json") if args.resume else (None, None)
    cfg = config_from_args(args, saved_config)
    recipes = parse_recipes(args, saved_recipes)
    parallel = args.jobs > 1 and len(recipes) > 1
    if args.resume:
        check_layout(out, parallel, args.jobs)
    if args.resume and hf_path and read_hf_config(hf_path)[1] != cfg.hf_config:
        raise ValueError(f"--resume --hf-config {hf_path}: the run in {out} trains another architecture "
                         "(its run.json holds the config it started with); drop --hf-config or pass that one.")
    if cfg.hf_config is not None:
        check_hf_args(cfg, args.jobs, getattr(args, "eager_swiglu", False))
    check_parallel_args(cfg.fsdp, cfg.ep, cfg.quantized_weights, args.jobs, cfg.tp)
    par: Optional[Parallel] = None
    if cfg.fsdp or cfg.ep > 1 or cfg.tp > 1:
        par = init_parallel(cfg.device, cfg.fsdp, cfg.ep, cfg.model.n_experts, cfg.tp, cfg.model.n_head)
        joined.append(par)
        check_batch(cfg.batch_size, par)
        cfg.device = par.device
        if not par.is_main:  # rank 0 logs; the others say only what goes wrong
            logging.getLogger("hybridfp.train").setLevel(logging.WARNING)
    main = par is None or par.is_main
    if main:
        prepare_out(out)
        (out / "checkpoints").mkdir(exist_ok=True)
    barrier(par)
    data = load_data(cfg.data, args.cache_dir)
    for split, toks in (("train", data.train), ("validation", data.val)):
        if len(toks) < cfg.seq_len + 1:
            raise DataError(f"the {split} split of {data.source} has {len(toks)} tokens; --seq-len "
                            f"{cfg.seq_len} needs at least {cfg.seq_len + 1}.")
    if cfg.hf_config is not None:
        check_hf_config(cfg.hf_config, data.vocab_size, cfg.seq_len)
    # Every checkpoint is checked before any recipe trains: a bad one stops the run with the
    # others' files untouched. (Worker processes check their own.)
    resumes: dict[str, bool] = {}
    if args.resume:
        MetricsLog(out / "metrics.jsonl").read()  # a damaged line stops the run here
    if args.resume and not parallel:
        resumes = {r.label: plan_resume(cfg, r, out) for r in recipes}
    barrier(par)  # every rank has read run.json and the checkpoints before rank 0 rewrites them
    if main:
        atomic_write_text(out / "run.json", json.dumps(
            {"config": cfg.to_dict(), "recipes": [r.label for r in recipes], "jobs": parallel}, indent=1))
    if not args.resume and main:  # a new run: start a new metrics file (old checkpoints get overwritten)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    params = count_params(cfg, data.vocab_size)
    device_name = (torch.cuda.get_device_name() if cfg.device.startswith("cuda")
                   else f"cpu ({torch.get_num_threads()} threads)")
    resume_command = f"hybridfp train --resume --out {out} --steps {2 * cfg.steps}"
    if par is not None:
        how = ["FSDP2"] * par.fsdp + [f"experts over {par.ep} ranks"] * (par.ep > 1) + \
            [f"tensor parallel over {par.tp} ranks"] * (par.tp > 1)
        device_name = f"{par.world} x {device_name} ({', '.join(how)})"
        resume_command = (f"torchrun --nproc-per-node {par.world} -m hybridfp.train --resume --out {out} "
                          f"--steps {2 * cfg.steps}" + " --fsdp" * par.fsdp + f" --ep {par.ep}" * (par.ep > 1))
    logger.info("data: %s", data.describe())
    logger.info("model: %s, %s parameters; %d steps x %s tokens on %s",
                f"--hf-config {cfg.hf_name}" if cfg.hf_name else f"preset {cfg.preset}", f"{params:,}",
                cfg.steps, f"{cfg.tokens_per_step:,}", device_name)
    logger.info("recipes: %s  ->  %s/", ", ".join(r.label for r in recipes), out)
    info = {"params": params, "device": device_name, "data": data.source,
            "metrics": str(out / "metrics.jsonl"), "plot": str(out / "loss.png"),
            "resume_command": resume_command + (f" --jobs {args.jobs}" if args.jobs > 1 else "")}
    title = f"hybridfp train, preset {cfg.preset}"
    if cfg.hf_config is not None:
        arch = (cfg.hf_config.get("architectures") or [cfg.hf_config["model_type"]])[0]
        inside, matrices = quantized_share(build_hf_model(cfg.hf_config, cfg.seed, device="meta"))
        info["model"] = (f"{arch} `{cfg.hf_name}` ({params:,} parameters; {inside:,} of its {matrices:,} "
                         f"weight-matrix elements read by hybridfp modules), preset `{cfg.preset}`'s settings")
        title = f"hybridfp train, {cfg.hf_name} ({arch})"
    results: list[RunResult] = []
    t0 = time.perf_counter()
    failed: list[str] = []
    if parallel:
        results, failed = run_parallel(cfg, recipes, out, args.jobs, args.resume, args.cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedGemmWarning)  # listed in summary.md instead
        for named in [] if parallel else recipes:
            results.append(train_recipe(cfg, named, data, out, resume=resumes.get(named.label, False),
                                        progress=not args.no_progress, par=par))
            results[-1].model = None  # free memory before the next recipe
            if main:
                plot_losses(results, out / "loss.png", title=title, default_seed=cfg.seed)
                write_summary(out / "summary.md", results, cfg, info)
                write_results(out / RESULTS_FILE, results)
    if not main:
        return 0
    plot_losses(results, out / "loss.png", title=title, default_seed=cfg.seed)
    write_summary(out / "summary.md", results, cfg, info)
    logger.info("")
    logger.info("%s", summary_markdown(results, cfg, info).split("## GEMMs")[0].rstrip())
    logger.info("\ndone in %.0f s", time.perf_counter() - t0)
    logger.info("plot:    %s", out / "loss.png")
    logger.info("summary: %s", out / "summary.md")
    logger.info("metrics: %s", out / "metrics.jsonl")
    if failed:
        logger.error("\nthese runs FAILED (the summary has the others):\n%s", "\n".join(failed))
        return 1
    return 0


class _BelowWarning(logging.Filter):
    """Passes INFO and DEBUG records only (WARNING and above go to stderr)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


@contextlib.contextmanager
def console_logging() -> Iterator[None]:
    """For the duration of a command: the ``hybridfp.train`` loggers print their messages as
    they are, INFO to stdout and WARNING and above to stderr, and do not propagate further.

    The streams are those of the moment it is entered (a caller that redirects ``sys.stdout``
    or ``sys.stderr`` before running the command captures them); the logger's handlers, level
    and propagation are restored afterwards.
    """
    root = logging.getLogger("hybridfp.train")
    out, err = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    out.addFilter(_BelowWarning())
    err.setLevel(logging.WARNING)
    saved = root.level, root.propagate
    for h in (out, err):
        h.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        for h in (out, err):
            root.removeHandler(h)
        root.setLevel(saved[0])
        root.propagate = saved[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hybridfp`` console script."""
    args = build_parser().parse_args(argv)
    joined: list[Parallel] = []
    with console_logging():
        try:
            if args.command == "analyze":
                from ..analyze.cli import run_analyze
                code = run_analyze(args)
            else:
                code = run_train(args, joined)
        except (ValueError, OSError, FloatingPointError, MissingExtraError) as e:
            # one line, argparse's form and exit status: the messages say what to do
            logger.error("hybridfp %s: error: %s", args.command, " ".join(str(e).split()))
            code = 2
    if joined and joined[0].world > 1:
        # a rank of a torchrun launch, its group left and its output written: leave now. In the
        # interpreter's teardown a process-group thread still joinable can abort the process
        # ("terminate called without an active exception"), failing a finished run.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hybridfp.train``: the same as ``hybridfp train``."""
    return main(["train", *(sys.argv[1:] if argv is None else argv)])
