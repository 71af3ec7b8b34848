"""Stochastic-rounding draws for the NVFP4 kernels: counter-based Philox4x32-10 inside the kernel.

Why not the reference's stream: ``formats.nvfp4`` draws ``torch.rand`` from a
``torch.Generator`` seeded per (seed, direction). Reproducing that stream inside a Triton
kernel is not possible in general (torch's CUDA generator is Philox with its own, internal
offset bookkeeping per launch, the CPU one is a Mersenne twister), and reading the draws from
memory costs an FP32 write plus an FP32 read per element: more traffic than the quantization
itself. So the kernels generate their own counter-based draws, and their stochastic-rounding
results are a different random realisation of the same distribution (tests check
reproducibility, unbiasedness and that every code is one of the two neighbours; everything
deterministic - amaxes, scales, RHT - stays bitwise equal to the reference).

The stream, defined so that it does not depend on tiles, warps or which other copies a call
writes (so a hybrid of two identical children equals the plain quantizer bit for bit):

- key: ``(seed * 2 + direction) mod 2**63`` (the number the reference seeds its per-direction
  generator with; 2D quantization uses direction 0), split into two 32-bit words (low, high);
- the draw for element (i, j) of a copy (row i, column j of the stored [rows, cols] copy,
  columnwise copies in their transposed, RHT'd layout) is half ``(j >> 2) & 1`` (low 16 bits,
  then high) of word ``j & 3`` of Philox4x32-10 on the counter ``(j >> 3, i, 0, 0)``, as the
  uniform ``u16 * 2**-16`` in [0, 1).

16 bits per draw: one Philox call (4 x 32 bits) serves 8 elements, and the probability of
rounding up is ceil(2**16 * frac) / 2**16 instead of frac, a bias below 2**-16 of the E2M1
step (far under NVFP4's quantization noise). :func:`reference_draws` computes the same
stream in PyTorch (tests feed it to ``formats.nvfp4`` as ``rand=`` and compare bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Philox4x32 round multipliers and key increments (Salmon et al., SC'11, "Random123").
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
_M32 = 0xFFFFFFFF
# The same numbers, visible inside kernels.
_M0, _M1 = tl.constexpr(PHILOX_M0), tl.constexpr(PHILOX_M1)
_W0, _W1 = tl.constexpr(PHILOX_W0), tl.constexpr(PHILOX_W1)
_ROUNDS = tl.constexpr(PHILOX_ROUNDS)


def stream_key(seed: int, direction: int) -> int:
    """The 63-bit key of a copy's stream: the number the reference seeds that copy's
    ``torch.Generator`` with (``NVFP4Quantizer._sr``), so ``generator.initial_seed()`` names it."""
    return (seed * 2 + direction) % (2**63)


def sr_key(seed: int, direction: int) -> tuple[int, int]:
    """The (low, high) 32-bit Philox key words of a copy, as int32 kernel arguments."""
    key = stream_key(seed, direction)
    lo, hi = key & _M32, key >> 32
    return tuple(v - 2**32 if v >= 2**31 else v for v in (lo, hi))  # type: ignore[return-value]


@triton.jit
def philox(c0, c1, k0, k1):
    """Philox4x32-10 of the counters (c0, c1, 0, 0) (uint32 tensors) under the key (k0, k1)
    (int32 scalars, reinterpreted): four uint32 tensors."""
    k0 = k0.to(tl.uint32, bitcast=True)
    k1 = k1.to(tl.uint32, bitcast=True)
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(_ROUNDS):
        p0 = c0.to(tl.uint64) * _M0  # one 32x32 -> 64-bit multiply for both words
        p1 = c2.to(tl.uint64) * _M1
        hi0 = (p0 >> 32).to(tl.uint32)
        hi1 = (p1 >> 32).to(tl.uint32)
        lo0 = p0.to(tl.uint32)
        lo1 = p1.to(tl.uint32)
        c0 = hi1 ^ c1 ^ k0
        c2 = hi0 ^ c3 ^ k1
        c1 = lo1
        c3 = lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    return c0, c1, c2, c3


@triton.jit
def u16_uniform(w, HIGH: tl.constexpr):
    """Uniform FP32 in [0, 1) from the low (or ``HIGH``) 16 bits of uint32 ``w`` (exact)."""
    if HIGH:
        u = w >> 16
    else:
        u = w & 0xFFFF
    return u.to(tl.int32).to(tl.float32) * 1.52587890625e-05  # 2**-16


@triton.jit
def draws8(i, g, k0, k1):
    """The 8 draws of columns 8 g .. 8 g + 7 of copy rows ``i`` (``i``, ``g`` broadcastable
    int tensors): (u0, ..., u7), u_m for column 8 g + m."""
    w0, w1, w2, w3 = philox(g.to(tl.uint32), i.to(tl.uint32), k0, k1)
    return (u16_uniform(w0, False), u16_uniform(w1, False), u16_uniform(w2, False), u16_uniform(w3, False),
            u16_uniform(w0, True), u16_uniform(w1, True), u16_uniform(w2, True), u16_uniform(w3, True))


@triton.jit
def u16_int(w, HIGH: tl.constexpr):
    """The low (or ``HIGH``) 16 bits of uint32 ``w`` as int32: the draw :func:`u16_uniform`
    makes a float of, ``u16_uniform(w, HIGH) == u16_int(w, HIGH) * 2**-16``."""
    if HIGH:
        return (w >> 16).to(tl.int32)
    else:
        return (w & 0xFFFF).to(tl.int32)


@triton.jit
def draws8_u16(i, g, k0, k1):
    """:func:`draws8` as the 16-bit integers ``u`` of the draws ``u * 2**-16`` (same order)."""
    w0, w1, w2, w3 = philox(g.to(tl.uint32), i.to(tl.uint32), k0, k1)
    return (u16_int(w0, False), u16_int(w1, False), u16_int(w2, False), u16_int(w3, False),
            u16_int(w0, True), u16_int(w1, True), u16_int(w2, True), u16_int(w3, True))


@triton.jit
def draw_at(i, j, k0, k1):
    """The draw of element (i, j) of a copy, one Philox call per element (for the rarely used
    paths whose tiles do not split into groups of 8 columns cheaply)."""
    w0, w1, w2, w3 = philox((j >> 3).to(tl.uint32), i.to(tl.uint32), k0, k1)
    lane = j & 3
    w = tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))
    return tl.where((j & 4) != 0, u16_uniform(w, True), u16_uniform(w, False))


# ------------------------------------------------------------------ the same stream in PyTorch
def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m for uint32 values held in int64 (the int64 product
    wraps modulo 2**64, which keeps both words)."""
    p = a * m
    return (p >> 32) & _M32, p & _M32


def philox_torch(c0: torch.Tensor, c1: torch.Tensor, key: int) -> tuple[torch.Tensor, ...]:
    """:func:`philox` in PyTorch on int64 tensors holding uint32 values."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & _M32, (k1 + PHILOX_W1) & _M32
    return c0, c1, c2, c3


def reference_draws(key: int, shape: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The kernels' FP32 draws for a whole [rows, cols] copy whose stream key is ``key``
    (:func:`stream_key`; module docstring), in PyTorch."""
    rows, cols = shape
    i = torch.arange(rows, dtype=torch.int64, device=device)[:, None].expand(rows, cols)
    j = torch.arange(cols, dtype=torch.int64, device=device)[None, :].expand(rows, cols)
    words = torch.stack(philox_torch(j >> 3, i.clone(), key), dim=0)
    w = torch.gather(words, 0, (j & 3)[None]).squeeze(0)
    u = torch.where((j & 4) != 0, w >> 16, w & 0xFFFF)
    return u.to(torch.float32) * 2.0**-16


__all__ = ["PHILOX_ROUNDS", "draw_at", "draws8", "draws8_u16", "philox", "philox_torch", "reference_draws", "sr_key", "stream_key"]
