"""Storage of MXFP8 tensors (OCP microscaling, numerics §2.4).

rowwise: ``data`` [rows, cols] FP8 and E8M0 ``scale`` (uint8) per 1x32 block
[rows, ceil(cols/32)]. columnwise: 32x1 blocks, stored transposed (``data`` [cols, rows],
``scale`` [cols, ceil(rows/32)]) so every copy is reduced along its last dimension.
With ``block_2d`` (weights), 32x32 tiles: scales [ceil(rows/32), ceil(cols/32)]; the
columnwise copy is the same values transposed.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import mxfp8
from ..formats.common import ceil_div
from .storage import COLUMNWISE, FP8_DTYPES, ROWWISE, GemmOperand, QuantizedStorage


class MXFP8Storage(QuantizedStorage):
    """FP8 elements with a power-of-two (E8M0) scale per 32 elements."""

    format_name = "MXFP8"
    precision_rank = 2
    _meta_defaults = {"fp8_dtype": torch.float8_e4m3fn, "block_2d": False}
    _meta_choices = {"fp8_dtype": FP8_DTYPES}

    @property
    def _row_index(self):  # type: ignore[override]
        b = mxfp8.BLOCK
        return {
            ROWWISE: {"data": (0, 1), "scale": (0, b) if self.meta["block_2d"] else (0, 1)},
            COLUMNWISE: {"data": (1, 1), "scale": (1, b)},
        }

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        b = mxfp8.BLOCK
        r, c = (rows, cols) if direction == ROWWISE else (cols, rows)
        sr = ceil_div(r, b) if meta["block_2d"] else r
        return {"data": ((r, c), meta["fp8_dtype"]), "scale": ((sr, ceil_div(c, b)), torch.uint8)}

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """E4M3/E5M2 x E8M0 fits BF16's 8 significant bits and exponent range; only a block
        with an E8M0 scale below 2**-124 (block amax below ~2**-116) holding FP8 subnormals
        can fall under BF16's subnormal floor 2**-133: error < 2**-133 per element."""
        return None

    def gemm_operand(self, direction: str) -> GemmOperand:
        """E4M3/E5M2 x E8M0 values (exact in FP32), stored orientation."""
        p = self.payload(direction)
        deq = mxfp8.dequantize_2d if self.meta["block_2d"] else mxfp8.dequantize_1d
        return GemmOperand(deq(p["data"], p["scale"]), None, p["data"].shape[1])
