"""The autograd function of a quantized linear layer, y = x Wᵀ (+ b).

    fprop: y  = gemm(x.rowwise,     W.rowwise,    "TN")   # [M, K] · [N, K]ᵀ
    dgrad: dx = gemm(dy.rowwise,    W.columnwise, "NN")   # [M, N] · [N, K]
    wgrad: dW = gemm(dy.columnwise, x.columnwise, "NT")   # [M, N]ᵀ · [M, K]
    bias:  db = sum over rows of dy (high precision)

Only the copies a pass needs are made: x.columnwise only if W needs a gradient, W.columnwise
only if x needs one, dy's copies likewise. Saved quantized tensors go through
``save_for_backward`` as their plain payload tensors (so saved-tensor hooks — CPU offload,
recompute — see ordinary tensors) and are re-assembled in backward.

The recipe's ``backward_override`` picks the backward GEMMs' operands (the GEMMs stay the ones
above), with dy unquantized:

    None:             dy quantized, W.columnwise, x.columnwise (the forward quantizes them)
    "high_precision": dy, W and x themselves (x and W saved as they are; no columnwise copy)
    "dequantized":    dy, dequant(W.rowwise), dequant(x.rowwise) (the rowwise copies saved)
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch._C import _functions as _autograd_functions

from ..config import current_policy, use_policy
from ..gemm import gemm
from ..quantizers import Float8Quantizer, HybridQuantizer, Quantizer
from ..recipes.recipes import check_backward_override
from ..tensors import COLUMNWISE, ROWWISE, QuantizedStorage, QuantizedTensor
from .shared_input import quantize_input


@dataclass
class LinearContext:
    """What the function needs besides tensors: quantizers and the owning module.

    ``fprop_fast_accumulation``: the recipe's choice for the fprop GEMM (see
    :func:`hybridfp.gemm.gemm`).

    ``grad_enabled``: torch's grad mode where the module was called. Inside an
    autograd.Function's forward ``needs_input_grad`` reflects only ``requires_grad`` (it is
    True for parameters even under ``torch.no_grad()``), so without this, inference would
    quantize and keep backward copies that no backward will read.
    """

    input_q: Quantizer
    weight_q: Quantizer
    grad_q: Quantizer
    module: Any
    weight_index: int = 0
    save_original_input: bool = False
    grad_enabled: bool = True
    fprop_fast_accumulation: bool = False
    #: The autocast region's memo (``AutocastState.scratch``): an input quantized by an equal
    #: quantizer earlier in the region is taken from it (``shared_input``); None: never shared.
    scratch: Optional[dict] = None
    #: The autocast region's token (``AutocastState.token``): the weight cache's entries are
    #: reused only in the region that made them (None: never reused). See nn/weight_cache.py.
    region: Optional[object] = None
    #: TransformerEngine's forward argument: None, or True (quantize the weight and keep it for
    #: later regions) / False (reuse the kept copy). See nn/weight_cache.py.
    is_first_microbatch: Optional[bool] = None
    #: The recipe's ``backward_override``: None (quantized backward), "high_precision" or
    #: "dequantized" (see the module docstring).
    backward_override: Optional[str] = None


def region_context(module: Any, state: Any, index: int, is_first_microbatch: Optional[bool],
                   grad_enabled: Optional[bool], share_input: bool) -> LinearContext:
    """GEMM set ``index``'s context in autocast region ``state``.

    Parameters
    ----------
    module:
        The owning ``QuantizedModule`` (its quantizers per slot, ``save_original_input``).
    state:
        The active ``AutocastState`` (its recipe's GEMM options, region token and memo).
    index:
        The GEMM set: the weight-cache slot and the quantizers' index.
    is_first_microbatch:
        TransformerEngine's weight-reuse argument (see nn/weight_cache.py).
    grad_enabled:
        torch's grad mode where the module was called; None: the mode now.
    share_input:
        Whether an input an equal quantizer already quantized in the region may be taken from
        the region's memo (False for a module's own intermediates, which no other layer reads).

    Returns
    -------
    LinearContext
        What ``LinearFunction`` needs besides tensors.
    """
    qs = module.quantizers(state)
    return LinearContext(qs["input"][index], qs["weight"][index], qs["grad_output"][index], module,
                         weight_index=index, save_original_input=module.save_original_input,
                         grad_enabled=torch.is_grad_enabled() if grad_enabled is None else grad_enabled,
                         fprop_fast_accumulation=state.recipe.fprop_fast_accumulation,
                         backward_override=state.recipe.backward_override,
                         scratch=state.scratch if share_input else None, region=state.token,
                         is_first_microbatch=is_first_microbatch)


class SaveOriginalInputIgnoredWarning(UserWarning):
    """``save_original_input=True`` is ignored: the input quantizer cannot make the same copy
    again in backward, so the quantized forward value is saved instead (said once per module)."""


def _uses_delayed_scaling(q: Quantizer) -> bool:
    """Whether ``q`` (or a child of a hybrid ``q``) is an FP8 delayed-scaling quantizer."""
    children = (q.rowwise_quantizer, q.columnwise_quantizer) if isinstance(q, HybridQuantizer) else (q,)
    return any(isinstance(c, Float8Quantizer) for c in children)


def keeps_original_input(lc: LinearContext) -> bool:
    """Whether wgrad re-quantizes the kept high-precision input (``save_original_input``).

    The option is a hint the input quantizer may veto (TransformerEngine's semantics): only a
    requantization-safe quantizer makes the same columnwise copy in backward as it would have
    in forward. A vetoed hint warns once per module; with delayed scaling it is refused, as
    TransformerEngine refuses it for its DelayedScaling recipe.

    Parameters
    ----------
    lc:
        The layer's context (its ``save_original_input``, input quantizer and module).

    Returns
    -------
    bool
        True to save the original input, False to save the quantized forward copy.

    Raises
    ------
    ValueError
        ``save_original_input=True`` with an FP8 delayed-scaling input quantizer.
    """
    if not lc.save_original_input:
        return False
    q = lc.input_q
    if q.is_requantization_safe():
        return True
    who = lc.module._who()
    if _uses_delayed_scaling(q):
        raise ValueError(f"{who}: save_original_input=True cannot be used with delayed scaling (input "
                         f"quantizer {q!r}): its scale moves with the amax history, so wgrad would not "
                         "read the copy the forward step saw. Build the module with "
                         "save_original_input=False, or use a current-scaling recipe.")
    if not getattr(lc.module, "_save_original_input_warned", False):
        lc.module._save_original_input_warned = True  # once per module: it holds for every step
        warnings.warn(f"{who}: save_original_input=True is ignored: its input quantizer {q!r} is not "
                      "requantization-safe (stochastic rounding or moving state), so the quantized "
                      "forward copy is saved for wgrad instead. Build the module with "
                      "save_original_input=False to keep this and silence the warning.",
                      SaveOriginalInputIgnoredWarning, stacklevel=2)
    return False


def pack(t: Optional[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """Split a (quantized) tensor into plain tensors + a skeleton to rebuild it from them."""
    if t is None:
        return [], None
    if isinstance(t, QuantizedTensor):
        tensors, skeleton = t.qstorage.split_tensors()
        return tensors, ("q", skeleton, t.quantizer)
    return [t], ("t",)


def unpack(skeleton: Any, tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """Inverse of :func:`pack`."""
    if skeleton is None:
        return None
    if skeleton[0] == "t":
        return tensors[0]
    storage: QuantizedStorage = skeleton[1].with_tensors(list(tensors))
    return QuantizedTensor(storage, skeleton[2])


def backward_override(lc: LinearContext) -> Optional[str]:
    """The recipe's ``backward_override`` for this layer, checked (a user recipe class may set
    any value; the built-in ones check it when made).

    Parameters
    ----------
    lc:
        The layer's context.

    Returns
    -------
    Optional[str]
        None, "high_precision" or "dequantized".

    Raises
    ------
    ValueError
        An unknown value.
    """
    mode = lc.backward_override
    if mode is not None:
        check_backward_override(mode, f"{lc.module._who()}: the recipe's")
    return mode


def forward_gemm(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 lc: LinearContext, needs_dgrad: bool, needs_wgrad: bool, run_gemm: bool = True
                 ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """fprop of one [M, K] input against one weight; returns (y, what wgrad needs of x, what
    dgrad needs of W) — None where that gradient is not needed. With a ``backward_override``
    no columnwise copy is made: backward reads x and W themselves ("high_precision") or their
    rowwise copies ("dequantized"). ``run_gemm=False`` makes only the copies (y is None): the
    compiled path's shape pass on meta tensors (``nn/ops.py``)."""
    mode = backward_override(lc)
    if mode == "high_precision" and needs_dgrad and isinstance(weight, QuantizedTensor):
        raise ValueError(f"{lc.module._who()}: backward_override='high_precision' reads the "
                         "high-precision weight, but the weight is a QuantizedTensor (no "
                         "high-precision value exists); use backward_override='dequantized'.")
    save_original = mode is None and keeps_original_input(lc)
    qx = quantize_input(x2, lc.input_q, True, needs_wgrad and mode is None and not save_original, lc.scratch)
    qw = lc.module.quantized_weight(weight, lc.weight_q, columnwise=needs_dgrad and mode is None,
                                    index=lc.weight_index, region=lc.region,
                                    is_first_microbatch=lc.is_first_microbatch)
    y = gemm(qx, qw, "TN", out_dtype=x2.dtype, bias=bias,
             fast_accumulation=lc.fprop_fast_accumulation) if run_gemm else None
    saved_x: Optional[torch.Tensor] = None
    if needs_wgrad:
        if save_original or mode == "high_precision":
            saved_x = x2
        elif mode == "dequantized":
            saved_x = qx  # its rowwise copy only (asked for no other)
        else:
            qx.update_usage(rowwise_usage=False)  # fprop is done with the rowwise copy
            saved_x = qx
    saved_w = None
    if needs_dgrad:
        saved_w = weight if mode == "high_precision" else qw
    return y, saved_x, saved_w


def _dequantized(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A saved rowwise copy as the value the forward multiplied (a plain tensor as is).

    The decode is exact: in the tensor's dtype only where the format guarantees every decoded
    value fits it (BF16, a format whose block-decoded values are BF16-exact and which keeps no
    per-tensor / per-row factor for the epilogue: MXFP8, power-of-two FP8 blocks, BF16
    Identity); otherwise in FP32 (FP8 current / delayed scaling, NVFP4, FP32-scaled FP8
    blocks, FP16 tensors), as ``HybridQuantizer``'s ``rowwise_dequantized`` does — rounding
    those to BF16 would change most values. ``gemm`` multiplies an FP32 operand against the
    BF16 dy on its exact path (FP32 products and sums, one cast to the gradient's dtype). The
    saved copies stay quantized; only this transient decode is FP32 (twice a BF16 one)."""
    if not isinstance(t, QuantizedTensor):
        return t
    part = t.qstorage.part(ROWWISE)
    fits = (t.dtype == torch.bfloat16 and part.bf16_exact_reason(ROWWISE) is None
            and not part.has_epilogue_scale(ROWWISE))
    return t.dequantize(direction=ROWWISE, dtype=None if fits else torch.float32)


def check_dgrad_weight(qw: Any, who: str) -> None:
    """Refuse a saved weight whose columnwise copy has no memory (reading it would crash).

    Parameters
    ----------
    qw:
        The weight dgrad reads (a ``QuantizedTensor`` is checked; anything else passes).
    who:
        The module, for the message.

    Raises
    ------
    RuntimeError
        FSDP2 all-gathered only the rowwise copy for the forward and did not gather again
        before backward.
    """
    if isinstance(qw, QuantizedTensor) and qw.has_direction(COLUMNWISE) and qw.qstorage.unallocated(COLUMNWISE):
        raise RuntimeError(
            f"{who}: the weight's columnwise copy has no memory: FSDP2 all-gathered only its "
            "rowwise copy for the forward and did not gather again before backward (the module's "
            "parameters stay gathered after forward: FSDP2's root module, or "
            "reshard_after_forward=False). Gather both copies for this module: "
            "hybridfp.enable_quantized_all_gather(module, copies='both').")


def backward_gemms(dy2: torch.Tensor, saved_x: Optional[torch.Tensor], saved_w: Optional[torch.Tensor],
                   lc: LinearContext, x_dtype: torch.dtype, w_dtype: torch.dtype,
                   needs_dgrad: bool, needs_wgrad: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """dgrad and wgrad of one [M, N] output gradient."""
    dx = dw = None
    if not (needs_dgrad or needs_wgrad):
        return dx, dw
    mode = lc.backward_override
    if mode is None:
        lc.grad_q.set_usage(rowwise=needs_dgrad, columnwise=needs_wgrad)
        qdy = lc.grad_q.quantize(dy2.contiguous())
        qx, qw = saved_x, saved_w
        if needs_wgrad and not isinstance(saved_x, QuantizedTensor):  # the original: quantize it now
            lc.input_q.set_usage(rowwise=False, columnwise=True)
            qx = lc.input_q.quantize(saved_x)
    else:  # high-precision operands: plain tensors, which gemm multiplies unquantized
        qdy, qx, qw = dy2.contiguous(), _dequantized(saved_x), _dequantized(saved_w)
    if needs_dgrad:
        check_dgrad_weight(qw, lc.module._who())
        dx = gemm(qdy, qw, "NN", out_dtype=x_dtype)
    if needs_wgrad:
        dw = gemm(qdy, qx, "NT", out_dtype=w_dtype)
    return dx, dw


def torch_autocast_off(t: torch.Tensor) -> torch.autocast:
    """Disable torch's autocast (AMP) on ``t``'s device: the exact GEMM path multiplies FP32
    values, which autocast would silently run in BF16/FP16 (numerics §1 allows no such error)."""
    return torch.autocast(t.device.type, enabled=False)


def bias_grad(dy2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """db = column sums of dy, accumulated in FP32, in the bias's dtype."""
    return dy2.float().sum(0).to(dtype)


def once_differentiable_quantized(who: Callable[[Any], str],
                                  cross_terms: Callable[[Any], bool] = lambda ctx: False, *,
                                  recorded: Callable[[Any], bool] = lambda ctx: False,
                                  unrecorded: str = "quantized GEMMs, collectives",
                                  remedy: str = "Compute the gradient that is differentiated again outside "
                                                "hybridfp.autocast (high precision), or drop the penalty term.",
                                  where: str = "under a quantized recipe") -> Callable:
    """Mark the backward of a hybridfp autograd Function as not differentiable itself, so that
    differentiating through its gradients (``create_graph=True`` and then a backward through
    the gradients: a gradient penalty, a Hessian-vector product) raises a clear error instead
    of silently dropping the second-order term.

    The backward quantizes the output gradient and runs quantized GEMMs (or collectives on
    preallocated buffers), none of which autograd records; under ``create_graph=True`` its
    results would come back as constants (no ``grad_fn``), so a penalty on them would
    contribute nothing to the parameters' gradients. As torch's ``once_differentiable``, the backward runs under
    ``no_grad`` and, when grad mode is on (``create_graph=True``), its results are routed
    through a node that raises when a later backward reaches it: a ``create_graph=True``
    pass whose gradients are not differentiated again still works. Unlike
    ``once_differentiable``, which looks only at the incoming gradients, the error is also
    attached when those are constants but the results depend on differentiable forward inputs
    the backward reads from ``ctx`` (``cross_terms``): for y = x Wᵀ with a loss linear in y
    (a critic's score, as in WGAN-GP), dx = dy W still depends on W.

    Parameters
    ----------
    who:
        ``ctx`` -> the module (or operation) to name in the error.
    cross_terms:
        ``ctx`` -> whether the results depend on forward inputs that require grad (for a
        bilinear GEMM: x and W both do); False for a backward linear in the gradients alone.
    recorded:
        ``ctx`` -> whether this call's backward runs ops autograd records (plain torch ops on
        the saved tensors): it then runs with grad mode as given and is differentiable.
    unrecorded, remedy, where:
        The error's words: what the backward runs that autograd does not record, what to do
        instead, and under what the double backward is refused.

    Returns
    -------
    Callable
        A decorator for the ``backward`` staticmethod (place it under ``@staticmethod``).
    """
    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grads: Any) -> Any:
            if not torch.is_grad_enabled() or recorded(ctx):  # nothing to record, or autograd records it
                return backward(ctx, *grads)
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not (any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads) or cross_terms(ctx)):
                return outputs  # the results are constants for autograd: nothing to differentiate
            single = not isinstance(outputs, tuple)
            outs = (outputs,) if single else outputs
            message = (f"{who(ctx)}: double backward is not supported {where}: this "
                       "gradient came from a backward pass with create_graph=True (a gradient penalty, a "
                       "Hessian-vector product), and differentiating it again would need the derivative of "
                       f"this backward ({unrecorded}), which autograd does not record (the "
                       f"second-order term would be silently dropped). {remedy}")
            err = _autograd_functions.DelayedError(message, len(outs))

            # the results made leaves that require grad, so that the error node has an input on
            # the graph and the results a grad_fn (as torch's once_differentiable does)
            def leaf(t: Any) -> Any:
                return t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t

            got = err(*[leaf(t) for t in outs])
            return got if single or isinstance(got, tuple) else (got,)
        return wrapper
    return decorate


def linear_cross_terms(ctx: Any) -> bool:
    """dx = dy W reads W and dW = dyᵀ x reads x: both requiring grad makes second-order terms."""
    return bool(ctx.needs_input_grad[0] and ctx.needs_input_grad[1])


class LinearFunction(torch.autograd.Function):
    """Quantized y = x Wᵀ + b (see the module docstring for the three GEMMs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                lc: LinearContext) -> torch.Tensor:
        needs_dgrad = ctx.needs_input_grad[0] and lc.grad_enabled
        needs_wgrad = ctx.needs_input_grad[1] and lc.grad_enabled
        # explicit row count: reshape(-1, 0) is ambiguous for in_features == 0
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        with torch_autocast_off(x):
            y, saved_x, saved_w = forward_gemm(x2, weight, bias, lc, needs_dgrad, needs_wgrad)
        tx, ctx.skel_x = pack(saved_x)
        tw, ctx.skel_w = pack(saved_w)
        ctx.n_x = len(tx)
        ctx.save_for_backward(*tx, *tw)
        ctx.lc, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = lc, x.shape, x.dtype, weight.dtype
        ctx.policy = current_policy()  # backward may run on another thread: it re-enters this one
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable_quantized(lambda ctx: ctx.lc.module._who(), linear_cross_terms)
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        saved_x = unpack(ctx.skel_x, list(saved[:ctx.n_x]))
        saved_w = unpack(ctx.skel_w, list(saved[ctx.n_x:]))
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2 = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1])
        with use_policy(ctx.policy), torch_autocast_off(dy):
            dx, dw = backward_gemms(dy2, saved_x, saved_w, ctx.lc, ctx.x_dtype, ctx.w_dtype,
                                    needs_dgrad, needs_wgrad)
            db = bias_grad(dy2, ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (dx.reshape(ctx.x_shape) if dx is not None else None), dw, db, None
