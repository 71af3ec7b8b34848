"""QuantizerRole: which slot of which module a quantizer serves (numerics §4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: The tensor types hybridfp's modules ask for. A role may carry any other string (another
#: module's slots, e.g. attention's "qkv"): factories give types they do not know their
#: default (forward) settings, as TransformerEngine's do.
TENSOR_TYPES = ("input", "weight", "grad_output", "output", "grad_input")


@dataclass(frozen=True)
class QuantizerRole:
    """The slot a factory is asked to fill.

    Parameters
    ----------
    module_type:
        The kind of module: "linear" (Linear and LayerNormLinear) and "grouped_linear" (MoE
        experts) here; any other string (e.g. "dpa") for other modules; None when unknown.
    tensor_type:
        The tensor of that module: "input", "weight", "grad_output", "output" or
        "grad_input" here (``TENSOR_TYPES``); any other string for other modules' slots;
        None when unknown.
    name:
        The module's qualified name ("" or None when unknown).

    Raises
    ------
    TypeError
        A field that is neither a string nor None.

    Example
    -------
    >>> import hybridfp as hf
    >>> role = hf.QuantizerRole("linear", "weight", "blocks.0.fc1")
    >>> str(role), role.tensor_type
    ('blocks.0.fc1.weight', 'weight')
    """

    module_type: Optional[str] = None
    tensor_type: Optional[str] = None
    name: Optional[str] = ""

    def __post_init__(self) -> None:
        for field, what in (("module_type", "'linear', 'grouped_linear', 'dpa'"),
                            ("tensor_type", "'input', 'weight', 'grad_output'"),
                            ("name", "the module's qualified name")):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"QuantizerRole.{field}={value!r} must be a string ({what}, ...) or "
                                f"None when unknown; got {type(value).__name__}.")

    def __str__(self) -> str:
        """"<name or module_type>.<tensor_type>", unknown parts spelled out (error messages)."""
        return f"{self.name or self.module_type or '(any module)'}.{self.tensor_type or '(any tensor)'}"
