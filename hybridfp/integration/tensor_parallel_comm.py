"""The tensor-parallel collectives of ``tensor_parallel*.py``: along the rows of a 2D activation,
high precision (autograd functions) or quantized (one copy of a ``QuantizedTensor``).

All run ``torch.distributed`` collectives over the tensor-parallel group: all-reduce (SUM),
all-gather and reduce-scatter along dim 0 (the flattened rows: sequence x batch). A quantized
gather sends each row-indexed payload tensor of one copy (codes, block scales) as bytes, in the
layout FSDP2's quantized gather uses (``fsdp_layout``); per-tensor entries are not sent: every
rank computed them alike from an amax reduced over the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..tensors import QuantizedTensor
from .fsdp_layout import assemble, gather_layout, granularity, pack, unpack


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` summed over ``group`` (in place on a contiguous copy; returned)."""
    t = t.contiguous()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    """The ranks' ``t`` [m, ...] stacked along dim 0, in rank order: [world * m, ...]."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def reduce_scatter_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` [world * m, ...] summed over ``group``; this rank's rows [m, ...] of the sum."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM, group=group)
    return out


def gather_quantized_rows(q: QuantizedTensor, direction: str, group: Any, who: str) -> QuantizedTensor:
    """The ranks' row shards of one quantized tensor as the whole tensor's ``direction`` copy.

    Parameters
    ----------
    q:
        This rank's rows [m, K], quantized with per-tensor amaxes reduced over ``group`` (so
        every rank holds the same per-tensor scale), holding the copy ``direction``.
    direction:
        "rowwise" or "columnwise": the copy sent (the other one is not).
    group:
        The tensor-parallel process group.
    who:
        Names the tensor in errors.

    Returns
    -------
    QuantizedTensor
        [world * m, K] holding the ``direction`` copy only: bitwise what quantizing the whole
        tensor makes, since every block lies within one rank's rows.

    Raises
    ------
    ValueError
        ``m`` is not a multiple of the copy's rows per block (a block would straddle two ranks).
    """
    world = dist.get_world_size(group)
    probe = QuantizedTensor(q.qstorage.shallow_copy(), q.quantizer)
    probe.update_usage(rowwise_usage=direction == "rowwise", columnwise_usage=direction == "columnwise")
    rows, g = probe.qstorage.rows, granularity(probe.qstorage)
    if rows % g:
        raise ValueError(
            f"{who}: each rank holds {rows} rows of the sequence-parallel input, but its {direction} copy "
            f"({probe.qstorage.describe()}) is blocked every {g} rows, so a block would straddle two "
            f"ranks. Make the local sequence x batch rows a multiple of {g}.")
    sent = (direction,)
    layout = gather_layout(probe, (sent,))
    buf = pack(probe, layout, sent)
    gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=buf.device)
    dist.all_gather_into_tensor(gathered, buf, group=group)
    return assemble(probe, world * rows, unpack(gathered, world, layout, sent))


class CopyToParallel(torch.autograd.Function):
    """Forward: identity (the tensor is whole on every rank); backward: the gradient summed
    over the group (each rank computed a partial one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return all_reduce_sum(g, ctx.group), None


class ReduceFromParallel(torch.autograd.Function):
    """Forward: the partial sums summed over the group; backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return g, None


class GatherRows(torch.autograd.Function):
    """Forward: all-gather along the rows; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return all_gather_rows(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return reduce_scatter_rows(g, ctx.group), None


class ReduceScatterRows(torch.autograd.Function):
    """Forward: reduce-scatter along the rows; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return all_gather_rows(g, ctx.group), None
