"""Built-in and zoo factories (numerics §5) run through every module.

- Each base factory in a CustomRecipe equals its built-in recipe bitwise (numerics §4).
- Every factory trains (forward + backward) with an SQNR floor per GEMM set by the least
  precise format that GEMM reads (see FLOORS).
- The zoo's semantic claims that a module can check exactly: "high-precision backward of the
  forward value" is the FP32 backward evaluated at the forward's quantized operands, and a zoo
  recipe equal to a per_gemm spelling gives the same bits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import (FORMATS, MODULES, assert_bitwise, assert_grads_bitwise, make_data,
                      make_module, run_step, sqnr_db)

from hybridfp import CustomRecipe, MXFP8Quantizer
from hybridfp.factories import BASE, ZOO, per_gemm

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

BUILTIN_OF = {"delayed_scaling": "fp8_delayed", "current_scaling": "fp8_current",
              "float8_block_scaling": "fp8_block", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}

# (output, dx, dW) SQNR floors in dB against FP32, about 1 dB under the measured minimum over
# Linear / LayerNormLinear / GroupedLinear (single step, 48x64 -> 32). The least precise
# operand of each GEMM sets it (test_nn_sqnr.py derives these levels): FP32 (exact up to
# accumulation order: >= 100), E4M3 x E4M3 (~29: >= 27), E5M2 gradient (~24.5: >= 23), NVFP4
# (16.7 fprop, ~15 with SR dy; the double-quantized 1D weight's columnwise copy in dgrad
# 13.9: >= 13), row-scaled NVFP4 forward (17.4: >= 16), and backward GEMMs reading the
# NVFP4 forward value re-quantized to MXFP8 / kept in high precision (19.7-20.7: >= 18.5).
EXACT, E4M3, E5M2 = 100.0, 27.0, 23.0
FLOORS = {
    "high_precision": (EXACT, EXACT, EXACT),
    "bf16": (52.0, 51.5, 51.0),  # BF16 operands (8-bit significands: ~53 dB), FP32 accumulation
    "delayed_scaling": (E4M3, E5M2, E5M2),
    "current_scaling": (E4M3, E5M2, E5M2),
    "float8_block_scaling": (E4M3, E4M3, E4M3),
    "mxfp8": (E4M3, E4M3, E4M3),
    "nvfp4": (15.5, 14.0, 14.5),
    "high_precision_fwd_mxfp8_bwd": (EXACT, E4M3, E4M3),
    "mxfp8_fwd_nvfp4_bwd": (E4M3, 14.0, 14.5),
    "nvfp4_1d_weight": (16.0, 13.0, 14.5),
    "mxfp8_fwd_high_precision_bwd": (E4M3, 30.0, 30.0),  # one quantized operand per GEMM
    "nvfp4_row_scaled_fwd_mxfp8_bwd": (16.0, 18.5, 18.5),  # MXFP8 only for non-grouped
    "nvfp4_row_scaled_fwd_high_precision_bwd": (16.0, 18.5, 18.5),
}
KINDS = ["linear", "layernorm", "grouped"]


@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("name", list(BUILTIN_OF))
def test_base_factory_equals_builtin_recipe(name, kind):
    base = make_module(kind)
    x, dy = make_data(seed=11)
    want = run_step(copy.deepcopy(base), x, dy, FORMATS[BUILTIN_OF[name]](), seed=5)
    got = run_step(copy.deepcopy(base), x, dy, CustomRecipe(BASE[name]), seed=5)
    assert_bitwise(got.y, want.y, f"{name} output")
    assert_bitwise(got.dx, want.dx, f"{name} dx")
    assert_grads_bitwise(got.grads, want.grads, name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(FLOORS))
def test_factory_trains_with_sqnr_floor(name, kind):
    assert set(FLOORS) == set(BASE) | set(ZOO)
    base = make_module(kind)
    x, dy = make_data(seed=1)
    ref = run_step(copy.deepcopy(base), x, dy, None)
    got = run_step(copy.deepcopy(base), x, dy, CustomRecipe({**BASE, **ZOO}[name]))
    w_ref = torch.cat([g.flatten() for g in ref.weight_grads().values()])
    w_got = torch.cat([g.flatten() for g in got.weight_grads().values()])
    values = (sqnr_db(ref.y, got.y), sqnr_db(ref.dx, got.dx), sqnr_db(w_ref, w_got))
    for what, value, floor in zip(("output", "dx", "dW"), values, FLOORS[name]):
        assert value >= floor, f"{name} {kind} {what}: SQNR {value:.2f} dB < {floor} dB"
    for n, g in got.grads.items():
        assert torch.isfinite(g).all(), n


@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_high_precision_backward_of_the_forward_value(kind):
    """mxfp8_fwd_high_precision_bwd: dx = dy · Wq and dW = dyᵀ · xq in FP32, where xq, Wq are
    the MXFP8 values the forward used (rowwise_dequantized + Identity columnwise)."""
    m = make_module(kind)
    x, dy = make_data(seed=12)
    got = run_step(m, x, dy, CustomRecipe(ZOO["mxfp8_fwd_high_precision_bwd"]))
    ref_m = copy.deepcopy(m)
    with torch.no_grad():  # the reference sees the MXFP8 values of W (and of x, below)
        for n, p in ref_m.named_parameters():
            if n.startswith("weight"):
                p.copy_(MXFP8Quantizer().quantize(p).dequantize(direction="rowwise"))
    if kind == "grouped":  # experts quantize their own rows (blocks never straddle experts)
        rows = torch.split(x, [0, 19, 29])
        xq = torch.cat([MXFP8Quantizer().quantize(r).dequantize(direction="rowwise") for r in rows])
    else:
        xq = MXFP8Quantizer().quantize(x).dequantize(direction="rowwise")
    ref = run_step(ref_m, xq, dy, None)
    # FP32 results of the same products, only the accumulation order may differ.
    torch.testing.assert_close(got.y, ref.y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.dx, ref.dx, rtol=1e-5, atol=1e-5)
    for n in got.weight_grads():
        torch.testing.assert_close(got.grads[n], ref.grads[n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_zoo_recipe_equals_its_per_gemm_spelling(kind):
    """high_precision_fwd_mxfp8_bwd is per_gemm(high_precision, mxfp8, mxfp8) by definition."""
    base = make_module(kind)
    x, dy = make_data(seed=13)
    want = run_step(copy.deepcopy(base), x, dy, CustomRecipe(per_gemm("high_precision", "mxfp8", "mxfp8")))
    got = run_step(copy.deepcopy(base), x, dy, CustomRecipe(ZOO["high_precision_fwd_mxfp8_bwd"]))
    assert_bitwise(got.y, want.y, "output")
    assert_bitwise(got.dx, want.dx, "dx")
    assert_grads_bitwise(got.grads, want.grads, kind)
