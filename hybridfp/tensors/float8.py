"""Storage of FP8 per-tensor scaled tensors (delayed or current scaling, numerics §2.1-2.2).

rowwise: ``data`` [rows, cols] FP8, ``scale_inv`` 0-d FP32.
columnwise: the same values transposed (``data`` [cols, rows]) with the same scale — Hopper's
FP8 GEMMs are TN-only, so the backward copy is kept in the layout cuBLAS consumes.
"""

from __future__ import annotations

from typing import Optional

import torch

from .storage import COLUMNWISE, FP8_DTYPES, ROWWISE, GemmOperand, QuantizedStorage


class Float8Storage(QuantizedStorage):
    """FP8 with one FP32 scale for the whole tensor."""

    format_name = "FP8 per-tensor"
    precision_rank = 2
    _meta_defaults = {"fp8_dtype": torch.float8_e4m3fn}
    _meta_choices = {"fp8_dtype": FP8_DTYPES}
    _row_index = {
        ROWWISE: {"data": (0, 1), "scale_inv": None},
        COLUMNWISE: {"data": (1, 1), "scale_inv": None},
    }

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        shape = (rows, cols) if direction == ROWWISE else (cols, rows)
        return {"data": (shape, meta["fp8_dtype"]), "scale_inv": ((), torch.float32)}

    @classmethod
    def _shared_names(cls, meta: dict[str, object]) -> frozenset[str]:
        return frozenset({"scale_inv"})  # one scale for both copies (numerics §2.1)

    def has_epilogue_scale(self, direction: str) -> bool:
        """Yes: the per-tensor scale_inv."""
        return True

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """FP8 E4M3/E5M2 codes are exact in BF16 (scale_inv stays in the epilogue)."""
        return None

    def epilogue_scale(self, direction: str) -> Optional[torch.Tensor]:
        """The per-tensor scale_inv."""
        return self.payload(direction)["scale_inv"]

    def gemm_operand(self, direction: str) -> GemmOperand:
        """FP8 values as stored; the per-tensor scale_inv goes to the epilogue."""
        p = self.payload(direction)
        return GemmOperand(p["data"].float(), self.epilogue_scale(direction), p["data"].shape[1])
