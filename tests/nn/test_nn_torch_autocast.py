"""Modules under torch's own autocast (AMP) as well as hybridfp's.

Like ``nn.Linear``, the GEMM input takes torch's autocast dtype; the GEMMs themselves stay
exact (numerics §1): torch's autocast must not turn the emulation's FP32 products into BF16 ones.
So a module under ``torch.autocast(bfloat16)`` gives the same bits as the same module fed a
BF16 input without torch's autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import (FORMATS, assert_bitwise, assert_grads_bitwise, call, make_data, make_module,
                      run_step)

from hybridfp import Linear, MXFP8Quantizer, autocast
from hybridfp.gemm import gemm

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected


def _run_under_torch_autocast(m, x, dy, recipe, backward_inside: bool):
    xx = x.clone().requires_grad_()
    torch.manual_seed(1234)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with autocast(recipe=recipe):
            y = call(m, xx)
        if backward_inside:
            y.backward(dy)
    if not backward_inside:
        y.backward(dy)
    return y, xx.grad


@pytest.mark.parametrize("backward_inside", [False, True], ids=["bwd_outside", "bwd_inside"])
@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("fmt", ["fp8_current", "mxfp8", "nvfp4"])
def test_torch_autocast_equals_bf16_input(fmt, kind, backward_inside):
    base = make_module(kind)
    x, dy = make_data(seed=21)
    m = copy.deepcopy(base)
    y, dx = _run_under_torch_autocast(m, x, dy.bfloat16(), FORMATS[fmt](), backward_inside)
    want = run_step(copy.deepcopy(base), x.bfloat16(), dy.bfloat16(), FORMATS[fmt]())
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert_bitwise(y.detach(), want.y, "output")
    assert_bitwise(dx, want.dx.float(), "dx")
    got = {n: p.grad for n, p in m.named_parameters()}
    assert_grads_bitwise(got, want.grads, f"{fmt} {kind}")


def test_layernorm_linear_under_torch_autocast():
    """The norm runs as torch's autocast runs it (FP32); the GEMM input is its BF16 cast."""
    m = make_module("layernorm")
    x, dy = make_data(seed=22)
    y, _ = _run_under_torch_autocast(m, x, dy.bfloat16(), FORMATS["mxfp8"](), False)
    lin = Linear(64, 32)
    lin.weight, lin.bias = m.weight, m.bias
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = m.norm(x)
    with torch.no_grad(), autocast(recipe=FORMATS["mxfp8"]()):
        want = lin(h.bfloat16())
    assert y.dtype == torch.bfloat16
    assert_bitwise(y.detach(), want, "output")


def test_gemm_called_directly_is_exact_under_torch_autocast():
    a = MXFP8Quantizer().quantize(torch.randn(48, 64))
    b = MXFP8Quantizer().quantize(torch.randn(32, 64))
    want = gemm(a, b, "TN", out_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gemm(a, b, "TN", out_dtype=torch.float32)
    assert_bitwise(got, want, "gemm under torch.autocast")
