"""Awkward shapes for every format: ragged blocks, a single element, empty tensors, 0-d / 1-d."""

from __future__ import annotations

import io

import pytest
import torch

from tensor_cases import (as2d, assert_bitwise, assert_same_payloads, case_params, expected_nbytes,
                          make_input, quantize)

SHAPES = [
    pytest.param((3, 130), id="3x130"),  # FP8 block: one ragged 1x128 block per row
    pytest.param((33, 50), id="33x50"),  # NVFP4: ragged 16-blocks and an odd packed length
    pytest.param((1, 1), id="1x1"),
    pytest.param((2, 3, 40), id="2x3x40"),
    pytest.param((0, 64), id="0x64"),
    pytest.param((2, 0, 64), id="2x0x64"),
    pytest.param((64, 0), id="64x0"),  # as_2d needs an explicit row count here
    pytest.param((37,), id="1d"),
    pytest.param((), id="0d"),
]


def _round_trip(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", case_params())
def test_awkward_shape(case, shape):
    x = make_input(shape)
    t = quantize(case, x)
    assert tuple(t.shape) == shape and t.dtype == x.dtype and t.directions() == case.directions
    x2 = as2d(x)
    assert t.quantized_nbytes() == expected_nbytes(case, *x2.shape, case.directions)
    for d in case.directions:
        assert_bitwise(t.dequantize(direction=d), case.value(d, x2).reshape(shape))
    c = t.clone()
    assert_same_payloads(c, t)
    assert c.quantized_nbytes() == t.quantized_nbytes()
    loaded = _round_trip(t)
    assert_same_payloads(loaded, t)
    for d in case.directions:
        assert_bitwise(loaded.dequantize(direction=d), t.dequantize(direction=d))
    z = torch.zeros_like(t)
    for d in case.directions:
        assert torch.equal(z.dequantize(direction=d), torch.zeros(shape))


@pytest.mark.parametrize("case", case_params())
def test_zero_width_tensor_from_allocation(case):
    """[64, 0] built by allocation (new_zeros / make_empty) rather than by quantizing."""
    t = quantize(case, make_input((64, 32))).new_zeros((64, 0))
    assert tuple(t.shape) == (64, 0)
    assert t.quantized_nbytes() == expected_nbytes(case, 64, 0, case.directions)
    for d in case.directions:
        assert_bitwise(t.dequantize(direction=d), torch.zeros(64, 0))
    assert_same_payloads(t.clone(), t)
    assert_same_payloads(_round_trip(t), t)
    e = case.make().make_empty((64, 0))
    assert tuple(e.shape) == (64, 0) and e.directions() == case.directions
