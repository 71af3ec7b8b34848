"""Shared numerics for every format: constants, exact casts, 2D views and block reductions.

Everything here is pure PyTorch and stateless. Casts never rely on the framework to
saturate (torch's ``.to(float8)`` turns 500 into NaN): values are clamped first, then cast,
so the cast only ever rounds (RNE) a value inside the finite range.
"""

from __future__ import annotations

import math

import torch

FP32_MAX: float = float(torch.finfo(torch.float32).max)
FP32_TINY: float = float(torch.finfo(torch.float32).tiny)

#: Largest finite value of each FP8 element type.
FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

#: Input dtypes every quantizer accepts.
HIGH_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_FP8_NAMES: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}


def fp8_dtype(name_or_dtype: str | torch.dtype) -> torch.dtype:
    """Return the torch FP8 dtype for ``"e4m3"``/``"e5m2"`` (or pass a valid dtype through)."""
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype not in FP8_MAX:
            raise ValueError(
                f"fp8_dtype={name_or_dtype} is not an FP8 element type; use torch.float8_e4m3fn "
                "or torch.float8_e5m2 (or the strings 'e4m3' / 'e5m2')."
            )
        return name_or_dtype
    key = str(name_or_dtype).lower()
    if key not in _FP8_NAMES:
        raise ValueError(f"fp8_dtype={name_or_dtype!r} is unknown; use 'e4m3' or 'e5m2'.")
    return _FP8_NAMES[key]


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype."""
    return FP8_MAX[fp8_dtype(dtype)]


def min_pow2_scale(dtype: torch.dtype) -> float:
    """Smallest power-of-two scale whose inverse keeps ``fp8_max * scale_inv`` finite in FP32.

    With ``fp8_max = m * 2**E`` (m in [1, 2)) that is ``2**(E - 127)``: E4M3 2**-119, E5M2
    2**-112. A power-of-two scale below it (from a block amax above ``fp8_max / 2**(E - 127)``,
    about 2.98e38) would let the block's largest code decode to ``2**128`` = inf.

    Parameters
    ----------
    dtype : torch.dtype
        The FP8 element type (or its name, ``"e4m3"`` / ``"e5m2"``).

    Returns
    -------
    float
        The scale, a power of two.

    Raises
    ------
    ValueError
        If ``dtype`` is not an FP8 element type.
    """
    return 2.0 ** (math.frexp(fp8_max(dtype))[1] - 1 - 127)


def saturating_cast_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast FP32 ``x`` to FP8 with round-to-nearest-even, saturating ±inf/overflow to ±max.

    NaN stays NaN (E4M3 has a NaN encoding; E5M2 too).
    """
    m = FP8_MAX[dtype]
    return x.float().clamp(-m, m).to(dtype)


def check_input(x: torch.Tensor, what: str = "input") -> None:
    """Raise a clear error unless ``x`` is a floating tensor a quantizer can read."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{what} has dtype {x.dtype}; quantizers read float32, bfloat16 or float16 tensors. "
            "Cast it first (e.g. x.float())."
        )


def check_2d(x: torch.Tensor, what: str) -> None:
    """Raise a clear error unless ``x`` is 2D (format functions take [rows, cols])."""
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2D [rows, cols], got shape {tuple(x.shape)}; flatten "
                         "leading dims first (hybridfp.formats.common.as_2d).")


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as [rows, last_dim] (leading dims flattened; 0-d and 1-d become one row)."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 2:  # already [rows, last_dim]: no view op (an MoE layer's experts, each step)
        return x
    # Explicit row count: reshape(-1, 0) cannot infer -1 when the last dim is empty.
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def ceil_div(a: int, b: int) -> int:
    """Integer ceil(a / b)."""
    return -(-a // b)


def pad_2d(x: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """Pad a 2D tensor at the bottom/right to at least [rows, cols] (no copy if already)."""
    r, c = x.shape
    if r >= rows and c >= cols:
        return x
    out = x.new_full((max(r, rows), max(c, cols)), value)
    out[:r, :c] = x
    return out


def blocks_1d(x: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad the last dim of 2D ``x`` to a multiple of ``block``; return [R, nb, block]."""
    r, c = x.shape
    nb = ceil_div(c, block)
    return pad_2d(x, r, nb * block).reshape(r, nb, block)


def blocks_2d(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Zero-pad 2D ``x`` to multiples of (br, bc); return [R/br, C/bc, br*bc] tiles."""
    r, c = x.shape
    nr, nc = ceil_div(r, br), ceil_div(c, bc)
    t = pad_2d(x, nr * br, nc * bc).reshape(nr, br, nc, bc).permute(0, 2, 1, 3)
    return t.reshape(nr, nc, br * bc)


def amax_nan(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """max|x| in FP32 that propagates NaN (torch.amax does) as the positive quiet NaN, and is 0
    for empty input. The NaN is made canonical because torch's CPU reduction of a strided view
    can return a NaN with the sign bit set (0xFFFFFFFF), which would then reach the scale and
    code bytes (E4M3 0xFF instead of 0x7F) depending on the input's memory layout."""
    a = x.float().abs()
    if a.numel() == 0:
        if dim is None:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        return a.amax(dim=dim) if all(a.shape[d] > 0 for d in _dims(dim)) else _empty_reduce(a, dim)
    m = a.amax() if dim is None else a.amax(dim=dim)
    return torch.where(m.isnan(), torch.full_like(m, float("nan")), m)


def _dims(dim: int | tuple[int, ...]) -> tuple[int, ...]:
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _empty_reduce(a: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    dims = {d % a.dim() for d in _dims(dim)}
    shape = [s for i, s in enumerate(a.shape) if i not in dims]
    return a.new_zeros(shape)


def expand_blocks_1d(s: torch.Tensor, block: int, cols: int) -> torch.Tensor:
    """Broadcast per-block values [R, nb] to per-element [R, cols]."""
    return s.repeat_interleave(block, dim=1)[:, :cols]


def expand_blocks_2d(s: torch.Tensor, br: int, bc: int, rows: int, cols: int) -> torch.Tensor:
    """Broadcast per-tile values [nr, nc] to per-element [rows, cols]."""
    return s.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)[:rows, :cols]


def pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """Round positive normal FP32 values down to a power of two by clearing the mantissa.

    Bit manipulation is exact, unlike exp2(floor(log2(x))) which can be off by one ulp.
    """
    bits = x.float().contiguous().view(torch.int32) & 0x7F800000
    return bits.view(torch.float32)
