"""``LayerNormLinear``: a norm (LayerNorm or RMSNorm, high precision) followed by a Linear."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..recipes import AutocastState, current_autocast
from . import ops
from .base import QuantizedModule
from .linear import Linear
from .linear_function import LinearContext, region_context
from .quantized_init import build_part
from .weight_cache import check_is_first_microbatch

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def normalize(x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: Optional[torch.Tensor],
              eps: float) -> torch.Tensor:
    """LayerNorm or RMSNorm over x's last dim, in x's dtype with FP32 statistics (torch's
    kernels); the affine parameters are cast to x's dtype. Shared by the norm + GEMM modules."""
    w = weight.to(x.dtype)
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.layer_norm(x, (x.shape[-1],), w, bias.to(x.dtype), eps)  # type: ignore[union-attr]


def check_normalization(normalization: str) -> None:
    """Raise a ValueError naming the option unless it is "LayerNorm" or "RMSNorm"."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} is unknown; use 'LayerNorm' or 'RMSNorm'.")


class LayerNormLinear(QuantizedModule):
    """y = norm(x) Wᵀ + b. The norm runs in high precision; only the GEMMs are quantized,
    with the same roles as ``Linear`` (module_type "linear").

    Parameters
    ----------
    in_features, out_features, bias, params_dtype, device, save_original_input, name:
        As :class:`Linear`'s (the weight and bias initialised as ``Linear``'s).
    normalization:
        "LayerNorm" (weight and bias: ``layer_norm_weight``, ``layer_norm_bias``) or
        "RMSNorm" (weight only; ``layer_norm_bias`` is None).
    eps:
        The norm's epsilon.

    Raises
    ------
    ValueError
        An unknown ``normalization``; from ``forward``, as :meth:`Linear.forward`.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> m = hf.LayerNormLinear(64, 32, normalization="RMSNorm")
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = m(torch.randn(4, 64))
    >>> y.shape, m.layer_norm_bias
    (torch.Size([4, 32]), None)
    """

    supports_backward_override = True
    quantized_weight_slots = (("weight", 0),)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 normalization: str = "LayerNorm", eps: float = 1e-5,
                 params_dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name)
        check_normalization(normalization)
        self.normalization, self.eps = normalization, eps
        self.in_features, self.out_features = in_features, out_features
        self.save_original_input = save_original_input
        kw = {"dtype": params_dtype or torch.float32, "device": device}
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, **kw))
        self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, **kw)) if normalization == "LayerNorm" else None
        lin = build_part(lambda: Linear(in_features, out_features, bias, params_dtype=kw["dtype"], device=device))
        self.weight, self.bias = lin.weight, lin.bias  # same init as Linear, owned here
        ops.register(self)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The normalization, in x's dtype with FP32 statistics (torch's kernels)."""
        return normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """norm, then the (quantized inside autocast) linear.

        Parameters
        ----------
        x:
            The input, [..., in_features].
        is_first_microbatch:
            As :meth:`Linear.forward`'s (TransformerEngine's weight reuse across regions).

        Returns
        -------
        torch.Tensor
            [..., out_features].

        Raises
        ------
        ValueError, TypeError, RuntimeError
            As :meth:`Linear.forward`.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> m = hf.LayerNormLinear(64, 32)
        >>> m(torch.randn(2, 64)).shape            # outside autocast: high precision
        torch.Size([2, 32])
        """
        if self._tensor_parallel is not None:  # parallelized: runs on the local shards
            return self._tensor_parallel.forward(self, x, is_first_microbatch)
        check_is_first_microbatch(is_first_microbatch, self._who())
        self.check_input_features(x)
        h = self.norm(x)
        state = current_autocast()
        if state is None:
            return self.high_precision_linear(h, self.weight, self.bias)
        h = self.torch_autocast_input(h)
        return ops.quantized_linear(self, 0, h, self.weight, self.bias, state, is_first_microbatch)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        ops.register(self)  # a copy (deepcopy, unpickling) is reachable from the compiled ops too

    def linear_context(self, state: AutocastState, index: int, is_first_microbatch: Optional[bool],
                       grad_enabled: Optional[bool] = None) -> LinearContext:
        """The GEMM's context in region ``state`` (no shared-input memo: the normalized input
        is this module's own); ``grad_enabled`` None: torch's grad mode now."""
        return region_context(self, state, 0, is_first_microbatch, grad_enabled, share_input=False)

    def extra_repr(self) -> str:
        return (f"{self.normalization}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
