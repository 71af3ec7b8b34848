"""The candidate formats ``hybridfp analyze`` measures for each GEMM, and their cost.

A candidate is applied to both operands of one GEMM (fprop: input and weight; dgrad:
grad_output and weight; wgrad: grad_output and input), as ``hybridfp.factories.per_gemm``
does; the copy each GEMM reads is the one ARCHITECTURE.md's table names (rowwise for fprop,
the weight's columnwise copy for dgrad, both columnwise copies for wgrad).

Cost: ``tier`` is the element width in bits (4, 8, 16); the recommendation takes the
narrowest tier that meets the budget. The bytes per element the GEMM reads are measured on
the operands (payload + scales, ``quantized_nbytes``). ``speed`` is the GEMM speed relative to
BF16 as hybridfp runs the pair on Hopper (measured on an H200 at 8192^3: FP8 per-tensor 1235 vs
705 TFLOP/s; MXFP8 / NVFP4 pairs decode to BF16 first). bench/RESULTS.md's paired figures on an
H100 (FP8 per-tensor 1338 and FP8 block 1199 vs BF16 707 TFLOP/s, MXFP8 pairs 0.91x BF16, NVFP4
pairs 0.79-0.80x) rank the candidates the same way. It is a table, not a measurement of the
user's GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..quantizers import (Float8BlockQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
                          Quantizer)
from ..recipes import DelayedScaling, Float8CurrentScaling, QuantizerRole

GEMMS = ("fprop", "dgrad", "wgrad")
#: Per GEMM: (operand A, its copy), (operand B, its copy) -- numerics §1.
OPERANDS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "fprop": (("input", "rowwise"), ("weight", "rowwise")),
    "dgrad": (("grad_output", "rowwise"), ("weight", "columnwise")),
    "wgrad": (("grad_output", "columnwise"), ("input", "columnwise")),
}


@dataclass(frozen=True)
class Candidate:
    """One candidate format.

    Parameters
    ----------
    name:
        The name used in tables, the budget and the emitted factory.
    tier:
        Element width in bits (the cost rank).
    speed:
        GEMM speed relative to BF16 on Hopper as hybridfp runs it (bench/RESULTS.md).
    gemms:
        The GEMMs it may serve (RHT only changes columnwise copies: wgrad; row-scaled NVFP4
        has no columnwise copy: fprop).
    make:
        tensor_type -> a new quantizer.
    """

    name: str
    tier: int
    speed: float
    gemms: tuple[str, ...]
    make: Callable[[str], Quantizer]


def _role(t: str) -> QuantizerRole:
    return QuantizerRole("linear", t)


CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("high_precision", 16, 1.0, GEMMS, lambda t: IdentityQuantizer()),
    Candidate("fp8_current", 8, 1.75, GEMMS, lambda t: Float8CurrentScaling().quantizer(_role(t))),
    Candidate("fp8_delayed", 8, 1.75, GEMMS, lambda t: DelayedScaling().quantizer(_role(t))),
    Candidate("fp8_block_1d", 8, 1.74, GEMMS, lambda t: Float8BlockQuantizer(block_scaling_dim=1)),
    Candidate("fp8_block_2d", 8, 1.74, GEMMS, lambda t: Float8BlockQuantizer(block_scaling_dim=2)),
    Candidate("mxfp8", 8, 0.99, GEMMS, lambda t: MXFP8Quantizer()),
    Candidate("nvfp4_1d", 4, 0.92, GEMMS, lambda t: NVFP4Quantizer()),
    Candidate("nvfp4_2d", 4, 0.92, GEMMS, lambda t: NVFP4Quantizer(with_2d_quantization=True)),
    Candidate("nvfp4_rht", 4, 0.95, ("wgrad",), lambda t: NVFP4Quantizer(with_rht=True)),
    Candidate("nvfp4_sr", 4, 0.92, GEMMS, lambda t: NVFP4Quantizer(stochastic_rounding=True)),
    Candidate("nvfp4_row_scaled", 4, 0.92, ("fprop",),
              lambda t: NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)),
)}


def candidate(name: str, gemm: Optional[str] = None) -> Candidate:
    """The candidate called ``name`` (checked against ``gemm`` when given).

    Parameters
    ----------
    name:
        A key of ``CANDIDATES``.
    gemm:
        "fprop", "dgrad" or "wgrad" to check the candidate may serve it; None: no check.

    Returns
    -------
    Candidate

    Raises
    ------
    ValueError
        An unknown name, or a candidate that cannot serve ``gemm``.

    Example
    -------
    >>> from hybridfp.analyze import candidate
    >>> candidate("mxfp8").tier
    8
    """
    if name not in CANDIDATES:
        raise ValueError(f"format {name!r} is unknown; use one of {', '.join(CANDIDATES)}.")
    c = CANDIDATES[name]
    if gemm is not None and gemm not in c.gemms:
        raise ValueError(f"format {name!r} cannot serve {gemm}; it serves {', '.join(c.gemms)}.")
    return c


def make_quantizer(name: str, tensor_type: str, direction: Optional[str] = None) -> Quantizer:
    """A new quantizer of candidate ``name`` for a slot, its usage set to ``direction``.

    Parameters
    ----------
    name:
        A key of ``CANDIDATES``.
    tensor_type:
        "input", "weight" or "grad_output" (FP8 per-tensor picks E5M2 for gradients).
    direction:
        "rowwise" or "columnwise" to make only that copy; None: the quantizer's defaults.

    Returns
    -------
    Quantizer

    Example
    -------
    >>> from hybridfp.analyze import make_quantizer
    >>> make_quantizer("fp8_current", "grad_output").dtype
    torch.float8_e5m2
    """
    q = candidate(name).make(tensor_type)
    if direction is not None:
        q.set_usage(rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    return q


def dequantized(q: Quantizer, x: torch.Tensor, direction: str) -> tuple[torch.Tensor, int]:
    """The decoded ``direction`` copy of ``x`` in FP32 and its bytes, as ``hybridfp.report``
    measures them.

    Parameters
    ----------
    q:
        The quantizer (its usage must include ``direction``).
    x:
        The tensor to quantize.
    direction:
        "rowwise" or "columnwise".

    Returns
    -------
    tuple
        (decoded tensor in FP32, ``quantized_nbytes()`` of the quantized tensor).

    Raises
    ------
    MissingDirectionError
        ``q`` did not make the ``direction`` copy.

    Example
    -------
    >>> import torch
    >>> from hybridfp.analyze import make_quantizer
    >>> from hybridfp.analyze.candidates import dequantized
    >>> y, n = dequantized(make_quantizer("mxfp8", "input", "rowwise"), torch.ones(32, 32), "rowwise")
    >>> y.dtype, bool((y == 1).all())
    (torch.float32, True)
    """
    t = q.quantize(x)
    return t.dequantize(torch.float32, direction), t.quantized_nbytes()
