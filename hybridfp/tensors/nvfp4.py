"""Storage of NVFP4 tensors (numerics §2.5).

rowwise: ``data`` uint8 [rows, ceil(cols/2)] (two E2M1 codes per byte, element 2i in the low
nibble), ``scale`` E4M3 per 1x16 block [rows, ceil(cols/16)], ``amax`` the FP32 global amax
(0-d, or [rows] for row-scaled NVFP4).
columnwise: 16x1 blocks stored transposed (``data`` [cols, ceil(R/2)], ``scale``
[cols, ceil(R/16)], ``amax`` 0-d). With ``rht`` the columnwise copy holds the random-Hadamard
transformed values: R is zero-padded to a multiple of 16 (the padded tail is part of the
transformed tensor, so the stored length is ceil16(rows)), and decoding applies the inverse
transform, so ``dequantize`` always returns values in the original domain.
With ``block_2d`` (weights): 16x16 tiles, scales [ceil(r/16), ceil(c/16)] in each stored
orientation; both copies hold the same values.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import nvfp4
from ..formats.common import ceil_div
from .storage import COLUMNWISE, ROWWISE, GemmOperand, QuantizedStorage
from .validation import InvalidStateError


class NVFP4Storage(QuantizedStorage):
    """E2M1 elements, E4M3 scale per 16 elements, FP32 global scale (per tensor or per row)."""

    format_name = "NVFP4"
    precision_rank = 1
    _meta_defaults = {"block_2d": False, "rht": False, "row_scaled": False}

    @property
    def _row_index(self):  # type: ignore[override]
        b = nvfp4.BLOCK
        return {
            ROWWISE: {
                "data": (0, 1),
                "scale": (0, b) if self.meta["block_2d"] else (0, 1),
                "amax": (0, 1) if self.meta["row_scaled"] else None,
            },
            # Slicing the columnwise copy cuts its packed, blocked (and, with RHT, 16-tiled)
            # last axis: cuts must land on 16-row boundaries.
            COLUMNWISE: {"data": (1, 2), "scale": (1, b), "amax": None},
        }

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        b = nvfp4.BLOCK
        if direction == ROWWISE:
            r, c = rows, cols
            amax_shape: tuple[int, ...] = (rows,) if meta["row_scaled"] else ()
        else:
            r, c = cols, (ceil_div(rows, b) * b if meta["rht"] else rows)
            amax_shape = ()
        sr = ceil_div(r, b) if meta["block_2d"] else r
        return {
            "data": ((r, ceil_div(c, 2)), torch.uint8),
            "scale": ((sr, ceil_div(c, b)), torch.float8_e4m3fn),
            "amax": (amax_shape, torch.float32),
        }

    def _check_options(self) -> None:
        """Row scaling is a forward-activation format: rowwise only, no RHT, no 2D blocks (as
        ``NVFP4Quantizer`` refuses them)."""
        check_row_scaled(self)

    @classmethod
    def _shared_names(cls, meta: dict[str, object]) -> frozenset[str]:
        # The columnwise copy reuses the tensor's global amax, except after an RHT (post-RHT amax).
        return frozenset() if meta["rht"] else frozenset({"amax"})

    @classmethod
    def key_for(cls, direction: str, meta: dict[str, object]) -> tuple:
        """RHT concerns only the columnwise copy; row scaling only the rowwise one."""
        meta = dict(meta)
        if direction == ROWWISE:
            meta["rht"] = False
        else:
            meta["row_scaled"] = False
        return super().key_for(direction, meta)

    def has_epilogue_scale(self, direction: str) -> bool:
        """Yes: the global (or per-row) S_dec."""
        return True

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """E2M1 x E4M3 block scale has at most 6 significant bits and lies in [2**-10, 2688]:
        exact in BF16 (S_dec stays in the epilogue)."""
        return None

    def gemm_operand(self, direction: str) -> GemmOperand:
        """q x E4M3 block scale (exact in FP32), stored orientation; S_dec (per tensor, or per
        row when row-scaled) goes to the epilogue. An RHT copy stays in the transformed domain
        (stored length = k padded to 16)."""
        p = self.payload(direction)
        decode = nvfp4.decode_blocks_2d if self.meta["block_2d"] else nvfp4.decode_blocks_1d
        k, stored, rht_on = self.reduction_layout(direction)
        return GemmOperand(decode(p["data"], p["scale"], stored), self.epilogue_scale(direction), k, rht_on)

    def epilogue_scale(self, direction: str) -> Optional[torch.Tensor]:
        """S_dec from the global amax (per tensor, or per row when row-scaled)."""
        return nvfp4.shared_global_decode_scale(self.payload(direction)["amax"])

    def reduction_layout(self, direction: str) -> tuple[int, int, bool]:
        """(logical reduction length k, stored length, RHT on) of one copy: an RHT copy keeps
        k padded to whole 16-element tiles."""
        k = self.cols if direction == ROWWISE else self.rows
        rht_on = direction == COLUMNWISE and bool(self.meta["rht"])
        return k, (ceil_div(k, nvfp4.BLOCK) * nvfp4.BLOCK if rht_on else k), rht_on


def check_row_scaled(storage: QuantizedStorage) -> None:
    """Raise InvalidStateError for a row-scaled NVFP4 storage with options or a copy that
    ``NVFP4Quantizer(row_scaled_nvfp4=True)`` never makes."""
    if not storage.meta["row_scaled"]:
        return
    clash = [n for n in ("rht", "block_2d") if storage.meta[n]]
    if storage.has(COLUMNWISE):
        clash.append("a columnwise copy")
    if clash:
        raise InvalidStateError(f"{storage.describe()}: row_scaled=True cannot be combined with "
                                f"{', '.join(clash)} (row-scaled NVFP4 is a rowwise-only forward format).")
