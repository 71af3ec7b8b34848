"""``grouped_bf16.per_group_mm``: path 1's grouped matmul as one ``torch.mm`` per group (cuBLAS on
CUDA), ``torch._grouped_mm``'s semantics (BF16 in, FP32 accumulation, one rounding; zeros for an
empty reduction group), the CUDA default for few large groups (``grouped.per_group_wins``;
``grouped.BF16_PER_GROUP_CUBLAS`` forces either way).

Bitwise checks use small-integer operands: every product and partial sum is an integer far
below 2**24, exact in FP32 in any order, so every correct FP32-accumulating GEMM (the reference
emulation, CPU ``torch.mm``, cuBLAS) gives the same BF16 bits. On random MXFP8 operands the
per-expert ``gemm`` loop and ``per_group_mm`` differ only in FP32 summation order: within one
BF16 rounding (2**-8 relative, norm-wise) of each other.
"""

from __future__ import annotations

import pytest
import torch
from test_gemm_grouped import ODD, OPERANDS, per_expert, quantized

from hybridfp import current_policy
from hybridfp.moe import gemm as grouped, grouped_gemm
from hybridfp.moe.gemm import reference_grouped_mm
from hybridfp.moe.gemm_bf16 import per_group_mm
from hybridfp.kernels._common import poisoned_outputs


def _ints(shape: tuple[int, ...], g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return torch.randint(-4, 5, shape, generator=g).to(device=device, dtype=torch.bfloat16)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("sizes", [[3, 0, 7, 1], [0, 0, 5], [4]])
def test_rows_grouped_bitwise_on_exact_sums(sizes):
    """2D x 3D: group g's rows times ``mat_b[g]``, each row written once into one result."""
    g = torch.Generator().manual_seed(1)
    a, b = _ints((sum(sizes), 40), g), _ints((len(sizes), 40, 24), g)
    got = per_group_mm(a, b, sizes)
    assert got.dtype == torch.bfloat16 and got.shape == (sum(sizes), 24)
    assert torch.equal(got, reference_grouped_mm(a, b, sizes))


@pytest.mark.parametrize("sizes", [[3, 0, 7, 1], [0, 8], [5]])
def test_reduction_grouped_bitwise_and_zero_groups(sizes):
    """2D x 2D: group g's slice of the reduction; an empty group is zeros (the result is
    poisoned before the GEMMs: an unwritten element shows)."""
    g = torch.Generator().manual_seed(2)
    a, b = _ints((16, sum(sizes)), g), _ints((sum(sizes), 24), g)
    with poisoned_outputs():
        got = per_group_mm(a, b, sizes)
    assert got.shape == (len(sizes), 16, 24)
    assert torch.equal(got, reference_grouped_mm(a, b, sizes))
    for e, k in enumerate(sizes):
        if k == 0:
            assert torch.equal(got[e], torch.zeros(16, 24, dtype=torch.bfloat16))


@pytest.mark.parametrize("layout", list(OPERANDS))
def test_grouped_gemm_with_per_group_mm(layout):
    """Through ``grouped_gemm``'s path 1 (MXFP8 experts, an empty one, odd sizes): within one BF16
    rounding of the per-expert ``gemm`` loop (only the FP32 summation order differs)."""
    ops = quantized(["mxfp8_1d"] * 4, ODD)
    wa, wb = OPERANDS[layout]
    got = grouped_gemm(ops[wa], ops[wb], layout, grouped_mm=per_group_mm)
    want = per_expert(ops[wa], ops[wb], layout)
    pairs = zip(got, want) if layout == "NT" else [(got, want)]
    for g_, w_ in pairs:
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        if w_.numel():
            assert _rel(g_, w_) < 2 ** -8


def test_exact_settings_and_bad_sizes(monkeypatch):
    """Every ``torch.mm`` runs with cuBLAS's BF16 split-K reduction off and autocast off, even
    when the caller has both on (the CPU ignores the flag: recorded, not inferred from bits);
    sizes that do not describe the groups are refused."""
    seen = []
    real_mm = torch.mm

    def mm(*args, **kw):
        seen.append((torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                     torch.is_autocast_enabled("cpu")))
        return real_mm(*args, **kw)
    g = torch.Generator().manual_seed(4)
    a, b = _ints((9, 16), g), _ints((2, 16, 8), g)
    flags = torch.backends.cuda.matmul  # a module-like object: set and restored by hand
    old = flags.allow_bf16_reduced_precision_reduction
    monkeypatch.setattr(torch, "mm", mm)
    try:
        flags.allow_bf16_reduced_precision_reduction = True
        with torch.autocast("cpu", dtype=torch.float16):
            per_group_mm(a, b, [4, 5])
            per_group_mm(a.t().contiguous(), _ints((9, 8), g), [4, 5])
        assert flags.allow_bf16_reduced_precision_reduction  # restored after
    finally:
        flags.allow_bf16_reduced_precision_reduction = old
    assert seen == [(False, False)] * 4
    for bad in ([4, 4], [10, -1], [9]):
        with pytest.raises(ValueError, match="group sizes"):
            per_group_mm(a, b, bad)


def test_switch_selects_per_group_mm(monkeypatch, set_policy):
    """``torch_grouped_mm`` (path 1's default matmul) takes ``per_group_mm`` when the switch is on."""
    calls = []
    monkeypatch.setattr(grouped, "per_group_mm", lambda *a: calls.append(a[2]) or per_group_mm(*a))
    set_policy(bf16_per_group_cublas=True)
    g = torch.Generator().manual_seed(3)
    a, b = _ints((9, 16), g), _ints((2, 16, 8), g)
    assert torch.equal(grouped.torch_grouped_mm(a, b, [4, 5]), reference_grouped_mm(a, b, [4, 5]))
    assert calls == [[4, 5]]


def test_size_rule_picks_per_group_for_few_large_groups(monkeypatch, set_policy):
    """The default (switch None) takes cuBLAS per group for few large groups (8 experts of 4096
    rows on average, empty ones allowed) and CUTLASS's grouped kernel for many or small groups
    and for operands recording autograd (``per_group_mm`` writes ``out=`` slices); the switch
    forces either way."""
    assert current_policy().bf16_per_group_cublas is None
    wins = grouped.per_group_wins
    assert wins([4096, 0, 16, 5072, 6000, 32, 8192, 9360]) and wins([2048] * 16)
    assert not wins([1024] * 32) and not wins([1024] * 8) and not wins([512] * 64) and not wins([2048] * 17) and not wins([]) and not wins([0, 0])
    calls = []
    monkeypatch.setattr(grouped, "per_group_mm", lambda *a: calls.append(a[2]) or per_group_mm(*a))
    set_policy(per_group_min_mean=4)  # tiny CPU groups count as large
    g = torch.Generator().manual_seed(5)
    a, b = _ints((9, 16), g), _ints((2, 16, 8), g)
    assert torch.equal(grouped.torch_grouped_mm(a, b, [4, 5]), reference_grouped_mm(a, b, [4, 5]))
    assert calls == [[4, 5]]
    ag = a.clone().requires_grad_()
    y = grouped.torch_grouped_mm(ag, b, [4, 5])  # recording autograd: torch._grouped_mm
    assert calls == [[4, 5]] and y.requires_grad
    y.float().sum().backward()
    assert ag.grad is not None and ag.grad.shape == ag.shape
    set_policy(per_group_min_mean=5)  # mean 4.5: too small now
    assert torch.equal(grouped.torch_grouped_mm(a, b, [4, 5]), reference_grouped_mm(a, b, [4, 5]))
    assert calls == [[4, 5]]
    set_policy(bf16_per_group_cublas=False)
    assert torch.equal(grouped.torch_grouped_mm(a, b, [4, 5]), reference_grouped_mm(a, b, [4, 5]))
    assert calls == [[4, 5]]  # forced off: torch._grouped_mm ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows_grouped", [True, False])
def test_gpu_per_group_mm_equals_grouped_mm_on_exact_sums(rows_grouped):
    """cuBLAS per group and CUTLASS's grouped kernel give the same bits where every FP32 sum is
    exact (integer operands), at MoE-like shapes (an empty group, sizes multiples of 16 as
    ``torch._grouped_mm`` needs); random operands agree within one BF16 rounding."""
    sizes = [512, 0, 1040, 16, 2000]
    seed = int(torch.randint(0, 2**31, (1,)))
    g = torch.Generator().manual_seed(seed)
    makers = {"ints": lambda s: _ints(s, g, "cuda"),
              "randn": lambda s: torch.randn(s, generator=g).bfloat16().cuda()}
    for kind, make in makers.items():
        if rows_grouped:
            a, b = make((sum(sizes), 1024)), make((len(sizes), 1024, 1408))
        else:
            a, b = make((1408, sum(sizes))), make((sum(sizes), 1024))
        got = per_group_mm(a, b, sizes)
        want = torch._grouped_mm(a, b, offs=grouped.offsets(sizes, a.device))
        if not rows_grouped:
            want[1].zero_()  # an empty reduction group: hybridfp zeroes it (grouped_bf16._wgrad_result)
        if kind == "ints":
            assert torch.equal(got, want), f"seed {seed}"
        else:
            assert _rel(got, want) < 2 ** -8, f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_per_group_mm_long_reduction_is_exact():
    """A shape that invites cuBLAS's split-K (one reduction group of 16384 into a 64 x 64
    output, the size rule's kind of group): with integer operands every FP32 partial sum is
    exact (|sum| <= 16384 * 16 < 2**24), so the result must equal the exact sums rounded once to
    BF16 — a split-K reduced in BF16 would round partial sums and differ. Run with the process
    allowing BF16 reduced-precision reductions: ``exact_bf16_gemm`` must turn them off."""
    seed = int(torch.randint(0, 2**31, (1,)))
    g = torch.Generator().manual_seed(seed)
    a, b = _ints((64, 16384), g, "cuda"), _ints((16384, 64), g, "cuda")
    want = (a.double().cpu() @ b.double().cpu()).to(torch.bfloat16)[None]
    saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    try:
        assert grouped.per_group_wins([16384])
        got = per_group_mm(a, b, [16384])
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved
    assert torch.equal(got.cpu(), want), f"seed {seed}"
