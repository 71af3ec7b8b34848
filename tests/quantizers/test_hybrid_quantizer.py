"""HybridQuantizer (numerics §3): parity with the plain format, columnwise_source, usage,
Identity children, delayed children, requantization safety, copy, make_empty, in-place update."""

from __future__ import annotations

import pytest
import torch
from quantizer_cases import (CASES, ROWWISE_ONLY, amax, assert_bitwise, assert_payload,
                             assert_same_quantized, make_input, seed_all)

from hybridfp import (Float8Quantizer, HybridQuantizer, IdentityQuantizer, MissingDirectionError,
                      MXFP8Quantizer, NVFP4Quantizer)
from hybridfp.tensors import COLUMNWISE, ROWWISE, HybridStorage, IdentityStorage, MXFP8Storage

NAMES = sorted(CASES)
USAGES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}


def _twin_hybrid(name: str, source: str = "original") -> HybridQuantizer:
    """Hybrid of a quantizer and its copy (equal settings and state; a generator is shared)."""
    a = CASES[name]()
    return HybridQuantizer(a, a.copy(), source)


# ---------------------------------------------------------------- parity with the plain format
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("usage", list(USAGES))
# A forward-only format cannot be a columnwise child at all (test_quantizer_errors.py).
@pytest.mark.parametrize("name", [n for n in NAMES if n not in ROWWISE_ONLY])
def test_twin_hybrid_equals_plain(name, usage, dtype):
    rowwise, columnwise = USAGES[usage]
    plain, hybrid = CASES[name](), _twin_hybrid(name)
    plain.set_usage(rowwise=rowwise, columnwise=columnwise)
    hybrid.set_usage(rowwise=rowwise, columnwise=columnwise)
    x = make_input((33, 50), dtype, seed=21)
    # Same seed: one seed is drawn per quantize() call and shared by a hybrid's children, and
    # each copy draws from its own (seed, direction) generator, so stochastic rounding matches.
    seed_all(plain, 99)
    want = plain(x)
    seed_all(hybrid, 99)
    got = hybrid(x)
    assert isinstance(got.qstorage, HybridStorage)
    assert_same_quantized(got, want, name)
    assert_bitwise(got.dequantize(), want.dequantize(), "default dequantize")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_twin_hybrid_equals_plain_across_steps(fmt):
    plain = Float8Quantizer(fmt, amax_history_len=3, margin=1)
    hybrid = HybridQuantizer(Float8Quantizer(fmt, amax_history_len=3, margin=1),
                             Float8Quantizer(fmt, amax_history_len=3, margin=1))
    for step in range(5):
        x = make_input((3, 130), torch.bfloat16, seed=step) * 3.0**step
        assert_same_quantized(hybrid(x), plain(x), f"step {step}")
        if step == 2:  # a step with two quantizations: the recorded amax is their max
            assert_same_quantized(hybrid(x * 2), plain(x * 2), f"step {step}, second")
        plain.update_scale()
        hybrid.rowwise_quantizer.update_scale()
        hybrid.columnwise_quantizer.update_scale()
        for child in (hybrid.rowwise_quantizer, hybrid.columnwise_quantizer):
            assert_bitwise(child.scale, plain.scale)
            assert_bitwise(child.amax_history, plain.amax_history)
    assert plain.scale.item() != 1.0


@pytest.mark.parametrize("name", ["nvfp4_sr", "nvfp4_sr_rht"])
def test_sr_children_with_their_own_generators(name):
    """Two children with their own generators: the hybrid draws one seed per call (from the
    rowwise child's generator) and shares it, so both copies equal the plain quantizer's
    seeded alike, and runs reproduce."""
    def build() -> HybridQuantizer:
        kw = {"stochastic_rounding": True, "with_rht": name.endswith("rht")}
        return HybridQuantizer(NVFP4Quantizer(generator=torch.Generator(), **kw),
                               NVFP4Quantizer(generator=torch.Generator(), **kw))
    x = make_input((64, 64), seed=22)
    a, b = build(), build()
    seed_all(a, 4)
    seed_all(b, 4)
    assert_same_quantized(a(x), b(x))
    plain = NVFP4Quantizer(stochastic_rounding=True, with_rht=name.endswith("rht"),
                           generator=torch.Generator())
    seed_all(plain, 4)
    seed_all(a, 4)
    ya, yp = a(x), plain(x)
    assert_payload(ya.qstorage.payload(ROWWISE), yp.qstorage.payload(ROWWISE))
    assert_payload(ya.qstorage.payload(COLUMNWISE), yp.qstorage.payload(COLUMNWISE))


# ---------------------------------------------------------------- columnwise_source
PAIRS = [
    ("mxfp8", "nvfp4"),
    ("mxfp8", "nvfp4_rht"),
    ("mxfp8", "identity"),
    ("nvfp4_row_scaled", "mxfp8"),
    ("nvfp4_row_scaled", "identity"),
    ("nvfp4", "nvfp4"),
    ("nvfp4_2d", "mxfp8_2d"),
    ("fp8cs_e4m3", "fp8blk_1d"),
    ("fp8blk_2d", "identity_bf16"),
    ("identity", "mxfp8"),
    ("fp8_delayed", "fp8_delayed_e5m2"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("row,col", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_rowwise_dequantized_source(row, col, dtype):
    a, b = CASES[row](), CASES[col]()
    a_ref, b_ref = a.copy(), b.copy()  # fresh twins (same delayed state) for the expectation
    h = HybridQuantizer(a, b, "rowwise_dequantized")
    x = make_input((2, 3, 64), dtype, seed=23)
    y = h(x)
    a_ref.set_usage(rowwise=True, columnwise=False)
    b_ref.set_usage(rowwise=False, columnwise=True)
    ra = a_ref(x)
    cb = b_ref(ra.dequantize(torch.float32))  # B quantizes dequantize(A(x)), exact in FP32
    assert_payload(y.qstorage.payload(ROWWISE), ra.qstorage.payload(ROWWISE), "rowwise")
    assert_payload(y.qstorage.payload(COLUMNWISE), cb.qstorage.payload(COLUMNWISE), "columnwise")
    assert_bitwise(y.dequantize(torch.float32, COLUMNWISE), cb.dequantize(torch.float32, COLUMNWISE))
    if col.startswith("identity"):
        # "High-precision backward of the forward value": the columnwise copy IS the
        # rowwise dequantized value (cast to the Identity dtype, when it has one).
        want = ra.dequantize(torch.float32).to(b.dtype or torch.float32).float()
        assert_bitwise(y.dequantize(torch.float32, COLUMNWISE), want)
    if row != col and not row.startswith("identity"):
        # ... and differs from quantizing the original (double quantization is real).
        h0 = HybridQuantizer(CASES[row](), CASES[col](), "original")
        assert not torch.equal(h0(x).dequantize(direction=COLUMNWISE), y.dequantize(direction=COLUMNWISE))

    # Only the columnwise copy requested: a transient rowwise result gives the same copy, and
    # the returned tensor holds only the columnwise one.
    h_col = HybridQuantizer(CASES[row](), CASES[col](), "rowwise_dequantized", rowwise=False)
    yc = h_col(x)
    assert yc.directions() == (COLUMNWISE,) and yc.qstorage.rowwise_storage is None
    assert_payload(yc.qstorage.payload(COLUMNWISE), y.qstorage.payload(COLUMNWISE))
    with pytest.raises(MissingDirectionError, match="rowwise"):
        yc.dequantize(direction=ROWWISE)


def test_original_source_ignores_rowwise_quantizer():
    x = make_input((33, 50), seed=24)
    y = HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer())(x)
    assert_payload(y.qstorage.payload(COLUMNWISE),
                   MXFP8Quantizer(rowwise=False)(x).qstorage.payload(COLUMNWISE))
    assert_payload(y.qstorage.payload(ROWWISE), NVFP4Quantizer(columnwise=False)(x).qstorage.payload(ROWWISE))


@pytest.mark.parametrize("source", ["original", "rowwise_dequantized"])
def test_rowwise_only_request_never_runs_columnwise_child(source):
    a, b = Float8Quantizer(), Float8Quantizer()
    x = make_input((4, 8), seed=25)
    y = HybridQuantizer(a, b, source, columnwise=False)(x)
    assert y.directions() == (ROWWISE,) and y.qstorage.columnwise_storage is None
    # The idle delayed child still observes the original's amax (as the plain quantizer
    # records it), so its scale tracks the plain quantizer's; from a derived source there is
    # nothing to observe without computing it.
    want = amax(x).item() if source == "original" else 0.0
    assert b.amax_history[0].item() == want


def test_delayed_twin_equals_plain_across_single_direction_steps():
    """Rowwise-only steps (no_grad evaluation, frozen weights) must move a twin hybrid's
    columnwise child exactly like the plain quantizer, so later steps stay bitwise equal."""
    plain = Float8Quantizer()
    hybrid = HybridQuantizer(Float8Quantizer(), Float8Quantizer())
    for step, (scale, usage) in enumerate([(100.0, (True, False)), (1.0, (True, True)),
                                           (3.0, (False, True)), (7.0, (True, True))]):
        x = make_input((16, 64), seed=40 + step) * scale
        for q in (plain, hybrid):
            q.set_usage(rowwise=usage[0], columnwise=usage[1])
        assert_same_quantized(hybrid(x), plain(x))
        plain.update_scale()
        hybrid.finish_step()


# ---------------------------------------------------------------- Identity children
def test_identity_rowwise_child():
    x = make_input((33, 50), torch.bfloat16, seed=26)
    y = HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer())(x)
    assert isinstance(y.qstorage.rowwise_storage, IdentityStorage)
    assert isinstance(y.qstorage.columnwise_storage, MXFP8Storage)
    assert_bitwise(y.dequantize(direction=ROWWISE), x)
    assert_payload(y.qstorage.payload(COLUMNWISE), MXFP8Quantizer(rowwise=False)(x).qstorage.payload(COLUMNWISE))
    assert_bitwise(y.dequantize(), x)  # the default picks the more precise copy: Identity


def test_identity_columnwise_child():
    x = make_input((33, 50), torch.float32, seed=27)
    y = HybridQuantizer(MXFP8Quantizer(), IdentityQuantizer(torch.bfloat16))(x)
    assert_payload(y.qstorage.payload(ROWWISE), MXFP8Quantizer(columnwise=False)(x).qstorage.payload(ROWWISE))
    assert_bitwise(y.qstorage.payload(COLUMNWISE)["data"], x.to(torch.bfloat16))
    assert_bitwise(y.dequantize(direction=COLUMNWISE), x.to(torch.bfloat16).float())


# ---------------------------------------------------------------- delayed children
@pytest.mark.parametrize("source", ["original", "rowwise_dequantized"])
def test_delayed_children_record_amax(source):
    a, b = Float8Quantizer(), Float8Quantizer()
    x = make_input((3, 130), seed=28) * 300  # saturates at scale 1: the two amaxes differ
    y = HybridQuantizer(a, b, source)(x)
    assert a.amax_history[0].item() == amax(x).item()
    seen_by_b = x if source == "original" else y.dequantize(direction=ROWWISE)
    assert b.amax_history[0].item() == amax(seen_by_b).item()
    if source == "rowwise_dequantized":
        assert b.amax_history[0].item() == 448.0  # the saturated forward value


# ---------------------------------------------------------------- requantization safety
SAFETY = [
    ("mxfp8", "nvfp4_rht", "original", True),
    ("identity", "identity", "original", True),
    ("nvfp4_2d", "fp8blk_1d", "original", True),
    ("fp8_delayed", "mxfp8", "original", False),
    ("mxfp8", "fp8_delayed", "original", False),
    ("mxfp8", "nvfp4_sr_rht", "original", False),
    ("nvfp4_sr", "mxfp8", "original", False),
    # rowwise_dequantized: safe children re-make the same copies (test_te_semantics.py)
    ("mxfp8", "identity", "rowwise_dequantized", True),
    ("nvfp4_row_scaled", "mxfp8", "rowwise_dequantized", True),
    ("mxfp8", "mxfp8", "rowwise_dequantized", True),
    ("nvfp4_sr", "identity", "rowwise_dequantized", False),
]


@pytest.mark.parametrize("row,col,source,safe", SAFETY)
def test_is_requantization_safe(row, col, source, safe):
    assert HybridQuantizer(CASES[row](), CASES[col](), source).is_requantization_safe() is safe


# ---------------------------------------------------------------- copy, role
@pytest.mark.parametrize("source", ["original", "rowwise_dequantized"])
def test_copy_is_independent_with_equal_settings(source):
    h = HybridQuantizer(Float8Quantizer(margin=1), NVFP4Quantizer(with_rht=True), source, columnwise=False)
    h.role = "linear.fc2:weight"
    x = make_input((33, 50), seed=29)
    h(x)
    c = h.copy()
    assert c is not h and c.columnwise_source == source and c.role == h.role
    assert c.rowwise_quantizer is not h.rowwise_quantizer
    assert c.columnwise_quantizer is not h.columnwise_quantizer
    assert c.settings().keys() == h.settings().keys()
    for part in ("rowwise_quantizer", "columnwise_quantizer"):
        assert getattr(c, part).settings() == getattr(h, part).settings()
        assert getattr(c, part).role == h.role
    assert (c.rowwise_usage, c.columnwise_usage) == (True, False)
    assert torch.equal(c.rowwise_quantizer.amax_history, h.rowwise_quantizer.amax_history)
    c.set_usage(columnwise=True)
    h.set_usage(columnwise=True)
    assert_same_quantized(c(x), h(x))
    c.set_usage(rowwise=False)
    assert h.rowwise_usage
    c.rowwise_quantizer.update_scale()
    assert h.rowwise_quantizer.scale.item() == 1.0 and c.rowwise_quantizer.scale.item() != 1.0


def test_role_labels_children_and_errors():
    h = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), columnwise=False)
    h.role = "linear.qkv:input"
    assert h.rowwise_quantizer.role == h.columnwise_quantizer.role == "linear.qkv:input"
    y = h(make_input((4, 32)))
    with pytest.raises(MissingDirectionError, match=r"columnwise.*linear\.qkv:input|linear\.qkv:input.*columnwise"):
        y.dequantize(direction=COLUMNWISE)


# ---------------------------------------------------------------- make_empty, update_quantized
HYBRIDS = {
    "mxfp8+nvfp4_rht": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True)),
    "row_scaled+mxfp8/rd": lambda: HybridQuantizer(CASES["nvfp4_row_scaled"](), MXFP8Quantizer(),
                                                   "rowwise_dequantized"),
    "mxfp8+identity_bf16/rd": lambda: HybridQuantizer(MXFP8Quantizer(), IdentityQuantizer(torch.bfloat16),
                                                      "rowwise_dequantized"),
    "identity+fp8blk_1d": lambda: HybridQuantizer(IdentityQuantizer(), CASES["fp8blk_1d"]()),
    "delayed+delayed": lambda: HybridQuantizer(CASES["fp8_delayed"](), CASES["fp8_delayed_e5m2"]()),
    "nvfp4_sr+nvfp4_sr_rht": lambda: HybridQuantizer(CASES["nvfp4_sr"](), CASES["nvfp4_sr_rht"]()),
}


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("shape", [(2, 3, 64), (33, 50)], ids=str)
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_make_empty_matches_quantize_layout(name, shape, usage):
    h = HYBRIDS[name]()
    h.set_usage(rowwise=USAGES[usage][0], columnwise=USAGES[usage][1])
    e = h.make_empty(shape, dtype=torch.bfloat16)
    y = h(make_input(shape, torch.bfloat16))
    assert e.shape == y.shape and e.dtype == y.dtype and e.directions() == y.directions()
    for d in y.directions():
        assert type(e.qstorage.parts[d]) is type(y.qstorage.parts[d])
        assert {k: (tuple(v.shape), v.dtype) for k, v in e.qstorage.payload(d).items()} == \
               {k: (tuple(v.shape), v.dtype) for k, v in y.qstorage.payload(d).items()}


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_update_quantized_in_place(name, usage):
    h = HYBRIDS[name]()
    h.set_usage(rowwise=USAGES[usage][0], columnwise=USAGES[usage][1])
    x0, x1 = make_input((33, 50), seed=30), make_input((33, 50), seed=31)
    dst = h(x0)
    ptrs = [t.data_ptr() for t in dst.qstorage.tensors()]
    fresh = h.copy()
    seed_all(h, 5)
    assert h.update_quantized(x1, dst) is dst
    assert [t.data_ptr() for t in dst.qstorage.tensors()] == ptrs
    seed_all(fresh, 5)
    assert_same_quantized(dst, fresh(x1))


# ---------------------------------------------------------------- straight-through gradient
@pytest.mark.filterwarnings("ignore:hybridfp. aten")
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_straight_through_gradient(name):
    x = make_input((2, 3, 64), torch.bfloat16, seed=32).requires_grad_()
    y = HYBRIDS[name]()(x)
    assert y.requires_grad
    w = make_input((2, 3, 64), torch.bfloat16, seed=33)
    (y * w).sum().backward()
    assert_bitwise(x.grad, w, "gradient")
