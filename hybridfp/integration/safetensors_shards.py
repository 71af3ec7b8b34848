"""Sharded safetensors checkpoints, the Hugging Face layout: ``model-00001-of-0000N.safetensors``
files and ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {tensor: file}}``).

``save_safetensors(..., max_shard_size=...)`` hands this module its entries as *units*: a
header dict and the tensors it names (one plain tensor; a quantized weight's payloads with its
storage description; a module's quantizer state). A unit is never split across files, so every
shard is a complete safetensors file whose header describes exactly the tensors it holds; the
loader still resolves a header's tensor keys over the whole checkpoint (``weight_map``), and
checks that the index and the shards agree before anything is loaded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, NamedTuple, Union

import torch

#: The index file's name (transformers' ``SAFE_WEIGHTS_INDEX_NAME``).
INDEX_NAME = "model.safetensors.index.json"
#: The file a checkpoint that fits in one shard is written to (transformers' ``SAFE_WEIGHTS_NAME``).
SINGLE_NAME = "model.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: Header keys the loader does not compare between the index and the shards: the index's byte
#: count and the shards' framework tag (transformers writes ``{"format": "pt"}``).
_INDEX_ONLY, _SHARD_ONLY = ("total_size",), ("format",)
#: Prefixes of hybridfp's header entries that describe tensors (a quantized weight, quantizer state).
ENTRY_PREFIXES = ("__hybridfp__.quantized.", "__hybridfp__.extra.")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class Unit(NamedTuple):
    """Entries written together: header entries (str -> str) and the tensors they name."""

    header: dict[str, str]
    tensors: dict[str, torch.Tensor]

    def nbytes(self) -> int:
        """The bytes of its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def parse_shard_size(value: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"5GB"`` / ``"500MB"``
    (decimal units, as Hugging Face counts) or ``"2GiB"`` (binary units).

    Raises
    ------
    ValueError
        Not a positive int or a number with one of the units KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B)\s*", value.upper())
        if m is None:
            raise ValueError(f"save_safetensors: max_shard_size={value!r} is not a size; use an int of bytes "
                             "or a string such as '5GB', '500MB' or '2GiB'.")
        size = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise ValueError(f"save_safetensors: max_shard_size must be an int of bytes or a string such as '5GB'; "
                         f"got {type(value).__name__}.")
    if size <= 0:
        raise ValueError(f"save_safetensors: max_shard_size={value!r} must be positive.")
    return size


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Units (by index, in order) grouped into shards of at most ``max_bytes`` each, filled in
    order as Hugging Face does; a unit larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[int]] = []
    current, used = [], 0
    for i, size in enumerate(sizes):
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current or not shards:
        shards.append(current)
    return shards


def write_sharded(directory: str, base: dict[str, str], units: list[Unit], max_bytes: int,
                  save_file: Callable[..., None]) -> list[str]:
    """Write ``units`` into ``directory`` as shards and an index (one shard: ``model.safetensors``
    and no index, as Hugging Face does). Each shard's header holds ``base`` and its units' entries.
    Files of an earlier sharded save there that this one does not write are removed, so the
    directory holds one checkpoint. Returns the names of the files written."""
    os.makedirs(directory, exist_ok=True)
    plan = plan_shards([u.nbytes() for u in units], max_bytes)
    n = len(plan)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    for name, members in zip(names, plan):
        header = {"format": "pt", **base}
        tensors: dict[str, torch.Tensor] = {}
        for i in members:
            header.update(units[i].header)
            tensors.update(units[i].tensors)
            weight_map.update({k: name for k in units[i].tensors})
        save_file(tensors, os.path.join(directory, name), metadata=header)
    written = list(names)
    if n > 1:
        index = {"metadata": {"total_size": sum(u.nbytes() for u in units), **base},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(directory, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=False)
            f.write("\n")
        written.append(INDEX_NAME)
    for old in os.listdir(directory):  # stale files of an earlier save with another layout
        if old not in written and (_SHARD_RE.fullmatch(old) or old in (INDEX_NAME, SINGLE_NAME)):
            os.remove(os.path.join(directory, old))
    return written


def resolve(path: str) -> tuple[str, str]:
    """``("file", path)`` for a safetensors file, ``("index", path)`` for an index: ``path`` may be
    either, or a directory holding ``model.safetensors.index.json`` (preferred) or
    ``model.safetensors``.

    Raises
    ------
    FileNotFoundError
        Nothing of these at ``path``.
    """
    if os.path.isdir(path):
        for name, kind in ((INDEX_NAME, "index"), (SINGLE_NAME, "file")):
            if os.path.isfile(os.path.join(path, name)):
                return kind, os.path.join(path, name)
        raise FileNotFoundError(f"load_safetensors: the directory {path} holds neither {INDEX_NAME} nor "
                                f"{SINGLE_NAME}; pass the checkpoint's file, index or directory.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_safetensors: {path} does not exist.")
    return ("index", path) if path.endswith(".json") else ("file", path)


def read_file(path: str, safe_open: Callable[..., Any]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file's header (its metadata) and tensors."""
    with safe_open(path, framework="pt", device="cpu") as f:
        return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}


def _read_index(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The index's metadata and weight_map, checked for shape and for shard names that stay in
    the index's directory."""
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"load_safetensors: {path} is not valid JSON ({e}).") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"load_safetensors: {path} has no 'weight_map' object (tensor name -> shard file); "
                         "is it a safetensors index?")
    meta = index.get("metadata", {})
    if not isinstance(meta, dict):
        raise ValueError(f"load_safetensors: {path}: 'metadata' must be an object, got {type(meta).__name__}.")
    for key, name in index["weight_map"].items():
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            raise ValueError(f"load_safetensors: {path}: the weight_map maps {key!r} to {name!r}, which is not "
                             "a file name in the index's directory.")
    return meta, index["weight_map"]


def read_sharded(path: str, safe_open: Callable[..., Any]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Every shard an index names, as one header and one tensor dict, after checking that the
    index and the shards agree: each shard exists, holds the tensors the weight_map gives it and
    no other, its header's plain entries (user metadata, layout version) are the index's
    metadata, and no hybridfp header entry is in two shards.

    Raises
    ------
    FileNotFoundError
        A shard the weight_map names is missing (naming it).
    KeyError
        The weight_map names a tensor its shard does not hold (naming both).
    ValueError
        A shard holds a tensor the weight_map does not give it; metadata of a shard differs from
        the index's; an entry is described in two shards; a malformed index.
    """
    meta, weight_map = _read_index(path)
    directory = os.path.dirname(path)
    expected = {k: str(v) for k, v in meta.items() if k not in _INDEX_ONLY}
    header: dict[str, str] = {}
    stored: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        shard = os.path.join(directory, name)
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"load_safetensors: {path}: the weight_map names the shard {name!r}, which is "
                                    f"missing from {directory or '.'}; copy every shard of the checkpoint.")
        head, tensors = read_file(shard, safe_open)
        for key in tensors:
            if weight_map.get(key) != name:
                where = f"to {weight_map[key]!r}" if key in weight_map else "nowhere"
                raise ValueError(f"load_safetensors: {path}: the shard {name!r} holds the tensor {key!r}, which the "
                                 f"weight_map maps {where}; the index and the shards are of different saves.")
        plain = {k: v for k, v in head.items() if k not in _SHARD_ONLY and not _is_entry(k)}
        if plain != expected:
            diff = sorted(k for k in set(plain) | set(expected) if plain.get(k) != expected.get(k))
            raise ValueError(f"load_safetensors: {path}: the metadata of the shard {name!r} differs from the "
                             f"index's at {diff} (shard: {[plain.get(k) for k in diff]}, index: "
                             f"{[expected.get(k) for k in diff]}); the index and the shards are of different saves.")
        for k, v in head.items():
            if _is_entry(k):
                if k in header:
                    raise ValueError(f"load_safetensors: {path}: the header entry {k!r} is in two shards; the "
                                     "index and the shards are of different saves.")
                header[k] = v
        stored.update(tensors)
    missing = [(k, n) for k, n in weight_map.items() if k not in stored]
    if missing:
        key, name = missing[0]
        raise KeyError(f"load_safetensors: {path}: the weight_map names the tensor {key!r} in the shard {name!r}, "
                       f"which does not hold it ({len(missing)} such tensor(s)).")
    header.update(expected)
    return header, stored


def _is_entry(key: str) -> bool:
    """A hybridfp header entry that describes tensors (a quantized weight, quantizer state)."""
    return key.startswith(ENTRY_PREFIXES)
