"""``ExpertParallel``: an MoE block's experts spread over the ranks of one expert-parallel group.

Each rank holds ``num_experts / ep_size`` experts (e.g. an fc1 / activation / fc2 stack of
``GroupedLinear`` with that many gemms); a forward dispatches the rank's routed token rows to
the experts' ranks (``expert_dispatch``: one ``all_to_all_single`` of the rows, autograd-aware),
runs the local experts on the rows they received, and combines the outputs back to the tokens'
ranks in their original order (``expert_combine``). Each expert sees the rows, in the order, that
a single process holding every expert would give it for the ranks' batches concatenated in rank
order, so its quantization (per-tensor amaxes included: no cross-rank reduction) and its GEMMs
are that process's. The exchange itself is in ``expert_parallel_comm.py``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..quantizers import Quantizer
from .expert_parallel_comm import _check_same_on_ranks, expert_combine, expert_dispatch, resolve_group
from .grouped_linear import GroupedLinear, _split_counts


class ExpertParallel(nn.Module):
    """Run ``experts`` (this rank's share of an MoE layer's experts) on the tokens routed to
    them from every rank of the expert-parallel group.

    Rank ``r`` of a group of ``P`` ranks owns global experts ``r*L .. r*L+L-1``, ``L =
    num_experts / P``; ``experts(x, m_splits)`` is called with the rows of those ``L`` experts
    (``m_splits`` of length ``L``), so a ``GroupedLinear`` inside it has ``L`` gemms.
    ``forward`` is a collective: every rank of the group calls it, in the same order.

    Parameters
    ----------
    experts:
        A module called as ``experts(x, m_splits)`` with x [rows, hidden] grouped by local
        expert (e.g. fc1 -> activation -> fc2, each a ``GroupedLinear(L, ...)``).
    num_experts:
        Experts over the whole group: a multiple of the group's size.
    group:
        The expert-parallel group: a ``ProcessGroup``, a ``DeviceMesh`` (1-D, or with
        ``mesh_dim``) or None for the world group. torch.distributed must be initialized.
    mesh_dim:
        The mesh dimension (index or name) of a multi-dimensional ``DeviceMesh``.
    check_each_call:
        Check on every forward (one small all_gather each way) that the ranks agree on the
        number of experts and the rows' width and dtype; by default only the first forward
        checks (a rank whose dtype changes later is still caught by the routing message).
    wire_quantizer:
        Send the tokens encoded by this row-local quantizer (e.g. ``hybridfp.MXFP8Quantizer()``)
        instead of in their dtype: see :func:`hybridfp.expert_dispatch`.

    Raises
    ------
    ValueError
        ``num_experts`` not a positive multiple of the group's size; a ``GroupedLinear`` in
        ``experts`` whose ``num_gemms`` is not ``num_experts / size``. From ``forward``: see
        :func:`hybridfp.expert_dispatch`.
    TypeError, RuntimeError
        As :func:`hybridfp.moe.expert_parallel_comm.resolve_group`.

    Example
    -------
    >>> import torch, torch.distributed as dist, hybridfp as hf
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> class Experts(torch.nn.Module):
    ...     def __init__(self, local: int) -> None:
    ...         super().__init__()
    ...         self.fc1, self.fc2 = hf.GroupedLinear(local, 32, 64), hf.GroupedLinear(local, 64, 32)
    ...     def forward(self, x, m_splits):
    ...         return self.fc2(torch.nn.functional.gelu(self.fc1(x, m_splits)), m_splits)
    >>> ep = hf.ExpertParallel(Experts(4), num_experts=4)   # 4 experts / 1 rank
    >>> x = torch.randn(10, 32, requires_grad=True)        # rows sorted by expert
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = ep(x, [3, 0, 5, 2])
    >>> y.sum().backward()
    >>> y.shape, ep.local_experts
    (torch.Size([10, 32]), range(0, 4))
    >>> dist.destroy_process_group()
    """

    def __init__(self, experts: nn.Module, num_experts: int,
                 group: Union[None, dist.ProcessGroup, "dist.device_mesh.DeviceMesh"] = None, *,
                 mesh_dim: Union[None, int, str] = None, check_each_call: bool = False,
                 wire_quantizer: Optional[Quantizer] = None) -> None:
        super().__init__()
        pg = resolve_group(group, mesh_dim)
        size = dist.get_world_size(pg)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 \
                or num_experts % size:
            raise ValueError(f"ExpertParallel: num_experts={num_experts!r} must be a positive multiple of "
                             f"the expert-parallel group's size ({size}): each rank holds "
                             "num_experts / size experts.")
        local = num_experts // size
        for name, m in experts.named_modules():
            if isinstance(m, GroupedLinear) and m.num_gemms != local:
                raise ValueError(f"ExpertParallel: GroupedLinear {name or '(experts)'} has num_gemms="
                                 f"{m.num_gemms}, but each of the {size} ranks holds {num_experts} / "
                                 f"{size} = {local} experts; build it with num_gemms={local}.")
        self.experts = experts
        self.num_experts, self.num_local_experts = num_experts, local
        self.group, self.ep_size, self.ep_rank = pg, size, dist.get_rank(pg)
        self.check_each_call, self.wire_quantizer = check_each_call, wire_quantizer
        self._checked = False  # the first forward checks the ranks agree (collective, every rank)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank holds."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def forward(self, x: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
        """x: [tokens, hidden], rows grouped by global expert -> [tokens, out], row j the
        experts' output for row j (collective over the group).

        Parameters
        ----------
        x:
            This rank's routed rows, grouped by global expert (a stable sort by expert id).
        m_splits:
            Rows per global expert: ``num_experts`` non-negative ints (or an integer tensor).

        Returns
        -------
        torch.Tensor
            The experts' outputs in ``x``'s row order.

        Raises
        ------
        ValueError, TypeError
            As :func:`hybridfp.expert_dispatch` (``m_splits`` of the wrong length or sum, ranks
            disagreeing on experts, width or dtype) and the experts' own errors.

        Example
        -------
        See :class:`ExpertParallel`.
        """
        check = self.check_each_call or not self._checked
        try:
            m_splits = _split_counts(m_splits, "ExpertParallel")  # one host read of a tensor
            if len(m_splits) != self.num_experts:
                raise ValueError(f"ExpertParallel: m_splits has {len(m_splits)} entries; it needs one per "
                                 f"global expert ({self.num_experts}).")
        except (ValueError, TypeError) as e:
            if not check:
                raise
            # the other ranks are about to check with this one: raise on all of them
            _check_same_on_ranks((-1, -1, -1), (), self.group, x.device, "expert dispatch", refused=e)
        local_x, local_splits, handle = expert_dispatch(x, m_splits, self.group, check=check,
                                                      wire_quantizer=self.wire_quantizer)
        y = expert_combine(self.experts(local_x, local_splits), handle, check=check)
        self._checked = True
        return y

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, ep_size={self.ep_size}, ep_rank={self.ep_rank}, "
                f"local_experts={self.local_experts}")


__all__ = ["ExpertParallel"]
