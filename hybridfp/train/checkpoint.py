"""Training checkpoints: everything a resumed run needs to continue bit for bit, as tensors and
plain data only.

A checkpoint holds ``model.state_dict()`` (parameters, and every hybridfp module's quantizer
state as its extra state: delayed scaling's amax history and scale), the optimizer's
``state_dict()``, the step reached (which is also the data position: batch i is a function of
(seed, i)), torch's RNG states as byte tensors (stochastic rounding draws its seeds from them),
the recipe by its command-line label, the run's settings as a plain dict, and the cumulative
training time and tokens.

It is read with ``torch.load(weights_only=True)``: a file holding anything else (a pickled
object, which could run code when loaded) is refused before any of it is used, and so is a
checkpoint from another run (other settings, another recipe).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .files import atomic_write
from .model import saved_model_settings

#: Keys of a checkpoint and the types of their values.
_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,), "model": (dict,), "optimizer": (dict,), "rng": (dict,), "tokens": (int,),
    "train_seconds": (int, float), "recipe": (str,), "config": (dict,),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, not tensors and plain data, or from
    another run. The message names the file and what to do."""


def rng_state() -> dict[str, Any]:
    """torch's CPU and CUDA generator states (byte tensors).

    Returns
    -------
    dict
        ``{"cpu": tensor}`` plus ``"cuda": [tensor per device]`` once CUDA is initialized.
    """
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state` (states are CPU byte tensors, wherever the checkpoint was
    mapped to).

    Raises
    ------
    RuntimeError, TypeError
        A state that is not a generator state.
    """
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write a checkpoint atomically (a crash never leaves a truncated file).

    Parameters
    ----------
    path:
        Where to write it.
    payload:
        Tensors and plain data only (see the module docstring), so that :func:`load_checkpoint`
        can read it with ``weights_only=True``.
    """
    atomic_write(path, lambda f: torch.save(payload, f))


def _refusal_reason(e: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused."""
    paragraphs = [" ".join(p.split()) for p in str(e).split("\n\n") if p.strip()]
    detail = [p for p in paragraphs[1:] if not p.startswith("Check the documentation")]
    return detail[0] if detail else "refused by torch.load(weights_only=True)"


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`, as tensors and plain data only.

    Parameters
    ----------
    path:
        The checkpoint file.
    map_location:
        Where its tensors go (``torch.load``'s argument).
    mmap:
        Map the tensors instead of reading them (cheap: for checking a checkpoint's settings
        before training anything).

    Returns
    -------
    dict
        The checkpoint, its keys and their types checked.

    Raises
    ------
    CheckpointError
        The file is missing or unreadable, holds anything but tensors and plain data (nothing
        in it is run or used then), or lacks a checkpoint's keys.
    """
    if not path.is_file():
        raise CheckpointError(f"--resume: no checkpoint at {path}; run without --resume first "
                              "(with the same --out).")
    try:
        ck = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"--resume: {path} holds objects other than tensors and plain data ({_refusal_reason(e)}); "
            "hybridfp train writes only those, so the file was altered, written by something else, or "
            "written by an earlier hybridfp train that pickled quantizer objects (train it again). "
            "Nothing in it was used: restore it from a trusted copy, or delete it and that recipe's "
            "lines in metrics.jsonl to train the recipe again.") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = " ".join(str(e).split("\n")[0].split())
        raise CheckpointError(f"--resume: {path} cannot be read as a checkpoint ({type(e).__name__}: "
                              f"{first}); it is damaged (e.g. truncated): restore it, or delete it and "
                              "that recipe's lines in metrics.jsonl to train the recipe again.") from None
    _check_fields(ck, path)
    return ck


def _check_fields(ck: Any, path: Path) -> None:
    """A dict with every key of :data:`_FIELDS`, each of its type."""
    if not isinstance(ck, dict):
        raise CheckpointError(f"--resume: {path} is not a hybridfp train checkpoint (it holds a "
                              f"{type(ck).__name__}, not a dict with {', '.join(_FIELDS)}).")
    for key, types in _FIELDS.items():
        value = ck.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            got = "nothing" if key not in ck else f"a {type(value).__name__}"
            raise CheckpointError(f"--resume: {path} is not a hybridfp train checkpoint: its {key!r} "
                                  f"is {got}, expected {' or '.join(t.__name__ for t in types)}.")
    if ck["step"] < 0 or ck["tokens"] < 0:
        raise CheckpointError(f"--resume: {path} is at step {ck['step']} with {ck['tokens']} tokens; "
                              "a hybridfp train checkpoint has neither negative.")
    if not isinstance(ck["rng"].get("cpu"), torch.Tensor):
        raise CheckpointError(f"--resume: {path} has no CPU generator state (rng['cpu']); it is not a "
                              "hybridfp train checkpoint.")


def check_belongs(ck: Mapping[str, Any], path: Path, label: str, config: Mapping[str, Any],
                  keys: Sequence[str]) -> None:
    """Refuse a checkpoint of another recipe or of a run with other settings.

    Parameters
    ----------
    ck:
        The checkpoint (from :func:`load_checkpoint`).
    path:
        Its file (for the message).
    label:
        The recipe being resumed.
    config:
        The run's settings (``TrainConfig.to_dict()``, the recipe's own seed applied).
    keys:
        The settings that must match (those a resumed run cannot change), besides the model.

    Raises
    ------
    CheckpointError
        The recipe or one of those settings differs.
    """
    if ck["recipe"] != label:
        raise CheckpointError(f"--resume: {path} is a checkpoint of recipe {ck['recipe']!r}, not of "
                              f"{label!r}; restore {label!r}'s own checkpoint there.")
    # a checkpoint from before a model setting existed holds the value its run trained with
    saved = {**ck["config"], "model": saved_model_settings(ck["config"].get("model") or {})}
    for key in (*keys, "model"):
        if saved.get(key) != config.get(key):
            what = "model shape" if key == "model" else key
            preset = "" if key == "preset" else (f" (preset {saved.get('preset')!r}; this run's: "
                                                 f"{config.get('preset')!r})")
            raise CheckpointError(
                f"--resume: {path} is from a run with {what} {saved.get(key)!r}, but the run in its "
                f"folder has {config.get(key)!r}{preset}; it belongs to another run: resume that "
                "run's --out.")


__all__ = ["CheckpointError", "check_belongs", "load_checkpoint", "rng_state", "save_checkpoint",
           "set_rng_state"]
