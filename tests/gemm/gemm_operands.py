"""GEMM operands of every format, and the FP64 reference a GEMM must match (numerics §1).

Shapes: x [M, K], W [N, K], dy [M, N] with M = 40, N = 24, K = 56 — none a multiple of 32,
so every block format pads a partial block, and the NVFP4 RHT copy of a 40-row operand is
stored with 48 (= ceil16) reduction entries. Rows and columns have magnitudes spread over
2**-3 .. 2**3, so per-block scales differ and a GEMM reading the wrong copy (or the wrong
scale) changes the numbers by far more than the tolerance.

The reference: the operand's stored copy as ``storage.gemm_operand`` exposes it (FP32
block-decoded values, exact), promoted to FP64 and multiplied by its per-tensor / per-row
scale in FP64; for an RHT copy paired with a non-RHT one, the inverse transform is applied in
FP64 with R built here from numerics §2.5 (not from the code under test); then an FP64 GEMM.

Tolerance (REL_TOL = 1e-5 on ||out - ref|| / ||ref||): the emulation multiplies exact FP32
values and accumulates in FP32 (K <= 56 terms), then applies the epilogue scales (two more
FP32 roundings) and, for a one-sided RHT, an FP32 inverse transform (4 butterfly levels).
FP32 unit roundoff is u = 2**-24 = 6e-8; a worst-case dot-product bound is ~K u = 3.3e-6
relative to sum |a||b|, and for these random-sign operands ||ref|| is within a small factor
of that sum's norm, while typical errors are ~sqrt(K) u = 4.5e-7. 1e-5 sits above both and
is 1-2 orders of magnitude below any format's quantization error, which is what a wrong copy
or a dropped scale would show.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import pytest
import torch

from hybridfp import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                      IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer, QuantizedTensor)
from hybridfp.tensors import COLUMNWISE, ROWWISE

M, N, K = 40, 24, 56
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REL_TOL = 1e-5
#: layout -> (tensor of A, direction of A, tensor of B, direction of B)
LAYOUT_OPERANDS = {
    "TN": ("x", ROWWISE, "w", ROWWISE),       # fprop  y  = x Wᵀ
    "NN": ("dy", ROWWISE, "w", COLUMNWISE),   # dgrad  dx = dy W
    "NT": ("dy", COLUMNWISE, "x", COLUMNWISE),  # wgrad  dW = dyᵀ x
}
SHAPES = {"x": (M, K), "w": (N, K), "dy": (M, N)}


def _delayed_primed(dtype: torch.dtype) -> Callable[[torch.Tensor], Quantizer]:
    def make(t: torch.Tensor) -> Quantizer:
        q = Float8Quantizer(dtype, amax_history_len=4)
        q(t * 0.75)  # one step of history: this tensor then slightly saturates E4M3 at the top
        q.update_scale()
        return q
    return make


#: format name -> quantizer maker (given the tensor, for delayed scaling's history), or None
#: for a plain tensor used as is.
FORMATS: dict[str, Optional[Callable[[torch.Tensor], Quantizer]]] = {
    "identity_fp32": lambda t: IdentityQuantizer(),
    "identity_bf16": lambda t: IdentityQuantizer(torch.bfloat16),
    "plain": None,
    "fp8_e4m3": lambda t: Float8CurrentScalingQuantizer(E4M3),
    "fp8_e5m2": lambda t: Float8CurrentScalingQuantizer(E5M2),
    "fp8_delayed": _delayed_primed(E4M3),
    "fp8_block_1d": lambda t: Float8BlockQuantizer(block_scaling_dim=1),
    "fp8_block_2d": lambda t: Float8BlockQuantizer(block_scaling_dim=2),
    "mxfp8_1d": lambda t: MXFP8Quantizer(),
    "mxfp8_2d": lambda t: MXFP8Quantizer(with_2d_quantization=True),
    "nvfp4_1d": lambda t: NVFP4Quantizer(),
    "nvfp4_2d": lambda t: NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_rht": lambda t: NVFP4Quantizer(with_rht=True),
    "nvfp4_row_scaled": lambda t: NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False),
}
ROWWISE_ONLY = {"nvfp4_row_scaled"}


def has_copy(fmt: str, direction: str) -> bool:
    return direction == ROWWISE or fmt not in ROWWISE_ONLY


@functools.lru_cache(maxsize=None)
def source(which: str) -> torch.Tensor:
    """x, w or dy (FP32), with row and column magnitudes spread over 2**-3 .. 2**3."""
    seed = {"x": 1, "w": 2, "dy": 3}[which]
    g = torch.Generator().manual_seed(seed)
    r, c = SHAPES[which]
    rs = torch.exp2(torch.randint(-3, 4, (r, 1), generator=g).float())
    cs = torch.exp2(torch.randint(-3, 4, (1, c), generator=g).float())
    return torch.randn(r, c, generator=g) * rs * cs


@functools.lru_cache(maxsize=None)
def operand(fmt: str, which: str) -> torch.Tensor:
    """``source(which)`` in format ``fmt`` (a QuantizedTensor, or the plain tensor)."""
    t = source(which)
    make = FORMATS[fmt]
    return t if make is None else make(t)(t)


# ------------------------------------------------------------------ FP64 reference
def _rht_matrix64() -> torch.Tensor:
    """R = diag(s) H16 / 4 in FP64, from numerics §2.5."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    s = torch.tensor([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=torch.float64)
    return torch.diag(s) @ h / 4


R64 = _rht_matrix64()


def storage_of(t: torch.Tensor, direction: str):
    """The single-format storage holding ``direction`` (plain tensors: None)."""
    return t.qstorage.part(direction) if isinstance(t, QuantizedTensor) else None


def is_rht(t: torch.Tensor, direction: str) -> bool:
    s = storage_of(t, direction)
    return s is not None and s.gemm_operand(direction).rht


def ref_operand(t: torch.Tensor, direction: str, keep_rht: bool = False) -> torch.Tensor:
    """FP64 [m, k] stored-orientation values of ``t``'s ``direction`` copy, scale applied;
    an RHT copy is inverse-transformed unless ``keep_rht`` (then it keeps its padded k)."""
    s = storage_of(t, direction)
    if s is None:
        v = t.reshape(-1, t.shape[-1]).double()
        return v if direction == ROWWISE else v.t()
    op = s.gemm_operand(direction)
    v = op.values.double()
    if op.scale is not None:
        sc = op.scale.double()
        v = v * (sc if sc.dim() == 0 else sc[:, None])
    if op.rht and not keep_rht:
        m, kp = v.shape
        v = (v.reshape(m, kp // 16, 16) @ R64.to(v.device).t()).reshape(m, kp)[:, :op.k]
    return v


def reference(a: torch.Tensor, da: str, b: torch.Tensor, db: str) -> torch.Tensor:
    """FP64 A_s · B_sᵀ of the copies a layout reads (both RHT: stays in the RHT domain)."""
    both = is_rht(a, da) and is_rht(b, db)
    return ref_operand(a, da, both) @ ref_operand(b, db, both).t()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


HAS_CUDA = torch.cuda.is_available()


def gpu(test):
    """Marks a test ``gpu`` and skips it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(test))


@pytest.fixture(autouse=True)
def fresh_reports():
    """Each test sees its own once-per-reason reports of the BF16 backends (a test module
    that imports this fixture uses it for all its tests)."""
    from hybridfp.gemm import bf16_tensorcore
    saved = set(bf16_tensorcore._REPORTED)
    bf16_tensorcore._REPORTED.clear()
    yield
    bf16_tensorcore._REPORTED.clear()
    bf16_tensorcore._REPORTED.update(saved)
