"""``Linear``: drop-in ``nn.Linear`` whose three GEMMs are quantized per role and direction."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..recipes import AutocastState, current_autocast
from .base import QuantizedModule
from . import ops
from .linear_function import LinearContext, region_context
from .weight_cache import check_is_first_microbatch


class Linear(QuantizedModule):
    """y = x Wᵀ + b with W: [out_features, in_features].

    Inside ``hybridfp.autocast`` the GEMMs use the recipe's quantizers (roles
    ``<name>.input`` / ``.weight`` / ``.grad_output``); outside it runs in high precision.
    Under ``torch.autocast`` as well, the input takes the autocast dtype as ``nn.Linear``'s
    does (so does the output); the quantized GEMMs themselves are unaffected by it.

    Parameters
    ----------
    in_features, out_features:
        The weight is [out_features, in_features].
    bias:
        Whether to add a learnable bias.
    params_dtype:
        Dtype of the (master) weight and bias, FP32 by default; any optimizer works on them.
    device:
        Where the parameters are allocated.
    save_original_input:
        Keep the high-precision input for wgrad and quantize its columnwise copy in backward
        (saves memory when the input is kept anyway). Ignored, with a
        ``SaveOriginalInputIgnoredWarning`` once per module, when the input quantizer is not
        requantization-safe (stochastic rounding): the quantized forward value is saved.
    name:
        The module's qualified name in roles and messages (``hybridfp.convert`` /
        ``set_names`` set it); None: "".

    Raises
    ------
    ValueError
        From ``forward``: an input whose last dim is not ``in_features``; with
        ``save_original_input``, an FP8 delayed-scaling input quantizer.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin = hf.Linear(64, 32, name="fc1")
    >>> x = torch.randn(8, 64, requires_grad=True)
    >>> with hf.autocast(recipe=hf.Float8CurrentScaling()):
    ...     y = lin(x)
    >>> y.sum().backward()
    >>> y.shape, lin.weight.grad.shape
    (torch.Size([8, 32]), torch.Size([32, 64]))
    >>> str(lin.quantizer_roles()["weight"][0])
    'fc1.weight'
    """

    supports_backward_override = True
    quantized_weight_slots = (("weight", 0),)

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
        ops.register(self)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        ops.register(self)  # a copy (deepcopy, unpickling) is reachable from the compiled ops too

    def linear_context(self, state: AutocastState, index: int, is_first_microbatch: Optional[bool],
                       grad_enabled: Optional[bool] = None) -> LinearContext:
        """The GEMMs' context in region ``state`` (its quantizers, shared-input memo, weight
        cache region); ``grad_enabled`` None: torch's grad mode now."""
        return region_context(self, state, 0, is_first_microbatch, grad_enabled, share_input=True)

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """Quantized inside autocast, high precision outside.

        Parameters
        ----------
        x:
            The input, [..., in_features].
        is_first_microbatch:
            TransformerEngine's argument; ignored outside autocast. None quantizes the weight
            once per autocast region; True quantizes it and keeps the copy for later regions;
            False reuses the kept copy (the weight must not have changed since). See
            ``hybridfp.nn.weight_cache``.

        Returns
        -------
        torch.Tensor
            [..., out_features], in ``x``'s dtype (the autocast dtype under ``torch.autocast``).

        Raises
        ------
        ValueError
            ``x``'s last dim is not ``in_features``; ``save_original_input`` with a
            delayed-scaling input quantizer.
        TypeError
            ``is_first_microbatch`` is not None, True or False.
        RuntimeError
            ``is_first_microbatch=False`` with no matching kept copy; a forward run in backward
            outside ``hybridfp.autocast`` that is no recognised checkpoint recomputation.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> lin, x = hf.Linear(64, 32), torch.randn(4, 64)
        >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        ...     y1 = lin(x, is_first_microbatch=True)    # quantizes W and keeps the copy
        >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        ...     y2 = lin(x, is_first_microbatch=False)   # reuses it
        >>> torch.equal(y1, y2)
        True
        """
        if self._tensor_parallel is not None:  # parallelized: runs on the local shards
            return self._tensor_parallel.forward(self, x, is_first_microbatch)
        check_is_first_microbatch(is_first_microbatch, self._who())
        self.check_input_features(x)
        state = current_autocast()
        if state is None:
            return self.high_precision_linear(x, self.weight, self.bias)
        x = self.torch_autocast_input(x)
        return ops.quantized_linear(self, 0, x, self.weight, self.bias, state, is_first_microbatch)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
