"""Storage of FP8 block-scaled tensors (DeepSeek-V3 style, numerics §2.3).

1D (``block_dim=1``): rowwise 1x128 blocks, ``scale_inv`` [rows, ceil(cols/128)]; the
columnwise copy is re-quantized from the source with 128x1 blocks and stored transposed:
``data`` [cols, rows], ``scale_inv`` [cols, ceil(rows/128)].
2D (``block_dim=2``): 128x128 tiles, ``scale_inv`` [ceil(rows/128), ceil(cols/128)]; the
columnwise copy holds the same values, transposed (data and tile scales).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import fp8_block
from ..formats.common import ceil_div
from .storage import COLUMNWISE, FP8_DTYPES, ROWWISE, GemmOperand, QuantizedStorage


class Float8BlockStorage(QuantizedStorage):
    """FP8 with FP32 scales per 1x128 block or 128x128 tile."""

    format_name = "FP8 block"
    precision_rank = 2
    _meta_defaults = {"fp8_dtype": torch.float8_e4m3fn, "block_dim": 1, "block": 128, "pow2_scales": True}
    _meta_choices = {"fp8_dtype": FP8_DTYPES, "block_dim": (1, 2)}

    @property
    def _row_index(self):  # type: ignore[override]
        b = self.meta["block"]
        row_scale = (0, 1) if self.meta["block_dim"] == 1 else (0, b)
        return {
            ROWWISE: {"data": (0, 1), "scale_inv": row_scale},
            COLUMNWISE: {"data": (1, 1), "scale_inv": (1, b)},
        }

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        b = meta["block"]
        r, c = (rows, cols) if direction == ROWWISE else (cols, rows)
        sr = r if meta["block_dim"] == 1 else ceil_div(r, b)
        return {"data": ((r, c), meta["fp8_dtype"]), "scale_inv": ((sr, ceil_div(c, b)), torch.float32)}

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """Power-of-two block scales times FP8 codes are exact in BF16; FP32 scales are not."""
        return None if self.meta["pow2_scales"] else "FP32 (non power-of-two) block scales"

    def gemm_operand(self, direction: str) -> GemmOperand:
        """Block-decoded values in the stored orientation (no per-tensor factor)."""
        p = self.payload(direction)
        deq = fp8_block.dequantize_1d if self.meta["block_dim"] == 1 else fp8_block.dequantize_2d
        return GemmOperand(deq(p["data"], p["scale_inv"], block=self.meta["block"]), None, p["data"].shape[1])
