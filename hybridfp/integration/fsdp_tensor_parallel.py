"""FSDP2's quantized all-gather of tensor-parallel weights (a 2-D ``(dp, tp)`` mesh).

A hybridfp module parallelized with hybridfp's styles (``ColwiseParallel``, ``RowwiseParallel``,
``LayerNormMLPParallel``) holds each weight as a DTensor on the tensor-parallel mesh; its local
tensor is the rank's shard (column-parallel: rows of the weight, row-parallel: columns), which
the tensor-parallel layer quantizes as one tensor, its per-tensor amax (FP8 current scaling,
NVFP4's global amax) reduced over the tensor-parallel group: the whole weight's amax
(``tensor_parallel_linear.set_amax_groups``). ``fully_shard(..., mesh=mesh["dp"])`` then splits
that local tensor along its rows over the ``dp`` ranks.

Here the tensor-parallel local tensor plays the part a whole weight plays in ``fsdp.py``: its
dp shard is wrapped (:func:`wrap_tensor_parallel`), each gather encodes the dp shards with the
amax reduced over the dp group and then the tensor-parallel group (:class:`MeshAmax`: MAX of
maxima, so the same number as the tensor-parallel layer's), and the gathered copies are bitwise
the tensor-parallel layer's own quantization of its local tensor; FSDP2 wraps them back in the
DTensor and the layer reads them as a quantized parameter. Block formats: the tensor-parallel
split must keep blocks whole (the layer's own check, run before the gather,
:func:`check_tensor_parallel_blocks`); within the dp split a block may straddle shards
(``fsdp_layout``'s halo rows).

Quantized primary weights (``quantized_model_init`` under the tensor-parallel styles): the
parameter is the FP32 master DTensor; FSDP2 shards its tp shard over dp, and each (dp, tp) rank
keeps its FP32 master piece and the quantized copies of that piece, encoded once per optimizer
step with the amax reduced over dp, then tp (``fsdp_primary``); the gathers send those codes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .tensor_parallel_linear import check_split
from .tensor_parallel_primary import is_tensor_parallel_primary


class MeshAmax:
    """Stands in for a process group in a quantizer's amax reduction: all-reduces (MAX) over
    each of ``groups`` in turn (dp, then tp), which gives the maximum over every rank of the
    2-D mesh (``quantizers.base.all_reduce_amax`` calls ``reduce_amax``).

    Parameters
    ----------
    groups:
        The process groups, reduced over in this order.

    Example
    -------
    >>> import torch
    >>> from hybridfp.integration.fsdp_tensor_parallel import MeshAmax
    >>> MeshAmax(()).reduce_amax(torch.tensor(3.0))   # no group: unchanged
    tensor(3.)
    """

    def __init__(self, groups: tuple) -> None:
        self.groups = tuple(groups)

    def reduce_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """Reduce ``amax`` in place over every group; returns it."""
        import torch.distributed as dist
        for g in self.groups:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g)
        return amax

    def __deepcopy__(self, memo: dict) -> "MeshAmax":
        return self  # process-group handles are shared, never copied (Quantizer.copy)


def tensor_parallel_spec(module: nn.Module, index: int) -> Optional[Any]:
    """The tensor-parallel split (``ParallelGemm``) of ``module``'s weight slot ``index``, or
    None where the module is not parallelized by hybridfp's styles."""
    plan = getattr(module, "_tensor_parallel", None)
    if plan is None:
        return None
    return plan.specs[index]


def is_gated_fc1(module: nn.Module, index: int) -> bool:
    """Whether slot ``index`` is a gated ``LayerNormMLP``'s fc1 ([gate_r; up_r] on each rank)."""
    plan = getattr(module, "_tensor_parallel", None)
    return bool(plan is not None and plan.gated and index == 0)


def check_tensor_parallel_blocks(q: Any, module: nn.Module, index: int, local_shape: tuple, who: str) -> None:
    """Refuse, before the gather, a tensor-parallel split whose blocks would straddle two
    tensor-parallel ranks (the layer's own rule, ``check_split``).

    Parameters
    ----------
    q:
        The gather's weight quantizer.
    module, index:
        The tensor-parallel module and its weight slot.
    local_shape:
        The rank's tensor-parallel local weight shape (what FSDP2 shards over dp).
    who:
        The weight's name for errors.

    Raises
    ------
    ValueError
        Naming the layer, the size on each rank and the block size.
    """
    spec = tensor_parallel_spec(module, index)
    split = spec.split_slots()["weight"]
    check_split(q, "weight", split, local_shape[0], local_shape[1], spec, halves=is_gated_fc1(module, index))


def wrap_tensor_parallel(module: nn.Module, attr: str, p: nn.Parameter, wrap: Any) -> nn.Parameter:
    """``p`` (a tensor-parallel DTensor parameter) with its local tensor wrapped by ``wrap``
    (``local -> QuantizedGatherWeight``): the same DTensor placement, FSDP2 finds the gather
    hooks on the local tensor it shards. A tensor-parallel quantized primary weight
    (``quantized_model_init``: ``p`` is its FP32 master) becomes a ``QuantizedPrimaryWeight``
    of the same gather slot (``fsdp_primary.tensor_parallel_primary_local``).

    Raises
    ------
    ValueError
        ``p`` was not placed by hybridfp's tensor-parallel styles, is already sharded by FSDP2,
        or is placed over more than one mesh dimension.
    """
    from torch.distributed.tensor import DTensor

    who = f"{type(module).__name__}.{attr}"
    if getattr(module, "_tensor_parallel", None) is None:
        raise ValueError(
            f"{who} is a DTensor ({p.placements}) not placed by hybridfp's tensor-parallel styles: either "
            "FSDP2 sharded it already (call enable_quantized_all_gather before fully_shard) or another "
            "parallel style placed it (the quantized all-gather takes tensor-parallel weights from "
            "hybridfp.ColwiseParallel / RowwiseParallel / LayerNormMLPParallel on mesh['tp'], then "
            "fully_shard(..., mesh=mesh['dp'])).")
    if p.device_mesh.ndim != 1:
        raise ValueError(
            f"{who} is a DTensor over a {p.device_mesh.ndim}-D mesh (placements {p.placements}): FSDP2 has "
            "sharded it already. Call enable_quantized_all_gather before fully_shard.")
    local = p._local_tensor
    if type(local) is not torch.Tensor:
        raise ValueError(f"{who}'s local tensor is a {type(local).__name__}; the quantized all-gather takes a "
                         "high-precision tensor-parallel weight (call enable_quantized_all_gather before fully_shard).")
    held = wrap(local)
    if is_tensor_parallel_primary(p):  # quantized_model_init: its FP32 master, its codes kept per piece
        from .fsdp_primary import tensor_parallel_primary_local
        held = tensor_parallel_primary_local(p, held._slot)
    wrapped = DTensor(held, p._spec, requires_grad=p.requires_grad)
    return nn.Parameter(wrapped, requires_grad=p.requires_grad)
