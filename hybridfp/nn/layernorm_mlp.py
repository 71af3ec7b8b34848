"""``LayerNormMLP``: norm, fc1, activation, fc2 in one module (TransformerEngine's names).

The two GEMM sets run the autograd function of ``Linear`` (``linear_function.py``), each with
its own quantizers (quantizer sets 0 and 1 of every slot, roles ``<name>.fc1.*`` and
``<name>.fc2.*``), in the order the composed ``LayerNormLinear(fc1) -> activation ->
Linear(fc2)`` runs them: the results are bitwise those of the composed modules. The norm output
is quantized once, by fc1's input quantizer; the activation output once, by fc2's.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Policy
from ..quantizers import Quantizer
from ..recipes import AutocastState, QuantizerRole, current_autocast
from . import ops
from .base import QuantizedModule
from .layernorm_linear import check_normalization, normalize
from .linear import Linear
from .linear_function import LinearContext, region_context
from .quantized_init import build_part
from .swiglu import swiglu
from .weight_cache import check_is_first_microbatch


def _gelu(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")  # TransformerEngine's GeLU is the tanh form


def _srelu(t: torch.Tensor) -> torch.Tensor:
    r = F.relu(t)
    return r * r


def _qgelu(t: torch.Tensor) -> torch.Tensor:
    return t * torch.sigmoid(1.702 * t)


#: Elementwise activations by name; the gated ones apply the same function to the first half
#: of fc1's output and multiply by the second half.
_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu, "relu": F.relu, "srelu": _srelu, "qgelu": _qgelu, "silu": F.silu}
_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "geglu": _gelu, "reglu": F.relu, "sreglu": _srelu, "qgeglu": _qgelu, "swiglu": F.silu}
#: The activation names ``LayerNormMLP`` takes.
ACTIVATIONS = tuple(_ELEMENTWISE) + tuple(_GATED)
#: The names of the two GEMM sets (quantizer sets 0 and 1; the roles' name suffixes).
GEMM_SETS = ("fc1", "fc2")


def activate(activation: str, y: torch.Tensor) -> torch.Tensor:
    """``activation`` of fc1's output ``y``; a gated one splits y's last dim as [gate | up].

    "swiglu" runs the fused :func:`~hybridfp.swiglu` on y as one tensor (one kernel each way on
    CUDA; y's gradient written whole, with its amax recorded for fc1's FP8 current scaling).
    """
    if activation == "swiglu":
        return swiglu(y)
    if activation in _GATED:
        g, u = y.chunk(2, dim=-1)
        return _GATED[activation](g) * u
    return _ELEMENTWISE[activation](y)


class LayerNormMLP(QuantizedModule):
    """y = fc2(act(fc1(norm(x)))): TransformerEngine's ``LayerNormMLP``.

    The norm and the activation run in high precision; fc1's and fc2's GEMMs are quantized
    with their own quantizers (roles ``<name>.fc1.input`` ... ``<name>.fc2.grad_output``,
    module_type "linear"), bitwise as the composed ``LayerNormLinear`` -> activation ->
    ``Linear`` named ``<name>.fc1`` / ``<name>.fc2``. The recipe's ``backward_override``
    applies to both GEMM sets.

    Parameters
    ----------
    hidden_size:
        The input and output width.
    ffn_hidden_size:
        The width after the activation (fc1 makes twice as many for a gated activation).
    bias:
        Whether fc1 and fc2 have biases (``fc1_bias``, ``fc2_bias``).
    normalization:
        "LayerNorm" (``layer_norm_weight``, ``layer_norm_bias``) or "RMSNorm" (weight only).
    activation:
        "gelu" (tanh form, TE's), "relu", "srelu" (squared ReLU), "qgelu" (x sigmoid(1.702 x)),
        "silu", or the gated "swiglu" (fused, :func:`~hybridfp.swiglu`), "geglu", "reglu",
        "sreglu", "qgeglu" (act(first half) * second half of fc1's output).
    eps:
        The norm's epsilon.
    params_dtype, device, save_original_input, name:
        As :class:`~hybridfp.Linear`'s (``save_original_input`` for both GEMM sets).

    Raises
    ------
    ValueError
        An unknown ``normalization`` or ``activation``; from ``forward``, as
        :meth:`Linear.forward`.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> mlp = hf.LayerNormMLP(64, 128, activation="swiglu", normalization="RMSNorm", name="mlp")
    >>> x = torch.randn(8, 64, requires_grad=True)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = mlp(x)
    >>> y.sum().backward()
    >>> y.shape, tuple(mlp.fc1_weight.shape), [str(r) for r in mlp.quantizer_roles()["weight"]]
    (torch.Size([8, 64]), (256, 64), ['mlp.fc1.weight', 'mlp.fc2.weight'])
    """

    supports_backward_override = True
    quantized_weight_slots = (("fc1_weight", 0), ("fc2_weight", 1))

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, *,
                 normalization: str = "LayerNorm", activation: str = "gelu", eps: float = 1e-5,
                 params_dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name, num_quantizer_sets=len(GEMM_SETS))
        check_normalization(normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation={activation!r} is unknown; use one of "
                             f"{', '.join(repr(a) for a in ACTIVATIONS)}.")
        self.normalization, self.activation, self.eps = normalization, activation, eps
        self.in_features, self.hidden_size, self.ffn_hidden_size = hidden_size, hidden_size, ffn_hidden_size
        self.save_original_input = save_original_input
        kw = {"dtype": params_dtype or torch.float32, "device": device}
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size, **kw))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(hidden_size, **kw))
                                if normalization == "LayerNorm" else None)
        fc1_out = 2 * ffn_hidden_size if activation in _GATED else ffn_hidden_size
        fc1 = build_part(lambda: Linear(hidden_size, fc1_out, bias, params_dtype=kw["dtype"], device=device))
        fc2 = build_part(lambda: Linear(ffn_hidden_size, hidden_size, bias, params_dtype=kw["dtype"], device=device))
        # the same initialisation as Linear's, owned here under TE's names
        self.fc1_weight, self.fc1_bias = fc1.weight, fc1.bias
        self.fc2_weight, self.fc2_bias = fc2.weight, fc2.bias
        ops.register(self)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        ops.register(self)  # a copy (deepcopy, unpickling) is reachable from the compiled ops too

    def set_role(self, tensor_type: str, index: int) -> QuantizerRole:
        """Set 0 serves fc1, set 1 fc2: ``<name>.fc1`` / ``<name>.fc2`` (``fc1`` / ``fc2``
        unnamed)."""
        gemm = GEMM_SETS[index]
        return QuantizerRole(self.module_type, tensor_type, f"{self.name}.{gemm}" if self.name else gemm)

    def _sets(self, built: dict[str, list[Quantizer]]) -> list[dict[str, list[Quantizer]]]:
        """``built`` as one single-set dict per GEMM set."""
        return [{slot: [qs[i]] for slot, qs in built.items()} for i in range(len(GEMM_SETS))]

    def _hold_decoded(self, built: dict[str, list[Quantizer]], pol: Policy) -> None:
        """Per GEMM set, from that set's own formats (fc1 and fc2 may differ); a quantizer
        object a factory handed to both sets holds nothing decoded (as one shared by slots)."""
        for one in self._sets(built):
            super()._hold_decoded(one, pol)
        seen: dict[int, int] = {}
        for qs in built.values():
            for q in qs:
                seen[id(q)] = seen.get(id(q), 0) + 1
        for qs in built.values():
            for q in qs:
                if seen[id(q)] > 1:
                    q.hold_decoded = frozenset()

    def _report_emulated(self, built: dict[str, list[Quantizer]]) -> None:
        """Report each GEMM set's pairs (fc1's and fc2's formats may differ)."""
        for one in self._sets(built):
            super()._report_emulated(one)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The normalization, in x's dtype with FP32 statistics (as LayerNormLinear's)."""
        return normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """norm, fc1, activation, fc2 (the GEMMs quantized inside autocast).

        Parameters
        ----------
        x:
            The input, [..., hidden_size].
        is_first_microbatch:
            As :meth:`Linear.forward`'s, for both weights.

        Returns
        -------
        torch.Tensor
            [..., hidden_size].

        Raises
        ------
        ValueError, TypeError, RuntimeError
            As :meth:`Linear.forward`; NotImplementedError never (both GEMM sets honour a
            recipe's ``backward_override``).

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> hf.LayerNormMLP(32, 64)(torch.randn(2, 32)).shape    # outside autocast: high precision
        torch.Size([2, 32])
        """
        if self._tensor_parallel is not None:  # parallelized: runs on the local shards
            return self._tensor_parallel.forward(self, x, is_first_microbatch)
        check_is_first_microbatch(is_first_microbatch, self._who())
        self.check_input_features(x)
        h = self.norm(x)
        state = current_autocast()
        if state is None:
            a = activate(self.activation, self.high_precision_linear(h, self.fc1_weight, self.fc1_bias))
            return self.high_precision_linear(a, self.fc2_weight, self.fc2_bias)
        h = self.torch_autocast_input(h)
        y1 = ops.quantized_linear(self, 0, h, self.fc1_weight, self.fc1_bias, state, is_first_microbatch)
        a = self.torch_autocast_input(activate(self.activation, y1))
        return ops.quantized_linear(self, 1, a, self.fc2_weight, self.fc2_bias, state, is_first_microbatch)

    def linear_context(self, state: AutocastState, index: int, is_first_microbatch: Optional[bool],
                       grad_enabled: Optional[bool] = None) -> LinearContext:
        """GEMM set ``index``'s context: its quantizers and weight-cache slot. No shared-input
        memo: both inputs are this module's own intermediates, read by no other layer.
        ``grad_enabled`` None: torch's grad mode now."""
        return region_context(self, state, index, is_first_microbatch, grad_enabled, share_input=False)

    def extra_repr(self) -> str:
        return (f"{self.normalization}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}, "
                f"bias={self.fc1_bias is not None}")
