"""Every pair of operand formats in every layout where both copies exist (numerics §1: any pair
is legal) equals the FP64 GEMM of the operands' exact dequantized values; see
gemm_operands.py for the operands, the reference and the tolerance."""

from __future__ import annotations

import pytest
import torch
from gemm_operands import (FORMATS, LAYOUT_OPERANDS, M, N, REL_TOL, has_copy, is_rht, operand,
                           ref_operand, reference, rel_err)

from hybridfp.gemm import gemm
from hybridfp.tensors import COLUMNWISE, ROWWISE

NAMES = list(FORMATS)
CASES = [(layout, fa, fb) for layout, (_, da, _, db) in LAYOUT_OPERANDS.items()
         for fa in NAMES for fb in NAMES if has_copy(fa, da) and has_copy(fb, db)]


@pytest.mark.parametrize("layout, fmt_a, fmt_b", CASES, ids=["-".join(c) for c in CASES])
def test_pair_equals_fp64_gemm_of_dequantized_operands(layout, fmt_a, fmt_b):
    wa, da, wb, db = LAYOUT_OPERANDS[layout]
    a, b = operand(fmt_a, wa), operand(fmt_b, wb)
    out = gemm(a, b, layout, out_dtype=torch.float32)
    ref = reference(a, da, b, db)
    assert out.dtype == torch.float32 and tuple(out.shape) == tuple(ref.shape)
    assert rel_err(out, ref) < REL_TOL


COPIES = [(f, d) for f in NAMES for d in (ROWWISE, COLUMNWISE) if has_copy(f, d)]


@pytest.mark.parametrize("which", ["x", "w", "dy"])
@pytest.mark.parametrize("fmt, direction", COPIES, ids=["-".join(c) for c in COPIES])
def test_reference_operand_is_the_dequantized_value(fmt, direction, which):
    """The reference's operand (gemm_operand values x scale, inverse RHT, in FP64) is the
    tensor's dequantized copy: dequantize rounds once to FP32 (<= 2**-24 relative per
    element); an RHT copy's dequantize also runs the inverse butterfly in FP32 (4 additions
    deep: within 1e-6 of the operand's max)."""
    t = operand(fmt, which)
    ref = ref_operand(t, direction)
    deq = (t if fmt == "plain" else t.dequantize(torch.float32, direction)).double()  # [rows, cols]
    deq = deq if direction == ROWWISE else deq.t()  # the stored orientation of that copy
    if is_rht(t, direction):
        assert (deq - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    else:
        assert ((deq - ref).abs() <= ref.abs() * 2.0**-24).all()


def test_two_rht_operands_stay_in_the_transformed_domain():
    """wgrad of two RHT copies multiplies the transformed values (R cancels: R Rᵀ = I) over
    the padded reduction (40 rows -> 48), and approximates dyᵀ x of the original-domain
    dequantized values."""
    dy, x = operand("nvfp4_rht", "dy"), operand("nvfp4_rht", "x")
    a_op = dy.qstorage.gemm_operand(COLUMNWISE)
    assert a_op.rht and a_op.k == M and a_op.values.shape == (N, 48)
    out = gemm(dy, x, "NT", out_dtype=torch.float32)
    in_domain = ref_operand(dy, COLUMNWISE, keep_rht=True) @ ref_operand(x, COLUMNWISE, keep_rht=True).t()
    assert rel_err(out, in_domain) < REL_TOL
    dy_orig = dy.dequantize(torch.float32, COLUMNWISE).double()  # [M, N], inverse RHT applied
    x_orig = x.dequantize(torch.float32, COLUMNWISE).double()    # [M, K]
    assert rel_err(out, dy_orig.t() @ x_orig) < REL_TOL
    # ... and the transformed values really differ from the original-domain ones.
    assert rel_err(a_op.values[:, :M] * a_op.scale, dy_orig.t()) > 0.5


def test_one_rht_operand_is_inverse_transformed():
    """RHT copy x non-RHT copy: the GEMM undoes R on the RHT side; skipping that would give
    a wrong product (the check below shows how wrong)."""
    dy, x = operand("mxfp8_1d", "dy"), operand("nvfp4_rht", "x")
    out = gemm(dy, x, "NT", out_dtype=torch.float32)
    assert rel_err(out, reference(dy, COLUMNWISE, x, COLUMNWISE)) < REL_TOL
    wrong = ref_operand(dy, COLUMNWISE) @ ref_operand(x, COLUMNWISE, keep_rht=True)[:, :M].t()
    assert rel_err(out, wrong) > 0.5


def test_row_scaled_scales_are_per_output_row():
    """Row-scaled NVFP4 as A scales output rows, as B output columns (one S_dec per row)."""
    x = operand("nvfp4_row_scaled", "x")
    s = x.qstorage.gemm_operand(ROWWISE).scale
    assert s.shape == (M,) and s.unique().numel() > 1
    for a, b in ((x, operand("mxfp8_1d", "w")), (operand("mxfp8_1d", "w"), x)):
        out = gemm(a, b, "TN", out_dtype=torch.float32)
        assert rel_err(out, reference(a, ROWWISE, b, ROWWISE)) < REL_TOL
