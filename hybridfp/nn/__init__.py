"""hybridfp modules: Linear, LayerNormLinear, GroupedLinear, the SwiGLU activation, and model conversion."""

from .base import GEMMS, SLOTS, QuantizedModule
from .convert import convert, set_names
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .linear_function import SaveOriginalInputIgnoredWarning
from .swiglu import SwiGLU, swiglu

__all__ = ["GEMMS", "GroupedLinear", "LayerNormLinear", "Linear", "QuantizedModule", "SLOTS",
           "SaveOriginalInputIgnoredWarning", "SwiGLU", "convert", "set_names", "swiglu"]
