"""An input that two Linears read in one autocast region (a gated MLP's gate and up) is quantized
once when their input quantizers promise identical results (``Quantizer.share_key``), and the
step is bitwise the step with two separate quantizations: output, input gradient and every
weight gradient. Stateful (delayed scaling) and random (stochastic rounding) quantizers, and
quantizers of different settings, never share; an in-place write in between, or a second layer
that needs a copy the first did not make, quantizes again."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import hybridfp
from hybridfp import autocast, factories
from hybridfp.factories import per_gemm
from hybridfp.nn.shared_input import quantize_input
from hybridfp.quantizers import Quantizer
from hybridfp.quantizers.float8 import Float8CurrentScalingQuantizer
from hybridfp.quantizers.mxfp8 import MXFP8Quantizer
from hybridfp.quantizers.nvfp4 import NVFP4Quantizer

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

D, F, M = 64, 96, 48

#: name -> (recipe, whether the input quantizers share)
RECIPES = {
    "fp8_current": (lambda: hybridfp.Float8CurrentScaling(), True),
    "fp8_block": (lambda: hybridfp.Float8BlockScaling(), True),
    "mxfp8": (lambda: hybridfp.MXFP8BlockScaling(), True),
    "nvfp4": (lambda: hybridfp.NVFP4BlockScaling(), True),  # SR on gradients only; RHT on x's col copy
    "nvfp4_fwd_mxfp8_bwd": (lambda: hybridfp.CustomRecipe(qfactory=per_gemm("nvfp4", "mxfp8", "mxfp8")), True),
    "fp8_fwd_fp8_block_bwd": (lambda: hybridfp.CustomRecipe(qfactory=per_gemm("fp8", "fp8_block", "fp8_block")), True),
    "composer_2": (lambda: hybridfp.CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd), True),
    "high_precision": (lambda: hybridfp.CustomRecipe(qfactory=factories.high_precision), True),
    "fp8_delayed": (lambda: hybridfp.DelayedScaling(), False),
}


class MLP(torch.nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``clone_up`` gives ``up`` a copy of x (no sharing)."""

    def __init__(self, d: int = D, f: int = F, **kw) -> None:
        super().__init__()
        self.gate, self.up, self.down = (hybridfp.Linear(d, f, **kw), hybridfp.Linear(d, f, **kw),
                                         hybridfp.Linear(f, d, **kw))
        self.clone_up = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.up(x.clone() if self.clone_up else x)
        return self.down(torch.nn.functional.silu(self.gate(x)) * u)


class InputQuantizeCounter:
    """Counts ``Quantizer.quantize`` calls on input roles."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        orig = Quantizer.quantize

        def quantize(q: Quantizer, x: torch.Tensor):
            if q.role is not None and q.role.tensor_type == "input":
                self.n += 1
            return orig(q, x)
        monkeypatch.setattr(Quantizer, "quantize", quantize)


def step(m: MLP, x: torch.Tensor, dy: torch.Tensor, recipe: hybridfp.Recipe, steps: int = 2):
    """``steps`` training steps (delayed scaling moves its scales between them); the last
    step's output and gradients."""
    for _ in range(steps):
        m.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        torch.manual_seed(7)  # SR seeds are drawn from torch's generator: the same in both runs
        with autocast(recipe=recipe):
            y = m(xx)
        y.backward(dy)
    return [y, xx.grad] + [p.grad for p in m.parameters()]


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", list(RECIPES))
def test_shared_input_step_is_bitwise_the_separate_one(name, device, monkeypatch):
    """CPU: FP32 reference paths; CUDA: BF16 through the Triton kernels and cuBLAS."""
    make, shares = RECIPES[name]
    torch.manual_seed(0)
    m, d = (MLP(), D) if device == "cpu" else (MLP(256, 768, device="cuda", params_dtype=torch.bfloat16), 256)
    twin = copy.deepcopy(m)
    twin.clone_up = True
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(M * 8, d, device=device, dtype=dt) * 3
    dy = torch.randn(M * 8, d, device=device, dtype=dt)
    counter = InputQuantizeCounter(monkeypatch)
    got = step(m, x, dy, make(), steps=1)
    shared_count = counter.n
    counter.n = 0
    want = step(twin, x, dy, make(), steps=1)
    assert counter.n == 3  # x for gate, x (a copy) for up, h for down
    assert shared_count == (2 if shares else 3)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    got = step(m, x, dy, make())
    want = step(twin, x, dy, make())
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_share_keys():
    assert Float8CurrentScalingQuantizer().share_key() == Float8CurrentScalingQuantizer().share_key()
    assert Float8CurrentScalingQuantizer().share_key() != Float8CurrentScalingQuantizer("e5m2").share_key()
    assert Float8CurrentScalingQuantizer().share_key() != MXFP8Quantizer().share_key()
    assert MXFP8Quantizer().share_key() != MXFP8Quantizer(scale_rule="floor").share_key()
    assert NVFP4Quantizer(with_rht=True).share_key() != NVFP4Quantizer().share_key()
    assert NVFP4Quantizer(stochastic_rounding=True).share_key() is None
    assert hybridfp.quantizers.Float8Quantizer().share_key() is None  # delayed scaling: state
    hyb = hybridfp.quantizers.HybridQuantizer
    assert hyb(MXFP8Quantizer(), NVFP4Quantizer()).share_key() == hyb(MXFP8Quantizer(), NVFP4Quantizer()).share_key()
    assert hyb(MXFP8Quantizer(), NVFP4Quantizer(stochastic_rounding=True)).share_key() is None


def test_different_settings_do_not_share(monkeypatch):
    """gate E4M3, up E5M2 inputs: two quantizations, each its own format."""

    def factory(role):
        if role is not None and role.tensor_type == "input":
            return Float8CurrentScalingQuantizer("e5m2" if role.name == "up" else "e4m3")
        return factories.current_scaling(role)
    torch.manual_seed(0)
    m = MLP()
    for n in ("gate", "up", "down"):
        getattr(m, n).name = n
    twin = copy.deepcopy(m)
    twin.clone_up = True
    x, dy = torch.randn(M, D), torch.randn(M, D)
    counter = InputQuantizeCounter(monkeypatch)
    got = step(m, x, dy, hybridfp.CustomRecipe(qfactory=factory), steps=1)
    assert counter.n == 3
    for g, w in zip(got, step(twin, x, dy, hybridfp.CustomRecipe(qfactory=factory), steps=1)):
        assert torch.equal(g, w)


def test_in_place_write_or_missing_copy_quantizes_again():
    q = Float8CurrentScalingQuantizer()
    scratch: dict = {}
    x = torch.randn(32, 64)
    a = quantize_input(x, q, True, False, scratch)
    b = quantize_input(x.view(32, 64), q, True, False, scratch)  # another view, same elements
    assert b.qstorage.payload("rowwise")["data"] is a.qstorage.payload("rowwise")["data"]
    c = quantize_input(x, q, True, True, scratch)  # needs a columnwise copy the entry lacks
    assert c.has_direction("columnwise")
    assert c.qstorage.payload("rowwise")["data"] is not a.qstorage.payload("rowwise")["data"]
    x.mul_(2)  # in place: the version moves
    d = quantize_input(x, q, True, True, scratch)
    assert d.qstorage.payload("rowwise")["data"] is not c.qstorage.payload("rowwise")["data"]
    assert torch.equal(d.dequantize(), Float8CurrentScalingQuantizer()(x).dequantize())
    e = quantize_input(x[:16], q, True, True, scratch)  # other elements
    assert e.shape == (16, 64)


def test_dropping_a_copy_leaves_the_shared_one():
    q = MXFP8Quantizer()
    scratch: dict = {}
    x = torch.randn(64, 64)
    a = quantize_input(x, q, True, True, scratch)
    a.update_usage(rowwise_usage=False)  # what a Linear does after its fprop
    b = quantize_input(x, q, True, True, scratch)
    assert b.has_direction("rowwise") and not a.has_direction("rowwise")
    assert torch.equal(b.dequantize(direction="rowwise"), MXFP8Quantizer()(x).dequantize(direction="rowwise"))


def test_the_region_end_drops_the_entry():
    m = MLP()
    x = torch.randn(M, D)
    with autocast(recipe=hybridfp.Float8CurrentScaling()) as state:
        m(x)
        entry = state.scratch["shared_input"]
        held = weakref.ref(entry.quantized.qstorage.payload("columnwise")["data"])
    assert state.scratch == {}
    del entry
    import gc
    gc.collect()
    assert held() is None  # nothing else keeps the no-grad step's copies alive
