"""A small GPT built from hybridfp modules (dense or MoE), nanoGPT-style.

    x = embed(tokens)                                   # high precision
    for each block:
        x = x + proj(attn(rope(qkv(norm(x)))))          # LayerNormLinear qkv, Linear proj
        x = x + mlp(x)                                  # LayerNormLinear fc, Linear proj
                                                        #   (or MoE: router + 2 GroupedLinear)
    logits = lm_head(final_norm(x))                     # high precision by default

Pre-norm, RoPE, causal ``F.scaled_dot_product_attention`` in the activation dtype, SwiGLU
or GELU MLP. Only the hybridfp modules are quantized (inside ``hybridfp.autocast``); the
embedding, final norm, LM head and MoE router stay high precision unless the config says
otherwise (``quantize_lm_head`` / ``quantize_router``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..nn import LayerNormLinear, Linear, set_names
from .moe import MoE, activation, make_norm


@dataclass
class GPTConfig:
    """Model shape and which layers are quantized."""

    vocab_size: int = 256
    block_size: int = 128          # longest sequence (RoPE table length)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp: str = "swiglu"            # "swiglu" or "gelu"
    mlp_hidden: int = 0            # 0: 4*n_embd for gelu, 8/3*n_embd rounded to 64 for swiglu
    # SwiGLU through hybridfp.swiglu (one Triton kernel each way on CUDA, an MoE layer's expert
    # amaxes recorded for FP8 current scaling; the same eager ops off CUDA), else F.silu(g) * u
    fused_swiglu: bool = True
    normalization: str = "RMSNorm"  # or "LayerNorm"
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    quantize_lm_head: bool = False
    quantize_router: bool = False
    # MoE: n_experts > 0 replaces every dense MLP by a top-k MoE layer.
    n_experts: int = 0
    top_k: int = 2
    moe_hidden: int = 0            # 0: mlp_hidden
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={self.mlp!r} is unknown; use 'swiglu' or 'gelu'.")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of "
                             "even size (RoPE rotates pairs).")
        if self.mlp_hidden == 0:
            self.mlp_hidden = 4 * self.n_embd if self.mlp == "gelu" else _round_up(8 * self.n_embd // 3, 64)
        if self.moe_hidden == 0:
            self.moe_hidden = self.mlp_hidden
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}.")

    def to_dict(self) -> dict:
        """Plain dict (stored in checkpoints)."""
        return asdict(self)


#: GPTConfig settings added after runs were already saved, with the value those runs trained with:
#: a run.json or checkpoint without one of them is read with it (resumed as it started)
SETTINGS_BEFORE_THEY_EXISTED = {"fused_swiglu": False}


def saved_model_settings(saved: dict) -> dict:
    """A saved GPTConfig dict (run.json, checkpoint) with the settings it predates filled in as
    the run trained with them (:data:`SETTINGS_BEFORE_THEY_EXISTED`).

    Parameters
    ----------
    saved:
        ``GPTConfig.to_dict()`` as a run stored it, maybe from before some settings existed.

    Returns
    -------
    dict
        The same settings, complete."""
    return {**SETTINGS_BEFORE_THEY_EXISTED, **saved}


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def rope_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [length, head_dim // 2] in FP32."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, H, T, D] by the position angle."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    c, s = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention: norm + QKV in one LayerNormLinear, RoPE, SDPA, Linear out."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = LayerNormLinear(cfg.n_embd, 3 * cfg.n_embd, bias=False, normalization=cfg.normalization)
        self.proj = Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> attention output [B, T, C] (to be added to the residual)."""
        B, T, _ = x.shape
        # -1 heads and features: a tensor-parallel rank runs its n_head / tp heads (tensor_parallel.py)
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """Dense MLP: norm + fc in one LayerNormLinear, activation, Linear proj."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.kind, self.fused = cfg.mlp, cfg.fused_swiglu
        width = 2 * cfg.mlp_hidden if cfg.mlp == "swiglu" else cfg.mlp_hidden
        self.fc = LayerNormLinear(cfg.n_embd, width, bias=False, normalization=cfg.normalization)
        self.proj = Linear(cfg.mlp_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]."""
        return self.proj(activation(self.fc(x), self.kind, self.fused))


class Block(nn.Module):
    """Pre-norm transformer block (the norms live inside the LayerNormLinear / MoE)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]."""
        x = x + self.attn(x, cos, sin)
        return x + self.mlp(x)


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets)`` returns (logits, loss). In training
    mode the loss includes the MoE load-balancing term (``aux_loss_coef`` x mean over MoE
    layers); in eval mode it is the cross-entropy alone. ``last_ce_loss`` / ``last_aux_loss``
    keep the last forward's parts (detached)."""

    def __init__(self, cfg: GPTConfig, act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.cfg, self.act_dtype = cfg, act_dtype
        #: Recompute each block in backward (torch.utils.checkpoint) while training with grad.
        self.recompute = False
        self.last_ce_loss: Optional[torch.Tensor] = None
        self.last_aux_loss: Optional[torch.Tensor] = None
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.final_norm = make_norm(cfg.normalization, cfg.n_embd)
        self.lm_head = (Linear(cfg.n_embd, cfg.vocab_size, bias=False) if cfg.quantize_lm_head
                        else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()
        set_names(self)

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), output projections scaled by 1/sqrt(2 n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02
            if name.endswith("proj.weight") or ".fc2.weight" in name:
                std = 0.02 / (2 * self.cfg.n_layer) ** 0.5
            torch.nn.init.normal_(p, mean=0.0, std=std)

    def num_params(self) -> int:
        """Parameter count (tied weights once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """idx [B, T] token ids -> logits [B, T, vocab] (FP32) and the loss if targets given."""
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size={self.cfg.block_size}.")
        x = self.wte(idx).to(self.act_dtype)
        cos, sin = self.rope_cos.to(x.device), self.rope_sin.to(x.device)
        recompute = self.recompute and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
        h = self.final_norm(x.float())
        if isinstance(self.lm_head, Linear):
            logits = self.lm_head(h.to(self.act_dtype)).float()
        else:
            logits = F.linear(h.to(self.act_dtype), self.lm_head.weight.to(self.act_dtype)).float()
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        self.last_ce_loss = loss.detach()
        aux = [b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None]
        self.last_aux_loss = torch.stack(aux).mean().detach() if aux else None
        if aux and self.training:
            loss = loss + self.cfg.aux_loss_coef * torch.stack(aux).mean()
        return logits, loss


@dataclass
class Preset:
    """A model shape plus the training defaults that suit it."""

    model: GPTConfig
    batch_size: int
    seq_len: int
    steps: int
    lr: float
    warmup: int
    eval_interval: int
    eval_iters: int
    device: str = "cpu"
    note: str = ""
    extra: dict = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    # A few seconds on a CPU: for tests.
    "test": Preset(GPTConfig(n_layer=2, n_head=2, n_embd=64, mlp_hidden=128, block_size=64),
                   batch_size=8, seq_len=64, steps=20, lr=3e-3, warmup=2, eval_interval=10, eval_iters=2,
                   note="unit tests"),
    "test-moe": Preset(GPTConfig(n_layer=2, n_head=2, n_embd=64, mlp_hidden=128, block_size=64,
                                 n_experts=4, top_k=2, moe_hidden=64),
                       batch_size=8, seq_len=64, steps=20, lr=3e-3, warmup=2, eval_interval=10, eval_iters=2,
                       note="unit tests (MoE)"),
    # The default CPU demo: a few minutes for a 4-recipe comparison on 2 cores.
    "tiny": Preset(GPTConfig(n_layer=4, n_head=4, n_embd=128, mlp_hidden=384, block_size=128),
                   batch_size=16, seq_len=128, steps=200, lr=3e-3, warmup=20, eval_interval=50, eval_iters=8,
                   note="CPU demo"),
    "tiny-moe": Preset(GPTConfig(n_layer=4, n_head=4, n_embd=128, mlp_hidden=384, block_size=128,
                                 n_experts=4, top_k=2, moe_hidden=192),
                       batch_size=16, seq_len=128, steps=200, lr=3e-3, warmup=20, eval_interval=50, eval_iters=4,
                       note="CPU demo (MoE)"),
    # GPU presets.
    "small": Preset(GPTConfig(n_layer=6, n_head=6, n_embd=384, mlp="swiglu", block_size=512),
                    batch_size=32, seq_len=512, steps=2000, lr=1e-3, warmup=100, eval_interval=200, eval_iters=20,
                    device="cuda", note="GPU, ~11M params"),
    "gpt-50m": Preset(GPTConfig(n_layer=10, n_head=10, n_embd=640, mlp="swiglu", block_size=512),
                      batch_size=32, seq_len=512, steps=3000, lr=1e-3, warmup=100, eval_interval=250,
                      eval_iters=20, device="cuda", note="GPU, ~50M params: the convergence study"),
    # 101.5M parameters (8 x 1024, 16 heads, SwiGLU 2752): the multi-seed convergence study on the
    # packages corpus (bench/convergence.py sets the steps and warm-up from its time budget).
    "gpt-100m": Preset(GPTConfig(n_layer=8, n_head=16, n_embd=1024, mlp="swiglu", block_size=512),
                       batch_size=16, seq_len=512, steps=2000, lr=1e-3, warmup=100, eval_interval=250,
                       eval_iters=16, device="cuda", note="GPU, ~101M params: the multi-seed convergence study"),
    "gpt2-small": Preset(GPTConfig(n_layer=12, n_head=12, n_embd=768, mlp="gelu", normalization="LayerNorm",
                                   block_size=1024),
                         batch_size=16, seq_len=1024, steps=5000, lr=6e-4, warmup=200, eval_interval=250,
                         eval_iters=20, device="cuda",
                         note="GPU, GPT-2 small shape (124M with a 50k vocab; ~85M with bytes)"),
    "moe-small": Preset(GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=512, n_experts=8, top_k=2,
                                  moe_hidden=768),
                        batch_size=32, seq_len=512, steps=3000, lr=8e-4, warmup=150, eval_interval=250,
                        eval_iters=20, device="cuda", note="GPU MoE, 8 experts top-2"),
}
