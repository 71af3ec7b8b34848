"""Quantized tensor storages (one per format, plus the hybrid) and the QuantizedTensor subclass."""

from . import dispatch as _dispatch  # noqa: F401  (registers the __torch_dispatch__ handlers)
from .decoded import DecodedMXFP8Storage, DecodedNVFP4Storage, DecodedStorage
from .float8 import Float8Storage
from .float8_block import Float8BlockStorage
from .hybrid import HybridStorage
from .identity import IdentityStorage
from .mxfp8 import MXFP8Storage
from .nvfp4 import NVFP4Storage
from .quantized_tensor import QuantizedTensor
from .storage import COLUMNWISE, DIRECTIONS, ROWWISE, MissingDirectionError, QuantizedStorage
from .validation import InvalidStateError

__all__ = [
    "COLUMNWISE", "DIRECTIONS", "ROWWISE", "DecodedMXFP8Storage", "DecodedNVFP4Storage", "DecodedStorage", "Float8BlockStorage", "Float8Storage", "HybridStorage",
    "IdentityStorage", "InvalidStateError", "MXFP8Storage", "MissingDirectionError", "NVFP4Storage", "QuantizedStorage",
    "QuantizedTensor",
]
