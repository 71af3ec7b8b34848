"""The training loop for one recipe: nanoGPT's loop with a ``hybridfp.autocast`` around the
forward pass.

    for step in range(start, steps):
        x, y = batch(seed, step)                       # same data for every recipe
        with hybridfp.autocast(recipe=recipe):         # quantized GEMMs in hybridfp modules
            loss = model(x, y)
        loss.backward()                                # backward GEMMs use the same quantizers
        clip, AdamW step, LR scheduler step (warmup + cosine)
        every eval_interval steps and at the end: val loss (same recipe, no grad)

Every recipe starts from the same initial weights (``torch.manual_seed(seed)`` before the
model is built) and sees the same batches, so loss differences come from the recipe alone.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..recipes import autocast
from ..integration.fsdp_amax import precompute_weight_amax
from ..integration.master_weights import MasterWeightOptimizer
from ..nn import QuantizedModule
from ..nn.quantized_init import quantized_model_init
from ..tensors import QuantizedTensor
from ..recipes import AutocastState, Recipe
from .checkpoint import (CheckpointError, check_belongs, load_checkpoint, rng_state, save_checkpoint,
                         set_rng_state)
from .data import TokenData, get_batch, val_batches
from .dist_checkpoint import load_sharded, read_state, save_sharded, sharded_path
from .distributed import (Parallel, all_true, clip_grad_norm, mean_over_ranks, shard_model, sync_gradients,
                          weight_amax_precompute)
from .emulated import emulated_pairs
from .files import atomic_write_text
from .hf_model import HFCausalLM, build_hf_model
from .model import GPT, GPTConfig
from .recipes_by_name import NamedRecipe

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: Seed of the fixed validation batches (every run, whatever its own seed).
VAL_SEED = 0
#: Settings a resumed run takes from its checkpoint (changing them would change the run).
FIXED_ON_RESUME = ("preset", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup", "lr_decay_steps",
                   "weight_decay", "grad_clip", "seed", "dtype", "data", "eval_iters", "quantized_weights",
                   "hf_config")


@dataclass
class TrainConfig:
    """One run's settings (shared by every compared recipe)."""

    preset: str
    model: GPTConfig
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    lr_decay_steps: int
    eval_interval: int
    eval_iters: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "bf16"
    data: Optional[str] = None
    checkpoint_interval: int = 0   # 0: only at the end of the run
    save_checkpoints: bool = True  # False (--no-checkpoint): none at all, e.g. a study reading metrics only
    quantized_weights: bool = False  # weights held quantized (quantized_model_init), FP32 masters
    recompute: bool = False        # torch.utils.checkpoint per block
    fsdp: bool = False             # sharded by FSDP2 over the ranks of a torchrun launch
    ep: int = 1                    # expert-parallel group size (torchrun)
    tp: int = 1                    # tensor-parallel group size (torchrun)
    hf_config: Optional[dict] = None  # --hf-config: a transformers config (then ``model`` is unused)
    hf_name: Optional[str] = None  # its name (the file's stem)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (checkpoints, summary)."""
        d = asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @property
    def tokens_per_step(self) -> int:
        """Training tokens in one step."""
        return self.batch_size * self.seq_len


@dataclass
class RunResult:
    """What the report needs from one recipe's run."""

    label: str
    description: str
    records: list[dict[str, Any]] = field(default_factory=list)
    emulated: list[str] = field(default_factory=list)
    tokens: int = 0
    train_seconds: float = 0.0
    checkpoint: Optional[str] = None
    model: Optional[torch.nn.Module] = field(default=None, repr=False)  # the trained model

    @property
    def final_val_loss(self) -> Optional[float]:
        """Validation loss at the last evaluation."""
        vals = [r["val_loss"] for r in self.records if "val_loss" in r]
        return vals[-1] if vals else None

    @property
    def final_train_loss(self) -> Optional[float]:
        """Training loss of the last step."""
        vals = [r["train_loss"] for r in self.records if "train_loss" in r]
        return vals[-1] if vals else None

    @property
    def tokens_per_s(self) -> float:
        """Training throughput over the whole run (evaluation excluded)."""
        return self.tokens / self.train_seconds if self.train_seconds > 0 else 0.0


def warmup_cosine(step: int, peak: float, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """The learning rate of ``step``: linear warmup to ``peak`` over ``warmup`` steps, then cosine
    decay to ``min_ratio * peak`` at ``decay_steps``, constant after."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if step >= decay_steps:
        return peak * min_ratio
    t = (step - warmup) / max(1, decay_steps - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The run's learning rate at ``step``: :func:`warmup_cosine` with ``cfg.lr`` as the peak,
    ``cfg.warmup`` warmup steps, decay to ``min_lr_ratio * lr`` at ``lr_decay_steps``."""
    return warmup_cosine(step, cfg.lr, cfg.warmup, cfg.lr_decay_steps, cfg.min_lr_ratio)


class WarmupCosineLR(LRScheduler):
    """:func:`warmup_cosine` as a ``torch.optim`` learning-rate scheduler, each parameter
    group's initial learning rate as its peak.

    The rate is computed from the step (``last_epoch``) in closed form, in the same float
    operations as :func:`lr_at`, so it is bitwise the same. (``LambdaLR`` scales the initial
    rate by a factor, ``peak * ((step + 1) / warmup)``, which rounds differently from
    ``peak * (step + 1) / warmup`` at about a third of the warmup steps: 8 of the tiny
    preset's 20, e.g. step 2 gives 0.00045 instead of 0.00045000000000000004.)

    Parameters
    ----------
    optimizer:
        The optimizer whose groups' ``lr`` it sets.
    warmup, decay_steps, min_ratio:
        As in :func:`warmup_cosine`.
    last_epoch:
        The last step done; -1 (default) for a new run. A resumed run passes the step it
        resumes at minus one (its groups need ``initial_lr``, as ``torch.optim`` schedulers do).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, decay_steps: int, min_ratio: float,
                 last_epoch: int = -1) -> None:
        self.warmup, self.decay_steps, self.min_ratio = warmup, decay_steps, min_ratio
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The learning rate of step ``last_epoch`` for each parameter group."""
        return [warmup_cosine(self.last_epoch, base, self.warmup, self.decay_steps, self.min_ratio)
                for base in self.base_lrs]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | MasterWeightOptimizer:
    """AdamW, weight decay on matrices only (nanoGPT), biases excepted by name: a stacked expert
    bias [E, N] (``GroupedLinear(single_parameter=True)``, converted transformers experts) is 2-D
    but a bias. With ``cfg.quantized_weights``: AdamW on FP32 masters of the quantized weights
    (``MasterWeightOptimizer``, seeded from their kept initial values, which are then freed)."""
    named = {id(p): (name, p) for name, p in model.named_parameters() if p.requires_grad}
    params = [p for _, p in named.values()]
    # a parameter's own name (its last dotted part) says bias: bias, bias3, down_proj_bias
    decays = {i: p.dim() >= 2 and "bias" not in name.rsplit(".", 1)[-1].lower() for i, (name, p) in named.items()}
    decay = [p for p in params if decays[id(p)]]
    other = [p for p in params if not decays[id(p)]]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    kw: dict[str, Any] = {"lr": cfg.lr, "betas": (0.9, 0.95), "eps": 1e-8}
    if not cfg.quantized_weights:
        return torch.optim.AdamW(groups, **kw)
    opt = MasterWeightOptimizer(torch.optim.AdamW, groups, **kw)
    for p in params:
        if isinstance(p, QuantizedTensor):
            p.clear_high_precision_init_val()
    return opt


def make_scheduler(opt: torch.optim.Optimizer | MasterWeightOptimizer, cfg: TrainConfig,
                   step: int = 0) -> WarmupCosineLR:
    """The run's schedule (:func:`lr_at`) on ``opt``, its groups' learning rate set to that of
    ``step``: 0 for a new run, the step a resumed run continues at (the schedule is a function
    of the step and of settings a resumed run cannot change, so it is recomputed, not loaded)."""
    if isinstance(opt, MasterWeightOptimizer):
        opt = opt.optimizer  # the torch optimizer whose groups it steps
    if step > 0:
        for group in opt.param_groups:
            group["initial_lr"] = cfg.lr  # the peak; torch.optim's schedulers resume from it
    return WarmupCosineLR(opt, cfg.warmup, cfg.lr_decay_steps, cfg.min_lr_ratio, last_epoch=step - 1)


def build_model(cfg: TrainConfig, vocab_size: int, recipe: Optional[Recipe] = None) -> GPT | HFCausalLM:
    """The model with the run's initial weights (seeded: identical for every recipe); with
    ``cfg.quantized_weights`` its hybridfp modules hold their weights quantized by ``recipe``
    (the initial FP32 values kept to seed the masters); ``cfg.recompute`` recomputes blocks.
    With ``cfg.hf_config``: that transformers architecture, converted (``hf_model.py``)."""
    mcfg = GPTConfig(**{**cfg.model.to_dict(), "vocab_size": vocab_size,
                        "block_size": max(cfg.model.block_size, cfg.seq_len)})
    if cfg.quantized_weights and recipe is None:
        raise ValueError("build_model: quantized_weights needs the recipe whose weight format holds them.")
    if cfg.hf_config is not None:  # a transformers architecture (hf_model.py)
        hf = build_hf_model(cfg.hf_config, cfg.seed, DTYPES[cfg.dtype], cfg.device)
        hf.recompute = cfg.recompute
        return hf
    torch.manual_seed(cfg.seed)
    with quantized_model_init(enabled=cfg.quantized_weights, recipe=recipe, preserve_high_precision_init_val=True):
        model = GPT(mcfg, DTYPES[cfg.dtype]).to(cfg.device)
    model.recompute = cfg.recompute
    return model


def count_params(cfg: TrainConfig, vocab_size: int) -> int:
    """The model's parameter count, without allocating it (built on the meta device)."""
    mcfg = GPTConfig(**{**cfg.model.to_dict(), "vocab_size": vocab_size})
    if cfg.hf_config is not None:
        with torch.device("meta"):
            return build_hf_model(cfg.hf_config, cfg.seed, device="meta").num_params()
    with torch.device("meta"):
        return GPT(mcfg).num_params()


def _quantizer_states(model: torch.nn.Module, recipe: Recipe, group: Optional[Any] = None) -> list[dict[str, Any]]:
    """``Quantizer.get_state()`` of every quantizer of ``model``'s hybridfp modules for
    ``recipe`` under ``autocast(amax_reduction_group=group)``, in module order (copies: the live
    state may move on). ``group`` must be the training regions' (:func:`amax_group`): the
    modules key their quantizers on it, and another one rebuilds them fresh."""
    state = AutocastState(recipe, group)
    return [q.get_state() for m in model.modules() if isinstance(m, QuantizedModule)
            for qs in m.quantizers(state).values() for q in qs]


def _set_quantizer_states(model: torch.nn.Module, recipe: Recipe, saved: list[dict[str, Any]],
                          group: Optional[Any] = None) -> None:
    """Inverse of :func:`_quantizer_states` (same model, recipe and group)."""
    state = AutocastState(recipe, group)
    modules = [m for m in model.modules() if isinstance(m, QuantizedModule)]
    live = [q for m in modules for qs in m.quantizers(state).values() for q in qs]
    for q, s in zip(live, saved, strict=True):
        q.set_state(s)


def amax_group(model: torch.nn.Module, recipe: Recipe, par: Optional[Parallel]) -> Optional[Any]:
    """The ``autocast(amax_reduction_group=...)`` of a sharded run: every rank for a recipe
    with stateful (delayed-scaling) quantizers, whose amaxes are reduced at a region's end;
    None otherwise (current scaling keeps each rank's own amax, as TransformerEngine does)."""
    if par is None or par.world == 1:
        return None
    state = AutocastState(recipe)
    stateful = any(q.has_state() for m in model.modules() if isinstance(m, QuantizedModule)
                   for qs in m.quantizers(state).values() for q in qs)
    if par.tp > 1:  # the model reduces its amaxes over every rank (train/tensor_parallel.py)
        return None
    if stateful and par.ep > 1:
        raise ValueError(f"--ep with recipe {recipe!r}: its delayed-scaling amaxes are reduced over "
                         "the ranks, which hold different experts at the same places; use a "
                         "current-scaling or block-scaled recipe with --ep.")
    return par.group if stateful else None


@torch.no_grad()
def evaluate(model: GPT, named: NamedRecipe, data: TokenData, cfg: TrainConfig,
             par: Optional[Parallel] = None, amax_reduction_group: Optional[Any] = None) -> float:
    """Mean loss over the fixed validation batches, with the recipe's quantized forward.

    Evaluation leaves the quantizers' state (delayed scaling's amax history and scale) as it
    found it, so a run's training trajectory does not depend on how often it is evaluated.
    Sharded (``par``): each rank scores its rows of every batch, the losses are averaged over
    the ranks (a collective).

    Parameters
    ----------
    model, named, data, cfg:
        The model, its recipe, the data and the run's settings.
    par:
        The run's :class:`Parallel` (None: a single process).
    amax_reduction_group:
        The training regions' ``autocast(amax_reduction_group=...)`` (:func:`amax_group`,
        computed once per run): the modules key their quantizers on it, so evaluating under
        another one would rebuild them and drop the training state.

    Returns
    -------
    float
        The mean validation loss.

    Raises
    ------
    ValueError
        A sharded run (``par`` of several ranks, no tensor parallelism) whose modules hold
        delayed-scaling quantizers, evaluated without ``amax_reduction_group``.
    """
    group = amax_reduction_group
    if (group is None and par is not None and par.world > 1 and par.tp == 1
            and any(m.stateful_quantizers() for m in model.modules() if isinstance(m, QuantizedModule))):
        raise ValueError("evaluate: this sharded run's modules hold delayed-scaling quantizers, whose training "
                         "regions reduce amaxes over a group; pass amax_reduction_group=amax_group(model, "
                         "recipe, par) as computed once for the run (evaluating under another group would "
                         "rebuild the quantizers and drop their state).")
    saved = _quantizer_states(model, named.recipe, group)
    model.eval()
    losses = []
    # The validation batches do not depend on the run's seed: runs at several seeds (the noise
    # floor of a comparison) are then scored on the same text.
    for x, y in val_batches(data, cfg.batch_size, cfg.seq_len, VAL_SEED, cfg.eval_iters):
        if par is not None:
            x, y = x[par.rows(cfg.batch_size)], y[par.rows(cfg.batch_size)]
        with autocast(recipe=named.recipe, amax_reduction_group=group):
            _, loss = model(x.to(cfg.device), y.to(cfg.device))
        losses.append(mean_over_ranks(loss.float(), par))
    model.train()
    _set_quantizer_states(model, named.recipe, saved, group)
    return sum(losses) / len(losses)


class MetricsError(ValueError):
    """A line of metrics.jsonl that is not a metrics record; the message names the line."""


def _parse_record(line: str, where: str) -> dict[str, Any]:
    """One metrics.jsonl line -> its record (a JSON object with a str recipe and an int step)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise MetricsError(f"{where}: not valid JSON ({e.msg}); fix or delete that line, then run "
                           "again.") from None
    if not (isinstance(rec, dict) and isinstance(rec.get("recipe"), str)
            and isinstance(rec.get("step"), int) and not isinstance(rec.get("step"), bool)):
        raise MetricsError(f"{where}: not a metrics record (a JSON object with a string 'recipe' and "
                           "an integer 'step'); fix or delete that line, then run again.")
    return rec


class MetricsLog:
    """metrics.jsonl: one JSON object per line, every recipe of the run in one file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, label: Optional[str] = None) -> list[dict[str, Any]]:
        """All records (or one recipe's), in file order.

        Raises
        ------
        MetricsError
            A line is not a record (the message gives the file and line number).
        """
        if not self.path.is_file():
            return []
        recs = [_parse_record(line, f"{self.path}:{i}")
                for i, line in enumerate(self.path.read_text().splitlines(), 1) if line.strip()]
        return [r for r in recs if label is None or r["recipe"] == label]

    def last_step(self, label: str) -> Optional[int]:
        """The highest step recorded for ``label``, None when it has no record."""
        return max((r["step"] for r in self.read(label)), default=None)

    def truncate(self, label: str, after_step: int) -> None:
        """Drop ``label``'s records past ``after_step`` (all of them for after_step < 0).

        The file is replaced atomically: a run killed meanwhile leaves every recipe's history."""
        keep = [r for r in self.read() if r["recipe"] != label or r["step"] <= after_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def append(self, record: dict[str, Any]) -> None:
        """Add one record."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def checkpoint_path(out_dir: Path, named: NamedRecipe) -> Path:
    """Where ``named``'s checkpoint lives under the run's output folder."""
    return out_dir / "checkpoints" / f"{named.slug}.pt"


def run_config(cfg: TrainConfig, named: NamedRecipe) -> TrainConfig:
    """The run's settings for one recipe: ``NAME@seed=K`` replaces ``cfg.seed``."""
    return cfg if named.seed is None else replace(cfg, seed=named.seed)


def _check_resumable(ck: dict[str, Any], path: Path, named: NamedRecipe, cfg: TrainConfig) -> None:
    """The checkpoint is this recipe's, from this run, and not past the target step."""
    check_belongs(ck, path, named.label, cfg.to_dict(), FIXED_ON_RESUME)
    if ck["step"] > cfg.steps:
        raise CheckpointError(f"--resume: the checkpoint {path} is at step {ck['step']}, past --steps "
                              f"{cfg.steps}; pass --steps {ck['step']} or more.")


def plan_resume(cfg: TrainConfig, named: NamedRecipe, out_dir: Path) -> bool:
    """Whether ``named`` continues from its checkpoint in ``out_dir`` (True) or starts at step 0
    (False: no checkpoint and no step trained in metrics.jsonl, e.g. a recipe added to the run).

    Parameters
    ----------
    cfg:
        The run's settings.
    named:
        The recipe.
    out_dir:
        The run's output folder.

    Returns
    -------
    bool
        True when a checkpoint of this recipe and run is there.

    Raises
    ------
    CheckpointError
        The checkpoint is unreadable, not tensors and plain data, of another recipe or run, or
        past ``cfg.steps``; or it is missing while metrics.jsonl records steps of the recipe
        (starting over would silently drop them).
    MetricsError
        metrics.jsonl has a damaged line.
    """
    cfg = run_config(cfg, named)
    path = checkpoint_path(out_dir, named)
    sharded = cfg.fsdp or cfg.ep > 1 or cfg.tp > 1
    if sharded:
        path, other = sharded_path(path), path
    else:
        other = sharded_path(path)
    if not path.exists() and other.exists():
        how = ("a single process (without --fsdp / --ep)" if sharded else
               "torchrun with --fsdp / --ep, as it was started")
        raise CheckpointError(f"--resume: {named.label!r} has the checkpoint {other}, written by "
                              f"{'one process' if sharded else 'a sharded run'}; resume it with {how}.")
    if sharded and path.exists():
        _check_resumable(read_state(path), path, named, cfg)
        return True
    if not path.is_file():
        done = MetricsLog(out_dir / "metrics.jsonl").last_step(named.label)
        if done:
            raise CheckpointError(
                f"--resume: no checkpoint for recipe {named.label!r} at {path}, but metrics.jsonl has "
                f"its steps up to step {done}; resuming would restart it from step 0. Restore the "
                "checkpoint, or delete the recipe's lines in metrics.jsonl to train it again.")
        return False
    # mapped, not read: only the settings are looked at here
    _check_resumable(load_checkpoint(path, "cpu", mmap=True), path, named, cfg)
    return True


def _restore(model: torch.nn.Module, opt: torch.optim.Optimizer, ck: dict[str, Any], path: Path) -> None:
    """Load the model (its quantizer state included), optimizer and RNG states of ``ck``."""
    try:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        set_rng_state(ck["rng"])
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        detail = " ".join(str(e).split())
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        raise CheckpointError(f"--resume: {path} does not fit this run's model, optimizer or generator "
                              f"({type(e).__name__}: {detail}).") from None


def _check_same_corpus(metrics: MetricsLog, named: NamedRecipe, data: TokenData) -> None:
    """A resumed run must read the corpus it began on (its step-0 record's ``data``, where one
    was recorded): another would splice two trajectories into one run.

    Raises
    ------
    CheckpointError
        The recipe began on a corpus with another fingerprint (another set of installed
        packages, another cap) or on one with a fingerprint this data lacks.
    """
    began = next((r["data"] for r in metrics.read(named.label) if r["step"] == 0 and "data" in r), None)
    if began is not None and began != data.fingerprint:
        now = f"corpus {data.fingerprint}" if data.fingerprint else "data without a corpus fingerprint"
        raise CheckpointError(f"--resume: recipe {named.label!r} began on corpus {began}, but this run reads "
                              f"{now}; resume with the same --data, its files unchanged (for --data packages: on the same installed "
                              "packages), or "
                              "delete the recipe's lines in metrics.jsonl and its checkpoint to train it again.")


def train_recipe(cfg: TrainConfig, named: NamedRecipe, data: TokenData, out_dir: Path, *,
                 resume: bool = False, progress: bool = True, par: Optional[Parallel] = None) -> RunResult:
    """Train (or resume) one recipe for ``cfg.steps`` steps; write metrics and a checkpoint.

    A recipe given with its own seed (``bf16@seed=1``) replaces ``cfg.seed`` for this run.
    ``progress`` shows a tqdm bar (the ``train`` extra); a resume is logged at INFO.
    ``par``: a run spread over the ranks of a ``torchrun`` launch (``--fsdp`` / ``--ep``, see
    ``distributed.py``); every rank calls this, rank 0 writes the metrics, the others none;
    the checkpoint is a ``torch.distributed.checkpoint`` folder (``dist_checkpoint.py``)."""
    from tqdm import tqdm  # the train extra (hybridfp[train]); the CLI checks it is installed

    cfg = run_config(cfg, named)
    ckpt_path = checkpoint_path(out_dir, named)
    main = par is None or par.is_main
    metrics = MetricsLog(out_dir / "metrics.jsonl")
    if resume:  # before any model is built: a run on another corpus goes no further
        _check_same_corpus(metrics, named, data)
    model = build_model(cfg, data.vocab_size, named.recipe)
    if par is not None:
        shard_model(model, par, named.recipe)
    opt = make_optimizer(model, cfg)
    group = amax_group(model, named.recipe, par)
    precomputed = weight_amax_precompute(model, par, named.recipe)
    if precomputed and main:
        logger.info("[%s] %d weights' amaxes reduced once per step, one all-reduce per shard group "
                    "(tensor-parallel weights: a second over tp; precompute_weight_amax)", named.label, precomputed)
    if par is not None:
        ckpt_path = sharded_path(ckpt_path)
    result = RunResult(named.label, named.description, checkpoint=str(ckpt_path) if cfg.save_checkpoints else None)
    start = 0
    if resume:
        if par is None:
            ck = load_checkpoint(ckpt_path, cfg.device)
            _check_resumable(ck, ckpt_path, named, cfg)
            _restore(model, opt, ck, ckpt_path)
        else:
            ck = read_state(ckpt_path)
            _check_resumable(ck, ckpt_path, named, cfg)
            load_sharded(ckpt_path, model, opt, par, lambda: _quantizer_states(model, named.recipe, group))
        start, result.tokens, result.train_seconds = ck["step"], ck["tokens"], ck["train_seconds"]
        if main:
            metrics.truncate(named.label, start)
        logger.info("[%s] resumed from %s at step %d", named.label, ckpt_path, start)
    else:
        if main:
            metrics.truncate(named.label, -1)
        torch.manual_seed(cfg.seed + 1)  # training randomness (stochastic rounding), per run
        val = evaluate(model, named, data, cfg, par, group)
        if main:
            first: dict[str, Any] = {"step": 0, "recipe": named.label, "val_loss": val, "elapsed": 0.0}
            if data.fingerprint:  # the corpus this run read: reports refuse to compare runs of two corpora
                first["data"] = data.fingerprint
            metrics.append(first)
    sched = make_scheduler(opt, cfg, start)
    model.train()
    bar = tqdm(range(start, cfg.steps), desc=f"{named.label[:32]:<32}", initial=start, total=cfg.steps,
               disable=not (progress and main), dynamic_ncols=True, leave=True)
    tps_ema = None
    for step in bar:
        t0 = time.perf_counter()
        lr = opt.param_groups[0]["lr"]  # the scheduler's (every group has the same)
        x, y = get_batch(data.train, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        if par is not None:  # this rank's rows of the global batch
            x, y = x[par.rows(cfg.batch_size)], y[par.rows(cfg.batch_size)]
        x, y = x.to(cfg.device), y.to(cfg.device)
        with autocast(recipe=named.recipe, amax_reduction_group=group):
            _, loss = model(x, y)
        loss.backward()
        if par is not None:
            sync_gradients(model, par)
        if cfg.grad_clip > 0:
            clip_grad_norm(model, cfg.grad_clip, par)
        opt.step()
        if precomputed:  # the next step's quantized gathers all-reduce no amax of their own
            precompute_weight_amax(model)
        sched.step()
        opt.zero_grad(set_to_none=True)
        # cross-entropy (the MoE aux loss is logged apart), the mean over the ranks' rows
        train_loss = mean_over_ranks(model.last_ce_loss, par)
        dt = time.perf_counter() - t0
        result.train_seconds += dt
        result.tokens += cfg.tokens_per_step
        tps = cfg.tokens_per_step / dt
        tps_ema = tps if tps_ema is None else 0.9 * tps_ema + 0.1 * tps
        done = step + 1
        rec: dict[str, Any] = {"step": done, "recipe": named.label, "train_loss": train_loss, "lr": lr,
                               "tokens_per_s": tps, "elapsed": result.train_seconds}
        if model.last_aux_loss is not None:
            rec["aux_loss"] = mean_over_ranks(model.last_aux_loss, par)
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            rec["val_loss"] = evaluate(model, named, data, cfg, par, group)
        if main:
            metrics.append(rec)
        bar.set_postfix_str(f"loss {train_loss:.3f}, {tps_ema:,.0f} tok/s"
                            + (f", val {rec['val_loss']:.3f}" if "val_loss" in rec else ""))
        if not all_true(math.isfinite(loss.item()), par):  # every rank stops together
            bar.close()
            raise FloatingPointError(f"[{named.label}] loss became {train_loss} at step {done}; lower --lr "
                                     "or try a higher-precision recipe.")
        if cfg.save_checkpoints and ((cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0)
                                     or done == cfg.steps):
            info = {"step": done, "tokens": result.tokens, "train_seconds": result.train_seconds,
                    "recipe": named.label, "config": cfg.to_dict()}
            if par is None:
                save_checkpoint(ckpt_path, {**info, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                            "rng": rng_state()})
            else:
                save_sharded(ckpt_path, model, opt, info, par, group)
    bar.close()
    result.records = metrics.read(named.label) if main else []
    result.emulated = emulated_pairs(model, named, cfg.device, DTYPES[cfg.dtype])
    result.model = model
    return result


__all__ = ["DTYPES", "FIXED_ON_RESUME", "MetricsError", "MetricsLog", "RunResult", "TrainConfig", "WarmupCosineLR",
           "build_model", "checkpoint_path", "count_params", "emulated_pairs", "evaluate", "lr_at",
           "make_optimizer", "make_scheduler", "plan_resume", "run_config", "train_recipe", "warmup_cosine"]
