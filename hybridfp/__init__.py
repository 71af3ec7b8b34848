"""hybridfp: low-precision training in PyTorch with hybrid (per-direction) quantization."""

from .quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                         HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
                         Quantizer)
from .tensors import MissingDirectionError, QuantizedTensor

__version__ = "0.1.0"

__all__ = [
    "Float8BlockQuantizer", "Float8CurrentScalingQuantizer", "Float8Quantizer", "HybridQuantizer",
    "IdentityQuantizer", "MXFP8Quantizer", "MissingDirectionError", "NVFP4Quantizer",
    "QuantizedTensor", "Quantizer",
]
