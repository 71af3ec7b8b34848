"""``hybridfp train --jobs N``: the compared recipes as N concurrent worker processes.

A small model does not fill a GPU, and several GPUs may be present: each recipe then runs in
its own ``python -m hybridfp.train --recipe R`` process with the run's resolved settings (so
every recipe still starts from the same weights and sees the same batches), writing under
``<out>/parts/<slug>/``; recipes are assigned round-robin to the visible CUDA devices. When
all are done their metrics, checkpoints and results are gathered into ``<out>`` like a
sequential run's.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Optional, Sequence

import torch

from .files import atomic_write_text
from .loop import MetricsLog, RunResult, TrainConfig
from .recipes_by_name import NamedRecipe

#: TrainConfig fields forwarded as flags (resolved values, not the preset's defaults).
_FORWARDED = ("steps", "batch_size", "seq_len", "lr", "warmup", "lr_decay_steps", "eval_interval",
              "eval_iters", "checkpoint_interval", "dtype", "seed")
#: TrainConfig booleans forwarded as bare flags when set (``--recompute`` is not kept by
#: ``--resume``, so it is passed on a resume too; ``--quantized-weights`` is kept in the worker's
#: run.json but passed anyway: the worker then checks it against that).
_FORWARDED_FLAGS = ("quantized_weights", "recompute")
#: The ``hybridfp train`` options (argparse dests) a worker does not receive as such, and why:
#: every other option must reach the worker (tests check the parser against this list).
NOT_FORWARDED = {
    "preset": "forwarded as --preset from the resolved settings",
    "recipe": "each worker gets its own recipe as --recipe",
    "compare": "each worker gets its own recipe as --recipe",
    "tokens": "resolved into --steps",
    "no_checkpoint": "forwarded from the resolved settings (save_checkpoints)",
    "device": "each worker gets its own device",
    "out": "each worker writes under <out>/parts/<slug>",
    "resume": "forwarded as --resume",
    "no_progress": "workers never show a progress bar (their output goes to a log)",
    "jobs": "a worker trains one recipe",
    "list_recipes": "exits before any training",
    "cache_dir": "forwarded when given",
    "data": "forwarded from the resolved settings",
    "hf_config_path": "--hf-config refuses --jobs (check_hf_args)",
    "fsdp": "--fsdp refuses --jobs (check_parallel_args)",
    "ep": "--ep refuses --jobs (check_parallel_args)",
    "tp": "--tp refuses --jobs (check_parallel_args)",
}
RESULTS_FILE = "results.json"

logger = logging.getLogger(__name__)


def worker_devices(device: str, n_jobs: int) -> list[str]:
    """One device per job: ``cuda`` spreads over every visible GPU, anything else is kept."""
    if device == "cuda" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [f"cuda:{i % count}" for i in range(n_jobs)]
    return [device] * n_jobs


def worker_argv(cfg: TrainConfig, named: NamedRecipe, part: Path, device: str, resume: bool,
                cache_dir: Optional[str]) -> list[str]:
    """The command line of the worker that trains ``named`` into ``part`` (a label parses back
    to its recipe)."""
    argv = [sys.executable, "-m", "hybridfp.train", "--out", str(part), "--device", device, "--no-progress"]
    if resume:  # the worker's run.json holds the rest; only what --resume may change is passed
        argv += ["--resume", "--steps", str(cfg.steps), "--eval-interval", str(cfg.eval_interval),
                 "--checkpoint-interval", str(cfg.checkpoint_interval)]
        if cfg.recompute:  # not kept by --resume: the worker would otherwise drop it
            argv += ["--recompute"]
    else:
        argv += ["--preset", cfg.preset, "--recipe", named.label]
        for key in _FORWARDED:
            argv += [f"--{key.replace('_', '-')}", str(getattr(cfg, key))]
        if cfg.data:
            argv += ["--data", cfg.data]
        for key in _FORWARDED_FLAGS:
            if getattr(cfg, key):
                argv += [f"--{key.replace('_', '-')}"]
        if not cfg.model.fused_swiglu:  # a model setting: the worker's preset holds the default
            argv += ["--eager-swiglu"]
    if not cfg.save_checkpoints:
        argv += ["--no-checkpoint"]
    if cache_dir:
        argv += ["--cache-dir", cache_dir]
    return argv


def write_results(path: Path, results: Sequence[RunResult]) -> None:
    """``results.json``: what summary.md needs from each run besides its metrics."""
    atomic_write_text(path, json.dumps([{"label": r.label, "description": r.description, "tokens": r.tokens,
                                 "train_seconds": r.train_seconds, "emulated": r.emulated,
                                 "checkpoint": r.checkpoint} for r in results], indent=1))


def read_result(part: Path, label: str) -> RunResult:
    """One worker's RunResult, its metrics included."""
    entry = next(e for e in json.loads((part / RESULTS_FILE).read_text()) if e["label"] == label)
    records = MetricsLog(part / "metrics.jsonl").read(label)
    return RunResult(entry["label"], entry["description"], records, entry["emulated"], entry["tokens"],
                     entry["train_seconds"], entry["checkpoint"])


def run_parallel(cfg: TrainConfig, recipes: Sequence[NamedRecipe], out: Path, n_jobs: int,
                 resume: bool, cache_dir: Optional[str]) -> tuple[list[RunResult], list[str]]:
    """Train every recipe in worker processes, ``n_jobs`` at a time. Returns the results of the
    runs that finished (in order) and one message per failed run (its log's tail): one
    recipe's failure does not discard the others' hours. Each start and end is logged (INFO;
    a failure at WARNING)."""
    devices = worker_devices(cfg.device, len(recipes))
    pending = deque(enumerate(recipes))
    running: dict[int, tuple[subprocess.Popen, Path, float]] = {}
    failed: list[str] = []
    failed_labels: set[str] = set()
    while pending or running:
        while pending and len(running) < n_jobs:
            i, named = pending.popleft()
            part = out / "parts" / named.slug
            part.mkdir(parents=True, exist_ok=True)
            logf = open(part / "log.txt", "a")
            argv = worker_argv(cfg, named, part, devices[i], resume, cache_dir)
            running[i] = (subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT), part, time.time())
            logf.close()
            logger.info("[%s] started on %s -> %s/", named.label, devices[i], part)
        time.sleep(0.5)
        for i, (proc, part, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[i]
            label = recipes[i].label
            if proc.returncode:
                tail = "".join((part / "log.txt").read_text().splitlines(keepends=True)[-15:])
                failed.append(f"{label} (exit {proc.returncode}; log {part / 'log.txt'}):\n{tail}")
                failed_labels.add(label)
                logger.warning("[%s] FAILED after %.0f s", label, time.time() - t0)
            else:
                logger.info("[%s] done in %.0f s", label, time.time() - t0)
    results = [read_result(out / "parts" / named.slug, named.label) for named in recipes
               if named.label not in failed_labels]
    gathered = gather_records(MetricsLog(out / "metrics.jsonl").read(), results,
                              {named.label: out / "parts" / named.slug for named in recipes
                               if named.label in failed_labels})
    # replaced whole: a kill while gathering leaves the previous gathered file
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(rec) + "\n" for rec in gathered))
    return results, failed


def gather_records(previous: Sequence[dict], results: Sequence[RunResult],
                   failed_parts: dict[str, Path]) -> list[dict]:
    """The gathered metrics.jsonl: each finished recipe's records from its worker; a failed
    recipe's from its worker's metrics.jsonl where that is readable, else the ones gathered
    before; every other recipe's (not trained this time) as gathered before. A failure never
    loses records that were there (hours of training may stand behind them)."""
    by_label: dict[str, list[dict]] = {}
    for rec in previous:
        by_label.setdefault(rec["recipe"], []).append(rec)
    for label, part in failed_parts.items():
        try:
            own = MetricsLog(part / "metrics.jsonl").read(label)
        except (OSError, ValueError):  # a damaged worker file: keep what was gathered before
            own = []
        if own:
            by_label[label] = own
    for r in results:
        by_label[r.label] = list(r.records)
    return [rec for recs in by_label.values() for rec in recs]
