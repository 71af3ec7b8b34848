"""Quantized primary weights (``hybridfp.quantized_model_init``) under tensor parallelism.

hybridfp's tensor-parallel styles shard a ``QuantizedTensor`` weight parameter as its FP32
master: the module's parameter becomes the DTensor of the master (seeded from
``get_high_precision_init_val()``, else the dequantized weight), which ``state_dict``,
``torch.distributed.checkpoint``, gradient clipping and the optimizer see as they see a
high-precision tensor-parallel weight, and each rank keeps, next to its master shard, the
quantized copies of that shard (both copies), which its GEMMs read.

The shard is encoded by the weight's own quantizer exactly as the tensor-parallel layer
quantizes a high-precision weight's shard (``tensor_parallel_linear.py``): its per-tensor amax
all-reduced (MAX) over the tensor-parallel group, so the scale is the whole weight's, and every
block whole inside the shard (a shard size that cuts a block is refused, naming the weight and
the block size). Tensor parallelism with quantized primary weights therefore computes bitwise
what it computes with high-precision weights. The shard is encoded once per optimizer step, not
at every forward: :func:`quantize_tensor_parallel_weights` (which
``hybridfp.quantize_master_weights``, hence ``hybridfp.MasterWeightOptimizer.step``, calls).
A master written after its shard was encoded (a torch optimizer stepping it, a load) makes the
next forward raise instead of reading stale codes: version counters, and a fingerprint of the
local master (its amax and float64 sum) for writes that move no counter.

Outside ``hybridfp.autocast`` the module runs in high precision on its FP32 master shard.
Refused by name: stochastic rounding of the weight (a shard would draw other numbers than the
whole weight) and stateful (delayed-scaling) weight quantizers (their history is the module's,
which a tensor-parallel module does not adopt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ..quantizers import Quantizer
from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from .master_fingerprint import fingerprint, same_fingerprint
from .tensor_parallel_linear import block_extent

#: the attribute of a tensor-parallel primary weight's Parameter holding its :class:`PrimaryShard`
SLOT_ATTR = "_hybridfp_tp_primary"


@dataclass
class PrimaryShard:
    """One tensor-parallel quantized primary weight: its quantizer (amax reduced over ``group``)
    and this rank's quantized shard, with what the master was when the shard was encoded."""

    quantizer: Quantizer
    group: Any
    who: str
    shard: Optional[QuantizedTensor] = None
    #: the DTensor's and the local tensor's version counters at the encoding
    version: tuple = ()
    #: the local master's amax and float64 sum at the encoding (writes that move no counter)
    fingerprint: Optional[torch.Tensor] = None


def master_value(p: QuantizedTensor) -> torch.Tensor:
    """The FP32 master of quantized parameter ``p``: its kept initial value, else its
    dequantized value, on ``p``'s device (a new tensor)."""
    init = p.get_high_precision_init_val()
    value = init if init is not None else p.dequantize(torch.float32)
    return value.detach().to(device=p.device, dtype=torch.float32, copy=True)


def set_master_value(p: QuantizedTensor, value: torch.Tensor) -> None:
    """Give quantized weight parameter ``p`` the FP32 value ``value`` before it is sharded: its
    copies re-encoded in place and ``value`` kept as its initial high-precision value, the master
    :func:`shard_primary` distributes (a weight whose rows are reordered per rank first).

    Parameters
    ----------
    p:
        A ``quantized_model_init`` weight parameter with its quantizer.
    value:
        Its new value, of its shape.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.integration.tensor_parallel_primary import set_master_value
    >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
    ...     lin = hf.Linear(32, 32)
    >>> set_master_value(lin.weight, torch.ones(32, 32))
    >>> lin.weight.get_high_precision_init_val().unique().tolist(), lin.weight.dequantize().unique().tolist()
    ([1.0], [1.0])
    """
    with torch.no_grad():
        p.quantizer.update_quantized(value.detach(), p, directions=p.directions())
    p.__dict__["_high_precision_init_val"] = value.detach().to("cpu", dtype=torch.float32, copy=True)


def _format(q: Any) -> str:
    if hasattr(q, "rowwise_quantizer"):
        return f"{type(q).__name__}({_format(q.rowwise_quantizer)}, {_format(q.columnwise_quantizer)}, " \
               f"{q.settings().get('columnwise_source')})"
    return f"{type(q).__name__}{q.settings()}"


def check_primary_quantizer(q: Optional[Quantizer], who: str, split: str, local: tuple[int, ...],
                            world: int, halves: bool = False) -> None:
    """Refuse a weight quantizer a tensor-parallel shard cannot hold as the whole weight's codes.

    Parameters
    ----------
    q:
        The quantized parameter's quantizer.
    who:
        The module and parameter, for messages.
    split:
        "rows" (column-parallel, ``Shard(0)``) or "cols" (row-parallel, ``Shard(1)``).
    local:
        This rank's shard shape.
    world:
        Tensor-parallel ranks.
    halves:
        The rows are a gated fc1's ``[gate_r; up_r]``: each half must hold whole blocks.

    Raises
    ------
    ValueError
        No quantizer, stochastic rounding, a stateful (delayed-scaling) quantizer, per-row
        scales split along the columns, or a shard size that cuts a quantization block.
    """
    if q is None:
        raise ValueError(f"{who}: the quantized weight has no quantizer; build the model under "
                         "hybridfp.quantized_model_init(recipe=...).")
    if q.uses_randomness():
        raise ValueError(f"{who}: the weight quantizer {q!r} rounds stochastically; a tensor-parallel shard "
                         "would draw other numbers than the whole weight. Use a weight quantizer without "
                         "stochastic rounding for quantized primary weights under tensor parallelism.")
    if q.has_state():
        raise ValueError(f"{who}: the weight quantizer {type(q).__name__} keeps state (delayed scaling); "
                         "quantized primary weights under tensor parallelism take current-scaling or "
                         "block-scaled weight formats. Use such a recipe, or high-precision weights "
                         "(without quantized_model_init / --quantized-weights).")
    size = local[0] if split == "rows" else local[1]
    size, of = (size // 2, " per half of the gated [gate | up]") if halves else (size, "")
    for direction in (ROWWISE, COLUMNWISE):
        ext = block_extent(q, direction)[0 if split == "rows" else 1]
        if size % ext:
            raise ValueError(
                f"{who}: a quantized primary weight split across {world} tensor-parallel ranks along its "
                f"{split} ({size} on each{of}), but its {direction} copy ({type(q).__name__}) is blocked "
                f"every {ext} {split}: a block would straddle two ranks. Choose sizes whose per-rank part "
                f"is a multiple of {ext}, or another weight format.")
    child = getattr(q, "rowwise_quantizer", q)
    if split == "cols" and getattr(child, "row_scaled_nvfp4", False):
        raise ValueError(f"{who}: a row-parallel quantized primary weight with per-row scales "
                         "(row_scaled_nvfp4): no rank sees a whole row. Use per-tensor NVFP4 scaling.")


def shard_primary(p: QuantizedTensor, mesh: Any, placement: Any, src_data_rank: Optional[int],
                  who: str) -> nn.Parameter:
    """The tensor-parallel Parameter of quantized weight ``p``: the DTensor of its FP32 master
    placed as ``placement``, holding (``SLOT_ATTR``) this rank's quantized shard, encoded now
    (a collective over the mesh's group for per-tensor formats).

    Parameters
    ----------
    p:
        A ``quantized_model_init`` weight parameter, whole on every rank.
    mesh:
        The 1-D tensor-parallel mesh.
    placement:
        ``Shard(0)``, ``_StridedShard(0, split_factor=2)`` (a gated fc1) or ``Shard(1)``.
    src_data_rank:
        As ``distribute_tensor``'s.
    who:
        The module and parameter, for messages.

    Returns
    -------
    nn.Parameter
        The FP32 master DTensor (the parameter the optimizer steps).

    Raises
    ------
    ValueError
        What :func:`check_primary_quantizer` refuses, or a replicated placement.
    """
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(placement, (Shard, _StridedShard)):
        raise ValueError(f"{who}: a quantized primary weight is sharded along its rows or columns; "
                         f"got placement {placement!r}.")
    dt = distribute_tensor(master_value(p), mesh, [placement], src_data_rank=src_data_rank)
    split = "rows" if placement.dim == 0 else "cols"
    check_primary_quantizer(p.quantizer, who, split, tuple(dt.to_local().shape), mesh.size(),
                            halves=isinstance(placement, _StridedShard))
    q = p.quantizer
    q.set_amax_reduction_group(mesh.get_group())  # the whole weight's amax, as a high-precision shard's
    param = nn.Parameter(dt, requires_grad=p.requires_grad)
    setattr(param, SLOT_ATTR, PrimaryShard(q, mesh.get_group(), who))
    _encode(param)
    return param


def is_tensor_parallel_primary(p: Any) -> bool:
    """Whether ``p`` is a tensor-parallel quantized primary weight (its FP32 master DTensor)."""
    return getattr(p, SLOT_ATTR, None) is not None


def _version(param: torch.Tensor) -> tuple:
    local = param._local_tensor  # type: ignore[attr-defined]
    return (param._version, id(local), local._version)


def _fingerprint(param: torch.Tensor) -> torch.Tensor:
    return fingerprint(param._local_tensor)  # type: ignore[attr-defined]


def _encode(param: torch.Tensor) -> None:
    slot: PrimaryShard = getattr(param, SLOT_ATTR)
    q = slot.quantizer
    q.set_usage(rowwise=True, columnwise=True)
    with torch.no_grad():
        shard = q.quantize(param._local_tensor.detach())  # type: ignore[attr-defined]
    shard.set_quantizer(q)
    slot.shard, slot.version, slot.fingerprint = shard, _version(param), _fingerprint(param)


def quantize_tensor_parallel_weights(params: Any) -> int:
    """Re-encode each tensor-parallel quantized primary weight's shard from its FP32 master shard.

    Parameters
    ----------
    params:
        A model (its parameters are scanned) or parameters; others are skipped. Collective:
        every rank of each tensor-parallel group calls it with the same weights in the same order
        (a per-tensor format all-reduces each weight's amax over the group).

    Returns
    -------
    int
        The number of weights re-encoded.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> hf.quantize_tensor_parallel_weights(torch.nn.Linear(4, 4))   # none: nothing to do
    0
    """
    seq: Iterable[Any] = params.parameters() if isinstance(params, nn.Module) else params
    n = 0
    for p in seq:
        if is_tensor_parallel_primary(p):
            _encode(p)
            n += 1
    return n


def primary_shard(param: torch.Tensor, weight_q: Optional[Quantizer] = None) -> Optional[QuantizedTensor]:
    """This rank's quantized shard of tensor-parallel primary weight ``param`` (None for any
    other parameter), after checking it was encoded from the master as it is now and, given the
    module's weight quantizer ``weight_q``, that the active recipe builds the same format.

    Raises
    ------
    RuntimeError
        The master changed after its shard was encoded.
    ValueError
        The active recipe's weight format differs from the one the weight is held in.
    """
    slot: Optional[PrimaryShard] = getattr(param, SLOT_ATTR, None)
    if slot is None:
        return None
    assert slot.shard is not None  # encoded by shard_primary
    if not (_version(param) == slot.version and same_fingerprint(_fingerprint(param), slot.fingerprint)):
        raise RuntimeError(
            f"{slot.who}: its FP32 master shard changed after its quantized shard was encoded, so the "
            "GEMMs would read stale codes. Step with hybridfp.MasterWeightOptimizer, or call "
            "hybridfp.quantize_tensor_parallel_weights(model) after updating the masters (e.g. after a load).")
    check_held_format(slot.quantizer, weight_q, slot.who)
    return slot.shard


def check_held_format(held: Quantizer, weight_q: Optional[Quantizer], who: str) -> None:
    """Refuse an active recipe whose weight quantizer ``weight_q`` builds another format than the
    one a quantized primary weight is held in (``held``, its quantizer); None: no check.

    Parameters
    ----------
    held:
        The quantizer the weight is held quantized with.
    weight_q:
        The active recipe's weight quantizer for the module's slot, or None.
    who:
        The module and parameter, for messages.

    Raises
    ------
    ValueError
        Naming both formats and the weight.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.integration.tensor_parallel_primary import check_held_format
    >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
    ...     lin = hf.Linear(32, 32)
    >>> check_held_format(lin.weight.quantizer, lin.weight.quantizer.copy(), "lin.weight")  # same format
    """
    if weight_q is not None and _format(weight_q) != _format(held):
        raise ValueError(f"{who}: the weight is held quantized as {_format(held)}, but the "
                         f"active recipe's weight quantizer is {_format(weight_q)}. Run the model under the "
                         "recipe given to quantized_model_init.")


__all__ = ["PrimaryShard", "check_held_format", "check_primary_quantizer", "is_tensor_parallel_primary", "master_value",
           "primary_shard", "quantize_tensor_parallel_weights", "set_master_value", "shard_primary"]
