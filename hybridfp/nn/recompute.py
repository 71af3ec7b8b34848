"""What a module's forward records for ``torch.utils.checkpoint``, and how the recomputation
replays it.

``torch.utils.checkpoint`` recomputes a checkpointed segment's forward during backward: outside
the ``hybridfp.autocast`` region and the policy the forward ran under, perhaps on another thread,
and perhaps after delayed scaling moved its scales at the region's end. So every hybridfp module
call in a checkpointed forward appends a :class:`Record` (its region, policy and quantizers, the
stateful ones as copies) to the segment, held by torch's own object for that one forward: the
checkpoint frame (``use_reentrant=False``) or the ``CheckpointFunction`` node
(``use_reentrant=True``). Records thus live exactly as long as the segment can be recomputed, and
no record serves another forward.

A recomputation runs the segment's module calls in the forward's order: its k-th call replays
the k-th record (the module must be the same one, else an error), inside the record's region and
policy with the forward's quantizers. Each recomputation (one per backward pass: torch's graph
task) keeps its own cursor, so a second backward over a retained graph replays from the start.
Torch restores its RNG state for the recomputation, so stochastic rounding draws the same numbers.

How torch marks the two phases (read here; ``tests/integration`` checks them on the installed
torch, so a torch that changes them fails there, and a recomputation not recognised stays refused,
never silently high precision):

- non-reentrant: in forward the innermost saved-tensor hooks are ``_checkpoint_hook``'s (its
  ``frame``); in the recomputation ``_recomputation_hook``'s (``target_frame_ref``, ``gid``);
- reentrant: the forward runs inside ``CheckpointFunction.forward`` with grad mode off (its
  ``ctx``, found on the calling thread's Python stack); the recomputation runs while autograd
  executes that same ``ctx`` node (``torch._C._current_autograd_node()``).

A module call belongs to every checkpointed forward it runs in (nested checkpoints), except
that a non-reentrant checkpoint nested in a non-reentrant one's recomputation cannot be seen
through (torch shows only the innermost hooks): a module running there raises, never silently
quantizing otherwise than its forward did.

Selective activation checkpointing (``create_selective_checkpoint_contexts``) runs the forward
under a dispatch mode that keeps the outputs of the aten ops its policy saves, numbered per op in
call order, and the recomputation under one that hands the k-th call of an op the k-th saved
output. So both passes must show it the same calls. Work that depends on state from outside the
segment does not: a weight quantization runs or not as the weight cache misses or hits (the
recomputation mostly hits the forward's entry), quantizers are built in a forward only, the
replayed quantizer copies are made after the forward's call but before the recomputation's. It
runs with those two modes off the mode stack (:func:`hidden_from_selective_checkpoint`), so
neither pass shows them its ops. The memo of shared input quantizations, which a recomputation
starts empty, is emptied where a segment's forward starts under those modes
(``Record.opens_segment``).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Optional, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from ..config import Policy, use_policy
from ..recipes import AutocastState, replay_region

T = TypeVar("T")

#: The attribute of torch's checkpoint object (frame or ``ctx``) holding the segment's records.
ATTRIBUTE = "_hybridfp_records"
_FORWARD_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_RECOMPUTE_HOOK = "_recomputation_hook.__init__.<locals>.pack_hook"
_REENTRANT_FORWARD = torch_checkpoint.CheckpointFunction.forward.__code__
_REENTRANT_NODE = torch_checkpoint.CheckpointFunction._backward_cls
#: How far up the Python stack a reentrant checkpoint's forward is looked for.
MAX_STACK_DEPTH = 256
#: torch's selective activation checkpoint dispatch modes: the forward's (saves the outputs of
#: the ops its policy picks) and the recomputation's (hands them back by each op's call count).
#: A subclass (xformers') is one too.
SAC_MODES: tuple[type, ...] = tuple(getattr(torch_checkpoint, name) for name in (
    "_CachingTorchDispatchMode", "_CachedTorchDispatchMode") if hasattr(torch_checkpoint, name))


@dataclass
class Record:
    """One module call of a checkpointed forward: what its recomputation re-enters.

    ``quantizers``: the module's quantizers as the forward used them (None for a call outside
    any region); stateful forward quantizers are copies taken after the call. ``build_key``:
    the key they were built for (the recomputation reads the weights cached under it).
    ``opens_segment``: the call is the first of a checkpointed forward it belongs to (whose
    recomputation starts with empty memos).
    """

    module: Any
    state: Optional[AutocastState]
    policy: Policy
    quantizers: Optional[dict] = None
    build_key: Any = None
    opens_segment: bool = False


@dataclass
class _Cursor:
    """One recomputation's progress through a segment's records, and the memos (``scratch``) of
    the regions it replays, one per forward region, so inputs shared in the forward are shared."""

    position: int = 0
    scratch: dict = field(default_factory=dict)


@dataclass
class Segment:
    """The records of one checkpointed forward, in call order, and its recomputations' cursors."""

    records: list = field(default_factory=list)
    cursors: dict = field(default_factory=dict)

    def next_record(self, module: Any, phase: Hashable) -> tuple[Record, _Cursor]:
        """The record the recomputation ``phase`` replays next, which must be ``module``'s.

        Raises
        ------
        RuntimeError
            The recomputation calls more modules than the forward did, or another one.
        """
        cursor = self.cursors.setdefault(phase, _Cursor())
        k = cursor.position
        who = getattr(module, "_who", lambda: type(module).__name__)()
        if k >= len(self.records):
            raise RuntimeError(
                f"{who}: torch.utils.checkpoint recomputed more hybridfp module calls than its forward "
                f"made ({len(self.records)}); the checkpointed function must run the same modules in "
                "the same order each time.")
        record = self.records[k]
        if record.module is not module:
            other = getattr(record.module, "_who", lambda: type(record.module).__name__)()
            raise RuntimeError(
                f"{who}: torch.utils.checkpoint's recomputation called it where the forward called "
                f"{other} (call {k} of the segment); the checkpointed function must run the same "
                "modules in the same order each time.")
        cursor.position = k + 1
        if cursor.position == len(self.records):
            cursor.scratch.clear()  # done: nothing it memoised is read again
        return record, cursor


class _ThreadReplay(threading.local):
    """How many replays the calling thread is inside (a replay of a module call nests none)."""

    def __init__(self) -> None:
        self.depth = 0


_REPLAY = _ThreadReplay()


def in_replay() -> bool:
    """Whether the calling thread is replaying a recorded module call."""
    return _REPLAY.depth > 0


def _hook_cells() -> tuple[str, dict[str, Any]]:
    """The innermost saved-tensor pack hook's qualified name and closure variables when it is
    one of torch's checkpoint hooks, else ("", {})."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return "", {}
    name = getattr(hooks[0], "__qualname__", "")
    if name not in (_FORWARD_HOOK, _RECOMPUTE_HOOK):
        return "", {}
    pack = inspect.unwrap(hooks[0])  # torch wraps the recomputation's hook (dynamo disable)
    cells = pack.__closure__ or ()
    return name, dict(zip(pack.__code__.co_freevars, (c.cell_contents for c in cells)))


def _reentrant_forward_ctxs() -> list[Any]:
    """The ``ctx`` of every reentrant checkpoint whose forward is on this thread's stack."""
    found, frame = [], sys._getframe(2)
    for _ in range(MAX_STACK_DEPTH):
        if frame is None:
            break
        if frame.f_code is _REENTRANT_FORWARD and frame.f_locals.get("ctx") is not None:
            found.append(frame.f_locals["ctx"])
        frame = frame.f_back
    return found


def recording_segments() -> list[Segment]:
    """The records of every checkpointed forward running on this thread, innermost first (a
    call inside nested checkpoints belongs to each: each may be recomputed)."""
    name, cells = _hook_cells()
    owners = [cells["frame"]] if name == _FORWARD_HOOK and cells.get("frame") is not None else []
    if not torch.is_grad_enabled():  # a reentrant checkpoint runs its forward with grad mode off
        owners += _reentrant_forward_ctxs()
    segments = []
    for owner in owners:
        segment = getattr(owner, ATTRIBUTE, None)
        if segment is None:
            segment = Segment()
            setattr(owner, ATTRIBUTE, segment)
        segments.append(segment)
    return segments


def recording_segment() -> Optional[Segment]:
    """The records of the innermost checkpointed forward running on this thread (None outside
    one)."""
    segments = recording_segments()
    return segments[0] if segments else None


def replaying_segment() -> Optional[tuple[Optional[Segment], Hashable]]:
    """The segment torch is recomputing on this thread and the recomputation's key, or None
    outside a recomputation; the segment is None when its forward recorded nothing."""
    name, cells = _hook_cells()
    if name == _RECOMPUTE_HOOK:
        ref = cells.get("target_frame_ref")
        frame = ref() if ref is not None else None
        if frame is not None:
            return getattr(frame, ATTRIBUTE, None), ("frame", cells.get("gid"))
    task = torch._C._current_graph_task_id()
    if task != -1:
        # (grad mode may be off: a reentrant checkpoint nested in the segment runs its forward so)
        node = torch._C._current_autograd_node()
        if isinstance(node, _REENTRANT_NODE):
            return getattr(node, ATTRIBUTE, None), ("node", task)
        if name == _FORWARD_HOOK:
            return None, ("nested", task)  # a checkpoint's forward inside a backward: see replay_for
    return None


def record_call(module: Any, state: Optional[AutocastState], policy: Policy,
                quantizers: Optional[dict] = None) -> Optional[Record]:
    """Append a record of ``module``'s call to every checkpointed forward running on this thread.

    Returns
    -------
    Record or None
        The record (its ``quantizers`` to be set once the call ran, unless given); None
        outside a checkpointed forward.
    """
    segments = recording_segments()
    if not segments:
        return None
    record = Record(module, state, policy, quantizers, opens_segment=any([not s.records for s in segments]))
    for segment in segments:
        segment.records.append(record)
    return record


def replay_for(module: Any) -> Optional[tuple[Record, _Cursor]]:
    """The record ``module``'s call replays when torch is recomputing a checkpointed segment
    on this thread, else None.

    Raises
    ------
    RuntimeError
        A recomputation whose forward recorded no hybridfp module call, or one that calls
        other modules than its forward did (see :meth:`Segment.next_record`).
    """
    found = replaying_segment()
    if found is None:
        return None
    segment, phase = found
    if segment is None:
        who = getattr(module, "_who", lambda: type(module).__name__)()
        raise RuntimeError(
            f"{who}: torch.utils.checkpoint is recomputing a segment whose forward hybridfp cannot "
            "find (a non-reentrant checkpoint nested in another non-reentrant checkpoint, or a "
            "forward that ran under other saved-tensor hooks inside the checkpointed function), "
            "so it cannot replay the forward's quantization. Do not nest non-reentrant "
            "checkpoints, and enter saved-tensor hooks outside the checkpoint.")
    return segment.next_record(module, phase)


@contextmanager
def replaying(record: Record, cursor: _Cursor, quantizers: Optional[dict]) -> Iterator[None]:
    """Run one recorded call again: its region (``quantizers`` in place of the module's own;
    the memo shared with the recomputation's other calls of that region) and its policy."""
    scratch = None if record.state is None else cursor.scratch.setdefault(id(record.state), {})
    _REPLAY.depth += 1
    try:
        with use_policy(record.policy), replay_region(record.state, quantizers=quantizers, scratch=scratch):
            yield
    finally:
        _REPLAY.depth -= 1


def selective_checkpoint_active() -> bool:
    """Whether one of torch's selective activation checkpoint modes (``SAC_MODES``) is on this
    thread's dispatch mode stack, outside torch.compile (a compiled region's recomputation is
    the partitioner's, from the graph, not a replay of Python calls). A caller checks
    ``torch._C._len_torch_dispatch_stack()`` first: without any mode this is never asked."""
    return (any([isinstance(m, SAC_MODES) for m in _get_current_dispatch_mode_stack()])
            and not torch.compiler.is_compiling())


def unseen_by_selective_checkpoint(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, inside :func:`hidden_from_selective_checkpoint` when one of
    torch's selective activation checkpoint modes is on the stack; without any dispatch mode
    one call of ``_len_torch_dispatch_stack`` decides."""
    if torch._C._len_torch_dispatch_stack() and selective_checkpoint_active():
        with hidden_from_selective_checkpoint():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def method_unseen_by_selective_checkpoint(method: Callable[..., T]) -> Callable[..., T]:
    """Decorator: ``method`` runs as :func:`unseen_by_selective_checkpoint` runs a function (for a
    module's weight quantization through its cache, whose hits and misses differ between a
    forward and its recomputation)."""
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> T:
        # inline, not through unseen_by_selective_checkpoint: one frame a call on the hot path
        if torch._C._len_torch_dispatch_stack() and selective_checkpoint_active():
            with hidden_from_selective_checkpoint():
                return method(*args, **kwargs)
        return method(*args, **kwargs)
    return run


@contextmanager
def hidden_from_selective_checkpoint() -> Iterator[None]:
    """Run the body with torch's selective activation checkpoint modes off this thread's
    dispatch mode stack; every other mode (a ``FlopCounterMode``, a ``FakeTensorMode``) stays on
    it, in its order, and sees the body's ops as before. The stack is as it was afterwards,
    also when the body raises.

    For work that a checkpointed forward and its recomputation need not both do, or not at the
    same place (a weight cache hit runs no op, a miss quantizes): the modes number each op's
    calls, and the recomputation hands the k-th call of an op the output its forward saved for
    the k-th. Shown to them, such work shifts the numbers of the later calls of its ops, which
    then get other calls' saved outputs (wrong values, or a shape error). Hidden, nothing of it
    is saved (it runs wherever it runs), and both passes show the modes the same calls."""
    popped = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]  # innermost first
    pushed = 0
    try:
        for mode in reversed(popped):
            if not isinstance(mode, SAC_MODES):
                _push_mode(mode)
                pushed += 1
        yield
    finally:
        for _ in range(pushed):
            _pop_mode()
        for mode in reversed(popped):
            _push_mode(mode)
