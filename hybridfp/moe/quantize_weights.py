"""``quantize_weights_grouped``: the experts' weights of one shape quantized as the row groups
of their stack, bitwise each expert's own ``quantize``; Identity passthroughs wrap each weight
(or its buffer) without a cast.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..config import current_policy
from ..formats.common import HIGH_PRECISION_DTYPES
from ..tensors import QuantizedTensor
from ..quantizers.backends import QUANTIZE_KERNELS
from ..quantizers.base import Quantizer
from ..quantizers.identity import IdentityQuantizer
from .assemble import expert_group
from .grouped_tensor import GroupedTensor
from .plan import PlanMemo, plan_for
from .quantize import quantize_grouped
from .quantize_scaled import BOTH


def quantize_weights_grouped(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor],
                             plans: Optional[PlanMemo] = None, stacked: Optional[torch.Tensor] = None
                             ) -> Union[list[QuantizedTensor], GroupedTensor]:
    """``[q.quantize(w) for q, w in zip(quantizers, weights)]`` for experts' [N, K] weights of
    one shape, bitwise: the weights are joined to [E*N, K] (``stacked`` viewed, else one copy)
    and quantized as row groups of N rows, so row-local / tile-local copies and columnwise block
    copies (N a whole number of blocks: no padding) are encoded once for all experts.

    Parameters
    ----------
    quantizers, weights:
        One quantizer and one [N, K] weight per expert.
    plans:
        The caller's plan memo (``plan.PlanMemo``), or None to plan afresh.
    stacked:
        The caller's contiguous [E, N, K] tensor whose ``unbind(0)`` views ``weights`` are
        (``GroupedLinear``'s packed buffer, or its ``single_parameter`` Parameter): read in
        place as the joined weights. The caller states the layout; the weights are never
        inspected for one, so without it they are joined by one copy.

    Returns
    -------
    The experts' tensors: a ``GroupedTensor`` where the encodings are shared, else a list.

    Raises
    ------
    ValueError
        Weights of different shapes, or a ``stacked`` that is not their contiguous stack.
    """
    shape = weights[0].shape
    if any(w.shape != shape or w.dim() != 2 for w in weights):
        raise ValueError(f"quantize_weights_grouped: the experts' weights must be 2D of one shape; got "
                         f"{sorted({tuple(w.shape) for w in weights})}.")
    if stacked is not None and (stacked.dim() != 3 or stacked.shape[0] != len(weights) or stacked.shape[1:] != shape
                                or not stacked.is_contiguous()):
        raise ValueError(f"quantize_weights_grouped: stacked must be the contiguous [{len(weights)}, "
                         f"{', '.join(map(str, shape))}] tensor the weights are views of; got "
                         f"{tuple(stacked.shape)}, strides {stacked.stride()}.")
    joined = stacked if len(weights) >= 2 else None
    with torch.no_grad():
        if not _worth_stacking(quantizers, weights, plans, joined):
            if _passthrough(quantizers, weights):
                return (_passthrough_group(quantizers, weights, joined)
                        or [_wrap_weight(q, w) for q, w in zip(quantizers, weights)])
            return [q.quantize(w) for q, w in zip(quantizers, weights)]
        # the caller's buffer is read in place; otherwise one joining copy
        whole = joined if joined is not None else torch.stack(list(weights))
        whole = whole.reshape(-1, shape[1])
        out = quantize_grouped(list(quantizers), whole, [shape[0]] * len(weights), plans)
    return out if isinstance(out, GroupedTensor) else [t for t in out if t is not None]


def _passthrough(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor]) -> bool:
    """Whether every expert's quantize() is an Identity passthrough with no cast (its tensor
    wraps the weight itself): plain ``IdentityQuantizer`` instances (no subclass, nothing
    wrapped on the instance, no quantize kernel registered for them) asked for some copy, of
    the weights' own dtype (None or equal), weights of a dtype quantizers read."""
    if QUANTIZE_KERNELS.get(IdentityQuantizer):
        return False
    return all(type(q) is IdentityQuantizer and not ({"quantize", "encode", "reference_encode"} & vars(q).keys())
               and q.dtype in (None, w.dtype) and w.dtype in HIGH_PRECISION_DTYPES
               and (q.rowwise_usage or q.columnwise_usage) for q, w in zip(quantizers, weights))


def _passthrough_group(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor],
                       stacked: Optional[torch.Tensor]) -> Optional[GroupedTensor]:
    """The passthrough experts (``_passthrough``) as one joined Identity copy over the caller's
    ``stacked`` buffer (``GroupedLinear``'s packed weights or its one Parameter): its
    per-expert tensors are ``_wrap_weight``'s (the same values, as views of the buffer)."""
    if stacked is None or any(q.rowwise_usage != quantizers[0].rowwise_usage
                              or q.columnwise_usage != quantizers[0].columnwise_usage for q in quantizers):
        return None
    rows = quantizers[0].reference_encode(stacked.reshape(-1, weights[0].shape[1]), True, False)
    return expert_group(quantizers, [weights[0].shape[0]] * len(weights), rows, None, None, False, None)


def _wrap_weight(q: IdentityQuantizer, w: torch.Tensor) -> QuantizedTensor:
    """``q.quantize(w)`` for a passthrough ``q`` (``_passthrough``), without its dispatch
    (quantize -> encode -> kernel lookup, host work repeated per expert, timed by ``python -m
    bench.bench_moe_overhead``): the reference encode,
    which wraps the detached weight, one payload for both copies."""
    return QuantizedTensor(q.reference_encode(w.detach(), q.rowwise_usage, q.columnwise_usage), q)


def _worth_stacking(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor],
                    plans: Optional[PlanMemo], joined: Optional[torch.Tensor]) -> bool:
    """Whether one encoding of the joined weights saves work: some copy is shared, and not
    only Identity passthroughs (each expert's is a view of its weight; stacking would copy),
    and, for per-tensor scales (``BOTH``: the stack shares launches, not encodings), weights
    small enough that the stacking copy costs less than the launches it saves
    (the policy's ``stack_scaled_max_numel``), or already one buffer (``joined``: the caller's)."""
    if len(weights) < 2 or len({w.dtype for w in weights}) > 1:
        return False
    plan = plan_for(list(quantizers), [weights[0].shape[0]] * len(weights), plans)
    if plan is None:
        return False
    if plan.scaled == BOTH and weights[0].numel() > current_policy().stack_scaled_max_numel:
        return joined is not None
    return any(q is not None and not isinstance(q, IdentityQuantizer) for q in (plan.row_q, plan.col_q))
