"""Tests for hybridfp.formats.rht (numerics §2.5): the 16-point random Hadamard transform."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from hybridfp.formats.rht import (
    RHT_SIGNS,
    apply_inverse_rht,
    apply_rht,
    hadamard16,
    rht_matrix,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]
REFERENCE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def f32(v: float) -> float:
    """Round a Python float to FP32 (a single rounding when ``v`` is exact in double)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def reference_tile(t: list[float]) -> list[float]:
    """The order of numerics §2.5 spelled out in scalar Python with FP32 rounding after every operation."""
    u = [f32(a * s) for a, s in zip(t, REFERENCE_SIGNS)]
    h = 1
    while h < 16:
        for start in range(0, 16, 2 * h):
            for i in range(start, start + h):
                a, b = u[i], u[i + h]
                u[i], u[i + h] = f32(a + b), f32(a - b)
        h *= 2
    return [f32(a * 0.25) for a in u]


def test_signs_and_hadamard() -> None:
    assert list(RHT_SIGNS) == REFERENCE_SIGNS
    h = hadamard16()
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    # Sylvester natural order: H[i, j] = (-1)^popcount(i & j).
    want = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    assert torch.equal(h, want)
    assert torch.equal(h @ h.t(), 16 * torch.eye(16))


def test_rht_matrix_orthogonal() -> None:
    r = rht_matrix()
    signs = torch.tensor(REFERENCE_SIGNS, dtype=torch.float32)
    assert torch.equal(r, torch.diag(signs) @ hadamard16() / 4)
    # Entries are ±1/4, so R Rᵀ sums sixteen ±1/16 terms: exact in FP32 (well inside 1e-6).
    assert (r @ r.t() - torch.eye(16)).abs().max().item() <= 1e-6
    assert torch.equal(r @ r.t(), torch.eye(16))


@pytest.mark.parametrize("device", DEVICES)
def test_butterfly_matches_matrix(device: str) -> None:
    r = rht_matrix().to(device)
    # Small integers: every partial sum is exact, so the butterfly equals t @ R bit for bit.
    ints = torch.randint(-50, 51, (64, 32), generator=gen(0)).float().to(device)
    assert torch.equal(apply_rht(ints), (ints.reshape(64, 2, 16) @ r).reshape(64, 32))
    # Random FP32: both are sums of 16 terms of size |t|/4, each rounded a few times; the
    # butterfly does 4 additions per output, so |err| <= ~5 u sum|t_i|/4 with u = 2**-24.
    x = torch.randn(64, 32, generator=gen(1)).to(device)
    ref = (x.double().reshape(64, 2, 16) @ rht_matrix().double().to(device)).reshape(64, 32)
    tol = 5 * 2**-24 * x.abs().reshape(64, 2, 16).sum(-1, keepdim=True).double() / 4
    assert ((apply_rht(x).double().reshape(64, 2, 16) - ref.reshape(64, 2, 16)).abs() <= tol).all()


def test_fixed_evaluation_order_bitwise() -> None:
    # 12-bit integers times 2**-8..2**8: every sum spans < 40 bits, so the double arithmetic in
    # reference_tile is exact before its single FP32 rounding, while FP32 (24 bits) must round.
    # Only the exact order of numerics §2.5 (signs, butterfly h = 1, 2, 4, 8, then * 0.25) gives every bit.
    g = gen(2)
    mant = torch.randint(-(2**12), 2**12, (8, 16), generator=g).float()
    x = mant * torch.exp2(torch.randint(-8, 9, (8, 16), generator=g).float())
    got = apply_rht(x)
    for row in range(8):
        assert got[row].tolist() == reference_tile(x[row].tolist())
    # A different (matrix) order disagrees somewhere on these inputs, so the test can fail.
    assert not torch.equal(got, x @ rht_matrix())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [1, 15, 17, 50])
def test_padding_kept_and_equals_explicit_zero_pad(device: str, cols: int) -> None:
    x = torch.randn(3, cols, generator=gen(cols)).to(device)
    y = apply_rht(x)
    width = 16 * math.ceil(cols / 16)
    assert y.shape == (3, width) and y.device == x.device
    padded = torch.zeros(3, width, device=device)
    padded[:, :cols] = x
    assert torch.equal(y, apply_rht(padded))
    assert y[:, cols:].abs().sum().item() > 0  # the tail carries energy: it must be kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [5, 16, 50, 77])
def test_wgrad_product_preserved(device: str, m: int) -> None:
    # wgrad dW = dyᵀ x reduces over M; the columnwise copies are dyᵀ [N, M] and xᵀ [K, M] with
    # the transform along M: RHT(dyᵀ) RHT(xᵀ)ᵀ = dyᵀ x even when M is not a multiple of 16.
    dy = torch.randn(m, 24, generator=gen(10 + m)).to(device)
    x = torch.randn(m, 40, generator=gen(20 + m)).to(device)
    got = (apply_rht(dy.t()).double() @ apply_rht(x.t()).double().t())
    want = dy.t().double() @ x.double()
    # Each transformed entry carries ~4u relative error of its tile norm; by Cauchy-Schwarz the
    # product error is <= ~10u |dy_col| |x_col| (column norms); 1e-6 of that product is ample.
    norms = dy.double().norm(dim=0)[:, None] * x.double().norm(dim=0)[None, :]
    assert ((got - want).abs() <= 1e-6 * norms).all()
    # Dropping the padded tail breaks the identity (the test can fail).
    if m % 16:
        cut = apply_rht(dy.t())[:, :m].double() @ apply_rht(x.t())[:, :m].double().t()
        assert ((cut - want).abs() > 1e-3 * norms).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 16), (3, 50), (1, 1), (7, 33)])
def test_inverse_roundtrip(device: str, shape: tuple[int, int]) -> None:
    x = (torch.randn(shape, generator=gen(3)) * 1e3).to(device)
    back = apply_inverse_rht(apply_rht(x), shape[1])
    assert back.shape == shape and back.dtype == torch.float32
    # 8 butterfly levels round trip, each <= u |tile|_1 / 4 per entry: 1e-6 of the tile's
    # largest magnitude (times 16 for the 1-norm) is a loose but failing-capable bound.
    tiles = torch.zeros(shape[0], 16 * math.ceil(shape[1] / 16), device=device)
    tiles[:, : shape[1]] = x.abs()
    scale = tiles.reshape(shape[0], -1, 16).amax(-1).repeat_interleave(16, dim=1)[:, : shape[1]]
    assert ((back - x).abs() <= 1e-6 * scale).all()
    # Small integers scaled by 4 round-trip exactly.
    ints = torch.randint(-8, 9, shape, generator=gen(4)).float().to(device)
    assert torch.equal(apply_inverse_rht(apply_rht(ints), shape[1]), ints)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounds_to_input_dtype(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(6, 40, generator=gen(5)).to(device, dtype)
    y = apply_rht(x)
    assert y.dtype == dtype
    full = apply_rht(x.float())  # FP32 in, FP32 out: no rounding
    assert full.dtype == torch.float32
    assert torch.equal(y, full.to(dtype))  # computed in FP32, rounded once at the end
    assert not torch.equal(y.float(), full)  # the rounding is real
    assert torch.equal(apply_rht(x, out_dtype=torch.float32), full)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device: str) -> None:
    assert apply_rht(torch.zeros(0, 5, device=device)).shape == (0, 16)
    assert apply_rht(torch.zeros(3, 0, device=device)).shape == (3, 0)
    assert apply_inverse_rht(torch.zeros(0, 16, device=device), 5).shape == (0, 5)
    assert apply_inverse_rht(torch.zeros(3, 0, device=device), 0).shape == (3, 0)


def test_input_errors() -> None:
    with pytest.raises(ValueError, match="2D"):
        apply_rht(torch.zeros(2, 3, 16))
    with pytest.raises(TypeError, match="float32"):
        apply_rht(torch.zeros(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="16k"):
        apply_inverse_rht(torch.zeros(2, 20), 20)
    with pytest.raises(ValueError, match="cols"):
        apply_inverse_rht(torch.zeros(2, 32), 16)
