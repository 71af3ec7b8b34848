"""Triton FP8 per-tensor kernels (hybridfp/kernels/triton_fp8_tensorwise.py): current scaling
(amax pass + cast pass) and delayed scaling (cast pass recording the amax), bitwise vs the
reference, quantizer state included.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, EMPTY_SHAPES, GPU_SHAPES, SHAPES, assert_storage_bitwise,  # noqa: E402
                                   assert_tensor_bitwise, check_against_reference, check_gpu, edge_tensor,
                                   edge_values, gpu, gpu_input, interpreter_only, run_kernel)

from hybridfp.quantizers import (Float8CurrentScalingQuantizer, Float8Quantizer, HybridQuantizer,  # noqa: E402
                                 fast)
from hybridfp.quantizers import fast as fast_glue  # noqa: E402
from hybridfp.quantizers import float8 as float8_quantizers  # noqa: E402
from hybridfp import policy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CURRENT = {
    "e4m3": dict(fp8_dtype=E4M3),
    "e5m2_pow2": dict(fp8_dtype=E5M2, force_pow_2_scales=True),
    "e4m3_eps": dict(fp8_dtype=E4M3, amax_epsilon=4.0),
}


def delayed(fp8_dtype=E4M3, margin: int = 0, amax: float = 7.0) -> Float8Quantizer:
    """A delayed-scaling quantizer one update in (E4M3, amax 7: scale 64)."""
    q = Float8Quantizer(fp8_dtype, margin=margin)
    with policy(quantize_kernels=False):
        q.quantize(torch.full((1, 1), amax))
    q.update_scale()
    return q


def check_delayed(q: Float8Quantizer, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True):
    """Kernel storage and the recorded amax history equal the reference's."""
    ref = q.copy()
    want = ref.reference_encode(x, rowwise, columnwise)
    got = run_kernel(q, x, rowwise, columnwise)
    assert_storage_bitwise(got, want, repr(q))
    assert_tensor_bitwise(q.amax_history, ref.amax_history, "amax history")
    assert q._recorded and torch.equal(q.scale, ref.scale)


@interpreter_only
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CURRENT)
def test_fp8_current_kernel_bitwise(config, dtype, shape):
    x = edge_tensor(shape, dtype, seed=shape[-1])
    check_against_reference(Float8CurrentScalingQuantizer(**CURRENT[config]), x, what=config)


@interpreter_only
@pytest.mark.parametrize("fill", [0.0, float("nan"), float("inf"), 1e-30])
def test_fp8_current_kernel_special_amax(fill):
    """amax 0 / NaN / inf give scale 1; a tiny amax overflows the scale to FP32_MAX."""
    x = edge_tensor((33, 50), torch.float32, seed=1) * 1e-38
    x[5, 7] = fill
    if fill == 0.0:
        x.zero_()
    for cfg in CURRENT.values():
        check_against_reference(Float8CurrentScalingQuantizer(**cfg), x)


@interpreter_only
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_fp8_current_kernel_one_direction(rowwise, columnwise):
    got = check_against_reference(Float8CurrentScalingQuantizer(), edge_tensor((40, 72), torch.bfloat16),
                                  rowwise, columnwise)
    assert got.directions() == (("rowwise",) if rowwise else ("columnwise",))


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(64, 64)], ids=str)
def test_fp8_delayed_kernel_bitwise(shape, dtype):
    check_delayed(delayed(), edge_tensor(shape, dtype, seed=2, specials=True))
    check_delayed(delayed(E5M2, margin=1), edge_tensor(shape, dtype, seed=3))


@interpreter_only
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
def test_fp8_rounding_exhaustive(fp8_dtype):
    """Scale 1: the kernel's integer RNE equals torch's saturating cast on every FP8 grid value,
    midpoint, midpoint ± 2**-20 (relative), subnormal and overflow, with NaN and ±inf."""
    v = torch.cat([edge_values(), torch.tensor([float("nan"), float("inf"), float("-inf")])])
    v = torch.cat([v, v * 2**-8, v * 2**-16, v * 2**8])
    x = torch.nn.functional.pad(v, (0, (-v.numel()) % 128)).reshape(-1, 128)
    check_delayed(Float8Quantizer(fp8_dtype), x)


@interpreter_only
def test_fp8_delayed_kernel_accumulates_history():
    """Two quantizations in a step fold into one history slot (max), as the reference does."""
    q = delayed()
    check_delayed(q, edge_tensor((20, 30), torch.float32, seed=4))
    check_delayed(q, edge_tensor((20, 30), torch.float32, seed=5) * 100)


@interpreter_only
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
def test_fp8_tensorwise_kernel_empty(shape):
    check_against_reference(Float8CurrentScalingQuantizer(), torch.empty(shape))
    check_delayed(delayed(), torch.empty(shape))


@interpreter_only
def test_fp8_current_kernel_amax_reduction(monkeypatch):
    """The amax goes through the same reduction function as the reference's (here a stand-in
    for an all-reduce that sees a 4x larger amax on another rank)."""
    fake = lambda amax, group: amax * 4  # noqa: E731
    monkeypatch.setattr(float8_quantizers, "all_reduce_amax", fake)  # reference path
    monkeypatch.setattr(fast_glue, "all_reduce_amax", fake)  # kernel path
    q = Float8CurrentScalingQuantizer(with_amax_reduction=True, amax_reduction_group=object())
    check_against_reference(q, edge_tensor((33, 50), torch.bfloat16))


@interpreter_only
def test_fp8_tensorwise_dispatch_hybrid(monkeypatch):
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    x = edge_tensor((24, 48), torch.bfloat16, seed=9)
    q = HybridQuantizer(Float8CurrentScalingQuantizer(), delayed(E5M2), "rowwise_dequantized")
    ref = q.copy()
    got = q.quantize(x)
    with policy(quantize_kernels=False):
        want = ref.quantize(x)
    for d in ("rowwise", "columnwise"):
        assert_storage_bitwise(got.qstorage.part(d), want.qstorage.part(d), d)
    assert_tensor_bitwise(q.columnwise_quantizer.amax_history, ref.columnwise_quantizer.amax_history, "history")


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("config", ["e4m3", "e5m2_pow2"])
def test_fp8_current_gpu_bitwise(config, shape):
    check_gpu(Float8CurrentScalingQuantizer(**CURRENT[config]), gpu_input(shape, torch.bfloat16, specials=True))


@interpreter_only
@pytest.mark.parametrize("tile", [(64, 64), (32, 64), (128, 64)], ids=str)
def test_fp8_current_kernel_tiles(tile):
    """Tiles other than the default (the GPU shape sweep's candidates), both copies, bitwise."""
    from hybridfp.kernels import _common, triton_fp8_tensorwise
    x = edge_tensor((70, 96), torch.bfloat16, seed=9, specials=True)
    want = Float8CurrentScalingQuantizer().reference_encode(x, True, True)
    rd, cd, sinv, _ = triton_fp8_tensorwise.quantize(x, E4M3, amax=_common.global_amax(x), block=tile, num_warps=2)
    assert_tensor_bitwise(rd, want.payload("rowwise")["data"], "rowwise")
    assert_tensor_bitwise(cd, want.payload("columnwise")["data"], "columnwise")
    assert_tensor_bitwise(sinv, want.payload("rowwise")["scale_inv"], "scale_inv")


@gpu
@pytest.mark.parametrize("tile", [((64, 64), 4), ((32, 64), 2), ((64, 64), 2), ((32, 64), 4), ((128, 64), 4),
                                  ((128, 64), 8), ((64, 128), 4), ((32, 128), 4), ((64, 128), 8)], ids=str)
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 4160)], ids=str)
def test_fp8_current_gpu_tiles(shape, tile):
    """Each of these tiles (``block`` / ``num_warps`` are public), both copies and each alone,
    bitwise the reference, outputs poisoned (a partial last row tile at 1000 rows)."""
    from hybridfp.kernels import _common, triton_fp8_tensorwise
    x = gpu_input(shape, torch.bfloat16, specials=True)
    q = Float8CurrentScalingQuantizer(E5M2)
    want = q.reference_encode(x, True, True)
    amax = _common.global_amax(x)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        with _common.poisoned_outputs():
            rd, cd, sinv, _ = triton_fp8_tensorwise.quantize(x, E5M2, amax=amax, block=tile[0], num_warps=tile[1],
                                                             rowwise=rowwise, columnwise=columnwise)
        for got, d in ((rd, "rowwise"), (cd, "columnwise")):
            if got is not None:
                assert_tensor_bitwise(got, want.payload(d)["data"], f"{tile} {d}")
        assert_tensor_bitwise(sinv, want.payload("rowwise")["scale_inv"], f"{tile} scale_inv")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fp8_current_gpu_dtypes(dtype):
    check_gpu(Float8CurrentScalingQuantizer(), gpu_input((4096, 4096), dtype))
    check_gpu(Float8CurrentScalingQuantizer(), gpu_input((4096, 4096), dtype), True, False)


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_fp8_delayed_gpu_bitwise(shape):
    q = delayed()
    q._state_to(torch.device("cuda"))
    x = gpu_input(shape, torch.bfloat16, specials=True)
    ref = q.copy()
    check_gpu(q, x)
    ref.reference_encode(x, True, True)
    assert_tensor_bitwise(q.amax_history, ref.amax_history, "amax history")
