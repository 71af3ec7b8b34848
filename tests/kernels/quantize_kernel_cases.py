"""Shared inputs and bitwise checks for the Triton quantize-kernel tests.

CPU (no CUDA): kernels run under ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py) on tiny
shapes; GPU (``-m gpu``): real shapes, fresh random inputs, outputs poisoned before launch.

One documented relaxation, interpreter only: in an NVFP4 block whose E4M3 scale is NaN (the
block holds a NaN, e.g. from inf - inf inside the RHT), the sign bit of a code whose element
is itself NaN depends on which NaN operand the CPU's ``x * encode`` returns: x86 returns the
first, torch's vectorized CPU loops the second, numpy (the interpreter) the first. Those codes
are meaningless (the block dequantizes to NaN) and the GPU gives canonical NaNs, so the GPU
tests compare them exactly; on the CPU the code magnitudes there must still match.

NVFP4 stochastic rounding: the kernels draw their own Philox stream (hybridfp/kernels/
triton_sr.py), so every comparison with the reference runs the reference inside
:func:`kernel_sr_stream`, which feeds it that stream instead of ``torch.rand``: then the
stochastic codes are compared bit for bit as well.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Iterator, Optional

import pytest
import torch
import triton
import triton.language.standard

from hybridfp.formats import nvfp4
from hybridfp.kernels._common import poisoned_outputs
from hybridfp.kernels.triton_sr import reference_draws
from hybridfp.quantizers import fast
from hybridfp.quantizers.backends import ReferenceQuantizeWarning, select_quantize_kernel
from hybridfp.tensors import QuantizedStorage

HAS_CUDA = torch.cuda.is_available()
#: Triton runs in interpreter mode: the variable is set and Triton's own jit functions were
#: decorated under it (they are not when Triton was imported before the variable was set).
INTERPRET = (os.environ.get("TRITON_INTERPRET") == "1"
             and type(triton.language.standard.cdiv).__name__ == "InterpretedFunction")

#: CPU tests: tiny shapes through the interpreter (skipped on the GPU machine, where the
#: kernels are compiled instead).
interpreter_only = pytest.mark.skipif(
    not INTERPRET, reason="CPU kernel tests need Triton in interpreter mode: TRITON_INTERPRET=1 set "
    "before triton is imported (tests/kernels/conftest.py does it without CUDA)")


def gpu(test):
    """Marks a test ``gpu`` and skips it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(test))


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Awkward tiny shapes: partial blocks in both directions, a 3D input, one element.
SHAPES = [(3, 40), (33, 50), (64, 96), (2, 5, 36), (1, 1)]
EMPTY_SHAPES = [(0, 64), (4, 0)]
#: GPU shapes (BF16 activations of a 4096-wide model).
GPU_SHAPES = [(4096, 4096), (16384, 4096)]


def edge_values() -> torch.Tensor:
    """FP32 values that stress rounding: every finite E4M3 / E5M2 / E2M1 value, the midpoints
    between neighbours and a relative 2**-20 either side, FP32 / FP16 / BF16 extremes and
    subnormals, values past each format's max; both signs."""
    grids = []
    for d in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = torch.arange(256, dtype=torch.uint8).view(d).float()
        grids.append(v[torch.isfinite(v)])
    grids.append(torch.tensor(nvfp4.E2M1_VALUES))
    g = torch.cat(grids).abs().unique()
    mid = (g[1:] + g[:-1]) / 2
    extra = torch.tensor([0.0, 1e-40, 1e-42, 2**-126, 2**-127, 2**-149, 3.0e38, 3.4e38, 65504.0,
                          65520.0, 464.0, 480.0, 61440.0, 225.0, 1.0 / 3.0, 2688.0])
    v = torch.cat([g, mid, mid * (1 + 2**-20), mid * (1 - 2**-20), extra])
    return torch.cat([v, -v])


def edge_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, seed: int = 0,
                specials: bool = False) -> torch.Tensor:
    """Normal values with a magnitude spread, half of them replaced by edge values times a
    small power of two; ``specials`` adds NaN, +inf and -inf elements."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    n = x.numel()
    if n:
        ev = edge_values()
        idx = torch.randperm(n, generator=g)[: max(n // 2, 1)]
        pick = ev[torch.randint(0, ev.numel(), (idx.numel(),), generator=g)]
        x.view(-1)[idx] = pick * torch.exp2(torch.randint(-3, 3, (idx.numel(),), generator=g).float())
    x = x.to(dtype)
    if specials and n >= 8:
        flat = x.view(-1)
        flat[idx[:2]] = float("nan")
        flat[idx[2:4]] = float("inf")
        flat[idx[4:5]] = float("-inf")
    return x


def gpu_input(shape: tuple[int, ...], dtype: torch.dtype, *, specials: bool = False) -> torch.Tensor:
    """Fresh random CUDA input (seeded from os.urandom, so every run differs; never zeros):
    normal values with per-row and per-column magnitude spread (2**-8 .. 2**7), so misplaced
    block scales show; ``specials`` sprinkles edge values, NaN (both signs, quiet with a
    payload) and ±inf."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows, cols = shape[0], shape[-1]
    x = torch.randn(shape, generator=g, device="cuda")
    x *= torch.exp2(torch.randint(-4, 4, (rows, 1), generator=g, device="cuda").float())
    x *= torch.exp2(torch.randint(-4, 4, (1, cols), generator=g, device="cuda").float())
    if specials:
        ev = edge_values().cuda()
        flat = x.view(-1)
        idx = torch.randint(0, x.numel(), (4096,), generator=g, device="cuda")
        flat[idx] = ev[torch.randint(0, ev.numel(), (4096,), generator=g, device="cuda")]
        flat[idx[:3]] = torch.tensor([float("nan"), float("inf"), float("-inf")], device="cuda")
        # -NaN and a NaN with low payload bits: the kernels must give the reference's bytes
        # whatever NaN the input holds (hardware FP8 conversion, _common_encode._hw_fp8_code)
        flat[idx[3:5]] = torch.tensor([0xFFC00000, 0x7F800001], dtype=torch.int64,
                                      device="cuda").to(torch.int32).view(torch.float32)
    return x.to(dtype)


@contextmanager
def kernel_sr_stream() -> Iterator[None]:
    """Inside the block, ``formats.nvfp4``'s stochastic rounding draws the kernels' Philox
    stream (``triton_sr.reference_draws`` keyed by the per-direction generator's seed, which
    ``NVFP4Quantizer._sr`` sets to the stream key) instead of ``torch.rand``."""
    orig = nvfp4._draws

    def draws(x, stochastic_rounding, rand, generator):
        if stochastic_rounding and rand is None and generator is not None:
            rand = reference_draws(generator.initial_seed(), tuple(x.shape), x.device)
        return orig(x, stochastic_rounding, rand, generator)

    nvfp4._draws = draws
    try:
        yield
    finally:
        nvfp4._draws = orig


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _nan_block_mask(scale: torch.Tensor, rows: int, cols: int, block_2d: bool) -> torch.Tensor:
    """[rows, cols] mask of the NVFP4 elements whose block's E4M3 scale is NaN."""
    nan = (scale.view(torch.uint8) & 0x7F) == 0x7F
    if block_2d:
        nan = nan.repeat_interleave(nvfp4.BLOCK, dim=0)
    return nan.repeat_interleave(nvfp4.BLOCK, dim=1)[:rows, :cols]


def assert_tensor_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bytes; FP32 tensors (amaxes, scales) may differ only in the payload
    of a NaN (both NaN at the same places)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype == torch.float32:
        g, w = got.detach().cpu(), want.detach().cpu()
        same = (g.view(torch.int32) == w.view(torch.int32)) | (g.isnan() & w.isnan())
        assert bool(same.all()), f"{what}: {int((~same).sum())} FP32 values differ"
        return
    diff = _bits(got) != _bits(want)
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} of {diff.numel()} bytes differ"


def _assert_nvfp4_data_relaxed(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, cols: int,
                               block_2d: bool, what: str) -> None:
    """Packed codes equal, except the sign bit inside NaN-scaled blocks (module docstring)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: shape/dtype differ"
    n = got.shape[1] * 2  # every nibble, the odd-width padding one included
    g, w = nvfp4.unpack_fp4(got.cpu(), n), nvfp4.unpack_fp4(want.cpu(), n)
    nan = torch.zeros(g.shape, dtype=torch.bool)
    nan[:, :cols] = _nan_block_mask(scale.cpu(), g.shape[0], cols, block_2d)
    bad = (g != w) & ~(nan & ((g & 7) == (w & 7)))
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} codes differ"


def assert_storage_bitwise(got: QuantizedStorage, want: QuantizedStorage, what: str = "") -> None:
    """Two storages hold the same copies with bitwise-equal payloads (see the module docstring
    for the one interpreter-only NVFP4 NaN-block relaxation)."""
    assert type(got) is type(want), f"{what}: {type(got).__name__} != {type(want).__name__}"
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: shape/dtype differ"
    assert got.meta == want.meta, f"{what}: meta {got.meta} != {want.meta}"
    assert got.directions() == want.directions(), f"{what}: {got.directions()} != {want.directions()}"
    for d in want.directions():
        gp, wp = got.payload(d), want.payload(d)
        assert sorted(gp) == sorted(wp), f"{what} {d}: payload names {sorted(gp)} != {sorted(wp)}"
        for name in wp:
            if INTERPRET and name == "data" and type(want).__name__ == "NVFP4Storage":
                length = -(-want.rows // 16) * 16 if want.meta["rht"] else want.rows
                cols = want.cols if d == "rowwise" else length
                _assert_nvfp4_data_relaxed(gp["data"], wp["data"], wp["scale"], cols,
                                           bool(want.meta["block_2d"]), f"{what} {d}[data]")
                continue
            assert_tensor_bitwise(gp[name], wp[name], f"{what} {d}[{name}]")


def shared_tensors(storage: QuantizedStorage) -> set[str]:
    """Payload names the two copies share as one tensor object (e.g. one FP8 scale_inv)."""
    if len(storage.directions()) < 2:
        return set()
    r, c = storage.payload("rowwise"), storage.payload("columnwise")
    return {k for k in r if k in c and r[k] is c[k]}


def run_kernel(q, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True,
               seed: Optional[int] = None) -> QuantizedStorage:
    """Run q's registered Triton kernel directly (on CPU tensors too, under the interpreter)."""
    return fast.KERNELS[type(q)].run(q, x, rowwise, columnwise, seed)


def check_against_reference(q, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True,
                            what: str = "", seed: int = 1234) -> QuantizedStorage:
    """The kernel's storage equals ``q.reference_encode`` bit for bit (run on a copy of q, so
    stateful quantizers start from the same state; one stochastic-rounding seed for both, the
    reference drawing the kernels' stream: :func:`kernel_sr_stream`);
    returns the kernel's storage."""
    ref_q = q.copy()
    with kernel_sr_stream():
        want = ref_q.reference_encode(x, rowwise, columnwise, seed)
    got = run_kernel(q, x, rowwise, columnwise, seed)
    assert_storage_bitwise(got, want, what or repr(q))
    assert shared_tensors(got) == shared_tensors(want), f"{what}: shared payload tensors differ"
    return got


def check_gpu(q, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True) -> None:
    """On CUDA: ``q.encode`` picks q's Triton kernel (no reference fallback warning) and, with
    every output poisoned before launch, equals ``reference_encode`` bit for bit."""
    kernel = select_quantize_kernel(q, x, rowwise, columnwise)
    assert kernel is fast.KERNELS[type(q)], f"{q!r} on {x.device} selected {kernel}"
    seed = int.from_bytes(os.urandom(7), "little")
    ref_q = q.copy()
    with kernel_sr_stream():
        want = ref_q.reference_encode(x, rowwise, columnwise, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceQuantizeWarning)
        with poisoned_outputs(0x7F):
            got = q.encode(x, rowwise, columnwise, seed)
    torch.cuda.synchronize()
    assert_storage_bitwise(got, want, f"{q!r} {tuple(x.shape)} {x.dtype}")


#: integers that E4M3 and E5M2 both hold exactly (E5M2's 2 mantissa bits reach 7)
_EXACT_INTS = 7


def exact_sum_values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, reduction: int,
                    device: str = "cpu") -> torch.Tensor:
    """Values ``i * 2**p`` (|i| <= 7, |p| <= s; exact in E4M3, E5M2, BF16, FP16) whose products
    sum exactly in FP32 in any order over a reduction of ``reduction`` terms, so two kernels that
    sum them in different orders (the interpreter's numpy dot sums in an order set by the CPU's
    BLAS kernel and the operands' layouts) give the same bits on every CPU.

    Every product is a multiple of 2**-2s with magnitude <= 49 * 2**2s, so every partial sum of
    ``reduction`` of them is a multiple of 2**-2s below ``reduction * 49 * 2**2s``; FP32 holds all
    such values exactly while that is <= 2**24 * 2**-2s. ``s`` is the largest of 3, 2, 1, 0 that
    fits (many magnitudes where the reduction allows).

    Parameters
    ----------
    shape, dtype, g, device
        The values' shape, dtype (FP8, BF16, FP16 or FP32), random generator and device.
    reduction
        The longest reduction (K) the values take part in.

    Returns
    -------
    torch.Tensor
        Finite values (no NaN / inf codes).

    Raises
    ------
    ValueError
        If even ``s = 0`` (integers 0..7) cannot keep ``reduction`` terms exact.
    """
    for s in (3, 2, 1, 0):
        if reduction * _EXACT_INTS ** 2 * 2 ** (4 * s) <= 2 ** 24:
            break
    else:
        raise ValueError(f"exact_sum_values: reduction={reduction} is too long to sum exactly in FP32; "
                         "use a reduction of at most 342392 terms")
    ints = torch.randint(-_EXACT_INTS, _EXACT_INTS + 1, shape, generator=g, device=device).float()
    return (ints * torch.exp2(torch.randint(-s, s + 1, shape, generator=g, device=device).float())).to(dtype)


def moe_step(m, splits: list[int], factory, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """One GroupedLinear forward + backward under ``factory``'s recipe on fixed random x / dy
    (CPU, ``dtype``): [output, input grad, parameter grads...]."""
    from hybridfp import CustomRecipe, autocast
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(splits), m.in_features, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(sum(splits), m.out_features, generator=g).to(dtype)
    with autocast(recipe=CustomRecipe(qfactory=factory)):
        y = m(x, splits)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]

