"""Grouped per-tensor scaling kernels (hybridfp/kernels/triton_grouped_fp8.py), through
``quantize_grouped``'s ``encode_group_scaled(kernel=True)``: every expert's FP8 current-scaling
copies (rowwise, and its own transpose as the columnwise copy) and every expert's 1D NVFP4
rowwise copy (its per-tensor amax expanded to its rows through ``triton_nvfp4``'s row-scaled
path) equal, bit for bit, that expert's own ``reference_encode``; zero-size experts, counts that
are not multiples of 4 / 16 / 32 / 128, NaN / inf inputs, E4M3 and E5M2, power-of-two scales and
amax epsilon. Interpreter on tiny shapes (CPU); compiled at the MoE shape with ``-m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, assert_storage_bitwise, assert_tensor_bitwise, edge_tensor,  # noqa: E402
                                   gpu, gpu_input, interpreter_only)

from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.kernels.triton_grouped_fp8 import group_amax  # noqa: E402
from hybridfp.quantizers import Float8CurrentScalingQuantizer, NVFP4Quantizer  # noqa: E402
from hybridfp.quantizers.backends import select_quantize_kernel  # noqa: E402
from hybridfp.quantizers.grouped import encode_group_scaled  # noqa: E402
from hybridfp.quantizers.grouped_scaled import padded_ld  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {
    "e4m3": dict(fp8_dtype=E4M3),
    "e5m2_pow2": dict(fp8_dtype=E5M2, force_pow_2_scales=True),
    "e4m3_eps": dict(fp8_dtype=E4M3, amax_epsilon=4.0),
}
#: an empty expert first and last, one-row experts, counts not multiples of 4 / 16 / 32
SPLITS = [0, 3, 1, 37, 0, 18, 5, 0]


def grouped_input(splits, cols: int, dtype: torch.dtype, *, specials: bool = True) -> torch.Tensor:
    """Edge values, each expert at its own magnitude (2**-6 .. 2**6), so per-expert scales differ."""
    x = edge_tensor((sum(splits), cols), torch.float32, seed=cols, specials=specials)
    mag = torch.cat([torch.full((m, 1), 2.0 ** (3 * (e % 5) - 6)) for e, m in enumerate(splits)])
    return (x * mag).to(dtype)


def check_grouped(q, x: torch.Tensor, splits, rowwise: bool, columnwise: bool, what: str) -> None:
    """Kernel result per expert == that expert's own reference_encode, bitwise (on CUDA through
    the default selection, which must pick the kernels)."""
    if x.is_cuda:
        assert select_quantize_kernel(q, x, rowwise, columnwise) is not None
    with poisoned_outputs(0x7F):
        got = encode_group_scaled(q, x, splits, rowwise, columnwise, kernel=None if x.is_cuda else True).parts
    for e, (part, xe) in enumerate(zip(got, torch.split(x, splits))):
        want = q.copy().reference_encode(xe, rowwise, columnwise)
        assert_storage_bitwise(part, want, f"{what} expert {e} ({xe.shape[0]} rows)")
        if columnwise:  # its own transpose: a 16-byte aligned view whose rows continue with
            # zero codes up to a multiple of 16 (the cuBLAS wgrad reads it padded, no copy)
            col = part.payload("columnwise")["data"]
            m, ld = xe.shape[0], padded_ld(xe.shape[0])
            assert col.shape == (x.shape[1], m) and col.stride() == (ld, 1) and col.data_ptr() % 16 == 0
            assert part.columnwise_zero_tail
            tail = col.as_strided((x.shape[1], ld), (ld, 1))[:, m:]
            assert not tail.view(torch.uint8).any(), f"{what} expert {e}: nonzero row tail"


@interpreter_only
@pytest.mark.parametrize("cols", [40, 129])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", FP8)
def test_grouped_fp8_current_kernel_bitwise(config, dtype, cols):
    x = grouped_input(SPLITS, cols, dtype)
    q = Float8CurrentScalingQuantizer(**FP8[config])
    check_grouped(q, x, SPLITS, True, True, config)
    check_grouped(q, x, SPLITS, False, True, f"{config} columnwise only")
    check_grouped(q, x, SPLITS, True, False, f"{config} rowwise only")
    # groups longer than a tile (32 rows): tiles wholly inside one group and tiles across
    # group boundaries
    long = [70, 0, 45, 96, 3]
    check_grouped(q, grouped_input(long, cols, dtype), long, True, True, f"{config} long groups")


@interpreter_only
def test_grouped_fp8_nan_expert_gets_scale_one():
    """A NaN in one expert makes only that expert's scale 1 (SPEC §2.1); the others keep theirs."""
    splits = [5, 6, 7]
    x = grouped_input(splits, 33, torch.bfloat16, specials=False)
    x[7, 3] = float("nan")
    x[14, 0] = float("inf")
    got = encode_group_scaled(Float8CurrentScalingQuantizer(), x, splits, True, True, kernel=True).parts
    sinv = torch.stack([p.payload("rowwise")["scale_inv"] for p in got])
    assert sinv[1] == 1 and sinv[2] == 1 and sinv[0] != 1
    check_grouped(Float8CurrentScalingQuantizer(), x, splits, True, True, "nan/inf experts")


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [40, 64])
def test_grouped_nvfp4_rows_kernel_bitwise(dtype, cols):
    """An expert's per-tensor amax on each of its rows (row-scaled kernel path) gives that
    expert's own per-tensor NVFP4 bits; the amax handed out is the expert's own."""
    x = grouped_input(SPLITS, cols, dtype)
    check_grouped(NVFP4Quantizer(), x, SPLITS, True, False, "nvfp4")


@interpreter_only
def test_group_amax_kernel():
    splits = [0, 70, 1, 0, 65, 3]  # tiles of 64 rows: one group, several groups, a group over tiles
    x = grouped_input(splits, 200, torch.float32)
    group = torch.repeat_interleave(torch.arange(len(splits), dtype=torch.int32), torch.tensor(splits))
    got = group_amax(x, group, len(splits))
    want = torch.stack([xe.abs().amax() if xe.numel() else torch.zeros(()) for xe in torch.split(x, splits)])
    assert_tensor_bitwise(got, want.float(), "group amax")


@gpu
@pytest.mark.parametrize("config", ["e4m3", "e5m2_pow2"])
def test_grouped_fp8_current_gpu_bitwise(config):
    """The MoE shape: hidden 4096, 64 experts with uneven counts (some empty), outputs poisoned;
    ``quantize_grouped``'s default on CUDA picks the kernels."""
    g = torch.Generator().manual_seed(0)
    splits = torch.randint(0, 513, (64,), generator=g).tolist()
    splits[1] = splits[40] = 0
    x = gpu_input((sum(splits), 4096), torch.bfloat16, specials=True)
    check_grouped(Float8CurrentScalingQuantizer(**FP8[config]), x, splits, True, True, config)
    # stacked expert weights [64 * 1408, 4096] and their transposes
    w = gpu_input((64 * 1408, 4096), torch.bfloat16)
    check_grouped(Float8CurrentScalingQuantizer(**FP8[config]), w, [1408] * 64, True, True, f"{config} weights")


@gpu
def test_grouped_nvfp4_rows_gpu_bitwise():
    g = torch.Generator().manual_seed(1)
    splits = torch.randint(0, 513, (64,), generator=g).tolist()
    splits[3] = 0
    x = gpu_input((sum(splits), 4096), torch.bfloat16, specials=True)
    check_grouped(NVFP4Quantizer(), x, splits, True, False, "nvfp4")
    w = gpu_input((64 * 1408, 4096), torch.bfloat16)
    check_grouped(NVFP4Quantizer(), w, [1408] * 64, True, False, "nvfp4 weights")

