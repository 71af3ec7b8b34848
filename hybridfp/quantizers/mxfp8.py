"""MXFP8 quantizer (OCP microscaling, numerics §2.4)."""

from __future__ import annotations

from typing import Hashable, Optional

import torch

from ..formats import mxfp8
from ..formats.common import as_2d, fp8_dtype as _fp8_dtype
from ..tensors import MXFP8Storage, QuantizedStorage
from .base import Quantizer

_RULES = ("rceil", "floor")


class MXFP8Quantizer(Quantizer):
    """FP8 elements with an E8M0 scale per 32 (1x32 rowwise, 32x1 columnwise), numerics §2.4.

    Stateless and deterministic; the columnwise copy of 1D blocks is quantized from the
    source, not transposed from the rowwise one.

    Parameters
    ----------
    fp8_dtype:
        ``torch.float8_e4m3fn`` (default) / ``torch.float8_e5m2``, or "e4m3" / "e5m2".
    rowwise, columnwise:
        The copies ``quantize`` makes (see :meth:`Quantizer.set_usage`).
    scale_rule:
        "rceil" (TE/cuBLAS default, block max never saturates) or "floor" (OCP).
    with_2d_quantization:
        32x32 tiles (weights); both copies then hold the same values.

    Raises
    ------
    ValueError
        An unknown ``scale_rule``, or an ``fp8_dtype`` that is not an FP8 type.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> q = hf.MXFP8Quantizer(scale_rule="floor")
    >>> x = torch.randn(64, 64)
    >>> t = q(x)
    >>> t.directions(), t.quantized_nbytes()   # 2 x (4096 codes + 128 scales)
    (('rowwise', 'columnwise'), 8448)
    """

    storage_cls = MXFP8Storage
    format_name = "mxfp8"

    def __init__(self, fp8_dtype: str | torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                 columnwise: bool = True, scale_rule: str = "rceil",
                 with_2d_quantization: bool = False) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = _fp8_dtype(fp8_dtype)
        if scale_rule not in _RULES:
            raise ValueError(f"scale_rule={scale_rule!r} is unknown; use 'rceil' or 'floor'.")
        self.scale_rule = scale_rule
        self.with_2d_quantization = bool(with_2d_quantization)

    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """Quantize the requested copies (columnwise = 1x32 blocks of the transpose)."""
        x2 = as_2d(x)
        row = col = None
        if self.with_2d_quantization:
            d, s = mxfp8.quantize_2d(x2, self.dtype, rule=self.scale_rule)
            row = {"data": d, "scale": s} if rowwise else None
            if columnwise:
                col = {"data": d.t().contiguous(), "scale": s.t().contiguous()}
        else:
            if rowwise:
                d, s = mxfp8.quantize_1d(x2, self.dtype, rule=self.scale_rule)
                row = {"data": d, "scale": s}
            if columnwise:
                d, s = mxfp8.quantize_1d(x2.t(), self.dtype, rule=self.scale_rule)
                col = {"data": d, "scale": s}
        return MXFP8Storage(x.shape, x.dtype, row, col, label=self.label, **self.storage_meta())

    def decodable(self, want: frozenset) -> frozenset:
        """1D blocks, both copies (one storage holds both: all of them decoded or none); the
        quantize kernel writes the BF16 decodes directly."""
        return want if (not self.with_2d_quantization and want == {"rowwise", "columnwise"}) else frozenset()

    def decodable_part(self, direction: str) -> bool:
        """A 1D columnwise copy (the fused NVFP4 -> MXFP8 kernel's)."""
        return direction == "columnwise" and not self.with_2d_quantization

    def storage_meta(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype, "block_2d": self.with_2d_quantization}

    def share_key(self) -> Hashable:
        """Stateless and deterministic: its result is shared with quantizers of equal settings."""
        return self._settings_share_key()

    def settings(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype, "scale_rule": self.scale_rule,
                "with_2d_quantization": self.with_2d_quantization}
