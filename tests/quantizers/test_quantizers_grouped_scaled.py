"""``quantize_grouped`` with per-tensor scales computed for all experts at once (FP8 current
scaling, both copies; 1D NVFP4's rowwise copy): every expert's storage equals its own
``quantize`` bit for bit — E4M3 / E5M2, power-of-two scales, amax epsilon, NaN / inf inputs,
zero-size experts, counts not multiples of 16 / 32 / 128 — from ONE encoding (the experts'
payloads are views of shared buffers, the columnwise copies each expert's own contiguous
transpose); delayed scaling still records each expert's amax in its own history.
"""

from __future__ import annotations

import pytest
import torch
from test_quantizers_grouped import SPLITS, data

from hybridfp import factories
from hybridfp.quantizers import (Float8CurrentScalingQuantizer, Float8Quantizer, HybridQuantizer,
                                 MXFP8Quantizer, NVFP4Quantizer)
from hybridfp.moe import plan as qplan
from hybridfp.moe.quantize import quantize_grouped
from hybridfp.moe.quantize_scaled import BOTH, ROWS, group_scaled_mode
from hybridfp.recipes import QuantizerRole
from hybridfp.moe.grouped_tensor import GroupedTensor
from hybridfp.tensors.storage import COLUMNWISE, DIRECTIONS, ROWWISE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {
    "e4m3": dict(fp8_dtype=E4M3),
    "e5m2": dict(fp8_dtype=E5M2),
    "e4m3_pow2": dict(fp8_dtype=E4M3, force_pow_2_scales=True),
    "e5m2_eps": dict(fp8_dtype=E5M2, amax_epsilon=64.0),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Comparable bits: bytes of 1-byte payloads; FP32 NaNs made one NaN (payloads may differ)."""
    if t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)
    return t


def assert_bitwise_storage(got, want, what: str) -> None:
    assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype, what
    assert got.directions() == want.directions() and got.label == want.label, what
    for d in DIRECTIONS:
        if not want.has(d):
            continue
        g, w = got.part(d), want.part(d)
        assert type(g) is type(w) and g.meta == w.meta and g.label == w.label, f"{what} {d}"
        pg, pw = g.payload(d), w.payload(d)
        assert sorted(pg) == sorted(pw), f"{what} {d}"
        for n in pw:
            assert pg[n].dtype == pw[n].dtype and pg[n].shape == pw[n].shape, f"{what} {d} {n}"
            assert torch.equal(bits(pg[n]), bits(pw[n])), f"{what} {d} {n}"


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """NaN in expert 2, +inf in expert 4, -inf in expert 6 (SPLITS: 0, 19, 45, 1, 130, 0, 33)."""
    x = x.clone()
    x[19 + 7, 3] = float("nan")
    x[65 + 10, 0] = float("inf")
    x[195 + 2, 5] = float("-inf")
    return x


def check(make, x: torch.Tensor, splits, usage=(True, True), what: str = ""):
    """quantize_grouped == per-expert quantize for quantizers from ``make()``."""
    def build():
        qs = [make() for _ in splits]
        for i, q in enumerate(qs):
            q.role = QuantizerRole("grouped_linear", "input", f"experts.{i}")
            q.set_usage(rowwise=usage[0], columnwise=usage[1])
        return qs
    got = quantize_grouped(build(), x, splits)
    want = [q.quantize(xe) for q, xe in zip(build(), torch.split(x, list(splits)))]
    for e, (g, w) in enumerate(zip(got, want)):
        assert_bitwise_storage(g.qstorage, w.qstorage, f"{what} expert {e}")
    return got


@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)], ids=str)
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("config", FP8)
def test_fp8_current_grouped_bitwise(config, specials, usage):
    x = data()
    x = with_specials(x) if specials else x
    got = check(lambda: Float8CurrentScalingQuantizer(**FP8[config]), x, SPLITS, usage, config)
    if specials:  # NaN / inf: that expert's scale is 1, the others keep their own
        sinv = [t.qstorage.payload(ROWWISE if usage[0] else COLUMNWISE)["scale_inv"] for t in got]
        assert sinv[2] == 1 and sinv[4] == 1 and sinv[1] != 1


def test_fp8_current_shares_one_encoding():
    """Rowwise copies are adjacent row slices of one buffer; columnwise copies are each expert's
    own [K, m_e] transpose, 16-byte aligned column slices of one [K, Σ padded m] matrix (no
    per-expert copy), each continuing with zero codes to m_e rounded up to 16 (``columnwise_zero_tail``); both copies of an
    expert share one scale_inv tensor, as the quantizer's own storage does. The experts come
    as a ``GroupedTensor`` (every expert keeps both copies): the joined copies, each expert's
    scale_inv in ``scales``."""
    x = data()
    qs = [Float8CurrentScalingQuantizer() for _ in SPLITS]
    experts = quantize_grouped(qs, x, SPLITS)
    assert isinstance(experts, GroupedTensor) and not experts.materialized
    width = sum(-(-m // 16) * 16 for m in SPLITS)
    cols = experts.joined(COLUMNWISE)
    assert cols.storage.payload(COLUMNWISE)["data"].shape == (x.shape[1], width)
    assert cols.starts == [sum(-(-m // 16) * 16 for m in SPLITS[:e]) for e in range(len(SPLITS))]
    assert experts.joined(ROWWISE).scales is cols.scales and cols.scales.shape == (len(SPLITS),)
    got = [t.qstorage for t in experts]
    row0, col0 = got[0].payload(ROWWISE)["data"], got[0].payload(COLUMNWISE)["data"]
    for s in got:
        row, col = s.payload(ROWWISE), s.payload(COLUMNWISE)
        assert row["data"].untyped_storage().data_ptr() == row0.untyped_storage().data_ptr()
        assert col["data"].untyped_storage().data_ptr() == col0.untyped_storage().data_ptr()
        m = s.shape[0]
        assert col["data"].stride() == (width, 1) and s.columnwise_zero_tail
        assert col["data"].data_ptr() % 16 == 0 and row["scale_inv"] is col["scale_inv"]
        assert col["data"].data_ptr() % 16 == 0  # cuBLAS reads 16-byte aligned operands


def test_fp8_current_aligned_and_single_groups():
    """Stacked-weight-like groups (whole 128-row blocks), one expert, and all-empty experts."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(384, 40, generator=g).bfloat16()
    check(Float8CurrentScalingQuantizer, x, [128, 128, 128], what="aligned")
    check(Float8CurrentScalingQuantizer, x, [384], what="one expert")
    check(Float8CurrentScalingQuantizer, x[:0], [0, 0, 0], what="all empty")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_current_input_dtypes(dtype):
    check(lambda: Float8CurrentScalingQuantizer(fp8_dtype=E5M2), data(dtype), SPLITS, what=str(dtype))


@pytest.mark.parametrize("specials", [False, True])
def test_nvfp4_rowwise_grouped_bitwise(specials):
    """1D NVFP4 with a global amax: each expert's amax on its rows gives its own bits."""
    x = with_specials(data()) if specials else data()
    check(NVFP4Quantizer, x, SPLITS, (True, False), "nvfp4 rowwise")


@pytest.mark.parametrize("specials", [False, True])
def test_nvfp4_mxfp8_hybrid_derived_columnwise(specials):
    """Composer-2's weight: Hybrid(row=NVFP4 1D, col=MXFP8, rowwise_dequantized); the MXFP8
    columnwise source is the grouped NVFP4 rows dequantized (each expert's own values)."""
    x = with_specials(data()) if specials else data()
    role = QuantizerRole("grouped_linear", "weight", "experts")
    check(lambda: factories.nvfp4_row_scaled_fwd_mxfp8_bwd(role), x, SPLITS, what="composer-2 weight")


def test_fp8_current_hybrid_rows():
    """Hybrid(row=FP8 current, col=MXFP8) from either source: grouped FP8 rows."""
    for source in ("original", "rowwise_dequantized"):
        check(lambda: HybridQuantizer(rowwise_quantizer=Float8CurrentScalingQuantizer(),
                                      columnwise_quantizer=MXFP8Quantizer(), columnwise_source=source),
              data(), SPLITS, what=source)


def test_plans():
    """Which copies are grouped: FP8 current both, NVFP4 1D rowwise only; not delayed scaling,
    stochastic rounding, 2D NVFP4, or a plain NVFP4 whose columnwise copy shares its amax."""
    assert group_scaled_mode(Float8CurrentScalingQuantizer()) == BOTH
    assert group_scaled_mode(NVFP4Quantizer(with_rht=True)) == ROWS
    assert group_scaled_mode(Float8Quantizer()) is None
    assert group_scaled_mode(NVFP4Quantizer(stochastic_rounding=True)) is None
    assert group_scaled_mode(NVFP4Quantizer(with_2d_quantization=True)) is None
    plain = [NVFP4Quantizer() for _ in range(3)]
    assert qplan.plan_for(plain, [4, 4, 4]) is None  # rowwise + columnwise: per expert
    for q in plain:
        q.set_usage(rowwise=True, columnwise=False)
    assert qplan.plan_for(plain, [4, 4, 4]).scaled == ROWS


def test_delayed_scaling_records_each_experts_amax():
    """Delayed scaling stays per expert: expert e's history holds expert e's amax."""
    x = data()
    qs = [Float8Quantizer() for _ in SPLITS]
    quantize_grouped(qs, x, SPLITS)
    for q, xe in zip(qs, torch.split(x, SPLITS)):
        want = xe.float().abs().amax() if xe.numel() else torch.zeros(())
        assert torch.equal(q.amax_history[0], want)


def test_shared_columnwise_block_copies_are_views_of_one_padded_buffer():
    """MXFP8 columnwise copies shared by all experts (groups zero-padded to whole blocks): each
    expert's payload tensors are column-slice views of one buffer (no copy), starting at its
    padded group start; the result's joined columnwise copy is
    the whole buffer with those starts, and the padding decodes to zeros. FP8 block copies (read
    per expert by cuBLAS) are each expert's own contiguous, 16-byte aligned copy, not joined."""
    from hybridfp.formats.common import ceil_div
    from hybridfp.moe.joined import joined_column_storage, joined_of

    role = QuantizerRole("grouped_linear", "input", "experts")
    x = data()
    grouped = quantize_grouped([factories.float8_block_scaling(role) for _ in SPLITS], x, SPLITS)
    got = [t.qstorage for t in grouped]
    for s in got:
        for name, t in s.payload(COLUMNWISE).items():
            assert t.is_contiguous() and t.data_ptr() % 16 == 0, name
    assert joined_of(grouped, COLUMNWISE) is None

    block = 32
    grouped = quantize_grouped([factories.mxfp8(role) for _ in SPLITS], x, SPLITS)
    got = [t.qstorage for t in grouped]
    starts = [0]
    for m in SPLITS[:-1]:
        starts.append(starts[-1] + ceil_div(m, block) * block)
    for name in got[0].payload(COLUMNWISE):
        ts = [s.part(COLUMNWISE).payload(COLUMNWISE)[name] for s in got]
        assert len({t.untyped_storage().data_ptr() for t in ts}) == 1, name
        assert [t.storage_offset() - ts[0].storage_offset() for t in ts] == [
            st // (1 if name == "data" else block) for st in starts], name
    joined, js = joined_column_storage(joined_of(grouped, COLUMNWISE), COLUMNWISE)
    assert js == starts and joined.rows == starts[-1] + ceil_div(SPLITS[-1], block) * block
    whole = joined.dequantize(torch.float32, COLUMNWISE)  # [padded rows, K]
    for s, st, m in zip(got, starts, SPLITS):
        assert torch.equal(whole[st:st + m], s.dequantize(torch.float32, COLUMNWISE))
        pad = whole[st + m:st + ceil_div(m, block) * block]
        assert torch.equal(pad, torch.zeros_like(pad))
