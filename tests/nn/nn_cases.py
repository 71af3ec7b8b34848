"""Shared cases for the module tests: formats, modules, one training step, comparisons."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hybridfp import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, GroupedLinear,
                      HybridQuantizer, LayerNormLinear, Linear, MXFP8BlockScaling, NVFP4BlockScaling,
                      QuantizerRole, Recipe, autocast, swiglu)
from hybridfp.quantizers import Quantizer
from hybridfp.tensors import QuantizedTensor

#: Built-in recipe per format (default options: NVFP4 has RHT + SR + 2D weights).
FORMATS: dict[str, type[Recipe]] = {
    "fp8_delayed": DelayedScaling,
    "fp8_current": Float8CurrentScaling,
    "fp8_block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}
MODULES = ("linear", "layernorm", "rmsnorm", "grouped")
IN, OUT, ROWS = 64, 32, 48
#: Odd sizes: K and N not multiples of 32 or 128, M odd (padding paths of every format).
ODD_IN, ODD_OUT, ODD_ROWS = 80, 24, 33
NUM_EXPERTS = 3


def splits_for(rows: int) -> list[int]:
    """Expert row counts: an empty expert and sizes that are not multiples of 16, 32 or 128."""
    return [0, 19, rows - 19]


class TwinFactory:
    """Hybrid(F_role, F_role): two fresh children, each what the built-in recipe gives the role.

    A module-level class (picklable), as checkpointed factories must be.
    """

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def __call__(self, role: Optional[QuantizerRole]) -> Quantizer:
        return HybridQuantizer(self.recipe.quantizer(role), self.recipe.quantizer(role))


def make_module(kind: str, *, in_features: int = IN, out_features: int = OUT, bias: bool = True,
                params_dtype: Optional[torch.dtype] = None, seed: int = 0, name: str = "mod",
                **kw) -> torch.nn.Module:
    """One module of ``kind`` with seeded, non-trivial parameters (norm affine included)."""
    torch.manual_seed(seed)
    common = {"params_dtype": params_dtype, "name": name, **kw}
    if kind == "linear":
        return Linear(in_features, out_features, bias, **common)
    if kind in ("layernorm", "rmsnorm"):
        norm = "LayerNorm" if kind == "layernorm" else "RMSNorm"
        m = LayerNormLinear(in_features, out_features, bias, normalization=norm, **common)
        with torch.no_grad():
            m.layer_norm_weight.uniform_(0.5, 1.5)
            if m.layer_norm_bias is not None:
                m.layer_norm_bias.uniform_(-0.2, 0.2)
        return m
    if kind == "grouped":
        return GroupedLinear(NUM_EXPERTS, in_features, out_features, bias, **common)
    raise ValueError(kind)


def make_data(dtype: torch.dtype = torch.float32, seed: int = 1, rows: int = ROWS,
              in_features: int = IN, out_features: int = OUT,
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random input [rows, in_features] and upstream gradient [rows, out_features] (drawn on
    the CPU, so every device sees the same values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(device, dtype)
    dy = torch.randn(rows, out_features, generator=g).to(device, dtype)
    return x, dy


def call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward, with the expert splits for a GroupedLinear."""
    return module(x, splits_for(x.shape[0])) if isinstance(module, GroupedLinear) else module(x)


@dataclass
class StepResult:
    """What one forward + backward produced."""

    y: torch.Tensor
    dx: torch.Tensor
    grads: dict[str, torch.Tensor]

    def weight_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the GEMM weights (weight, weight0, weight1, ...)."""
        return {n: g for n, g in self.grads.items() if n.startswith("weight")}

    def bias_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the linear biases (bias, bias0, ...)."""
        return {n: g for n, g in self.grads.items() if n.startswith("bias")}


def run_step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
             recipe: Optional[Recipe], seed: int = 1234) -> StepResult:
    """One forward inside ``autocast(recipe)`` (outside autocast if None) and ``y.backward(dy)``.

    ``torch.manual_seed(seed)`` first: stochastic rounding draws one seed per quantize() call
    from torch's default generator, so identical seeding makes SR runs reproducible.
    """
    xx = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if recipe is None:
        y = call(module, xx)
    else:
        with autocast(recipe=recipe):
            y = call(module, xx)
    y.backward(dy)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return StepResult(y.detach(), xx.grad.detach(), grads)


def sgd_step(module: torch.nn.Module, lr: float = 0.05) -> None:
    """A plain in-place SGD update (bitwise identical grads give bitwise identical weights)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """torch.equal, with the largest difference in the message."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs()
        raise AssertionError(f"{what}: not bitwise equal; max |diff| {diff.max().item():.3e} at "
                             f"{diff.argmax().item()}, {int((diff > 0).sum())} elements differ")


def assert_grads_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Same parameter names, bitwise equal gradients."""
    assert sorted(got) == sorted(want), f"{what}: {sorted(got)} vs {sorted(want)}"
    for n in want:
        assert_bitwise(got[n], want[n], f"{what} {n}.grad")


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - test|^2) in FP64 (inf when equal)."""
    ref, test = ref.double(), test.double()
    noise = (ref - test).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def check_twin_parity(kind: str, fmt: str, dtype: torch.dtype,
                      shape: tuple[int, int, int] = (ROWS, IN, OUT),
                      params_dtype: torch.dtype = torch.float32, device: str = "cpu",
                      steps: int = 3) -> None:
    """Hybrid(F_role, F_role) == built-in recipe F, bitwise, over ``steps`` training steps (SGD
    between them): output, input grad and every parameter grad, at every step."""
    rows, in_features, out_features = shape
    builtin_mod = make_module(kind, in_features=in_features, out_features=out_features,
                              params_dtype=params_dtype, device=device)
    twin_mod = copy.deepcopy(builtin_mod)
    builtin, twin = FORMATS[fmt](), twin_recipe(fmt)
    for step in range(steps):
        # New data every step: delayed scaling's step-n scale comes from step n-1's amax.
        x, dy = make_data(dtype, seed=10 + step, rows=rows, in_features=in_features,
                          out_features=out_features, device=device)
        x, dy = x * (1 + step), dy * 2.0**-step  # move the amaxes so the scales change
        want = run_step(builtin_mod, x, dy, builtin, seed=100 + step)
        got = run_step(twin_mod, x, dy, twin, seed=100 + step)
        where = f"{kind}/{fmt}/{dtype}/step {step}"
        assert_bitwise(got.y, want.y, f"{where} output")
        assert_bitwise(got.dx, want.dx, f"{where} input grad")
        assert_grads_bitwise(got.grads, want.grads, where)
        assert got.weight_grads() and got.bias_grads(), "the test must cover weight and bias grads"
        sgd_step(builtin_mod)
        sgd_step(twin_mod)
    # Guard: the twin run really used hybrids, the built-in one plain quantizers.
    for slot, qs in twin_mod._quantizers.items():
        assert all(isinstance(q, HybridQuantizer) for q in qs), slot
        assert not any(isinstance(q, HybridQuantizer) for q in builtin_mod._quantizers[slot]), slot


def twin_recipe(fmt: str) -> CustomRecipe:
    """CustomRecipe whose factory returns Hybrid(F_role, F_role) for format ``fmt``."""
    return CustomRecipe(TwinFactory(FORMATS[fmt]()))


class CountingFactory:
    """Wraps a factory; records (tensor_type, copies made) for every ``quantize`` call of the
    quantizers it builds, so tests can count weight quantizations and see which copies were
    requested."""

    def __init__(self, base: Callable[[Optional[QuantizerRole]], Quantizer]) -> None:
        self.base = base
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __call__(self, role: Optional[QuantizerRole]) -> Quantizer:
        q = self.base(role)
        inner = q.quantize
        tensor_type = role.tensor_type if role is not None else "?"

        def quantize(x: torch.Tensor) -> QuantizedTensor:
            out = inner(x)
            self.calls.append((tensor_type, out.directions()))
            return out

        q.quantize = quantize  # type: ignore[method-assign]
        return q

    def count(self, tensor_type: str) -> int:
        """Number of quantize() calls made by quantizers of ``tensor_type``."""
        return sum(1 for t, _ in self.calls if t == tensor_type)

    def copies(self, tensor_type: str) -> list[tuple[str, ...]]:
        """The copies each quantize() call of ``tensor_type`` produced, in call order."""
        return [d for t, d in self.calls if t == tensor_type]


class GatedMLP(torch.nn.Module):
    """Llama's MLP on hybridfp Linears (BF16 parameters, no bias) and the fused SwiGLU:
    ``down(swiglu(gate(x), up(x)))``."""

    def __init__(self, d: int, f: int, device: str = "cuda") -> None:
        super().__init__()
        kw = dict(bias=False, params_dtype=torch.bfloat16, device=device)
        self.gate, self.up, self.down = Linear(d, f, **kw), Linear(d, f, **kw), Linear(f, d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x)))


def train_side_by_side(models: tuple[torch.nn.Module, ...], x: torch.Tensor, dy: torch.Tensor,
                       forward: Callable[[torch.nn.Module, torch.Tensor, int], torch.Tensor],
                       grads: Callable[[torch.nn.Module], list], steps: int = 2) -> list[list[tuple]]:
    """``steps`` SGD steps (lr 0.1) of each model on the same x / dy, in turn within a step:
    per step, per model, (output, input gradient, ``grads(model)``). ``forward(model, x, step)``
    runs the model (inside whatever autocast it needs)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    history = []
    for step in range(steps):
        results = []
        for m, opt in zip(models, opts):
            xi = x.clone().requires_grad_(True)
            opt.zero_grad()
            y = forward(m, xi, step)
            y.backward(dy)
            results.append((y.detach(), xi.grad, grads(m)))
            opt.step()
        history.append(results)
    return history
