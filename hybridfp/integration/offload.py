"""CPU offload of the tensors layers save for backward (TransformerEngine's
``get_cpu_offload_context``).

Each layer's forward runs inside the returned context, and its output goes through the returned
``sync_function``::

    context, sync_function = hybridfp.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4)
    for layer in layers:
        with context:
            x = layer(x)
        x = sync_function(x)

The context is a ``torch.autograd.graph.saved_tensors_hooks`` pair. hybridfp modules save their
quantized copies as plain payload tensors (codes and scales), so the hooks move those bytes as
they are, never a dequantized copy, and backward reads back exactly what it would have read:
gradients are bitwise those without offload. What moves: plain strided tensors of at least
``min_tensor_size_to_offload`` elements saved by the first ``num_layers`` layers; what stays in
place: parameters and other leaves that require grad, and views of them (their owner holds
them anyway), tensors marked with :func:`mark_not_offload` and views of them (hybridfp marks
its quantized weights' payloads, held by the weight cache or, for ``quantized_model_init``
weights, by the parameter: a module marks its parameter's, or its experts', when it reads
them, in compiled calls too), smaller tensors, views with gaps, tensor subclasses.

No module hook is involved (torch.compile guards on the process-wide hooks: one added per
entry would recompile a compiled caller at every entry). The saved-tensor hooks are never
traced by torch.compile (a module compiled in place calls them from its compiled frame).

Schedule (TE's): a tensor's copy to pinned host memory starts on a side CUDA stream when it is
saved; layer ``i``'s copies are waited for and its device tensors dropped when layer
``model_layers - num_layers + i`` starts its forward, so at most ``model_layers - num_layers``
layers keep their activations on the device. In backward (``sync_function`` registers a hook on
each layer's output), layer ``i``'s copies back start when the backward reaches layer
``model_layers - 1 - num_layers + i``, and the reloaded tensors of layers whose backward is done
are dropped. A tensor needed before its reload started is copied back at once. Tensors on the
CPU take the same path synchronously (a copy into a separate buffer): what CI tests.

Each pass of ``model_layers`` layers is its own ``OffloadIteration``, held by the autograd
graph, so several forwards may precede one backward. A layer whose forward raises (a bad batch
the caller skips) ends its pass: the next entry starts a new one, and the failed pass's offloads
are finished (its partial graph, if kept, holds host copies only).

In-place check: with saved-tensor hooks autograd no longer checks that a saved tensor was not
modified in place before backward reads it (the hooks own what is saved), and an offloaded
tensor's host copy would silently give backward the old values. So every tensor saved inside
the context (offloaded or not) is saved with its version counter's value, and backward raises
autograd's "modified by an inplace operation" error when the counter moved. An offloaded tensor
is checked through an alias that shares its version counter but not its memory (see
``_version_alias``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..nn.base import NOT_OFFLOADED, mark_not_offload

__all__ = ["CpuOffloadContext", "OffloadStats", "get_cpu_offload_context", "mark_not_offload"]

#: TE's default threshold (elements): smaller tensors are not worth a transfer.
DEFAULT_MIN_TENSOR_SIZE_TO_OFFLOAD = 2**20


@dataclass
class OffloadStats:
    """Counters of what a context moved (cumulative; ``reset()`` zeroes them).

    ``offloaded_*``: tensors (and bytes) copied to the host in forward; ``kept_*``: tensors the
    offloaded layers saved that stayed in place (parameters, marked, small, not dense, subclasses);
    ``reloaded_*``: copies back to the device; ``late_reloads``: of those, copies made when the
    tensor was needed (no prefetch had started).
    """

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    kept_tensors: int = 0
    kept_bytes: int = 0
    reloaded_tensors: int = 0
    reloaded_bytes: int = 0
    late_reloads: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _version_of(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter's value; None for an inference tensor (it keeps none; autograd
    refuses to save one, so this is only a guard)."""
    return None if t.is_inference() else t._version


def _version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor of no elements sharing ``t``'s version counter but not its memory: what an
    offloaded tensor is checked through once its device tensor is dropped. ``detach()`` shares
    the counter (and the memory); assigning ``.data`` swaps the memory and keeps the counter,
    without moving it. A weak reference to ``t`` would not do: the tensor usually dies (the next
    layer's input, reassigned) while a write through it, or a view of it, already happened."""
    alias = t.detach()
    alias.data = alias.new_empty(0)
    return alias


def _check_version(source: torch.Tensor, saved: Optional[int], size: Optional[torch.Size] = None) -> None:
    """Autograd's check of a saved tensor, which saved-tensor hooks turn off: raise when
    ``source`` (the saved tensor, or an alias sharing its version counter: then ``size`` is the
    saved tensor's) was modified in place since it was saved at version ``saved``."""
    if saved is None:
        return
    now = source._version
    if now != saved:
        size = source.size() if size is None else size
        raise RuntimeError(
            f"hybridfp CPU offload: one of the variables needed for gradient computation has been modified by "
            f"an inplace operation: [{source.type()} {list(size)}], saved for backward inside the CPU offload "
            f"context, is at version {now}; expected version {saved} instead (under the context's saved-tensor "
            "hooks autograd does not check this itself, and an offloaded tensor's host copy would give backward "
            "the old values). Hint: enable anomaly detection to find the operation that failed to compute its "
            "gradient, with torch.autograd.set_detect_anomaly(True).")


class _Kept:
    """A tensor saved inside the context that stays in place, with its version when saved."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, _version_of(t)

    def get(self) -> torch.Tensor:
        """The tensor for backward (raises if it was modified in place since it was saved)."""
        _check_version(self.tensor, self.version)
        return self.tensor


class _Streams:
    """The side stream of a device and the ordering between it and the current stream; on the
    CPU every method is a no-op and copies are synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def side_after_current(self) -> contextlib.AbstractContextManager:
        """A block run on the side stream, ordered after the work queued so far."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.side)

    def record(self) -> Optional[torch.cuda.Event]:
        return self.side.record_event() if self.cuda else None

    def wait(self, event: Optional[torch.cuda.Event]) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class _Moved:
    """One offloaded tensor: its host copy, and its device tensor until the offload finished or
    its reload once started; its version when saved, checked in backward on the device tensor
    or, once that is dropped, on ``alias`` (:func:`_version_alias`)."""

    __slots__ = ("group", "device", "size", "stride", "device_tensor", "host", "reloaded", "version", "alias")

    def __init__(self, group: "_Group", t: torch.Tensor, host: torch.Tensor) -> None:
        self.group, self.device, self.size, self.stride = group, t.device, t.size(), t.stride()
        self.device_tensor: Optional[torch.Tensor] = t
        self.host, self.reloaded = host, None
        self.version, self.alias = _version_of(t), None

    def drop_device_tensor(self) -> None:
        """Its offload finished: keep only the host copy (and the alias the check reads)."""
        if self.device_tensor is not None:
            if self.version is not None:
                self.alias = _version_alias(self.device_tensor)
            self.device_tensor = None

    def _copy_back(self) -> torch.Tensor:
        t = torch.empty_strided(self.size, self.stride, dtype=self.host.dtype, device=self.device)
        return t.copy_(self.host, non_blocking=self.host.is_pinned())

    def get(self) -> torch.Tensor:
        """The tensor for backward (waits for its prefetch; copies it back if none started).
        Raises if it was modified in place since it was saved."""
        _check_version(self.device_tensor if self.device_tensor is not None else self.alias, self.version,
                       self.size)
        if self.device_tensor is not None:  # its offload has not finished: never left the device
            return self.device_tensor
        if self.reloaded is not None:
            self.group.streams.wait(self.group.reload_event)
            return self.reloaded
        stats = self.group.iteration.stats
        stats.late_reloads += 1
        stats.reloaded_tensors += 1
        stats.reloaded_bytes += _nbytes(self.host)
        return self._copy_back()


@dataclass
class _Group:
    """The tensors one layer moved in one iteration."""

    iteration: "OffloadIteration"
    streams: _Streams
    moved: list = field(default_factory=list)
    by_id: dict = field(default_factory=dict)  # during the layer's forward: id -> _Moved (one copy each)
    offload_event: Any = None
    reload_event: Any = None

    def finish_offload(self) -> None:
        """Wait for the copies to the host; drop the device tensors."""
        self.streams.wait(self.offload_event)
        for m in self.moved:
            m.drop_device_tensor()
        self.by_id.clear()

    def start_reload(self) -> None:
        """Copy the host tensors back on the side stream (those still on the device need none)."""
        todo = [m for m in self.moved if m.device_tensor is None and m.reloaded is None]
        if not todo:
            return
        outs = [torch.empty_strided(m.size, m.stride, dtype=m.host.dtype, device=m.device) for m in todo]
        with self.streams.side_after_current():
            for m, out in zip(todo, outs):
                m.reloaded = out.copy_(m.host, non_blocking=m.host.is_pinned())
        self.reload_event = self.streams.record()
        stats = self.iteration.stats
        stats.reloaded_tensors += len(todo)
        stats.reloaded_bytes += sum(_nbytes(m.host) for m in todo)

    def release_reloaded(self) -> None:
        """Drop the reloaded device tensors (a later need copies them back again). Their memory
        belongs to the current stream, which first waits for the side stream's writes into it."""
        if any(m.reloaded is not None for m in self.moved):
            self.streams.wait(self.reload_event)
        for m in self.moved:
            m.reloaded = None


class OffloadIteration:
    """One pass of ``model_layers`` layers through the context and its backward."""

    def __init__(self, context: "CpuOffloadContext") -> None:
        self.context, self.stats = context, context.stats
        self.layer = -1
        self.groups: dict[int, _Group] = {}
        self.streams: Optional[_Streams] = None
        self._callback_task: Optional[int] = None  # the backward whose end callback is queued

    def group(self, t: torch.Tensor) -> _Group:
        if self.streams is None:
            self.streams = _Streams(t.device)
        return self.groups.setdefault(self.layer, _Group(self, self.streams))

    def forward_step(self) -> None:
        """A layer starts its forward: finish the offloads due now."""
        self.layer += 1
        for i in self.context.finish_offload_at.get(self.layer, ()):
            if i in self.groups:
                self.groups[i].finish_offload()

    def backward_step(self, layer: int) -> None:
        """The backward reaches ``layer``'s output: drop the reloads of the layers done, start
        the reloads due now (and, once per backward, drop every reload when it ends)."""
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
        for i, g in self.groups.items():
            if i > layer:
                g.release_reloaded()
        for i in self.context.start_reload_at.get(layer, ()):
            if i in self.groups:
                self.groups[i].start_reload()

    def backward_done(self) -> None:
        for g in self.groups.values():
            g.release_reloaded()

    def abandon(self) -> None:
        """The pass's forward raised: finish every offload started. A partial graph still alive
        (a traceback kept) then holds host copies only (its backward reloads them late), and
        the device tensors are freed only once the side stream has read them."""
        for g in self.groups.values():
            g.finish_offload()


class CpuOffloadContext:
    """The context of :func:`get_cpu_offload_context` (enter it around each layer's forward).

    When a layer's forward raises inside it, the pass ends there: the next entry starts a new
    pass at layer 0 (the caller skipped the batch), with no ``sync_function`` call owed."""

    def __init__(self, num_layers: int, model_layers: int, min_tensor_size_to_offload: int) -> None:
        self.num_layers, self.model_layers = num_layers, model_layers
        self.min_tensor_size_to_offload = min_tensor_size_to_offload
        self.stats = OffloadStats()
        #: forward step -> layers whose offload finishes then; backward step -> reloads started
        self.finish_offload_at: dict[int, list[int]] = {}
        self.start_reload_at: dict[int, list[int]] = {}
        for i in range(num_layers):
            self.finish_offload_at.setdefault(model_layers - num_layers + i, []).append(i)
            self.start_reload_at.setdefault(model_layers - 1 - num_layers + i, []).append(i)
        self.iteration: Optional[OffloadIteration] = None
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._synced = True

    def __enter__(self) -> "CpuOffloadContext":
        if self._hooks is not None:
            raise RuntimeError("hybridfp CPU offload: the context is already entered; enter it once around "
                               "each layer's forward (not nested).")
        if not self._synced:
            raise RuntimeError("hybridfp CPU offload: the context was entered again before sync_function was "
                               "called on the previous layer's output; call x = sync_function(x) after each layer.")
        if self.iteration is None or self.iteration.layer >= self.model_layers - 1:
            self.iteration = OffloadIteration(self)  # a new pass of the model's layers
        self.iteration.forward_step()
        self._layer = self.iteration.layer
        # autograd calls the hooks from inside a compiled frame too (a module compiled in place
        # that runs eager ops): traced, they would compile once per tensor layout and step of
        # the schedule (their guards read both). Wrapped here, not at import: torch.compiler
        # imports Dynamo, which imports Triton, and Triton reads TRITON_INTERPRET once
        self._hooks = torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(self._pack),
                                                               torch.compiler.disable(_unpack))
        self._hooks.__enter__()
        self._synced = False
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(exc_type, exc, tb)
        iteration = self.iteration
        group = iteration.groups.get(self._layer) if iteration is not None else None
        if group is not None:
            group.by_id.clear()
        if exc_type is not None and iteration is not None:
            # the layer's forward raised (a bad batch the caller skips, an out-of-memory error):
            # no sync_function call follows, nor the pass's other layers. Forget the pass, so
            # that the next entry starts a new one at layer 0 with the schedule in step (the
            # failed pass's tensors belong to its partial graph, normally dropped with the error)
            self.iteration, self._synced = None, True
            iteration.abandon()

    def keeps(self, t: torch.Tensor) -> bool:
        """Whether a saved tensor stays where it is (see the module docstring).

        Parameters
        ----------
        t:
            A tensor saved for backward inside the context.

        Returns
        -------
        bool
            True to leave it in place, False to offload it.
        """
        base = t._base if t._base is not None else t  # ops save views of parameters (addmm: weight.t())
        return (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
                or getattr(t, NOT_OFFLOADED, False) or getattr(base, NOT_OFFLOADED, False)
                or type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type == "meta"
                or t.numel() < self.min_tensor_size_to_offload or not _dense(t))

    def _pack(self, t: torch.Tensor) -> Any:
        # every tensor is saved with its version (_Kept, _Moved): the hooks turn off autograd's
        # own check of it, in the layers that offload nothing too
        it = self.iteration
        if it is None or it.layer >= self.num_layers:
            return _Kept(t)
        if self.keeps(t):
            self.stats.kept_tensors += 1
            self.stats.kept_bytes += _nbytes(t) if type(t) is torch.Tensor else 0
            return _Kept(t)
        group = it.group(t)
        hit = group.by_id.get(id(t))
        # one copy of a tensor saved twice; a second save after an in-place write needs its own
        # (the first copy holds the old values, which only the first save may read)
        if hit is not None and hit.device_tensor is t and hit.version == _version_of(t):
            return hit
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        with group.streams.side_after_current():
            host.copy_(t, non_blocking=t.is_cuda)
        group.offload_event = group.streams.record()
        moved = _Moved(group, t, host)
        group.moved.append(moved)
        group.by_id[id(t)] = moved
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _nbytes(t)
        return moved

    def synchronize(self, tensor: torch.Tensor) -> torch.Tensor:
        """``sync_function``: mark ``tensor`` as the output of the layer just run, so the
        backward knows when it reaches that layer. Returns ``tensor``.

        Raises
        ------
        TypeError
            ``tensor`` is not a tensor.
        RuntimeError
            Called inside the context, or twice for one layer.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"hybridfp CPU offload: sync_function takes the layer's output tensor; got "
                            f"{type(tensor).__name__}.")
        if self._hooks is not None:
            raise RuntimeError("hybridfp CPU offload: sync_function was called inside the context; call it "
                               "on the layer's output after leaving it.")
        if self._synced:
            raise RuntimeError("hybridfp CPU offload: sync_function was called twice for one layer (or before "
                               "the context was entered); call it once after each layer's forward.")
        self._synced = True
        if tensor.grad_fn is None:  # no backward will run through it (inference, no_grad)
            return tensor
        iteration, layer = self.iteration, self._layer

        def reached(_grads: Any) -> None:
            iteration.backward_step(layer)

        tensor.grad_fn.register_prehook(reached)
        return tensor


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its extent exactly (so an ``empty_strided`` copy of it has
    its very layout): no gaps, no overlap."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.size(), t.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _unpack(x: Any) -> torch.Tensor:
    return x.get()


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE_TO_OFFLOAD,
                            ) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
    """CPU offload of the activations of the first ``num_layers`` of ``model_layers`` layers
    (TransformerEngine's function; see the module docstring for what moves and when).

    Parameters
    ----------
    enabled:
        False returns ``(contextlib.nullcontext(), identity)``.
    num_layers:
        How many layers (the first ones) offload what they save; at most ``model_layers - 1``.
    model_layers:
        How many layers run under the context per forward pass.
    offload_activations:
        Must be True (activations are what is offloaded).
    offload_weights:
        Must be False: parameters stay on the device (TE deprecated the option).
    min_tensor_size_to_offload:
        Tensors with fewer elements stay in place (TE's default, 2**20).

    Returns
    -------
    tuple
        ``(context, sync_function)``: enter ``context`` around each layer's forward, and pass
        its output through ``sync_function``. ``context.stats`` (:class:`OffloadStats`) counts
        what moved. In backward, a tensor saved inside the context and modified in place since
        raises autograd's RuntimeError ("modified by an inplace operation"), as without offload.

    Raises
    ------
    TypeError
        ``enabled`` not a bool, or a count not an int.
    ValueError
        ``model_layers < 1``, ``num_layers`` outside ``0 .. model_layers - 1``,
        ``offload_activations=False``, ``offload_weights=True`` or a negative
        ``min_tensor_size_to_offload``.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> layers = [hf.Linear(64, 64) for _ in range(3)]
    >>> ctx, sync = hf.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3,
    ...                                        min_tensor_size_to_offload=1)
    >>> x = torch.randn(32, 64, requires_grad=True)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     h = x
    ...     for layer in layers:
    ...         with ctx:
    ...             h = layer(h)
    ...         h = sync(h)
    >>> h.sum().backward()
    >>> ctx.stats.offloaded_tensors > 0, ctx.stats.reloaded_tensors == ctx.stats.offloaded_tensors
    (True, True)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"get_cpu_offload_context: enabled must be a bool; got {type(enabled).__name__}.")
    for name, value in (("num_layers", num_layers), ("model_layers", model_layers),
                        ("min_tensor_size_to_offload", min_tensor_size_to_offload)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"get_cpu_offload_context: {name} must be an int; got {value!r}.")
    if not enabled:  # (TE's defaults, num_layers=1 with model_layers=1, are valid only here)
        return contextlib.nullcontext(), lambda tensor: tensor
    if not offload_activations:
        raise ValueError("get_cpu_offload_context: offload_activations=False leaves nothing to offload "
                         "(hybridfp offloads activations only); pass enabled=False to turn offload off.")
    if offload_weights:
        raise ValueError("get_cpu_offload_context: offload_weights=True is not supported: parameters stay on the "
                         "device (TransformerEngine deprecated the option); pass offload_weights=False.")
    if model_layers < 1:
        raise ValueError(f"get_cpu_offload_context: model_layers={model_layers}; it must be at least 1.")
    if not 0 <= num_layers <= model_layers - 1:
        raise ValueError(f"get_cpu_offload_context: num_layers={num_layers} with model_layers={model_layers}; "
                         f"offload between 0 and model_layers - 1 = {model_layers - 1} layers (the last layer's "
                         "activations are needed first in backward, so they are never offloaded).")
    if min_tensor_size_to_offload < 0:
        raise ValueError(f"get_cpu_offload_context: min_tensor_size_to_offload={min_tensor_size_to_offload}; "
                         "it must be >= 0.")
    context = CpuOffloadContext(num_layers, model_layers, min_tensor_size_to_offload)
    return context, context.synchronize
