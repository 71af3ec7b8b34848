"""Layouts pick the copies of numerics §1 and compute the linear layer's three GEMMs:

    TN fprop  y  = x Wᵀ   x.rowwise,     W.rowwise
    NN dgrad  dx = dy W   dy.rowwise,    W.columnwise
    NT wgrad  dW = dyᵀ x  dy.columnwise, x.columnwise

The operands are hybrids whose two copies are different formats, so reading the wrong copy
changes the numbers by the quantization error (>= 1e-3 relative), far above REL_TOL."""

from __future__ import annotations

import itertools

import pytest
import torch
from gemm_operands import REL_TOL, ref_operand, rel_err, source

from hybridfp import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, HybridQuantizer,
                      IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer)
from hybridfp.gemm import GEMM_OF_LAYOUT, LAYOUTS, gemm
from hybridfp.tensors import COLUMNWISE, ROWWISE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _hybrids(x_col_rht: bool = False):
    x = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=x_col_rht))(source("x"))
    w = HybridQuantizer(Float8CurrentScalingQuantizer(E4M3),
                        Float8BlockQuantizer(block_scaling_dim=1))(source("w"))
    dy = HybridQuantizer(Float8CurrentScalingQuantizer(E5M2),
                         NVFP4Quantizer(with_rht=True) if x_col_rht else MXFP8Quantizer())(source("dy"))
    return {"x": x, "w": w, "dy": dy}


def _deq(t, direction):
    """FP64 dequantized copy in the tensor's own orientation [rows, cols]."""
    return t.dequantize(torch.float32, direction).double()


#: layout -> (A, B, the math in original orientation)
MATH = {
    "TN": ("x", "w", lambda t: _deq(t["x"], ROWWISE) @ _deq(t["w"], ROWWISE).t()),
    "NN": ("dy", "w", lambda t: _deq(t["dy"], ROWWISE) @ _deq(t["w"], COLUMNWISE)),
    "NT": ("dy", "x", lambda t: _deq(t["dy"], COLUMNWISE).t() @ _deq(t["x"], COLUMNWISE)),
}


def test_layout_table():
    assert LAYOUTS == {"TN": (ROWWISE, ROWWISE), "NN": (ROWWISE, COLUMNWISE), "NT": (COLUMNWISE, COLUMNWISE)}
    assert GEMM_OF_LAYOUT == {"TN": "fprop", "NN": "dgrad", "NT": "wgrad"}


@pytest.mark.parametrize("x_col_rht", [False, True], ids=["mxfp8-wgrad", "rht-wgrad"])
@pytest.mark.parametrize("layout", list(MATH))
def test_layout_computes_the_linear_gemm(layout, x_col_rht):
    t = _hybrids(x_col_rht)
    a, b, math = MATH[layout]
    out = gemm(t[a], t[b], layout, out_dtype=torch.float32)
    want = math(t)
    assert tuple(out.shape) == {"TN": (40, 24), "NN": (40, 56), "NT": (24, 56)}[layout]
    assert rel_err(out, want) < REL_TOL


@pytest.mark.parametrize("layout", list(MATH))
def test_layout_reads_the_right_copies(layout):
    """Reading the other copy of A or B (its values brought to the same orientation) would
    give a clearly different product: only the numerics §1 pair matches."""
    t = _hybrids()
    a, b, _ = MATH[layout]
    out = gemm(t[a], t[b], layout, out_dtype=torch.float32)
    other = {ROWWISE: COLUMNWISE, COLUMNWISE: ROWWISE}

    def candidates(x, direction):  # stored orientation of ``direction``, from either copy
        return {direction: ref_operand(x, direction), other[direction]: ref_operand(x, other[direction]).t()}

    da, db = LAYOUTS[layout]
    for (ca, va), (cb, vb) in itertools.product(candidates(t[a], da).items(), candidates(t[b], db).items()):
        err = rel_err(out, va @ vb.t())
        if (ca, cb) == (da, db):
            assert err < REL_TOL
        else:
            assert err > 1e-3, (ca, cb, err)


@pytest.mark.parametrize("layout", list(MATH))
def test_plain_tensors_give_the_plain_math(layout):
    x, w, dy = source("x"), source("w"), source("dy")
    a, b, _ = MATH[layout]
    out = gemm({"x": x, "w": w, "dy": dy}[a], {"x": x, "w": w, "dy": dy}[b], layout, out_dtype=torch.float32)
    want = {"TN": x.double() @ w.double().t(), "NN": dy.double() @ w.double(),
            "NT": dy.double().t() @ x.double()}[layout]
    assert rel_err(out, want) < REL_TOL


def test_leading_dims_are_flattened():
    """A [2, 20, K] input is the [40, K] operand of the GEMM (numerics §1)."""
    q = HybridQuantizer(MXFP8Quantizer(), IdentityQuantizer())
    x3 = q(source("x").reshape(2, 20, -1))
    x2 = q(source("x"))
    w = MXFP8Quantizer()(source("w"))
    dy3 = source("dy").reshape(2, 20, -1)
    assert torch.equal(gemm(x3, w, "TN", out_dtype=torch.float32), gemm(x2, w, "TN", out_dtype=torch.float32))
    assert torch.equal(gemm(dy3, x3, "NT", out_dtype=torch.float32),
                       gemm(source("dy"), x2, "NT", out_dtype=torch.float32))
