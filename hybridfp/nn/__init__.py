"""hybridfp dense modules: Linear, LayerNormLinear, LayerNormMLP, the SwiGLU activation, and model
conversion (the MoE layer, ``GroupedLinear``, lives in :mod:`hybridfp.moe`)."""

from .base import GEMMS, SLOTS, QuantizedModule
from .convert import convert, set_names
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .linear_function import SaveOriginalInputIgnoredWarning
from .swiglu import SwiGLU, swiglu

__all__ = ["GEMMS", "LayerNormLinear", "LayerNormMLP", "Linear", "QuantizedModule", "SLOTS",
           "SaveOriginalInputIgnoredWarning", "SwiGLU", "convert", "set_names", "swiglu"]
