"""Shared quantizer cases and an independent reference for the quantizer tests.

The reference calls ``hybridfp.formats`` directly, as numerics §2 defines each copy:

- per-tensor FP8 and every 2D format: the columnwise copy is the rowwise one transposed;
- 1D block formats: the columnwise copy is the 1D quantization of ``x2.t()``;
- NVFP4 with RHT: ``quantize_1d(apply_rht(x2.t(), x.dtype), amax of that)``;

where ``x2`` is the input with its leading dims flattened (computed here with an explicit
``reshape(rows, cols)``, not with ``formats.common.as_2d``, so the reference does not share
that helper with the code under test).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from hybridfp import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                      IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from hybridfp.formats import fp8_block, fp8_tensorwise, mxfp8, nvfp4, rht
from hybridfp.tensors import COLUMNWISE, ROWWISE

Payload = dict[str, torch.Tensor]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(2, 3, 64), (3, 130), (33, 50), (1, 1), (40,), (), (0, 64)]
# A zero-width last dim: reshape(-1, 0) cannot infer the row count, so as_2d must not use it.
EMPTY_LAST_DIM_SHAPES = [(4, 0), (0, 0)]


def _delayed_primed(**kw: object) -> Float8Quantizer:
    """A delayed-scaling quantizer one update in (amax 7: E4M3 scale 448 / 7 = 64)."""
    q = Float8Quantizer(**kw)
    q.quantize(torch.full((1, 1), 7.0))
    q.update_scale()
    return q


#: name -> factory of a fresh quantizer (both usages on, unless the format cannot).
CASES: dict[str, Callable[[], Quantizer]] = {
    "fp8cs_e4m3": lambda: Float8CurrentScalingQuantizer("e4m3"),
    "fp8cs_e5m2": lambda: Float8CurrentScalingQuantizer(E5M2),
    "fp8cs_pow2": lambda: Float8CurrentScalingQuantizer(force_pow_2_scales=True),
    "fp8cs_e5m2_pow2": lambda: Float8CurrentScalingQuantizer("e5m2", force_pow_2_scales=True),
    # eps = 4 exceeds the amax of most unit-scale test rows, so max(amax, eps) matters.
    "fp8cs_eps": lambda: Float8CurrentScalingQuantizer(amax_epsilon=4.0),
    "fp8_delayed": lambda: _delayed_primed(),
    "fp8_delayed_e5m2": lambda: _delayed_primed(fp8_dtype="e5m2", margin=1),
    "fp8blk_1d": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "fp8blk_2d": lambda: Float8BlockQuantizer(block_scaling_dim=2),
    "fp8blk_1d_e5m2_nopow2": lambda: Float8BlockQuantizer("e5m2", block_scaling_dim=1,
                                                          force_pow_2_scales=False),
    "fp8blk_2d_eps": lambda: Float8BlockQuantizer(block_scaling_dim=2, amax_epsilon=4.0),
    "mxfp8": lambda: MXFP8Quantizer(),
    "mxfp8_floor": lambda: MXFP8Quantizer(scale_rule="floor"),
    "mxfp8_e5m2": lambda: MXFP8Quantizer("e5m2"),
    "mxfp8_2d": lambda: MXFP8Quantizer(with_2d_quantization=True),
    "mxfp8_2d_floor_e5m2": lambda: MXFP8Quantizer(E5M2, with_2d_quantization=True, scale_rule="floor"),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_rht": lambda: NVFP4Quantizer(with_rht=True),
    "nvfp4_rht_pre_amax": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=False),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_sr": lambda: NVFP4Quantizer(stochastic_rounding=True),
    "nvfp4_sr_rht": lambda: NVFP4Quantizer(stochastic_rounding=True, with_rht=True),
    "nvfp4_sr_2d": lambda: NVFP4Quantizer(stochastic_rounding=True, with_2d_quantization=True),
    "nvfp4_sr_generator": lambda: NVFP4Quantizer(stochastic_rounding=True, with_rht=True,
                                                 generator=torch.Generator()),
    "nvfp4_row_scaled": lambda: NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False),
    "identity": lambda: IdentityQuantizer(),
    "identity_bf16": lambda: IdentityQuantizer(torch.bfloat16),
    "identity_fp32": lambda: IdentityQuantizer(torch.float32),
}
#: Cases whose columnwise copy cannot exist (row-scaled NVFP4 is forward-only).
ROWWISE_ONLY = {"nvfp4_row_scaled"}


def make_input(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Normal values with per-row magnitudes 2**-6 .. 2**5 and a few exact zeros and negatives.

    The spread exercises per-block scales, per-tensor saturation/underflow and fp16's range.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.dim() >= 1 and x.numel():
        lead = (*shape[:-1], 1)
        x = x * torch.exp2(torch.randint(-6, 6, lead, generator=g).float())
        x.view(-1)[:: 7] = 0.0
    return x.to(dtype)


def flat2d(x: torch.Tensor) -> torch.Tensor:
    """x as [prod(leading dims), last dim] (0-d and 1-d as one row)."""
    cols = x.shape[-1] if x.dim() else 1
    rows = math.prod(x.shape[:-1]) if x.dim() else 1
    return x.reshape(rows, cols)


def f32(value: float) -> float:
    """A Python float rounded once to FP32."""
    return torch.tensor(value, dtype=torch.float32).item()


def f32_div(a: float, b: float) -> float:
    """a / b as one IEEE FP32 division."""
    return torch.div(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)).item()


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| in FP32, 0 for an empty tensor."""
    return x.float().abs().amax() if x.numel() else torch.zeros(())


def seed_all(q: Quantizer, seed: int) -> None:
    """Reset every random stream a quantizer may draw from (the default one and its generator)."""
    torch.manual_seed(seed)
    for child in (q, getattr(q, "rowwise_quantizer", None), getattr(q, "columnwise_quantizer", None)):
        gen = getattr(child, "generator", None)
        if gen is not None:
            gen.manual_seed(seed)


def _transpose(p: Payload, names: tuple[str, ...]) -> Payload:
    return {k: (v.t().contiguous() if k in names else v) for k, v in p.items()}


def _nvfp4_transpose(p: Payload, cols: int) -> Payload:
    codes = nvfp4.unpack_fp4(p["data"], cols)
    return {"data": nvfp4.pack_fp4(codes.t().contiguous()), "scale": p["scale"].t().contiguous(),
            "amax": p["amax"]}


def reference(q: Quantizer, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True,
              *, delayed_scale: Optional[torch.Tensor] = None) -> dict[str, Optional[Payload]]:
    """The payloads numerics §2 defines for ``q``'s settings, from ``hybridfp.formats`` directly.

    Stochastic rounding: one seed per call, one generator per direction (call :func:`seed_all` first).
    ``delayed_scale``: the scale a delayed quantizer holds before this quantization.
    """
    x2 = flat2d(x)
    rows, cols = x2.shape
    row: Optional[Payload] = None
    col: Optional[Payload] = None
    if isinstance(q, (Float8CurrentScalingQuantizer, Float8Quantizer)):
        if isinstance(q, Float8Quantizer):
            scale = delayed_scale
        else:
            scale = fp8_tensorwise.current_scale(amax(x2), q.dtype, eps=q.amax_epsilon,
                                                 power_2_scale=q.force_pow_2_scales)
        d, s = fp8_tensorwise.quantize(x2, scale, q.dtype)
        full = {"data": d, "scale_inv": s}
        row, col = full, _transpose(full, ("data",))
    elif isinstance(q, Float8BlockQuantizer):
        opts = {"power_2_scale": q.force_pow_2_scales, "eps": q.amax_epsilon}
        if q.block_scaling_dim == 1:
            row = dict(zip(("data", "scale_inv"), fp8_block.quantize_1d(x2, q.dtype, **opts)))
            if columnwise:
                col = dict(zip(("data", "scale_inv"), fp8_block.quantize_1d(x2.t(), q.dtype, **opts)))
        else:
            row = dict(zip(("data", "scale_inv"), fp8_block.quantize_2d(x2, q.dtype, **opts)))
            col = _transpose(row, ("data", "scale_inv"))
    elif isinstance(q, MXFP8Quantizer):
        if q.with_2d_quantization:
            row = dict(zip(("data", "scale"), mxfp8.quantize_2d(x2, q.dtype, rule=q.scale_rule)))
            col = _transpose(row, ("data", "scale"))
        else:
            row = dict(zip(("data", "scale"), mxfp8.quantize_1d(x2, q.dtype, rule=q.scale_rule)))
            if columnwise:
                col = dict(zip(("data", "scale"), mxfp8.quantize_1d(x2.t(), q.dtype, rule=q.scale_rule)))
    elif isinstance(q, NVFP4Quantizer):
        row, col = _nvfp4_reference(q, x, x2, rowwise, columnwise)
    elif isinstance(q, IdentityQuantizer):
        row = col = {"data": x2.to(q.dtype or x.dtype)}
    else:
        raise TypeError(f"no reference for {q!r}")
    return {ROWWISE: row if rowwise else None, COLUMNWISE: col if columnwise else None}


def _nvfp4_reference(q: NVFP4Quantizer, x: torch.Tensor, x2: torch.Tensor, rowwise: bool,
                     columnwise: bool) -> tuple[Optional[Payload], Optional[Payload]]:
    # One seed per quantize() call from the quantizer's generator (or torch's default), then
    # one generator per (seed, direction): row uses seed*2, col seed*2+1 (2D: one quantization).
    seed = None
    if q.stochastic_rounding:
        seed = int(torch.randint(0, 2**62, (1,), generator=q.generator).item())

    def sr_for(direction: int) -> dict:
        if seed is None:
            return {"stochastic_rounding": False}
        gen = torch.Generator(device=x.device).manual_seed((seed * 2 + direction) % 2**63)
        return {"stochastic_rounding": True, "generator": gen}

    row = col = None
    g = amax(x2)
    if q.with_2d_quantization:
        # numerics §2.5: 2D copies hold identical values, so one (possibly random) quantization
        # serves both: the columnwise copy is its transpose.
        d, s = nvfp4.quantize_2d(x2, g, **sr_for(0))
        row = {"data": d, "scale": s, "amax": g}
        col = _nvfp4_transpose(row, x2.shape[1])
        return row, col
    if rowwise:
        ra = x2.float().abs().amax(dim=1) if q.row_scaled_nvfp4 else g
        d, s = nvfp4.quantize_1d(x2, ra, **sr_for(0))
        row = {"data": d, "scale": s, "amax": ra}
    if columnwise:
        xt = x2.t()
        ca = g
        if q.with_rht:
            xt = rht.apply_rht(xt, x.dtype)
            ca = amax(xt) if q.with_post_rht_amax else g
        d, s = nvfp4.quantize_1d(xt, ca, **sr_for(1))
        col = {"data": d, "scale": s, "amax": ca}
    return row, col


def reference_decode(q: Quantizer, p: Payload, direction: str, rows: int, cols: int) -> torch.Tensor:
    """FP32 [rows, cols] value of one reference payload, original orientation (Identity:
    the held tensor itself)."""
    r, c = (rows, cols) if direction == ROWWISE else (cols, rows)
    two_d = getattr(q, "with_2d_quantization", False) or getattr(q, "block_scaling_dim", 1) == 2
    if isinstance(q, (Float8CurrentScalingQuantizer, Float8Quantizer)):
        out = fp8_tensorwise.dequantize(p["data"], p["scale_inv"])
    elif isinstance(q, Float8BlockQuantizer):
        out = (fp8_block.dequantize_2d if two_d else fp8_block.dequantize_1d)(p["data"], p["scale_inv"])
    elif isinstance(q, MXFP8Quantizer):
        out = (mxfp8.dequantize_2d if two_d else mxfp8.dequantize_1d)(p["data"], p["scale"])
    elif isinstance(q, NVFP4Quantizer):
        deq = nvfp4.dequantize_2d if two_d else nvfp4.dequantize_1d
        if direction == COLUMNWISE and q.with_rht:
            padded = -(-rows // 16) * 16
            out = rht.apply_inverse_rht(deq(p["data"], p["scale"], p["amax"], padded), rows)
        else:
            out = deq(p["data"], p["scale"], p["amax"], c)
    else:  # Identity: one [rows, cols] tensor serves both directions, never transposed. Kept
        # in its dtype: a BF16 -> FP32 -> BF16 round trip may change NaN payload bits.
        return p["data"]
    return out if direction == ROWWISE else out.t()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of any tensor (so NaN, -0 and FP8 compare bitwise)."""
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))  # a fresh dense copy: any view's strides are gone
    return flat.view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bytes."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"


def assert_payload(got: Payload, want: Payload, what: str = "") -> None:
    """Same payload names and bitwise-equal tensors."""
    assert sorted(got) == sorted(want), f"{what}: payload names {sorted(got)} != {sorted(want)}"
    for k in want:
        assert_bitwise(got[k], want[k], f"{what}[{k}]")


def assert_same_quantized(a, b, what: str = "") -> None:
    """Two quantized tensors hold the same copies with bitwise-equal payloads and values."""
    assert a.directions() == b.directions(), f"{what}: {a.directions()} != {b.directions()}"
    for d in a.directions():
        assert_payload(a.qstorage.payload(d), b.qstorage.payload(d), f"{what} {d}")
        assert_bitwise(a.dequantize(direction=d), b.dequantize(direction=d), f"{what} {d} dequantized")
