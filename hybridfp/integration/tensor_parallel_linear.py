"""One tensor-parallel quantized linear: each rank's GEMMs on its shard, with the collectives.

Column-parallel (W [N/p, K] on each rank, rows of the whole weight):

    fprop  y_r  = x · W_rᵀ                 x whole (or, sequence parallel, gathered quantized)
    dgrad  dx   = Σ_r dy_r · W_r           all-reduce (sequence parallel: reduce-scatter rows)
    wgrad  dW_r = dy_rᵀ · x                x's columnwise copy (sequence parallel: gathered)

Row-parallel (W [N, K/p], columns of the whole weight; x [M, K/p], columns of the input):

    fprop  y    = Σ_r x_r · W_rᵀ + b       all-reduce (sequence parallel: reduce-scatter rows)
    dgrad  dx_r = dy · W_r                 dy whole (sequence parallel: gathered quantized)
    wgrad  dW_r = dyᵀ · x_r

Which operands are split across the group, so their per-tensor amaxes (FP8 current scaling,
NVFP4's global amax, delayed scaling's history) are reduced over it: column-parallel W and dy
(along N) and, sequence parallel, x (along the rows); row-parallel x and W (along K) and,
sequence parallel, dy (along the rows: each rank quantizes its rows, then its rowwise copy is
all-gathered for dgrad and its columnwise copy for wgrad). The others (column-parallel x
without sequence parallelism, row-parallel dy without it) are whole and equal on every rank:
no reduction. Partial sums travel in FP32 and the output is rounded once, as one process's
GEMM rounds its FP32 accumulator once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..gemm import gemm
from ..nn.linear_function import (LinearContext, bias_grad, linear_cross_terms, once_differentiable_quantized, pack,
                                  torch_autocast_off, unpack)
from ..nn.shared_input import quantize_input
from ..quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                          HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from ..utils.optimizer_steps import on_stepped_parameters
from .tensor_parallel_comm import all_reduce_sum, gather_quantized_rows, reduce_scatter_rows

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class ParallelGemm:
    """How one GEMM set is split: ``kind`` "column" or "row", the group, and whether the
    activation is sequence-parallel (split along its rows outside the layer)."""

    kind: str
    group: Any
    world: int
    sequence_parallel: bool
    who: str

    def split_slots(self) -> dict[str, Optional[str]]:
        """Slot -> the dim along which that GEMM operand is split across the group ("rows" /
        "cols" of its [rows, cols] 2D form), None where it is whole on every rank."""
        if self.kind == COLUMN:
            return {"input": "rows" if self.sequence_parallel else None, "weight": "rows", "grad_output": "cols"}
        return {"input": "cols", "weight": "cols", "grad_output": "rows" if self.sequence_parallel else None}


def block_extent(q: Quantizer, direction: str) -> tuple[int, int]:
    """(rows, cols) one block of ``q``'s ``direction`` copy spans in the original orientation;
    (1, 1) for per-tensor formats.

    Raises
    ------
    NotImplementedError
        A quantizer class whose block layout this module does not know.
    """
    if isinstance(q, HybridQuantizer):
        child = q.rowwise_quantizer if direction == ROWWISE else q.columnwise_quantizer
        return block_extent(child, direction)
    if isinstance(q, (Float8CurrentScalingQuantizer, Float8Quantizer, IdentityQuantizer)):
        return (1, 1)
    if isinstance(q, MXFP8Quantizer):
        b, two_d = 32, q.with_2d_quantization
    elif isinstance(q, NVFP4Quantizer):
        b, two_d = 16, q.with_2d_quantization
    elif isinstance(q, Float8BlockQuantizer):
        b, two_d = 128, q.block_scaling_dim == 2
    else:
        raise NotImplementedError(f"tensor parallelism does not know the block layout of {type(q).__name__}; "
                                  "use a built-in quantizer for the parallel layers.")
    if two_d:
        return (b, b)
    return (1, b) if direction == ROWWISE else (b, 1)


def _row_scaled(q: Quantizer) -> bool:
    child = q.rowwise_quantizer if isinstance(q, HybridQuantizer) else q
    return bool(getattr(child, "row_scaled_nvfp4", False))


def check_split(q: Quantizer, slot: str, split: Optional[str], rows: int, cols: int, spec: ParallelGemm,
                halves: bool = False) -> None:
    """Refuse a shard whose blocks would straddle two ranks (each copy's blocks must be whole
    within every rank's part), and per-row scales of a row split along its columns. ``halves``:
    the split dim holds a gated fc1's [gate | up], each half sharded on its own, so each half of
    the rank's part must hold whole blocks.

    Raises
    ------
    ValueError
        Naming the layer, the slot, the local size and the block size to use.
    """
    if split is None:
        return
    for direction in (ROWWISE, COLUMNWISE):
        ext = block_extent(q, direction)[0 if split == "rows" else 1]
        local = rows if split == "rows" else cols
        local, of = (local // 2, " per half of the gated [gate | up]") if halves else (local, "")
        if local % ext:
            raise ValueError(
                f"{spec.who}: the {slot} is split across {spec.world} tensor-parallel ranks along its "
                f"{split} ({local} on each{of}), but its {direction} copy ({type(q).__name__}) is blocked every "
                f"{ext} {split}, so a block would straddle two ranks. Choose sizes whose per-rank part is a "
                f"multiple of {ext}, or another format for this layer.")
    if split == "cols" and _row_scaled(q):
        raise ValueError(f"{spec.who}: the {slot} is split along its columns across the tensor-parallel "
                         "ranks, but its quantizer scales each row by the row's own amax (row_scaled_nvfp4), "
                         "which no rank sees whole. Use per-tensor NVFP4 scaling for this layer.")


def set_amax_groups(lc: LinearContext, spec: ParallelGemm) -> None:
    """Per slot: reduce per-tensor amaxes over the group where the operand is split, not where
    it is whole (a quantizer object serving both kinds of slot reduces: harmless there)."""
    split = spec.split_slots()
    qs = {"input": lc.input_q, "weight": lc.weight_q, "grad_output": lc.grad_q}
    reduce: dict[int, bool] = {}
    for slot, q in qs.items():
        reduce[id(q)] = reduce.get(id(q), False) or split[slot] is not None
    for q in qs.values():
        q.set_amax_reduction_group(spec.group if reduce[id(q)] else None)


#: the attribute of a tensor-parallel weight Parameter (a DTensor) holding its version counter
#: as :func:`local_weight` last saw it; its presence marks a weight whose shard the
#: quantized-weight cache may hold
_SEEN_VERSION_ATTR = "_hybridfp_tp_seen_version"

def _moved_on(local: torch.Tensor) -> None:
    """Moves ``local``'s version counter (an inference tensor has none to move)."""
    if not local.is_inference():
        torch.autograd.graph.increment_version(local)


def _mark_stepped_weights(params: Sequence[torch.Tensor]) -> None:
    """After an optimizer step over ``params`` (``utils.optimizer_steps``): moves the local
    version counter of each tensor-parallel weight the cache may hold a shard of.

    The foreach and fused implementations (torch's default for DTensor parameters on CUDA)
    write a DTensor below autograd without moving its version counter, so the counter alone
    cannot tell the cache a step happened; the step hook sees every step exactly: no stale shard
    is served, and a forward pays nothing. A content fingerprint (the amax and sum that
    ``tensor_parallel_primary.py`` compares) would cost two passes over the shard and a host
    synchronization at every call, and a write that keeps both (two elements moved by
    opposite amounts) would still go unseen. A weight with a gradient that the step left as it
    was is quantized again once, which is conservative, never stale.
    """
    for p in params:
        if hasattr(p, _SEEN_VERSION_ATTR):
            _moved_on(p._local_tensor)


def local_weight(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of DTensor weight ``param``, for the quantized-weight cache: the same
    object at every call, its version counter moved on when ``param`` was written in place
    since the previous call.

    An in-place op on a DTensor (a ``load_state_dict`` copy, ``nn.init``, an optimizer step)
    writes the local tensor below autograd, so at most the DTensor's version counter moves;
    the cache keys on the local tensor's (``nn/weight_cache.py``) and would keep serving the
    codes of the weight as it was inside ``weight_caching()`` or with
    ``is_first_microbatch=False``. So a move of the DTensor's counter moves the local one here,
    and the end of every optimizer step moves it too (:func:`_mark_stepped_weights`): a foreach
    or fused step moves neither counter. Moving the local counter also tells autograd that the
    values it may have saved changed. A write through ``.data``, or a foreach op outside an
    optimizer step, is not seen: call ``invalidate_weight_cache()`` after one, as for any
    weight.

    A weight made under ``torch.inference_mode()`` has no version counter to read or move: its
    local tensor is returned as it is (the high-precision path outside autocast reads it).

    Parameters
    ----------
    param:
        A tensor-parallel weight Parameter (a DTensor), not a quantized primary weight.

    Returns
    -------
    torch.Tensor
        ``param``'s local tensor.
    """
    local = param._local_tensor  # type: ignore[attr-defined]
    if param.is_inference() or local.is_inference():
        return local
    # registered before the cache can hold any shard (it holds one only after this call)
    on_stepped_parameters(_mark_stepped_weights)
    now = param._version
    seen = getattr(param, _SEEN_VERSION_ATTR, None)
    if seen is not None and seen != now:
        _moved_on(local)
    setattr(param, _SEEN_VERSION_ATTR, now)
    return local


@dataclass
class WeightShard:
    """The rank's weight shard as the quantized-weight cache sees it: ``source`` is the same
    tensor object at every call (the DTensor's local tensor, from :func:`local_weight`, whose
    version counter follows the DTensor's in-place writes), so the cache's identity and version
    rule holds (``nn/weight_cache.py``); the autograd input is its differentiable view. For a
    quantized primary weight ``source`` is its quantized shard, read as it is."""

    source: torch.Tensor


class ParallelLinearFunction(torch.autograd.Function):
    """The quantized GEMMs of one rank's shard, with the tensor-parallel collectives (see the
    module docstring). Takes and returns 2D tensors."""

    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                lc: LinearContext, spec: ParallelGemm, shard: WeightShard) -> torch.Tensor:
        needs_dgrad = ctx.needs_input_grad[0] and lc.grad_enabled
        needs_wgrad = ctx.needs_input_grad[1] and lc.grad_enabled
        sp, group = spec.sequence_parallel, spec.group
        with torch_autocast_off(x2):
            qx = quantize_input(x2, lc.input_q, True, needs_wgrad, lc.scratch)
            qw = lc.module.quantized_weight(shard.source, lc.weight_q, columnwise=needs_dgrad,
                                            index=lc.weight_index, region=lc.region,
                                            is_first_microbatch=lc.is_first_microbatch)
            if spec.kind == COLUMN:
                # sequence parallel: the local rows' rowwise copy is gathered, quantized (one scale
                # for all ranks: the amax was reduced over the group when quantizing)
                qin = gather_quantized_rows(qx, ROWWISE, group, f"{spec.who}: input") if sp else qx
                y = gemm(qin, qw, "TN", out_dtype=x2.dtype, bias=bias,
                         fast_accumulation=lc.fprop_fast_accumulation)
            else:
                part = gemm(qx, qw, "TN", out_dtype=torch.float32, fast_accumulation=lc.fprop_fast_accumulation)
                y32 = reduce_scatter_rows(part, group) if sp else all_reduce_sum(part, group)
                if bias is not None:  # after the sum: added once, as one process's epilogue adds it
                    y32 = y32 + bias.float()
                y = y32.to(x2.dtype)
        saved_x = saved_w = None
        if needs_wgrad:
            qx.update_usage(rowwise_usage=False)  # fprop is done with the rowwise copy
            saved_x = qx
        if needs_dgrad:
            saved_w = qw
        tx, ctx.skel_x = pack(saved_x)
        tw, ctx.skel_w = pack(saved_w)
        ctx.n_x = len(tx)
        ctx.save_for_backward(*tx, *tw)
        ctx.lc, ctx.spec = lc, spec
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    @once_differentiable_quantized(lambda ctx: ctx.lc.module._who(), linear_cross_terms)
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        qx = unpack(ctx.skel_x, list(saved[:ctx.n_x]))
        qw = unpack(ctx.skel_w, list(saved[ctx.n_x:]))
        lc, spec = ctx.lc, ctx.spec
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        sp, group = spec.sequence_parallel, spec.group
        dx = dw = db = None
        # the output of a sequence-parallel row-parallel layer was reduce-scattered along the rows:
        # each rank quantizes its rows of dy (amax reduced), the copies are all-gathered quantized
        gather_dy = spec.kind == ROW and sp
        with torch_autocast_off(dy):
            dy2 = dy.contiguous()
            if needs_dgrad or needs_wgrad:
                lc.grad_q.set_usage(rowwise=needs_dgrad, columnwise=needs_wgrad)
                qdy = qdy_row = qdy_col = lc.grad_q.quantize(dy2)
                if gather_dy:
                    who = f"{spec.who}: output gradient"
                    qdy_row = gather_quantized_rows(qdy, ROWWISE, group, who) if needs_dgrad else None
                    qdy_col = gather_quantized_rows(qdy, COLUMNWISE, group, who) if needs_wgrad else None
            if needs_dgrad:
                if spec.kind == COLUMN:
                    part = gemm(qdy_row, qw, "NN", out_dtype=torch.float32)
                    dx = (reduce_scatter_rows(part, group) if sp else all_reduce_sum(part, group)).to(ctx.x_dtype)
                else:
                    dx = gemm(qdy_row, qw, "NN", out_dtype=ctx.x_dtype)
            if needs_wgrad:
                if spec.kind == COLUMN and sp:
                    qx = gather_quantized_rows(qx, COLUMNWISE, group, f"{spec.who}: input")
                dw = gemm(qdy_col, qx, "NT", out_dtype=ctx.w_dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                # sequence parallel: each rank's rows' sum, then summed over the group (in FP32)
                db = (all_reduce_sum(dy2.float().sum(0), group).to(ctx.bias_dtype) if gather_dy
                      else bias_grad(dy2, ctx.bias_dtype))
        return dx, dw, db, None, None, None


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [rows, K] (explicit row count: reshape(-1, 0) is ambiguous for K == 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is a quantized weight parameter (``quantized_model_init``)."""
    return isinstance(t, QuantizedTensor)
