"""NVFP4: E2M1 elements in blocks of 16 with an E4M3 block scale and an FP32 global scale.

numerics §2.5 is normative; the FP32 arithmetic below follows it (and TE's kernels) step by step:

    S_enc   = min(2688 / global_amax, FP32_MAX)        # 2688 = 448 * 6; 1 if amax is 0 / inf / NaN
    S_dec   = 1 / S_enc
    S_dec_b = e4m3_rne_satfinite(block_amax * (S_enc * fp32(1/6)))
    encode  = min(1 / (fp32(S_dec_b) * S_dec), FP32_MAX)
    q       = e2m1(clamp(x * encode, -6, 6))
    dequant = q * fp32(S_dec_b) * S_dec                  # left to right; q * S_dec_b is exact

Decisions where numerics §2.5 is silent:
- A NaN global amax gives S_enc = 1, like FP8 current scaling (numerics §2.5 names only 0 and inf).
- NaN propagates through the block amax, so a block holding a NaN gets a NaN E4M3 scale and
  dequantizes to NaN everywhere; its element codes are 0 with the sign kept (meaningless).
- ±inf elements saturate: with a per-tensor amax of inf, S_enc = 1 and the element becomes
  ±6 * 448 (the block scale saturates at 448, the element at 6).
- A block whose S_dec_b underflows to 0 gets encode = FP32_MAX (1/0 clamped), so its codes are
  arbitrary but it dequantizes to exactly 0, as numerics §2.5 requires.
- Stochastic rounding: with lo <= |v| <= hi the neighbouring E2M1 values, round up iff
  rand < (|v| - lo) / (hi - lo). Both subtraction and division are exact in FP32 (Sterbenz /
  division by a power of two), so a kernel given the same uniform draws matches bit for bit.
  Draws come from ``torch.rand`` (one FP32 draw per logical element, row-major [R, C]).
- Row-scaled NVFP4 (a [R] global amax) is only offered for 1x16 blocks.
- Round trip: quantize(dequantize(q)) with the same global amax reproduces a block (0 < S_dec_b
  finite, encode not clamped) bit for bit iff its scale comes back, which holds whenever its
  largest code is ±6; that is
  every block with an E4M3-normal scale. A block with a subnormal S_dec_b (block_amax * S_enc
  / 6 < 2**-6) may come back with another scale, and one with S_dec_b = 0 with other codes.
  (tests/formats/test_nvfp4.py::test_idempotence states and checks the precise condition.)

Layout: codes are 4-bit (bit 3 = sign, bits 0-2 index ``E2M1_VALUES``); two per byte, element
2i in the low nibble and 2i+1 in the high nibble (TE's order). Odd widths pad with code 0.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from hybridfp.formats.common import (
    check_2d,
    FP32_MAX,
    FP8_MAX,
    amax_nan,
    blocks_1d,
    blocks_2d,
    ceil_div,
    check_input,
    expand_blocks_1d,
    expand_blocks_2d,
    saturating_cast_fp8,
)
from hybridfp.utils.device import device_constant
from hybridfp.utils.rewrites import version

BLOCK: int = 16
E2M1_MAX: float = 6.0
#: Non-negative E2M1 values, indexed by the 3-bit magnitude code 0..7.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_DTYPE: torch.dtype = torch.float8_e4m3fn
#: fp8_max(E4M3) * E2M1_MAX; global_amax maps onto it.
GLOBAL_SCALE_NUMERATOR: float = FP8_MAX[torch.float8_e4m3fn] * E2M1_MAX

# Midpoints between consecutive E2M1 values, with the direction a tie goes: RNE picks the even
# code, i.e. rounds up when the lower neighbour's code is odd (0.75 -> 1, 1.75 -> 2, 3.5 -> 4).
_MIDPOINTS: tuple[tuple[float, bool], ...] = tuple(
    ((E2M1_VALUES[k] + E2M1_VALUES[k + 1]) / 2, k % 2 == 1) for k in range(7)
)


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    # a fill, not a host copy: torch.tensor(..., device="cuda") syncs the stream
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _rcp6(like: torch.Tensor) -> torch.Tensor:
    """fp32(1/6) as an FP32 division (same constant as the C++ ``1.0f / 6.0f``)."""
    return torch.div(_f32(1.0, like), _f32(E2M1_MAX, like))


def global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = min(2688 / amax, FP32_MAX) elementwise in FP32; 1 where amax is 0, inf or NaN."""
    g = torch.as_tensor(global_amax).float()
    # Tensor / tensor: a Python scalar numerator would become reciprocal(g) * 2688 (two roundings).
    s = torch.div(torch.full_like(g, GLOBAL_SCALE_NUMERATOR), g).clamp(max=FP32_MAX)
    fallback = (g == 0) | (s == 0) | torch.isnan(g)
    return torch.where(fallback, torch.ones_like(s), s)


def global_decode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_dec = 1 / S_enc (FP32 division)."""
    s_enc = global_encode_scale(global_amax)
    return torch.div(torch.ones_like(s_enc), s_enc)


#: id(base amax buffer) -> (that buffer, its version, global_decode_scale of all of it); the
#: few most recent buffers (held, so their ids cannot be reused while listed). Shared by the
#: threads (autograd's backward thread reuses the forward's entries) under ``_SHARED_S_DEC_LOCK``:
#: a lookup, reorder and eviction are several steps another thread must not interleave.
_SHARED_S_DEC: "OrderedDict[int, tuple[torch.Tensor, tuple[int, int], torch.Tensor]]" = OrderedDict()
_SHARED_S_DEC_LOCK = threading.Lock()
_SHARED_S_DEC_SIZE = 8


def shared_global_decode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``global_decode_scale(global_amax)``, bitwise, computed once per buffer when
    ``global_amax`` is a contiguous piece of a larger FP32 buffer (an MoE expert's per-row or
    per-tensor amax in the experts' shared one): the elementwise result of the whole buffer,
    sliced. The per-expert GEMMs of a 64-expert layer otherwise spend ~14 small torch ops per
    expert and operand on it. The buffer's version (``utils.rewrites``; shared by its views)
    invalidates the entry after an in-place change; the result is a view: read it, do not modify it."""
    base = global_amax._base
    if (base is None or global_amax.dtype != torch.float32 or base.dtype != torch.float32
            or not base.is_contiguous() or not global_amax.is_contiguous()):
        return global_decode_scale(global_amax)
    key = id(base)
    with _SHARED_S_DEC_LOCK:
        entry = _SHARED_S_DEC.get(key)
        if entry is None or entry[0] is not base or entry[1] != version(base):
            entry = (base, version(base), global_decode_scale(base).reshape(-1))
            _SHARED_S_DEC[key] = entry
            if len(_SHARED_S_DEC) > _SHARED_S_DEC_SIZE:
                _SHARED_S_DEC.popitem(last=False)
        else:
            _SHARED_S_DEC.move_to_end(key)
    start = global_amax.storage_offset() - base.storage_offset()
    return entry[2][start:start + global_amax.numel()].view(global_amax.shape)


def block_decode_scale(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """S_dec_b = e4m3_rne_satfinite(block_amax * (S_enc * fp32(1/6))); NaN stays NaN."""
    return saturating_cast_fp8(block_amax * (s_enc * _rcp6(s_enc)), SCALE_DTYPE)


def block_encode_scale(s_dec_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """min(1 / (fp32(S_dec_b) * S_dec), FP32_MAX); FP32_MAX where S_dec_b is 0."""
    d = s_dec_b.float() * s_dec
    return torch.div(torch.ones_like(d), d).clamp(max=FP32_MAX)


def encode_e2m1(v: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
    """Round FP32 ``v`` (already scaled, |v| <= 6) to 4-bit E2M1 codes (uint8, bit 3 = sign).

    ``rand`` None: round to nearest, ties to the even code. ``rand`` (uniform [0, 1), same
    shape): round |v| up to the next grid value iff rand < (|v| - lo) / (hi - lo).
    NaN gives magnitude code 0; |v| > 6 gives code 7; the sign bit is v's (so -0.0 -> 8).
    """
    a = v.float().abs()
    if rand is None:
        # Counting exceeded midpoints is the comparator chain a kernel uses; NaN exceeds none.
        code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
        for mid, tie_up in _MIDPOINTS:
            code += ((a >= mid) if tie_up else (a > mid)).to(torch.uint8)
    else:
        if rand.shape != v.shape:
            raise ValueError(
                f"rand has shape {tuple(rand.shape)}; it must match v {tuple(v.shape)}."
            )
        grid = device_constant(E2M1_VALUES, a.device)  # no host copy / sync per call
        lo = torch.zeros(a.shape, dtype=torch.long, device=a.device)
        for k in range(1, len(E2M1_VALUES)):
            lo += a >= E2M1_VALUES[k]
        hi = (lo + 1).clamp(max=len(E2M1_VALUES) - 1)
        lo_v, hi_v = grid[lo], grid[hi]
        # On a grid value (or at 6, or NaN) the probability is 0, so nothing ever moves there.
        frac = torch.where(hi > lo, (a - lo_v) / (hi_v - lo_v), torch.zeros_like(a))
        code = (lo + (rand.float() < frac).long()).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, 0..15) to FP32 values (code 8 is -0.0)."""
    grid = device_constant(E2M1_VALUES, codes.device)  # no host copy / sync per call
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., C] into uint8 [..., ceil(C/2)]: element 2i low nibble, 2i+1 high."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp4 expects uint8 codes (0..15), got {codes.dtype}.")
    if codes.shape[-1] % 2:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], 1)], dim=-1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of ``pack_fp4``: uint8 [..., ceil(cols/2)] -> codes [..., cols]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 expects uint8 packed data, got {packed.dtype}.")
    if packed.shape[-1] != ceil_div(cols, 2):
        raise ValueError(
            f"packed data has {packed.shape[-1]} bytes per row, but cols={cols} needs "
            f"{ceil_div(cols, 2)}."
        )
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])[..., :cols]


def _check_2d(x: torch.Tensor, what: str) -> None:
    check_input(x, what)
    check_2d(x, what)


def _global_amax(
    global_amax: torch.Tensor, rows: int, device: torch.device, allow_rows: bool
) -> torch.Tensor:
    """Validate a per-tensor (0-d) or, where allowed, per-row ([R]) global amax; FP32 on device."""
    g = torch.as_tensor(global_amax).to(device=device, dtype=torch.float32)
    if g.dim() == 0:
        return g
    if allow_rows and g.shape == (rows,):
        return g.reshape(rows, 1)
    want = "a 0-d tensor (per-tensor)" + (f" or shape [{rows}] (row-scaled)" if allow_rows else "")
    raise ValueError(f"global_amax has shape {tuple(g.shape)}; pass {want}.")


def _draws(
    x: torch.Tensor,
    stochastic_rounding: bool,
    rand: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor | None:
    if not stochastic_rounding:
        if rand is not None:
            raise ValueError(
                "rand was given but stochastic_rounding=False; pass stochastic_rounding=True."
            )
        return None
    if rand is None:
        return torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    if rand.shape != x.shape:
        raise ValueError(f"rand has shape {tuple(rand.shape)}; it must match x {tuple(x.shape)}.")
    return rand.to(device=x.device, dtype=torch.float32)


def quantize_1d(
    x: torch.Tensor,
    global_amax: torch.Tensor,
    *,
    stochastic_rounding: bool = False,
    rand: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 2D ``x`` with 1x16 blocks along the last dim.

    ``global_amax``: 0-d (per tensor) or [R] (row-scaled, one per row).
    Returns (packed uint8 [R, ceil(C/2)], E4M3 block scales [R, ceil(C/16)]).
    """
    _check_2d(x, "x")
    rows, cols = x.shape
    xf = x.float()
    s_enc = global_encode_scale(_global_amax(global_amax, rows, x.device, allow_rows=True))
    s_dec = torch.div(torch.ones_like(s_enc), s_enc)
    s_dec_b = block_decode_scale(amax_nan(blocks_1d(xf, BLOCK), dim=-1), s_enc)
    encode = expand_blocks_1d(block_encode_scale(s_dec_b, s_dec), BLOCK, cols)
    v = (xf * encode).clamp(-E2M1_MAX, E2M1_MAX)
    codes = encode_e2m1(v, _draws(x, stochastic_rounding, rand, generator))
    return pack_fp4(codes), s_dec_b


def quantize_2d(
    x: torch.Tensor,
    global_amax: torch.Tensor,
    *,
    stochastic_rounding: bool = False,
    rand: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 2D ``x`` with 16x16 tiles and a per-tensor (0-d) global amax.

    Returns (packed uint8 [R, ceil(C/2)], E4M3 tile scales [ceil(R/16), ceil(C/16)]).
    """
    _check_2d(x, "x")
    rows, cols = x.shape
    xf = x.float()
    s_enc = global_encode_scale(_global_amax(global_amax, rows, x.device, allow_rows=False))
    s_dec = torch.div(torch.ones_like(s_enc), s_enc)
    s_dec_b = block_decode_scale(amax_nan(blocks_2d(xf, BLOCK, BLOCK), dim=-1), s_enc)
    encode = expand_blocks_2d(block_encode_scale(s_dec_b, s_dec), BLOCK, BLOCK, rows, cols)
    v = (xf * encode).clamp(-E2M1_MAX, E2M1_MAX)
    codes = encode_e2m1(v, _draws(x, stochastic_rounding, rand, generator))
    return pack_fp4(codes), s_dec_b


def _check_packed(
    packed: torch.Tensor, scale: torch.Tensor, cols: int, scale_shape: tuple[int, int]
) -> None:
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be 2D uint8, got {packed.dtype} {tuple(packed.shape)}.")
    if scale.dtype != SCALE_DTYPE:
        raise TypeError(f"NVFP4 block scales must be {SCALE_DTYPE}, got {scale.dtype}.")
    if tuple(scale.shape) != scale_shape:
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}, expected {scale_shape} for "
            f"{packed.shape[0]} rows x {cols} cols."
        )


def dequantize_1d(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_amax: torch.Tensor,
    cols: int,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize 1x16-block NVFP4: q * fp32(S_dec_b) * S_dec, left to right in FP32."""
    rows = packed.shape[0]
    s_dec = global_decode_scale(_global_amax(global_amax, rows, packed.device, allow_rows=True))
    return (decode_blocks_1d(packed, scale, cols) * s_dec).to(out_dtype)


def decode_blocks_1d(packed: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """q * fp32(S_dec_b) for 1x16 blocks: exact in FP32 (what a GEMM multiplies before its
    epilogue applies the global S_dec)."""
    rows = packed.shape[0]
    _check_packed(packed, scale, cols, (rows, ceil_div(cols, BLOCK)))
    q = decode_e2m1(unpack_fp4(packed, cols))
    return q * expand_blocks_1d(scale.float(), BLOCK, cols)


def dequantize_2d(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_amax: torch.Tensor,
    cols: int,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize 16x16-tile NVFP4: q * fp32(S_dec_b) * S_dec, left to right in FP32."""
    rows = packed.shape[0]
    s_dec = global_decode_scale(_global_amax(global_amax, rows, packed.device, allow_rows=False))
    return (decode_blocks_2d(packed, scale, cols) * s_dec).to(out_dtype)


def decode_blocks_2d(packed: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """q * fp32(S_dec_b) for 16x16 tiles (exact in FP32; global S_dec not applied)."""
    rows = packed.shape[0]
    _check_packed(packed, scale, cols, (ceil_div(rows, BLOCK), ceil_div(cols, BLOCK)))
    q = decode_e2m1(unpack_fp4(packed, cols))
    return q * expand_blocks_2d(scale.float(), BLOCK, BLOCK, rows, cols)
