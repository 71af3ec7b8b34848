"""Quantize kernels on finite inputs near the FP32 maximum: bitwise equal to the ``formats``
reference, which saturates there (tests/formats/test_near_fp32_max.py), and every copy decodes
finite. Tiny shapes: the kernels run in the interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import check_against_reference, interpreter_only, run_kernel  # noqa: E402

from hybridfp.formats import fp8_block, mxfp8  # noqa: E402
from hybridfp.kernels import triton_fp8_block, triton_mxfp8  # noqa: E402
from hybridfp.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer,  # noqa: E402
                                 HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RD = "rowwise_dequantized"


def near_max(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Ordinary values with near-maximum ones (the dtype's max, FP32: also 3.4e38 / 3.3e38) in
    both directions' blocks, of both signs; 16 rows of column 0 all at the max (an RHT tile
    whose transform is beyond the range)."""
    top = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    x = torch.randn(shape, generator=g) * 1e3
    x[:16, 0] = top
    x[1, 3], x[5, 20 % shape[1]], x[17 % shape[0], 9] = -top, min(3.4e38, top), -min(3.3e38, top)
    x[shape[0] - 1, shape[1] - 1] = top
    return x.to(dtype)


def _assert_decodes_finite(storage, what: str) -> None:
    for d in storage.directions():
        part = storage.part(d) if hasattr(storage, "part") else storage
        v = part.decode(d)
        assert torch.isfinite(v).all(), f"{what} {d}: {v[~torch.isfinite(v)][:4]}"


QUANTIZERS = {
    "fp8block_1d": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "fp8block_2d_e5m2": lambda: Float8BlockQuantizer(E5M2, block_scaling_dim=2),
    "mxfp8": lambda: MXFP8Quantizer(),
    "mxfp8_e5m2_2d": lambda: MXFP8Quantizer(E5M2, with_2d_quantization=True),
    "nvfp4_rht": lambda: NVFP4Quantizer(with_rht=True),
    "nvfp4_rht_sr": lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
    "nvfp4_rht_prerht_amax": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=False),
    "fp8cur_pow2": lambda: Float8CurrentScalingQuantizer(force_pow_2_scales=True),
    "fp8cur_pow2_e5m2": lambda: Float8CurrentScalingQuantizer(E5M2, force_pow_2_scales=True),
    "hyb_fp8cur_pow2_fp8block": lambda: HybridQuantizer(Float8CurrentScalingQuantizer(force_pow_2_scales=True),
                                                        Float8BlockQuantizer(block_scaling_dim=1)),
    "hyb_fp8cur_fp8block": lambda: HybridQuantizer(Float8CurrentScalingQuantizer(),
                                                   Float8BlockQuantizer(block_scaling_dim=1)),
    "hyb_nvfp4rht_mxfp8": lambda: HybridQuantizer(NVFP4Quantizer(with_rht=True), MXFP8Quantizer()),
    "hyb_nvfp4_mxfp8_rd": lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), RD),
    "hyb_mxfp8_nvfp4rht": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True)),
}


def _check(q, x: torch.Tensor, what: str) -> None:
    if isinstance(q, HybridQuantizer):
        want = q.copy().reference_encode(x, True, True)
        got = run_kernel(q, x, True, True)
        from quantize_kernel_cases import assert_storage_bitwise
        for d in want.directions():
            assert_storage_bitwise(got.part(d), want.part(d), f"{what} {d}")
    else:
        got = check_against_reference(q, x, what=what)
    _assert_decodes_finite(got, what)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_quantize_kernel_near_max(name, dtype):
    _check(QUANTIZERS[name](), near_max((32, 40), dtype), f"{name} {dtype}")


@interpreter_only
@pytest.mark.parametrize("name", ["nvfp4_rht", "fp8block_1d", "mxfp8"])
def test_quantize_kernel_near_max_fp16(name):
    """FP16's max: the RHT of 16 equal maxima (4 x 65504) saturates to 65504."""
    _check(QUANTIZERS[name](), near_max((32, 40), torch.float16), f"{name} fp16")


@interpreter_only
@pytest.mark.parametrize("method", ["tile", "natural", "slices"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_fp8_block_1d_methods_near_max(method, dtype):
    x = near_max((64, 64), torch.float32)
    row, col = triton_fp8_block.quantize(x, dtype, block_size=32, method=method)
    for (d, s), src in ((row, x), (col, x.t())):
        wd, ws = fp8_block.quantize_1d(src, dtype, block=32)
        assert torch.equal(d.view(torch.uint8), wd.view(torch.uint8)), method
        assert torch.equal(s.view(torch.int32), ws.view(torch.int32)), method
        assert torch.isfinite(fp8_block.dequantize_1d(d, s, block=32)).all()


@interpreter_only
@pytest.mark.parametrize("method", ["tile", None])
def test_fp8_block_2d_near_max(method):
    x = near_max((64, 64), torch.float32)
    row, col = triton_fp8_block.quantize(x, E4M3, block_dim=2, block_size=32, method=method)
    wd, ws = fp8_block.quantize_2d(x, E4M3, block=32)
    assert torch.equal(row[0].view(torch.uint8), wd.view(torch.uint8))
    assert torch.equal(row[1].view(torch.int32), ws.view(torch.int32))
    assert torch.isfinite(fp8_block.dequantize_2d(row[0], row[1], block=32)).all()


@interpreter_only
@pytest.mark.parametrize("method", ["slices", "natural"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_methods_near_max(method, rule):
    x = near_max((64, 64), torch.bfloat16)
    row, col = triton_mxfp8.quantize(x, E4M3, rule=rule, method=method)
    for (d, s), src in ((row, x), (col, x.t())):
        wd, ws = mxfp8.quantize_1d(src, E4M3, rule=rule)
        assert torch.equal(d.view(torch.uint8), wd.view(torch.uint8)), method
        assert torch.equal(s, ws), method
        assert torch.isfinite(mxfp8.dequantize_1d(d, s)).all()
