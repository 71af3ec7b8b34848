"""Every FSDP2 quantized-gather weight's amax in one all-reduce per step.

Without it, each gather of a weight with a per-tensor scale (FP8 current scaling, NVFP4's
global amax; one side of a hybrid) all-reduces that weight's amax over the shard group: one
collective per weight per gather, forward and backward. :func:`precompute_weight_amax`, called
after ``optimizer.step()`` (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), computes
every such weight's shard amax, stacks them and reduces them all in ONE all-reduce (MAX) per
shard group; the step's gathers (every micro-batch, forward and backward) then hand that amax to
the weight quantizer instead of reducing their own (``quantizers.base.all_reduce_amax`` calls a
group's ``reduce_amax``). The amax is the same number, so the step is bitwise the same.

A precomputed amax is never used stale. A gather checks that the weight is the one measured:
the sharded parameter's and its local shard's version counters (``_version``: an optimizer
step, an in-place edit) and this rank's amax (the quantizer's own, or one pass over the shard
where a block straddles shards; it catches writes that move no version counter, such as a
``foreach`` optimizer's on a DTensor). A weight changed since raises a clear error: call the
function again after each optimizer step (or after loading weights). Quantizers whose amax is
not the weight's own (NVFP4 with a post-RHT amax, a hybrid's columnwise side read from the
dequantized rowwise copy) keep their per-gather all-reduce. Tensor-parallel weights (a 2-D
mesh, ``fsdp_tensor_parallel.py``) take a second all-reduce over the tensor-parallel group: their
scale is the whole weight's, as the tensor-parallel layer's. Quantized primary weights
(``fsdp_primary.py``) are skipped: their gathers send stored codes and read no amax.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..formats.common import amax_nan


@dataclass(frozen=True)
class PrecomputedAmax:
    """One weight's amax as :func:`precompute_weight_amax` measured and reduced it."""

    #: the sharded parameter and its local shard (weakly), and their version counters
    param: Callable[[], Any]
    shard: Callable[[], Any]
    versions: tuple[int, int]
    #: this rank's shard amax and the shard group's (FP32 0-d), of the dtype the gather encodes
    local: torch.Tensor
    amax: torch.Tensor
    dtype: torch.dtype


class _ReducedAmax:
    """Stands in for the shard group in a quantizer's amax reduction: it returns the
    precomputed amax (checking, where the quantizer's rows are this rank's shard, that the
    amax it was about to reduce is the one measured)."""

    def __init__(self, pre: PrecomputedAmax, check_local: bool, who: str) -> None:
        self.pre, self.check_local, self.who = pre, check_local, who

    def reduce_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """Write the reduced amax into ``amax`` (in place, as an all-reduce would)."""
        if self.check_local and not _same(amax, self.pre.local):
            raise _stale(self.who, f"this rank's amax is {amax.item()}, measured {self.pre.local.item()}")
        return amax.copy_(self.pre.amax.to(device=amax.device, dtype=amax.dtype).reshape(amax.shape))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().float().reshape(()), b.detach().float().reshape(()).to(a.device)
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))  # NaN bits included


def _stale(who: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"{who}: its amax was precomputed (hybridfp.precompute_weight_amax) but the weight changed "
        f"since ({why}). Call precompute_weight_amax(model) after every optimizer.step() and after "
        "loading or editing weights, before the next forward.")


def _weight_leaves(q: Any) -> list[Any]:
    """The single-format quantizers in ``q`` that read the weight itself (a hybrid's columnwise
    child reading the dequantized rowwise copy does not)."""
    if not hasattr(q, "rowwise_quantizer"):
        return [q]
    leaves = _weight_leaves(q.rowwise_quantizer)
    if getattr(q, "columnwise_source", "original") == "original":
        leaves += _weight_leaves(q.columnwise_quantizer)
    return leaves


def _reads_amax(leaf: Any) -> bool:
    """Whether the leaf can reduce a per-tensor amax of the weight itself (an RHT'd copy's
    amax, row-scaled NVFP4's per-row amaxes are other numbers)."""
    return hasattr(leaf, "with_amax_reduction") and not getattr(leaf, "row_scaled_nvfp4", False) and not (
        getattr(leaf, "with_rht", False) and getattr(leaf, "with_post_rht_amax", False))


def _takes_weight_amax(leaf: Any) -> bool:
    """Whether the leaf all-reduces the amax of the weight itself at this gather."""
    return bool(getattr(leaf, "with_amax_reduction", False)) and _reads_amax(leaf)


def reads_weight_amax(quantizer: Any) -> bool:
    """Whether a weight quantizer's gathers would use a precomputed amax (a per-tensor scale
    of the weight itself: FP8 current scaling, NVFP4, such a side of a hybrid).

    Parameters
    ----------
    quantizer:
        A module's weight quantizer.

    Returns
    -------
    bool
        True where :func:`precompute_weight_amax` saves its gathers a collective.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.integration.fsdp_amax import reads_weight_amax
    >>> reads_weight_amax(hf.Float8CurrentScalingQuantizer()), reads_weight_amax(hf.MXFP8Quantizer())
    (True, False)
    """
    return any(_reads_amax(leaf) for leaf in _weight_leaves(quantizer))


@contextmanager
def reduced_amax(q: Any, local: Any, halo: int, src: torch.Tensor, who: str) -> Iterator[None]:
    """While quantizing a gather's rows with ``q``: its leaves that would all-reduce the
    weight's amax take the precomputed one instead (nothing changes without a precompute).

    Parameters
    ----------
    q:
        The gather's weight quantizer (its amax reduction group set to the shard group).
    local:
        This rank's ``QuantizedGatherWeight`` shard.
    halo:
        The layout's halo: where nonzero the quantizer reads other ranks' rows too, so this
        rank's shard amax is measured here.
    src:
        This rank's shard as the gather encodes it (FSDP2's ``param_dtype``).
    who:
        The weight's name for errors.

    Raises
    ------
    RuntimeError
        The weight changed since the precompute.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.integration.fsdp_amax import reduced_amax
    >>> m = hf.Linear(4, 4)
    >>> hf.enable_quantized_all_gather(m)
    1
    >>> q = hf.Float8CurrentScalingQuantizer()
    >>> with reduced_amax(q, m.weight, 0, m.weight.detach(), "Linear.weight"):  # none precomputed
    ...     t = q(m.weight.detach())
    """
    pre = local._slot.amax
    leaves = [leaf for leaf in _weight_leaves(q) if _takes_weight_amax(leaf)]
    if pre is None or not leaves:
        yield
        return
    param = pre.param()
    # FSDP2's lazy init may put a padded shard's copy in place of the local tensor measured
    # (same values, its own version counter): its amax is then what tells
    if (param is None or param._version != pre.versions[0]
            or (pre.shard() is local and local._version != pre.versions[1])):
        raise _stale(who, "its version counter moved")
    if pre.dtype != src.dtype:
        raise _stale(who, f"measured in {pre.dtype}, encoded in {src.dtype}")
    if halo and not _same(amax_nan(src), pre.local):
        raise _stale(who, "this rank's amax moved")
    stand_in = _ReducedAmax(pre, check_local=not halo, who=who)
    saved = [leaf.amax_reduction_group for leaf in leaves]
    for leaf in leaves:
        leaf.amax_reduction_group = stand_in
    try:
        yield
    finally:
        for leaf, group in zip(leaves, saved):
            leaf.amax_reduction_group = group


def _records(module: nn.Module) -> list[Any]:
    """FSDP2's parameter records (``FSDPParam``) of ``module``'s own ``fully_shard`` state."""
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if get_state is not None else None
    if state is None:
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [record for group in groups for record in getattr(group, "fsdp_params", ())]


def precompute_weight_amax(model: nn.Module) -> int:
    """Reduce every FSDP2 quantized-gather weight's amax in one all-reduce, for the next step.

    Call it after ``optimizer.step()`` (and after loading weights), outside the forward. Each
    weight of ``model`` that ``enable_quantized_all_gather`` wrapped and ``fully_shard``
    sharded measures max|shard| (in the dtype its gather encodes); one all-reduce (MAX) per
    shard group reduces them all, and the gathers until the weight changes use the result
    instead of all-reducing their own (bitwise the same amax). Once called, call it after
    every step: a gather of a weight changed since raises.

    Parameters
    ----------
    model:
        The model (or a part of it) after ``fully_shard``.

    Returns
    -------
    int
        The number of weights whose amax was reduced (quantized primary weights are skipped:
        ``hybridfp.quantize_sharded_weights`` reduces theirs; a model with only those: 0).

    Raises
    ------
    ValueError
        ``model`` has no quantized-gather weight sharded by FSDP2.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> try:
    ...     hf.precompute_weight_amax(torch.nn.Linear(4, 4))
    ... except ValueError as e:
    ...     print(str(e)[:60])
    precompute_weight_amax: Linear has no weight that FSDP2 gath
    """
    import torch.distributed as dist

    from .fsdp import QuantizedGatherWeight
    from .fsdp_primary import QuantizedPrimaryWeight

    by_group: dict = {}
    primary = 0
    for module in model.modules():
        for record in _records(module):
            local = record._sharded_local_tensor
            if isinstance(local, QuantizedPrimaryWeight):
                # quantize_sharded_weights reduces its amax when it encodes it; its gathers
                # send stored codes and read no amax
                primary += 1
                continue
            if not isinstance(local, QuantizedGatherWeight):
                continue
            mesh = record.shard_mesh_from_root
            dtype = getattr(record.mp_policy, "param_dtype", None) or local.dtype
            src = local._hp.detach()
            with torch.no_grad():
                amax = amax_nan(src.to(dtype) if dtype != src.dtype else src)
            # a tensor-parallel weight's scale is its whole weight's: reduced over dp, then tp
            # (FSDP2's record of the parameter's placement before its dp sharding: read directly,
            # so a torch that renames it fails here instead of skipping the tp reduction)
            spec = record._unsharded_dtensor_spec
            if spec is not None and spec.mesh.ndim != 1:
                raise ValueError(
                    f"precompute_weight_amax: a weight placed over a {spec.mesh.ndim}-D mesh before FSDP2 "
                    f"sharded it ({spec.placements}); the quantized all-gather takes weights placed by "
                    "hybridfp's tensor-parallel styles on a 1-D mesh['tp'].")
            tp = spec.mesh.get_group() if spec is not None else None
            by_group.setdefault((mesh.get_group(mesh.ndim - 1), tp), []).append((record, local, amax, dtype))
    if not by_group and primary:
        return 0
    if not by_group:
        raise ValueError(
            f"precompute_weight_amax: {type(model).__name__} has no weight that FSDP2 gathers quantized; "
            "call hybridfp.enable_quantized_all_gather(model) and then fully_shard first.")
    n = 0
    for (group, tp), entries in by_group.items():  # in module order: the same on every rank
        flat = torch.stack([amax for _, _, amax, _ in entries])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)  # the step's one collective
        if tp is not None:  # (a tensor-parallel weight's second: over the tp group)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=tp)
        for k, (record, local, amax, dtype) in enumerate(entries):
            param = record.sharded_param
            local._slot.amax = PrecomputedAmax(weakref.ref(param), weakref.ref(local),
                                               (param._version, local._version), amax, flat[k].clone(), dtype)
            n += 1
    return n
