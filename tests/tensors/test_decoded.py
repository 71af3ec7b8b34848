"""Copies held as their BF16 decodes (``tensors/decoded.py``): the same values, format key and
GEMM operand as the codes they decode, through slicing, saving and the GEMM."""

from __future__ import annotations

import io

import pytest
import torch

from hybridfp import QuantizedTensor
from hybridfp.gemm import gemm
from hybridfp.quantizers import Float8CurrentScalingQuantizer, HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer
from hybridfp.tensors import COLUMNWISE, ROWWISE, DecodedMXFP8Storage, DecodedNVFP4Storage, DecodedStorage, MXFP8Storage


def _pair(fp8_dtype=torch.float8_e4m3fn, shape=(96, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    codes = MXFP8Quantizer(fp8_dtype).reference_encode(x, True, True)
    return codes, DecodedStorage.of(codes)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_same_values_key_and_operand(fp8_dtype):
    codes, dec = _pair(fp8_dtype)
    assert type(dec) is DecodedMXFP8Storage and dec.meta == codes.meta
    for d in (ROWWISE, COLUMNWISE):
        assert dec.format_key(d) == codes.format_key(d)
        assert torch.equal(_bits(dec.dequantize(direction=d)), _bits(codes.dequantize(direction=d)))
        a, b = dec.gemm_operand(d), codes.gemm_operand(d)
        assert torch.equal(_bits(a.values), _bits(b.values)) and a.scale is None and a.k == b.k
        assert dec.payload(d)["data"].dtype == torch.bfloat16
    assert "held as its BF16 decode" in dec.describe()
    assert dec.nbytes() == 2 * 2 * codes.rows * codes.cols


def test_slicing_keeps_values():
    codes, dec = _pair(shape=(96, 64))
    part_c, part_d = codes.slice_dim0(32, 64), dec.slice_dim0(32, 64)
    for d in (ROWWISE, COLUMNWISE):
        assert torch.equal(part_d.dequantize(direction=d), part_c.dequantize(direction=d))


def test_gemm_equals_codes():
    a_codes, a_dec = _pair(seed=1)
    b_codes, b_dec = _pair(seed=2, shape=(48, 64))
    want = gemm(QuantizedTensor(a_codes), QuantizedTensor(b_codes), "TN", out_dtype=torch.float32)
    got = gemm(QuantizedTensor(a_dec), QuantizedTensor(b_codes), "TN", out_dtype=torch.float32)
    got2 = gemm(QuantizedTensor(a_dec), QuantizedTensor(b_dec), "TN", out_dtype=torch.float32)
    assert torch.equal(got, want) and torch.equal(got2, want)


def test_save_and_load():
    _, dec = _pair()
    t = QuantizedTensor(dec)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back.qstorage) is DecodedMXFP8Storage
    for d in (ROWWISE, COLUMNWISE):
        assert torch.equal(back.dequantize(direction=d), t.dequantize(direction=d))


def test_only_eligible_formats():
    rht = NVFP4Quantizer(with_rht=True).reference_encode(torch.randn(32, 64), False, True)
    with pytest.raises(TypeError, match="transformed domain"):
        DecodedStorage.of(rht)
    fp8 = Float8CurrentScalingQuantizer().reference_encode(torch.randn(32, 64), True, True)
    with pytest.raises(TypeError, match="can be held decoded"):
        DecodedStorage.of(fp8)
    with pytest.raises(ValueError, match="cannot hold only"):
        _pair()[0].with_decoded(frozenset({ROWWISE}))


@pytest.mark.parametrize("kw", [{}, {"row_scaled_nvfp4": True}, {"with_2d_quantization": True}], ids=str)
def test_nvfp4_rows_same_values_scale_and_gemm(kw):
    """An NVFP4 rowwise copy held decoded keeps its amax: the same S_dec (per tensor or per row),
    dequantized values, row slices and GEMM results."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-2, 2, 64)[:, None]
    codes = NVFP4Quantizer(**kw).reference_encode(x, True, False)
    dec = DecodedStorage.of(codes)
    assert type(dec) is DecodedNVFP4Storage and dec.format_key(ROWWISE) == codes.format_key(ROWWISE)
    assert dec.payload(ROWWISE)["amax"] is codes.payload(ROWWISE)["amax"]
    assert torch.equal(dec.epilogue_scale(ROWWISE), codes.epilogue_scale(ROWWISE))
    assert torch.equal(_bits(dec.dequantize(direction=ROWWISE)), _bits(codes.dequantize(direction=ROWWISE)))
    if kw.get("row_scaled_nvfp4"):
        assert torch.equal(dec.slice_dim0(16, 48).dequantize(), codes.slice_dim0(16, 48).dequantize())
    w = MXFP8Quantizer().reference_encode(torch.randn(40, 96, generator=g), True, False)
    want = gemm(QuantizedTensor(codes), QuantizedTensor(w), "TN", out_dtype=torch.float32)
    assert torch.equal(gemm(QuantizedTensor(dec), QuantizedTensor(w), "TN", out_dtype=torch.float32), want)


def test_hybrid_parts_decoded():
    hq = HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), "rowwise_dequantized")
    h = hq.reference_encode(torch.randn(64, 64), True, True)
    only_row = h.with_decoded(frozenset({ROWWISE}))
    assert type(only_row.part(ROWWISE)) is DecodedNVFP4Storage and only_row.part(COLUMNWISE) is h.part(COLUMNWISE)
    both = h.with_decoded(frozenset({ROWWISE, COLUMNWISE}))
    assert type(both.part(COLUMNWISE)) is DecodedMXFP8Storage
    for d in (ROWWISE, COLUMNWISE):
        assert torch.equal(both.dequantize(direction=d), h.dequantize(direction=d))
    assert h.with_decoded(frozenset()) is h


def test_joined_decode_is_not_cached():
    """A decoded copy's BF16 decode is its payload: the weight-decode cache must not keep an
    entry for it (the entry would hold its own weak key alive: one leaked weight copy a step)."""
    from hybridfp.gemm import bf16_decode
    _, dec = _pair()
    before = len(bf16_decode._CACHE)
    for d in (ROWWISE, COLUMNWISE):
        op = bf16_decode.decode_bf16_joined(dec, [dec], d, cache=True)
        assert op.values is dec.payload(d)["data"]
        assert bf16_decode.decode_bf16(dec, d, cache=True).values is dec.payload(d)["data"]
    assert len(bf16_decode._CACHE) == before


@pytest.mark.parametrize("kind", ["mxfp8", "nvfp4_rows", "nvfp4_row_scaled"])
def test_bf16_path_keeps_the_epilogue_factor(kind):
    """The BF16 tensor-core path (``decode_bf16`` + ``bf16_gemm``, CPU here) on a decoded copy
    equals it on the codes: NVFP4's S_dec (per tensor / per row) must reach the epilogue."""
    from hybridfp.gemm.bf16_decode import decode_bf16
    from hybridfp.gemm.bf16_tensorcore import bf16_gemm
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-2, 2, 48)[:, None]
    q = {"mxfp8": MXFP8Quantizer(), "nvfp4_rows": NVFP4Quantizer(),
         "nvfp4_row_scaled": NVFP4Quantizer(row_scaled_nvfp4=True)}[kind]
    codes = q.reference_encode(x, True, False)
    w = decode_bf16(MXFP8Quantizer().reference_encode(torch.randn(40, 64, generator=g), True, False), ROWWISE)
    a_codes, a_dec = decode_bf16(codes, ROWWISE), decode_bf16(DecodedStorage.of(codes), ROWWISE)
    assert (a_codes.scale is None) == (a_dec.scale is None)
    if a_codes.scale is not None:
        assert torch.equal(a_codes.scale, a_dec.scale)
    assert torch.equal(bf16_gemm(a_dec, w, out_dtype=torch.float32), bf16_gemm(a_codes, w, out_dtype=torch.float32))


def test_grouped_columns_join_at_the_source_block():
    """Experts' decoded MXFP8 columnwise copies of zero-padded groups (splits not multiples of 32)
    join into one operand as their codes do (the result's joined columnwise copy)."""
    from hybridfp.moe.joined import joined_column_storage, joined_of
    from hybridfp.moe.quantize import quantize_grouped
    splits = [20, 0, 33, 17]
    x = torch.randn(sum(splits), 64, generator=torch.Generator().manual_seed(2))
    out = {}
    for held in ((), (ROWWISE, COLUMNWISE)):
        qs = [MXFP8Quantizer(rowwise=False) for _ in splits]
        for q in qs:
            q.hold_decoded = held
        out[held] = joined_column_storage(joined_of(quantize_grouped(qs, x, splits), COLUMNWISE), COLUMNWISE)
    (codes, starts), (dec, dec_starts) = out[()], out[(ROWWISE, COLUMNWISE)]
    assert type(dec) is DecodedMXFP8Storage and dec_starts == starts == [0, 32, 32, 96]
    assert torch.equal(dec.dequantize(direction=COLUMNWISE), codes.dequantize(direction=COLUMNWISE))


@pytest.mark.parametrize("empty_first", [True, False])
def test_copy_into_keeps_the_destination_layout(empty_first):
    """``copy_`` into a quantized tensor re-quantizes into its own layout: a ``make_empty``
    destination (codes) from a quantizer that holds decoded copies, and a decoded destination
    from a quantizer that holds none."""
    q = MXFP8Quantizer()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    if empty_first:
        q.hold_decoded = (ROWWISE, COLUMNWISE)
        dst = q.make_empty((64, 64))
        want_cls = MXFP8Storage
    else:
        q.hold_decoded = (ROWWISE, COLUMNWISE)
        dst = q.quantize(torch.zeros(64, 64))
        q.hold_decoded = ()
        want_cls = DecodedMXFP8Storage
    dst.copy_(x)
    assert type(dst.qstorage) is want_cls
    ref = MXFP8Quantizer().reference_encode(x, True, True)
    for d in (ROWWISE, COLUMNWISE):
        assert torch.equal(dst.dequantize(direction=d), ref.dequantize(direction=d))
