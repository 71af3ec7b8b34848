"""``GroupedLinear``: the experts of an MoE layer, one weight per expert, one call.

``forward(x, m_splits)``: rows of ``x`` are grouped by expert (``m_splits[i]`` rows for
expert i, zero allowed); expert i computes ``x_i W_iᵀ + b_i``. Each expert has its own
quantizers per slot (role module_type "grouped_linear"), so per-tensor scales and blocks never
straddle two experts. The GEMMs per expert are those of ``Linear`` (see linear_function).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..quantizers import HybridQuantizer, Quantizer
from ..recipes import current_autocast
from .base import SLOTS, QuantizedModule
from .linear_function import (LinearContext, backward_gemms, bias_grad, forward_gemm, pack,
                              torch_autocast_off, unpack)


class GroupedLinearFunction(torch.autograd.Function):
    """Per-expert quantized linears over row groups of one input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m_splits: list[int], lcs: list[LinearContext],  # type: ignore[override]
                has_bias: bool, *params: torch.Tensor) -> torch.Tensor:
        n = len(lcs)
        weights, biases = params[:n], (params[n:] if has_bias else (None,) * n)
        grad_enabled = lcs[0].grad_enabled  # see LinearContext
        needs_dgrad = ctx.needs_input_grad[0] and grad_enabled
        needs_wgrad = [ctx.needs_input_grad[4 + i] and grad_enabled for i in range(n)]
        outs, tensors, skels = [], [], []
        with torch_autocast_off(x):
            for i, xi in enumerate(torch.split(x, m_splits)):
                y, sx, sw = forward_gemm(xi, weights[i], biases[i], lcs[i], needs_dgrad, needs_wgrad[i])
                outs.append(y)
                for t in (sx, sw):
                    ts, sk = pack(t)
                    skels.append((sk, len(ts)))
                    tensors.extend(ts)
        ctx.save_for_backward(*tensors)
        ctx.skels, ctx.lcs, ctx.m_splits, ctx.has_bias = skels, lcs, m_splits, has_bias
        ctx.x_dtype, ctx.w_dtypes = x.dtype, [w.dtype for w in weights]
        ctx.b_dtypes = [b.dtype for b in biases] if has_bias else None
        return torch.cat(outs) if outs else x.new_zeros(0, weights[0].shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        saved, it = list(ctx.saved_tensors), 0
        restored = []
        for sk, k in ctx.skels:
            restored.append(unpack(sk, saved[it:it + k]))
            it += k
        needs_dgrad = ctx.needs_input_grad[0]
        dxs, dws, dbs = [], [], []
        with torch_autocast_off(dy):
            for i, dyi in enumerate(torch.split(dy, ctx.m_splits)):
                needs_wgrad = ctx.needs_input_grad[4 + i]
                dx, dw = backward_gemms(dyi, restored[2 * i], restored[2 * i + 1], ctx.lcs[i],
                                        ctx.x_dtype, ctx.w_dtypes[i], needs_dgrad, needs_wgrad)
                dxs.append(dx)
                dws.append(dw)
                if ctx.has_bias:
                    dbs.append(bias_grad(dyi, ctx.b_dtypes[i]))
        dx = torch.cat(dxs) if needs_dgrad else None
        return (dx, None, None, None, *dws, *dbs)


class GroupedLinear(QuantizedModule):
    """``num_gemms`` experts of shape [out_features, in_features] (parameters ``weight{i}``
    and ``bias{i}``, TransformerEngine's names)."""

    module_type = "grouped_linear"

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name, num_quantizer_sets=num_gemms)
        if num_gemms < 1:
            raise ValueError(f"GroupedLinear needs num_gemms >= 1; got {num_gemms}.")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.save_original_input = bias, save_original_input
        kw = {"dtype": params_dtype or torch.float32, "device": device}
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        for i in range(num_gemms):
            w = nn.Parameter(torch.empty(out_features, in_features, **kw))
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features, **kw).uniform_(-bound, bound)))

    def weights(self) -> list[nn.Parameter]:
        """Expert weights in order."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self) -> list[nn.Parameter]:
        """Expert biases in order (empty without bias)."""
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []

    def _check_splits(self, x: torch.Tensor, m_splits: Sequence[int]) -> list[int]:
        splits = [int(m) for m in (m_splits.tolist() if torch.is_tensor(m_splits) else m_splits)]
        who = f"GroupedLinear {self.name or ''}".rstrip()
        if len(splits) != self.num_gemms:
            raise ValueError(f"{who}: m_splits has {len(splits)} entries; it needs one per expert "
                             f"({self.num_gemms}).")
        if any(m < 0 for m in splits):
            raise ValueError(f"{who}: m_splits {splits} has negative entries.")
        if sum(splits) != x.shape[0]:
            raise ValueError(f"{who}: m_splits sum to {sum(splits)} but the input has {x.shape[0]} "
                             "rows; pass the number of rows routed to each expert (input flattened "
                             "to [tokens, in_features]).")
        return splits

    def _validate_quantizers(self, built: dict[str, list[Quantizer]]) -> None:
        """All experts of a slot must be all-hybrid or all-plain, with one columnwise_source."""
        for slot in SLOTS:
            qs = built[slot]
            hybrid = {isinstance(q, HybridQuantizer) for q in qs}
            if len(hybrid) > 1:
                raise ValueError(f"role {qs[0].role}: the factory returned HybridQuantizers for some "
                                 "experts and plain quantizers for others; return the same kind for "
                                 "every expert of a GroupedLinear.")
            sources = {q.columnwise_source for q in qs if isinstance(q, HybridQuantizer)}
            if len(sources) > 1:
                raise ValueError(f"role {qs[0].role}: experts use different columnwise_source values "
                                 f"({sorted(sources)}); use one for every expert.")

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        """x: [sum(m_splits), in_features] -> [sum(m_splits), out_features]."""
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear {self.name}: input must be [tokens, {self.in_features}]; "
                             f"got {tuple(x.shape)}.")
        splits = self._check_splits(x, m_splits)
        state = current_autocast()
        if state is None:
            bs = self.biases() or [None] * self.num_gemms
            outs = [self.high_precision_linear(xi, w, b)
                    for xi, w, b in zip(torch.split(x, splits), self.weights(), bs)]
            return torch.cat(outs)
        qs = self.quantizers(state)
        x = self.torch_autocast_input(x)
        grad_enabled = torch.is_grad_enabled()
        lcs = [LinearContext(qs["input"][i], qs["weight"][i], qs["grad_output"][i], self, i,
                             self.save_original_input, grad_enabled) for i in range(self.num_gemms)]
        return GroupedLinearFunction.apply(x, splits, lcs, self.use_bias, *self.weights(), *self.biases())

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
