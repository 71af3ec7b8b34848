"""``GroupedLinear``: the experts of an MoE layer, one weight per expert, one call.

``forward(x, m_splits)``: rows of ``x`` are grouped by expert (``m_splits[i]`` rows for
expert i, zero allowed); expert i computes ``x_i W_iᵀ + b_i``. Each expert has its own
quantizers per slot (role module_type "grouped_linear"), so per-tensor scales and blocks never
straddle two experts. The GEMMs per expert are those of ``Linear`` (see linear_function); each
of the three runs for all experts in one ``hybridfp.moe.grouped_gemm`` call (one grouped
kernel where the operand formats allow it, else per expert). The experts' inputs and output
gradients (and their stacked weights) are quantized together by ``quantize_grouped``, bitwise
what each expert's own quantizer makes: a row-local rowwise copy (Identity, MXFP8 1x32, FP8
block 1x128, row-scaled NVFP4) is encoded once and handed out as row-slice views; per-tensor
scales from the tensor's own amax (FP8 current scaling, NVFP4 1D rows) come from one segmented
amax and one cast pass for all experts (FP8 columnwise copies: each expert's own transpose,
a view of one buffer); columnwise block copies are encoded once and copied out per expert. Delayed scaling and stochastic rounding stay per
expert (each expert's amax history; each quantization's seed).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..config import current_policy, use_policy
from .gemm import grouped_gemm
from ..quantizers import HybridQuantizer, Quantizer
from .quantize import quantize_grouped
from .quantize_weights import quantize_weights_grouped
from ..recipes import current_autocast
from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from .expert_tensors import ExpertTensors
from ..tensors.slicing import adjacent_rows
from ..nn.base import SLOTS, QuantizedModule
from .saved import restore_experts, save_experts
from ..nn.linear_function import LinearContext, bias_grad, keeps_original_input, torch_autocast_off
from ..nn.weight_cache import WeightKey, check_is_first_microbatch, join_keys, new_entry, reusable, split_entry


class WeightReuse(NamedTuple):
    """What the weight cache decides with in one forward (see nn/weight_cache.py)."""

    region: Optional[object]  #: the autocast region's token
    is_first_microbatch: Optional[bool]  #: TransformerEngine's forward argument


#: Position of the first parameter among GroupedLinearFunction.forward's inputs.
_PARAMS = 6


class GroupedLinearFunction(torch.autograd.Function):
    """Per-expert quantized linears over row groups of one input.

    Each expert quantizes with its own quantizers (as ``Linear`` does, see linear_function);
    the three GEMMs then run for all experts at once through ``grouped_gemm``:

        fprop: y  = grouped_gemm([x_e.rowwise],     [W_e.rowwise],    "TN")  # [Σm_e, N]
        dgrad: dx = grouped_gemm([dy_e.rowwise],    [W_e.columnwise], "NN")  # [Σm_e, K]
        wgrad: dW = grouped_gemm([dy_e.columnwise], [x_e.columnwise], "NT")  # E x [N, K]
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m_splits: list[int], lcs: list[LinearContext],  # type: ignore[override]
                has_bias: bool, stacked: Optional[Sequence[torch.Tensor]], reuse: "WeightReuse",
                *params: torch.Tensor) -> torch.Tensor:
        """``params``: the experts' weights then biases (one Parameter each), or with ``stacked``
        (the experts' weights as views of one [E, N, K] Parameter, see ``single_parameter``)
        that Parameter and the [E, N] bias: its gradient comes back stacked. ``reuse``: the
        region token and ``is_first_microbatch`` the weight cache decides with."""
        n = len(lcs)
        grad_enabled = lcs[0].grad_enabled  # see LinearContext
        if stacked is not None:
            weights, biases = stacked, (params[1].unbind(0) if has_bias else (None,) * n)
            needs_wgrad = [ctx.needs_input_grad[_PARAMS] and grad_enabled] * n
        else:
            weights, biases = params[:n], (params[n:] if has_bias else (None,) * n)
            needs_wgrad = [ctx.needs_input_grad[_PARAMS + i] and grad_enabled for i in range(n)]
        needs_dgrad = ctx.needs_input_grad[0] and grad_enabled
        with torch_autocast_off(x):
            qxs, qws = _fprop_operands(x, m_splits, weights, lcs, needs_dgrad, needs_wgrad, reuse)
            y = grouped_gemm(qxs, qws, "TN", out_dtype=x.dtype, biases=list(biases) if has_bias else None)
        saved_xs = _saved_inputs(x, m_splits, qxs, lcs, needs_wgrad)
        # the experts' copies are views of a few shared buffers: saved as those (grouped_saved)
        tx, ctx.saved_x = save_experts(saved_xs)
        tw, ctx.saved_w = save_experts(qws if needs_dgrad else [None] * n)
        ctx.n_x = len(tx)
        ctx.save_for_backward(*tx, *tw)
        ctx.lcs, ctx.m_splits, ctx.has_bias, ctx.stacked = lcs, m_splits, has_bias, stacked is not None
        ctx.x_dtype, ctx.w_dtypes = x.dtype, [w.dtype for w in weights]
        ctx.policy = current_policy()  # backward may run on another thread: it re-enters this one
        ctx.b_dtypes = [b.dtype for b in biases] if has_bias else None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        saved_xs = restore_experts(ctx.saved_x, saved[:ctx.n_x])
        saved_ws = restore_experts(ctx.saved_w, saved[ctx.n_x:])
        n = len(ctx.lcs)
        needs_dgrad = ctx.needs_input_grad[0]
        needs_wgrad = ([ctx.needs_input_grad[_PARAMS]] * n if ctx.stacked else
                       [ctx.needs_input_grad[_PARAMS + i] for i in range(n)])
        with use_policy(ctx.policy), torch_autocast_off(dy):
            qdys = _quantize_grads(dy, ctx.m_splits, ctx.lcs, needs_dgrad, needs_wgrad)
            qxs = (saved_xs if isinstance(saved_xs, ExpertTensors) else
                   [_wgrad_input(saved_xs[i], lc) if needs_wgrad[i] else None for i, lc in enumerate(ctx.lcs)])
            dbs = ([bias_grad(dyi, dt) for dyi, dt in zip(torch.split(dy, ctx.m_splits), ctx.b_dtypes)]
                   if ctx.has_bias else [])
            dx = (grouped_gemm(qdys, saved_ws, "NN", out_dtype=ctx.x_dtype)
                  if needs_dgrad else None)
            dws = _wgrads(qdys, qxs, ctx.w_dtypes)
        if ctx.stacked:  # one [E, N, K] gradient (and one [E, N] bias gradient)
            return (dx, None, None, None, None, None, _stack(dws), *([_stack(dbs)] if ctx.has_bias else []))
        return (dx, None, None, None, None, None, *dws, *dbs)


def _split_counts(m_splits: Any, who: str) -> list[int]:
    """``m_splits`` as Python ints, refusing anything that is not integer counts (a float
    would be truncated and a string read digit by digit: rows silently routed elsewhere)."""
    def given() -> str:  # the value for an error message, formatted only when one is raised
        text = repr(m_splits)
        return text if len(text) <= 80 else text[:77] + "..."

    if torch.is_tensor(m_splits):
        if m_splits.dtype.is_floating_point or m_splits.dtype.is_complex or m_splits.dtype == torch.bool:
            raise TypeError(f"{who}: m_splits is a {m_splits.dtype} tensor; pass integer row counts "
                            "(an int64 tensor or a list of ints).")
        if m_splits.dim() != 1:
            raise ValueError(f"{who}: m_splits must be a one-dimensional tensor of row counts; got "
                             f"shape {tuple(m_splits.shape)}.")
        return [int(m) for m in m_splits.tolist()]
    if isinstance(m_splits, np.ndarray):  # numpy counts: the same checks as a tensor's
        if m_splits.dtype.kind not in "iu" or m_splits.ndim != 1:
            raise TypeError(f"{who}: m_splits is a numpy array of dtype {m_splits.dtype} and shape "
                            f"{m_splits.shape}; pass one-dimensional integer row counts.")
        return [int(m) for m in m_splits.tolist()]
    if isinstance(m_splits, (str, bytes)) or not isinstance(m_splits, Sequence):
        raise TypeError(f"{who}: m_splits={given()} is not a sequence of ints; pass the number of rows "
                        "of each expert, e.g. [4, 0, 9] (or an int64 tensor).")
    splits = []
    for m in m_splits:
        if isinstance(m, bool):
            raise TypeError(f"{who}: m_splits={given()} holds {m!r}; pass int row counts.")
        try:
            splits.append(operator.index(m))
        except TypeError:
            raise TypeError(f"{who}: m_splits={given()} holds {m!r} ({type(m).__name__}); pass int row "
                            "counts.") from None
    return splits


def _stack(ts: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The experts' gradients as one [E, ...] tensor: the buffer they are views of when they lie
    back to back in it (the joined wgrad writes one), else a stacked copy; None if none was
    computed."""
    if ts[0] is None:
        return None
    whole = adjacent_rows(ts)
    return whole.view(len(ts), *ts[0].shape) if whole is not None else torch.stack(list(ts))


def _fprop_operands(x: torch.Tensor, m_splits: list[int], weights: Sequence[torch.Tensor],
                    lcs: list[LinearContext], needs_dgrad: bool, needs_wgrad: list[bool],
                    reuse: WeightReuse) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every expert's fprop operands: x (``_quantize_inputs``) and the cached quantized W.

    With random draws (stochastic rounding) on an input or weight quantizer, the experts
    quantize x_e then W_e in turn, as the per-expert loop does, so every quantization gets the
    same seed from torch's generator; otherwise all inputs go in one grouped call first."""
    def weight(i: int) -> torch.Tensor:
        lc = lcs[i]
        return lc.module.quantized_weight(weights[i], lc.weight_q, columnwise=needs_dgrad, index=lc.weight_index,
                                          region=reuse.region, is_first_microbatch=reuse.is_first_microbatch)

    if _draws_randomly(lcs):
        qxs, qws = [], []
        for i, xi in enumerate(torch.split(x, m_splits)):
            qxs.append(_quantize_inputs(xi, [xi.shape[0]], lcs[i:i + 1], needs_wgrad[i:i + 1])[0])
            qws.append(weight(i))
        return qxs, qws
    qxs = _quantize_inputs(x, m_splits, lcs, needs_wgrad)
    return qxs, lcs[0].module.quantized_weights(weights, [lc.weight_q for lc in lcs], needs_dgrad, *reuse)


def _draws_randomly(lcs: list[LinearContext]) -> bool:
    """Whether an input or weight quantizer of some expert draws random numbers; for the
    module's own LinearContexts, the answer it keeps with them (settings are fixed)."""
    module = lcs[0].module if lcs else None
    if module is not None and lcs is getattr(module, "_lcs", None):
        return module._lcs_random
    return _any_random(lcs)


def _any_random(lcs: list[LinearContext]) -> bool:
    """Whether an input or weight quantizer of some expert draws random numbers (asked anew)."""
    return any(lc.input_q.uses_randomness() or lc.weight_q.uses_randomness() for lc in lcs)


def _quantize_inputs(x: torch.Tensor, m_splits: list[int], lcs: list[LinearContext],
                     needs_wgrad: list[bool]) -> list[torch.Tensor]:
    """Every expert's x with its rowwise copy (+ columnwise if its wgrad reads it), as
    ``forward_gemm`` quantizes them, in one ``quantize_grouped`` call (shared row-local
    encodings)."""
    for lc, wgrad in zip(lcs, needs_wgrad):
        lc.input_q.set_usage(rowwise=True, columnwise=wgrad and not keeps_original_input(lc))
    return quantize_grouped([lc.input_q for lc in lcs], x, m_splits, _plans(lcs))


def _quantize_grads(dy: torch.Tensor, m_splits: list[int], lcs: list[LinearContext], needs_dgrad: bool,
                    needs_wgrad: list[bool]) -> list[Optional[torch.Tensor]]:
    """Every expert's dy with the copies its dgrad / wgrad read (None: it needs neither)."""
    qs: list[Optional[Quantizer]] = []
    for lc, wgrad in zip(lcs, needs_wgrad):
        if needs_dgrad or wgrad:
            lc.grad_q.set_usage(rowwise=needs_dgrad, columnwise=wgrad)
            qs.append(lc.grad_q)
        else:
            qs.append(None)
    # detached: under create_graph=True backward runs with grad enabled and dy may require
    # grad; the quantization is not differentiated through (as Linear's backward)
    return quantize_grouped(qs, dy.detach().contiguous(), m_splits, _plans(lcs))


def _memo(module: Any) -> Optional[dict]:
    """``module``'s plan memo for ``quantize_grouped`` (None: plan afresh)."""
    return getattr(module, "_plans", None)


def _plans(lcs: list[LinearContext]) -> Optional[dict]:
    """The owning module's plan memo (``_memo``)."""
    return _memo(lcs[0].module) if lcs else None


def _saved_inputs(x: torch.Tensor, m_splits: list[int], qxs: Sequence[torch.Tensor], lcs: list[LinearContext],
                  needs_wgrad: list[bool]) -> Sequence[Optional[torch.Tensor]]:
    """Every expert's ``_saved_input`` (None where its wgrad is not needed); experts held as
    joined copies (``ExpertTensors``) stay so, their rowwise copies dropped."""
    if (isinstance(qxs, ExpertTensors) and all(needs_wgrad) and qxs.has_direction(COLUMNWISE)
            and not any(keeps_original_input(lc) for lc in lcs)):
        qxs.drop(ROWWISE)
        return qxs
    return [_saved_input(xi, qx, lcs[i]) if needs_wgrad[i] else None
            for i, (xi, qx) in enumerate(zip(torch.split(x, m_splits), qxs))]


def _saved_input(x2: torch.Tensor, qx: torch.Tensor, lc: LinearContext) -> torch.Tensor:
    """What wgrad needs of x: the original (``save_original_input`` with a requantization-safe
    quantizer) or the columnwise copy, the rowwise one dropped now that fprop is done."""
    if keeps_original_input(lc):
        return x2
    qx.update_usage(rowwise_usage=False)
    return qx


def _wgrad_input(saved_x: torch.Tensor, lc: LinearContext) -> torch.Tensor:
    """x's columnwise copy for wgrad, quantized now if the original was saved."""
    if isinstance(saved_x, QuantizedTensor):
        return saved_x
    lc.input_q.set_usage(rowwise=False, columnwise=True)
    return lc.input_q.quantize(saved_x)


def _wgrads(qdys: list[Optional[torch.Tensor]], qxs: list[Optional[torch.Tensor]],
            w_dtypes: list[torch.dtype]) -> list[Optional[torch.Tensor]]:
    """dW per expert (None where not needed): one grouped wgrad per weight dtype present."""
    if isinstance(qxs, ExpertTensors) and len(set(w_dtypes)) == 1:  # every expert, one call
        return list(grouped_gemm(qdys, qxs, "NT", out_dtype=w_dtypes[0]))
    dws: list[Optional[torch.Tensor]] = [None] * len(qdys)
    for dtype in dict.fromkeys(w_dtypes):
        idx = [i for i, qx in enumerate(qxs) if qx is not None and w_dtypes[i] == dtype]
        if idx:
            outs = grouped_gemm([qdys[i] for i in idx], [qxs[i] for i in idx], "NT", out_dtype=dtype)
            for i, dw in zip(idx, outs):
                dws[i] = dw
    return dws


#: ``_wcache`` key of the experts' weights quantized together (``ExpertTensors``); the
#: per-expert entries use the expert index.
_GROUP_SLOT = -1
#: ``_wcache`` key of ``single_parameter``'s experts quantized from the one weight Parameter
#: (``_quantized_stack``: a list or an ``ExpertTensors``, keyed by the Parameter).
_STACK_SLOT = -2


class GroupedLinear(QuantizedModule):
    """``num_gemms`` experts of shape [out_features, in_features] (parameters ``weight{i}``
    and ``bias{i}``, TransformerEngine's names).

    ``pack_weights`` (default True): the expert weights live in one [num_gemms, out, in]
    buffer, each ``weight{i}`` a slice of it (its own Parameter, gradient, version counter
    and state_dict entry), so the grouped weight quantization reads them in place instead of
    stacking them every step (``quantize_weights_grouped``; ``python -m bench.bench_moe``'s
    "[unpacked weights]" rows time the difference). The packing survives ``.to()`` / ``.cuda()``
    (re-packed after the move); parameters replaced from outside (FSDP2, ``load_state_dict(
    assign=True)``) are used as they are. ``safetensors.torch.save_file`` refuses tensors that
    share storage: save ``{k: v.clone()}`` there, or build with ``pack_weights=False``.

    ``single_parameter`` (default False): one Parameter ``weight`` [num_gemms, out, in] (and
    ``bias`` [num_gemms, out]) instead of ``weight{i}`` / ``bias{i}``, as torch-native MoE
    code (``torch._grouped_mm`` layers) holds its experts. Autograd then accumulates one
    gradient instead of one per expert (two AccumulateGrad calls a layer instead of 2 x
    num_gemms: less host work, timed by ``python -m bench.bench_moe``'s "[one weight
    Parameter]" rows), and an optimizer steps one tensor. The experts' values, quantization
    and results are bitwise those of the per-expert Parameters with the same seed; an in-place
    change re-quantizes every expert (one version counter). ``load_state_dict`` takes either
    layout's keys.

    Parameters
    ----------
    num_gemms:
        The number of experts, >= 1.
    in_features, out_features:
        Each expert's weight is [out_features, in_features].
    bias:
        Whether each expert has a learnable bias.
    params_dtype, device, save_original_input, name:
        As :class:`~hybridfp.Linear`'s.
    pack_weights:
        Keep the per-expert weights in one buffer (above).
    single_parameter:
        One [num_gemms, out, in] Parameter ``weight`` (above).

    Raises
    ------
    ValueError
        ``num_gemms`` < 1. From ``forward``: see :meth:`forward`.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> experts = hf.GroupedLinear(3, 64, 32, name="moe.fc1")
    >>> x = torch.randn(10, 64, requires_grad=True)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = experts(x, [4, 0, 6])        # rows 0-3: expert 0, rows 4-9: expert 2
    >>> y.sum().backward()
    >>> y.shape, experts.weight0.grad.shape
    (torch.Size([10, 32]), torch.Size([32, 64]))
    """

    module_type = "grouped_linear"
    #: The experts' per-tensor scales come from one segmented amax over all of them
    #: (moe/quantize_scaled.py), not from a recorded whole-tensor amax.
    reads_recorded_amax = False

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None,
                 save_original_input: bool = False, name: Optional[str] = None,
                 pack_weights: bool = True, single_parameter: bool = False) -> None:
        super().__init__(name, num_quantizer_sets=num_gemms)
        if num_gemms < 1:
            raise ValueError(f"GroupedLinear needs num_gemms >= 1; got {num_gemms}.")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.save_original_input = bias, save_original_input
        self.single_parameter = single_parameter
        kw = {"dtype": params_dtype or torch.float32, "device": device}
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        if single_parameter:
            self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, **kw))
            self.bias = nn.Parameter(torch.empty(num_gemms, out_features, **kw)) if bias else None
        for i in range(num_gemms):  # per expert, in the same order either way: the same init
            w = self.weight[i] if single_parameter else nn.Parameter(torch.empty(out_features, in_features, **kw))
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            b = (self.bias[i] if single_parameter else nn.Parameter(torch.empty(out_features, **kw))) if bias else None
            if b is not None:
                with torch.no_grad():
                    b.uniform_(-bound, bound)
            if not single_parameter:
                self.register_parameter(f"weight{i}", w)
                if b is not None:
                    self.register_parameter(f"bias{i}", b)
        # single_parameter: the experts' weights as detached views of ``weight`` (sharing its
        # version counter) and what they were made from; kept so that the weight cache's keys
        # (which hold each weight's identity) stay the same from one forward to the next
        self._views: list[list[torch.Tensor]] = [[], []]
        self._views_key: Optional[tuple] = None
        self.pack_weights = pack_weights
        # the experts' LinearContexts of the last forward and what they were built from: they
        # hold nothing per call, so a forward with the same quantizers reuses them
        self._lcs: list[LinearContext] = []
        self._lcs_key: Optional[tuple] = None
        self._lcs_random = False  # whether _lcs's input / weight quantizers draw random numbers
        # quantize_grouped's plans for this module's quantizers (``plans=``), emptied with them
        self._plans: dict = {}
        self._pack()

    def _pack(self) -> None:
        """Move the expert weights into one buffer (``pack_weights``), unless they already are
        consecutive slices of one or are not plain dense tensors (DTensor shards, quantized
        parameters, meta tensors: their storage belongs to someone else)."""
        if self.single_parameter:  # one buffer already
            return
        ws = self.weights()
        if not self.pack_weights or len(ws) < 2:
            return
        # plain dense tensors first: a wrapper subclass (DTensor) may not expose a data pointer
        if any(type(w.data) is not torch.Tensor or w.is_meta or w.layout != torch.strided for w in ws):
            return
        if len({(w.shape, w.dtype, w.device) for w in ws}) > 1 or adjacent_rows(ws) is not None:
            return
        with torch.no_grad():
            buf = torch.stack([w.detach() for w in ws])
            for w, b in zip(ws, buf):
                # .data keeps each Parameter's own version counter (a change to one expert
                # re-quantizes that expert only), unlike Parameters made from views
                w.data = b

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """``nn.Module``'s, after rewriting the other layout's keys into this module's (``weight{i}``
        / ``bias{i}`` stacked into ``weight`` / ``bias`` with ``single_parameter``, and back), so a
        checkpoint loads into either layout. ``load_state_dict`` hands this a copy of the dict."""
        for name in ("weight", "bias"):
            per_expert = [f"{prefix}{name}{i}" for i in range(self.num_gemms)]
            if self.single_parameter and prefix + name not in state_dict and all(k in state_dict for k in per_expert):
                parts = [state_dict[k] for k in per_expert]
                # experts of different shapes are left as they are: torch then reports the keys
                if all(torch.is_tensor(t) and t.shape == parts[0].shape for t in parts):
                    for k in per_expert:
                        del state_dict[k]
                    state_dict[prefix + name] = torch.stack(parts)
            elif not self.single_parameter and prefix + name in state_dict and per_expert[0] not in state_dict:
                whole = state_dict[prefix + name]
                if torch.is_tensor(whole) and whole.dim() >= 1 and whole.shape[0] == self.num_gemms:
                    del state_dict[prefix + name]
                    # copies, not views of one tensor: with assign=True each expert keeps its own
                    # version counter (an update to one re-quantizes that expert only)
                    state_dict.update(zip(per_expert, (t.clone() for t in whole.unbind(0))))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._pack()  # assign=True put new tensors in place: back into one buffer

    def _apply(self, fn: Any, recurse: bool = True) -> "GroupedLinear":
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``: each parameter moved on its
        own), then the weights re-packed into one buffer."""
        out = super()._apply(fn, recurse)
        if self.single_parameter:
            # the views (and the cached quantized weights keyed by them) belong to the old tensor:
            # dropped now, so a move (``.cpu()`` to offload) frees it
            self._views, self._views_key = [[], []], None
            self._wcache.clear()
        self._pack()
        return out

    def weights(self) -> list[torch.Tensor]:
        """Expert weights in order: the Parameters ``weight{i}``, or with ``single_parameter``
        views of ``weight`` [i] (detached: gradients reach ``weight`` through ``forward``)."""
        if self.single_parameter:
            return self._expert_views()[0]
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self) -> list[torch.Tensor]:
        """Expert biases in order (empty without bias); detached views of ``bias`` with
        ``single_parameter``."""
        if not self.use_bias:
            return []
        if self.single_parameter:
            return self._expert_views()[1]
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    def _expert_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``single_parameter``: per-expert detached views of ``weight`` and ``bias``, made again
        only when a parameter's tensor changes (``.to()``, ``.data =``, ``load_state_dict(assign=
        True)``): an in-place update keeps them (their version counter is the parameter's)."""
        w, b = self.weight, self.bias
        for what, t in (("weight", w), ("bias", b)):
            if isinstance(t, QuantizedTensor):
                raise ValueError(f"GroupedLinear {self.name or ''}: single_parameter=True takes a high-precision "
                                 f"{what} [num_gemms, ...]; got a quantized one. Quantized parameters need one "
                                 "per expert: build the module with single_parameter=False (weight{i}).")
        key = tuple((id(t), t.data_ptr(), t.shape, t.dtype, t.device) for t in (w, b) if t is not None)
        if key != self._views_key:
            self._views = [list(w.detach().unbind(0)), list(b.detach().unbind(0)) if b is not None else []]
            self._views_key = key
        return self._views[0], self._views[1]

    def quantized_weights(self, weights: Sequence[torch.Tensor], qs: Sequence[Quantizer], columnwise: bool,
                          region: Optional[object] = None,
                          is_first_microbatch: Optional[bool] = None) -> Sequence[torch.Tensor]:
        """Every expert's ``quantized_weight`` (same cache entries and rule, nn/weight_cache.py),
        the ones not reusable quantized together by ``quantize_weights_grouped`` (one encoding of
        the stacked weights where the formats allow; bitwise each expert's own). All experts
        quantized as views of shared encodings come back (and are cached) as one
        ``ExpertTensors``. ``region`` / ``is_first_microbatch``: as ``quantized_weight``'s, for
        every expert at once."""
        if self.single_parameter and weights is self._views[0]:
            return self._quantized_stack(qs, columnwise, region, is_first_microbatch)
        who = self._who()
        keys: list = [None if isinstance(w, QuantizedTensor) else self._weight_key(w, q) for w, q in zip(weights, qs)]
        joined = self._wcache.get(_GROUP_SLOT)
        if joined is not None:
            # reusable() may raise (is_first_microbatch=False): the entry stays for a retry
            if None not in keys and reusable(joined, list(weights), join_keys(keys), columnwise, region,
                                             is_first_microbatch, who):
                return joined.qw
            del self._wcache[_GROUP_SLOT]
            if is_first_microbatch is None:
                # some weights changed: the unchanged experts keep their quantized tensors
                # (per-expert entries from here on, same region), the others are quantized below
                for i, entry in enumerate(split_entry(joined)):
                    self._wcache[i] = entry
        out: list[Optional[torch.Tensor]] = [None] * len(weights)
        missing = []  # keys were read before quantizing (as quantized_weight does)
        for i, (w, key) in enumerate(zip(weights, keys)):
            if key is None:  # already quantized (quantized parameters)
                out[i] = w
            elif reusable(self._wcache.get(i), w, key, columnwise, region, is_first_microbatch, who):
                out[i] = self._wcache[i].qw
            else:
                missing.append(i)
        if missing:
            for i in missing:
                qs[i].set_usage(rowwise=True, columnwise=columnwise)
            qws = quantize_weights_grouped([qs[i] for i in missing], [weights[i] for i in missing],
                                           _memo(self))
            if isinstance(qws, ExpertTensors) and len(missing) == len(weights):
                # all experts quantized together as views of shared encodings: cached as one
                # entry (its per-expert tensors are built only if something asks for them);
                # per-expert entries of older weights would only hold memory now
                for i in range(len(weights)):
                    self._wcache.pop(i, None)
                self._wcache[_GROUP_SLOT] = new_entry(joined, join_keys(keys), qws, list(weights), region,
                                                      is_first_microbatch)
                return qws
            for i, qw in zip(missing, qws):
                self._wcache[i] = new_entry(self._wcache.get(i), keys[i], qw, weights[i], region, is_first_microbatch)
                out[i] = qw
        return out  # type: ignore[return-value]

    def _quantized_stack(self, qs: Sequence[Quantizer], columnwise: bool, region: Optional[object] = None,
                         is_first_microbatch: Optional[bool] = None) -> Sequence[torch.Tensor]:
        """``quantized_weights`` of ``single_parameter``'s expert views: one cache entry for the
        one Parameter (its version counter is every expert's; the quantizers are the module's,
        rebuilt only with a new recipe key, which empties the cache), the stacked weight handed
        to ``quantize_weights_grouped`` as it is. The per-expert path would build 64 keys and check
        the views' adjacency twice a call (host work a 64-expert MoE step cannot afford:
        ``python -m bench.bench_moe_overhead``); the results are the same tensors."""
        w = self.weight
        key = WeightKey(w._version, tuple(q.state_version() for q in self._stateful), self._qkey)
        entry = self._wcache.get(_STACK_SLOT)
        if reusable(entry, w, key, columnwise, region, is_first_microbatch, self._who()):
            return entry.qw  # type: ignore[union-attr]
        for q in qs:
            q.set_usage(rowwise=True, columnwise=columnwise)
        qws = quantize_weights_grouped(qs, self._views[0], _memo(self), stacked=w.detach())
        self._wcache[_STACK_SLOT] = new_entry(entry, key, qws, w, region, is_first_microbatch)
        return qws

    def _check_splits(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> list[int]:
        """``m_splits`` as a list of ints, checked against the experts and the input's rows.

        Parameters
        ----------
        x:
            The [tokens, in_features] input.
        m_splits:
            Rows per expert: a sequence of non-negative Python ints (``operator.index``-able,
            not bool), or a 1-D integer tensor (read once with ``tolist()``: a CUDA tensor
            costs the one host sync it always did).

        Returns
        -------
        list[int]
            The row counts.

        Raises
        ------
        TypeError
            Not a sequence / tensor of integers (floats, strings, None, bools).
        ValueError
            Wrong number of entries, a negative entry, or a sum other than ``x``'s rows.
        """
        who = f"GroupedLinear {self.name or ''}".rstrip()
        splits = _split_counts(m_splits, who)
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

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """x: [sum(m_splits), in_features] -> [sum(m_splits), out_features]; expert i computes
        ``x_i W_iᵀ + b_i`` on its ``m_splits[i]`` consecutive rows.

        Parameters
        ----------
        x:
            The [tokens, in_features] input, rows grouped by expert.
        m_splits:
            Rows per expert: a sequence of non-negative ints (zero allowed), or a 1-D integer
            tensor (read once with ``tolist()``).
        is_first_microbatch:
            As :meth:`Linear.forward`'s (TransformerEngine's weight reuse across autocast
            regions, for every expert at once; see ``hybridfp.nn.weight_cache``).

        Returns
        -------
        torch.Tensor
            [tokens, out_features].

        Raises
        ------
        ValueError
            ``x`` is not [tokens, in_features]; ``m_splits`` has the wrong length, a negative
            entry, or a sum other than ``x``'s rows; the recipe returns hybrid quantizers for
            some experts of a slot and plain ones for others (or mixed ``columnwise_source``).
        TypeError
            ``m_splits`` is not integer counts; ``is_first_microbatch`` not None / True /
            False.
        RuntimeError
            As :meth:`Linear.forward`.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> experts = hf.GroupedLinear(2, 16, 8)
        >>> experts(torch.randn(5, 16), torch.tensor([2, 3])).shape
        torch.Size([5, 8])
        """
        check_is_first_microbatch(is_first_microbatch, self._who())
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear {self.name}: input must be [tokens, {self.in_features}]; "
                             f"got {tuple(x.shape)}.")
        splits = self._check_splits(x, m_splits)
        state = current_autocast()
        if state is None:
            if self.single_parameter:  # autograd views, so that the gradients reach the Parameters
                ws = self.weight.unbind(0)
                bs = self.bias.unbind(0) if self.use_bias else [None] * self.num_gemms
            else:
                ws, bs = self.weights(), self.biases() or [None] * self.num_gemms
            outs = [self.high_precision_linear(xi, w, b) for xi, w, b in zip(torch.split(x, splits), ws, bs)]
            return torch.cat(outs)
        qs = self.quantizers(state)
        x = self.torch_autocast_input(x)
        grad_enabled = torch.is_grad_enabled()
        last = self._lcs_key  # (the quantizers dict itself, held: its id cannot be reused, flags)
        if last is None or last[0] is not qs or last[1:] != (self.save_original_input, grad_enabled):
            self._lcs = [LinearContext(qs["input"][i], qs["weight"][i], qs["grad_output"][i], self, i,
                                       self.save_original_input, grad_enabled) for i in range(self.num_gemms)]
            self._lcs_random = _any_random(self._lcs)
            if last is None or last[0] is not qs:
                self._plans = {}  # new quantizers: the old plans' keys name the old ones
            self._lcs_key = (qs, self.save_original_input, grad_enabled)
        reuse = WeightReuse(state.token, is_first_microbatch)
        if self.single_parameter:
            params = (self.weight, self.bias) if self.use_bias else (self.weight,)
            return GroupedLinearFunction.apply(x, splits, self._lcs, self.use_bias, self._expert_views()[0], reuse,
                                               *params)
        return GroupedLinearFunction.apply(x, splits, self._lcs, self.use_bias, None, reuse, *self.weights(),
                                           *self.biases())

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}"
                + (", single_parameter=True" if self.single_parameter else ""))
