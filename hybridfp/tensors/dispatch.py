"""``__torch_dispatch__`` handlers of :class:`QuantizedTensor`.

Handled natively (no dequantization): detach, alias, clone, ``_to_copy`` (device moves, pinned
memory, nominal dtype), pin_memory, ``copy_``, views/reshapes that keep the last dimension,
split / slice along dim 0 at block boundaries, new_zeros / new_empty / empty_like /
zeros_like, zero_. Everything else dequantizes, runs in high precision and warns once per op;
in-place ops on a quantized tensor re-quantize the result into it through its quantizer.
A write through a dim-0 slice, split piece, view or detached alias reaches what is kept for
the tensor it was made from, and for each tensor that one was made from in turn (also once the
tensors between are gone, as in ``w[0:32].detach()``): their cached BF16 decodes see it, and
their kept initial high-precision values take the rows written.

The wrapper reports contiguous strides and storage offset 0 over its own elements, so ops
that read memory layout (``as_strided``) get the value in that layout: row-major, in memory of
its own (a columnwise copy decodes transposed; an Identity slice is a view into a larger
tensor), and a view reaching outside the tensor is a clear error.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_map

from ..utils.rewrites import note_rewrite
from .hybrid import HybridStorage
from .identity import IdentityStorage
from .quantized_tensor import _TENSOR_DATA, FALLBACK, PARAM_NAME_ATTR, QuantizedTensor, implements
from .storage import DIRECTIONS, MissingDirectionError, QuantizedStorage

aten = torch.ops.aten
_WARNED: set[str] = set()
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KEPT = "_high_precision_init_val"

#: The attribute of a tensor made by the handlers below over another one's payload memory
#: (dim-0 slice / split, view, detach / alias) holding its :class:`_ViewOf`.
_VIEW_ATTR = "_hybridfp_view_of"


class _ViewOf:
    """What a view covers of each tensor it was made from (directly or through others) that
    keeps an initial value: ``(that tensor's __dict__, first element, end element)``, the
    elements in its row-major order, nearest first. A write through the view moves each one's
    kept value by it.

    The tensors' ``__dict__`` is held, not the tensors: a weak reference to a Parameter makes
    ``torch.utils.swap_tensors`` refuse it, and ``swap_tensors`` moves the ``__dict__`` with the
    payload memory, which is what a write through the view reaches. The whole chain is recorded
    when the view is made: a detached alias does not keep its source alive, so in
    ``w[0:32].detach()`` the slice between is gone by the time of a write. A deep copy (new
    memory) records nothing."""

    __slots__ = ("chain",)

    def __init__(self, chain: tuple[tuple[dict, int, int], ...]) -> None:
        self.chain = chain

    def __deepcopy__(self, memo: dict) -> "_ViewOf":
        return _ViewOf(())


def _view_chain(t: QuantizedTensor) -> tuple[tuple[dict, int, int], ...]:
    """``t``'s recorded chain (:class:`_ViewOf`), empty for a tensor made otherwise."""
    held = t.__dict__.get(_VIEW_ATTR)
    return held.chain if held is not None else ()


def _wrap(storage: QuantizedStorage, like: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(storage, like._quantizer)


def _wrap_view(storage: QuantizedStorage, of: QuantizedTensor, start: int = 0,
               end: Optional[int] = None) -> QuantizedTensor:
    """``_wrap`` for a tensor over ``of``'s payload memory covering its elements [start, end)."""
    out = _wrap(storage, of)
    end = of.numel() if end is None else end
    # of's element i is element s + i of each tensor of was made from; only those keeping a
    # value are recorded, so a chain of aliases of aliases (x = x.detach() in a loop) stays short
    chain = [(of.__dict__, start, end)] if _KEPT in of.__dict__ else []
    chain += [(d, s + start, s + end) for d, s, _ in _view_chain(of)]
    if chain:
        out.__dict__[_VIEW_ATTR] = _ViewOf(tuple(chain))
    return out


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    (t,) = args
    return _wrap_view(t._storage.map_tensors(lambda x: x), t)


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    t = args[0]
    return _wrap(t._storage.map_tensors(torch.clone, copies=True), t)


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if dtype not in _FLOAT_DTYPES:
        return _fallback(func, args, kwargs)
    device = kwargs.get("device")
    pin = kwargs.get("pin_memory") or False
    non_blocking = kwargs.get("non_blocking", False)

    def move(x: torch.Tensor) -> torch.Tensor:
        y = x.to(device=device, non_blocking=non_blocking, copy=True) if device is not None else x.clone()
        return y.pin_memory() if pin else y

    storage = t._storage.map_tensors(move, copies=True)
    if dtype != t.dtype:  # only the nominal dtype changes: the encoded values do not
        storage = storage._new(storage.shape, dict(storage.payloads), dtype)
    out = _wrap(storage, t)
    kept = t.__dict__.get(_KEPT)
    if kept is not None:
        # the copy holds the same value, so it was initialised with the same one: Module.to() /
        # .cuda() / .half() hand this copy to the Parameter (``QuantizedTensor.data``'s setter,
        # or torch.utils.swap_tensors), whose masters are later seeded from what it keeps. Cast
        # to the new nominal dtype, as the weights of a plain model.to(dtype) are; on the CPU
        # as always (a kept value never stands in GPU memory). Never written in place: shared.
        out.__dict__[_KEPT] = kept if kept.dtype == dtype else kept.to(dtype)
    return out


@implements(aten._pin_memory.default)
def _pin(func, args, kwargs):
    t = args[0]
    return _wrap(t._storage.map_tensors(lambda x: x.pin_memory(), copies=True), t)


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    return all(x.is_pinned() for x in args[0]._storage.tensors())


def assign_data(dst: QuantizedTensor, new: torch.Tensor) -> None:
    """``dst.data = new`` (``QuantizedTensor.data``'s setter): ``dst`` becomes ``new``, as torch's
    ``.data =`` makes a tensor alias another's memory, the payloads included.

    ``nn.Module._apply`` (``.to(device)``, ``.cuda()``, ``.to(dtype)``, ``.half()``) assigns the
    converted copy so, as do EMA swaps and ``torch.nn.utils.vector_to_parameters``. torch's
    ``set_data`` only knows the wrapper's C++ metadata (shape, dtype, device); the payloads are
    Python attributes it cannot see, so without this the Parameter would report the new dtype
    and device and keep encoding, and GEMMs would read, the old payloads.

    ``dst`` takes ``new``'s payloads (a storage object of its own over the same tensors, as
    ``detach()`` makes: dropping a copy from one leaves the other's) and its quantizer (``dst``'s
    own stays when ``new`` has none, e.g. loaded from a file, and is of ``dst``'s format). Its kept
    initial high-precision value becomes ``new``'s when ``new`` keeps one (a ``.to()`` copy keeps
    its source's, cast), else, when ``dst`` kept one and ``new`` lies in other memory (not
    ``dst.data``), ``new``'s value (as ``copy_`` of a quantized source leaves it: masters seeded
    from it start where ``dst`` now is, not at another tensor's initial value that its optimizer
    steps since may have left behind). A write through ``dst`` then reaches the kept
    values of what ``new`` is a slice / view of (``new = w.data``: ``w``'s). ``dst``'s version
    counter, autograd state and other attributes (its name) stay.

    Parameters
    ----------
    dst:
        The tensor (usually a Parameter) assigned to.
    new:
        A QuantizedTensor (any format, shape, nominal dtype or device torch's ``set_data``
        accepts).

    Raises
    ------
    TypeError
        ``new`` is not a QuantizedTensor: a quantized tensor cannot alias a plain tensor's memory,
        and re-quantizing it instead would silently break ``.data``'s aliasing (code writing the
        assigned tensor afterwards, as flat-buffer optimizers do, would no longer reach ``dst``).
        The message names ``param.copy_(t)`` (re-quantize a value in), ``quantizer.quantize(t)``
        and replacing the Parameter.
    RuntimeError
        torch's own, when ``set_data`` refuses the pair (e.g. a meta tensor into a CPU one);
        ``dst`` is then unchanged.
    """
    if not isinstance(new, QuantizedTensor):
        raise TypeError(_plain_data_message(dst, new))
    if new is dst:
        return
    _TENSOR_DATA.__set__(dst, new)  # first: when torch refuses, nothing below has changed
    old_storage = dst._storage
    dst._storage = new._storage.map_tensors(lambda x: x)
    if new._quantizer is not None:
        dst._quantizer = new._quantizer
    elif not _same_format(old_storage, new._storage):
        dst._quantizer = None  # another format's quantizer would encode the wrong layout into it
    own = dst.__dict__
    if _KEPT in new.__dict__:
        own[_KEPT] = new.__dict__[_KEPT]  # never written in place: shared, as swap_tensors would move it
    elif _KEPT in own and _payload_memory(new._storage) != _payload_memory(old_storage):
        # another value (p.data = p.data, p.detach(): the same one, whose kept value stays)
        own[_KEPT] = new.dequantize().detach().to("cpu", copy=True)
    # dst now covers new's memory, so a write through it reaches the kept values of what new is a
    # view of (new's recorded chain), no longer what dst covered before. Not new's own kept value
    # (dst took it over, as swap_tensors moves the __dict__: recording new too would keep a second
    # value, usually of a dead temporary, alive and rewritten), nor dst's (written as its own).
    chain = tuple(c for c in _view_chain(new) if c[0] is not own)
    own.pop(_VIEW_ATTR, None)
    if chain:
        own[_VIEW_ATTR] = _ViewOf(chain)


def _same_format(a: QuantizedStorage, b: QuantizedStorage) -> bool:
    """Whether storages ``a`` and ``b`` are of one format: same class and, for every copy ``b``
    holds, the same format key (a hybrid's absent part counts as another format)."""
    if type(a) is not type(b):
        return False
    return all(_copy_format(a, d) is not None and _copy_format(a, d) == _copy_format(b, d)
               for d in b.directions())


def _plain_data_message(dst: QuantizedTensor, new: object) -> str:
    """The TypeError :func:`assign_data` raises for a value that is not a QuantizedTensor."""
    kind = "quantized Parameter" if getattr(dst, "_is_param", False) else "QuantizedTensor"
    owner = dst.__dict__.get(PARAM_NAME_ATTR)
    name = f"{owner + ', a ' if owner else 'a '}{kind} ({dst._storage.describe()})"
    if not isinstance(new, torch.Tensor):
        return (f"hybridfp: cannot assign {type(new).__name__} to .data of {name}: .data takes a "
                "tensor (a QuantizedTensor for a quantized one).")
    if new.dtype not in _FLOAT_DTYPES:
        # Module.double() / .to(torch.float64) reach here: _to_copy dequantizes to a dtype no
        # quantized tensor can take as its nominal dtype
        return (f"hybridfp: cannot make {name} a {new.dtype} tensor (.data = a plain {new.dtype} "
                f"tensor, as Module.double() / .to({new.dtype}) assign): a quantized tensor's nominal dtype "
                "is float32, bfloat16 or float16, and the conversion would dequantize it. Convert the "
                "module to one of those, or replace the Parameter by its high-precision value first: "
                f"`module.weight = torch.nn.Parameter(module.weight.dequantize().to({new.dtype}))`.")
    return (f"hybridfp: cannot assign a plain {new.dtype} tensor of shape {tuple(new.shape)} to .data "
            f"of {name}: .data = makes a tensor alias the assigned one's memory, which a quantized "
            "tensor cannot do with a plain one (quantizing a copy instead would silently drop the "
            "aliasing). To write the value in, re-quantized by the tensor's quantizer: "
            "`with torch.no_grad(): param.copy_(t)` (from FP32 master weights: "
            "hybridfp.quantize_master_weights(params, masters)). To assign a quantized value: "
            "`param.data = param.quantizer.quantize(t)`. To make the weight high precision again, "
            "replace the Parameter: `module.weight = torch.nn.Parameter(t)`.")


def _mark_written(t: QuantizedTensor, value: Callable[[], torch.Tensor]) -> None:
    """Record that ``t``'s payloads were written in place below autograd.

    Inside ``__torch_dispatch__`` torch does not bump the payload tensors' version counters, and
    caches keyed on them (``gemm.bf16_decode``'s decodes) would serve the old value: bump them
    here. A slice, split piece or view made here shares its tensor's payload memory but not its
    version counters, so the write is also noted on the memory itself
    (``utils.rewrites.note_rewrite``), which the tensor's cache keys see.

    A kept initial value (``preserve_high_precision_init_val``) follows the new value
    (``value()``, called only then, kept on the CPU), so masters seeded from it start where the
    tensor now is: ``t``'s own, and the rows ``t`` covers of the kept value of every tensor it is
    a slice / view of.
    """
    for x in t._storage.tensors():
        if not x.is_inference():  # inference tensors keep no version counter
            torch.autograd.graph.increment_version(x)
        note_rewrite(x)
    if _KEPT in t.__dict__:
        t.__dict__[_KEPT] = value().detach().to("cpu", copy=True)
    _write_kept_of_bases(t, value)


def _payload_memory(storage: QuantizedStorage) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in storage.tensors()}


def _write_kept_of_bases(t: QuantizedTensor, value: Callable[[], torch.Tensor]) -> None:
    """Write ``value()`` into the elements ``t`` covers of the kept initial value of each tensor
    ``t`` is a slice / view of (directly or through others, alive or not)."""
    flat: Optional[torch.Tensor] = None
    memory: Optional[set[int]] = None
    for base, start, end in _view_chain(t):
        if _KEPT not in base:
            continue  # cleared since: the tensors it was made from still take the write
        memory = _payload_memory(t._storage) if memory is None else memory
        if not memory <= _payload_memory(base["_storage"]):
            continue  # the base's payloads were replaced since: t no longer writes its memory
        kept = base[_KEPT]
        if kept.numel() != base["_storage"].shape.numel():  # another shape: it no longer describes base
            del base[_KEPT]
            continue
        if flat is None:
            flat = value().detach().reshape(-1).to("cpu")
        # a new tensor: a kept value handed out before stays as it was
        new = kept.detach().clone(memory_format=torch.contiguous_format)
        new.view(-1)[start:end] = flat
        base[_KEPT] = new


@implements(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):  # high-precision destination
        return dst.copy_(src.dequantize(dst.dtype))
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_ shape mismatch: {tuple(src.shape)} into {dst._storage.describe()}.")
    if isinstance(src, QuantizedTensor):
        _check_copies_held(dst._storage, src._storage)
        try:
            dst._storage.copy_payload_(src._storage.map_tensors(lambda x: x.to(dst.device)))
        except (ValueError, RuntimeError):
            src = src.dequantize(dst.dtype)  # another format: re-quantize its value
        else:
            # not src's kept initial value: src may have been stepped since it was kept
            _mark_written(dst, lambda: src.dequantize(dst.dtype))
            return dst
    if _aliases_payload(src, dst._storage):
        # dst's own memory (e.g. an Identity copy's dequantize()): re-quantizing overwrites it
        # before the kept initial value takes src's value
        src = src.clone(memory_format=torch.contiguous_format)
    _requantize_into(dst, src)
    _mark_written(dst, lambda: src.to(dst.dtype))
    return dst


def _copy_format(s: QuantizedStorage, direction: str):
    """The format key of ``s``'s ``direction`` copy, held or not (None: a hybrid's absent part,
    whose format is unknown)."""
    if isinstance(s, HybridStorage):
        part = s.parts[direction]
        return None if part is None else part.format_key(direction)
    return type(s).key_for(direction, s.meta)


def _check_copies_held(dst: QuantizedStorage, src: QuantizedStorage) -> None:
    """Refuse ``dst.copy_(src)`` of one format when ``src`` lacks a copy ``dst`` holds.

    Copying would have to re-quantize that copy from the value of another one (a second
    quantization, e.g. the columnwise blocks from the rowwise-rounded values), which is not a
    copy. Tensors of different formats are re-quantized from the source's value by design;
    Identity holds one tensor for both copies, so either serves.
    """
    missing = [d for d in dst.directions() if not src.has(d)]
    if not missing or (isinstance(dst, IdentityStorage) and isinstance(src, IdentityStorage)):
        return
    keys = [(_copy_format(dst, d), _copy_format(src, d)) for d in DIRECTIONS]
    if any(a is not None and b is not None and a != b for a, b in keys):
        return  # another format: its value is re-quantized
    held = " and ".join(src.directions())
    holds, value = (f"only its {held}", f"the source's {held} value") if held else ("no", "nothing")
    raise MissingDirectionError(
        f"copy_: the source {src.describe()} holds {holds} copy; the destination {dst.describe()} "
        f"also holds its {' and '.join(missing)} copy, which copying would have to re-quantize "
        f"from {value} (a second quantization). Quantize the source with the copies the destination holds "
        f"(quantizer.set_usage({missing[0]}=True)), drop them from the destination first "
        f"(dst.update_usage({missing[0]}_usage=False)), or copy a high-precision value "
        "explicitly (dst.copy_(src.dequantize())) to re-quantize it.")


def _requantize_into(dst: QuantizedTensor, src: torch.Tensor) -> None:
    dst._storage.check_writable()  # before the quantizer runs (delayed scaling records amax)
    if dst._quantizer is None:
        raise RuntimeError(
            f"cannot write high-precision values into {dst._storage.describe()}: it has no "
            "quantizer (e.g. it was loaded from a checkpoint). Call tensor.set_quantizer(q) "
            "first, or dequantize it."
        )
    # torch's copy_: dst takes src's value in every copy it holds, whatever the usage is now
    dst._quantizer.update_quantized(src.to(dst.device), dst, directions=dst.directions())


@implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    t, size = args[0], args[1]
    shape = torch.empty(t.shape, device="meta").view(size).shape
    return _wrap_view(t._storage.view_leading(shape), t)


def _dim0(t: QuantizedTensor, dim: int) -> bool:
    return dim % max(t.dim(), 1) == 0


def _per_entry(t: QuantizedTensor) -> int:
    """Elements per dim-0 entry of ``t``."""
    return math.prod(t.shape[1:])


@implements(aten.split.Tensor)
def _split(func, args, kwargs):
    t, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not _dim0(t, dim):
        return _fallback(func, args, kwargs)
    n = t.shape[0]
    starts = range(0, n, size) or [0]  # torch returns one empty piece for an empty dim
    per = _per_entry(t)
    return [_wrap_view(t._storage.slice_dim0(s, min(s + size, n)), t, s * per, min(s + size, n) * per)
            for s in starts]


@implements(aten.split_with_sizes.default)
def _split_sizes(func, args, kwargs):
    t, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not _dim0(t, dim):
        return _fallback(func, args, kwargs)
    if sum(sizes) != t.shape[0]:
        raise ValueError(f"split sizes {list(sizes)} do not sum to dim 0 ({t.shape[0]}).")
    out, s, per = [], 0, _per_entry(t)
    for k in sizes:
        out.append(_wrap_view(t._storage.slice_dim0(s, s + k), t, s * per, (s + k) * per))
        s += k
    return out


@implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if not _dim0(t, dim) or step != 1:
        return _fallback(func, args, kwargs)
    n = t.shape[0]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    storage = t._storage.slice_dim0(start, end)
    start = max(0, min(start, n))  # the entries the slice holds (slice_dim0 clamps as torch does)
    per = _per_entry(t)
    return _wrap_view(storage, t, start * per, start * per + storage.shape[0] * per)


def _allocate_like(t: QuantizedTensor, shape, kwargs, fill) -> torch.Tensor:
    storage = t._storage.allocate_like(torch.Size(shape), kwargs.get("dtype") or t.dtype, fill,
                                       kwargs.get("device"))
    if kwargs.get("pin_memory"):
        storage = storage.map_tensors(lambda x: x.pin_memory())
    out = QuantizedTensor(storage, t._quantizer)
    owner = _trained_name(t)
    if owner is not None:  # an optimizer's state of a quantized parameter: refuses updates too
        setattr(out, PARAM_NAME_ATTR, owner if owner.startswith("optimizer state") else f"optimizer state of {owner}")
    return out


@implements(aten.new_zeros.default, aten.new_empty.default)
def _new_factory(func, args, kwargs):
    t, size = args[0], args[1]
    if (kwargs.get("dtype") or t.dtype) not in _FLOAT_DTYPES:
        return func(t.dequantize(), size, **kwargs)
    return _allocate_like(t, size, kwargs, 0.0 if func is aten.new_zeros.default else None)


@implements(aten.empty_like.default, aten.zeros_like.default)
def _like(func, args, kwargs):
    t = args[0]
    if (kwargs.get("dtype") or t.dtype) not in _FLOAT_DTYPES:
        return func(t.dequantize(), **kwargs)
    return _allocate_like(t, t.shape, kwargs, 0.0 if func is aten.zeros_like.default else None)


def _dense(t: QuantizedTensor) -> torch.Tensor:
    """``t``'s value as the wrapper presents it: row-major, offset 0, in memory of its own (a
    columnwise copy decodes transposed; an Identity slice is a view into its parent).

    Never ``t``'s payload memory: an Identity copy (plain, or a hybrid's high-precision side)
    dequantizes to its own data tensor, and an in-place op run on that would write the payload
    directly; re-quantizing its result into ``t`` then overwrites that same memory (with a
    ``rowwise_dequantized`` hybrid: the rounded rowwise value), so the value the op wrote, which
    a kept initial value must take, would be lost, and a view returned by a fallback op would
    write one copy of ``t`` only."""
    v = t.dequantize()
    owned = (v.is_contiguous() and v.storage_offset() == 0
             and v.untyped_storage().nbytes() == v.numel() * v.element_size()
             and not _aliases_payload(v, t._storage))
    return v if owned else v.clone(memory_format=torch.contiguous_format)


def _aliases_payload(x: torch.Tensor, storage: QuantizedStorage) -> bool:
    """Whether ``x`` lies in the memory of one of ``storage``'s payload tensors."""
    return x.numel() > 0 and x.untyped_storage().data_ptr() in _payload_memory(storage)


def _check_strided_view(t: QuantizedTensor, size, stride, offset: int) -> None:
    """Raise unless the view (size, stride, offset) stays inside ``t``'s own elements."""
    if offset < 0 or any(s < 0 for s in stride) or len(size) != len(stride):
        raise ValueError(f"as_strided of {t._storage.describe()}: size {list(size)}, stride "
                         f"{list(stride)}, offset {offset} is not a valid view.")
    if any(n == 0 for n in size):
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= t.numel():
        raise ValueError(
            f"as_strided of {t._storage.describe()}: size {list(size)}, stride {list(stride)}, "
            f"offset {offset} reaches element {last}, outside the tensor's {t.numel()} elements "
            f"({' x '.join(map(str, t.shape))}). A QuantizedTensor (a slice too) has memory of its "
            "own: offsets count from its first element (its storage_offset() is 0).")


@implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    t, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    offset = 0 if offset is None else offset
    _check_strided_view(t, size, stride, offset)
    if offset == 0 and tuple(size) == tuple(t.shape) and tuple(stride) == tuple(t.stride()):
        return _wrap_view(t._storage.map_tensors(lambda x: x), t)  # the whole tensor (FSDP2 views it so)
    _warn_once(func)
    return _dense(t).as_strided(size, stride, offset)


@implements(aten.zero_.default)
def _zero(func, args, kwargs):
    args[0]._storage.zero_()
    _mark_written(args[0], lambda: torch.zeros(args[0].shape, dtype=args[0].dtype))
    return args[0]


def _mutated_quantized(func, args, kwargs) -> list[QuantizedTensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, QuantizedTensor):
            out.append(v)
    return out


def _warn_once(func) -> None:
    """Say once per op that it dequantizes its QuantizedTensor operands."""
    name = str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func)
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"hybridfp: aten.{name} has no quantized implementation; the QuantizedTensor "
            "operands are dequantized and the op runs in high precision.", stacklevel=4)


def _trained_name(t: QuantizedTensor) -> Optional[str]:
    """How messages name ``t`` if it is a parameter (or optimizer state made from one), else None."""
    name = t.__dict__.get(PARAM_NAME_ATTR)
    if name is not None:
        return name
    return f"parameter {t._storage.describe()}" if getattr(t, "_is_param", False) else None


def _written_quantized(func, args, kwargs) -> list[QuantizedTensor]:
    """The QuantizedTensors ``func`` writes, lists of tensors (``_foreach_*``, fused optimizers) included."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        out += [x for x in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(x, QuantizedTensor)]
    return out


#: In-place ops that set a value rather than update one (initialisation): re-quantized as usual.
_VALUE_SETTERS = frozenset({"fill_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_"})


def _is_value_setter(func) -> bool:
    return (func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)) in _VALUE_SETTERS


def _refuse_trained_update(func, args, kwargs) -> None:
    """An in-place op other than a copy on a quantized parameter (or on optimizer state made from
    one with ``zeros_like``) is an optimizer step applied to the quantized values: each update would
    be rounded away or land on a stale scale and training diverges silently. Refuse it."""
    if _is_value_setter(func):
        return
    op = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    for t in _written_quantized(func, args, kwargs):
        name = _trained_name(t)
        if name is not None:
            raise RuntimeError(
                f"hybridfp: in-place aten.{op} on {name} ({t._storage.describe()}), a quantized "
                "parameter: an optimizer cannot update quantized weights in place (the update is "
                "rounded into the low-precision format and its state would be quantized too). Train "
                "quantized parameters with FP32 master weights: hybridfp.MasterWeightOptimizer("
                "torch.optim.AdamW, model.parameters(), ...), or step FP32 masters yourself and call "
                "hybridfp.quantize_master_weights(model_params, master_params).")


def _fallback(func, args, kwargs):
    _refuse_trained_update(func, args, kwargs)
    _warn_once(func)
    mutated = _mutated_quantized(func, args, kwargs)
    deq = {id(t): _dense(t) for t in mutated}
    unwrap = lambda x: (deq.get(id(x)) if id(x) in deq else _dense(x)) if isinstance(x, QuantizedTensor) else x
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    for t in mutated:  # write the high-precision result back by re-quantizing
        if _is_value_setter(func) and t._quantizer is not None and getattr(t, "_is_param", False):
            # a parameter initialised anew (nn.init after quantized_model_init): what its quantizer
            # recorded of the value it replaces (delayed scaling's pending amax) goes with it
            t._quantizer.discard_step()
        _requantize_into(t, deq[id(t)])
        _mark_written(t, lambda: deq[id(t)])  # e.g. nn.init after creation: a kept initial value follows it
    if mutated and out is not None:
        return mutated[0] if len(mutated) == 1 else out
    return out


FALLBACK.append(_fallback)
