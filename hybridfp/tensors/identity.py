"""Storage of an unquantized (high-precision) tensor, numerics §2.6.

One ``data`` tensor [rows, cols] serves both directions (a transposed use is a view), so
holding both copies costs nothing extra.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats.common import HIGH_PRECISION_DTYPES
from .storage import COLUMNWISE, ROWWISE, GemmOperand, QuantizedStorage
from .validation import InvalidStateError, same_tensor


class IdentityStorage(QuantizedStorage):
    """High-precision passthrough, in ``data``'s dtype."""

    format_name = "Identity"
    precision_rank = 3
    _meta_defaults: dict[str, object] = {}
    _row_index = {ROWWISE: {"data": (0, 1)}, COLUMNWISE: {"data": (0, 1)}}

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        raise TypeError("IdentityStorage is allocated with IdentityStorage.allocate_like")

    @classmethod
    def allocate(cls, shape, dtype, device, directions, *, label="", fill=None,  # type: ignore[override]
                 data_dtype: Optional[torch.dtype] = None, **meta):
        """An empty high-precision tensor shared by the requested directions.

        Parameters
        ----------
        dtype
            The nominal dtype (what ``dequantize()`` returns by default).
        data_dtype
            The dtype the data is held in (an ``IdentityQuantizer(dtype=...)`` cast); None:
            ``dtype``.
        """
        shape = torch.Size(shape)
        rows = shape[:-1].numel() if len(shape) else 1
        cols = shape[-1] if len(shape) else 1
        data = (torch.empty if fill is None else torch.zeros)((rows, cols), dtype=data_dtype or dtype,
                                                              device=device)
        p = {"data": data}
        return cls(shape, dtype, p if ROWWISE in directions else None,
                   p if COLUMNWISE in directions else None, label=label)

    def allocate_like(self, shape: torch.Size, dtype: torch.dtype, fill: Optional[float] = None,
                      device: torch.device | str | None = None) -> "IdentityStorage":
        """An empty (or zero) storage of another shape and nominal ``dtype`` holding its data in
        this one's data dtype: the quantizer's cast is part of the format, so a later
        ``copy_`` into it neither rounds (FP32 held under a BF16 nominal dtype) nor widens."""
        return type(self).allocate(shape, dtype, device or self.device, self.directions(), label=self.label,
                                   fill=fill, data_dtype=self.tensors()[0].dtype)

    def tensors(self) -> list[torch.Tensor]:
        """The one data tensor (shared by both directions)."""
        return [self.payload(self.directions()[0])["data"]]

    def split_tensors(self) -> tuple[list[torch.Tensor], "QuantizedStorage"]:
        """The payload tensors and a skeleton holding none of them (own layout: not the slots)."""
        tensors = self.tensors()
        return tensors, self.with_tensors([None] * len(tensors))

    def with_tensors(self, tensors: list[torch.Tensor]) -> "IdentityStorage":
        """Same directions, new data tensor."""
        if len(tensors) != 1:
            raise ValueError(f"{self.describe()} has 1 payload tensor; got {len(tensors)}.")
        (data,) = tensors
        p = {"data": data}
        return self._new(self.shape, {d: (p if self.has(d) else None) for d in (ROWWISE, COLUMNWISE)})

    def copy_payload_(self, src: QuantizedStorage) -> None:
        """Copy another identity storage's values in place.

        Any other format is refused (ValueError), so ``copy_`` re-quantizes its value instead
        of copying raw FP8/FP4 codes as if they were values.
        """
        if type(src) is not IdentityStorage or src.shape != self.shape:
            raise ValueError(f"cannot copy {src.describe()} into {self.describe()} in place: "
                             "formats or shapes differ.")
        self.tensors()[0].copy_(src.tensors()[0])

    @classmethod
    def from_state(cls, state: dict) -> "IdentityStorage":
        """Both directions share one payload, as when quantized; every field is checked.

        Raises
        ------
        InvalidStateError
            A field disagrees with the header (see ``QuantizedStorage.validate``), or the two
            copies are different tensors (one tensor serves both).
        """
        p = cls._checked_state(state)
        if p[ROWWISE] is not None and p[COLUMNWISE] is not None:
            a, b = p[ROWWISE].get("data"), p[COLUMNWISE].get("data")
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_tensor(a, b)):
                raise InvalidStateError(
                    f"saved {cls.format_name} tensor of shape {tuple(state['shape'])}: its rowwise and "
                    "columnwise 'data' must be one tensor (both copies of an Identity tensor are the "
                    "same values); got two different ones.")
            p = {ROWWISE: p[ROWWISE], COLUMNWISE: p[ROWWISE]}
        out = cls(state["shape"], state["dtype"], p[ROWWISE], p[COLUMNWISE], label=state["label"])
        out.validate()
        return out

    def expected_payload(self, direction: str) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        """One [rows, cols] tensor in any high-precision dtype (the quantizer's cast)."""
        return {"data": ((self.rows, self.cols), HIGH_PRECISION_DTYPES)}

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """Only BF16 values are BF16; an exact GEMM of FP32/FP16 values needs FP32 products."""
        dt = self.payload(direction)["data"].dtype
        return None if dt == torch.bfloat16 else f"{str(dt).replace('torch.', '')} values"

    def gemm_operand(self, direction: str) -> GemmOperand:
        """The held values in FP32; columnwise reads them transposed (a view)."""
        v = self.payload(direction)["data"].float()
        v = v if direction == ROWWISE else v.t()
        return GemmOperand(v, None, v.shape[1])

    def dequantize(self, dtype=None, direction=None) -> torch.Tensor:  # type: ignore[override]
        """The held tensor (cast only if ``dtype`` differs), original shape."""
        d = direction or self.directions()[0]
        data = self.payload(d)["data"]
        return data.reshape(self.shape).to(dtype or self.dtype)
