"""The tensor-parallel collectives of ``tensor_parallel*.py``: along the rows of a 2D activation,
high precision (autograd functions) or quantized (one copy of a ``QuantizedTensor``).

All run ``torch.distributed`` collectives over the tensor-parallel group: all-reduce (SUM),
all-gather and reduce-scatter along dim 0 (the flattened rows: sequence x batch). A quantized
gather sends each row-indexed payload tensor of one copy (codes, block scales) as bytes, its row
axis first, all in one buffer per rank (the storage's row-index table says which axis of each
payload tensor the rows run along: a columnwise copy is stored transposed); per-tensor entries
are not sent: every rank computed them alike from an amax reduced over the group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from ..tensors.hybrid import HybridStorage


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


def all_gather_count(n: int, group: Any, device: torch.device) -> list[int]:
    """Every rank's ``n`` over ``group``, in rank order (one small all-gather on ``device``,
    the device the group's collectives run on; a host read follows).

    Parameters
    ----------
    n:
        This rank's count.
    group:
        The process group.
    device:
        Where the collective runs (the activations' device).

    Returns
    -------
    list[int]
        The ranks' counts, the same list on every rank.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out.tolist()


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
    storage = q.qstorage
    part = storage.part(direction)
    table = part._row_index[direction]
    rows, g = storage.rows, 1
    for spec in table.values():
        if spec is not None:
            g = math.lcm(g, spec[1])
    if rows % g:
        raise ValueError(
            f"{who}: each rank holds {rows} rows of the sequence-parallel input, but its {direction} copy "
            f"({part.describe()}) is blocked every {g} rows, so a block would straddle two ranks. Make "
            f"the local sequence x batch rows a multiple of {g}.")
    payload = part.payloads[direction]
    # each row-indexed tensor with its row axis first, as bytes, one after the other
    pieces = [(name, spec[0], payload[name].movedim(spec[0], 0).contiguous())
              for name, spec in sorted(table.items()) if spec is not None]
    flat = [t.reshape(-1).view(torch.uint8) for _, _, t in pieces]
    buf = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=storage.device)
    gathered = torch.empty(world * buf.numel(), dtype=torch.uint8, device=buf.device)
    dist.all_gather_into_tensor(gathered, buf, group=group)
    per_rank = gathered.view(world, buf.numel())
    whole = dict(payload)  # per-tensor entries: this rank's, equal on every rank
    offset = 0
    for (name, axis, t), b in zip(pieces, flat):
        chunk = per_rank[:, offset:offset + b.numel()].contiguous().view(t.dtype)
        whole[name] = chunk.reshape(world * t.shape[0], *t.shape[1:]).movedim(0, axis).contiguous()
        offset += b.numel()
    shape = torch.Size((world * storage.shape[0], *storage.shape[1:]))
    payloads = {ROWWISE: None, COLUMNWISE: None, direction: whole}
    if isinstance(storage, HybridStorage):  # one single-format part per copy
        parts = {ROWWISE: None, COLUMNWISE: None, direction: part._new(shape, payloads)}
        out = HybridStorage(shape, storage.dtype, parts[ROWWISE], parts[COLUMNWISE], label=storage.label)
    else:
        out = storage._new(shape, payloads)
    return QuantizedTensor(out, q.quantizer)


class CopyToParallel(torch.autograd.Function):
    """Forward: identity (the tensor is whole on every rank); backward: the gradient summed
    over the group (each rank computed a partial one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return all_reduce_sum(g.clone(), ctx.group), None  # autograd may still hold g


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
