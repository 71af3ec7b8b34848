"""Expert parallelism's token exchange: ``expert_dispatch`` sends each token row to the rank
that owns its expert, ``expert_combine`` brings the experts' output rows back in the tokens'
original order.

Layout. With ``E`` experts over an expert-parallel group of ``P`` ranks, rank ``r`` owns the
``L = E / P`` consecutive experts ``r*L .. r*L + L - 1``. A rank's input rows are grouped by
global expert (``m_splits[e]`` rows for expert ``e``, as ``GroupedLinear`` takes them), so the
rows for rank ``d`` are one contiguous block: the data moves in one ``all_to_all_single``
(autograd-aware: its backward is the reverse exchange). Rank ``r`` then holds ``[from rank 0:
its rows for local experts 0..L-1 | from rank 1: ...]``; ``expert_dispatch`` reorders them
expert-major, ``[local expert 0: rows from rank 0, rank 1, ... | local expert 1: ...]``, so each
expert reads exactly the rows one process would give it for the concatenation of the ranks'
batches (rank order, each rank's order kept), in the same order: its GEMMs, and its per-tensor
amax (the expert's rows all live on its rank), are the single process's.

The reorderings are exact row gathers whose backward is the inverse gather (no scatter-add:
each gradient row is copied, not added to zero, so even a -0.0 survives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..quantizers import Quantizer
from .expert_parallel_wire import _QuantizedExchange, checked_wire_quantizer
from .grouped_linear import _split_counts

#: dtypes by a small id sent with the routing counts, so that ranks disagreeing on the token
#: dtype are told so instead of exchanging bytes of different widths
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _dtype_id(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + dtype.itemsize


def resolve_group(group: Union[None, dist.ProcessGroup, "dist.device_mesh.DeviceMesh"],
                  mesh_dim: Union[None, int, str] = None) -> dist.ProcessGroup:
    """The process group of an expert-parallel dimension.

    Parameters
    ----------
    group:
        A ``ProcessGroup``, a ``DeviceMesh`` (1-D, or with ``mesh_dim``), or None for the
        default (world) group.
    mesh_dim:
        The mesh dimension (index or name) when ``group`` is a multi-dimensional mesh.

    Returns
    -------
    ProcessGroup

    Raises
    ------
    RuntimeError
        torch.distributed is not initialized.
    ValueError
        A multi-dimensional mesh without ``mesh_dim``, or ``mesh_dim`` given with a group.
    TypeError
        ``group`` is neither.

    Example
    -------
    >>> import torch.distributed as dist
    >>> from hybridfp.moe.expert_parallel_comm import resolve_group
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> resolve_group(None) is dist.group.WORLD
    True
    >>> dist.destroy_process_group()
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first.")
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(group, DeviceMesh):
        if mesh_dim is None and group.ndim != 1:
            raise ValueError(f"expert parallelism: the DeviceMesh has {group.ndim} dimensions "
                             f"{group.mesh_dim_names}; pass mesh_dim= naming the expert-parallel one.")
        return group.get_group(mesh_dim if mesh_dim is not None else 0)
    if mesh_dim is not None:
        raise ValueError("expert parallelism: mesh_dim is for a DeviceMesh; a process group has "
                         "one dimension.")
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"expert parallelism: group must be a ProcessGroup, a DeviceMesh or None; "
                        f"got {type(group).__name__}.")
    return group


class _Rows(torch.autograd.Function):
    """``x[index]`` whose backward is ``grad[inverse]``: a permutation both ways, exact."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` of rows, waited on: a plain tensor."""
    y = funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else y


@dataclass(frozen=True)
class ExpertDispatch:
    """What :func:`expert_combine` needs to send a ``expert_dispatch``'s expert outputs back.

    Attributes
    ----------
    group:
        The expert-parallel process group.
    num_experts:
        Experts over the whole group.
    send_splits, recv_splits:
        Rows this rank sent to / received from each rank of the group.
    recv_counts:
        ``recv_counts[s][i]``: rows rank ``s`` sent to this rank's local expert ``i``.
    local_splits:
        Rows per local expert, in the dispatched (expert-major) order: the ``m_splits`` of
        this rank's ``GroupedLinear``.
    order, inverse:
        The expert-major permutation of the received rows and its inverse (index tensors).

    Example
    -------
    See :func:`expert_dispatch` (which returns one) and :func:`expert_combine` (which reads it).
    """

    group: dist.ProcessGroup
    num_experts: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_counts: tuple[tuple[int, ...], ...]
    local_splits: tuple[int, ...]
    order: torch.Tensor
    inverse: torch.Tensor

    @property
    def rows(self) -> int:
        """Rows this rank's experts process."""
        return sum(self.local_splits)


def _check_same_on_ranks(values: Sequence[int], names: Sequence[str], group: dist.ProcessGroup,
                         device: torch.device, who: str, refused: Optional[Exception] = None) -> None:
    """Raise on every rank of ``group`` when a rank refused its inputs or the ranks' ``values``
    differ (one all_gather), so that no rank is left waiting in the exchange.

    Parameters
    ----------
    values, names:
        This rank's integers and what each is, for the message.
    group, device:
        The group and the device of the collective's tensors.
    who:
        The caller, for the message.
    refused:
        This rank's own error with its inputs, if any: raised here once every rank knows.

    Raises
    ------
    ValueError, TypeError
        ``refused`` on its rank; on the others, a ValueError naming the ranks that refused;
        else a ValueError when some rank's values differ (every rank raises the same message).
    """
    size = dist.get_world_size(group)
    mine = torch.tensor([int(refused is not None), *values], dtype=torch.int64, device=device)
    every = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    # all_gather_single is all_gather_into_tensor's newer name (the old one warns on torch 2.13)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(every, mine, group=group)
    rows = every.view(size, mine.numel()).tolist()
    if refused is not None:
        raise refused
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        raise ValueError(f"{who}: rank(s) {bad} of the expert-parallel group refused their inputs (their "
                         "error says why); no rows were exchanged.")
    for j, name in enumerate(names, start=1):
        seen = [r[j] for r in rows]
        if len(set(seen)) > 1:
            raise ValueError(f"{who}: the ranks of the expert-parallel group disagree on {name}: "
                             f"{seen} (by rank); every rank must pass the same.")


def _local_inputs(x: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor], size: int,
                  wire_quantizer: Optional[Quantizer], who: str) -> tuple[list[int], Optional[Quantizer], int, int]:
    """expert_dispatch's checks of one rank's own inputs: the row counts, the wire quantizer and
    the bytes it sends per row and once (the rows' own bytes and 0 without one)."""
    if x.dim() != 2:
        raise ValueError(f"{who}: x must be [tokens, hidden]; got shape {tuple(x.shape)} (flatten the "
                         "leading dimensions first).")
    splits = _split_counts(m_splits, who)
    if not splits or len(splits) % size:
        raise ValueError(f"{who}: m_splits has {len(splits)} entries (experts) but the expert-parallel "
                         f"group has {size} ranks; the number of experts must be a positive multiple "
                         "of the group's size.")
    if any(m < 0 for m in splits):
        raise ValueError(f"{who}: m_splits {splits} has negative entries.")
    if sum(splits) != x.shape[0]:
        raise ValueError(f"{who}: m_splits sum to {sum(splits)} but x has {x.shape[0]} rows; pass the "
                         "rows of each expert, x's rows grouped by expert.")
    if wire_quantizer is None:
        return splits, None, x.shape[1] * x.element_size(), 0
    return (splits, *checked_wire_quantizer(wire_quantizer, x.shape[1], x.device))


def expert_dispatch(x: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor],
                    group: Union[None, dist.ProcessGroup, "dist.device_mesh.DeviceMesh"] = None, *,
                    mesh_dim: Union[None, int, str] = None, check: bool = True,
                    wire_quantizer: Optional[Quantizer] = None
                    ) -> tuple[torch.Tensor, list[int], ExpertDispatch]:
    """Send each row of ``x`` to the rank that owns its expert (collective over ``group``).

    Parameters
    ----------
    x:
        [tokens, hidden] rows grouped by global expert (e.g. a stable sort of the routed
        (token, slot) pairs by expert id), autograd flows through.
    m_splits:
        Rows per global expert (``num_experts`` entries, zeros allowed; a list of ints or a
        1-D integer tensor). ``num_experts`` must be a multiple of the group's size; rank
        ``r`` owns experts ``r*L .. r*L+L-1`` with ``L = num_experts / size``.
    group, mesh_dim:
        The expert-parallel group: a ``ProcessGroup``, a ``DeviceMesh`` (with ``mesh_dim``
        when it has several dimensions) or None (world).
    check:
        Also check, with one small all_gather, that every rank has the same number of experts
        and the same row width and dtype (a mismatch would otherwise exchange bytes of
        different sizes). The per-call routing message carries width and dtype in any case.
    wire_quantizer:
        Send the rows encoded by this quantizer's rowwise format (its bytes on the wire, e.g.
        ``hybridfp.MXFP8Quantizer()``: 1 + 1/32 bytes an element) and decode them to ``x``'s
        dtype on arrival; the backward sends the gradient in ``x``'s dtype (straight-through).
        Row-local formats only (FP8 per-tensor, MXFP8 1x32, FP8 block 1x128); every rank must
        pass an equal one. The experts then read the decoded rows: a recipe of the same
        row-local format makes the same forward operand from them, its columnwise copy (weight
        gradient) comes from the decoded rows (``hybridfp.moe.expert_parallel_wire``).

    Returns
    -------
    tuple
        ``(local_x, local_splits, handle)``: this rank's experts' rows expert-major
        ([sum(local_splits), hidden]), rows per local expert (the local ``GroupedLinear``'s
        ``m_splits``), and the :class:`ExpertDispatch` that :func:`expert_combine` takes.

    Raises
    ------
    ValueError
        ``x`` not 2-D; ``m_splits`` of the wrong sum or with negative entries; experts not
        divisible by the group's size; ranks disagreeing on experts, width, dtype or wire
        encoding; a ``wire_quantizer`` with blocks spanning rows or stochastic rounding.
    TypeError
        ``m_splits`` not integer counts; ``group`` of the wrong type; ``wire_quantizer`` not a
        single-format hybridfp Quantizer.
    RuntimeError
        torch.distributed not initialized.

    Example
    -------
    >>> import torch, torch.distributed as dist, hybridfp as hf
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> x = torch.randn(5, 8)
    >>> local_x, local_splits, handle = hf.expert_dispatch(x, [2, 3])   # one rank: both experts
    >>> local_splits
    [2, 3]
    >>> torch.equal(hf.expert_combine(local_x * 2, handle), x * 2)
    True
    >>> dist.destroy_process_group()
    """
    who = "expert dispatch"
    pg = resolve_group(group, mesh_dim)
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    try:
        splits, wire, row_bytes, once_bytes = _local_inputs(x, m_splits, size, wire_quantizer, who)
    except (ValueError, TypeError) as e:
        if not check:
            raise
        # tell the other ranks first, so that none waits in the exchange for this one
        _check_same_on_ranks((-1, -1, -1), (), pg, x.device, who, refused=e)
    num_experts, local = len(splits), len(splits) // size
    if check:
        _check_same_on_ranks((num_experts, x.shape[1], _dtype_id(x.dtype)),
                             ("the number of experts (len(m_splits))", "x's width", "x's dtype"),
                             pg, x.device, who)
    # after the counts, each rank's routing message says what its rows are: width, dtype id,
    # bytes sent per row and once (a wire quantizer's encoding; else the rows' own bytes, 0)
    head = [x.shape[1], _dtype_id(x.dtype), row_bytes, once_bytes]
    # the routing message: per destination rank, its experts' counts, then the header
    msg = torch.tensor(splits, dtype=torch.int64).view(size, local)
    msg = torch.cat([msg, torch.tensor([head] * size)], 1).to(x.device)
    got = torch.empty_like(msg)
    dist.all_to_all_single(got, msg, group=pg)
    got_rows = got.tolist()  # the host needs the counts: the exchange's split sizes
    for s, row in enumerate(got_rows):
        if row[local:local + 2] != head[:2]:
            raise ValueError(f"{who}: rank {s} sends rows of width {row[local]} (dtype id {row[local + 1]}) "
                             f"but rank {rank} has width {x.shape[1]} ({x.dtype}); every rank must "
                             "dispatch rows of one width and dtype.")
        if row[local + 2:] != head[2:]:
            raise ValueError(f"{who}: rank {s} sends {row[local + 2]} bytes a row (+ {row[local + 3]} once) "
                             f"but rank {rank} sends {head[2]} (+ {head[3]}); every rank must pass an "
                             "equal wire_quantizer (or none).")
    recv_counts = tuple(tuple(row[:local]) for row in got_rows)
    send_splits = [sum(splits[d * local:(d + 1) * local]) for d in range(size)]
    recv_splits = [sum(c) for c in recv_counts]
    local_splits = [sum(c[i] for c in recv_counts) for i in range(local)]
    order, inverse = _expert_major(recv_counts, x.device)
    received = (_exchange(x, recv_splits, send_splits, pg) if wire is None
                else _QuantizedExchange.apply(x, wire, recv_splits, send_splits, pg))
    handle = ExpertDispatch(pg, num_experts, tuple(send_splits), tuple(recv_splits), recv_counts,
                            tuple(local_splits), order, inverse)
    return _Rows.apply(received, order, inverse), local_splits, handle


def _expert_major(counts: tuple[tuple[int, ...], ...], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The permutation taking rows stored [source rank][local expert] to [local expert][source
    rank] (each block's rows in their order), and its inverse."""
    c = torch.tensor(counts, dtype=torch.int64, device=device)            # [source, expert]
    flat = c.flatten()
    starts = (flat.cumsum(0) - flat).view_as(c)                           # where each block begins
    lens, begins = c.t().flatten(), starts.t().flatten()                  # blocks expert-major
    total = sum(map(sum, counts))
    within = torch.arange(total, device=device) - torch.repeat_interleave(lens.cumsum(0) - lens, lens,
                                                                          output_size=total)
    order = torch.repeat_interleave(begins, lens, output_size=total) + within
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total, device=device)
    return order, inverse


def expert_combine(y: torch.Tensor, handle: ExpertDispatch, *, check: bool = True) -> torch.Tensor:
    """Send the local experts' output rows back to their tokens' ranks (collective).

    Parameters
    ----------
    y:
        [handle.rows, out] rows in :func:`expert_dispatch`'s expert-major order (what the local
        experts returned for ``local_x``).
    handle:
        The :class:`ExpertDispatch` of the matching ``expert_dispatch``.
    check:
        Check with one small all_gather that every rank's ``y`` has the same width and dtype.

    Returns
    -------
    torch.Tensor
        [tokens, out]: row j is the output for row j of the ``x`` given to ``expert_dispatch``.

    Raises
    ------
    ValueError
        ``y`` is not 2-D with ``handle.rows`` rows; ranks disagreeing on ``y``'s width or dtype.
    TypeError
        ``handle`` is not an :class:`ExpertDispatch`.

    Example
    -------
    See :func:`expert_dispatch`.
    """
    who = "expert combine"
    if not isinstance(handle, ExpertDispatch):
        raise TypeError(f"{who}: handle must be the ExpertDispatch that expert_dispatch() returned; got "
                        f"{type(handle).__name__}.")
    refused = None
    if y.dim() != 2 or y.shape[0] != handle.rows:
        refused = ValueError(f"{who}: y must be [{handle.rows}, out] (the rows expert_dispatch() gave this "
                             f"rank's experts, in its order); got shape {tuple(y.shape)}.")
        if not check:
            raise refused
    if check:  # every rank raises when one refused its y: none waits in the exchange
        _check_same_on_ranks((y.shape[-1], _dtype_id(y.dtype)), ("the experts' output width", "its dtype"),
                             handle.group, y.device, who, refused)
    by_source = _Rows.apply(y, handle.inverse, handle.order)
    return _exchange(by_source, list(handle.send_splits), list(handle.recv_splits), handle.group)


__all__ = ["ExpertDispatch", "expert_combine", "expert_dispatch", "resolve_group"]
