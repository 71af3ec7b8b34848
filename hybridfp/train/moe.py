"""A top-k mixture-of-experts MLP with hybridfp GroupedLinear experts.

    h       = norm(x)                                    # high precision
    p       = softmax(router(h))   [T, E]                # FP32 router (high precision)
    g, e    = topk(p, k); g /= g.sum(-1)                 # k experts per token
    order   = argsort(e.flatten(), stable)               # tokens sorted by expert
    m_splits= bincount(e, E)                             # rows per expert (zeros allowed)
    y_s     = fc2(act(fc1(h[order // k], m_splits)), m_splits)   # two GroupedLinear
    out     = sum_k g * unsort(y_s)                      # deterministic (no scatter-add)
    aux     = E * sum_e f_e * P_e                        # Switch load-balancing loss

f_e is the fraction of routed assignments that went to expert e, P_e the mean router
probability of e. Spread over ranks (``hybridfp train --fsdp / --ep``), f_e counts the routed
rows of every rank (``stats_group``) and the experts may live on other ranks
(:meth:`MoE.use_expert_parallel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..moe import ExpertParallel, GroupedLinear
from ..nn import Linear, swiglu
from ..tensors import QuantizedTensor

if TYPE_CHECKING:  # model.py imports this module; the config type is for annotations only
    from .model import GPTConfig


def activation(h: torch.Tensor, kind: str, fused: bool = False,
               splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    """SwiGLU (h = [gate | up]) or GELU (tanh approximation).

    Parameters
    ----------
    h:
        The fc layer's output ([..., 2F] for SwiGLU).
    kind:
        "swiglu" or "gelu".
    fused:
        SwiGLU through ``hybridfp.swiglu`` (one Triton kernel each way on CUDA, the halves read
        in place; the same eager ops off CUDA) instead of ``F.silu(gate) * up``.
    splits:
        With ``fused``: the experts' rows of a 2D ``h`` (an MoE layer's), so the kernels record
        each expert's amax for the next GroupedLinear under FP8 current scaling.

    Returns
    -------
    torch.Tensor
        The activation, [..., F] for SwiGLU, ``h``'s shape for GELU.
    """
    if kind == "swiglu":
        if fused:
            return swiglu(h, splits=splits)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def make_norm(kind: str, dim: int) -> nn.Module:
    """A high-precision RMSNorm or LayerNorm."""
    return nn.RMSNorm(dim, eps=1e-5) if kind == "RMSNorm" else nn.LayerNorm(dim, eps=1e-5)


def route(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Top-k routing of [T, E] probabilities.

    Returns (gates [T, k] renormalized, order [T*k] (flat assignment ids sorted by expert,
    stable), experts [T*k] (expert of each flat assignment), m_splits (rows per expert)).
    """
    gates, experts = probs.topk(top_k, dim=-1)
    gates = gates / gates.sum(-1, keepdim=True)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    m_splits = torch.bincount(flat, minlength=probs.shape[-1]).tolist()
    return gates, order, flat, m_splits


def load_balancing_loss(probs: torch.Tensor, flat_experts: torch.Tensor,
                        group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Switch-Transformer aux loss: E * sum_e (fraction routed to e) * (mean prob of e).

    With ``group`` the fractions count the routed rows of every rank of the group (integer
    counts: exactly one process's for the ranks' rows together); the mean probability stays
    this rank's, so the mean of the ranks' losses is the loss of their rows together."""
    E = probs.shape[-1]
    counts = torch.bincount(flat_experts, minlength=E)
    total = flat_experts.numel()
    if group is not None:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
        total *= dist.get_world_size(group)
    frac = counts.float() / total
    return E * (frac * probs.mean(0)).sum()


def run_experts(fc1: GroupedLinear, fc2: GroupedLinear, x: torch.Tensor, m_splits: Sequence[int], kind: str,
                fused: bool) -> torch.Tensor:
    """fc1 -> activation -> fc2 over rows grouped by expert (``m_splits`` rows each).

    Parameters
    ----------
    fc1, fc2:
        The experts' two GroupedLinear layers.
    x:
        [rows, C], grouped by expert.
    m_splits:
        Rows of each expert.
    kind, fused:
        As :func:`activation`.

    Returns
    -------
    torch.Tensor
        [rows, C]."""
    return fc2(activation(fc1(x, m_splits), kind, fused, m_splits), m_splits)


class Experts(nn.Module):
    """Some experts of an MoE layer: fc1 -> activation -> fc2, each a ``GroupedLinear``."""

    def __init__(self, fc1: GroupedLinear, fc2: GroupedLinear, kind: str, fused: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.kind, self.fused = fc1, fc2, kind, fused

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        """x [rows, C] grouped by expert -> [rows, C]."""
        return run_experts(self.fc1, self.fc2, x, m_splits, self.kind, self.fused)


def _keep_experts(full: GroupedLinear, first: int, count: int) -> GroupedLinear:
    """A GroupedLinear of ``full``'s experts ``first .. first+count-1`` (their weights copied;
    weights held quantized move over as they are: the same parameters, their kept FP32 initial
    values seed the masters exactly as in one process)."""
    quantized = isinstance(full.weight0, QuantizedTensor)
    part = GroupedLinear(count, full.in_features, full.out_features, bias=False, device=full.weight0.device,
                         params_dtype=full.weight0.dtype, pack_weights=not quantized)
    with torch.no_grad():
        for i in range(count):
            w = getattr(full, f"weight{first + i}")
            if quantized:
                setattr(part, f"weight{i}", w)
            else:
                getattr(part, f"weight{i}").copy_(w)
    part.name = full.name
    return part


class MoE(nn.Module):
    """norm -> router -> k of ``n_experts`` experts (fc1, fc2: GroupedLinear) -> gated sum.

    ``aux_loss`` holds the last forward's load-balancing loss (the model adds it).
    """

    def __init__(self, cfg: "GPTConfig") -> None:
        super().__init__()
        self.n_experts, self.top_k, self.kind = cfg.n_experts, cfg.top_k, cfg.mlp
        self.fused_swiglu = cfg.fused_swiglu
        self.norm = make_norm(cfg.normalization, cfg.n_embd)
        self.router = (Linear(cfg.n_embd, cfg.n_experts, bias=False) if cfg.quantize_router
                       else nn.Linear(cfg.n_embd, cfg.n_experts, bias=False))
        width = 2 * cfg.moe_hidden if cfg.mlp == "swiglu" else cfg.moe_hidden
        self.fc1 = GroupedLinear(cfg.n_experts, cfg.n_embd, width, bias=False)
        self.fc2 = GroupedLinear(cfg.n_experts, cfg.moe_hidden, cfg.n_embd, bias=False)
        self.aux_loss: Optional[torch.Tensor] = None
        self.last_m_splits: list[int] = []
        #: the ranks whose routed rows the load-balancing fractions count (None: this process's)
        self.stats_group: Optional[dist.ProcessGroup] = None
        #: the experts spread over an expert-parallel group (:meth:`use_expert_parallel`)
        self.expert_parallel: Optional[ExpertParallel] = None

    def use_expert_parallel(self, mesh: Any) -> None:
        """Keep only this rank's experts and run them through :class:`hybridfp.ExpertParallel`
        over the ``"ep"`` dimension of ``mesh``: rank ``e`` of the group keeps experts
        ``e*L .. e*L+L-1`` (``L = n_experts / group size``) with their current weights.

        Raises
        ------
        ValueError
            ``n_experts`` is not a multiple of the group's size (from ExpertParallel).
        """
        size, rank = mesh["ep"].size(), mesh["ep"].get_local_rank()
        if self.n_experts % size:
            raise ValueError(f"MoE: {self.n_experts} experts do not split over an expert-parallel "
                             f"group of {size} ranks; pick --ep dividing n_experts.")
        local = self.n_experts // size
        experts = Experts(_keep_experts(self.fc1, rank * local, local),
                          _keep_experts(self.fc2, rank * local, local), self.kind, self.fused_swiglu)
        del self.fc1, self.fc2
        self.expert_parallel = ExpertParallel(experts, self.n_experts, mesh, mesh_dim="ep")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., C] -> [..., C]."""
        shape = x.shape
        h = self.norm(x.float()).reshape(-1, shape[-1])              # [T, C] FP32
        if isinstance(self.router, Linear):
            logits = self.router(h.to(x.dtype)).float()
        else:
            logits = self.router(h)
        probs = logits.softmax(-1)
        gates, order, flat, m_splits = route(probs, self.top_k)
        self.aux_loss = load_balancing_loss(probs, flat, self.stats_group)
        self.last_m_splits = m_splits
        xs = h.to(x.dtype)[order // self.top_k]                        # [T*k, C] sorted by expert
        if self.expert_parallel is not None:                           # a collective over its group
            ys = self.expert_parallel(xs, m_splits)
        else:
            ys = run_experts(self.fc1, self.fc2, xs, m_splits, self.kind, self.fused_swiglu)
        y = torch.empty_like(ys)
        y[order] = ys                                                  # back to (token, slot) order
        y = (y.view(-1, self.top_k, shape[-1]).float() * gates.unsqueeze(-1)).sum(1)
        return y.to(x.dtype).view(shape)
