"""Triton NVFP4 kernels (hybridfp/kernels/triton_nvfp4.py) vs the reference, bitwise: 1D with
and without the RHT on the columnwise copy (post- and pre-RHT amax), row-scaled, 2D, and
stochastic rounding (the kernels take the reference's per-direction torch.rand draws).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, EMPTY_SHAPES, GPU_SHAPES, SHAPES, assert_storage_bitwise,  # noqa: E402
                                   check_against_reference, check_gpu, edge_tensor, gpu, gpu_input,
                                   interpreter_only, run_kernel)

from hybridfp.formats import nvfp4, rht  # noqa: E402
from hybridfp.kernels import triton_nvfp4  # noqa: E402
from hybridfp.quantizers import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer, fast  # noqa: E402
from hybridfp.quantizers import nvfp4 as nvfp4_quantizers  # noqa: E402
from hybridfp.quantizers.backends import kernels_enabled, select_quantize_kernel  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

CONFIGS = {
    "1d": dict(),
    "rht": dict(with_rht=True),
    "rht_pre_amax": dict(with_rht=True, with_post_rht_amax=False),
    "2d": dict(with_2d_quantization=True),
    "sr": dict(stochastic_rounding=True),
    "sr_rht": dict(stochastic_rounding=True, with_rht=True),
    "sr_2d": dict(stochastic_rounding=True, with_2d_quantization=True),
}
NVFP4_SHAPES = SHAPES + [(17, 3)]


@interpreter_only
@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_nvfp4_kernel_bitwise(config, dtype, shape):
    x = edge_tensor(shape, dtype, seed=shape[-1] + 1, specials=True)
    check_against_reference(NVFP4Quantizer(**CONFIGS[config]), x, what=config)


@interpreter_only
@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_row_scaled_kernel_bitwise(dtype, shape):
    x = edge_tensor(shape, dtype, seed=shape[0], specials=True)
    check_against_reference(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), x, True, False)


@interpreter_only
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_nvfp4_kernel_one_direction(config, rowwise, columnwise):
    check_against_reference(NVFP4Quantizer(**CONFIGS[config]), edge_tensor((40, 72), torch.bfloat16, seed=2),
                            rowwise, columnwise)


@interpreter_only
@pytest.mark.parametrize("fill", [0.0, 1e-30, 3e38])
def test_nvfp4_kernel_extreme_amax(fill):
    """Zero tensor (S_enc = 1), a tiny and a huge global amax (block scales underflow to 0 and
    S_enc clamps): still bitwise."""
    x = edge_tensor((32, 48), torch.float32, seed=4) * (fill if fill else 0.0)
    x[3, 5] = fill
    for cfg in CONFIGS.values():
        check_against_reference(NVFP4Quantizer(**cfg), x)


@interpreter_only
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_nvfp4_kernel_empty(config, shape):
    check_against_reference(NVFP4Quantizer(**CONFIGS[config]), torch.empty(shape, dtype=torch.bfloat16))


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_kernel_small_tiles(dtype):
    """One 16-row tile x 32 columns per program on a transposed (strided) 100x70 view: many
    programs, partial tiles in both directions, the RHT tail (100 -> 112) spanning programs.
    Finite values only (no inf - inf NaN blocks: exact comparisons below)."""
    x = edge_tensor((70, 100), torch.float32, seed=11).clamp(-1e4, 1e4).to(dtype).t()
    g, per_row, post = triton_nvfp4.amaxes(x, amax=True, row_amax=True, rht_amax=True, block=(1, 32))
    xt = rht.apply_rht(x.t(), dtype)
    assert torch.equal(post, xt.float().abs().amax()) and torch.equal(per_row, x.float().abs().amax(1))
    for use_rht, camax in ((False, g), (True, post)):
        row, col = triton_nvfp4.quantize_1d(x, per_row, camax, rht=use_rht, block=(1, 32))
        d, s = nvfp4.quantize_1d(x, per_row)
        dc, sc = nvfp4.quantize_1d(xt if use_rht else x.t(), camax)
        assert torch.equal(row[0], d) and torch.equal(row[1].view(torch.uint8), s.view(torch.uint8))
        assert torch.equal(col[0], dc) and torch.equal(col[1].view(torch.uint8), sc.view(torch.uint8))
    row, col = triton_nvfp4.quantize_2d(x, g, block=(1, 32))
    d, s = nvfp4.quantize_2d(x, g)
    assert torch.equal(row[0], d) and torch.equal(row[1].view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(col[0], nvfp4.pack_fp4(nvfp4.unpack_fp4(d, 70).t().contiguous()))


@interpreter_only
def test_nvfp4_kernel_selection():
    """Row-scaled columnwise (an error the reference raises) is declined; CPU tensors are never
    selected by the registry."""
    x = torch.ones(16, 32)
    assert not fast.NVFP4_KERNEL.supports(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), x, True, True)
    assert select_quantize_kernel(NVFP4Quantizer(), x, True, True) is None


@interpreter_only
def test_nvfp4_kernel_sr_seed():
    """Stochastic rounding: same seed, same bits as the reference; without a seed the kernel
    draws one from the quantizer's generator exactly as the reference does."""
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(13))
    for cfg in ("sr", "sr_rht", "sr_2d"):
        q = NVFP4Quantizer(**CONFIGS[cfg], generator=torch.Generator().manual_seed(5))
        ref = NVFP4Quantizer(**CONFIGS[cfg], generator=torch.Generator().manual_seed(5))
        assert_storage_bitwise(run_kernel(q, x), ref.reference_encode(x, True, True), cfg)
        a, b = run_kernel(q, x, seed=1), run_kernel(q, x, seed=2)
        assert not torch.equal(a.payload("rowwise")["data"], b.payload("rowwise")["data"])


@interpreter_only
def test_nvfp4_kernel_amax_reduction(monkeypatch):
    """The kernel path reduces the same amaxes as the reference (a stand-in all-reduce that
    sees a 3x larger amax elsewhere; patched where each path imported it by name)."""
    fake = lambda amax, group: amax * 3  # noqa: E731
    monkeypatch.setattr(nvfp4_quantizers, "all_reduce_amax", fake)  # reference path
    monkeypatch.setattr(fast, "all_reduce_amax", fake)  # kernel path
    for cfg in CONFIGS.values():
        q = NVFP4Quantizer(**cfg, with_amax_reduction=True, amax_reduction_group=object())
        check_against_reference(q, edge_tensor((33, 40), torch.bfloat16, seed=5))


@interpreter_only
def test_nvfp4_dispatch_hybrids(monkeypatch):
    """MXFP8 forward / NVFP4 RHT backward, and NVFP4 double quantization (rowwise_dequantized),
    through quantize() with the kernels vs the reference path."""
    monkeypatch.setattr(fast, "_device_ok", lambda x: True)
    x = edge_tensor((48, 64), torch.bfloat16, seed=12)
    for q in (HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True)),
              HybridQuantizer(NVFP4Quantizer(), NVFP4Quantizer(), "rowwise_dequantized"),
              HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), MXFP8Quantizer(),
                              "rowwise_dequantized")):
        got = q.quantize(x)
        with kernels_enabled(False):
            want = q.quantize(x)
        for d in ("rowwise", "columnwise"):
            assert_storage_bitwise(got.qstorage.part(d), want.qstorage.part(d), f"{q!r} {d}")


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("config", ["1d", "rht", "2d"])
def test_nvfp4_gpu_bitwise(config, shape):
    check_gpu(NVFP4Quantizer(**CONFIGS[config]), gpu_input(shape, torch.bfloat16, specials=True))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_nvfp4_gpu_rht_dtypes(dtype):
    check_gpu(NVFP4Quantizer(with_rht=True), gpu_input((4096, 4096), dtype, specials=True))
    check_gpu(NVFP4Quantizer(with_rht=True, with_post_rht_amax=False), gpu_input((4096, 4096), dtype), False, True)


@gpu
@pytest.mark.parametrize("config", ["sr_rht", "sr_2d"])
def test_nvfp4_gpu_sr(config):
    check_gpu(NVFP4Quantizer(**CONFIGS[config]), gpu_input((16384, 4096), torch.bfloat16, specials=True))
    check_gpu(NVFP4Quantizer(**CONFIGS[config]), gpu_input((4096, 4096), torch.float32), False, True)


@gpu
def test_nvfp4_gpu_row_scaled_and_directions():
    x = gpu_input((4096, 4096), torch.bfloat16)
    check_gpu(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), x, True, False)
    check_gpu(NVFP4Quantizer(with_rht=True), x, False, True)
    check_gpu(NVFP4Quantizer(), x, True, False)
