"""Identity quantizer: a high-precision passthrough for a direction or role (numerics §2.6)."""

from __future__ import annotations

import math
from typing import Hashable, Optional

import torch

from ..formats.common import HIGH_PRECISION_DTYPES, as_2d
from ..tensors import IdentityStorage, QuantizedStorage
from .base import Quantizer


class IdentityQuantizer(Quantizer):
    """Keeps the tensor unquantized (optionally cast to ``dtype``); both copies share it.

    Without a cast the storage aliases the input (no copy), as a passthrough should. The
    result's nominal dtype stays the input's: ``dequantize()`` returns it in that dtype (the
    values rounded through ``dtype`` when one is given).

    Parameters
    ----------
    dtype:
        float32, bfloat16, float16 or None (no cast).
    rowwise, columnwise:
        The copies ``quantize`` makes (see :meth:`Quantizer.set_usage`); both share one tensor.

    Raises
    ------
    ValueError
        For any other ``dtype``.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> x = torch.tensor([[1.0 + 2**-10]])
    >>> hf.IdentityQuantizer()(x).dequantize().item() == x.item()
    True
    >>> hf.IdentityQuantizer(torch.bfloat16)(x).dequantize()
    tensor([[1.]])
    """

    storage_cls = IdentityStorage
    format_name = "identity"
    has_fast_kernels = False

    def __init__(self, dtype: Optional[torch.dtype] = None, *, rowwise: bool = True,
                 columnwise: bool = True) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        if dtype is not None and dtype not in HIGH_PRECISION_DTYPES:
            raise ValueError(f"IdentityQuantizer(dtype={dtype}) must be float32, bfloat16, float16 or None.")
        self.dtype = dtype

    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """Wrap (or cast) ``x``; both directions see the same tensor."""
        p = {"data": as_2d(x).to(self.dtype or x.dtype)}
        return IdentityStorage(x.shape, x.dtype, p if rowwise else None, p if columnwise else None,
                               label=self.label)

    def _allocate(self, shape, dtype, device, rowwise, columnwise):  # type: ignore[override]
        # The held data is in the cast dtype, but the nominal dtype stays the requested one,
        # as encode() keeps x's dtype: make_empty + update_quantized must equal quantize.
        data = torch.empty((math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1),
                           dtype=self.dtype or dtype, device=device)
        p = {"data": data}
        return IdentityStorage(shape, dtype, p if rowwise else None, p if columnwise else None,
                               label=self.label)

    def share_key(self) -> Hashable:
        """Stateless and deterministic: its result is shared with quantizers of equal settings."""
        return self._settings_share_key()

    def settings(self) -> dict[str, object]:
        return {"dtype": self.dtype}
