"""``Linear``: drop-in ``nn.Linear`` whose three GEMMs are quantized per role and direction."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..recipes import current_autocast
from .base import QuantizedModule
from .linear_function import LinearContext, LinearFunction
from .weight_cache import check_is_first_microbatch


class Linear(QuantizedModule):
    """y = x Wᵀ + b with W: [out_features, in_features].

    Inside ``hybridfp.autocast`` the GEMMs use the recipe's quantizers (roles
    ``<name>.input`` / ``.weight`` / ``.grad_output``); outside it runs in high precision.
    ``params_dtype``: dtype of the (master) weight and bias, FP32 by default; any optimizer
    works on them. ``save_original_input``: keep the high-precision input for wgrad and
    quantize its columnwise copy in backward (saves memory when the input is kept anyway);
    ignored, with a ``SaveOriginalInputIgnoredWarning`` once per module, when the input
    quantizer is not requantization-safe (stochastic rounding): the quantized forward value
    is saved. Refused (ValueError) with an FP8 delayed-scaling input quantizer.
    Under ``torch.autocast`` as well, the input takes the autocast dtype as ``nn.Linear``'s
    does (so does the output); the quantized GEMMs themselves are unaffected by it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.in_features, self.out_features = in_features, out_features
        self.save_original_input = save_original_input
        kw = {"dtype": params_dtype or torch.float32, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """Quantized inside autocast, high precision outside.

        ``is_first_microbatch`` (TransformerEngine's argument; ignored outside autocast): None
        quantizes the weight once per autocast region; True quantizes it and keeps the copy
        for later regions; False reuses the kept copy (the weight must not have changed since)
        and raises RuntimeError if none matches. See ``hybridfp.nn.weight_cache``.
        """
        check_is_first_microbatch(is_first_microbatch, self._who())
        self.check_input_features(x)
        state = current_autocast()
        if state is None:
            return self.high_precision_linear(x, self.weight, self.bias)
        qs = self.quantizers(state)
        x = self.torch_autocast_input(x)
        lc = LinearContext(qs["input"][0], qs["weight"][0], qs["grad_output"][0], self,
                           save_original_input=self.save_original_input,
                           grad_enabled=torch.is_grad_enabled(),
                           fprop_fast_accumulation=state.recipe.fprop_fast_accumulation,
                           scratch=state.scratch, region=state.token,
                           is_first_microbatch=is_first_microbatch)
        return LinearFunction.apply(x, self.weight, self.bias, lc)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
