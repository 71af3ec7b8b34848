"""Quantizers: one per format, the Identity passthrough and the per-direction HybridQuantizer."""

from .base import Quantizer
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, NonFiniteAmaxWarning
from .float8_block import Float8BlockQuantizer
from .hybrid import HybridQuantizer
from .identity import IdentityQuantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer
from . import fast as _fast  # noqa: F401,E402  (registers the Triton kernels for CUDA tensors)

__all__ = [
    "Float8BlockQuantizer", "Float8CurrentScalingQuantizer", "Float8Quantizer", "HybridQuantizer",
    "IdentityQuantizer", "MXFP8Quantizer", "NVFP4Quantizer", "NonFiniteAmaxWarning", "Quantizer",
]
