"""MXFP8 columnwise copies read through a row map (``triton_mxfp8.quantize(row_map=...)``) and
the grouped path that uses them (``moe.quantize.encode_padded_columns``).

The row-mapped kernel must give, bit for bit, the columnwise copy of the zero-padded row groups
that ``pad_row_groups`` would have written; ``quantize_grouped`` then gives every expert its own
quantize's copies without the padded copy ever being made. CPU: interpreter, awkward splits
(empty groups, one-row groups, whole blocks, a last group of padding only), every input dtype,
both element types and rules, strided input. GPU (``-m gpu``): MoE-sized groups, poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, assert_storage_bitwise, edge_tensor, gpu, gpu_input,  # noqa: E402
                                   interpreter_only)

from hybridfp.formats import mxfp8  # noqa: E402
from hybridfp.kernels import triton_mxfp8  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import MXFP8Quantizer, fast  # noqa: E402
from hybridfp.moe import quantize as qgrouped
from hybridfp.moe.quantize import _offsets, _padded_total, _row_map, quantize_grouped  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [[5, 0, 33, 32, 1], [0, 0, 7], [32, 64], [40]]


def row_map_for(x: torch.Tensor, splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int32 row map of the 32-padded groups, the padded tensor itself, built on the CPU)."""
    starts = _offsets(splits, 32)
    total = _padded_total(splits, 32, starts)
    rm = _row_map(splits, starts, total, x)
    padded = torch.zeros(total, x.shape[1], dtype=x.dtype, device=x.device)
    padded[rm >= 0] = x[rm[rm >= 0].long()]
    return rm, padded


def check_row_map(x: torch.Tensor, splits: list[int], dtype=E4M3, rule: str = "rceil") -> None:
    """Columnwise copy through the map (alone and with the rowwise copy of x in the same pass)
    against the reference of the padded tensor; the rowwise copy against x's own reference."""
    rm, padded = row_map_for(x, splits)
    want_d, want_s = mxfp8.quantize_1d(padded.t(), dtype, rule=rule)
    want_rd, want_rs = mxfp8.quantize_1d(x, dtype, rule=rule)
    for rowwise in (False, True):
        with poisoned_outputs(0x7F):
            row, (cd, cs) = triton_mxfp8.quantize(x, dtype, rule=rule, rowwise=rowwise, row_map=rm)
        assert torch.equal(cd.view(torch.uint8), want_d.contiguous().view(torch.uint8)), "columnwise data"
        assert torch.equal(cs, want_s.contiguous()), "columnwise E8M0 scales"
        if rowwise:
            assert torch.equal(row[0].view(torch.uint8), want_rd.view(torch.uint8)), "rowwise data"
            assert torch.equal(row[1], want_rs), "rowwise E8M0 scales"
        else:
            assert row is None


@interpreter_only
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_map_equals_padded_copy(splits, dtype):
    x = edge_tensor((sum(splits), 80), dtype, seed=sum(splits), specials=True)
    check_row_map(x, splits)


@interpreter_only
@pytest.mark.parametrize("fp8,rule", [(E5M2, "floor"), (E4M3, "floor"), (E5M2, "rceil")], ids=str)
def test_row_map_formats_and_strides(fp8, rule):
    """Both element types and rules; a transposed (column-major) source read through the map."""
    splits = [3, 0, 45]
    x = edge_tensor((sum(splits), 64), torch.bfloat16, seed=3, specials=True)
    check_row_map(x, splits, fp8, rule)
    xt = edge_tensor((64, sum(splits)), torch.float32, seed=4).t()
    check_row_map(xt, splits, fp8, rule)


def check_any_map(x: torch.Tensor, rm: torch.Tensor, block=None) -> None:
    """Both copies through an arbitrary map (each source row once, padding anywhere) against
    the reference of the gathered tensor and of x."""
    gathered = torch.zeros(rm.shape[0], x.shape[1], dtype=x.dtype)
    gathered[rm >= 0] = x[rm[rm >= 0].long()]
    want_d, want_s = mxfp8.quantize_1d(gathered.t(), E4M3)
    want_rd, want_rs = mxfp8.quantize_1d(x, E4M3)
    with poisoned_outputs(0x7F):
        (rd, rs), (cd, cs) = triton_mxfp8.quantize(x, E4M3, row_map=rm, block=block)
    assert torch.equal(cd.view(torch.uint8), want_d.contiguous().view(torch.uint8)), "columnwise data"
    assert torch.equal(cs, want_s.contiguous()), "columnwise E8M0 scales"
    assert torch.equal(rd.view(torch.uint8), want_rd.view(torch.uint8)) and torch.equal(rs, want_rs), "rowwise"


@interpreter_only
@pytest.mark.parametrize("block", [(32, 32), (64, 64), (32, 128)], ids=str)
def test_row_map_column_tiles_and_shuffled_maps(block):
    """Tiles past the first column tile (c0 > 0: the mapped base and the rowwise stores add
    it), a shuffled map with padding rows scattered anywhere, a map length that is not a
    multiple of 4 (byte stores), and a column-major FP16 source."""
    g = torch.Generator().manual_seed(0)
    x = edge_tensor((45, 200), torch.bfloat16, seed=1, specials=True)
    rm = torch.full((70,), -1, dtype=torch.int32)
    rm[torch.randperm(70, generator=g)[:45]] = torch.randperm(45, generator=g).to(torch.int32)
    check_any_map(x, rm, block)
    odd = torch.full((37,), -1, dtype=torch.int32)
    odd[torch.randperm(37, generator=g)[:20]] = torch.arange(20, dtype=torch.int32)
    check_any_map(edge_tensor((20, 160), torch.float32, seed=2, specials=True), odd, block)
    xt = edge_tensor((200, 45), torch.float16, seed=3).t()
    cm = torch.full((64,), -1, dtype=torch.int32)
    cm[3:48] = torch.arange(45, dtype=torch.int32)
    check_any_map(xt, cm, block)


@interpreter_only
def test_row_map_padding_only_and_errors():
    """A map of padding rows only (no source rows): all-zero blocks, scale byte 0; bad calls
    name what to pass."""
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    rm = torch.full((32,), -1, dtype=torch.int32)
    with poisoned_outputs(0x7F):
        _, (cd, cs) = triton_mxfp8.quantize(x, E4M3, rowwise=False, row_map=rm)
    want_d, want_s = mxfp8.quantize_1d(torch.zeros(64, 32, dtype=torch.bfloat16), E4M3)
    assert torch.equal(cd.view(torch.uint8), want_d.view(torch.uint8)) and torch.equal(cs, want_s)
    y = torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_2d=False"):
        triton_mxfp8.quantize(y, E4M3, block_2d=True, row_map=torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        triton_mxfp8.quantize(y, E4M3, rowwise=False, row_map=torch.zeros(32, dtype=torch.int64))


@interpreter_only
@pytest.mark.parametrize("splits", SPLITS, ids=str)
def test_grouped_columnwise_reads_through_row_map(splits, monkeypatch):
    """``quantize_grouped`` of MXFP8 experts (the kernel path forced on the CPU): every expert's
    copies equal its own encode, the row-mapped kernel ran once (both copies), and no padded
    copy was written."""
    from hybridfp.quantizers import backends
    monkeypatch.setattr(fast, "device_ok", lambda x, rows=None: True)
    mapped, padded = [], []
    supports, run = backends.ROW_MAPPED_KERNELS[MXFP8Quantizer]
    monkeypatch.setitem(backends.ROW_MAPPED_KERNELS, MXFP8Quantizer,
                        (supports, lambda *a: mapped.append(1) or run(*a)))
    real_pad = qgrouped.pad_row_groups
    monkeypatch.setattr(qgrouped, "pad_row_groups", lambda *a: padded.append(1) or real_pad(*a))
    x = edge_tensor((sum(splits), 64), torch.bfloat16, seed=7, specials=True)
    qs = [MXFP8Quantizer() for _ in splits]
    got = quantize_grouped(qs, x, splits)
    # whole blocks only: one row+col encode, nothing padded or mapped
    assert mapped == ([1] if any(m % 32 for m in splits) else []) and padded == []
    for e, (g, xe) in enumerate(zip(got, torch.split(x, splits))):
        want = MXFP8Quantizer().reference_encode(xe, True, True)
        for d in ("rowwise", "columnwise"):
            assert_storage_bitwise(g.qstorage.part(d), want.part(d), f"expert {e} {d}")


@interpreter_only
def test_row_mapped_kernel_selection():
    """Registered for MXFP8 1D on CUDA inputs only: 2D MXFP8, CPU tensors and the kernels
    switched off find none (the padded copy is then written and encoded)."""
    from hybridfp import policy
    from hybridfp.quantizers.backends import row_mapped_kernel
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    assert row_mapped_kernel(MXFP8Quantizer(), x, 64) is None  # a CPU tensor (not the interpreter's choice)
    fake_cuda = type("T", (), {"is_cuda": True, "dtype": torch.bfloat16, "shape": (40, 64),
                                "dim": lambda self: 2, "numel": lambda self: 2560,
                                "stride": lambda self: (64, 1)})()
    assert row_mapped_kernel(MXFP8Quantizer(), fake_cuda, 64) is fast._mxfp8_row_mapped_run
    assert row_mapped_kernel(MXFP8Quantizer(with_2d_quantization=True), fake_cuda, 64) is None
    with policy(quantize_kernels=False):
        assert row_mapped_kernel(MXFP8Quantizer(), fake_cuda, 64) is None


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_row_map_gpu_moe_groups(dtype):
    """8 experts' routed rows (awkward counts, an empty expert) at hidden 4096: the row-mapped
    pass's columnwise copy equals the one of the padded copy (pad_rows kernel, then the plain
    kernel), its rowwise copy the plain kernel's rowwise copy of x."""
    from hybridfp.kernels.moe import triton_pad_rows
    splits = [4099, 0, 1, 2077, 3000, 31, 4096, 3080]
    x = gpu_input((sum(splits), 4096), dtype, specials=True)
    starts = _offsets(splits, 32)
    total = _padded_total(splits, 32, starts)
    rm = _row_map(splits, starts, total, x)
    padded = triton_pad_rows.pad_rows(x, rm)
    with poisoned_outputs(0x7F):
        (rd, rs), (cd, cs) = triton_mxfp8.quantize(x, E4M3, row_map=rm)
        _, (wd, ws) = triton_mxfp8.quantize(padded, E4M3, rowwise=False)
        (wrd, wrs), _ = triton_mxfp8.quantize(x, E4M3, columnwise=False)
    assert torch.equal(cd.view(torch.uint8), wd.view(torch.uint8)) and torch.equal(cs, ws)
    assert torch.equal(rd.view(torch.uint8), wrd.view(torch.uint8)) and torch.equal(rs, wrs)
    want_d, want_s = mxfp8.quantize_1d(padded[:4096].t(), E4M3)  # the reference on a slice
    assert torch.equal(cd[:, :4096].contiguous().view(torch.uint8), want_d.contiguous().view(torch.uint8))
