"""``quantize_grouped``: every expert's storage equals ``quantizers[e].quantize(x_e)`` bit for
bit — every payload tensor of every copy — for every factory role, every usage combination
(per expert too), zero-size experts and row counts that are not multiples of 16, 32 or 128;
and formats with row-local rowwise scaling share one encoding (experts' payloads are adjacent
row-slice views), which the result names as its joined copy (``GroupedTensor.joined``) and
``grouped_gemm`` then reads without a copy."""

from __future__ import annotations

import pytest
import torch

from hybridfp import factories
from hybridfp.moe.joined import joined_column_storage, joined_of, joined_row_storage
from hybridfp.moe.plan import row_local_mode
from hybridfp.moe.quantize import quantize_grouped
from hybridfp.recipes import QuantizerRole
from hybridfp.tensors.storage import COLUMNWISE, DIRECTIONS, ROWWISE

K = 72  # not a multiple of 32 (MXFP8) or 128 (FP8 block): partial blocks along the row
SPLITS = [0, 19, 45, 1, 130, 0, 33]
FACTORIES = {**factories.BASE, **factories.ZOO}
ROLES = ["input", "weight", "grad_output"]
#: (rowwise, columnwise) per expert; None = the expert needs no copy.
USAGES = {
    "both": [(True, True)] * len(SPLITS),
    "rowwise": [(True, False)] * len(SPLITS),
    "columnwise": [(False, True)] * len(SPLITS),
    "mixed": [(True, True), (True, False), None, (True, True), (True, False), (True, True), None],
}


def build(factory, tensor_type: str, usage) -> list:
    """One quantizer per expert from ``factory`` (as GroupedLinear builds them), usage set;
    None where the usage row says so. Quantizers whose columnwise copy cannot exist
    (row-scaled NVFP4) keep rowwise only."""
    role = QuantizerRole("grouped_linear", tensor_type, "experts")
    out = []
    for u in usage:
        q = factory(role)
        q.role = role
        if u is None:
            out.append(None)
            continue
        try:
            q.check_columnwise()
            q.set_usage(rowwise=u[0], columnwise=u[1])
        except ValueError:
            q.set_usage(rowwise=True, columnwise=False)
        out.append(q)
    return out


def data(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows at magnitudes 2**-6 .. 2**6, so per-expert and per-block scales differ."""
    g = torch.Generator().manual_seed(5)
    rows = sum(SPLITS)
    mag = torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    return (torch.randn(rows, K, generator=g) * mag).to(dtype)


def parts(storage):
    """(direction, single-format part) for every copy held."""
    return [(d, storage.part(d)) for d in DIRECTIONS if storage.has(d)]


def assert_same_storage(got, want, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert got.directions() == want.directions(), what
    for (d, g), (_, w) in zip(parts(got), parts(want)):
        assert type(g) is type(w) and g.meta == w.meta and g.label == w.label, f"{what} {d}"
        pg, pw = g.payload(d), w.payload(d)
        assert sorted(pg) == sorted(pw), f"{what} {d}"
        for n in pw:
            assert pg[n].dtype == pw[n].dtype and pg[n].shape == pw[n].shape, f"{what} {d} {n}"
            assert torch.equal(pg[n].view(torch.uint8) if pg[n].dtype.itemsize == 1 else pg[n],
                               pw[n].view(torch.uint8) if pw[n].dtype.itemsize == 1 else pw[n]), \
                f"{what} {d} {n}"


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("tensor_type", ROLES)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_grouped_equals_per_expert_quantize(name, tensor_type, usage):
    factory = FACTORIES[name]
    x = data()
    torch.manual_seed(7)  # stochastic rounding draws its seeds from torch's generator
    got = quantize_grouped(build(factory, tensor_type, USAGES[usage]), x, SPLITS)
    torch.manual_seed(7)
    want = [None if q is None else q.quantize(xe)
            for q, xe in zip(build(factory, tensor_type, USAGES[usage]), torch.split(x, SPLITS))]
    for e, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), e
        if w is not None:
            assert_same_storage(g.qstorage, w.qstorage, f"{name} {tensor_type} expert {e}")


def test_derived_hybrid_is_one_encode_of_the_padded_groups():
    """A hybrid whose columnwise copy derives from a row-local rowwise copy (Composer-2's
    row-scaled NVFP4 -> MXFP8 input) is one encode of the groups zero-padded to 32 rows: every
    expert's rowwise payload is a row slice of one buffer at its padded start, its columnwise
    payload a column slice of another, the result's joined columnwise copy. Bitwise equality
    with each expert's own quantize: test_grouped_equals_per_expert_quantize."""
    qs = build(FACTORIES["nvfp4_row_scaled_fwd_mxfp8_bwd"], "input", USAGES["both"])
    got = quantize_grouped(qs, data(), SPLITS)
    storages = [t.qstorage for t in got]
    starts = [0]
    for m in SPLITS[:-1]:
        starts.append(starts[-1] + -(-m // 32) * 32)
    for n in storages[0].part(ROWWISE).payload(ROWWISE):
        ts = [s.part(ROWWISE).payload(ROWWISE)[n] for s in storages]
        assert len({t.untyped_storage().data_ptr() for t in ts}) == 1, n
        row = ts[0].stride(0)
        assert [(t.storage_offset() - ts[0].storage_offset()) // row for t in ts] == starts, n
    found = joined_column_storage(joined_of(got, COLUMNWISE), COLUMNWISE)
    assert found is not None and found[1] == starts
    cols = storages[1].part(COLUMNWISE).payload(COLUMNWISE)["data"]
    assert cols.untyped_storage().data_ptr() == found[0].payload(COLUMNWISE)["data"].untyped_storage().data_ptr()


@pytest.mark.parametrize("name", ["high_precision", "mxfp8", "float8_block_scaling"])
def test_row_local_rowwise_copies_are_one_encoding(name):
    """The experts' rowwise copies are row-slice views of one buffer, the result's joined
    rowwise copy, which equals the whole tensor's rowwise encoding."""
    qs = build(FACTORIES[name], "input", USAGES["both"])
    x = data()
    got = quantize_grouped(qs, x, SPLITS)
    storages = [t.qstorage for t in got]
    joined = joined_row_storage(joined_of(got, ROWWISE), ROWWISE, SPLITS)
    assert joined is not None
    q = qs[0].rowwise_quantizer if hasattr(qs[0], "rowwise_quantizer") else qs[0]
    assert row_local_mode(q) is not None
    whole = q.encode(x, True, False, None)
    for n, t in whole.payload(ROWWISE).items():
        j = joined.payload(ROWWISE)[n]
        assert j.data_ptr() == storages[1].part(ROWWISE).payload(ROWWISE)[n].data_ptr()  # a view
        assert torch.equal(j.view(torch.uint8) if j.dtype.itemsize == 1 else j,
                           t.view(torch.uint8) if t.dtype.itemsize == 1 else t), n


@pytest.mark.parametrize("name", ["current_scaling", "nvfp4", "delayed_scaling"])
def test_per_tensor_scaled_formats_quantize_per_expert(name):
    """Per-tensor scales (FP8 per-tensor, NVFP4 global amax) are each expert's own, so the
    experts' rowwise copies are never one operand of plain back-to-back rows, even where one
    grouped encoding made them (test_quantizers_grouped_scaled.py): FP8 current's joined copy
    carries each expert's scale apart (``scales``), NVFP4's is row-scaled (each row with its
    expert's amax) where it has one (none with the RHT option); delayed scaling quantizes each
    expert on its own (a list)."""
    qs = build(FACTORIES[name], "input", USAGES["both"])
    got = quantize_grouped(qs, data(), SPLITS)
    j = joined_of(got, ROWWISE)
    if name == "delayed_scaling":
        assert isinstance(got, list) and j is None
    elif name == "current_scaling":
        assert j.scales is not None and joined_row_storage(j, ROWWISE, SPLITS) is None
    else:
        assert j is None or (j.scales is None and j.storage.meta["row_scaled"])


def test_errors_name_the_problem():
    qs = build(factories.mxfp8, "input", USAGES["both"])
    with pytest.raises(ValueError, match="one \\(or None\\) per expert"):
        quantize_grouped(qs[:2], data(), SPLITS)
    with pytest.raises(ValueError, match="row groups stacked"):
        quantize_grouped(qs, data()[:5], SPLITS)
    with pytest.raises(TypeError, match="dtype"):
        quantize_grouped(qs, data().to(torch.int32), SPLITS)
    qs[2].set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="enable at least one"):
        quantize_grouped(qs, data(), SPLITS)
