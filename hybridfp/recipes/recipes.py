"""Recipes: what quantizer each role gets (numerics §4-5).

A recipe answers ``quantizer(role) -> Quantizer`` once per slot when a module builds its
quantizers. Built-in recipes are dataclasses with TransformerEngine's names and options;
``CustomRecipe(qfactory=f)`` lets ``f(role)`` decide. ``key()`` identifies the configuration:
modules rebuild their quantizers (and drop cached quantized weights) when it changes, so a
recipe edited or swapped between steps takes effect at the next step.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

from ..quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                          HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from .roles import QuantizerRole

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FORMATS = ("E4M3", "E5M2", "HYBRID")
_GRADS = ("grad_output", "grad_input")
#: The values of ``backward_override`` (TransformerEngine's): None keeps the quantized backward;
#: "high_precision" runs dgrad / wgrad in high precision on the original input and weight;
#: "dequantized" runs them in high precision on the forward's dequantized rowwise copies.
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def check_backward_override(value: object, who: str) -> None:
    """Raise a ValueError naming ``who`` unless ``value`` is one of ``BACKWARD_OVERRIDES``.

    Parameters
    ----------
    value:
        The ``backward_override`` to check.
    who:
        The recipe (class name) it belongs to, for the message.

    Raises
    ------
    ValueError
        ``value`` is not None, "high_precision" or "dequantized".

    Example
    -------
    >>> from hybridfp.recipes.recipes import check_backward_override
    >>> check_backward_override("dequantized", "MXFP8BlockScaling")   # accepted: no error
    """
    if not (value is None or (isinstance(value, str) and value in BACKWARD_OVERRIDES)):
        raise ValueError(f"{who}: backward_override={value!r} is unknown; use None (quantized "
                         "backward), 'high_precision' (dgrad / wgrad on the original input and "
                         "weight) or 'dequantized' (dgrad / wgrad on the forward's dequantized "
                         "input and weight).")


def _is_grad(role: Optional[QuantizerRole]) -> bool:
    return role is not None and role.tensor_type in _GRADS


def _tensor_type(role: Optional[QuantizerRole]) -> Optional[str]:
    return None if role is None else role.tensor_type


def _fp8_for(fp8_format: str, role: Optional[QuantizerRole]) -> torch.dtype:
    """E4M3 forward / E5M2 gradients for "HYBRID"; the named format otherwise."""
    if fp8_format not in _FORMATS:
        raise ValueError(f"fp8_format={fp8_format!r} is unknown; use one of {', '.join(_FORMATS)}.")
    if fp8_format == "HYBRID":
        return E5M2 if _is_grad(role) else E4M3
    return E5M2 if fp8_format == "E5M2" else E4M3


class Recipe(ABC):
    """Base: maps a role to a new quantizer.

    Subclass it (and implement :meth:`quantizer`) for a recipe of your own; a subclass that is
    not a dataclass is identified by the recipe object itself (see :meth:`key`).

    Attributes
    ----------
    fprop_fast_accumulation:
        Run fprop's FP8 per-tensor GEMMs with cuBLAS fast accumulation (see
        :func:`hybridfp.gemm.gemm`; outside numerics §1, hence off unless a recipe turns it
        on). dgrad / wgrad and ``GroupedLinear`` experts always promote to FP32.
    backward_override:
        None (default): dgrad and wgrad quantized as the roles say. "high_precision": they run
        in high precision on the original operands (the saved input, the high-precision
        weight, dy unquantized); the forward stays quantized. "dequantized": they run in high
        precision on the forward's rowwise copies of x and W, dequantized (dy unquantized), so
        backward sees exactly the values the forward multiplied. ``Linear``,
        ``LayerNormLinear`` and ``LayerNormMLP`` honour it; ``GroupedLinear`` refuses it.
        Fixed when the recipe is made: assigning it raises ``dataclasses.FrozenInstanceError``
        (``dataclasses.replace(recipe, backward_override=...)`` makes a recipe with another).

    Example
    -------
    >>> import hybridfp as hf
    >>> class AllMXFP8(hf.Recipe):
    ...     def quantizer(self, role):
    ...         return hf.MXFP8Quantizer()
    >>> AllMXFP8().quantizer(hf.QuantizerRole("linear", "weight")).format_name
    'mxfp8'
    """

    fprop_fast_accumulation: bool = False
    backward_override: Optional[str] = None

    def __setattr__(self, name: str, value: Any) -> None:
        # backward_override is checked when the recipe is made; an assignment afterwards would
        # skip that check (and the DelayedScaling refusal), so it is set once only
        if name == "backward_override" and name in self.__dict__:
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.backward_override is fixed when the recipe is made; make "
                "a new recipe, e.g. dataclasses.replace(recipe, backward_override=...).")
        super().__setattr__(name, value)

    @abstractmethod
    def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
        """A fresh quantizer for ``role``.

        Parameters
        ----------
        role:
            The slot to fill; None when the consumer is unknown.

        Returns
        -------
        Quantizer
            A new quantizer, not shared with any other slot.

        Example
        -------
        >>> import hybridfp as hf
        >>> q = hf.Float8CurrentScaling().quantizer(hf.QuantizerRole("linear", "grad_output"))
        >>> q.dtype
        torch.float8_e5m2
        """

    def key(self) -> Hashable:
        """Identity of the configuration: a change makes modules rebuild their quantizers.

        Dataclass recipes: their field values. Any other recipe: the recipe object itself
        (its ``__eq__``), unless it overrides ``key``.

        Returns
        -------
        Hashable
            Equal keys mean modules keep their quantizers and cached weights.

        Example
        -------
        >>> import hybridfp as hf
        >>> hf.MXFP8BlockScaling().key() == hf.MXFP8BlockScaling().key()
        True
        >>> hf.MXFP8BlockScaling().key() == hf.MXFP8BlockScaling(scale_rule="floor").key()
        False
        """
        if not dataclasses.is_dataclass(self):
            return (type(self).__name__, _FactoryKey(self))
        fields = tuple((f.name, repr(getattr(self, f.name))) for f in dataclasses.fields(self))
        return (type(self).__name__, fields)


class _BuiltinRecipe(Recipe):
    """Base of the dataclass recipes: options are checked when the recipe is made, not at the
    first forward (one quantizer per GEMM operand role must build)."""

    def __post_init__(self) -> None:
        check_backward_override(self.backward_override, type(self).__name__)
        for t in ("input", "weight", "grad_output"):
            try:
                self.quantizer(QuantizerRole("linear", t))
            except ValueError as e:
                raise ValueError(f"{type(self).__name__}: {e}") from None


@dataclass
class DelayedScaling(_BuiltinRecipe):
    """FP8 per-tensor delayed scaling (scale from the amax history, updated per step):
    :class:`~hybridfp.Float8Quantizer` for every role (numerics §2.2). The scales are updated
    when an :func:`~hybridfp.autocast` region ends.

    Parameters
    ----------
    fp8_format:
        "HYBRID" (E4M3 forward, E5M2 for gradients), "E4M3" or "E5M2".
    margin:
        An integer in [0, ``max_margin``] of the formats used (8 for E4M3, 15 for E5M2:
        beyond it the scale of a large amax or its inverse leaves FP32's range).
    amax_history_len:
        An integer >= 1.
    amax_compute_algo:
        "max" or "most_recent".
    fprop_fast_accumulation:
        See :class:`Recipe`.
    backward_override:
        None only (as TransformerEngine, delayed scaling refuses the other values: the
        gradient quantizers' amax history would stop moving while the recipe still owns them).

    Raises
    ------
    ValueError
        When the recipe is made, naming the option out of range and the range;
        ``backward_override`` other than None.

    Example
    -------
    >>> import hybridfp as hf
    >>> r = hf.DelayedScaling(amax_history_len=16)
    >>> r.quantizer(hf.QuantizerRole("linear", "grad_output")).dtype
    torch.float8_e5m2
    """

    fp8_format: str = "HYBRID"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fprop_fast_accumulation: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        if self.backward_override is not None:
            check_backward_override(self.backward_override, "DelayedScaling")
            raise ValueError(f"DelayedScaling: backward_override={self.backward_override!r} is not "
                             "supported with delayed scaling (as in TransformerEngine); use None, "
                             "or a current-scaling or block recipe (e.g. Float8CurrentScaling) "
                             "for a high-precision backward.")
        super().__post_init__()

    def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
        """Float8Quantizer with this recipe's history settings."""
        return Float8Quantizer(_fp8_for(self.fp8_format, role), margin=self.margin,
                               amax_history_len=self.amax_history_len,
                               amax_compute_algo=self.amax_compute_algo)


@dataclass
class Float8CurrentScaling(_BuiltinRecipe):
    """FP8 per-tensor current scaling (each tensor's own amax):
    :class:`~hybridfp.Float8CurrentScalingQuantizer` for every role (numerics §2.1).

    Parameters
    ----------
    fp8_format:
        "HYBRID" (E4M3 forward, E5M2 for gradients), "E4M3" or "E5M2".
    use_power_2_scales:
        Round scales down to powers of two.
    amax_epsilon:
        The amax floor: a finite number >= 0.
    fprop_fast_accumulation:
        See :class:`Recipe`.
    backward_override:
        None, "high_precision" or "dequantized"; see :class:`Recipe`.

    Raises
    ------
    ValueError
        When the recipe is made: an unknown ``fp8_format`` or ``backward_override``, or an
        invalid ``amax_epsilon``.

    Example
    -------
    >>> import hybridfp as hf
    >>> q = hf.Float8CurrentScaling(fp8_format="E4M3").quantizer(None)
    >>> q.format_name, q.dtype
    ('fp8_current', torch.float8_e4m3fn)
    """

    fp8_format: str = "HYBRID"
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    fprop_fast_accumulation: bool = False
    backward_override: Optional[str] = None

    def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
        """Float8CurrentScalingQuantizer: E5M2 for gradients under "HYBRID", else E4M3."""
        return Float8CurrentScalingQuantizer(_fp8_for(self.fp8_format, role),
                                             force_pow_2_scales=self.use_power_2_scales,
                                             amax_epsilon=self.amax_epsilon)


@dataclass
class Float8BlockScaling(_BuiltinRecipe):
    """FP8 block scaling: 1x128 activations/gradients, 128x128 weights (DeepSeek-V3):
    :class:`~hybridfp.Float8BlockQuantizer` for every role (numerics §2.3).

    Parameters
    ----------
    fp8_format:
        "E4M3" (default), "E5M2" or "HYBRID" (E5M2 for gradients).
    x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim:
        1 (1x128 blocks) or 2 (128x128 tiles) for activations, weights and gradients.
    use_power_2_scales:
        Round block scales down to powers of two.
    amax_epsilon:
        A floor >= 0 for each block's amax.
    backward_override:
        None, "high_precision" or "dequantized"; see :class:`Recipe`.

    Raises
    ------
    ValueError
        When the recipe is made: a block dim other than 1 or 2, an unknown ``fp8_format`` or
        ``backward_override``, or a negative ``amax_epsilon``.

    Example
    -------
    >>> import hybridfp as hf
    >>> r = hf.Float8BlockScaling()
    >>> r.quantizer(hf.QuantizerRole("linear", "weight")).block_scaling_dim
    2
    >>> r.quantizer(hf.QuantizerRole("linear", "input")).block_scaling_dim
    1
    """

    fp8_format: str = "E4M3"
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    use_power_2_scales: bool = True
    amax_epsilon: float = 0.0
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        for f in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, f) not in (1, 2):
                raise ValueError(f"Float8BlockScaling: {f}={getattr(self, f)!r} is unknown; use 1 "
                                 "(1x128 blocks) or 2 (128x128 tiles).")
        super().__post_init__()

    def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
        """Float8BlockQuantizer with the block shape of the role."""
        t = _tensor_type(role)
        dim = (self.w_block_scaling_dim if t == "weight"
               else self.grad_block_scaling_dim if _is_grad(role) else self.x_block_scaling_dim)
        return Float8BlockQuantizer(_fp8_for(self.fp8_format, role), block_scaling_dim=dim,
                                    force_pow_2_scales=self.use_power_2_scales,
                                    amax_epsilon=self.amax_epsilon)


@dataclass
class MXFP8BlockScaling(_BuiltinRecipe):
    """MXFP8 (E8M0 scale per 32 elements) for every role: :class:`~hybridfp.MXFP8Quantizer`
    (numerics §2.4).

    Parameters
    ----------
    fp8_format:
        "E4M3" (default), "E5M2" or "HYBRID" (E5M2 for gradients).
    scale_rule:
        "rceil" (default) or "floor".
    weight_2d:
        32x32 tiles for weights (both copies then hold the same values).
    backward_override:
        None, "high_precision" or "dequantized"; see :class:`Recipe`.

    Raises
    ------
    ValueError
        When the recipe is made: an unknown ``fp8_format``, ``scale_rule`` or
        ``backward_override``.

    Example
    -------
    >>> import hybridfp as hf
    >>> q = hf.MXFP8BlockScaling(weight_2d=True).quantizer(hf.QuantizerRole("linear", "weight"))
    >>> q.with_2d_quantization
    True
    """

    fp8_format: str = "E4M3"
    scale_rule: str = "rceil"
    weight_2d: bool = False
    backward_override: Optional[str] = None

    def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
        """MXFP8Quantizer (32x32 tiles for weights when ``weight_2d``)."""
        return MXFP8Quantizer(_fp8_for(self.fp8_format, role), scale_rule=self.scale_rule,
                              with_2d_quantization=self.weight_2d and _tensor_type(role) == "weight")


@dataclass
class NVFP4BlockScaling(_BuiltinRecipe):
    """NVFP4 with NVIDIA's per-role defaults (numerics §2.5), each switch can be turned off.

    weight: 2D 16x16, no RHT, no SR. Gradients (grad_output, grad_input): 1D, RHT on the
    columnwise copy, SR. input and output: 1D, RHT on the columnwise copy, no SR.
    ``row_scaled_activation`` makes the input's rowwise copy row-scaled (its columnwise copy
    stays per-tensor NVFP4).

    Parameters
    ----------
    disable_rht:
        No random Hadamard transform on any columnwise copy.
    disable_stochastic_rounding:
        Round gradients to nearest.
    disable_2d_quantization:
        1D blocks for weights.
    row_scaled_activation:
        The input becomes ``HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True),
        NVFP4Quantizer(with_rht=...))``.
    backward_override:
        None, "high_precision" or "dequantized"; see :class:`Recipe`.

    Raises
    ------
    ValueError
        When the recipe is made: an unknown ``backward_override``.

    Example
    -------
    >>> import hybridfp as hf
    >>> q = hf.NVFP4BlockScaling().quantizer(hf.QuantizerRole("linear", "grad_output"))
    >>> q.with_rht, q.stochastic_rounding
    (True, True)
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    backward_override: Optional[str] = None

    def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
        """NVFP4Quantizer configured for the role."""
        t = _tensor_type(role)
        if t == "weight":
            return NVFP4Quantizer(with_2d_quantization=not self.disable_2d_quantization)
        if _is_grad(role):  # every backward slot rounds stochastically, as TE's recipe does
            return NVFP4Quantizer(with_rht=not self.disable_rht,
                                  stochastic_rounding=not self.disable_stochastic_rounding)
        if t == "input" and self.row_scaled_activation:
            return HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True),
                                   NVFP4Quantizer(with_rht=not self.disable_rht))
        return NVFP4Quantizer(with_rht=not self.disable_rht)


class CustomRecipe(Recipe):
    """A recipe whose quantizers come from ``qfactory(role)``.

    The factory is called once per quantizer slot when a module builds its quantizers; it
    must return a Quantizer (IdentityQuantizer() for a slot that stays in high precision).
    Use a module-level function (picklable) so the recipe can be saved with a checkpoint.
    Modules rebuild their quantizers when the factory object changes (see :meth:`key`).

    Parameters
    ----------
    qfactory:
        A callable ``role -> Quantizer`` (``role`` a :class:`QuantizerRole` or None), e.g. one
        of ``hybridfp.recipes.factories`` or ``factories.per_gemm(...)``.
    fprop_fast_accumulation:
        A bool; see :class:`Recipe`.
    backward_override:
        None, "high_precision" or "dequantized"; see :class:`Recipe`.

    Raises
    ------
    TypeError
        ``qfactory`` is not callable or ``fprop_fast_accumulation`` is not a bool. Later,
        from :meth:`quantizer`: the factory returned something other than a Quantizer.
    ValueError
        An unknown ``backward_override``. From :meth:`quantizer`: the factory returned None.

    Example
    -------
    >>> import hybridfp as hf
    >>> def fp8_fwd_bf16_bwd(role):
    ...     if role is not None and role.tensor_type in ("grad_output", "grad_input"):
    ...         return hf.IdentityQuantizer()
    ...     return hf.Float8CurrentScalingQuantizer()
    >>> r = hf.CustomRecipe(fp8_fwd_bf16_bwd)
    >>> r.quantizer(hf.QuantizerRole("linear", "grad_output")).format_name
    'identity'
    """

    def __init__(self, qfactory: Callable[[Optional[QuantizerRole]], Quantizer], *,
                 fprop_fast_accumulation: bool = False, backward_override: Optional[str] = None) -> None:
        if not callable(qfactory):
            raise TypeError(f"CustomRecipe(qfactory=...) needs a callable role -> Quantizer; got "
                            f"{type(qfactory).__name__}.")
        if not isinstance(fprop_fast_accumulation, bool):
            raise TypeError(f"CustomRecipe(fprop_fast_accumulation=...) must be a bool; got "
                            f"{fprop_fast_accumulation!r}.")
        check_backward_override(backward_override, "CustomRecipe")
        self.qfactory = qfactory
        self.fprop_fast_accumulation = fprop_fast_accumulation
        self.backward_override = backward_override

    def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
        """Call the factory and check what it returned."""
        q = self.qfactory(role)
        if q is None:
            raise ValueError(f"qfactory {_name(self.qfactory)} returned None for role {role}; return "
                             "hybridfp.IdentityQuantizer() for a slot that should stay in high "
                             "precision.")
        if not isinstance(q, Quantizer):
            raise TypeError(f"qfactory {_name(self.qfactory)} returned {type(q).__name__} for role "
                            f"{role}; it must return a hybridfp Quantizer.")
        return q

    def key(self) -> Hashable:
        """The factory itself: swapping the factory rebuilds quantizers (see _FactoryKey)."""
        return ("CustomRecipe", _FactoryKey(self.qfactory), self.fprop_fast_accumulation,
                self.backward_override)

    def __repr__(self) -> str:
        fast = ", fprop_fast_accumulation=True" if self.fprop_fast_accumulation else ""
        override = f", backward_override={self.backward_override!r}" if self.backward_override else ""
        return f"CustomRecipe(qfactory={_name(self.qfactory)}{fast}{override})"


class _FactoryKey:
    """A CustomRecipe's configuration key: its factory object, not the factory's ``id``
    (also the key of a user recipe class that is not a dataclass: the recipe object).

    A module keeps the key of the recipe it built its quantizers for; holding the factory keeps
    it alive, so a new factory can never reuse its address and pass for it (with an ``id`` key,
    a fresh closure allocated where the previous step's one was freed would keep the old
    quantizers).
    Factories compare with their own ``__eq__``: functions by identity, ``per_gemm`` by its
    three format names. A deep copy shares the factory; a pickled key never matches again
    (closures do not pickle), so a module loaded from a pickle rebuilds its quantizers.
    """

    __slots__ = ("factory",)

    def __init__(self, factory: Optional[Callable[..., Any]]) -> None:
        self.factory = factory

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _FactoryKey) or self.factory is None or other.factory is None:
            return False
        return self.factory is other.factory or bool(self.factory == other.factory)

    def __hash__(self) -> int:
        try:
            return hash(self.factory)
        except TypeError:
            return 0

    def __deepcopy__(self, memo: dict) -> "_FactoryKey":
        return self

    def __reduce__(self) -> tuple:
        return (_FactoryKey, (None,))


def _name(f: Any) -> str:
    return getattr(f, "__qualname__", None) or repr(f)
