"""QuantizerRole: which slot of which module a quantizer serves (SPEC §4)."""

from __future__ import annotations

from dataclasses import dataclass

TENSOR_TYPES = ("input", "weight", "grad_output", "output", "grad_input")


@dataclass(frozen=True)
class QuantizerRole:
    """The slot a factory is asked to fill.

    ``module_type``: "linear" (Linear and LayerNormLinear) or "grouped_linear" (MoE experts).
    ``tensor_type``: one of "input", "weight", "grad_output", "output", "grad_input".
    ``name``: the module's qualified name when known ("" otherwise).
    """

    module_type: str
    tensor_type: str
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.module_type, str) or not self.module_type:
            raise ValueError(f"QuantizerRole.module_type={self.module_type!r} must be a non-empty "
                             "string such as 'linear' or 'grouped_linear'.")
        if not isinstance(self.name, str):
            raise TypeError(f"QuantizerRole.name={self.name!r} must be a string (the module's "
                            "qualified name, or '' when unknown).")
        if self.tensor_type not in TENSOR_TYPES:
            raise ValueError(f"QuantizerRole.tensor_type={self.tensor_type!r} is unknown; use one of "
                             f"{', '.join(TENSOR_TYPES)}.")

    def __str__(self) -> str:
        return f"{self.name or self.module_type}.{self.tensor_type}"
