"""``save_safetensors`` / ``load_safetensors``: a model's state dict as a safetensors file that
keeps quantized weights quantized.

safetensors holds plain tensors and a string -> string header, no pickled objects. Each
``QuantizedTensor`` entry is written as its payload tensors, under
``<entry>.__hybridfp__.<direction>.<name>``, and its storage description (class name, shape,
nominal dtype, format options, which key holds which payload) as JSON in the header; the
modules' quantizer state (``_extra_state``: delayed scaling's amax history and scale) likewise,
so training resumes where it stopped. Loading reads nothing but tensors and JSON, checks every
field as ``torch.load(weights_only=True)`` does (``tensors.validation``) and copies the payloads
into the model's own quantized parameters bitwise. With ``max_shard_size`` the same entries are
written as a Hugging Face sharded checkpoint (``safetensors_shards``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from ..tensors import QuantizedTensor
from ..tensors.quantized_tensor import storage_from_state
from ..tensors.validation import InvalidStateError
from . import safetensors_shards as shards

#: Header keys and tensor-key infix of hybridfp's own entries (reserved: user metadata may not
#: use them).
RESERVED = "__hybridfp__"
#: Version of the layout below; a file of another version is refused.
FORMAT_VERSION = "1"
_VERSION_KEY = f"{RESERVED}.version"
_QUANTIZED, _EXTRA = shards.ENTRY_PREFIXES  # "__hybridfp__.quantized.", "__hybridfp__.extra."
_EXTRA_SUFFIX = "_extra_state"

PathLike = Union[str, "os.PathLike[str]"]


def _safetensors() -> Any:
    """The ``safetensors`` package (an optional dependency), or an ImportError naming the extra."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        raise ImportError("hybridfp.save_safetensors / load_safetensors need the safetensors package: "
                          "pip install 'hybridfp[safetensors]' (or pip install safetensors).") from e
    return safetensors


# ---------------------------------------------------------------------- JSON encoding
# Every value that JSON has no type for is a one-key tagged object; dicts (str keys) are JSON
# objects, refused on save when one could be mistaken for a tag.
_TAGS = ("__tensor__", "__dtype__", "__tuple__")

def _encode(value: Any, path: tuple, put: Callable[[tuple, torch.Tensor], str], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
            raise TypeError(f"save_safetensors: {where}: {'.'.join(map(str, path))} is a "
                            f"{type(value).__name__}; only plain tensors can be written.")
        return {"__tensor__": put(path, value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, torch.Size)):
        return {"__tuple__": [_encode(v, path + (i,), put, where) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, path + (i,), put, where) for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str) or (len(value) == 1 and k in _TAGS):
                raise TypeError(f"save_safetensors: {where}: dict key {k!r} at {'.'.join(map(str, path))} "
                                f"cannot be written (keys must be str; a lone key may not be one of {_TAGS}).")
        return {k: _encode(v, path + (k,), put, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"save_safetensors: {where}: {'.'.join(map(str, path))} is a {type(value).__name__}; "
                    "only tensors, dtypes and plain data (dict, list, tuple, str, int, float, bool, "
                    "None) can be written.")


def _decode(value: Any, get: Callable[[str], torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, get, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1 or next(iter(value)) not in _TAGS:
        return {k: _decode(v, get, where) for k, v in value.items()}
    (tag, body), = value.items()
    if tag == "__tensor__" and isinstance(body, str):
        return get(body)
    if tag == "__dtype__" and isinstance(body, str):
        dtype = getattr(torch, body, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidStateError(f"{where}: {body!r} is not a torch dtype.")
        return dtype
    if tag == "__tuple__" and isinstance(body, list):
        return tuple(_decode(v, get, where) for v in body)
    raise InvalidStateError(f"{where}: metadata tag {tag!r} holds a {type(body).__name__}, which it cannot.")


# ---------------------------------------------------------------------- save
def save_safetensors(model: Union[nn.Module, Mapping[str, Any]], path: PathLike,
                     metadata: Optional[dict[str, str]] = None, *,
                     max_shard_size: Optional[Union[int, str]] = None) -> None:
    """Write ``model.state_dict()`` to a safetensors file, quantized weights as their payloads;
    with ``max_shard_size``, to a directory of shards in the Hugging Face layout.

    Plain tensors keep their names (any safetensors reader gets them); each ``QuantizedTensor``
    (a weight held by ``quantized_model_init``) becomes its payload tensors,
    ``<name>.__hybridfp__.<direction>.<payload>``, described in the header as JSON; the
    quantizers' state (``_extra_state``) goes in the header too, its tensors under
    ``<module>._extra_state.<field>``. :func:`load_safetensors` reads it back bitwise. For plain
    high-precision weights pass ``export_state_dict(model)`` instead of the model.

    Sharded: ``path`` is a directory; the entries are written in state-dict order into
    ``model-00001-of-0000N.safetensors`` files of at most ``max_shard_size`` bytes of tensors
    each (an entry larger than that gets a file of its own) and ``model.safetensors.index.json``
    (``{"metadata": {"total_size": ..., <metadata>}, "weight_map": {tensor: file}}``); a
    checkpoint that fits in one shard is ``model.safetensors`` alone, as Hugging Face writes it.
    A quantized weight's payloads and its description, and a module's quantizer state, always
    go into one file together; every shard's header carries ``metadata``. Shard and index files
    of an earlier save in the directory that this save does not write are removed.

    Parameters
    ----------
    model:
        Any module (hybridfp modules with quantized or high-precision weights), or a state dict
        (e.g. ``export_state_dict(model)``: a plain checkpoint any safetensors reader loads).
    path:
        The file to write; with ``max_shard_size``, the directory.
    metadata:
        Extra header entries (str -> str); keys starting with ``__hybridfp__`` are reserved.
    max_shard_size:
        None: one file. Otherwise the largest shard, an int of bytes or a string such as
        ``"5GB"``, ``"500MB"`` (decimal units, as Hugging Face counts) or ``"2GiB"``.

    Raises
    ------
    ImportError
        safetensors is not installed (the ``hybridfp[safetensors]`` extra).
    ValueError
        ``metadata`` is not str -> str or uses a reserved key; ``max_shard_size`` is not a
        positive size.
    TypeError
        A state-dict entry holds something other than tensors and plain data.

    Example
    -------
    >>> import os, tempfile, torch, hybridfp as hf
    >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
    ...     a, b = hf.Linear(32, 16), hf.Linear(32, 16)
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> hf.save_safetensors(a, path)
    >>> _ = hf.load_safetensors(b, path)
    >>> all(torch.equal(x, y) for x, y in zip(a.weight.qstorage.tensors(), b.weight.qstorage.tensors()))
    True
    >>> folder = tempfile.mkdtemp()
    >>> hf.save_safetensors(a, folder, max_shard_size="1KB")
    >>> sorted(os.listdir(folder))
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
    >>> _ = hf.load_safetensors(b, folder)
    """
    st = _safetensors()
    limit = None if max_shard_size is None else shards.parse_shard_size(max_shard_size)
    base: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"save_safetensors: metadata must map str to str; got {k!r}: {type(v).__name__}.")
        if k.startswith(RESERVED):
            raise ValueError(f"save_safetensors: metadata key {k!r} is reserved (keys starting with {RESERVED!r} "
                             "hold hybridfp's own entries); rename it.")
        base[k] = v
    base[_VERSION_KEY] = FORMAT_VERSION
    state = model.state_dict() if isinstance(model, nn.Module) else model
    units = _units(state)
    if limit is not None:
        shards.write_sharded(os.fspath(path), base, units, limit, st.torch.save_file)
        return
    header, tensors = dict(base), {}
    for unit in units:
        header.update(unit.header)
        tensors.update(unit.tensors)
    st.torch.save_file(tensors, os.fspath(path), metadata=header)


def _units(state: Mapping[str, Any]) -> list[shards.Unit]:
    """The state dict's entries as units written together: a plain tensor; a quantized weight's
    payloads and description; a module's quantizer state and its tensors."""
    units: list[shards.Unit] = []
    keys: set[str] = set()
    storages: set[int] = set()

    def adder(unit: shards.Unit) -> Callable[[str, torch.Tensor], str]:
        def add(key: str, t: torch.Tensor) -> str:
            if key in keys:
                raise ValueError(f"save_safetensors: two entries would be written under the key {key!r}.")
            t = t.detach().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages and t.numel():  # safetensors refuses tensors sharing memory
                t = t.clone()
            storages.add(ptr)
            keys.add(key)
            unit.tensors[key] = t
            return key
        return add

    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"save_safetensors: state-dict key {name!r} is not a str.")
        unit = shards.Unit({}, {})
        add = adder(unit)
        if name.rsplit(".", 1)[-1] == _EXTRA_SUFFIX:
            enc = _encode(value, (), lambda p, t, n=name, add=add: add(".".join(map(str, (n,) + p)), t), name)
            unit.header[_EXTRA + name] = json.dumps(enc)
        elif isinstance(value, QuantizedTensor):
            unit.header[_QUANTIZED + name] = json.dumps({"storage": _encode_storage(name, value, add)})
        elif isinstance(value, torch.Tensor):
            add(name, value)
        else:
            raise TypeError(f"save_safetensors: state-dict entry {name!r} is a {type(value).__name__}, not a tensor.")
        units.append(unit)
    return units


def _encode_storage(name: str, t: QuantizedTensor, add: Callable[[str, torch.Tensor], str]) -> Any:
    """The storage's state with each distinct payload tensor written once (a tensor both copies
    share, such as FP8's per-tensor scale, keeps one key and is shared again on load)."""
    keys: dict[int, str] = {}

    def put(path: tuple, tensor: torch.Tensor) -> str:
        if id(tensor) not in keys:
            # ('payloads', direction, payload) or, in a hybrid, ('parts', d, 'payloads', d, payload)
            short = f"{name}.{RESERVED}.{path[-2]}.{path[-1]}"
            full = f"{name}.{RESERVED}." + ".".join(map(str, path))
            keys[id(tensor)] = add(short if short not in keys.values() else full, tensor)
        return keys[id(tensor)]

    return _encode(t.qstorage.to_state(), (), put, name)


# ---------------------------------------------------------------------- load
def load_safetensors(model: nn.Module, path: PathLike, strict: bool = True) -> Any:
    """Load a checkpoint written by :func:`save_safetensors` into ``model`` (or a plain
    safetensors checkpoint into a model of plain weights): quantized weights get the saved
    payloads bitwise, the quantizers the saved state (applied when the next forward builds them).

    ``model`` must hold its quantized weights in the saved formats (built under
    ``quantized_model_init`` with the saved recipe); every entry is checked before anything is
    loaded. A sharded checkpoint is read whole, after checking that its index and shards agree
    (every shard present, holding the tensors the ``weight_map`` gives it and no other, its
    metadata the index's).

    Parameters
    ----------
    model:
        The module to load into.
    path:
        The file; for a sharded checkpoint its directory or its ``model.safetensors.index.json``
        (a directory holding only ``model.safetensors`` reads that).
    strict:
        Refuse entries the model lacks and model entries the file lacks (as
        ``load_state_dict``); False loads what both have and reports the rest.

    Returns
    -------
    NamedTuple
        ``load_state_dict``'s ``(missing_keys, unexpected_keys)``.

    Raises
    ------
    ImportError
        safetensors is not installed (the ``hybridfp[safetensors]`` extra).
    FileNotFoundError
        Nothing at ``path``, or a shard the index names is missing (naming it).
    KeyError
        A tensor the header or the weight_map names is not in the checkpoint; with ``strict``,
        an entry missing or unexpected. The message names the key.
    ValueError
        (``InvalidStateError`` for quantized entries) a header entry that is not valid JSON, an
        unknown storage class or tag, payloads of the wrong dtype or shape, a quantized entry in
        another format than the model's, a plain entry of another dtype or shape; an index and
        shards that disagree (metadata, which shard holds a tensor); naming the key or shard.

    Example
    -------
    >>> import os, tempfile, torch, hybridfp as hf
    >>> a, b = hf.Linear(8, 4), hf.Linear(8, 4)
    >>> path = os.path.join(tempfile.mkdtemp(), "plain.safetensors")
    >>> hf.save_safetensors(a, path)
    >>> hf.load_safetensors(b, path)
    <All keys matched successfully>
    >>> torch.equal(a.weight, b.weight)
    True
    """
    st = _safetensors()
    kind, where = shards.resolve(os.fspath(path))
    if kind == "index":
        header, stored = shards.read_sharded(where, st.safe_open)
    else:
        header, stored = shards.read_file(where, st.safe_open)
    version = header.get(_VERSION_KEY)
    if version is not None and version != FORMAT_VERSION:
        raise ValueError(f"load_safetensors: {where} has hybridfp layout version {version!r}; this hybridfp "
                         f"reads version {FORMAT_VERSION!r}.")
    used: set[str] = set()

    def getter(entry: str) -> Callable[[str], torch.Tensor]:
        def get(key: str) -> torch.Tensor:
            if key not in stored:
                raise KeyError(f"load_safetensors: {where}: the header of {entry!r} names the tensor {key!r}, "
                               "which the file does not hold.")
            used.add(key)
            return stored[key]
        return get

    loaded: dict[str, Any] = {}
    for hkey, text in header.items():
        for prefix in (_QUANTIZED, _EXTRA):
            if hkey.startswith(prefix):
                entry = hkey[len(prefix):]
                what = f"load_safetensors: {where}: entry {entry!r}"
                try:
                    raw = json.loads(text)
                except json.JSONDecodeError as e:
                    raise InvalidStateError(f"{what}: its header value is not valid JSON ({e}).") from None
                if prefix == _EXTRA:
                    loaded[entry] = _decode(raw, getter(entry), what)
                    continue
                if not (isinstance(raw, dict) and set(raw) == {"storage"}):
                    raise InvalidStateError(f"{what}: its header value must be an object with the one key "
                                            f"'storage'; got {str(raw)[:80]!r}.")
                try:
                    storage = storage_from_state(_decode(raw["storage"], getter(entry), what))
                except InvalidStateError as e:
                    if str(e).startswith(what):
                        raise
                    raise InvalidStateError(f"{what}: {e}") from None
                loaded[entry] = QuantizedTensor(storage)
    for key, t in stored.items():
        if key not in used and RESERVED not in key:
            loaded[key] = t
    for key in stored:  # payload-like keys that no header entry names
        if RESERVED in key and key not in used:
            loaded.setdefault(key, stored[key])

    expected = model.state_dict()
    missing = [k for k in expected if k not in loaded and k.rsplit(".", 1)[-1] != _EXTRA_SUFFIX]
    unexpected = [k for k in loaded if k not in expected]
    if strict and (missing or unexpected):
        raise KeyError(f"load_safetensors: {where} does not match the model: missing {missing}, "
                       f"unexpected {unexpected}. Pass strict=False to load the entries both have.")
    for key, value in loaded.items():
        if key in expected:
            _check_entry(key, value, expected[key], where)
    sd = {k: v for k, v in loaded.items() if k in expected}
    return model.load_state_dict(sd, strict=False)


def _format(t: QuantizedTensor) -> tuple:
    s = t.qstorage
    return (type(s).__name__, tuple(s.shape), s.directions(),
            tuple((d, s.part(d).format_key(d)) for d in s.directions()))


def _check_entry(key: str, value: Any, target: Any, where: str) -> None:
    """``value`` (from the file) can be loaded into ``target`` (the model's entry) as it is."""
    what = f"load_safetensors: {where}: entry {key!r}"
    if key.rsplit(".", 1)[-1] == _EXTRA_SUFFIX:
        return  # set_extra_state checks it
    if isinstance(target, QuantizedTensor):
        if not isinstance(value, QuantizedTensor):
            raise ValueError(f"{what} holds a plain {value.dtype} tensor but the model holds a quantized "
                             f"{target.qstorage.describe()}; build the model without quantized_model_init, "
                             "or save from a model with quantized weights.")
        if _format(value) != _format(target):
            raise ValueError(f"{what} holds {_format(value)}; the model holds {_format(target)}. Build the "
                             "model under quantized_model_init with the recipe the file was saved with.")
    elif isinstance(target, torch.Tensor):
        if isinstance(value, QuantizedTensor):
            raise ValueError(f"{what} holds a quantized {value.qstorage.describe()} but the model holds a "
                             "plain tensor; build the model under quantized_model_init with the saved recipe.")
        if value.dtype != target.dtype or value.shape != target.shape:
            raise ValueError(f"{what} has dtype {value.dtype} and shape {tuple(value.shape)}; the model "
                             f"expects {target.dtype} and {tuple(target.shape)}.")
