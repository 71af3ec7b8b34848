"""MXFP8 quantize kernel writing the BF16-decoded copies in the same pass
(``triton_mxfp8.quantize_decoded``): codes and scales bitwise ``quantize``'s, decoded copies
bitwise ``triton_decode.decode_mxfp8`` of those codes and the reference dequantize in BF16.

CPU: interpreter, awkward shapes, edge values (NaN, ±inf, subnormals), tiny blocks whose
scale takes the decode's exact integer path, both element types and rules. GPU (``-m gpu``):
16384x4096 and 4096x14336 inputs, outputs poisoned before the launch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import DTYPES, SHAPES, assert_tensor_bitwise, edge_tensor, gpu, gpu_input, interpreter_only  # noqa: E402

from hybridfp import MXFP8Quantizer  # noqa: E402
from hybridfp.formats import mxfp8  # noqa: E402
from hybridfp.gemm import bf16_decode  # noqa: E402
from hybridfp.kernels import triton_decode, triton_mxfp8  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import fast  # noqa: E402
from hybridfp.tensors import COLUMNWISE, ROWWISE, decoded  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BOTH = frozenset({ROWWISE, COLUMNWISE})


def _check(x2: torch.Tensor, dtype: torch.dtype, rule: str, *, reference: bool = True, **kw) -> None:
    """quantize_decoded(x2) against quantize(x2), the decode kernel and (CPU) the reference."""
    row, col, rb, cb = triton_mxfp8.quantize_decoded(x2, dtype, rule=rule, decoded_rowwise=True,
                                                     decoded_columnwise=True, **kw)
    want_row, want_col = triton_mxfp8.quantize(x2, dtype, rule=rule, **kw)
    for (d, s), (wd, ws), what in ((row, want_row, "row"), (col, want_col, "col")):
        assert_tensor_bitwise(d.view(torch.uint8), wd.view(torch.uint8), f"{what} codes")
        assert_tensor_bitwise(s, ws, f"{what} scales")
    for (d, s), got, what in ((row, rb, "row"), (col, cb, "col")):
        assert got.dtype == torch.bfloat16 and got.shape == d.shape, what
        assert_tensor_bitwise(got, triton_decode.decode_mxfp8(d, s), f"{what} decoded vs decode kernel")
        if reference:
            want = mxfp8.dequantize_1d(d, s).to(torch.bfloat16)
            assert_tensor_bitwise(got, want, f"{what} decoded vs reference")


@interpreter_only
@pytest.mark.parametrize("shape", [s for s in SHAPES if len(s) == 2] + [(70, 33)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8,rule", [(E4M3, "rceil"), (E5M2, "floor")], ids=["e4m3_rceil", "e5m2_floor"])
def test_quantize_decoded_bitwise(fp8, rule, dtype, shape):
    x = edge_tensor(shape, dtype, seed=shape[0] * 7 + shape[1], specials=True)
    _check(x, fp8, rule, block=(32, 32))


def _tiny_blocks() -> torch.Tensor:
    """Blocks of magnitude ~2**-140 (E8M0 bytes below BIAS + MBITS: decoded values are FP32
    subnormals rounded again to BF16, the decode kernel's integer path) and blocks of 2**-149
    and 0 next to normal blocks, a NaN, an inf."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 160, generator=g) * 2.0 ** -140
    x[:, 64:96] = torch.randn(64, 32, generator=g)
    x[:32, 96:128] = 2.0 ** -149
    x[32:, 96:128] = 0.0
    x[5, 70], x[40, 130] = float("nan"), float("inf")
    return x


@interpreter_only
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=str)
def test_quantize_decoded_tiny_blocks_exact_path(fp8):
    _check(_tiny_blocks(), fp8, "rceil", block=(32, 64))


@gpu
@pytest.mark.parametrize("fp8,rule", [(E4M3, "rceil"), (E5M2, "floor")], ids=["e4m3_rceil", "e5m2_floor"])
def test_quantize_decoded_tiny_blocks_gpu(fp8, rule):
    """The GPU's FP32 multiply + BF16 conversion against the decode kernel's integer path and
    the reference, bit for bit, where products are FP32 subnormals (no flush to zero)."""
    x = _tiny_blocks()
    with poisoned_outputs():
        _check(x.cuda(), fp8, rule, block=(32, 64))
        _check(torch.cat([x, -x]).t().contiguous().cuda(), fp8, rule)


@interpreter_only
def test_quantize_decoded_one_direction_and_strided():
    """Only the copies asked for are decoded; a transposed input view; several programs."""
    x = edge_tensor((96, 160), torch.bfloat16, seed=4).t()
    row, col, rb, cb = triton_mxfp8.quantize_decoded(x, E4M3, decoded_columnwise=True, block=(32, 64))
    assert rb is None and row is not None
    assert_tensor_bitwise(cb, triton_decode.decode_mxfp8(*col), "col decoded")
    row, col, rb, cb = triton_mxfp8.quantize_decoded(x, E4M3, columnwise=False, decoded_rowwise=True)
    assert col is None and cb is None
    assert_tensor_bitwise(rb, triton_decode.decode_mxfp8(*row), "row decoded")


@interpreter_only
def test_quantize_decoded_refuses_what_it_cannot_write():
    x = torch.ones(32, 32)
    with pytest.raises(ValueError, match="decoded_rowwise needs rowwise=True"):
        triton_mxfp8.quantize_decoded(x, E4M3, rowwise=False, decoded_rowwise=True)
    with pytest.raises(ValueError, match="1D"):
        triton_mxfp8.quantize_decoded(x, E4M3, block_2d=True, decoded_columnwise=True)
    row, col, rb, cb = triton_mxfp8.quantize_decoded(torch.empty(0, 64), E4M3, decoded_rowwise=True)
    assert rb.shape == (0, 64) and cb is None


@pytest.mark.parametrize("shape", [(48, 64), (33, 80)], ids=str)
@interpreter_only
def test_mxfp8_kernel_keeps_decoded_copies(shape, monkeypatch):
    """Through the registry (device check opened to CPU tensors, kernels interpreted): the kept
    copies are what the GEMM's decode returns, bitwise, and the GEMM's decode hands them out;
    an in-place change of the payload invalidates them."""
    monkeypatch.setattr(fast, "_device_ok", lambda x: True)
    q = MXFP8Quantizer()
    q.decoded_copies = BOTH
    s = q.quantize(edge_tensor(shape, torch.bfloat16, seed=2, specials=True)).qstorage
    for d in (ROWWISE, COLUMNWISE):
        kept = decoded.recall(s, d)
        assert kept is not None, d
        assert_tensor_bitwise(kept.values, bf16_decode.reference_decode_bf16(s, d).values, d)
        assert bf16_decode.decode_bf16(s, d) is kept
    s.payload(ROWWISE)["data"].view(torch.uint8).add_(0)  # bumps the version
    assert decoded.recall(s, ROWWISE) is None and decoded.recall(s, COLUMNWISE) is not None
    q.decoded_copies = frozenset()
    s2 = q.quantize(edge_tensor(shape, torch.bfloat16, seed=2)).qstorage
    assert decoded.recall(s2, ROWWISE) is None and decoded.recall(s2, COLUMNWISE) is None


@gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (4096, 14336), (1000, 4160)], ids=str)
@pytest.mark.parametrize("fp8,rule", [(E4M3, "rceil"), (E5M2, "floor")], ids=["e4m3_rceil", "e5m2_floor"])
def test_quantize_decoded_gpu_bitwise(fp8, rule, shape):
    x = gpu_input(shape, torch.bfloat16, specials=True)
    with poisoned_outputs():
        _check(x, fp8, rule, reference=shape[0] < 8192)
