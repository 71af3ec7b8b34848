"""The module claims on a CUDA device, where fast GEMM backends (cuBLAS FP8, Triton) and
quantize kernels replace the exact emulation. Bitwise statements compare runs on the same
backend (numerics §1): a hybrid's parts are plain storages of the same format, so they select the
same kernel as the plain format. Runs on a CUDA GPU (``pytest -m gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import (FORMATS, MODULES, ODD_IN, ODD_OUT, ODD_ROWS, assert_bitwise,
                      assert_grads_bitwise, check_twin_parity, make_data, make_module, run_step,
                      sqnr_db)
from test_nn_sqnr import BOUNDS

from hybridfp import CustomRecipe, autocast
from hybridfp.factories import per_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # quantize-kernel fallbacks are reported
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_twin_hybrid_equals_builtin_recipe_cuda(fmt, kind, dtype):
    check_twin_parity(kind, fmt, dtype, device="cuda")


@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_twin_hybrid_equals_builtin_recipe_odd_shapes_cuda(fmt, kind):
    # Shapes cuBLAS cannot take (k, n not multiples of 16 / 128) fall back per GEMM: the
    # hybrid must fall back exactly where the plain format does.
    check_twin_parity(kind, fmt, torch.float32, (ODD_ROWS, ODD_IN, ODD_OUT), device="cuda")


@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("triple", [("fp8", "mxfp8", "nvfp4"), ("nvfp4", "fp8", "mxfp8"),
                                    ("mxfp8", "nvfp4", "bf16"), ("fp8_block", "fp8", "fp8_current")],
                         ids="-".join)
def test_each_gemm_uses_its_own_format_cuda(triple, kind):
    base = make_module(kind, device="cuda")
    x, dy = make_data(seed=3, device="cuda")

    def run(f: str, d: str, w: str):
        return run_step(copy.deepcopy(base), x, dy, CustomRecipe(per_gemm(f, d, w)), seed=7)

    hybrid = run(*triple)
    only = [run(f, f, f) for f in triple]
    assert_bitwise(hybrid.y, only[0].y, "output")
    assert_bitwise(hybrid.dx, only[1].dx, "dx")
    assert_grads_bitwise(hybrid.weight_grads(), only[2].weight_grads(), "dW")


@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sqnr_against_fp32_cuda(fmt, kind):
    """The CPU bounds hold: cuBLAS FP8's reduced-precision accumulation (~1e-4 relative,
    ~80 dB) is far below the quantization noise the bounds budget."""
    base = make_module(kind, device="cuda")
    x, dy = make_data(seed=1, device="cuda")
    # The FP32 reference: torch's CUDA matmuls use TF32 only when asked to.
    ref = run_step(copy.deepcopy(base), x, dy, None)
    m = copy.deepcopy(base)
    for _ in range(2 if fmt == "fp8_delayed" else 1):
        got = run_step(m, x, dy, FORMATS[fmt]())
    w_ref = torch.cat([g.flatten() for g in ref.weight_grads().values()])
    w_got = torch.cat([g.flatten() for g in got.weight_grads().values()])
    values = (sqnr_db(ref.y, got.y), sqnr_db(ref.dx, got.dx), sqnr_db(w_ref, w_got))
    for what, value, bound in zip(("output", "dx", "dW"), values, BOUNDS[fmt]):
        assert value >= bound, f"{fmt} {kind} {what}: SQNR {value:.2f} dB < {bound} dB"


@pytest.mark.parametrize("fmt", ["fp8_current", "fp8_block", "mxfp8", "nvfp4"])
def test_torch_autocast_equals_bf16_input_cuda(fmt):
    """Under torch.autocast("cuda", bfloat16): the same bits as a BF16 input without it."""
    base = make_module("linear", device="cuda")
    x, dy = make_data(seed=21, device="cuda")
    m = copy.deepcopy(base)
    xx = x.clone().requires_grad_()
    torch.manual_seed(1234)
    with torch.autocast("cuda", dtype=torch.bfloat16), autocast(recipe=FORMATS[fmt]()):
        y = m(xx)
    y.backward(dy.bfloat16())
    want = run_step(copy.deepcopy(base), x.bfloat16(), dy.bfloat16(), FORMATS[fmt]())
    assert y.dtype == torch.bfloat16
    assert_bitwise(y.detach(), want.y, "output")
    assert_bitwise(xx.grad, want.dx.float(), "dx")
    assert_grads_bitwise({n: p.grad for n, p in m.named_parameters()}, want.grads, fmt)
