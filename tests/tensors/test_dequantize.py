"""dequantize(dtype, direction): values equal the formats layer bit for bit, original shape."""

from __future__ import annotations

import pytest
import torch

import hybridfp
from hybridfp.tensors import COLUMNWISE, ROWWISE
from tensor_cases import CASES, as2d, assert_bitwise, case_params, make_input, quantize

TWO_COPY = case_params([c.name for c in CASES if c.col is not None])


@pytest.mark.parametrize("shape", [(2, 3, 40), (70, 200), (3, 130)], ids=str)
@pytest.mark.parametrize("case", case_params())
def test_each_direction_equals_formats_reference(case, shape):
    """A columnwise copy (stored transposed) comes back in the original orientation and shape."""
    x = make_input(shape)
    t = quantize(case, x)
    for d in case.directions:
        want = case.value(d, as2d(x)).reshape(shape)
        assert_bitwise(t.dequantize(direction=d), want)  # nominal dtype: float32
        assert_bitwise(t.dequantize(torch.bfloat16, d), want.to(torch.bfloat16))
        assert_bitwise(t.qstorage.decode(d), want.reshape(as2d(x).shape))  # FP32 [rows, cols]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", case_params())
def test_low_precision_input(case, dtype):
    """A bf16/fp16 source: the nominal dtype is the source's; values still match the reference."""
    x = make_input((2, 48, 64), dtype)
    t = quantize(case, x)
    assert t.dtype == dtype and t.shape == x.shape
    for d in case.directions:
        want = case.value(d, as2d(x)).reshape(x.shape)
        assert_bitwise(t.dequantize(direction=d), want.to(dtype))
        assert_bitwise(t.dequantize(torch.float32, d), want)


@pytest.mark.parametrize("case", case_params())
def test_default_direction_is_the_more_precise_copy(case):
    """Plain formats: rowwise. Hybrids: the copy whose format is more precise (rowwise on ties)."""
    x = make_input((64, 64))
    t = quantize(case, x)
    want = case.value(case.preferred(), x)
    assert_bitwise(t.dequantize(), want)
    assert_bitwise(t.dequantize(dtype=torch.float16), want.to(torch.float16))


def test_hybrid_default_direction_examples():
    """Spelled out: NVFP4 rowwise + MXFP8 columnwise prefers MXFP8; Identity beats anything."""
    x = make_input((64, 64))
    nv_mx = hybridfp.HybridQuantizer(hybridfp.NVFP4Quantizer(), hybridfp.MXFP8Quantizer())(x)
    assert nv_mx.qstorage.preferred_direction() == COLUMNWISE
    mx_id = hybridfp.HybridQuantizer(hybridfp.MXFP8Quantizer(), hybridfp.IdentityQuantizer(),
                                     "rowwise_dequantized")(x)
    assert mx_id.qstorage.preferred_direction() == COLUMNWISE
    # rowwise_dequantized + Identity: the backward copy is exactly the forward's value
    assert_bitwise(mx_id.dequantize(), mx_id.dequantize(direction=ROWWISE))
    mx_fp8 = hybridfp.HybridQuantizer(hybridfp.MXFP8Quantizer(),
                                      hybridfp.Float8CurrentScalingQuantizer())(x)
    assert mx_fp8.qstorage.preferred_direction() == ROWWISE  # a tie: rowwise


@pytest.mark.parametrize("case", TWO_COPY)
def test_single_copy_default_is_that_copy(case):
    x = make_input((64, 64))
    t = quantize(case, x, rowwise=False, columnwise=True)
    assert t.directions() == (COLUMNWISE,)
    assert_bitwise(t.dequantize(), case.value(COLUMNWISE, x))


def test_identity_dequantize_returns_the_source_values():
    x = make_input((3, 5, 8), torch.bfloat16)
    t = hybridfp.IdentityQuantizer()(x)
    assert_bitwise(t.dequantize(), x)
    assert_bitwise(t.dequantize(direction=COLUMNWISE), x)
    cast = hybridfp.IdentityQuantizer(torch.bfloat16)(x.float())  # stored in bf16, nominal fp32
    assert cast.qstorage.payloads[ROWWISE]["data"].dtype == torch.bfloat16
    assert_bitwise(cast.dequantize(), x.float())


def test_delayed_scaling_uses_the_stored_scale():
    """The delayed quantizer's scale at quantization time is what dequantize divides by."""
    q = hybridfp.Float8Quantizer()
    x = make_input((16, 32))
    t1 = q(x)  # scale 1: the first step has no history
    assert_bitwise(t1.qstorage.payloads[ROWWISE]["scale_inv"], torch.tensor(1.0))
    q.update_scale()
    t2 = q(x)
    amax = x.abs().max()
    assert_bitwise(t2.qstorage.payloads[ROWWISE]["scale_inv"], 1.0 / (448.0 / amax))
    assert_bitwise(t1.qstorage.payloads[ROWWISE]["scale_inv"], torch.tensor(1.0))  # unchanged
