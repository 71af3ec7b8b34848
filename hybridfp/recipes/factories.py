"""Quantizer factories for ``CustomRecipe(qfactory=...)`` (numerics §5).

Base factories reproduce the built-in recipes bit for bit. The zoo composes hybrids; those
recipes are *unvalidated research recipes*: each docstring says what it is for and what
motivates it, not that it converges. All are module-level (picklable), as checkpoints need.
Notation below: ``Hybrid(row=A, col=B[, src])``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..quantizers import (Float8CurrentScalingQuantizer, HybridQuantizer, IdentityQuantizer,
                          MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from .recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                      NVFP4BlockScaling, _fp8_for)
from .roles import QuantizerRole

_RD = "rowwise_dequantized"


def _t(role: Optional[QuantizerRole]) -> Optional[str]:
    return None if role is None else role.tensor_type


# ---------------------------------------------------------------------------- base factories
def high_precision(role: Optional[QuantizerRole]) -> Quantizer:
    """Identity without a cast for every role: each GEMM reads its operands in their own dtype.

    With FP32 master weights the fprop and dgrad GEMMs read an FP32 weight (a BF16 activation
    is widened to meet it): FP32 GEMMs on the exact path. For the BF16 baseline use :func:`bf16`.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> factories.high_precision(hf.QuantizerRole("linear", "weight"))
    IdentityQuantizer(dtype=None)
    """
    return IdentityQuantizer()


def bf16(role: Optional[QuantizerRole]) -> Quantizer:
    """BF16 for every role: each operand cast to BF16, products accumulated in FP32.

    Like ``torch.autocast(dtype=torch.bfloat16)`` on a linear layer, on the same code path as
    the quantized recipes (unlike autocast, the bias stays FP32 in the epilogue and the weight
    gradient is not rounded to BF16): FP32 master weights are read as BF16 copies, so fprop and dgrad
    are BF16 GEMMs; wgrad reads BF16 operands and writes the FP32 weight gradient.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new ``IdentityQuantizer(torch.bfloat16)``.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> factories.bf16(hf.QuantizerRole("linear", "weight"))
    IdentityQuantizer(dtype=torch.bfloat16)
    """
    return IdentityQuantizer(torch.bfloat16)


def delayed_scaling(role: Optional[QuantizerRole]) -> Quantizer:
    """FP8 per-tensor delayed scaling: E4M3 input/weight, E5M2 gradients (= DelayedScaling()).

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer, equal in settings to ``DelayedScaling().quantizer(role)``.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> factories.delayed_scaling(hf.QuantizerRole("linear", "grad_output")).dtype
    torch.float8_e5m2
    """
    return DelayedScaling().quantizer(role)


def current_scaling(role: Optional[QuantizerRole]) -> Quantizer:
    """FP8 per-tensor current scaling: E5M2 for gradients, else E4M3 (= Float8CurrentScaling()).

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer, equal in settings to ``Float8CurrentScaling().quantizer(role)``.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> factories.current_scaling(hf.QuantizerRole("linear", "input")).dtype
    torch.float8_e4m3fn
    """
    return Float8CurrentScaling().quantizer(role)


def float8_block_scaling(role: Optional[QuantizerRole]) -> Quantizer:
    """FP8 block, pow2 scales: 128x128 weights, 1x128 else (= Float8BlockScaling()).

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer, equal in settings to ``Float8BlockScaling().quantizer(role)``.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> factories.float8_block_scaling(hf.QuantizerRole("linear", "weight")).block_scaling_dim
    2
    """
    return Float8BlockScaling().quantizer(role)


def mxfp8(role: Optional[QuantizerRole]) -> Quantizer:
    """MXFP8 E4M3 for every role (= MXFP8BlockScaling()).

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer, equal in settings to ``MXFP8BlockScaling().quantizer(role)``.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> recipe = hf.CustomRecipe(factories.mxfp8)
    >>> recipe.quantizer(None).format_name
    'mxfp8'
    """
    return MXFP8BlockScaling().quantizer(role)


def nvfp4(role: Optional[QuantizerRole]) -> Quantizer:
    """NVFP4 with NVIDIA's per-role defaults (= NVFP4BlockScaling()).

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer, equal in settings to ``NVFP4BlockScaling().quantizer(role)``.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> factories.nvfp4(hf.QuantizerRole("linear", "weight")).with_2d_quantization
    True
    """
    return NVFP4BlockScaling().quantizer(role)


# ---------------------------------------------------------------------------- zoo
def high_precision_fwd_mxfp8_bwd(role: Optional[QuantizerRole]) -> Quantizer:
    """Unvalidated research recipe: fprop in high precision, dgrad/wgrad in MXFP8.

    grad_output -> MXFP8; else -> Hybrid(row=Identity, col=MXFP8). Motivation: NVIDIA's NVFP4
    pretraining report finds most of the low-precision loss gap comes from fprop, so keeping
    only the forward GEMM precise isolates the backward's contribution.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer (a HybridQuantizer except for grad_output).

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> import torch
    >>> q = factories.high_precision_fwd_mxfp8_bwd(hf.QuantizerRole("linear", "input"))
    >>> q(torch.randn(32, 64)).qstorage.describe()
    'Hybrid[Identity/MXFP8] tensor of shape (32, 64)'
    """
    if _t(role) == "grad_output":
        return MXFP8Quantizer()
    return HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer())


def mxfp8_fwd_nvfp4_bwd(role: Optional[QuantizerRole]) -> Quantizer:
    """Unvalidated research recipe: MXFP8 forward, NVFP4 backward.

    input -> Hybrid(row=MXFP8, col=NVFP4 input recipe (RHT)); weight -> Hybrid(row=MXFP8,
    col=NVFP4 1D, rowwise_dequantized); grad_output -> NVFP4 grad recipe (RHT + SR); else ->
    MXFP8. Motivation: gradients tolerate NVFP4 with RHT + SR (NVFP4 report) while the forward
    keeps MXFP8 accuracy; the weight's backward copy is re-quantized from its MXFP8 value so
    dgrad sees the weight the forward used.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> q = factories.mxfp8_fwd_nvfp4_bwd(hf.QuantizerRole("linear", "weight"))
    >>> q.rowwise_quantizer.format_name, q.columnwise_quantizer.format_name, q.columnwise_source
    ('mxfp8', 'nvfp4', 'rowwise_dequantized')
    """
    t = _t(role)
    if t == "input":
        return HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True))
    if t == "weight":
        return HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), _RD)
    if t == "grad_output":
        return NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    return MXFP8Quantizer()


def nvfp4_1d_weight(role: Optional[QuantizerRole]) -> Quantizer:
    """Unvalidated research recipe: NVFP4 with 1D weight blocks and double quantization.

    weight -> Hybrid(row=NVFP4 1D, col=NVFP4 1D, rowwise_dequantized); else -> ``nvfp4``.
    Motivation: 2D 16x16 weight blocks exist so fprop and dgrad see the same weight; quantizing
    the columnwise copy from the rowwise-dequantized value gets that with finer 1D blocks.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> q = factories.nvfp4_1d_weight(hf.QuantizerRole("linear", "weight"))
    >>> q.columnwise_source, q.rowwise_quantizer.with_2d_quantization
    ('rowwise_dequantized', False)
    """
    if _t(role) == "weight":
        return HybridQuantizer(NVFP4Quantizer(), NVFP4Quantizer(), _RD)
    return nvfp4(role)


def mxfp8_fwd_high_precision_bwd(role: Optional[QuantizerRole]) -> Quantizer:
    """Unvalidated research recipe: MXFP8 forward, high-precision backward of the forward value.

    input, weight -> Hybrid(row=MXFP8, col=Identity, rowwise_dequantized); grad_output ->
    Identity. Motivation (RL fine-tuning): gradients must be those of the function the forward
    actually computed, so backward uses the dequantized forward operands, unquantized.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> factories.mxfp8_fwd_high_precision_bwd(hf.QuantizerRole("linear", "grad_output"))
    IdentityQuantizer(dtype=None)
    """
    if _t(role) in ("input", "weight"):
        return HybridQuantizer(MXFP8Quantizer(), IdentityQuantizer(), _RD)
    if _t(role) == "grad_output":
        return IdentityQuantizer()
    return MXFP8Quantizer()


def nvfp4_row_scaled_fwd_mxfp8_bwd(role: Optional[QuantizerRole]) -> Quantizer:
    """Unvalidated research recipe (Composer 2 style MoE): NVFP4 forward for the experts,
    MXFP8 backward from the forward value, MXFP8 everywhere else.

    grouped_linear input -> Hybrid(row=row-scaled NVFP4, col=MXFP8, rowwise_dequantized);
    grouped_linear weight -> Hybrid(row=NVFP4 1D, col=MXFP8, rowwise_dequantized); everything
    else, plain linear included -> MXFP8. Motivation: the Composer 2 report trains MoE experts
    with row-scaled NVFP4 forward GEMMs and MXFP8 backward.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> q = factories.nvfp4_row_scaled_fwd_mxfp8_bwd(hf.QuantizerRole("grouped_linear", "input"))
    >>> q.rowwise_quantizer.row_scaled_nvfp4, q.columnwise_quantizer.format_name
    (True, 'mxfp8')
    >>> factories.nvfp4_row_scaled_fwd_mxfp8_bwd(hf.QuantizerRole("linear", "input")).format_name
    'mxfp8'
    """
    if role is not None and role.module_type == "grouped_linear":
        if role.tensor_type == "input":
            return HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), _RD)
        if role.tensor_type == "weight":
            return HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), _RD)
    return MXFP8Quantizer()


def nvfp4_row_scaled_fwd_high_precision_bwd(role: Optional[QuantizerRole]) -> Quantizer:
    """Unvalidated research recipe: row-scaled NVFP4 forward, high-precision backward of the
    forward value.

    input -> Hybrid(row=row-scaled NVFP4, col=Identity, rowwise_dequantized); weight ->
    Hybrid(row=NVFP4 1D, col=Identity, rowwise_dequantized); grad_output -> Identity; else ->
    Identity. Motivation: measures the forward-only cost of NVFP4 with exact backward math.

    Parameters
    ----------
    role:
        The slot to fill (a QuantizerRole), or None when the consumer is unknown.

    Returns
    -------
    Quantizer
        A new quantizer.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes import factories
    >>> q = factories.nvfp4_row_scaled_fwd_high_precision_bwd(hf.QuantizerRole("linear", "input"))
    >>> q.rowwise_quantizer.row_scaled_nvfp4, q.columnwise_quantizer.format_name
    (True, 'identity')
    """
    t = _t(role)
    if t == "input":
        return HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), IdentityQuantizer(), _RD)
    if t == "weight":
        return HybridQuantizer(NVFP4Quantizer(), IdentityQuantizer(), _RD)
    return IdentityQuantizer()


# ---------------------------------------------------------------------------- per_gemm
def _format_quantizer(name: str, tensor_type: Optional[str]) -> Quantizer:
    """A quantizer for a format name, configured as the built-in recipe would for the role."""
    role = None if tensor_type is None else QuantizerRole("linear", tensor_type)
    makers = {
        "bf16": lambda: IdentityQuantizer(torch.bfloat16), "identity": lambda: IdentityQuantizer(),
        "high_precision": lambda: IdentityQuantizer(),
        "fp8": lambda: Float8CurrentScalingQuantizer(_fp8_for("HYBRID", role)),
        "fp8_current": lambda: Float8CurrentScaling().quantizer(role),
        "fp8_delayed": lambda: DelayedScaling().quantizer(role),
        "fp8_block": lambda: Float8BlockScaling().quantizer(role),
        "mxfp8": lambda: MXFP8Quantizer(),
        "nvfp4": lambda: NVFP4BlockScaling(disable_2d_quantization=True).quantizer(role),
    }
    if name not in makers:
        raise ValueError(f"per_gemm: format {name!r} is unknown; use one of {', '.join(makers)}.")
    return makers[name]()


FORMAT_NAMES = ("bf16", "identity", "high_precision", "fp8", "fp8_current", "fp8_delayed",
                "fp8_block", "mxfp8", "nvfp4")


class per_gemm:  # noqa: N801 - used like a function: per_gemm(fprop=..., dgrad=..., wgrad=...)
    """Factory from three format names, one per GEMM (numerics §1 mapping).

    input -> Hybrid(row=F, col=W); weight -> Hybrid(row=F, col=D); grad_output ->
    Hybrid(row=D, col=W); a plain quantizer where the two directions are equal. Unknown roles
    (and None) get the fprop format. Instances are picklable (a module-level class holding
    three strings) and compare equal when their three names are, so a module keeps its
    quantizers across an equal ``CustomRecipe(per_gemm(...))``.

    Parameters
    ----------
    fprop, dgrad, wgrad:
        Format names (``FORMAT_NAMES``): bf16 (cast to BF16, no quantization), identity /
        high_precision (no quantization, no cast: the operand's own dtype), fp8 (current
        scaling; E5M2 for gradients), fp8_current, fp8_delayed, fp8_block (as their built-in
        recipes make them for the role), mxfp8, nvfp4 (1D; RHT on wgrad operands, SR on
        gradients).

    Returns
    -------
    per_gemm
        A factory: calling it with a role returns a new Quantizer.

    Raises
    ------
    ValueError
        An unknown format name, naming the argument and the choices.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.recipes.factories import per_gemm
    >>> f = per_gemm(fprop="mxfp8", dgrad="mxfp8", wgrad="nvfp4")
    >>> q = f(hf.QuantizerRole("linear", "input"))   # fprop (rowwise) and wgrad (columnwise)
    >>> q.rowwise_quantizer.format_name, q.columnwise_quantizer.format_name
    ('mxfp8', 'nvfp4')
    >>> f(hf.QuantizerRole("linear", "weight")).format_name   # fprop and dgrad agree
    'mxfp8'
    >>> recipe = hf.CustomRecipe(f)
    """

    def __init__(self, fprop: str, dgrad: str, wgrad: str) -> None:
        for arg, n in (("fprop", fprop), ("dgrad", dgrad), ("wgrad", wgrad)):
            if n not in FORMAT_NAMES:  # validate early, naming the argument and the choices
                raise ValueError(f"per_gemm({arg}={n!r}): unknown format; use one of "
                                 f"{', '.join(FORMAT_NAMES)}.")
        self.fprop, self.dgrad, self.wgrad = fprop, dgrad, wgrad

    def __call__(self, role: Optional[QuantizerRole]) -> Quantizer:
        """The quantizer for ``role``.

        Parameters
        ----------
        role:
            The slot to fill, or None (the fprop format).

        Returns
        -------
        Quantizer
            A plain quantizer where the role's two GEMMs use one format, else a
            HybridQuantizer (rowwise: the forward-side GEMM's format).
        """
        t = _t(role)
        row, col = {"input": (self.fprop, self.wgrad), "weight": (self.fprop, self.dgrad),
                    "grad_output": (self.dgrad, self.wgrad)}.get(t or "", (self.fprop, self.fprop))
        if row == col:
            return _format_quantizer(row, t)
        return HybridQuantizer(_format_quantizer(row, t), _format_quantizer(col, t))

    def __repr__(self) -> str:
        return f"per_gemm(fprop={self.fprop!r}, dgrad={self.dgrad!r}, wgrad={self.wgrad!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, per_gemm) and (self.fprop, self.dgrad, self.wgrad) == (
            other.fprop, other.dgrad, other.wgrad)

    def __hash__(self) -> int:
        return hash((self.fprop, self.dgrad, self.wgrad))


#: The base factories by name; each with a built-in recipe is bitwise equal to it (numerics §5).
BASE = {
    "high_precision": high_precision, "bf16": bf16, "delayed_scaling": delayed_scaling,
    "current_scaling": current_scaling, "float8_block_scaling": float8_block_scaling,
    "mxfp8": mxfp8, "nvfp4": nvfp4,
}
#: The zoo factories by name (numerics §5).
ZOO = {
    "high_precision_fwd_mxfp8_bwd": high_precision_fwd_mxfp8_bwd,
    "mxfp8_fwd_nvfp4_bwd": mxfp8_fwd_nvfp4_bwd,
    "nvfp4_1d_weight": nvfp4_1d_weight,
    "mxfp8_fwd_high_precision_bwd": mxfp8_fwd_high_precision_bwd,
    "nvfp4_row_scaled_fwd_mxfp8_bwd": nvfp4_row_scaled_fwd_mxfp8_bwd,
    "nvfp4_row_scaled_fwd_high_precision_bwd": nvfp4_row_scaled_fwd_high_precision_bwd,
}
