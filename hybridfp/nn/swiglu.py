"""SwiGLU activation, ``silu(g) * u``, with one fused kernel per direction on CUDA.

Eager torch saves three activations for ``F.silu(g) * u`` (g for silu, silu(g) and u for the
mul) and runs five memory-bound kernels per step; :class:`SwiGLUFunction` saves g and u only,
recomputes silu(g) in backward, and on CUDA runs one Triton kernel each way
(``hybridfp/kernels/triton_swiglu.py``)::

    forward:  h = silu(g) * u                 # one pass: read g, u; write h
    backward: s = silu(g)                     # recomputed in registers
              du = dh * s
              dg = silu_backward(dh * u, g)   # one pass: read dh, g, u; write dg, du

with torch eager's rounding points (each of s, h, dh * u, du, dg rounded to the input dtype),
so results agree with eager torch up to the last bits of the exponential (the verified bounds
are in tests/nn/test_swiglu.py). Elsewhere (CPU, ...) the same function runs exactly the eager
ops. On CUDA the kernels take float32, bfloat16 and float16; other dtypes raise (no silent
eager fallback). A tensor the kernels cannot read in place — a last dimension with non-unit
stride, or leading dimensions that do not flatten into one row stride — is copied to a
contiguous one first (one extra pass); the halves of a fused gate/up projection's output are
read in place. Double backward (differentiating gradients taken with ``create_graph=True``)
works through the eager ops; through the kernels, which autograd does not record, it raises.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..recipes import current_autocast
from ..tensors import known_amax
from ..utils.device import row_groups
from .linear_function import once_differentiable_quantized

HAVE_TRITON = importlib.util.find_spec("triton") is not None
#: Dtypes the CUDA kernels take.
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _uses_kernels(g: torch.Tensor) -> bool:
    """Whether :func:`swiglu` runs the Triton kernels for ``g``: on CUDA tensors (the tests also
    route CPU tensors here, with Triton in interpreter mode). Raises for a CUDA tensor the
    kernels cannot take rather than running eager ops silently."""
    if not g.is_cuda:
        return False
    if g.dtype not in KERNEL_DTYPES:
        raise TypeError(f"swiglu on CUDA runs Triton kernels for float32, bfloat16 and float16; got {g.dtype}. "
                        "Cast the inputs, or use F.silu(g) * u for this dtype.")
    if not HAVE_TRITON:
        raise RuntimeError("swiglu on CUDA needs Triton (pip install triton), or use F.silu(g) * u.")
    return True


def _check_pair(g: torch.Tensor, u: torch.Tensor) -> None:
    """Raise unless the gate ``g`` and up ``u`` projections can be combined elementwise."""
    if g.shape != u.shape:
        raise ValueError(f"swiglu: gate g has shape {tuple(g.shape)} but up u has shape {tuple(u.shape)}; "
                         "they must be equal (no broadcasting).")
    if g.dtype != u.dtype:
        raise TypeError(f"swiglu: gate g is {g.dtype} but up u is {u.dtype}; cast one so they match.")
    if g.device != u.device:
        raise ValueError(f"swiglu: gate g is on {g.device} but up u is on {u.device}; move them to one device.")
    if not g.is_floating_point():
        raise TypeError(f"swiglu: g and u must be floating point; got {g.dtype}.")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last dim] with unit inner stride: a view where one exists, else a
    contiguous copy (documented in the module docstring)."""
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return x2 if x2.shape[1] <= 1 or x2.stride(1) == 1 else x2.contiguous()


def _silu_backward(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient through silu(g), as eager autograd computes it: ``aten.silu_backward``, or
    under grad mode (a ``create_graph=True`` backward) the differentiable composite autograd's
    own silu derivative switches to there (aten's has no derivative of its own)."""
    if not torch.is_grad_enabled():
        return torch.ops.aten.silu_backward(grad, g)
    s = torch.sigmoid(g)
    return grad * s * (1 + g * (1 - s))


def _records_amax(grouped: bool) -> bool:
    """Whether the kernels record the amax of what they write: inside an autocast region whose
    modules read recorded amaxes (per row group with ``grouped``). Not under torch.compile: the
    quantizers take their own amax there (the compiler fuses it), and the flag is set by the
    modules of the same traced frame, which Dynamo would guard on as set at entry (a recompile
    in every region, Dynamo's limit after eight), so it is checked first."""
    if torch.compiler.is_compiling():
        return False
    state = current_autocast()
    return state is not None and (state.reads_known_group_amax if grouped else state.reads_known_amax)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(g) * u``; saves g and u (no other activation) and recomputes silu in backward.

    Inside an autocast region whose modules read recorded amaxes (FP8 current scaling: a
    module that ran there has such a quantizer) the kernels also record the amax of h (forward)
    and of dg, du (backward) beside those tensors (``hybridfp.tensors.known_amax``), so those
    quantizers skip their amax pass over them; other recipes pay nothing for it."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        ctx.uses_kernels = _uses_kernels(g)
        ctx.record_amax = _records_amax(grouped=False)
        if not ctx.uses_kernels:
            return F.silu(g) * u
        # imported at the first kernel call: Triton's import fixes its compiled / interpreted
        # mode, and CPU-only users skip its cost (see quantizers/fast.py)
        from ..kernels import triton_swiglu as k
        buf = k.amax_buffer(g, 1) if ctx.record_amax else None
        h = k.swiglu_forward(_rows(g), _rows(u), amax_out=buf)
        if buf is not None:
            known_amax.remember(h, buf[0].view(torch.float32))
        return h.view(g.shape)

    @staticmethod
    # the eager ops are recorded (double backward as torch's); the kernels are not, and dg, du
    # depend on g and u even for a loss linear in h, so the kernels' results refuse it
    @once_differentiable_quantized(lambda ctx: "swiglu", lambda ctx: any(ctx.needs_input_grad),
                                   recorded=lambda ctx: not ctx.uses_kernels,
                                   unrecorded="the fused SwiGLU kernels", where="on CUDA",
                                   remedy="Use F.silu(g) * u where the gradient is differentiated again.")
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        g, u = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad
        if ctx.uses_kernels:  # one pass writes both (a second output costs less than a second pass)
            from ..kernels import triton_swiglu as k
            buf = k.amax_buffer(g, 2) if ctx.record_amax else None
            dg, du = k.swiglu_backward(_rows(dh), _rows(g), _rows(u), amax_out=buf)
            if buf is not None:
                known_amax.remember(dg, buf[0].view(torch.float32))
                known_amax.remember(du, buf[1].view(torch.float32))
            dg, du = dg.view(g.shape), du.view(g.shape)
        else:  # exactly eager autograd's ops for F.silu(g) * u
            du = dh * F.silu(g) if need_u else None
            dg = _silu_backward(dh * u, g) if need_g else None
        return (dg if need_g else None), (du if need_u else None)


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the [M, 2F] rows of ``gate_up`` (``_rows``), its gate half, its up half): views."""
    rows = _rows(gate_up)
    f = rows.shape[1] // 2
    return rows, rows[:, :f], rows[:, f:]


def _amax_record(k: Any, rows: torch.Tensor, n: int, splits: Optional[tuple[int, ...]]
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the kernels' zeroed amax buffer, each row's group or None): ``n`` per-tensor entries, or
    one per group of ``splits``."""
    if splits is None:
        return k.amax_buffer(rows, n), None
    return k.amax_buffer(rows, len(splits)), row_groups(splits, rows.device)


class SwiGLUPackedFunction(torch.autograd.Function):
    """``silu(gate) * up`` of one [..., 2F] tensor holding [gate | up] (a fused gate/up
    projection's output), differentiated as one tensor: its gradient is written as one [..., 2F]
    tensor, dg and du straight into its halves, where the two-input form's gradients (dg, du)
    would be concatenated by autograd (one more pass over 2F columns: read and write). Values,
    amax records and errors are :class:`SwiGLUFunction`'s; the gradient's recorded amax is that
    of the whole [..., 2F] tensor, the tensor the next quantizer reads. With ``splits`` (the rows
    of each row group: an MoE layer's experts) the amaxes recorded are those of each group's rows,
    where a ``GroupedLinear`` reads them (``AutocastState.reads_known_group_amax``)."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor, splits: Optional[tuple[int, ...]]) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        rows, g, u = _halves(gate_up)
        out_shape = (*gate_up.shape[:-1], g.shape[1])
        ctx.uses_kernels = _uses_kernels(gate_up)
        ctx.splits = splits
        ctx.record_amax = _records_amax(grouped=splits is not None)
        f = g.shape[1]
        if not ctx.uses_kernels:  # a tensor of its own (not a view: in-place ops on it stay allowed)
            return F.silu(gate_up[..., :f]) * gate_up[..., f:]
        from ..kernels import triton_swiglu as k
        buf, groups = _amax_record(k, rows, 1, splits) if ctx.record_amax else (None, None)
        h = k.empty(out_shape, rows.dtype, rows.device)  # written through a 2D view: h is no view
        k.swiglu_forward(g, u, amax_out=buf, row_groups=groups, out=h.view(rows.shape[0], f))
        if buf is not None:
            known_amax.remember(h, buf.view(torch.float32) if splits is not None else buf[0].view(torch.float32),
                                splits)
        return h

    @staticmethod
    @once_differentiable_quantized(lambda ctx: "swiglu", lambda ctx: ctx.needs_input_grad[0],
                                   recorded=lambda ctx: not ctx.uses_kernels,
                                   unrecorded="the fused SwiGLU kernels", where="on CUDA",
                                   remedy="Use F.silu(g) * u where the gradient is differentiated again.")
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        (gate_up,) = ctx.saved_tensors
        rows, g, u = _halves(gate_up)
        dh2 = _rows(dh)
        if not ctx.uses_kernels:  # eager autograd's ops for F.silu(g) * u, then chunk's cat
            du = dh2 * F.silu(g)
            dg = _silu_backward(dh2 * u, g)
            return torch.cat([dg, du], dim=1).view(gate_up.shape), None
        from ..kernels import triton_swiglu as k
        dgu = k.empty(rows.shape, rows.dtype, rows.device)
        f = g.shape[1]
        buf, groups = _amax_record(k, rows, 2, ctx.splits) if ctx.record_amax else (None, None)
        k.swiglu_backward(dh2, g, u, amax_out=buf, out=(dgu[:, :f], dgu[:, f:]), row_groups=groups)
        if groups is not None:  # the kernel folded dg's and du's into each group's entry
            known_amax.remember(dgu, buf.view(torch.float32), ctx.splits)
        elif buf is not None:  # magnitude bits order like |v| (NaN above inf): one int max
            known_amax.remember(dgu, torch.maximum(buf[0], buf[1]).view(torch.float32))
        return dgu.view(gate_up.shape), None


def swiglu(g: torch.Tensor, u: Optional[torch.Tensor] = None, *,
           splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``F.silu(g) * u`` for the gate ``g`` and up ``u`` projections (same shape, dtype, device),
    fused on CUDA (module docstring); differentiable in both. With ``u`` None, ``g`` is a fused
    gate/up projection's output [..., 2F] holding [gate | up] along its last dimension: its
    halves are read in place and its gradient is written as one tensor
    (:class:`SwiGLUPackedFunction`: no concatenation of the halves' gradients). ``splits``
    (with ``u`` None and a 2D ``g``): the rows of each row group, the experts of an MoE layer, as
    ``GroupedLinear`` takes them; inside an autocast region where a ``GroupedLinear`` with FP8
    current scaling ran, the kernels then record each expert's amax of h and of the gradient,
    and the next ``GroupedLinear`` skips its own per-expert amax pass over them.

    Parameters
    ----------
    g:
        The gate projection's output (floating point), or [..., 2F] holding [gate | up] when
        ``u`` is None.
    u:
        The up projection's output, of ``g``'s shape, dtype and device; or None.
    splits:
        Rows of each row group of a 2D one-tensor ``g`` (None: no groups).

    Returns
    -------
    torch.Tensor
        ``silu(g) * u``, of ``g``'s shape and dtype ([..., F] with ``u`` None).

    Raises
    ------
    ValueError
        Shapes or devices differ; with ``u`` None, a 0-d ``g`` or an odd last dimension;
        ``splits`` with ``u`` given, with a ``g`` not 2D, or not adding up to its rows.
    TypeError
        Dtypes differ or are not floating point; on CUDA, a dtype other than float32,
        bfloat16 or float16.
    RuntimeError
        On CUDA without Triton installed.

    Example
    -------
    >>> import torch, torch.nn.functional as F, hybridfp as hf
    >>> g, u = torch.randn(4, 8), torch.randn(4, 8)
    >>> torch.equal(hf.swiglu(g, u), F.silu(g) * u)     # the CPU runs the eager ops
    True
    >>> gu = torch.cat([g, u], dim=1)                   # a fused gate/up projection's output
    >>> torch.equal(hf.swiglu(gu), F.silu(gu[:, :8]) * gu[:, 8:])
    True
    """
    if u is None:
        if g.dim() == 0 or g.shape[-1] % 2:
            raise ValueError(f"swiglu with one input splits its last dimension in two halves [gate | up]; "
                             f"got shape {tuple(g.shape)}.")
        if not g.is_floating_point():
            raise TypeError(f"swiglu: gate_up must be floating point; got {g.dtype}.")
        # map: C-level, no Python frame per expert (this runs every micro-batch of an MoE layer)
        groups = None if splits is None else tuple(map(int, splits))
        # any(), not min(): Dynamo traces it with splits that change between calls
        if groups is not None and (g.dim() != 2 or sum(groups) != g.shape[0] or any(m < 0 for m in groups)):
            raise ValueError(f"swiglu: splits {list(groups)} must be non-negative row counts adding up to the rows "
                             f"of a 2D gate_up; got shape {tuple(g.shape)}.")
        return SwiGLUPackedFunction.apply(g, groups)
    if splits is not None:
        raise ValueError("swiglu: splits (row groups) go with the one-tensor form swiglu(gate_up, splits=...); "
                         "pass the fused gate/up projection's output as one tensor.")
    _check_pair(g, u)
    return SwiGLUFunction.apply(g, u)


class SwiGLU(nn.Module):
    """The SwiGLU activation of a gated MLP: ``down(SwiGLU()(gate(x), up(x)))``.

    ``forward(gate, up)`` is :func:`swiglu`; ``forward(gate_up)`` with one tensor takes its last
    dimension as the halves [gate | up] (the output of a fused gate+up projection), read in place,
    and writes its gradient as one tensor (``swiglu(gate_up)``).
    No parameters, no constructor arguments.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> act = hf.SwiGLU()
    >>> gate_up = torch.randn(4, 16)
    >>> torch.equal(act(gate_up), hf.swiglu(gate_up[:, :8], gate_up[:, 8:]))
    True
    """

    def forward(self, gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
        """silu(gate) * up; with ``up`` None, ``gate`` holds both halves along its last dim.

        Parameters
        ----------
        gate:
            The gate projection's output, or [..., 2 * F] holding [gate | up] when ``up`` is
            None.
        up:
            The up projection's output, or None.

        Returns
        -------
        torch.Tensor
            [..., F].

        Raises
        ------
        ValueError
            With one input, a 0-d tensor or an odd last dimension; otherwise as :func:`swiglu`.
        TypeError, RuntimeError
            As :func:`swiglu`.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> hf.SwiGLU()(torch.randn(2, 3, 10)).shape
        torch.Size([2, 3, 5])
        """
        return swiglu(gate, up)  # with up None: the one-tensor form, its gradient written whole
