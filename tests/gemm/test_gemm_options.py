"""gemm's options and errors: bias (FP32, before the cast), out_dtype (one rounding of the
FP32 result), accumulate_into (in place), and the errors for mismatched shapes, unknown
layouts, bad operands and missing copies."""

from __future__ import annotations

import pytest
import torch
from gemm_operands import K, M, N, REL_TOL, operand, reference, rel_err, source

from hybridfp import (Float8CurrentScalingQuantizer, HybridQuantizer, MissingDirectionError,
                      MXFP8Quantizer, NVFP4Quantizer, QuantizerRole)
from hybridfp.gemm import gemm
from hybridfp.tensors import ROWWISE

PAIRS = [("mxfp8_1d", "nvfp4_2d"), ("fp8_e4m3", "fp8_block_2d"), ("nvfp4_row_scaled", "identity_bf16")]


def _fprop(fa, fb, **kw):
    return gemm(operand(fa, "x"), operand(fb, "w"), "TN", **kw)


# ------------------------------------------------------------------ bias, out_dtype
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fa, fb", PAIRS)
def test_bias_is_added_in_fp32_before_the_cast(fa, fb, bias_dtype):
    bias = (torch.randn(N, generator=torch.Generator().manual_seed(7)) * 10).to(bias_dtype)
    acc = _fprop(fa, fb, out_dtype=torch.float32)
    want32 = acc + bias.float()
    assert torch.equal(_fprop(fa, fb, out_dtype=torch.float32, bias=bias), want32)
    got16 = _fprop(fa, fb, out_dtype=torch.bfloat16, bias=bias)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, want32.to(torch.bfloat16))
    # Adding after the cast rounds twice, which differs somewhere for these values.
    assert not torch.equal(got16, (acc.to(torch.bfloat16) + bias.to(torch.bfloat16)))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout, a, b", [("TN", "x", "w"), ("NN", "dy", "w"), ("NT", "dy", "x")])
def test_out_dtype_is_the_fp32_result_rounded_once(layout, a, b, out_dtype):
    fa, fb = "mxfp8_1d", "nvfp4_rht"
    A, B = operand(fa, a), operand(fb, b)
    got = gemm(A, B, layout, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, gemm(A, B, layout, out_dtype=torch.float32).to(out_dtype))


def test_default_out_dtype_is_bf16():
    assert _fprop("mxfp8_1d", "mxfp8_1d").dtype == torch.bfloat16


# ------------------------------------------------------------------ accumulate_into
@pytest.mark.parametrize("with_bias", [False, True])
def test_accumulate_into_adds_in_place_and_returns_the_buffer(with_bias):
    dy, x = operand("mxfp8_1d", "dy"), operand("nvfp4_rht", "x")
    bias = torch.randn(K) if with_bias else None
    buf = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    before, ptr = buf.clone(), buf.data_ptr()
    res = gemm(dy, x, "NT", out_dtype=torch.bfloat16, bias=bias, accumulate_into=buf)
    assert res is buf and buf.data_ptr() == ptr and buf.dtype == torch.float32
    update = gemm(dy, x, "NT", out_dtype=torch.float32, bias=bias)
    assert torch.equal(buf, before + update)  # FP32 += FP32 result: no intermediate rounding
    gemm(dy, x, "NT", bias=bias, accumulate_into=buf)  # and again: a second micro-batch
    assert torch.equal(buf, (before + update) + update)


def test_accumulate_into_bf16_buffer_rounds_the_sum_once():
    a, b = operand("fp8_e4m3", "x"), operand("fp8_e4m3", "w")
    buf = torch.randn(M, N).to(torch.bfloat16)
    before = buf.clone()
    gemm(a, b, "TN", accumulate_into=buf)
    assert torch.equal(buf, (before.float() + gemm(a, b, "TN", out_dtype=torch.float32)).to(torch.bfloat16))


def test_accumulate_into_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"\[40, 24\].*\(24, 40\)"):
        _fprop("mxfp8_1d", "mxfp8_1d", accumulate_into=torch.zeros(N, M))


# ------------------------------------------------------------------ out
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fa, fb", PAIRS)
def test_out_receives_the_result_in_a_row_slice(fa, fb, out_dtype):
    """gemm(out=rows of a bigger tensor) writes exactly gemm()'s result there, returns that
    slice and leaves the other rows alone (grouped_gemm's per-expert path relies on it)."""
    big = torch.full((M + 7, N), -3.0, dtype=out_dtype)
    before = big.clone()
    res = _fprop(fa, fb, out_dtype=out_dtype, out=big[3:3 + M])
    assert res.data_ptr() == big[3].data_ptr() and res.shape == (M, N)
    assert torch.equal(big[3:3 + M], _fprop(fa, fb, out_dtype=out_dtype))
    assert torch.equal(big[:3], before[:3]) and torch.equal(big[3 + M:], before[3 + M:])


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.empty(N, M, dtype=torch.bfloat16), r"\[40, 24\].*\(24, 40\)"),
    (lambda: torch.empty(M, N, dtype=torch.float16), r"bfloat16.*float16"),
    (lambda: torch.empty(N, M, dtype=torch.bfloat16).t(), "unit column stride"),
])
def test_out_of_the_wrong_shape_dtype_or_layout(bad, match):
    with pytest.raises(ValueError, match=match):
        _fprop("mxfp8_1d", "mxfp8_1d", out=bad())


def test_out_with_accumulate_into_is_refused():
    with pytest.raises(ValueError, match="either out or accumulate_into"):
        _fprop("mxfp8_1d", "mxfp8_1d", out=torch.empty(M, N, dtype=torch.bfloat16),
               accumulate_into=torch.zeros(M, N))


# ------------------------------------------------------------------ errors
def _labelled(q, tensor_type, which, name="blocks.1.fc2"):
    q.role = QuantizerRole("linear", tensor_type, name)
    return q(source(which))


@pytest.mark.parametrize("layout, a_shape, b_shape, ka, kb", [
    ("TN", (M, K), (N, K + 16), K, K + 16),        # x [M, K] vs W [N, K']
    ("NN", (M, N), (N + 8, K), N, N + 8),          # dy [M, N] vs W [N', K]
    ("NT", (M, N), (M + 4, K), M, M + 4),          # dy [M, N] vs x [M', K]
])
def test_reduction_mismatch_names_both_operands(layout, a_shape, b_shape, ka, kb):
    qa, qb = MXFP8Quantizer(), Float8CurrentScalingQuantizer()
    qa.role, qb.role = QuantizerRole("linear", "input", "fc"), QuantizerRole("linear", "weight", "fc")
    a, b = qa(torch.randn(a_shape)), qb(torch.randn(b_shape))
    with pytest.raises(ValueError) as e:
        gemm(a, b, layout)
    msg = str(e.value)
    for part in (layout, f"over {ka}", f"over {kb}", "A's", "B's", "fc.input", "fc.weight",
                 str(a_shape), str(b_shape), "MXFP8", "FP8 per-tensor"):
        assert part in msg, part


def test_plain_operand_shape_mismatch():
    with pytest.raises(ValueError, match="reduction lengths differ"):
        gemm(torch.randn(4, 8), torch.randn(3, 9), "TN")


def test_bias_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"bias must have shape \[24\]; got \(40,\)"):
        _fprop("mxfp8_1d", "mxfp8_1d", bias=torch.zeros(M))


@pytest.mark.parametrize("layout", ["TT", "nt", "fprop", ""])
def test_unknown_layout(layout):
    with pytest.raises(ValueError) as e:
        gemm(source("x"), source("w"), layout)
    assert repr(layout) in str(e.value) and all(s in str(e.value) for s in ("TN", "NN", "NT"))


@pytest.mark.parametrize("bad", [torch.ones(4, 8, dtype=torch.int32), [[1.0] * 8] * 4])
def test_non_floating_operand(bad):
    with pytest.raises(TypeError, match="operand A"):
        gemm(bad, torch.randn(3, 8), "TN")
    with pytest.raises(TypeError, match="operand B"):
        gemm(torch.randn(3, 8), bad, "TN")


@pytest.mark.parametrize("kind", ["plain", "hybrid", "row_scaled"])
def test_missing_direction_names_direction_and_role(kind):
    """dgrad needs W.columnwise; a weight quantized rowwise-only cannot serve it."""
    if kind == "plain":
        q = Float8CurrentScalingQuantizer(columnwise=False)
    elif kind == "hybrid":
        q = HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), columnwise=False)
    else:
        q = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)
    w = _labelled(q, "weight", "w")
    with pytest.raises(MissingDirectionError) as e:
        gemm(source("dy"), w, "NN")
    assert "columnwise" in str(e.value) and "blocks.1.fc2.weight" in str(e.value)
    gemm(source("x"), w, "TN")  # the copy it holds still works


def test_missing_rowwise_copy_names_the_role():
    x = _labelled(MXFP8Quantizer(rowwise=False), "input", "x", name="attn.proj")
    with pytest.raises(MissingDirectionError) as e:
        gemm(x, source("w"), "TN")
    assert "rowwise" in str(e.value) and "attn.proj.input" in str(e.value)


# ------------------------------------------------------------------ global matmul settings
@pytest.fixture
def restore_matmul_precision():
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.fp32_precision,
             torch.backends.mkldnn.matmul.fp32_precision)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.fp32_precision = saved[1]
    torch.backends.mkldnn.matmul.fp32_precision = saved[2]


@pytest.mark.parametrize("setting", ["new_api", "legacy_api", "matmul_precision", "onednn_bf16"])
def test_emulation_works_with_any_reduced_precision_setting(setting, restore_matmul_precision):
    """The emulation does not read ``torch.backends.cuda.matmul.allow_tf32``, which raises once
    TF32 is set through torch's fp32_precision API (every GEMM would fail, on CPU too). It also
    must not let a reduced-precision FP32 matmul setting (TF32, oneDNN BF16) reach
    its exact product; the settings are restored afterwards."""
    cuda, onednn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    if setting == "new_api":
        cuda.fp32_precision = "tf32"
    elif setting == "legacy_api":
        cuda.allow_tf32 = True
    elif setting == "matmul_precision":
        torch.set_float32_matmul_precision("high")
    else:
        onednn.fp32_precision = "bf16"
    before = (cuda.fp32_precision, onednn.fp32_precision)
    a, b = operand("mxfp8_1d", "x"), operand("fp8_e4m3", "w")
    out = gemm(a, b, "TN", out_dtype=torch.float32)
    assert rel_err(out, reference(a, ROWWISE, b, ROWWISE)) < REL_TOL
    assert (cuda.fp32_precision, onednn.fp32_precision) == before
