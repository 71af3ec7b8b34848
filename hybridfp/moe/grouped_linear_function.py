"""``GroupedLinearFunction``: the autograd function of ``GroupedLinear``'s step.

Forward quantizes every expert's input (``quantize_grouped``) and weight (the module's cache),
runs fprop for all experts in one ``grouped_gemm`` call and saves the experts' copies for
backward (``saved.py``); backward quantizes the output gradients together and runs dgrad and
wgrad the same way.

The recipe's ``backward_override`` has Linear's meaning per expert (``nn/linear_function.py``):
the forward makes no columnwise copy and saves x's rows and the high-precision weights
("high_precision") or the experts' rowwise copies ("dequantized"); backward runs each expert's
dgrad and wgrad unquantized on those (dequantized) operands with dy unquantized, by
``backward_gemms`` per expert: Linear's GEMMs, one expert at a time (no grouped kernel for
these plain operands).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from ..config import current_policy, use_policy
from ..quantizers import Quantizer
from ..quantizers.base import set_usages
from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from ..nn.linear_function import (LinearContext, backward_gemms, backward_override, bias_grad, check_dgrad_weight, keeps_original_input,
                                  once_differentiable_quantized, torch_autocast_off)
from .grouped_tensor import GroupedTensor
from .gemm import grouped_gemm, grouped_wgrad
from .quantize import quantize_grouped
from .saved import restore_experts, save_experts


class WeightReuse(NamedTuple):
    """What the weight cache decides with in one forward (see nn/weight_cache.py)."""

    region: Optional[object]  #: the autocast region's token
    is_first_microbatch: Optional[bool]  #: TransformerEngine's forward argument


#: Position of the first parameter among GroupedLinearFunction.forward's inputs.
_PARAMS = 6


def _grouped_cross_terms(ctx: Any) -> bool:
    """dx reads the experts' weights and their dW read x: x and some weight both requiring grad
    makes second-order terms (the biases' gradients read neither)."""
    n = len(ctx.lcs)
    weights = ctx.needs_input_grad[_PARAMS:_PARAMS + (1 if ctx.stacked else n)]
    return bool(ctx.needs_input_grad[0] and any(weights))


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
        mode = backward_override(lcs[0])  # one recipe: the same for every expert
        if mode == "high_precision" and needs_dgrad and any(isinstance(w, QuantizedTensor) for w in weights):
            raise ValueError(f"{lcs[0].module._who()}: backward_override='high_precision' reads the experts' "
                             "high-precision weights, but they are QuantizedTensors (quantized_model_init: no "
                             "high-precision value exists); use backward_override='dequantized'.")
        # with an override backward reads no columnwise copy: none is made
        col_wgrad = needs_wgrad if mode is None else [False] * n
        with torch_autocast_off(x):
            qxs, qws = _fprop_operands(x, m_splits, weights, lcs, needs_dgrad and mode is None, col_wgrad, reuse)
            y = grouped_gemm(qxs, qws, "TN", out_dtype=x.dtype, biases=list(biases) if has_bias else None)
        if mode is None:
            saved_xs = _saved_inputs(x, m_splits, qxs, lcs, needs_wgrad)
            keeps_x = all(keeps_original_input(lc) for lc in lcs)
        elif mode == "high_precision":  # x's rows and the weights themselves
            saved_xs, keeps_x = [xi if need else None for xi, need in zip(torch.split(x, m_splits), needs_wgrad)], True
            qws = weights
        else:  # "dequantized": the rowwise copies the forward multiplied
            saved_xs = qxs if all(needs_wgrad) else [qx if need else None for qx, need in zip(qxs, needs_wgrad)]
            keeps_x = False
        # the experts' copies are views of a few shared buffers: saved as those (grouped_saved)
        # every expert keeps its rows of x: x itself is saved (the caller states the layout)
        whole_x = x if all(needs_wgrad) and keeps_x else None
        tx, ctx.saved_x = save_experts(saved_xs, rows_of=whole_x)
        tw, ctx.saved_w = save_experts(qws if needs_dgrad else [None] * n)
        ctx.mode = mode
        ctx.n_x = len(tx)
        ctx.save_for_backward(*tx, *tw)
        ctx.lcs, ctx.m_splits, ctx.has_bias, ctx.stacked = lcs, m_splits, has_bias, stacked is not None
        ctx.x_dtype, ctx.w_dtypes = x.dtype, [w.dtype for w in weights]
        ctx.policy = current_policy()  # backward may run on another thread: it re-enters this one
        ctx.b_dtypes = [b.dtype for b in biases] if has_bias else None
        return y

    @staticmethod
    @once_differentiable_quantized(lambda ctx: ctx.lcs[0].module._who(), _grouped_cross_terms)
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        saved_xs = restore_experts(ctx.saved_x, saved[:ctx.n_x])
        saved_ws = restore_experts(ctx.saved_w, saved[ctx.n_x:])
        n = len(ctx.lcs)
        needs_dgrad = ctx.needs_input_grad[0]
        needs_wgrad = ([ctx.needs_input_grad[_PARAMS]] * n if ctx.stacked else
                       [ctx.needs_input_grad[_PARAMS + i] for i in range(n)])
        with use_policy(ctx.policy), torch_autocast_off(dy):
            dbs = ([bias_grad(dyi, dt) for dyi, dt in zip(torch.split(dy, ctx.m_splits), ctx.b_dtypes)]
                   if ctx.has_bias else [])
            if ctx.mode is not None:
                dx, dws = _override_grads(ctx, dy, saved_xs, saved_ws, needs_dgrad, needs_wgrad)
                dw_all = None  # separate per-expert results: stacked for single_parameter
            else:
                qdys = _quantize_grads(dy, ctx.m_splits, ctx.lcs, needs_dgrad, needs_wgrad)
                qxs = (saved_xs if isinstance(saved_xs, GroupedTensor) else
                       [_wgrad_input(saved_xs[i], lc) if needs_wgrad[i] else None for i, lc in enumerate(ctx.lcs)])
                if needs_dgrad and not isinstance(saved_ws, GroupedTensor):
                    for w, lc in zip(saved_ws, ctx.lcs):
                        check_dgrad_weight(w, lc.module._who())
                dx = (grouped_gemm(qdys, saved_ws, "NN", out_dtype=ctx.x_dtype)
                      if needs_dgrad else None)
                dws, dw_all = _wgrads(qdys, qxs, ctx.w_dtypes)
        if ctx.stacked:  # one [E, N, K] gradient (and one [E, N] bias gradient)
            return (dx, None, None, None, None, None, _stack(dws, dw_all), *([_stack(dbs)] if ctx.has_bias else []))
        return (dx, None, None, None, None, None, *dws, *dbs)


def _override_grads(ctx: Any, dy: torch.Tensor, saved_xs: Sequence[Optional[torch.Tensor]],
                    saved_ws: Sequence[Optional[torch.Tensor]], needs_dgrad: bool, needs_wgrad: list[bool]
                    ) -> tuple[Optional[torch.Tensor], list[Optional[torch.Tensor]]]:
    """(dx, dW per expert) of a ``backward_override``: each expert's dgrad and wgrad as Linear
    runs them (``backward_gemms``: dy unquantized, the saved operands as they are or their
    rowwise copies dequantized), one expert at a time."""
    dxs, dws = [], []
    for e, (dye, lc) in enumerate(zip(torch.split(dy, ctx.m_splits), ctx.lcs)):
        dxe, dwe = backward_gemms(dye, saved_xs[e], saved_ws[e], lc, ctx.x_dtype, ctx.w_dtypes[e],
                                  needs_dgrad, needs_wgrad[e])
        dxs.append(dxe)
        dws.append(dwe)
    return (torch.cat(dxs) if needs_dgrad else None), dws


def _stack(ts: Sequence[Optional[torch.Tensor]], whole: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The experts' gradients as one [E, ...] tensor: ``whole`` when the grouped GEMM wrote them
    as one (``_wgrads`` says so), else a stacked copy; None if none was computed."""
    if ts[0] is None:
        return None
    return whole.contiguous() if whole is not None else torch.stack(list(ts))


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
    return any_random(lcs)


def any_random(lcs: list[LinearContext]) -> bool:
    """Whether an input or weight quantizer of some expert draws random numbers (asked anew)."""
    return any(lc.input_q.uses_randomness() or lc.weight_q.uses_randomness() for lc in lcs)


def _quantize_inputs(x: torch.Tensor, m_splits: list[int], lcs: list[LinearContext],
                     needs_wgrad: list[bool]) -> list[torch.Tensor]:
    """Every expert's x with its rowwise copy (+ columnwise if its wgrad reads it), as
    ``forward_gemm`` quantizes them, in one ``quantize_grouped`` call (shared row-local
    encodings)."""
    qs = [lc.input_q for lc in lcs]
    # save_original_input read first: no call per expert when the option is off (the default)
    cols = [wgrad and not (lc.save_original_input and keeps_original_input(lc)) for lc, wgrad in zip(lcs, needs_wgrad)]
    set_usages(qs, [True] * len(qs), cols)
    return quantize_grouped(qs, x, m_splits, _plans(lcs))


def _quantize_grads(dy: torch.Tensor, m_splits: list[int], lcs: list[LinearContext], needs_dgrad: bool,
                    needs_wgrad: list[bool]) -> list[Optional[torch.Tensor]]:
    """Every expert's dy with the copies its dgrad / wgrad read (None: it needs neither)."""
    qs: list[Optional[Quantizer]] = [lc.grad_q if needs_dgrad or wgrad else None for lc, wgrad in zip(lcs, needs_wgrad)]
    used = [(q, wgrad) for q, wgrad in zip(qs, needs_wgrad) if q is not None]
    set_usages([q for q, _ in used], [needs_dgrad] * len(used), [wgrad for _, wgrad in used])
    # detached: under create_graph=True backward runs with grad enabled and dy may require
    # grad; the quantization is not differentiated through (as Linear's backward)
    return quantize_grouped(qs, dy.detach().contiguous(), m_splits, _plans(lcs))


def plan_memo(module: Any) -> Optional[dict]:
    """``module``'s plan memo for ``quantize_grouped`` (None: plan afresh)."""
    return getattr(module, "_plans", None)


def _plans(lcs: list[LinearContext]) -> Optional[dict]:
    """The owning module's plan memo (``plan_memo``)."""
    return plan_memo(lcs[0].module) if lcs else None


def _saved_inputs(x: torch.Tensor, m_splits: list[int], qxs: Sequence[torch.Tensor], lcs: list[LinearContext],
                  needs_wgrad: list[bool]) -> Sequence[Optional[torch.Tensor]]:
    """Every expert's ``_saved_input`` (None where its wgrad is not needed); experts held as a
    ``GroupedTensor`` stay one (their rowwise copies dropped) when they save columnwise copies
    it holds joined."""
    if isinstance(qxs, GroupedTensor) and not any([lc.save_original_input and keeps_original_input(lc) for lc in lcs]):
        if all(needs_wgrad) and qxs.has_direction(COLUMNWISE):
            qxs.drop(ROWWISE)
            return qxs
        if qxs.joined(COLUMNWISE) is not None:  # some experts' wgrad: theirs, as views of the copy
            keep = [_saved_input(None, qx, lc) if need else None for qx, lc, need in zip(qxs, lcs, needs_wgrad)]
            return GroupedTensor(m_splits, {COLUMNWISE: qxs.joined(COLUMNWISE)}, experts=keep)
    return [_saved_input(xi, qx, lcs[i]) if needs_wgrad[i] else None
            for i, (xi, qx) in enumerate(zip(torch.split(x, m_splits), qxs))]


def _saved_input(x2: Optional[torch.Tensor], qx: torch.Tensor, lc: LinearContext) -> torch.Tensor:
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
            w_dtypes: list[torch.dtype]) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
    """(dW per expert (None where not needed), the [E, N, K] tensor they are the slices of when
    one grouped wgrad wrote every expert's, else None): one grouped wgrad per weight dtype
    present."""
    if (isinstance(qxs, GroupedTensor) and len(set(w_dtypes)) == 1
            and (qxs.joined_only or None not in qxs.experts())):
        return _as_experts(grouped_wgrad(qdys, qxs, out_dtype=w_dtypes[0]))  # every expert, one call
    dws: list[Optional[torch.Tensor]] = [None] * len(qdys)
    for dtype in dict.fromkeys(w_dtypes):
        idx = [i for i, qx in enumerate(qxs) if qx is not None and w_dtypes[i] == dtype]
        if len(idx) == len(qdys):  # every expert in one call
            return _as_experts(grouped_wgrad(_select(qdys, idx), _select(qxs, idx), out_dtype=dtype))
        if idx:  # a run of experts keeps its joined copies (GroupedTensor.select)
            outs = grouped_gemm(_select(qdys, idx), _select(qxs, idx), "NT", out_dtype=dtype)
            for i, dw in zip(idx, outs):
                dws[i] = dw
    return dws, None


def _as_experts(out: Union[torch.Tensor, list[torch.Tensor]]
                ) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
    """``grouped_wgrad``'s result as (the experts' [N, K] results, the [E, N, K] tensor or None)."""
    return (list(out.unbind(0)), out) if isinstance(out, torch.Tensor) else (list(out), None)


def _select(ts: Sequence[Optional[torch.Tensor]], idx: list[int]) -> Sequence[Optional[torch.Tensor]]:
    """Experts ``idx`` of ``ts``: ``GroupedTensor.select`` (joined copies kept for a run), or a list."""
    return ts.select(idx) if isinstance(ts, GroupedTensor) else [ts[i] for i in idx]
