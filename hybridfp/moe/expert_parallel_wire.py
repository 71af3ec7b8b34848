"""Token rows sent quantized: ``expert_dispatch(..., wire_quantizer=q)`` sends each row's rowwise
encoding (codes and scales, e.g. MXFP8: 1 + 1/32 bytes an element instead of BF16's 2) and the
expert's rank decodes it back to the rows' dtype.

Only formats whose rowwise copy is row-local travel this way: every rowwise payload tensor is
indexed by row (axis 0, one row per index: FP8 per-tensor codes, MXFP8 1x32, FP8 block 1x128)
or is one value for the whole tensor (FP8's per-tensor scale, sent with each sender's rows);
blocks spanning rows (2-D blocks) would straddle the exchange's row splits and are refused.

The decode is what the sender's quantizer made, so an expert reads ``dequantize(q(x_rows))``:
a rowwise re-quantization by a recipe of the same row-local format gives the same values again
(the forward GEMM reads what it would have read from the high-precision rows), while the
columnwise copy a weight gradient reads is made from the decoded rows. The backward is
straight-through: the gradient of the decoded rows goes back to ``x``'s rows in ``x``'s dtype.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..nn.linear_function import once_differentiable_quantized
from ..quantizers import HybridQuantizer, Quantizer
from ..tensors.storage import COLUMNWISE, ROWWISE, QuantizedStorage


def checked_wire_quantizer(quantizer: object, cols: int, device: torch.device) -> tuple[Quantizer, int, int]:
    """A copy of ``quantizer`` for the wire (rowwise only, codes held, not decodes), checked,
    and the bytes it sends per row of ``cols`` elements and once per sender.

    Parameters
    ----------
    quantizer:
        The quantizer whose rowwise format the rows travel in.
    cols, device:
        The rows' width and device.

    Returns
    -------
    tuple
        ``(quantizer, bytes per row, bytes per sender)``.

    Raises
    ------
    TypeError
        Not a hybridfp ``Quantizer``, or a ``HybridQuantizer`` (pass its rowwise format's).
    ValueError
        Its rowwise copy is not row-local (2-D blocks), or it draws random numbers.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.moe.expert_parallel_wire import checked_wire_quantizer
    >>> checked_wire_quantizer(hf.MXFP8Quantizer(), 64, torch.device("cpu"))[1:]  # codes + E8M0 scales
    (66, 0)
    """
    if not isinstance(quantizer, Quantizer) or isinstance(quantizer, HybridQuantizer):
        raise TypeError(f"expert dispatch: wire_quantizer must be a single-format hybridfp Quantizer "
                        f"(e.g. hybridfp.MXFP8Quantizer()); got {type(quantizer).__name__}. For a hybrid "
                        "recipe pass the quantizer of its forward (rowwise) format.")
    if quantizer.uses_randomness():
        raise ValueError(f"expert dispatch: wire_quantizer {quantizer!r} uses stochastic rounding; the "
                         "rows would be rounded differently than on the expert's rank. Pass a "
                         "round-to-nearest quantizer.")
    q = quantizer.copy()
    q.set_usage(rowwise=True, columnwise=False)
    q.hold_decoded = frozenset()  # the codes travel, not their BF16 decode
    probe = q.encode(torch.zeros(1, cols, device=device), rowwise=True, columnwise=False)
    bad = [n for n, spec in probe._row_index[ROWWISE].items() if spec is not None and spec != (0, 1)]
    if bad:
        raise ValueError(f"expert dispatch: wire_quantizer {quantizer!r} has rowwise {bad} blocks spanning "
                         "several rows, which the exchange's row splits would cut; use a row-local "
                         "format (FP8 per-tensor, MXFP8 1x32, FP8 block 1x128).")
    _, by_row, whole = _split_payload(probe, 1)
    return q, by_row.shape[1], whole.numel()


def _encode(q: Quantizer, x: torch.Tensor) -> tuple[QuantizedStorage, torch.Tensor, torch.Tensor]:
    """x's rowwise encoding, its row-indexed tensors as one [rows, bytes] uint8 buffer, and its
    whole-tensor values as one uint8 vector."""
    return _split_payload(q.encode(x.detach(), rowwise=True, columnwise=False), x.shape[0])


def _split_payload(storage: QuantizedStorage, rows: int) -> tuple[QuantizedStorage, torch.Tensor, torch.Tensor]:
    payload, index = storage.payload(ROWWISE), storage._row_index[ROWWISE]
    per_row = [payload[n].contiguous().view(torch.uint8).reshape(rows, _row_bytes(payload[n]))
               for n in sorted(payload) if index[n] is not None]
    whole = [payload[n].contiguous().reshape(-1).view(torch.uint8) for n in sorted(payload) if index[n] is None]
    empty = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return (storage, torch.cat(per_row, 1) if per_row else empty.view(rows, 0),
            torch.cat(whole) if whole else empty)


def _decode(template: QuantizedStorage, by_row: torch.Tensor, whole: torch.Tensor, cols: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Rows encoded like ``template`` (one sender's): their ``dtype`` values."""
    rows = by_row.shape[0]
    payload, index = template.payload(ROWWISE), template._row_index[ROWWISE]
    rebuilt, at_row, at_whole = {}, 0, 0
    for n in sorted(payload):
        t = payload[n]
        if index[n] is None:
            size = t.numel() * t.element_size()
            rebuilt[n] = whole[at_whole:at_whole + size].view(t.dtype).reshape(t.shape)
            at_whole += size
        else:
            width = _row_bytes(t)
            rebuilt[n] = by_row[:, at_row:at_row + width].contiguous().view(t.dtype).reshape(rows, *t.shape[1:])
            at_row += width
    storage = template._new(torch.Size([rows, cols]), {ROWWISE: rebuilt, COLUMNWISE: None})
    return storage.dequantize(dtype=dtype, direction=ROWWISE)


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of a row-indexed payload tensor."""
    return math.prod(t.shape[1:]) * t.element_size()


class _QuantizedExchange(torch.autograd.Function):
    """Rows sent encoded by ``q`` and decoded on arrival (forward); the gradient sent back in
    the rows' dtype (backward, straight-through)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: Quantizer, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        size = dist.get_world_size(group)
        template, by_row, whole = _encode(q, x)
        got = by_row.new_empty(sum(out_splits), by_row.shape[1])
        dist.all_to_all_single(got, by_row, out_splits, in_splits, group=group)
        wholes = whole.new_empty(size * whole.numel())
        if whole.numel():  # one sender's per-tensor values (scales) for each received block
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(wholes, whole, group=group)
        parts, at = [], 0
        for s, n in enumerate(out_splits):
            w = wholes[s * whole.numel():(s + 1) * whole.numel()]
            parts.append(_decode(template, got[at:at + n], w, x.shape[1], x.dtype))
            at += n
        return torch.cat(parts) if parts else x.new_empty(0, x.shape[1])

    @staticmethod
    # the reverse exchange writes into a preallocated buffer, which autograd does not record;
    # the result is linear in grad alone (no cross terms)
    @once_differentiable_quantized(lambda ctx: "expert_dispatch (wire_quantizer's exchange)")
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad = grad.contiguous()
        back = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(back, grad, in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


__all__ = ["checked_wire_quantizer"]
