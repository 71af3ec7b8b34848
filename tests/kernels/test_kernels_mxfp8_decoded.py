"""MXFP8 copies written as their BF16 decodes (``triton_mxfp8.quantize(decoded=True)``, the
quantizer's ``hold_decoded``) vs the reference encode decoded by ``DecodedStorage.of``, bitwise.

CPU: interpreter, awkward shapes, edge values (FP8 grid points and midpoints, subnormals, NaN,
±inf), blocks whose E8M0 scale is so small that products fall on FP32's and BF16's subnormal
grids (the double rounding of ``dequantize_1d(...).to(bfloat16)``), each direction alone, the
row-mapped copy of zero-padded groups, empty inputs. GPU (``-m gpu``): real shapes through the
registry with poisoned outputs.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, EMPTY_SHAPES, GPU_SHAPES, SHAPES, assert_storage_bitwise,  # noqa: E402
                                   edge_tensor, gpu, gpu_input, interpreter_only, run_kernel)

from hybridfp.kernels import triton_mxfp8  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import MXFP8Quantizer, NVFP4Quantizer, fast  # noqa: E402
from hybridfp.quantizers.backends import ReferenceQuantizeWarning, select_quantize_kernel  # noqa: E402
from hybridfp.tensors import DecodedMXFP8Storage, DecodedStorage  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

CONFIGS = {
    "e4m3_rceil": dict(fp8_dtype=torch.float8_e4m3fn),
    "e5m2_floor": dict(fp8_dtype=torch.float8_e5m2, scale_rule="floor"),
}


BOTH = ("rowwise", "columnwise")


def _decoding(**kw) -> MXFP8Quantizer:
    q = MXFP8Quantizer(**kw)
    q.hold_decoded = BOTH
    return q


def check_decoded(q: MXFP8Quantizer, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True,
                  what: str = "") -> DecodedStorage:
    """The kernel's decoded storage equals the reference encode's decode, bit for bit."""
    want = DecodedStorage.of(q.reference_encode(x, rowwise, columnwise))
    got = run_kernel(q, x, rowwise, columnwise)
    assert type(got) is DecodedMXFP8Storage
    assert_storage_bitwise(got, want, what or repr(q))
    return got


@interpreter_only
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)], ids=["both", "row", "col"])
@pytest.mark.parametrize("shape", SHAPES + [(33, 70)], ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_decoded_bitwise(config, shape, rowwise, columnwise):
    """Every input dtype, each direction alone and both, edge values with NaN / inf."""
    for dtype in DTYPES:
        x = edge_tensor(shape, dtype, seed=len(shape) + shape[-1], specials=True)
        got = check_decoded(_decoding(**CONFIGS[config]), x, rowwise, columnwise, what=f"{config} {dtype}")
        assert got.directions() == tuple(d for d, on in zip(BOTH, (rowwise, columnwise)) if on)


@interpreter_only
@pytest.mark.parametrize("config", CONFIGS)
def test_decoded_tiny_scales(config):
    """Blocks of magnitude 2**-110 .. 2**-135: E8M0 bytes near 0, products subnormal in FP32 and
    BF16 (the reference rounds twice), next to ordinary blocks in the same tile."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64)
    x = x * torch.pow(2.0, -torch.arange(110, 142, dtype=torch.float64).repeat(4))[None, :]
    x[:, :8] = torch.randn(64, 8, generator=g, dtype=torch.float64)  # one normal block per row
    q = _decoding(**CONFIGS[config])
    got = check_decoded(q, x.float())
    sub = got.payload("rowwise")["data"].view(torch.int16) & 0x7F80
    assert ((sub == 0) & (got.payload("rowwise")["data"] != 0)).any()  # BF16 subnormals were written


@interpreter_only
def test_decoded_row_map():
    """The row-mapped columnwise copy of zero-padded groups (grouped dy) and the source's own
    rowwise copy, decoded in one pass, equal the reference of the gathered rows."""
    x = edge_tensor((45, 64), torch.bfloat16, seed=7, specials=True)
    row_map = torch.tensor(list(range(20)) + [-1] * 12 + list(range(20, 45)) + [-1] * 7, dtype=torch.int32)
    gathered = torch.zeros(row_map.shape[0], 64, dtype=x.dtype)
    gathered[row_map >= 0] = x[row_map[row_map >= 0].long()]
    q = _decoding()
    rows, cols = fast._mxfp8_row_mapped_run(q, x, row_map, True)
    assert_storage_bitwise(rows, DecodedStorage.of(q.reference_encode(x, True, False)), "rows")
    assert_storage_bitwise(cols, DecodedStorage.of(q.reference_encode(gathered, False, True)), "cols")


@interpreter_only
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
def test_decoded_empty(shape):
    q = _decoding()
    got = q.encode(torch.empty(shape, dtype=torch.bfloat16), True, True)
    assert type(got) is DecodedMXFP8Storage and got.payload("columnwise")["data"].shape == shape[::-1]


def test_decoded_refusals():
    with pytest.raises(ValueError, match="slices"):
        triton_mxfp8.quantize(torch.ones(32, 32), torch.float8_e4m3fn, block_2d=True, decoded=True)
    with pytest.raises(ValueError, match="slices"):
        triton_mxfp8.quantize(torch.ones(32, 32), torch.float8_e4m3fn, method="natural", decoded=True)
    for q, want in ((MXFP8Quantizer(with_2d_quantization=True), BOTH), (NVFP4Quantizer(), BOTH),
                    (MXFP8Quantizer(), ("rowwise",))):  # one storage: both copies decoded or none
        with pytest.raises(ValueError, match="cannot hold its"):
            q.hold_decoded = want
        q.hold_decoded = ()  # allowed: the default
    with pytest.raises(ValueError, match="direction"):
        MXFP8Quantizer().hold_decoded = ("forward",)


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_decoded_gpu_bitwise(config, shape, rowwise, columnwise):
    x = gpu_input(shape, torch.bfloat16, specials=True)
    q = _decoding(**CONFIGS[config])
    assert select_quantize_kernel(q, x, rowwise, columnwise) is fast.KERNELS[MXFP8Quantizer]
    want = DecodedStorage.of(q.reference_encode(x, rowwise, columnwise))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceQuantizeWarning)
        with poisoned_outputs(0x7F):
            got = q.encode(x, rowwise, columnwise)
    torch.cuda.synchronize()
    assert_storage_bitwise(got, want, f"{config} {shape}")


@gpu
def test_decoded_gpu_tiny_scales_and_row_map():
    """Subnormal products and the row-mapped copy on the GPU (no flush to zero)."""
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(4096, 4096, device="cuda", generator=g)
    x = (x * torch.pow(2.0, -torch.arange(100, 132, device="cuda", dtype=torch.float32).repeat(128))[None, :])
    x = x.to(torch.bfloat16)
    q = _decoding()
    want = DecodedStorage.of(q.reference_encode(x, True, True))
    with poisoned_outputs(0x7F):
        got = q.encode(x, True, True)
    assert_storage_bitwise(got, want, "tiny scales")
    y = gpu_input((8000, 4096), torch.bfloat16, specials=True)
    keep = torch.randperm(8000 + 500, device="cuda")
    row_map = torch.full((8500,), -1, dtype=torch.int32, device="cuda")
    row_map[keep[:8000]] = torch.arange(8000, dtype=torch.int32, device="cuda")
    gathered = torch.zeros(8500, 4096, dtype=y.dtype, device="cuda")
    gathered[row_map >= 0] = y[row_map[row_map >= 0].long()]
    with poisoned_outputs(0x7F):
        rows, cols = fast._mxfp8_row_mapped_run(q, y, row_map, True)
    assert_storage_bitwise(rows, DecodedStorage.of(q.reference_encode(y, True, False)), "rows")
    assert_storage_bitwise(cols, DecodedStorage.of(q.reference_encode(gathered, False, True)), "cols")
