"""Fused SwiGLU, ``h = silu(g) * u``, forward and backward in one pass each over [M, N] tensors.

Eager torch runs the forward as two memory-bound kernels (silu, mul) and the backward as three
(two muls, ``silu_backward``); here the forward reads g and u once and writes h, the backward
reads dh, g and u once and writes dg and du: about half the bytes.

Per element, in FP32, with torch eager's rounding points (``round`` = to the input dtype):

    d  = 1 + exp(-g)
    s  = round(g / d)                              # F.silu(g)
    h  = round(s * u)                              # * u
    ds = round(dh * u)                             # mul backward, grad of s
    du = round(dh * s)                             # mul backward, grad of u
    dg = round(ds * (1 / d) * fma(g, 1 - 1/d, 1))  # aten silu_backward(ds, g)

The divisions are IEEE (``tl.math.div_rn``; Triton's ``/`` is approximate on NVIDIA GPUs), as
torch's CUDA and CPU kernels divide. ``fma`` is explicit because nvcc contracts torch's CUDA
``1 + x * (1 - s)`` into one and Triton's contraction is the compiler's choice; the
interpreter implements ``tl.fma`` with one rounding too. On CUDA the exponential is
libdevice's ``expf`` (``EXACT_EXP``), the function torch's CUDA kernels call; ``tl.exp`` lowers
to the approximate ``ex2.approx`` there, and the interpreter has no libdevice (it uses numpy's
exp). So results agree with eager torch up to the exponential's last bits: see
``tests/nn/test_swiglu.py`` for the verified bounds.

The amax of what a kernel stores (h; dg and du) comes out of the same pass when asked
(``amax_out``): a per-tensor current-scaling quantizer of the next GEMM then skips its own amax
read of the tensor (``hybridfp.tensors.known_amax``). It is the max of the magnitude bits of
the values before rounding, rounded once at the end (rounding is monotone, so this is the
stored values' amax bit for bit, NaN as the canonical quiet NaN), one atomic max per program.
Given each row's group (``row_groups``: an MoE layer's experts) the amax is kept per group
instead, the backward's as one max over dg and du (the amax of each group's rows of the
[dg | du] gradient a ``GroupedLinear`` quantizes), as the grouped FP8 encode's own segmented
amax (``kernels/moe/triton_grouped_fp8.group_amax``) computes it.

Layout: 2D inputs with unit inner stride (checked) and any row stride, e.g. the two halves of a
fused gate/up projection's output. One program per (row, block of ``BLOCK`` columns): a 64-bit
row base pointer and int32 column offsets, so loads are contiguous and vectorize (the row
strides are specialized on divisibility by 16 like every int argument).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import DTYPE_CODE, empty, kernel_input, load_f32
from ._common_encode import bf16_nan16, bf16_nan_bits, round_to_dtype
from .triton_epilogue import store_out

#: Columns per program at most: 2048 BF16 elements over 4 warps is 16 per thread, two 16-byte
#: loads per input; memory-bound, so nothing here is tuned beyond keeping loads vectorized.
MAX_BLOCK: int = 2048
#: CUDA's limit on grid dimension 1 (column blocks).
_MAX_GRID_Y: int = 65535


@triton.jit
def _exp(x, EXACT_EXP: tl.constexpr):
    """exp(x) in FP32: CUDA's ``expf`` (libdevice) when compiled for CUDA, else ``tl.exp``."""
    if EXACT_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _silu_parts(g, EXACT_EXP: tl.constexpr):
    """(g / d, 1 / d) for d = 1 + exp(-g), each one IEEE division as torch computes them."""
    d = 1.0 + _exp(-g, EXACT_EXP)
    return tl.math.div_rn(g, d), tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)


@triton.jit
def _abs_bits(v, mask):
    """int32 magnitude bits of FP32 ``v`` (0 where masked): they order like |v|, NaNs above inf."""
    return tl.where(mask, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)


@triton.jit
def _record_amax(amax_ptr, m, DTYPE: tl.constexpr, BF16_NAN: tl.constexpr):
    """Atomic max into ``amax_ptr`` (int32 bits, zeroed by the caller) of the STORED values' amax,
    from ``m``, the magnitude bits of one program's values before their rounding to DTYPE:
    rounding (RNE) is monotone and odd, so max|round(v)| = round(max|v|); a NaN becomes the
    canonical quiet NaN (0x7FC00000, above inf), as ``_common.amax_bits`` has it. One atomic per
    program (114688 on one address for 16384 x 14336) is the cheapest arrangement
    (``_swiglu_fwd_kernel``)."""
    a = tl.max(m, 0)
    r = round_to_dtype(a.to(tl.float32, bitcast=True), DTYPE, BF16_NAN).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr, tl.where(a > 0x7F800000, 0x7FC00000, r))


@triton.jit
def _amax_slot(amax_ptr, group_ptr, row, GROUPED: tl.constexpr):
    """Where a row's amax goes: ``amax_ptr``, or with ``GROUPED`` its row group's entry."""
    if GROUPED:
        return amax_ptr + tl.load(group_ptr + row)
    else:
        return amax_ptr


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, amax_ptr, group_ptr, N, sg, su, sh, DTYPE: tl.constexpr,
                       BF16_NAN: tl.constexpr, NAN16: tl.constexpr, EXACT_EXP: tl.constexpr,
                       BLOCK: tl.constexpr, AMAX: tl.constexpr, GROUPED: tl.constexpr):
    """``AMAX``: also max|h| (see ``_record_amax``); with ``GROUPED`` per row group (``group_ptr``:
    each row's group). One row per program: several rows per program (fewer atomics) are slower
    on the H200 at 16384 x 14336 with the amax, backward most of all."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = load_f32(g_ptr + row * sg + cols, mask, DTYPE)
    u = load_f32(u_ptr + row * su + cols, mask, DTYPE)
    silu, _ = _silu_parts(g, EXACT_EXP)
    h = round_to_dtype(silu, DTYPE, BF16_NAN) * u
    store_out(h_ptr + row * sh + cols, h, mask, DTYPE, NAN16)
    if AMAX:
        _record_amax(_amax_slot(amax_ptr, group_ptr, row, GROUPED), _abs_bits(h, mask), DTYPE, BF16_NAN)


@triton.jit
def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, amax_ptr, group_ptr, N, sdh, sg, su, sdg, sdu,
                       DTYPE: tl.constexpr, BF16_NAN: tl.constexpr, NAN16: tl.constexpr,
                       EXACT_EXP: tl.constexpr, BLOCK: tl.constexpr, AMAX: tl.constexpr,
                       GROUPED: tl.constexpr):
    """``AMAX``: also max|dg| and max|du| (amax_ptr[0], amax_ptr[1]); with ``GROUPED`` the max of
    both, one per row group (the amax of each group's rows of the [dg | du] gradient)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dh = load_f32(dh_ptr + row * sdh + cols, mask, DTYPE)
    g = load_f32(g_ptr + row * sg + cols, mask, DTYPE)
    u = load_f32(u_ptr + row * su + cols, mask, DTYPE)
    silu, sig = _silu_parts(g, EXACT_EXP)
    s = round_to_dtype(silu, DTYPE, BF16_NAN)
    ds = round_to_dtype(dh * u, DTYPE, BF16_NAN)
    du = dh * s
    dg = ds * sig * tl.fma(g, 1.0 - sig, 1.0)
    store_out(du_ptr + row * sdu + cols, du, mask, DTYPE, NAN16)
    store_out(dg_ptr + row * sdg + cols, dg, mask, DTYPE, NAN16)
    if AMAX:
        if GROUPED:  # max|round(v)| over both = round(max|v| over both): one atomic
            _record_amax(_amax_slot(amax_ptr, group_ptr, row, GROUPED),
                         tl.maximum(_abs_bits(dg, mask), _abs_bits(du, mask)), DTYPE, BF16_NAN)
        else:
            _record_amax(amax_ptr, _abs_bits(dg, mask), DTYPE, BF16_NAN)
            _record_amax(amax_ptr + 1, _abs_bits(du, mask), DTYPE, BF16_NAN)


def _check(name: str, x: torch.Tensor, like: torch.Tensor) -> None:
    """Raise unless ``x`` is a 2D [M, N] tensor like ``like`` the kernels can read."""
    if x.dim() != 2:
        raise ValueError(f"swiglu kernels take 2D [M, N] tensors; {name} has shape {tuple(x.shape)}.")
    if x.shape != like.shape or x.dtype != like.dtype or x.device != like.device:
        raise ValueError(f"swiglu kernels: {name} is {tuple(x.shape)} {x.dtype} on {x.device}, expected "
                         f"{tuple(like.shape)} {like.dtype} on {like.device} like g.")
    if x.dtype not in DTYPE_CODE:
        raise TypeError(f"swiglu kernels read float32, bfloat16 or float16; {name} is {x.dtype}.")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"swiglu kernels need a unit inner stride; {name} has strides {x.stride()} "
                         "(make it contiguous first).")


def _launch_config(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``n`` columns: up to MAX_BLOCK columns per program, at
    least 16 elements per thread where the row is long enough."""
    block = max(16, min(MAX_BLOCK, triton.next_power_of_2(n)))
    return block, max(1, min(4, block // 512))


def _grid(m: int, n: int, block: int) -> tuple[int, int]:
    nb = triton.cdiv(n, block)
    if nb > _MAX_GRID_Y:
        raise ValueError(f"swiglu kernels: rows of {n} elements need {nb} column blocks; at most "
                         f"{_MAX_GRID_Y} fit in one launch.")
    return m, nb


def amax_buffer(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` zeroed int32 amax accumulators on x's device, the ``amax_out`` the kernels take;
    ``buffer[i].view(torch.float32)`` is amax i once the kernel has run."""
    return torch.zeros(n, dtype=torch.int32, device=x.device)


def _check_amax(amax_out: Optional[torch.Tensor], n: int, like: torch.Tensor,
                row_groups: Optional[torch.Tensor] = None) -> None:
    if row_groups is not None:
        if amax_out is None:
            raise ValueError("swiglu kernels: row_groups is given without amax_out (the per-group amaxes' buffer).")
        if row_groups.shape != (like.shape[0],) or row_groups.dtype != torch.int32 or row_groups.device != like.device:
            raise ValueError(f"swiglu kernels: row_groups must be int32 [{like.shape[0]}] on {like.device} (each "
                             f"row's group); got {row_groups.dtype} {tuple(row_groups.shape)} on {row_groups.device}.")
        n = amax_out.shape[0] if amax_out.dim() == 1 else -1
    if amax_out is not None and (amax_out.shape != (n,) or amax_out.dtype != torch.int32
                                 or amax_out.device != like.device):
        raise ValueError(f"swiglu kernels: amax_out must be amax_buffer(x, {n}) (int32 [{n}] on {like.device}); "
                         f"got {amax_out.dtype} {tuple(amax_out.shape)} on {amax_out.device}.")


def _consts(x: torch.Tensor) -> dict:
    """The constexpr arguments both kernels take for inputs like ``x``."""
    return dict(DTYPE=DTYPE_CODE[x.dtype], BF16_NAN=bf16_nan_bits(x.device), NAN16=bf16_nan16(x.device),
                EXACT_EXP=x.device.type == "cuda")


def _on_device(x: torch.Tensor):
    """Launch on x's GPU (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else nullcontext()


def swiglu_forward(g: torch.Tensor, u: torch.Tensor, *, amax_out: Optional[torch.Tensor] = None,
                   row_groups: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(g) * u`` of 2D [M, N] tensors (unit inner stride), a new contiguous tensor, or
    written into ``out`` (2D like g, unit inner stride; its version counter is bumped, as an
    in-place write would, so nothing recorded for its old values is served again).
    ``amax_out`` (:func:`amax_buffer` of 1): max|h| is accumulated there (NaN-propagating bits,
    exactly what ``_common.global_amax(h)`` returns); with ``row_groups`` (int32 [M], each row's
    group in [0, G)) ``amax_out`` is :func:`amax_buffer` of G and takes each group's max|h|
    (what ``kernels.moe.triton_grouped_fp8.group_amax(h, row_groups, G)`` returns)."""
    _check("g", g, g)
    _check("u", u, g)
    _check_amax(amax_out, 1, g, row_groups)
    m, n = g.shape
    if out is None:
        h = empty((m, n), g.dtype, g.device)
    else:
        _check("out", out, g)
        h = out
        if not torch.compiler.is_compiling():  # no amax records under torch.compile (nn/swiglu.py)
            torch.autograd.graph.increment_version(h)
    if h.numel() == 0:
        return h
    block, warps = _launch_config(n)
    amax, grouped = amax_out is not None, row_groups is not None
    with _on_device(g):
        _swiglu_fwd_kernel[_grid(m, n, block)](
            kernel_input(g), kernel_input(u), kernel_input(h), amax_out if amax else h,
            row_groups if grouped else h, n, g.stride(0), u.stride(0), h.stride(0), **_consts(g), BLOCK=block,
            AMAX=amax, GROUPED=grouped, num_warps=warps)
    return h


def swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, *,
                    amax_out: Optional[torch.Tensor] = None,
                    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                    row_groups: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of ``h = silu(g) * u`` for the gradient ``dh`` (all 2D [M, N], unit inner stride);
    silu(g) is recomputed, not read. ``out``: the (dg, du) tensors to write (2D like g, unit inner
    stride: e.g. the two halves of one [M, 2N] gradient, which then needs no concatenation);
    None: new contiguous tensors (with ``out``, their version counters are bumped as
    :func:`swiglu_forward`'s ``out``'s is). ``amax_out`` (:func:`amax_buffer` of 2): max|dg| and max|du|
    are accumulated in its two entries; with ``row_groups`` (as :func:`swiglu_forward`'s) it is
    :func:`amax_buffer` of G and takes each group's max over both dg and du."""
    _check("g", g, g)
    _check("u", u, g)
    _check("dh", dh, g)
    _check_amax(amax_out, 2, g, row_groups)
    m, n = g.shape
    if out is None:
        dg = empty((m, n), g.dtype, g.device)
        du = empty((m, n), g.dtype, g.device)
    else:
        dg, du = out
        _check("out[0] (dg)", dg, g)
        _check("out[1] (du)", du, g)
        if not torch.compiler.is_compiling():  # as an in-place write would: old records go stale
            for t in (dg, du):
                torch.autograd.graph.increment_version(t)
    if dg.numel() == 0:
        return dg, du
    block, warps = _launch_config(n)
    amax, grouped = amax_out is not None, row_groups is not None
    with _on_device(g):
        _swiglu_bwd_kernel[_grid(m, n, block)](
            kernel_input(dh), kernel_input(g), kernel_input(u), kernel_input(dg), kernel_input(du),
            amax_out if amax else dg, row_groups if grouped else dg, n, dh.stride(0), g.stride(0), u.stride(0),
            dg.stride(0), du.stride(0), **_consts(g), BLOCK=block, AMAX=amax, GROUPED=grouped, num_warps=warps)
    return dg, du
