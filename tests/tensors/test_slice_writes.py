"""Writes into a dim-0 slice (a view of the whole tensor's payload).

Block-local formats re-encode the slice's own blocks; formats with a per-tensor scale / amax
(FP8 per-tensor, NVFP4's global amax) cannot re-encode a slice without changing how every
other row decodes, so such writes are refused with a clear error and change nothing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tensor_cases import (assert_bitwise, assert_same_payloads, case_params, make_input,
                          quantize)

PER_TENSOR = {"fp8_current", "fp8_delayed", "nvfp4", "nvfp4_rht", "nvfp4_2d"}


def _per_tensor(case) -> bool:
    return any(case.key(d) in PER_TENSOR for d in case.directions)


def _setup(case):
    g = max(case.granularity(), 8)
    t = quantize(case, make_input((3 * g, 48)))
    full = {d: t.dequantize(direction=d) for d in t.directions()}
    return g, t, full


def _assert_rows_unchanged(t, full, keep):
    for d, v in full.items():
        assert_bitwise(t.dequantize(direction=d)[keep], v[keep])


@pytest.mark.parametrize("case", case_params())
def test_requantizing_write_into_a_slice(case):
    g, t, full = _setup(case)
    hp = make_input((g, 48), seed=3)
    piece = t[g:2 * g]
    before = [x.clone() for x in t.qstorage.tensors()]
    if _per_tensor(case):
        with pytest.raises(ValueError, match="dim-0 slice sharing the whole tensor's per-tensor"):
            piece.copy_(hp)
        for x, y in zip(t.qstorage.tensors(), before):  # nothing written
            assert_bitwise(x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match="clone\\(\\) the slice first"):
                piece.mul_(2.0)
        return
    piece.copy_(hp)  # block-local: only the slice's own blocks are re-encoded
    want = quantize(case, hp)
    for d in t.directions():
        assert_bitwise(t.dequantize(direction=d)[g:2 * g], want.dequantize(direction=d))
    _assert_rows_unchanged(t, full, slice(0, g))
    _assert_rows_unchanged(t, full, slice(2 * g, None))


@pytest.mark.parametrize("case", case_params())
def test_copy_between_slices_of_one_tensor(case):
    """Same per-tensor entries (one tensor): a payload copy is allowed for every format."""
    g, t, full = _setup(case)
    t[0:g].copy_(t[2 * g:3 * g])
    for d, v in full.items():
        assert_bitwise(t.dequantize(direction=d)[0:g], v[2 * g:3 * g])
    _assert_rows_unchanged(t, full, slice(g, None))


@pytest.mark.parametrize("case", case_params())
def test_copy_from_another_tensor_into_a_slice(case):
    g, t, full = _setup(case)
    other = quantize(case, make_input((g, 48), seed=4))
    # Delayed scaling: both tensors carry the quantizer's one scale, so the copy is exact.
    # Otherwise the other tensor's per-tensor scale / amax differs from t's: refused.
    if _per_tensor(case) and case.name != "fp8_delayed":
        with pytest.raises(ValueError, match="Write the whole tensor"):
            t[g:2 * g].copy_(other)
        _assert_rows_unchanged(t, full, slice(None))
        return
    t[g:2 * g].copy_(other)
    for d in t.directions():
        assert_bitwise(t.dequantize(direction=d)[g:2 * g], other.dequantize(direction=d))
    _assert_rows_unchanged(t, full, slice(0, g))


@pytest.mark.parametrize("case", case_params())
def test_zero_a_slice(case):
    """Zero codes decode to 0 under any scale: the shared per-tensor entries are kept."""
    g, t, full = _setup(case)
    t[g:2 * g].zero_()
    for d in t.directions():
        assert torch.equal(t.dequantize(direction=d)[g:2 * g], torch.zeros(g, 48))
    _assert_rows_unchanged(t, full, slice(0, g))
    _assert_rows_unchanged(t, full, slice(2 * g, None))


@pytest.mark.parametrize("case", case_params())
def test_a_cloned_or_whole_slice_is_writable(case):
    g, t, full = _setup(case)
    hp = make_input((g, 48), seed=5)
    c = t[g:2 * g].clone()
    c.copy_(hp)
    assert_same_payloads(c, quantize(case, hp))
    _assert_rows_unchanged(t, full, slice(None))
    whole = t[0:3 * g].view(3, g, 48)  # the full range is not a partial slice
    x = make_input((3, g, 48), seed=6)
    whole.copy_(x)
    assert_same_payloads(t, quantize(case, x.reshape(3 * g, 48)))
