"""Format cases for the tensors tests, with references built from ``hybridfp.formats``.

Every case names the plain format of its rowwise copy and of its columnwise copy (a hybrid
has two different ones). From that, this module derives independently of the storages:

- the payload each copy must hold (names, shapes, dtypes, bitwise values) — the formats
  layer run on the flattened 2D input (rowwise) or its transpose (columnwise);
- the dequantized value of each copy, in the original orientation;
- the true byte footprint (tensors shared between copies, or aliased, counted once);
- the dim-0 granularity at which a copy can be sliced without re-quantizing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

import hybridfp
from hybridfp.formats import fp8_block, fp8_tensorwise, mxfp8, nvfp4, rht
from hybridfp.formats.common import amax_nan, ceil_div
from hybridfp.tensors import COLUMNWISE, ROWWISE

E4M3 = torch.float8_e4m3fn
DELAYED_SCALE = 16.0  # a non-trivial delayed scale, set on the quantizer by hand


def _delayed() -> hybridfp.Float8Quantizer:
    q = hybridfp.Float8Quantizer()
    q.scale = torch.tensor(DELAYED_SCALE)
    return q


def _row_scaled() -> hybridfp.NVFP4Quantizer:
    q = hybridfp.NVFP4Quantizer(row_scaled_nvfp4=True)
    q.set_usage(columnwise=False)  # forward-only format
    return q


#: plain format key -> quantizer factory
PLAIN: dict[str, Callable[[], hybridfp.Quantizer]] = {
    "fp8_current": hybridfp.Float8CurrentScalingQuantizer,
    "fp8_delayed": _delayed,
    "fp8_block_1d": lambda: hybridfp.Float8BlockQuantizer(block_scaling_dim=1),
    "fp8_block_2d": lambda: hybridfp.Float8BlockQuantizer(block_scaling_dim=2),
    "mxfp8": hybridfp.MXFP8Quantizer,
    "mxfp8_2d": lambda: hybridfp.MXFP8Quantizer(with_2d_quantization=True),
    "nvfp4": hybridfp.NVFP4Quantizer,
    "nvfp4_rht": lambda: hybridfp.NVFP4Quantizer(with_rht=True),
    "nvfp4_2d": lambda: hybridfp.NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_row_scaled": _row_scaled,
    "identity": hybridfp.IdentityQuantizer,
}

#: dequantize(direction=None) prefers the more precise copy (each storage's ``precision_rank``)
RANK = {"nvfp4": 1, "nvfp4_rht": 1, "nvfp4_2d": 1, "nvfp4_row_scaled": 1, "identity": 3}


@dataclass(frozen=True)
class Case:
    """A quantizer under test: the plain format of each copy, hybrid or not."""

    name: str
    row: str
    col: Optional[str]  # None: the format has no columnwise copy (row-scaled NVFP4)
    hybrid: bool = False
    rowwise_dequantized: bool = False

    def make(self, rowwise: bool = True, columnwise: Optional[bool] = None) -> hybridfp.Quantizer:
        """A fresh quantizer producing the requested copies (default: every copy it has)."""
        columnwise = self.col is not None if columnwise is None else columnwise
        if self.hybrid:
            src = "rowwise_dequantized" if self.rowwise_dequantized else "original"
            q = hybridfp.HybridQuantizer(PLAIN[self.row](), PLAIN[self.col](), src)
        else:
            q = PLAIN[self.row]()
        q.set_usage(rowwise=rowwise, columnwise=columnwise)
        return q

    @property
    def directions(self) -> tuple[str, ...]:
        return (ROWWISE, COLUMNWISE) if self.col is not None else (ROWWISE,)

    def key(self, direction: str) -> str:
        return self.row if direction == ROWWISE else self.col

    def col_source(self, x2: torch.Tensor) -> torch.Tensor:
        """What the columnwise quantizer reads (numerics §3 columnwise_source)."""
        if self.rowwise_dequantized:
            return ref_value(self.row, ROWWISE, x2).float()  # exact FP32 forward value
        return x2

    def payload(self, direction: str, x2: torch.Tensor) -> dict[str, torch.Tensor]:
        src = x2 if direction == ROWWISE else self.col_source(x2)
        return ref_payload(self.key(direction), direction, src)

    def value(self, direction: str, x2: torch.Tensor) -> torch.Tensor:
        """FP32 [R, C] reference dequantized value of one copy."""
        src = x2 if direction == ROWWISE else self.col_source(x2)
        return ref_value(self.key(direction), direction, src)

    def preferred(self) -> str:
        if not self.hybrid:
            return ROWWISE
        return COLUMNWISE if RANK.get(self.col, 2) > RANK.get(self.row, 2) else ROWWISE

    def granularity(self, directions: Optional[tuple[str, ...]] = None) -> int:
        return math.lcm(*(GRANULARITY[self.key(d)][d] for d in (directions or self.directions)))


CASES = [Case(k, k, None if k == "nvfp4_row_scaled" else k) for k in PLAIN] + [
    Case("hybrid_nvfp4_mxfp8", "nvfp4", "mxfp8", hybrid=True),
    Case("hybrid_mxfp8_identity_rowdq", "mxfp8", "identity", hybrid=True, rowwise_dequantized=True),
    Case("hybrid_identity_mxfp8", "identity", "mxfp8", hybrid=True),
    Case("hybrid_rownvfp4_mxfp8_rowdq", "nvfp4_row_scaled", "mxfp8", hybrid=True,
         rowwise_dequantized=True),
    Case("hybrid_block1d_nvfp4rht", "fp8_block_1d", "nvfp4_rht", hybrid=True),
    Case("hybrid_mxfp8_nvfp4_rowdq", "mxfp8", "nvfp4", hybrid=True, rowwise_dequantized=True),
]
CASE_IDS = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}

#: Rows per dim-0 cut that keep every block of a copy whole (numerics §2 block shapes).
GRANULARITY = {
    "fp8_current": {ROWWISE: 1, COLUMNWISE: 1},
    "fp8_delayed": {ROWWISE: 1, COLUMNWISE: 1},
    "fp8_block_1d": {ROWWISE: 1, COLUMNWISE: 128},
    "fp8_block_2d": {ROWWISE: 128, COLUMNWISE: 128},
    "mxfp8": {ROWWISE: 1, COLUMNWISE: 32},
    "mxfp8_2d": {ROWWISE: 32, COLUMNWISE: 32},
    "nvfp4": {ROWWISE: 1, COLUMNWISE: 16},
    "nvfp4_rht": {ROWWISE: 1, COLUMNWISE: 16},
    "nvfp4_2d": {ROWWISE: 16, COLUMNWISE: 16},
    "nvfp4_row_scaled": {ROWWISE: 1},
    "identity": {ROWWISE: 1, COLUMNWISE: 1},
}


def case_params(names: Optional[list[str]] = None) -> list:
    """``pytest.param`` per case (all by default), ids = case names."""
    return [pytest.param(BY_NAME[n], id=n) for n in (names or CASE_IDS)]


# ---------------------------------------------------------------------- references
def _cols_of(d: str, x2: torch.Tensor) -> torch.Tensor:
    """The 2D tensor a copy is quantized from: x2 (rowwise) or its transpose (columnwise)."""
    return x2 if d == ROWWISE else x2.t()


def ref_payload(key: str, d: str, x2: torch.Tensor) -> dict[str, torch.Tensor]:
    """The encoded tensors of one copy, straight from the formats layer."""
    src = _cols_of(d, x2)
    if key in ("fp8_current", "fp8_delayed"):
        amax = amax_nan(x2)
        scale = (fp8_tensorwise.current_scale(amax, E4M3) if key == "fp8_current"
                 else torch.tensor(DELAYED_SCALE))
        data, scale_inv = fp8_tensorwise.quantize(src, scale, E4M3)
        return {"data": data, "scale_inv": scale_inv}
    if key == "fp8_block_1d":
        return dict(zip(("data", "scale_inv"), fp8_block.quantize_1d(src, E4M3)))
    if key == "fp8_block_2d":  # the columnwise copy is the same tiles, transposed
        return dict(zip(("data", "scale_inv"), fp8_block.quantize_2d(src, E4M3)))
    if key == "mxfp8":
        return dict(zip(("data", "scale"), mxfp8.quantize_1d(src, E4M3)))
    if key == "mxfp8_2d":
        return dict(zip(("data", "scale"), mxfp8.quantize_2d(src, E4M3)))
    if key in ("nvfp4", "nvfp4_rht", "nvfp4_2d"):
        if key == "nvfp4_rht" and d == COLUMNWISE:
            src = rht.apply_rht(src, out_dtype=x2.dtype)  # post-RHT amax (NVIDIA default)
            amax = amax_nan(src)
        else:
            amax = amax_nan(x2)
        quant = nvfp4.quantize_2d if key == "nvfp4_2d" else nvfp4.quantize_1d
        data, scale = quant(src, amax)
        return {"data": data, "scale": scale, "amax": amax}
    if key == "nvfp4_row_scaled":
        amax = amax_nan(x2, dim=1)
        data, scale = nvfp4.quantize_1d(x2, amax)
        return {"data": data, "scale": scale, "amax": amax}
    if key == "identity":
        return {"data": x2}
    raise KeyError(key)


def ref_value(key: str, d: str, x2: torch.Tensor) -> torch.Tensor:
    """FP32 [R, C] dequantized value of one copy, original orientation."""
    p = ref_payload(key, d, x2)
    rows, cols = x2.shape
    n = cols if d == ROWWISE else rows  # logical length of the stored rows
    if key in ("fp8_current", "fp8_delayed"):
        out = fp8_tensorwise.dequantize(p["data"], p["scale_inv"])
    elif key == "fp8_block_1d":
        out = fp8_block.dequantize_1d(p["data"], p["scale_inv"])
    elif key == "fp8_block_2d":
        out = fp8_block.dequantize_2d(p["data"], p["scale_inv"])
    elif key == "mxfp8":
        out = mxfp8.dequantize_1d(p["data"], p["scale"])
    elif key == "mxfp8_2d":
        out = mxfp8.dequantize_2d(p["data"], p["scale"])
    elif key == "nvfp4_2d":
        out = nvfp4.dequantize_2d(p["data"], p["scale"], p["amax"], n)
    elif key == "nvfp4_rht" and d == COLUMNWISE:
        stored = ceil_div(rows, 16) * 16
        y = nvfp4.dequantize_1d(p["data"], p["scale"], p["amax"], stored)
        out = rht.apply_inverse_rht(y, rows)
    elif key.startswith("nvfp4"):
        out = nvfp4.dequantize_1d(p["data"], p["scale"], p["amax"], n)
    else:  # identity: one [R, C] tensor in the original orientation serves both copies
        return p["data"].float()
    return out if d == ROWWISE else out.t()


# ---------------------------------------------------------------------- byte footprint
#: (shape, dtype, tag): tag "shared" = one tensor for both copies; "T" = the columnwise
#: tensor is the rowwise one transposed (.t().contiguous()), which aliases it when the
#: transpose of a tensor with a dimension <= 1 is already contiguous.
Layout = dict[str, tuple[tuple[int, ...], torch.dtype, str]]


def layout(key: str, d: str, rows: int, cols: int, hp: torch.dtype = torch.float32) -> Layout:
    """Expected payload names, shapes and dtypes of one copy (numerics §2, storage docstrings)."""
    r, c = (rows, cols) if d == ROWWISE else (cols, rows)
    f32, u8 = torch.float32, torch.uint8
    col_t = "T" if d == COLUMNWISE else ""
    if key in ("fp8_current", "fp8_delayed"):
        return {"data": ((r, c), E4M3, col_t), "scale_inv": ((), f32, "shared")}
    if key == "fp8_block_1d":
        return {"data": ((r, c), E4M3, ""), "scale_inv": ((r, ceil_div(c, 128)), f32, "")}
    if key == "fp8_block_2d":
        return {"data": ((r, c), E4M3, col_t),
                "scale_inv": ((ceil_div(r, 128), ceil_div(c, 128)), f32, col_t)}
    if key == "mxfp8":
        return {"data": ((r, c), E4M3, ""), "scale": ((r, ceil_div(c, 32)), u8, "")}
    if key == "mxfp8_2d":
        return {"data": ((r, c), E4M3, col_t), "scale": ((ceil_div(r, 32), ceil_div(c, 32)), u8, col_t)}
    if key in ("nvfp4", "nvfp4_rht"):
        rht_col = key == "nvfp4_rht" and d == COLUMNWISE
        c_stored = ceil_div(c, 16) * 16 if rht_col else c  # RHT pads R to 16-element tiles
        return {"data": ((r, ceil_div(c_stored, 2)), u8, ""),
                "scale": ((r, ceil_div(c, 16)), E4M3, ""),
                "amax": ((), f32, "" if rht_col else "shared")}
    if key == "nvfp4_2d":  # codes are repacked for the transpose; tile scales transposed
        return {"data": ((r, ceil_div(c, 2)), u8, ""),
                "scale": ((ceil_div(r, 16), ceil_div(c, 16)), E4M3, col_t), "amax": ((), f32, "shared")}
    if key == "nvfp4_row_scaled":
        return {"data": ((r, ceil_div(c, 2)), u8, ""), "scale": ((r, ceil_div(c, 16)), E4M3, ""),
                "amax": ((r,), f32, "")}
    if key == "identity":
        return {"data": ((rows, cols), hp, "shared")}  # one [R, C] tensor serves both
    raise KeyError(key)


def expected_nbytes(case: Case, rows: int, cols: int, directions: tuple[str, ...]) -> int:
    """Bytes the payloads occupy, each piece of memory counted once."""
    total = 0
    both = len(directions) == 2 and not case.hybrid  # a hybrid's parts share nothing
    for d in directions:
        for shape, dtype, tag in layout(case.key(d), d, rows, cols).values():
            if d == COLUMNWISE and both and (tag == "shared" or (tag == "T" and min(shape) <= 1)):
                continue
            total += math.prod(shape) * dtype.itemsize
    return total


# ---------------------------------------------------------------------- comparisons
def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bits (torch.equal on FP8 / NaN-safe)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape, dtype and bits."""
    assert not isinstance(actual, hybridfp.QuantizedTensor)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert torch.equal(bits(actual.cpu()), bits(expected.cpu()))


def assert_same_payloads(a: hybridfp.QuantizedTensor, b: hybridfp.QuantizedTensor) -> None:
    """Two quantized tensors hold the same copies with bitwise-equal payload tensors."""
    sa, sb = a.qstorage, b.qstorage
    assert type(sa) is type(sb) and sa.shape == sb.shape and sa.meta == sb.meta
    assert a.directions() == b.directions()
    for d in a.directions():
        pa, pb = sa.payloads[d], sb.payloads[d]
        assert sorted(pa) == sorted(pb)
        for n in pa:
            assert_bitwise(pa[n], pb[n])


def data_ptrs(t: hybridfp.QuantizedTensor) -> list[int]:
    return [x.data_ptr() for x in t.qstorage.tensors()]


def make_input(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Normal values with a few outliers, so blocks get different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.numel():
        x.view(-1)[:: max(1, x.numel() // 7)] *= 40.0
    return x.to(dtype)


def as2d(x: torch.Tensor) -> torch.Tensor:
    """[prod(leading), last] view (also for a zero-size last dimension; 0-d is [1, 1])."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def quantize(case: Case, x: torch.Tensor, **usage: bool) -> hybridfp.QuantizedTensor:
    return case.make(**usage)(x)
