"""Views of leading dims, and split / chunk / slice along dim 0 at block boundaries (no
re-quantization: the pieces are views of the payload and equal slices of the dequantized value)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp
from hybridfp import QuantizedTensor
from tensor_cases import assert_bitwise, case_params, data_ptrs, make_input, quantize

CASES_WITH_BLOCKS = case_params(["fp8_block_1d", "fp8_block_2d", "mxfp8", "mxfp8_2d", "nvfp4",
                                 "nvfp4_rht", "nvfp4_2d", "hybrid_nvfp4_mxfp8",
                                 "hybrid_block1d_nvfp4rht", "hybrid_mxfp8_nvfp4_rowdq",
                                 "hybrid_rownvfp4_mxfp8_rowdq"])


@pytest.fixture(autouse=True)
def no_fallback_warning():
    """Every op here is handled natively: a dequantizing fallback would be a bug."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hybridfp: aten")
        yield


def _storages(t: QuantizedTensor) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in t.qstorage.tensors()}


def _check_piece(piece: QuantizedTensor, whole: QuantizedTensor, full: dict, start: int, stop: int) -> None:
    """``piece`` = rows [start, stop) of dim 0 of ``whole``: same copies, a view, exact values."""
    assert type(piece) is QuantizedTensor and piece.shape == (stop - start, *whole.shape[1:])
    assert piece.directions() == whole.directions() and piece.quantizer is whole.quantizer
    assert _storages(piece) <= _storages(whole)  # a view: nothing re-quantized or copied
    for d, v in full.items():
        assert_bitwise(piece.dequantize(direction=d), v[start:stop])


@pytest.mark.parametrize("case", case_params())
def test_views_of_leading_dims(case):
    t = quantize(case, make_input((4, 6, 64)))
    full = {d: t.dequantize(direction=d) for d in t.directions()}
    views = [((24, 64), t.view(24, 64)), ((2, 12, 64), t.reshape(2, 12, 64)), ((24, 64), t.view(-1, 64)),
             ((4, 6, 64), t.view(24, 64).view(4, 6, 64)), ((1, 24, 64), t.reshape(1, -1, 64))]
    for shape, v in views:
        assert type(v) is QuantizedTensor and tuple(v.shape) == shape
        assert data_ptrs(v) == data_ptrs(t)
        for d, value in full.items():
            assert_bitwise(v.dequantize(direction=d), value.reshape(shape))
    flat = t.flatten(0, 1)
    assert tuple(flat.shape) == (24, 64) and data_ptrs(flat) == data_ptrs(t)


@pytest.mark.parametrize("case", case_params(["mxfp8", "nvfp4", "identity", "hybrid_nvfp4_mxfp8"]))
def test_view_changing_the_last_dim_is_a_clear_error(case):
    t = quantize(case, make_input((4, 6, 64)))
    for bad in (lambda: t.view(4, 384), lambda: t.view(-1), lambda: t.reshape(24, 32, 2)):
        with pytest.raises(ValueError, match=r"same last dimension \(64\).*Dequantize first") as e:
            bad()
        assert t.qstorage.describe() in str(e.value)


@pytest.mark.parametrize("case", case_params())
def test_split_chunk_slice_at_block_boundaries(case):
    g = max(case.granularity(), 8)  # unblocked formats: any cut works, 8 will do
    rows = 3 * g + 5  # a ragged last piece: a cut may always end at the end
    t = quantize(case, make_input((rows, 48)))
    full = {d: t.dequantize(direction=d) for d in t.directions()}
    pieces = t.split(g)
    assert len(pieces) == 4
    for i, p in enumerate(pieces):
        _check_piece(p, t, full, i * g, min((i + 1) * g, rows))
    a, b = torch.split(t, [g, rows - g])
    _check_piece(a, t, full, 0, g)
    _check_piece(b, t, full, g, rows)
    _check_piece(t[g:2 * g], t, full, g, 2 * g)
    _check_piece(t[2 * g:], t, full, 2 * g, rows)
    _check_piece(t[:g], t, full, 0, g)
    _check_piece(t[-(rows - g):], t, full, g, rows)  # negative start
    _check_piece(t[g:10 ** 9], t, full, g, rows)  # stop past the end is clamped
    c = quantize(case, make_input((4 * g, 48)))
    cfull = {d: c.dequantize(direction=d) for d in c.directions()}
    for i, p in enumerate(c.chunk(2)):
        _check_piece(p, c, cfull, 2 * g * i, 2 * g * (i + 1))


@pytest.mark.parametrize("case", case_params())
def test_split_of_a_3d_tensor_along_dim0(case):
    """Dim 0 of [n, g, K] cuts at multiples of g flattened rows."""
    g = case.granularity()
    t = quantize(case, make_input((3, g, 32)))
    full = {d: t.dequantize(direction=d) for d in t.directions()}
    for i, p in enumerate(t.split(1)):
        _check_piece(p, t, full, i, i + 1)
    _check_piece(t[1:], t, full, 1, 3)


@pytest.mark.parametrize("case", CASES_WITH_BLOCKS)
def test_cut_inside_a_block_names_the_granularity(case):
    g = case.granularity()
    assert g > 1
    t = quantize(case, make_input((2 * g, 32)))
    before = [x.clone() for x in t.qstorage.tensors()]
    for bad in (lambda: t.split(g // 2), lambda: t[g // 2:], lambda: t[: g + 1],
                lambda: torch.split(t, [g - 1, g + 1])):
        with pytest.raises(ValueError, match=f"multiples of {g} rows") as e:
            bad()
        assert "dequantize first" in str(e.value) and f"shape ({2 * g}, 32)" in str(e.value)
    for x, y in zip(t.qstorage.tensors(), before):  # a failed cut changes nothing
        assert_bitwise(x, y)


def test_hybrid_cut_error_names_the_hybrid_granularity():
    """A part only knows its own block (32 rows); the hybrid needs the lcm with the other (128)."""
    q = hybridfp.HybridQuantizer(hybridfp.MXFP8Quantizer(with_2d_quantization=True),
                                 hybridfp.Float8BlockQuantizer(block_scaling_dim=1))
    t = q(make_input((256, 32)))
    assert t.qstorage.row_granularity() == 128
    with pytest.raises(ValueError, match=r"Hybrid\[MXFP8/FP8 block\].*multiples of 128 rows"):
        t.split(16)
    with pytest.raises(ValueError, match="multiples of 128 rows"):
        t.split(64)
    assert [tuple(p.shape) for p in t.split(128)] == [(128, 32), (128, 32)]


@pytest.mark.parametrize("case", case_params(["mxfp8", "nvfp4_rht", "hybrid_nvfp4_mxfp8"]))
def test_other_dims_and_steps_fall_back(case):
    t = quantize(case, make_input((64, 64)))
    deq = t.dequantize()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cols = t.split(32, dim=1)
        sliced = t[:, 16:48]
        stepped = t[::2]
    assert [type(c) for c in cols] == [torch.Tensor, torch.Tensor]
    for c, want in zip(cols, deq.split(32, dim=1)):
        assert_bitwise(c, want)
    assert_bitwise(sliced, deq[:, 16:48])
    assert_bitwise(stepped, deq[::2])
    names = [str(w.message).split()[1] for w in rec if "hybridfp" in str(w.message)]
    assert names == ["aten.split", "aten.slice"]  # the second slice: already warned


def test_slicing_a_1d_tensor_is_a_clear_error():
    t = hybridfp.MXFP8Quantizer()(make_input((64,)))
    with pytest.raises(ValueError, match="along its last \\(blocked\\) dimension"):
        t[0:32]


@pytest.mark.parametrize("case", case_params())
def test_empty_dim0_split(case):
    t = quantize(case, make_input((0, 64)))
    pieces = t.split(32)
    assert len(pieces) == 1 and tuple(pieces[0].shape) == (0, 64)
    for d in t.directions():
        assert_bitwise(pieces[0].dequantize(direction=d), torch.zeros(0, 64))
