"""MXFP8 1D ``method="natural"`` (``triton_mxfp8.col_copy_natural``) against the default
``method="slices"`` and the ``formats.mxfp8`` reference, bit for bit.

The two methods compute the columnwise copy from differently laid-out reads of the same tile
(natural [row_slice, BC] slices with a running block amax and 4-row int32 words, against
transposed [BC, 32] slices), so every test compares both copies, data and E8M0 scales, with
the outputs poisoned before each launch. CPU: interpreter, awkward shapes (rows / columns not
multiples of 32 or 4, one row, empty), both element types and rules, BF16 / FP16 / FP32,
strided input, row maps (shuffled, padding rows, padding only), every ``row_slice``, each
direction. GPU (``-m gpu``): real sizes and the MoE row-map case.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import edge_tensor, gpu, gpu_input, interpreter_only  # noqa: E402

from hybridfp.formats import mxfp8  # noqa: E402
from hybridfp.kernels import triton_mxfp8  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _same(got: Optional[tuple], want: Optional[tuple], what: str) -> None:
    """Two copies (data, scales) or both None, bitwise."""
    assert (got is None) == (want is None), f"{what}: one copy missing"
    if want is None:
        return
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape, f"{what}: shapes differ"
    d = got[0].contiguous().view(torch.uint8) != want[0].contiguous().view(torch.uint8)
    assert not bool(d.any()), f"{what} data: {int(d.sum())} of {d.numel()} bytes differ"
    s = got[1].contiguous() != want[1].contiguous()
    assert not bool(s.any()), f"{what} scales: {int(s.sum())} of {s.numel()} E8M0 bytes differ"


def check_natural(x: torch.Tensor, dtype: torch.dtype = E4M3, rule: str = "rceil", *, rowwise: bool = True,
                  row_map: Optional[torch.Tensor] = None, reference: bool = True, **kw) -> None:
    """"natural" equals "slices" (both copies, poisoned outputs) and, with ``reference``, the
    ``formats.mxfp8`` copies of x and of the row-mapped (gathered) tensor's transpose."""
    args = dict(rule=rule, rowwise=rowwise, row_map=row_map)
    with poisoned_outputs(0x7F):
        want = triton_mxfp8.quantize(x, dtype, **args, block=kw.get("block"), num_warps=kw.get("num_warps"),
                                     method="slices")
    with poisoned_outputs(0x7F):
        got = triton_mxfp8.quantize(x, dtype, **args, method="natural", **kw)
    for i, d in enumerate(("rowwise", "columnwise")):
        _same(got[i], want[i], f"{d} natural {kw} vs slices")
    if not reference:
        return
    src = x
    if row_map is not None:
        src = torch.zeros(row_map.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        src[row_map >= 0] = x[row_map[row_map >= 0].long()]
    _same(got[1], mxfp8.quantize_1d(src.t(), dtype, rule=rule), f"columnwise natural {kw} vs reference")
    if rowwise:
        _same(got[0], mxfp8.quantize_1d(x, dtype, rule=rule), f"rowwise natural {kw} vs reference")


#: (shape, input dtype, element dtype, rule, kwargs): partial 32-row blocks and 32-column tiles,
#: rows % 4 != 0 (byte stores), FP32 (byte stores by design), several programs each way.
CASES = [
    ((33, 50), torch.bfloat16, E4M3, "rceil", {}),
    ((1, 40), torch.bfloat16, E5M2, "floor", {}),
    ((68, 40), torch.float16, E5M2, "rceil", dict(block=(64, 64), num_warps=2)),
    ((45, 64), torch.float32, E4M3, "floor", dict(block=(64, 64), num_warps=2)),
    ((40, 40), torch.bfloat16, E4M3, "floor", dict(block=(32, 32), num_warps=1, row_slice=16)),
]


@interpreter_only
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}".replace(" ", ""))
def test_natural_bitwise(case):
    shape, xdtype, dtype, rule, kw = case
    check_natural(edge_tensor(shape, xdtype, seed=shape[0], specials=True), dtype, rule, **kw)


@interpreter_only
@pytest.mark.parametrize("row_slice", [4, 8, 16, 32])
def test_natural_row_slices(row_slice):
    """Every slice height: one read of the block (32) or a running amax over slices, then the
    block read again (4 .. 16); a partial last block, packed words (R % 4 == 0)."""
    x = edge_tensor((44, 64), torch.bfloat16, seed=row_slice, specials=True)
    check_natural(x, block=(64, 64), num_warps=2, row_slice=row_slice)


@interpreter_only
def test_natural_columnwise_only_and_strided():
    """The columnwise copy alone (no rowwise stores to anchor layouts), from a transposed
    (column-major) FP32 view and a row-strided BF16 view; all-zero blocks (scale byte 0)."""
    xt = edge_tensor((40, 36), torch.float32, seed=1, specials=True).t()  # [36, 40], strides (1, 36)
    check_natural(xt, rowwise=False, block=(64, 64), num_warps=2)
    xs = edge_tensor((40, 80), torch.bfloat16, seed=2, specials=True)[:, 8:72]
    xs[:32, :32] = 0.0
    check_natural(xs, rowwise=False, block=(64, 64), num_warps=2, row_slice=8)


@interpreter_only
def test_grid_fallback(monkeypatch):
    """Past the 2D grid's row-tile limit (patched down to 1 here) both methods launch on the 1D
    grid (``_common.tile_grid``): "natural" still equals "slices" and the reference."""
    from hybridfp.kernels import _common
    monkeypatch.setattr(_common, "GRID_Y_MAX", 1)
    assert not _common.tile_grid(96, 72, 32, 64)[1]
    check_natural(edge_tensor((96, 72), torch.bfloat16, seed=13, specials=True), block=(32, 64), num_warps=2)


@interpreter_only
def test_natural_packed_equals_bytes():
    """``pack=False`` (byte stores) and the packed words give the same bytes (BF16, R % 4 == 0)."""
    x = edge_tensor((64, 64), torch.bfloat16, seed=9, specials=True)
    kw = dict(rowwise=False, method="natural", block=(64, 64), num_warps=2)
    with poisoned_outputs(0x7F):
        a = triton_mxfp8.quantize(x, E4M3, pack=False, **kw)[1]
    with poisoned_outputs(0x7F):
        b = triton_mxfp8.quantize(x, E4M3, pack=True, **kw)[1]
    _same(a, b, "bytes vs words")


@interpreter_only
@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (0, 0)], ids=str)
def test_natural_empty(shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    check_natural(x)


@interpreter_only
def test_natural_row_maps():
    """A shuffled map with padding rows anywhere past the first column tile (length % 4 == 0:
    words), an odd-length map (bytes), an FP16 column-major source, and a map of padding only."""
    g = torch.Generator().manual_seed(0)
    x = edge_tensor((45, 72), torch.bfloat16, seed=1, specials=True)
    rm = torch.full((60,), -1, dtype=torch.int32)
    rm[torch.randperm(60, generator=g)[:45]] = torch.randperm(45, generator=g).to(torch.int32)
    check_natural(x, row_map=rm, block=(32, 64), num_warps=2)
    odd = torch.full((37,), -1, dtype=torch.int32)
    odd[torch.randperm(37, generator=g)[:20]] = torch.arange(20, dtype=torch.int32)
    check_natural(edge_tensor((20, 40), torch.float32, seed=2, specials=True), row_map=odd, rowwise=False,
                  row_slice=8)
    xt = edge_tensor((40, 45), torch.float16, seed=3).t()
    cm = torch.full((52,), -1, dtype=torch.int32)
    cm[3:48] = torch.arange(45, dtype=torch.int32)
    check_natural(xt, row_map=cm, block=(64, 64), num_warps=2, rowwise=False)
    check_natural(torch.empty(0, 64, dtype=torch.bfloat16), row_map=torch.full((32,), -1, dtype=torch.int32),
                  rowwise=False)


@interpreter_only
def test_natural_errors():
    """Bad calls name what to pass."""
    y = torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1D only"):
        triton_mxfp8.quantize(y, E4M3, block_2d=True, method="natural")
    with pytest.raises(ValueError, match="'slices' or"):
        triton_mxfp8.quantize(y, E4M3, method="rows")
    with pytest.raises(ValueError, match="4, 8, 16 or 32"):
        triton_mxfp8.quantize(y, E4M3, method="natural", row_slice=12)
    with pytest.raises(ValueError, match="method='natural'"):
        triton_mxfp8.quantize(y, E4M3, row_slice=16)


#: GPU sizes: the dense input, and 8 experts' routed rows (awkward counts, an empty expert)
#: summing to 40000 at hidden 4096, whose first HEAD padded rows are checked against the reference.
GPU_SHAPE = (16384, 4096)
#: the tiles the GPU test runs "natural" at: each row_slice at the default tile, and wider tiles
#: ((64, 128) / 2 warps, ``COL_ONLY_NATURAL``: the fastest columnwise-only one on an NVIDIA H200)
NATURAL_GPU_CONFIGS = [dict(row_slice=rs) for rs in (8, 16, 32)] + [
    dict(block=(64, 256), num_warps=4), dict(block=(64, 256), num_warps=8), dict(block=(64, 128), num_warps=2),
    dict(block=(128, 128), num_warps=4), dict(block=(32, 128), num_warps=4),
    dict(block=(64, 128), num_warps=2, row_slice=16)]
MOE_SPLITS = [5003, 0, 1, 7077, 9000, 31, 12800, 6088]
HIDDEN = HEAD = 4096


@gpu
@pytest.mark.parametrize("case", ["bf16", "fp32", "moe"])
def test_natural_gpu_bitwise(case):
    """16384x4096 BF16 / FP32 and the 40000x4096 row-mapped MoE case (fresh random input with
    specials, poisoned outputs): "natural" at each row_slice and a few tiles, both copies and the
    columnwise one alone, bitwise equal to "slices"; the default natural call also to the
    reference (on a slice of the columnwise copy for the MoE case)."""
    from hybridfp.moe.quantize import _offsets, _padded_total, _row_map
    rm = None
    if case == "moe":
        x = gpu_input((sum(MOE_SPLITS), HIDDEN), torch.bfloat16, specials=True)
        starts = _offsets(MOE_SPLITS, 32)
        rm = _row_map(MOE_SPLITS, starts, _padded_total(MOE_SPLITS, 32, starts), x)
    else:
        x = gpu_input(GPU_SHAPE, torch.float32 if case == "fp32" else torch.bfloat16, specials=True)
    failed = []  # every config runs: a miscompile shows up as a pattern over tiles, not one
    for kw in NATURAL_GPU_CONFIGS:
        for rowwise in (True, False):
            try:
                check_natural(x, rowwise=rowwise, row_map=rm, reference=False, **kw)
            except AssertionError as err:
                failed.append(f"rowwise={rowwise}: {err}".splitlines()[0])
    assert not failed, "\n".join(failed)
    with poisoned_outputs(0x7F):
        row, col = triton_mxfp8.quantize(x, E4M3, row_map=rm, method="natural")
    torch.cuda.synchronize()
    if rm is None:
        _same(col, mxfp8.quantize_1d(x.t(), E4M3), "columnwise natural vs reference")
        _same(row, mxfp8.quantize_1d(x, E4M3), "rowwise natural vs reference")
    else:  # the padded groups' reference on the first HEAD padded rows
        head = torch.zeros(HEAD, x.shape[1], dtype=x.dtype, device=x.device)
        m = rm[:HEAD]
        head[m >= 0] = x[m[m >= 0].long()]
        d, s = mxfp8.quantize_1d(head.t(), E4M3)
        _same((col[0][:, :HEAD], col[1][:, :HEAD // 32]), (d, s), "columnwise natural (row map) vs reference")
        _same(row, mxfp8.quantize_1d(x, E4M3), "rowwise natural (row map) vs reference")


def test_default_method_choice():
    """No method named: "natural" on its measured tile for a columnwise-only 1D copy of 16-bit
    input with no tile asked for; "slices" (and the caller's tile) for everything else."""
    choose = triton_mxfp8._default_method
    bf, f32 = torch.empty(2, 2, dtype=torch.bfloat16), torch.empty(2, 2)
    assert choose(bf, False, True, False, None, None) == ("natural", *triton_mxfp8.COL_ONLY_NATURAL)
    assert choose(bf.half(), False, True, False, None, None)[0] == "natural"
    assert choose(bf, True, True, False, None, None) == ("slices", None, None)
    assert choose(f32, False, True, False, None, None) == ("slices", None, None)
    assert choose(bf, False, True, True, None, None) == ("slices", None, None)
    assert choose(bf, False, True, False, (32, 128), None) == ("slices", (32, 128), None)
    assert choose(bf, False, True, False, None, 4) == ("slices", None, 4)


@interpreter_only
@pytest.mark.parametrize("row_map", [False, True], ids=["plain", "row map"])
def test_default_columnwise_only_is_natural_and_exact(row_map):
    """The default columnwise-only call ("natural" on (64, 128) / 2 warps) gives the bytes of
    "slices" and of the reference, with and without a row map."""
    x = edge_tensor((100, 160), torch.bfloat16, seed=5, specials=True)
    rm = None
    if row_map:
        rm = torch.full((160,), -1, dtype=torch.int32)
        rm[torch.randperm(160, generator=torch.Generator().manual_seed(1))[:100]] = torch.arange(100, dtype=torch.int32)
    with poisoned_outputs(0x7F):
        got = triton_mxfp8.quantize(x, E4M3, rowwise=False, row_map=rm)
    with poisoned_outputs(0x7F):
        want = triton_mxfp8.quantize(x, E4M3, rowwise=False, row_map=rm, method="slices")
    assert got[0] is None
    _same(got[1], want[1], "default columnwise-only vs slices")
    src = x
    if rm is not None:
        src = torch.zeros(160, 160, dtype=x.dtype)
        src[rm >= 0] = x[rm[rm >= 0].long()]
    _same(got[1], mxfp8.quantize_1d(src.t(), E4M3), "default columnwise-only vs reference")
