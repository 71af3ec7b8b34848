"""Fused hybrid quantize kernels (hybridfp/kernels/triton_hybrid_*.py) vs the separate encodes.

A ``HybridQuantizer`` whose pair of children has a fused kernel (``fast.HYBRID_KERNELS``) writes
both copies in one cast pass; its storage must equal, bit for bit, the hybrid's own
``reference_encode`` (each child separately: the ``formats`` reference on the CPU, and on the
GPU both the children's own kernels and, with kernels disabled, the ``formats`` reference).

CPU: interpreter, awkward tiny shapes (partial 16/32/128 blocks, 3D, odd widths), edge values
with NaN / ±inf, each source and direction set, empty inputs, the registry lookup. GPU
(``-m gpu``): real shapes, fresh inputs, outputs poisoned, the registry picking the fused kernel.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (EMPTY_SHAPES, GPU_SHAPES, assert_storage_bitwise, edge_tensor,  # noqa: E402
                                   gpu, gpu_input, interpreter_only, run_kernel)

from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, HybridQuantizer,  # noqa: E402
                                 IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, fast)
from hybridfp import policy  # noqa: E402
from hybridfp.quantizers.backends import (ReferenceQuantizeWarning, hybrid_quantize_kernel,  # noqa: E402
                                          select_quantize_kernel)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RD = "rowwise_dequantized"


def _fp8_block1d(**kw):
    return Float8BlockQuantizer(block_scaling_dim=1, **kw)


#: name -> (hybrid factory, fused kernel it must select).
PAIRS = {
    "fp8cur_fp8block": (lambda: HybridQuantizer(Float8CurrentScalingQuantizer(), _fp8_block1d()),
                        fast.HYBRID_FP8_CURRENT_BLOCK_KERNEL),
    "fp8cur_e5m2_pow2_fp8block_eps": (
        lambda: HybridQuantizer(Float8CurrentScalingQuantizer(E5M2, force_pow_2_scales=True, amax_epsilon=2.0),
                                _fp8_block1d(force_pow_2_scales=False, amax_epsilon=0.5)),
        fast.HYBRID_FP8_CURRENT_BLOCK_KERNEL),
    "nvfp4_mxfp8_rd": (lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), RD),
                       fast.HYBRID_NVFP4_MXFP8_KERNEL),
    "nvfp4_rowscaled_mxfp8_rd": (
        lambda: HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), RD),
        fast.HYBRID_NVFP4_MXFP8_KERNEL),
    "nvfp4rht_mxfp8e5floor_orig": (
        lambda: HybridQuantizer(NVFP4Quantizer(with_rht=True), MXFP8Quantizer(E5M2, scale_rule="floor")),
        fast.HYBRID_NVFP4_MXFP8_KERNEL),
    "mxfp8_nvfp4rht_orig": (lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True)),
                            fast.HYBRID_MXFP8_NVFP4_KERNEL),
    "mxfp8e5floor_nvfp4_orig": (  # no RHT: the bytewise columnwise path where R % 16 != 0
        lambda: HybridQuantizer(MXFP8Quantizer(E5M2, scale_rule="floor"), NVFP4Quantizer()),
        fast.HYBRID_MXFP8_NVFP4_KERNEL),
    "mxfp8_nvfp4rht_prerht_amax": (
        lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True, with_post_rht_amax=False)),
        fast.HYBRID_MXFP8_NVFP4_KERNEL),
}
#: Partial 16 / 32 / 128 blocks in both directions, odd widths, a 3D input, one element.
SHAPES = [(3, 40), (33, 50), (130, 72), (40, 17), (2, 5, 36), (1, 1)]


def _check(hq: HybridQuantizer, x: torch.Tensor, rowwise: bool, columnwise: bool, what: str):
    """The hybrid kernel's storage equals the hybrid reference part by part."""
    want = hq.copy().reference_encode(x, rowwise, columnwise)
    got = run_kernel(hq, x, rowwise, columnwise)
    assert got.directions() == want.directions(), what
    for d in want.directions():
        assert_storage_bitwise(got.part(d), want.part(d), f"{what} {d}")
    return got


@interpreter_only
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pair", PAIRS)
def test_hybrid_kernel_bitwise(pair, shape):
    make, kernel = PAIRS[pair]
    hq = make()
    assert hybrid_quantize_kernel(hq) is kernel
    dtype = (torch.bfloat16, torch.float32, torch.float16)[shape[0] % 3]
    _check(hq, edge_tensor(shape, dtype, seed=shape[-1], specials=True), True, True, pair)


@interpreter_only
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_hybrid_kernel_one_direction(pair, rowwise, columnwise):
    """One copy: the fused kernel runs when the rowwise value is still needed (columnwise from
    rowwise_dequantized: the rowwise copy is made in registers and not stored); otherwise the
    child alone. Either way equal to the reference."""
    hq = PAIRS[pair][0]()
    x = edge_tensor((40, 72), torch.bfloat16, seed=2, specials=True)
    got = _check(hq, x, rowwise, columnwise, pair)
    assert got.directions() == (("rowwise",) if rowwise else ("columnwise",))


@interpreter_only
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("pair", PAIRS)
def test_hybrid_kernel_empty(pair, shape):
    _check(PAIRS[pair][0](), torch.empty(shape, dtype=torch.bfloat16), True, True, pair)


@interpreter_only
@pytest.mark.parametrize("method", ["trans", "natural"])
@pytest.mark.parametrize("source", ["original", RD])
@pytest.mark.parametrize("shape,dtype,block,finite_amax,row_scaled", [
    ((70, 100), torch.float32, (32, 64), True, False), ((33, 50), torch.float16, (32, 32), False, False),
    ((160, 96), torch.bfloat16, (64, 64), True, True), ((40, 17), torch.bfloat16, (32, 64), False, True),
    ((66, 136), torch.bfloat16, (64, 128), True, True)], ids=str)
def test_nvfp4_mxfp8_kernel_tiles(method, source, shape, dtype, block, finite_amax, row_scaled):
    """The fused NVFP4 row + MXFP8 col kernel at several tiles and both methods against the
    ``formats`` references: E2M1 code and value from one rounding FMA
    (``triton_nvfp4_tile.e2m1_rne``), NaN blocks under a finite global amax (their codes cleared per
    block) and under a NaN one, per-row amaxes (row-scaled), R and C not multiples of 32 or 8
    (bytewise rows), R % 4 != 0 (byte stores of the natural columnwise codes), a transposed
    (strided) view for (160, 96)."""
    x = edge_tensor(shape, dtype, seed=shape[1], specials=True)
    x = x.t() if shape == (160, 96) else x
    amax = (x.float().nan_to_num(0.0) if finite_amax else x.float()).abs()
    amax = amax.amax(dim=1) if row_scaled else amax.amax()
    _check_nvfp4_mxfp8(x, amax, source, block=block, method=method)


def _check_nvfp4_mxfp8(x, amax, source, **kw):
    """The fused NVFP4 row + MXFP8 col kernel's copies of ``x`` equal the ``formats`` references."""
    from hybridfp.formats import mxfp8, nvfp4
    from hybridfp.kernels import triton_hybrid_nvfp4
    (rd, rs), (cd, cs) = triton_hybrid_nvfp4.quantize(x, amax, E4M3, source=source, **kw)
    want_rd, want_rs = nvfp4.quantize_1d(x, amax)
    src = nvfp4.dequantize_1d(want_rd, want_rs, amax, x.shape[1]) if source == RD else x
    want_cd, want_cs = mxfp8.quantize_1d(src.t(), E4M3)
    assert torch.equal(rd, want_rd) and torch.equal(rs.view(torch.uint8), want_rs.view(torch.uint8)), kw
    assert torch.equal(cd.view(torch.uint8), want_cd.contiguous().view(torch.uint8)), kw
    assert torch.equal(cs, want_cs.contiguous()), kw


@interpreter_only
@pytest.mark.parametrize("method", ["trans", "natural"])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("block", [(128, 32), (64, 64), (96, 32)], ids=str)
def test_nvfp4_mxfp8_kernel_store_widths(method, wide, block):
    """Both store widths (narrow code words and unpaired scale bytes; wide words and paired
    64-row scales) and tiles of three and four 32-row blocks (several unpaired scale stores a
    tile), rows not a multiple of the tile, row-scaled, NaN blocks."""
    x = edge_tensor((230, 72), torch.bfloat16, seed=5, specials=True)
    amax = x.float().nan_to_num(0.0).abs().amax(dim=1)
    for source in ("original", RD):
        _check_nvfp4_mxfp8(x, amax, source, block=block, method=method, wide_stores=wide)


@interpreter_only
@pytest.mark.parametrize("y_max", [1, 2, 3, 4])
def test_nvfp4_mxfp8_kernel_grid_fallback(monkeypatch, y_max):
    """The fused kernel on its 2D grid (column tile, row tile) and, where the row tiles exceed
    the grid's y limit (patched down to 1-3 here; CUDA's is 65535), on the 1D grid with the
    division: the same bytes either way, global and per-row amaxes (4 row tiles of 32 rows)."""
    from hybridfp.kernels import _common
    monkeypatch.setattr(_common, "GRID_Y_MAX", y_max)
    x = edge_tensor((100, 72), torch.bfloat16, seed=9, specials=True)
    assert _common.tile_grid(100, 72, 32, 64) == (((2, 4), True) if y_max >= 4 else ((8,), False))
    for amax in (x.float().nan_to_num(0.0).abs().amax(), x.float().nan_to_num(0.0).abs().amax(dim=1)):
        for method in ("trans", "natural"):
            _check_nvfp4_mxfp8(x, amax, RD, block=(32, 64), method=method)


@gpu
@pytest.mark.parametrize("source", ["original", RD])
@pytest.mark.parametrize("tile", [((32, 64), 2, "trans"), ((32, 128), 4, "trans"), ((32, 32), 1, "trans"),
                                  ((64, 64), 2, "trans"), ((32, 64), 2, "natural"), ((32, 128), 2, "natural"),
                                  ((64, 64), 2, "natural"), ((64, 128), 4, "natural"), ((32, 128), 4, "natural")],
                         ids=str)
def test_nvfp4_mxfp8_gpu_tiles(source, tile):
    """The fused NVFP4 row + MXFP8 col kernel at the tiles to time, both methods, on the GPU
    (the hardware FP8 conversions, ``e2m1_rne``'s FMA), awkward shape and a transposed view, NaN
    blocks under a finite global amax, global and per-row amaxes; outputs poisoned."""
    from hybridfp.formats import mxfp8, nvfp4
    from hybridfp.kernels import triton_hybrid_nvfp4
    base = gpu_input((1000 + 17, 4160), torch.bfloat16, specials=True)
    for x, row_scaled in ((base, False), (base.t(), False), (base, True)):
        amax = x.float().nan_to_num(0.0).abs()
        amax = amax.amax(dim=1) if row_scaled else amax.amax()
        with poisoned_outputs():
            (rd, rs), (cd, cs) = triton_hybrid_nvfp4.quantize(x, amax, E4M3, source=source, block=tile[0],
                                                               num_warps=tile[1], method=tile[2])
        want_rd, want_rs = nvfp4.quantize_1d(x, amax)
        src = nvfp4.dequantize_1d(want_rd, want_rs, amax, x.shape[1]) if source == RD else x
        want_cd, want_cs = mxfp8.quantize_1d(src.t(), E4M3)
        assert torch.equal(rd, want_rd) and torch.equal(rs.view(torch.uint8), want_rs.view(torch.uint8))
        assert torch.equal(cd.view(torch.uint8), want_cd.contiguous().view(torch.uint8)), f"{tile} col"
        assert torch.equal(cs, want_cs.contiguous()), f"{tile} col scales"


@interpreter_only
def test_hybrid_kernel_equals_separate_child_kernels():
    """The fused NVFP4 + MXFP8 (rowwise_dequantized) pass equals the two child kernels run one
    after the other, the MXFP8 one on the FP32 dequantized NVFP4 value; likewise FP8 current
    + FP8 block and MXFP8 + NVFP4 (RHT) on the original input."""
    x = edge_tensor((96, 160), torch.bfloat16, seed=11, specials=True)
    hq = HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), RD)
    got = run_kernel(hq, x)
    row = run_kernel(hq.rowwise_quantizer, x, True, False)
    col = run_kernel(hq.columnwise_quantizer, row.dequantize(torch.float32, "rowwise"), False, True)
    assert_storage_bitwise(got.part("rowwise"), row, "nvfp4 rowwise")
    assert_storage_bitwise(got.part("columnwise"), col, "mxfp8 columnwise")
    hq = HybridQuantizer(Float8CurrentScalingQuantizer(), _fp8_block1d())
    got = run_kernel(hq, x)
    assert_storage_bitwise(got.part("rowwise"), run_kernel(hq.rowwise_quantizer, x, True, False), "fp8 row")
    assert_storage_bitwise(got.part("columnwise"), run_kernel(hq.columnwise_quantizer, x, False, True),
                           "fp8 block col")
    hq = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True))
    got = run_kernel(hq, x)
    assert_storage_bitwise(got.part("rowwise"), run_kernel(hq.rowwise_quantizer, x, True, False), "mxfp8 row")
    assert_storage_bitwise(got.part("columnwise"), run_kernel(hq.columnwise_quantizer, x, False, True),
                           "nvfp4 rht col")


@interpreter_only
@pytest.mark.parametrize("shape,dtype", [((64, 96), torch.bfloat16), ((70, 100), torch.float32),
                                         ((66, 40), torch.float16), ((96, 64), torch.bfloat16)], ids=str)
@pytest.mark.parametrize("method", ["natural", "slices"])
def test_hybrid_fp8_block_small_tiles(shape, dtype, method):
    """Fused FP8 current + FP8 block with 32-blocks: interior-only tiles (the EVEN path), edge
    tiles, R % 4 != 0 (byte stores), a transposed view (96, 64); each method. Equal to the per-tensor
    kernel (rowwise) and the ``formats`` block reference (columnwise)."""
    from hybridfp.kernels import _common, triton_hybrid_fp8
    x = edge_tensor(shape[::-1] if shape == (96, 64) else shape, dtype, seed=4, specials=True)
    x = x.t() if shape == (96, 64) else x
    amax = _common.global_amax(x)
    got = triton_hybrid_fp8.quantize(x, amax, E5M2, E4M3, block_size=32, method=method)
    _assert_fp8_current_block(got, x, amax, E5M2, 32)


def _assert_fp8_current_block(got, x, amax, row_dtype, block):
    """The fused FP8-current row + FP8-block col copies ``got`` equal the per-tensor kernel's
    rowwise copy and the block reference's columnwise copy (E4M3), bit for bit."""
    from hybridfp.formats import fp8_block
    from hybridfp.kernels import triton_fp8_tensorwise
    (rd, sinv), (cd, cs) = got
    want_rd, _, want_sinv, _ = triton_fp8_tensorwise.quantize(x, row_dtype, amax=amax, columnwise=False)
    want_cd, want_cs = fp8_block.quantize_1d(x.t(), E4M3, block=block)
    assert torch.equal(rd.view(torch.uint8), want_rd.view(torch.uint8)) and torch.equal(sinv, want_sinv)
    assert torch.equal(cd.view(torch.uint8), want_cd.contiguous().view(torch.uint8))
    assert torch.equal(cs.view(torch.int32), want_cs.contiguous().view(torch.int32))


@gpu
@pytest.mark.parametrize("config", [(None, None, None, None), ("natural", 4, 32, 16), ("natural", 1, 16, 8),
                                    ("natural", 4, 64, 32), ("natural", 8, 128, 32), ("natural", 8, 64, 32),
                                    ("slices", 4, None, 16)], ids=str)
@pytest.mark.parametrize("shape", [(4096, 4096), (4113, 1000)], ids=str)
def test_hybrid_fp8_block_gpu_configs(config, shape):
    """Fused FP8 current + FP8 block at the configurations to time (method, num_warps, chunk,
    row_slice; all None: the defaults), poisoned outputs, vs the per-tensor kernel and the block
    reference."""
    from hybridfp.kernels import _common, triton_hybrid_fp8
    method, nw, chunk, rw = config
    base = gpu_input(shape, torch.bfloat16, specials=True)
    for x in (base, base.float()):  # contiguous FP32: the packed natural path miscompiled there
        amax = _common.global_amax(x)
        with poisoned_outputs(0x7F):
            got = triton_hybrid_fp8.quantize(x, amax, E4M3, E4M3, method=method or "natural", num_warps=nw,
                                             chunk=chunk, row_slice=rw)
        _assert_fp8_current_block(got, x, amax, E4M3, 128)


@interpreter_only
def test_hybrid_kernel_registry():
    """The pair lookup is keyed by the children's kernel keys and the source: settings a kernel
    takes as arguments do not matter, unsupported ones (SR, 2D, RHT on a columnwise NVFP4
    child, an Identity child, the other source for FP8) find no kernel."""
    hq = HybridQuantizer(NVFP4Quantizer(with_rht=True), MXFP8Quantizer(E5M2, scale_rule="floor"), RD)
    assert hybrid_quantize_kernel(hq) is fast.HYBRID_NVFP4_MXFP8_KERNEL
    for none in [HybridQuantizer(NVFP4Quantizer(stochastic_rounding=True), MXFP8Quantizer(), RD),
                 HybridQuantizer(NVFP4Quantizer(with_2d_quantization=True), MXFP8Quantizer(), RD),
                 HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(with_2d_quantization=True), RD),
                 HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True), RD),
                 HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True, stochastic_rounding=True)),
                 HybridQuantizer(MXFP8Quantizer(with_2d_quantization=True), NVFP4Quantizer()),
                 HybridQuantizer(NVFP4Quantizer(), IdentityQuantizer(), RD),
                 HybridQuantizer(Float8CurrentScalingQuantizer(), _fp8_block1d(), RD),
                 HybridQuantizer(Float8CurrentScalingQuantizer(), Float8BlockQuantizer(block_scaling_dim=2))]:
        assert hybrid_quantize_kernel(none) is None, none
    # The registry selects kernels for CUDA tensors only.
    x = torch.zeros(4, 32)
    assert select_quantize_kernel(hq, x, True, True) is None


@interpreter_only
def test_hybrid_dispatch_quantize(monkeypatch):
    """With the device check opened to CPU tensors, quantize() selects the fused kernel and
    equals the reference path (kernels off)."""
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    x = edge_tensor((64, 96), torch.bfloat16, seed=9)
    for name, (make, kernel) in PAIRS.items():
        hq = make()
        assert select_quantize_kernel(hq, x, True, True) is fast.HYBRID_KERNEL
        got = hq.quantize(x)
        with policy(quantize_kernels=False):
            want = hq.quantize(x)
        for d in ("rowwise", "columnwise"):
            assert_storage_bitwise(got.qstorage.part(d), want.qstorage.part(d), f"{name} {d}")
    hq = PAIRS["fp8cur_fp8block"][0]()
    assert select_quantize_kernel(hq, x, True, False) is None  # one copy: the child's own kernel


def check_gpu_hybrid(hq: HybridQuantizer, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True) -> None:
    """On CUDA: ``hq.encode`` picks the fused kernel and, with outputs poisoned, equals both the
    children's own kernels run separately and the ``formats`` reference, bit for bit."""
    assert select_quantize_kernel(hq, x, rowwise, columnwise) is fast.HYBRID_KERNEL
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceQuantizeWarning)
        separate = hq.copy().reference_encode(x, rowwise, columnwise)
        with poisoned_outputs(0x7F):
            got = hq.encode(x, rowwise, columnwise)
    with policy(quantize_kernels=False):
        reference = hq.copy().reference_encode(x, rowwise, columnwise)
    torch.cuda.synchronize()
    what = f"{hq!r} {tuple(x.shape)} {x.dtype}"
    for want, how in ((separate, "separate kernels"), (reference, "formats reference")):
        assert got.directions() == want.directions(), f"{what} vs {how}"
        for d in want.directions():
            assert_storage_bitwise(got.part(d), want.part(d), f"{what} {d} vs {how}")


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("pair", PAIRS)
def test_hybrid_gpu_bitwise(pair, shape):
    check_gpu_hybrid(PAIRS[pair][0](), gpu_input(shape, torch.bfloat16, specials=True))


@gpu
@pytest.mark.parametrize("pair", ["fp8cur_fp8block", "nvfp4_mxfp8_rd", "nvfp4_rowscaled_mxfp8_rd",
                                  "mxfp8_nvfp4rht_orig"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_hybrid_gpu_dtypes(pair, dtype):
    check_gpu_hybrid(PAIRS[pair][0](), gpu_input((4096, 4096), dtype))


@gpu
@pytest.mark.parametrize("pair", ["nvfp4_mxfp8_rd", "nvfp4_rowscaled_mxfp8_rd"])
def test_hybrid_gpu_columnwise_only(pair):
    """Columnwise from rowwise_dequantized alone: the rowwise copy made in registers only."""
    check_gpu_hybrid(PAIRS[pair][0](), gpu_input((4096, 4096), torch.bfloat16), False, True)


@gpu
@pytest.mark.parametrize("pair", PAIRS)
def test_hybrid_gpu_awkward_shape(pair):
    """Partial blocks in both directions, a strided (transposed) input, odd row count."""
    x = gpu_input((4096 + 17, 1000), torch.bfloat16, specials=True)
    check_gpu_hybrid(PAIRS[pair][0](), x)
    check_gpu_hybrid(PAIRS[pair][0](), x.t())
