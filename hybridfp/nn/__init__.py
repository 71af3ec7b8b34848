"""hybridfp modules: Linear, LayerNormLinear, GroupedLinear, and model conversion."""

from .base import GEMMS, SLOTS, QuantizedModule
from .convert import convert, set_names
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .linear import Linear

__all__ = ["GEMMS", "GroupedLinear", "LayerNormLinear", "Linear", "QuantizedModule", "SLOTS",
           "convert", "set_names"]
