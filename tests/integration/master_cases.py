"""Shared pieces of the quantized-weight tests: recipes, a small model of every dense hybridfp
module, and a training step."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

import hybridfp as hfp
from hybridfp.factories import ZOO, per_gemm

RECIPES: dict[str, Callable[[], hfp.Recipe]] = {
    "delayed": lambda: hfp.DelayedScaling(amax_history_len=4),
    "fp8_current": lambda: hfp.Float8CurrentScaling(),
    "fp8_block": lambda: hfp.Float8BlockScaling(),
    "mxfp8": lambda: hfp.MXFP8BlockScaling(),
    "nvfp4": lambda: hfp.NVFP4BlockScaling(),
    "hybrid_per_gemm": lambda: hfp.CustomRecipe(qfactory=per_gemm("nvfp4", "mxfp8", "fp8_block")),
    **{f"zoo_{name}": (lambda f=f: hfp.CustomRecipe(qfactory=f)) for name, f in ZOO.items()},
}
D, H, ROWS = 64, 128, 32


class Model(nn.Module):
    """LayerNormLinear -> LayerNormMLP -> Linear: every dense module with quantizable weights."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = hfp.LayerNormLinear(D, D, normalization="RMSNorm", name="qkv")
        self.mlp = hfp.LayerNormMLP(D, H, name="mlp")
        self.out = hfp.Linear(D, D, name="out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(self.qkv(x)))


def build(recipe: hfp.Recipe, quantized: bool) -> Model:
    """The model from seed 0, its weights quantized with ``recipe`` or FP32 parameters."""
    torch.manual_seed(0)
    with hfp.quantized_model_init(enabled=quantized, recipe=recipe, preserve_high_precision_init_val=True):
        return Model()


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, D, generator=g) for _ in range(n)]


def step(model: nn.Module, opt, recipe: hfp.Recipe, x: torch.Tensor) -> torch.Tensor:
    """One training step; returns the loss."""
    with hfp.autocast(recipe=recipe):
        loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def quantized_weights(model: nn.Module) -> dict[str, hfp.QuantizedTensor]:
    return {n: p for n, p in model.named_parameters() if isinstance(p, hfp.QuantizedTensor)}
