"""Training checkpoints: everything a resumed run needs to continue bit for bit.

A checkpoint holds the model and optimizer state, the step reached (which is also the data
position: batch i is a function of (seed, i)), torch's RNG states (stochastic rounding draws
its seeds from them), the state of every hybridfp module's quantizers (delayed scaling's
amax history and scale live there, not in the module's state_dict), the run's settings, and
the cumulative training time and tokens.

Quantizer state is restored by building the module's quantizers for the recipe through the
public ``QuantizedModule.quantizers(state)`` and then copying the saved quantizers' attributes
into them (same recipe -> same quantizer classes and settings).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn import QuantizedModule
from ..recipes import AutocastState, Recipe


def quantizer_state(model: nn.Module, recipe: Recipe) -> dict[str, dict[str, list[Any]]]:
    """Module name -> slot -> the module's quantizer objects for ``recipe``."""
    state = AutocastState(recipe)
    return {name: {slot: list(qs) for slot, qs in m.quantizers(state).items()}
            for name, m in model.named_modules() if isinstance(m, QuantizedModule)}


def load_quantizer_state(model: nn.Module, recipe: Recipe, saved: dict[str, dict[str, list[Any]]]) -> None:
    """Restore quantizer state saved by :func:`quantizer_state` (same model and recipe)."""
    state = AutocastState(recipe)
    for name, m in model.named_modules():
        if not isinstance(m, QuantizedModule):
            continue
        if name not in saved:
            raise ValueError(f"checkpoint has no quantizer state for module {name!r}; was it saved "
                             "from a different model?")
        for slot, live_qs in m.quantizers(state).items():
            saved_qs = saved[name][slot]
            for live, old in zip(live_qs, saved_qs, strict=True):
                if type(live) is not type(old):
                    raise ValueError(f"checkpoint quantizer for {name}.{slot} is a {type(old).__name__} "
                                     f"but the recipe builds a {type(live).__name__}; resume with the "
                                     "recipe the checkpoint was trained with.")
                # which copies are held decoded is this device's policy (nn.base), not state
                live.__dict__.update({k: v for k, v in old.__dict__.items() if k != "_hold_decoded"})


def rng_state() -> dict[str, Any]:
    """torch's CPU and CUDA generator states."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state` (states are CPU byte tensors, wherever the checkpoint was
    mapped to)."""
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically (a crash never leaves a truncated checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    torch.save(payload, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (our own file: full unpickling,
    needed for the quantizer objects)."""
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}; run without --resume first "
                                "(with the same --out).")
    return torch.load(path, map_location=map_location, weights_only=False)
