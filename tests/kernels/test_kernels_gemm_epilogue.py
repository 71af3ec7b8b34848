"""The Triton GEMM epilogue (``hybridfp.kernels.triton_epilogue``) equals ``emulate``'s epilogue
bit for bit: ``acc * (sa * sb) (+ bias)`` in FP32, then one cast, or ``accumulate_into +``
that — for every kind of scale (none, 0-d, per row / column), with and without bias, into
FP32 / BF16 / FP16 (fresh outputs and strided accumulators).

CPU under ``TRITON_INTERPRET=1``; the GPU case (``-m gpu``) uses a large accumulator.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from quantize_kernel_cases import gpu, interpreter_only

from hybridfp.gemm import emulate
from hybridfp.gemm.backends import epilogue
from hybridfp.kernels import triton_epilogue
from hybridfp.kernels._common import poisoned_outputs
from hybridfp.tensors.storage import GemmOperand

# NaN / inf / overflow inputs are deliberate; numpy (the interpreter) warns about them.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
M, N = 37, 150


def _acc(m: int, n: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(m * n)
    a = torch.randn(m, n, generator=g, device=device) * 1e3
    a[0, :3] = torch.tensor([float("nan"), float("inf"), 3.4e38])  # NaN, inf, BF16 overflow
    return a


def _scale(kind: str, n: int, device: str = "cpu"):
    if kind == "none":
        return None
    if kind == "scalar":
        return torch.tensor(1.0 / 3.0, device=device)
    return torch.rand(n, device=device) + 0.5


def _reference(acc, sa, sb, bias, out_dtype, into):
    """``hybridfp.gemm.emulate``'s epilogue (``backends.epilogue``) on the accumulator."""
    return epilogue(acc, GemmOperand(acc, sa, 0), GemmOperand(acc, sb, 0), out_dtype, bias, into)


def test_reference_is_emulates_epilogue():
    """The reference above is emulate's: an identity-valued GEMM through emulate agrees."""
    acc = torch.randn(5, 7)
    sa, sb, bias = torch.rand(5) + 0.5, torch.tensor(0.3), torch.randn(7)
    a, b = GemmOperand(acc, sa, 7), GemmOperand(torch.eye(7), sb, 7)
    assert torch.equal(emulate(a, b, torch.bfloat16, bias), _reference(acc, sa, sb, bias, torch.bfloat16, None))


def _check(acc, sa, sb, bias, out_dtype, accumulate: bool, device: str = "cpu"):
    m, n = acc.shape
    into = into_ref = None
    if accumulate:
        base = torch.randn(n, m + 3, device=device).t()[:m]  # strided [m, n]
        into, into_ref = base.to(out_dtype), base.to(out_dtype)
    want = _reference(acc, sa, sb, bias, out_dtype, into_ref)
    with poisoned_outputs():
        got = triton_epilogue.epilogue(acc, sa, sb, bias, out_dtype, into)
    assert got.dtype == want.dtype and got.shape == want.shape
    if accumulate:
        assert got is into
    same = got.contiguous().view(torch.uint8) == want.contiguous().view(torch.uint8)
    assert bool(same.all()), f"{int((~same).sum())} bytes differ"


KINDS = ["none", "scalar", "vector"]
CASES = list(itertools.product(KINDS, KINDS, [False, True], [torch.float32, torch.bfloat16, torch.float16],
                               [False, True]))


@interpreter_only
@pytest.mark.parametrize("ka, kb, with_bias, out_dtype, accumulate", CASES, ids=str)
def test_epilogue_matches_emulate(ka, kb, with_bias, out_dtype, accumulate):
    acc = _acc(M, N)
    bias = torch.randn(N).to(torch.bfloat16) if with_bias else None
    _check(acc, _scale(ka, M), _scale(kb, N), bias, out_dtype, accumulate)


@interpreter_only
def test_epilogue_writes_into_out():
    """``out``: the result lands in the given rows of a larger buffer (the grouped per-expert
    path's joined output), bit for bit a fresh result's, and nothing around them changes; a
    wrong ``out``, or ``out`` with ``accumulate_into``, is refused by name."""
    acc, sa, bias = _acc(M, N), _scale("vector", M), torch.randn(N)
    for dtype in (torch.bfloat16, torch.float32):
        fresh = triton_epilogue.epilogue(acc, sa, None, bias, dtype)
        buf = torch.full((M + 5, N), float("nan"), dtype=dtype)
        dst = buf[2:2 + M]
        assert triton_epilogue.epilogue(acc, sa, None, bias, dtype, out=dst) is dst
        assert torch.equal(dst.view(torch.uint8), fresh.view(torch.uint8))
        assert bool(buf[:2].isnan().all()) and bool(buf[2 + M:].isnan().all())
        wide = torch.full((M + 5, N + 7), float("nan"), dtype=dtype)  # row stride != n
        dst = wide[2:2 + M, 3:3 + N]
        assert triton_epilogue.epilogue(acc, sa, None, bias, dtype, out=dst) is dst
        assert torch.equal(dst.contiguous().view(torch.uint8), fresh.view(torch.uint8))
        dst.fill_(0)
        assert bool(wide.isnan().sum() == wide.numel() - M * N)
    with pytest.raises(ValueError, match="out must be"):
        triton_epilogue.epilogue(acc, None, None, None, torch.bfloat16, out=torch.empty(M, N))
    with pytest.raises(ValueError, match="accumulate_into"):
        into = torch.zeros(M, N, dtype=torch.bfloat16)
        triton_epilogue.epilogue(acc, None, None, None, torch.bfloat16, into, out=into)


@interpreter_only
def test_epilogue_empty_and_bad_scale():
    out = triton_epilogue.epilogue(torch.empty(0, 5), None, None, None, torch.bfloat16)
    assert out.shape == (0, 5)
    with pytest.raises(ValueError, match="scale_a"):
        triton_epilogue.epilogue(torch.zeros(4, 5), torch.ones(3), None, None, torch.bfloat16)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_epilogue_matches_emulate(out_dtype):
    acc = torch.randn(4097, 1031, device="cuda") * 1e3
    sa, sb = torch.rand(4097, device="cuda") + 0.5, torch.tensor(0.37, device="cuda")
    bias = torch.randn(1031, device="cuda")
    _check(acc, sa, sb, bias, out_dtype, False, "cuda")
    _check(acc, sa, None, None, out_dtype, True, "cuda")


@gpu
def test_gpu_epilogue_bf16_special_values():
    """The epilogue kernel's BF16 store (the hardware conversion on the GPU) on the delicate
    values of :func:`_bf16_store_cases` (ties, subnormals, overflow, NaNs, ±inf), alone and with
    a unit scale and a zero bias (same values), equals emulate's epilogue bit for bit."""
    acc = _bf16_store_cases("cuda").reshape(-1, 4)
    _check(acc, None, None, None, torch.bfloat16, False, "cuda")
    _check(acc, torch.ones(acc.shape[0], device="cuda"), None, torch.zeros(4, device="cuda"), torch.bfloat16,
           False, "cuda")


def _bf16_store_cases(device: str) -> torch.Tensor:
    """FP32 values whose BF16 rounding is delicate: ties (even / odd), just above / below ties,
    FP32 subnormals, the largest finite values (round up to inf), ±inf, NaNs of both signs and
    payloads, zeros of both signs, plus random values over the whole exponent range."""
    bits = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,
            0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
            0x7F800001, 0x7FBFFFFF, 0x00000000, 0x80000000]
    g = torch.Generator().manual_seed(3)
    rnd = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 16,), generator=g, dtype=torch.int64)
    return torch.cat([torch.tensor(bits, dtype=torch.int64), rnd]).to(torch.int32).view(torch.float32).to(device)


@gpu
def test_gpu_hardware_bf16_store_is_bitwise_the_integer_rounding():
    """``store_out``'s hardware BF16 path (HW=True: the grouped GEMMs' epilogues) writes the same
    bits as its integer round-to-nearest-even path, and as torch's own cast, for every value
    class (NaNs become torch's NaN bits either way)."""
    import triton
    import triton.language as tl

    from hybridfp.kernels._common_encode import bf16_nan16

    @triton.jit
    def store(v_ptr, out_ptr, n, NAN16: tl.constexpr, HW: tl.constexpr):
        i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
        v = tl.load(v_ptr + i, mask=i < n, other=0.0)
        triton_epilogue.store_out(out_ptr + i, v, i < n, 1, NAN16, HW)

    v = _bf16_store_cases("cuda")
    outs = []
    for hw in (False, True):
        out = torch.full((v.numel(),), 0x5A5A, dtype=torch.int16, device="cuda")  # poisoned
        store[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), NAN16=bf16_nan16(v.device), HW=hw)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1], v.to(torch.bfloat16).view(torch.int16))
