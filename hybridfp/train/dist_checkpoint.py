"""Checkpoints of a sharded run (``hybridfp train --fsdp / --ep / --tp``): ``torch.distributed.checkpoint``.

``checkpoints/<recipe>.dcp/`` holds, as a DCP checkpoint, the model's state dict (the FSDP2
shards of the high-precision weights, every hybridfp module's quantizer state as its extra
state), the optimizer's, and torch's CPU generator state; ``train_state.json`` next to them holds
the plain data of a single-process checkpoint (step, tokens, training time, recipe, settings)
and the run's expert-parallel size. DCP reshards on load, so a run resumes at another number
of ranks; with ``--ep`` the experts are saved under their global names (``mlp.fc1.weight<e>``),
their quantizer state per expert-parallel rank, so the resumed run keeps the ``--ep`` size.
With ``--tp`` the weights whose rows each rank regroups (``tensor_parallel.grouped_weights``)
are written in one process's row order, so any ``--tp`` (or none) reads them.

The checkpoint is written to ``<recipe>.dcp.tmp`` and renamed when every rank has written its
part: a run killed meanwhile leaves the previous checkpoint. DCP's own ``.metadata`` file is
read by an unpickler that looks up the classes DCP writes there and nothing else.
"""

from __future__ import annotations

import importlib
import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from .checkpoint import CheckpointError
from .distributed import Parallel, barrier, masters_in_place
from .files import atomic_write_text

#: The plain-data file of a sharded checkpoint.
STATE_FILE = "train_state.json"
_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,), "tokens": (int,), "train_seconds": (int, float), "recipe": (str,), "config": (dict,),
    "ep": (int,),
}
_LOCAL_EXPERT = re.compile(r"^(.*)\.expert_parallel\.experts\.(fc[12])\.(weight)(\d+)$")
_LOCAL_EXTRA = re.compile(r"^(.*)\.expert_parallel\.experts\.(fc[12])\._extra_state$")


def read_state(path: Path) -> dict[str, Any]:
    """The plain data of the sharded checkpoint ``path`` (a ``.dcp`` folder), checked.

    Raises
    ------
    CheckpointError
        No checkpoint there, or its ``train_state.json`` is not JSON or lacks or mistypes a key.
    """
    f = path / STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"--resume: no sharded checkpoint at {path} ({STATE_FILE} missing); run "
                              "without --resume first (with the same --out), or restore the folder.")
    try:
        state = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"--resume: {f} is damaged (not JSON: {' '.join(str(e).split())}); restore "
                              "it, or delete the folder and the recipe's lines in metrics.jsonl.") from None
    for key, types in _STATE_TYPES.items():
        value = state.get(key) if isinstance(state, dict) else None
        if not isinstance(value, types) or isinstance(value, bool):
            raise CheckpointError(f"--resume: {f} is not a hybridfp train checkpoint: its {key!r} is "
                                  f"{type(value).__name__}, expected {' or '.join(t.__name__ for t in types)}.")
    return state


def _expert_names(model: nn.Module, par: Parallel) -> Callable[[str], str]:
    """Local state-dict names -> names that are the same on every rank for the same tensor:
    an expert's weight gets its global index; a local experts' quantizer state, its
    expert-parallel rank."""
    if par.ep == 1:
        return lambda k: k
    e = par.ep_mesh["ep"].get_local_rank()

    def rename(k: str) -> str:
        m = _LOCAL_EXPERT.match(k)
        if m:
            moe = model.get_submodule(m.group(1))
            return f"{m.group(1)}.{m.group(2)}.{m.group(3)}{e * moe.expert_parallel.num_local_experts + int(m.group(4))}"
        m = _LOCAL_EXTRA.match(k)
        return f"{m.group(1)}.{m.group(2)}._extra_state.ep{e}of{par.ep}" if m else k
    return rename


def _renamed(msd: dict, osd: dict, rename: Callable[[str], str]) -> tuple[dict, dict]:
    osd = {**osd, "state": {rename(k): v for k, v in osd.get("state", {}).items()},
           "param_groups": [{**g, "params": [rename(k) for k in g["params"]]} for g in osd.get("param_groups", [])]}
    return {rename(k): v for k, v in msd.items()}, osd


def save_sharded(path: Path, model: nn.Module, opt: torch.optim.Optimizer, info: dict[str, Any],
                 par: Parallel, amax_reduction_group: Optional[Any] = None) -> None:
    """Write the sharded checkpoint ``path`` (a collective: every rank calls it).

    Delayed scaling's amaxes recorded since the last region end (the output gradients' of the
    last backward) are each rank's own until the next region end reduces them, while the
    checkpoint holds one copy of the quantizers' state: they are all-reduced (MAX) first, so
    that copy is every rank's. The next region end's reduction of maxima then changes nothing:
    the run goes on as it would without the save.

    Parameters
    ----------
    path:
        The ``<recipe>.dcp`` folder.
    model, opt:
        The sharded model and its optimizer.
    info:
        step, tokens, train_seconds, recipe, config (plain data, rank 0's are written).
    par:
        The run's :class:`Parallel`.
    amax_reduction_group:
        The training regions' ``autocast(amax_reduction_group=...)`` (``loop.amax_group``;
        None: the recipe keeps no state, or ``--tp``, whose model reduces over every rank).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if par.tp > 1:  # every rank's delayed-scaling state the global one (tensor_parallel.py)
        from .tensor_parallel import reduce_pending_amaxes_all
        reduce_pending_amaxes_all(model)
    elif amax_reduction_group is not None:
        from ..quantizers.base import reduce_pending_amaxes
        from .tensor_parallel import stateful_quantizers
        reduce_pending_amaxes(stateful_quantizers(model), amax_reduction_group)
    with masters_in_place(model, opt) as torch_opt:  # --ep: separate FP32 masters saved as the weights
        msd, osd = _renamed(*get_state_dict(model, torch_opt), _expert_names(model, par))
    if par.tp > 1:  # the q/k/v (gate/up) rows in one process's order: resumable at any --tp
        from .tensor_parallel import grouped_weights, to_one_process_layout
        to_one_process_layout(msd, osd, grouped_weights(model))
    tmp = path.with_name(path.name + ".tmp")
    if par.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(par)
    dcp.save({"model": msd, "optimizer": osd, "rng": {"cpu": torch.get_rng_state()}}, checkpoint_id=str(tmp))
    if par.is_main:
        atomic_write_text(tmp / STATE_FILE, json.dumps({**info, "ep": par.ep, "world": par.world}, indent=1))
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    barrier(par)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: only the classes DCP writes there are looked up; any other
    global (which could run code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        from torch.distributed.checkpoint import filesystem
        from torch.distributed.checkpoint import metadata as md

        value = None
        if module == md.__name__ and isinstance(getattr(md, name, None), type):
            value = getattr(md, name)
        elif (module, name) in {(filesystem.__name__, "_StorageInfo"), ("torch", "Size"),
                                ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                                ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                                ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}:
            value = getattr(importlib.import_module(module), name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            value = getattr(torch, name)
        if value is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return value


def _safe_reader(path: Path) -> Any:
    """A DCP ``FileSystemReader`` that reads ``.metadata`` with :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as md

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                try:
                    meta = _MetadataUnpickler(f).load()
                except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
                    raise CheckpointError(
                        f"--resume: {path}/.metadata is not a checkpoint's metadata ({' '.join(str(e).split())}"
                        "); nothing in it was used: restore the folder from a trusted copy.") from None
            if not isinstance(meta, md.Metadata):
                raise CheckpointError(f"--resume: {path}/.metadata holds a {type(meta).__name__}, not a "
                                      "checkpoint's metadata; restore the folder from a trusted copy.")
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = md.StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return Reader(str(path))


def load_sharded(path: Path, model: nn.Module, opt: torch.optim.Optimizer, par: Parallel,
                 build_quantizers: Callable[[], Any]) -> None:
    """Load the sharded checkpoint ``path`` into ``model`` and ``opt`` and restore the CPU
    generator (a collective).

    Parameters
    ----------
    path:
        The ``<recipe>.dcp`` folder (its ``train_state.json`` already checked).
    model, opt:
        The sharded model and its optimizer, as built for the run.
    par:
        The run's :class:`Parallel`.
    build_quantizers:
        Builds the model's quantizers for the recipe (their state is then loaded into them).

    Raises
    ------
    CheckpointError
        The checkpoint was written with another ``--ep``, or does not fit the model.
    """
    saved_ep = read_state(path)["ep"]
    if saved_ep != par.ep:
        raise CheckpointError(f"--resume: {path} was written with --ep {saved_ep}; resume with --ep "
                              f"{saved_ep} (any number of ranks it divides).")
    build_quantizers()
    rename = _expert_names(model, par)
    with masters_in_place(model, opt) as torch_opt:
        _load_into(path, model, torch_opt, par, rename)
    # --ep: the quantized weights re-encoded from their loaded separate masters
    from ..integration.master_weights import MasterWeightOptimizer, quantize_master_weights
    if isinstance(opt, MasterWeightOptimizer):
        quantize_master_weights(opt.model_params, opt.master_params)


def _load_into(path: Path, model: nn.Module, opt: torch.optim.Optimizer, par: Parallel,
               rename: Callable[[str], str]) -> None:
    """:func:`load_sharded`'s DCP read into ``model`` and the torch optimizer ``opt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    local_msd, local_osd = get_state_dict(model, opt)
    back = {rename(k): k for k in [*local_msd, *local_osd.get("state", {}),
                                   *(k for g in local_osd.get("param_groups", []) for k in g["params"])]}
    msd, osd = _renamed(local_msd, local_osd, rename)
    undo: list = []
    if par.tp > 1:  # read whole in one process's row order, then regrouped and sharded
        from .tensor_parallel import expect_one_process_layout, grouped_weights
        undo = expect_one_process_layout(msd, osd, grouped_weights(model))
    state: dict[str, Any] = {"model": msd, "optimizer": osd, "rng": {"cpu": torch.get_rng_state()}}
    try:
        dcp.load(state, storage_reader=_safe_reader(path))
    except CheckpointError:
        raise
    except Exception as e:  # DCP wraps each rank's failure in its own exception type
        detail = " ".join(str(e).split())
        raise CheckpointError(f"--resume: {path} does not fit this run's model or optimizer "
                              f"({type(e).__name__}: {detail[:300]}).") from None
    if undo:
        from .tensor_parallel import from_one_process_layout
        from_one_process_layout(undo)
    msd, osd = _renamed(state["model"], state["optimizer"], lambda k: back.get(k, k))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    # quantized primary weights: each rank's quantized shard re-encoded from its loaded master
    from ..integration.fsdp_primary import quantize_sharded_weights
    quantize_sharded_weights(model)
    torch.set_rng_state(state["rng"]["cpu"].cpu())


def sharded_path(ckpt: Path) -> Path:
    """The sharded checkpoint folder of a recipe whose single-process checkpoint is ``ckpt``."""
    return ckpt.with_suffix(".dcp")


__all__ = ["STATE_FILE", "load_sharded", "read_state", "save_sharded", "sharded_path"]
