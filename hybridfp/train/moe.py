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
probability of e.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..moe import GroupedLinear
from ..nn import Linear

if TYPE_CHECKING:  # model.py imports this module; the config type is for annotations only
    from .model import GPTConfig


def activation(h: torch.Tensor, kind: str) -> torch.Tensor:
    """SwiGLU (h = [gate | up]) or GELU (tanh approximation)."""
    if kind == "swiglu":
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


def load_balancing_loss(probs: torch.Tensor, flat_experts: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer aux loss: E * sum_e (fraction routed to e) * (mean prob of e)."""
    E = probs.shape[-1]
    frac = torch.bincount(flat_experts, minlength=E).float() / flat_experts.numel()
    return E * (frac * probs.mean(0)).sum()


class MoE(nn.Module):
    """norm -> router -> k of ``n_experts`` experts (fc1, fc2: GroupedLinear) -> gated sum.

    ``aux_loss`` holds the last forward's load-balancing loss (the model adds it).
    """

    def __init__(self, cfg: "GPTConfig") -> None:
        super().__init__()
        self.n_experts, self.top_k, self.kind = cfg.n_experts, cfg.top_k, cfg.mlp
        self.norm = make_norm(cfg.normalization, cfg.n_embd)
        self.router = (Linear(cfg.n_embd, cfg.n_experts, bias=False) if cfg.quantize_router
                       else nn.Linear(cfg.n_embd, cfg.n_experts, bias=False))
        width = 2 * cfg.moe_hidden if cfg.mlp == "swiglu" else cfg.moe_hidden
        self.fc1 = GroupedLinear(cfg.n_experts, cfg.n_embd, width, bias=False)
        self.fc2 = GroupedLinear(cfg.n_experts, cfg.moe_hidden, cfg.n_embd, bias=False)
        self.aux_loss: Optional[torch.Tensor] = None
        self.last_m_splits: list[int] = []

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
        self.aux_loss = load_balancing_loss(probs, flat)
        self.last_m_splits = m_splits
        xs = h.to(x.dtype)[order // self.top_k]                        # [T*k, C] sorted by expert
        ys = self.fc2(activation(self.fc1(xs, m_splits), self.kind), m_splits)
        y = torch.empty_like(ys)
        y[order] = ys                                                  # back to (token, slot) order
        y = (y.view(-1, self.top_k, shape[-1]).float() * gates.unsqueeze(-1)).sum(1)
        return y.to(x.dtype).view(shape)
