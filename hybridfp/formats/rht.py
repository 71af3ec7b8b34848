"""Random Hadamard transform (RHT) for NVFP4's wgrad operands (numerics §2.5).

R = diag(s) · H16 / 4, with H16 the Sylvester Hadamard matrix in natural order and s TE's
fixed sign vector. R is orthogonal (H16 H16ᵀ = 16 I), so transforming both wgrad operands
along the reduction dimension leaves their product unchanged: (A R)(B R)ᵀ = A Bᵀ.

Fixed FP32 evaluation order (kernels must follow it to match bit for bit): for each 16-element
tile t along the last dim, u = t * s (exact), then the in-place fast Walsh-Hadamard butterfly
with h = 1, 2, 4, 8 ((a, b) -> (a + b, a - b) for pairs (i, i + h) inside groups of 2h), then
* 0.25 (exact, barring FP32 underflow). H16 is symmetric, so this is t · diag(s) · H16 / 4.

Near the FP32 maximum (finite in, finite out): the butterfly's sums reach 16 max|u|, so a
tile whose max |x| is at least ``PRESCALE_FROM`` (2**124) is transformed as
``butterfly(u * 2**-4) * 4`` instead: no intermediate sum can overflow, and since scaling by
a power of two commutes with FP32 rounding away from the subnormal range, this is the same
function up to the tile's tiny elements. Every other tile keeps the plain order above, bit for
bit. A tile of finite values is then saturated to ±max of ``out_dtype`` before it is
rounded: its true transform can reach 4 max|x| (all of u equal), beyond the dtype's range,
and rounding a BF16 / FP16 result can overflow too (FP16 inputs above 16384). The inverse
transform does the same (pre-scaled tiles of max |y| >= 2**124, saturated to ±FP32_MAX). A
tile holding ±inf is not saturated: its results stay ±inf (NaN where two infs meet), as a
NaN tile's stay NaN.

Decisions (numerics §2.5 asks for them to be documented):
- The transform result is rounded to ``out_dtype``, default the input's dtype, before anything
  downstream (global amax, quantization) sees it. For BF16 inputs this matches TE's reference,
  which stores the RHT output in BF16; FP32 inputs stay FP32. Kernels must round the same way.
- A width C that is not a multiple of 16 is zero-padded to ceil16(C). The padded tail is
  generally non-zero after the transform and is kept (the output is [R, ceil16(C)]); dropping
  it would break (A R)(B R)ᵀ = A Bᵀ. ``apply_inverse_rht`` takes the logical width back.
"""

from __future__ import annotations

import torch

from hybridfp.formats.common import blocks_1d, check_input
from hybridfp.utils.device import device_constant

TILE: int = 16
#: A tile with max |x| at or above this is transformed pre-scaled by PRESCALE (no overflow).
PRESCALE_FROM: float = 2.0**124
PRESCALE: float = 2.0**-4
#: TE's fixed RHT sign vector (numerics §2.5).
RHT_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard16() -> torch.Tensor:
    """16x16 Sylvester Hadamard matrix in natural order (H2n = [[Hn, Hn], [Hn, -Hn]]), FP32 ±1."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < TILE:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def rht_matrix() -> torch.Tensor:
    """R = diag(RHT_SIGNS) @ H16 / 4 in FP32 (entries ±0.25, exact)."""
    s = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    return s[:, None] * hadamard16() * 0.25


def _butterfly(u: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over the last dim (16), stages h = 1, 2, 4, 8."""
    lead = u.shape[:-1]
    h = 1
    while h < TILE:
        # Index i = group * 2h + half * h + j: pairs (i, i + h) are half 0 and half 1.
        g = u.reshape(*lead, TILE // (2 * h), 2, h)
        a, b = g[..., 0, :], g[..., 1, :]
        u = torch.stack([a + b, a - b], dim=-2).reshape(*lead, TILE)
        h *= 2
    return u


def _signs(like: torch.Tensor) -> torch.Tensor:
    return device_constant(RHT_SIGNS, like.device)  # copied once per device, no sync


def _butterfly_scaled(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``_butterfly(u) * 0.25`` over [..., 16] tiles, computed without overflow and saturated
    to ±max of ``dtype``. A tile whose max |u| reaches PRESCALE_FROM (its sums, up to 16 times
    that, could overflow FP32) is pre-scaled by PRESCALE and post-scaled by 0.25 / PRESCALE
    (exact powers of two); the others take the plain order (bitwise unchanged). Only tiles of
    finite values saturate: a tile holding ±inf keeps its inf / NaN results."""
    a = u.abs().amax(dim=-1, keepdim=True)  # NaN propagates: p = 1, bound = max (NaN kept)
    p = torch.where(a >= PRESCALE_FROM, PRESCALE, 1.0)
    y = _butterfly(u * p) * (0.25 / p)
    m = torch.where(a == float("inf"), float("inf"), torch.finfo(dtype).max)
    return y.clamp(-m, m)


def apply_rht(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Apply R to each 16-element tile of 2D ``x`` [R, C]; returns [R, ceil16(C)] in out_dtype.

    ``out_dtype`` defaults to ``x.dtype`` (see the module docstring for why). Results beyond
    ``out_dtype``'s range saturate to its ±max (module docstring: near the FP32 maximum).
    """
    check_input(x, "x")
    if x.dim() != 2:
        raise ValueError(
            f"apply_rht expects 2D [R, C] (flatten leading dims); got {tuple(x.shape)}."
        )
    out_dtype = x.dtype if out_dtype is None else out_dtype
    tiles = blocks_1d(x.float(), TILE)  # zero-padded to ceil16(C): [R, nb, 16]
    y = _butterfly_scaled(tiles * _signs(tiles), out_dtype)
    return y.reshape(x.shape[0], tiles.shape[1] * TILE).to(out_dtype)


def apply_inverse_rht(y: torch.Tensor, cols: int) -> torch.Tensor:
    """FP32 y · Rᵀ per tile (= butterfly, * 0.25, then * s), cropped to ``cols`` columns;
    saturated to ±FP32_MAX (module docstring: near the FP32 maximum)."""
    check_input(y, "y")
    if y.dim() != 2 or y.shape[1] % TILE:
        raise ValueError(f"apply_inverse_rht expects 2D [R, 16k]; got {tuple(y.shape)}.")
    if not 0 <= cols <= y.shape[1] or y.shape[1] - cols >= TILE:
        raise ValueError(f"cols={cols} does not fit an RHT output of width {y.shape[1]}.")
    tiles = y.float().reshape(y.shape[0], y.shape[1] // TILE, TILE)
    x = _butterfly_scaled(tiles, torch.float32) * _signs(tiles)
    return x.reshape(y.shape)[:, :cols]
