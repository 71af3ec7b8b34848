"""``kernels/triton_split_rht.py``: the inverse RHT + exact BF16 split of an RHT operand in one
pass, against the PyTorch path it replaces on CUDA (``formats.rht.apply_inverse_rht`` then
``split_bf16.split3`` / ``exact_parts``).

Inputs are NVFP4-structured RHT-domain values (an E2M1 value times one power-of-two or E4M3
scale per 16-element tile, as an NVFP4-RHT copy decodes), for which every partial sum of the
transform is exact in FP32, so the kernel's dot and PyTorch's butterfly give the same values.
The parts are compared as values: a zero's sign follows the order of the transform's
additions (x + (-x) = +0, then times the sign -1), which differs between the two; no
product or sum of the GEMM depends on it except the sign of an exact-zero result. Flags are
compared exactly. CPU: the interpreter at small shapes; GPU (``-m gpu``): real shapes."""

from __future__ import annotations

import pytest
import torch

from hybridfp.formats import rht
from hybridfp.gemm import split_bf16

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _rht_domain_values(rows: int, kp: int, g: torch.Generator, exps: tuple[int, int] = (-8, 8),
                       device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[rows, kp] values q * s: q a signed E2M1 value, s one E4M3-like scale per 16-tile
    (a 4-bit significand times 2**e, e in ``exps``)."""
    q = E2M1[torch.randint(0, 8, (rows, kp), generator=g)] * (1 - 2 * torch.randint(0, 2, (rows, kp), generator=g))
    mant = torch.randint(8, 16, (rows, kp // 16, 1), generator=g).float() / 8
    e = torch.randint(exps[0], exps[1] + 1, (rows, kp // 16, 1), generator=g).float()
    s = (mant * torch.exp2(e)).expand(rows, kp // 16, 16).reshape(rows, kp)
    return (q * s).to(dtype).to(device)


def _torch_split(y: torch.Tensor, k: int):
    v = rht.apply_inverse_rht(y.float(), k)
    hi, mid, lo = split_bf16.split3(v)
    exact = bool((((hi.float() + mid.float()) + lo.float()) == v).all())
    return hi, mid, lo, [int(not exact), int(bool(mid.ne(0).any())), int(bool(lo.ne(0).any()))]


def _check(y: torch.Tensor, k: int) -> list[int]:
    from hybridfp.kernels.triton_split_rht import inverse_rht_split

    parts, flags = inverse_rht_split(y, k)
    hi, mid, lo, ref_flags = _torch_split(y, k)
    assert parts.shape == (y.shape[0], 3 * k) and parts.dtype == torch.bfloat16
    for got, ref in ((parts[:, :k], hi), (parts[:, k:2 * k], mid), (parts[:, 2 * k:], lo)):
        same = (got == ref) | (got.isnan() & ref.isnan())  # as values (see the module doc)
        assert bool(same.all()), f"{int((~same).sum())} elements differ"
    assert flags.tolist() == ref_flags
    return ref_flags


@pytest.mark.parametrize("rows, k", [(1, 16), (33, 70), (40, 130), (7, 256), (64, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_pytorch_split(rows, k, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    kp = -(-k // 16) * 16
    flags = _check(_rht_domain_values(rows, kp, g, dtype=dtype), k)
    assert flags[0] == 0  # NVFP4-RHT values: exact in hi + mid
    assert flags[1] == 1 or rows * k < 512  # mid holds bits somewhere once there are enough values


def test_tiny_values_flag_an_inexact_split():
    """Scales near 2**-125: ``lo`` would need bits under BF16's subnormal grid."""
    g = torch.Generator().manual_seed(3)
    y = _rht_domain_values(8, 64, g, exps=(-128, -120), dtype=torch.float32)
    assert _check(y, 64)[0] == 1


def test_nan_and_inf_flag_an_inexact_split():
    g = torch.Generator().manual_seed(4)
    for bad in (float("nan"), float("inf")):
        y = _rht_domain_values(4, 32, g)
        y[2, 17] = bad
        assert _check(y, 30)[0] == 1


def test_zero_rows_or_width_and_bad_shapes():
    from hybridfp.kernels.triton_split_rht import inverse_rht_split

    parts, flags = inverse_rht_split(torch.zeros(0, 32, dtype=torch.bfloat16), 30)
    assert parts.shape == (0, 90) and flags.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="multiple of 16"):
        inverse_rht_split(torch.zeros(4, 30, dtype=torch.bfloat16), 30)
    with pytest.raises(ValueError, match="k=10 does not fit"):
        inverse_rht_split(torch.zeros(4, 32, dtype=torch.bfloat16), 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, k", [(4096, 4096), (1000, 14330)])
def test_equals_the_pytorch_split_cuda(rows, k):
    g = torch.Generator().manual_seed(k)
    y = _rht_domain_values(rows, -(-k // 16) * 16, g, device="cuda")
    flags = _check(y, k)
    assert flags[0] == 0
