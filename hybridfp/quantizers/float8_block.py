"""FP8 block-scaling quantizer (DeepSeek-V3 style, numerics §2.3)."""

from __future__ import annotations

from typing import Hashable, Optional

import torch

from ..formats import fp8_block
from ..formats.common import as_2d, fp8_dtype as _fp8_dtype
from ..tensors import Float8BlockStorage, QuantizedStorage
from .base import Quantizer


class Float8BlockQuantizer(Quantizer):
    """FP8 with one FP32 scale per 1x128 block (``block_scaling_dim=1``) or 128x128 tile (2).

    1D: the columnwise copy is re-quantized from the source with 128x1 blocks (stored
    transposed). 2D: both copies hold the same values; the columnwise one is the transpose.
    Stateless and deterministic (numerics §2.3).

    Parameters
    ----------
    fp8_dtype:
        ``torch.float8_e4m3fn`` (default) / ``torch.float8_e5m2``, or "e4m3" / "e5m2".
    rowwise, columnwise:
        The copies ``quantize`` makes (see :meth:`Quantizer.set_usage`).
    amax_epsilon:
        A floor >= 0 for each block's amax (0: none).
    force_pow_2_scales:
        Round each block scale down to a power of two (default True, as DeepSeek-V3).
    block_scaling_dim:
        1 (1x128 blocks: activations, gradients) or 2 (128x128 tiles: weights).

    Raises
    ------
    ValueError
        An unknown ``block_scaling_dim``, a negative ``amax_epsilon``, or an ``fp8_dtype``
        that is not an FP8 type.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> q = hf.Float8BlockQuantizer(block_scaling_dim=1)
    >>> x = torch.randn(256, 256)
    >>> err = (q(x).dequantize() - x).norm() / x.norm()
    >>> bool(err < 0.05)
    True
    """

    storage_cls = Float8BlockStorage
    format_name = "fp8_block"

    def __init__(self, fp8_dtype: str | torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                 columnwise: bool = True, amax_epsilon: float = 0.0, force_pow_2_scales: bool = True,
                 block_scaling_dim: int = 2) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = _fp8_dtype(fp8_dtype)
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim={block_scaling_dim} is unknown; use 1 (1x128 "
                             "blocks, activations/gradients) or 2 (128x128 tiles, weights).")
        if amax_epsilon < 0:
            raise ValueError(f"amax_epsilon={amax_epsilon} must be >= 0.")
        self.block_scaling_dim = block_scaling_dim
        self.amax_epsilon = float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)

    def _opts(self) -> dict[str, object]:
        return {"power_2_scale": self.force_pow_2_scales, "eps": self.amax_epsilon}

    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """Block-quantize the requested copies."""
        x2 = as_2d(x)
        row = col = None
        if self.block_scaling_dim == 1:
            if rowwise:
                d, s = fp8_block.quantize_1d(x2, self.dtype, **self._opts())
                row = {"data": d, "scale_inv": s}
            if columnwise:
                d, s = fp8_block.quantize_1d(x2.t(), self.dtype, **self._opts())
                col = {"data": d, "scale_inv": s}
        else:
            d, s = fp8_block.quantize_2d(x2, self.dtype, **self._opts())
            row = {"data": d, "scale_inv": s} if rowwise else None
            if columnwise:
                col = {"data": d.t().contiguous(), "scale_inv": s.t().contiguous()}
        return Float8BlockStorage(x.shape, x.dtype, row, col, label=self.label, **self.storage_meta())

    def storage_meta(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype, "block_dim": self.block_scaling_dim, "block": 128,
                "pow2_scales": self.force_pow_2_scales}

    def share_key(self) -> Hashable:
        """Stateless and deterministic: its result is shared with quantizers of equal settings."""
        return self._settings_share_key()

    def settings(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype, "block_scaling_dim": self.block_scaling_dim,
                "force_pow_2_scales": self.force_pow_2_scales, "amax_epsilon": self.amax_epsilon}
