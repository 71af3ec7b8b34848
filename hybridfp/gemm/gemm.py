"""``gemm``: one entry point for every operand-format pair and the three GEMMs of a linear.

Layouts name which copy of each operand a GEMM reads (numerics §1); every copy is stored with
its reduction along the last dimension, so each layout is ``A_s[m, k] · B_s[n, k]ᵀ``:

| layout | GEMM  | A copy     | B copy     | math                               |
|--------|-------|------------|------------|------------------------------------|
| "TN"   | fprop | rowwise    | rowwise    | y[M, N]  = x[M, K] · W[N, K]ᵀ      |
| "NN"   | dgrad | rowwise    | columnwise | dx[M, K] = dy[M, N] · W[N, K]      |
| "NT"   | wgrad | columnwise | columnwise | dW[N, K] = dy[M, N]ᵀ · x[M, K]     |

Operands are QuantizedTensors (any format, hybrids included) or plain tensors (used
unquantized). Any pair is legal; pairs without a fast kernel run the exact emulation. Two
Identity copies (or plain tensors) held in the output dtype run torch's own op in that dtype,
as ``F.linear`` and its autograd do (``backends.identity_gemm``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats.common import as_2d
from ..tensors import IdentityStorage, QuantizedStorage, QuantizedTensor
from ..tensors.storage import COLUMNWISE, ROWWISE
from .backends import emulate, identity_gemm, identity_pair, report_emulated, select

LAYOUTS: dict[str, tuple[str, str]] = {
    "TN": (ROWWISE, ROWWISE),
    "NN": (ROWWISE, COLUMNWISE),
    "NT": (COLUMNWISE, COLUMNWISE),
}
GEMM_OF_LAYOUT = {"TN": "fprop", "NN": "dgrad", "NT": "wgrad"}


def operand_storage(t: torch.Tensor, direction: str, what: str) -> QuantizedStorage:
    """The single-format storage that holds ``t``'s ``direction`` copy (hybrids unwrap)."""
    if isinstance(t, QuantizedTensor):
        return t.qstorage.part(direction)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"gemm operand {what} must be a floating tensor or a QuantizedTensor; got "
                        f"{getattr(t, 'dtype', type(t).__name__)}.")
    p = {"data": as_2d(t)}
    return IdentityStorage(t.shape, t.dtype, p, p)


def gemm(A: torch.Tensor, B: torch.Tensor, layout: str = "TN", *, out_dtype: torch.dtype = torch.bfloat16,
         bias: Optional[torch.Tensor] = None, accumulate_into: Optional[torch.Tensor] = None,
         fast_accumulation: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Compute the GEMM ``layout`` selects (table above) on the copies it needs.

    The pair's registered backend runs it (a fast kernel) where one serves the operands'
    formats, layout and device; otherwise the exact emulation does, reported once per device,
    GEMM and pair (``EmulatedGemmWarning``).

    Parameters
    ----------
    A, B:
        QuantizedTensors holding the copies the layout reads (any format, hybrids included),
        or plain floating tensors (used unquantized). ``A`` is x (fprop) or dy (dgrad,
        wgrad); ``B`` is W (fprop, dgrad) or x (wgrad).
    layout:
        "TN" (fprop), "NN" (dgrad) or "NT" (wgrad).
    out_dtype:
        The result's dtype (default bfloat16): a floating dtype (float32, bfloat16, float16,
        float64); an integer or complex dtype is refused (the cast would truncate silently).
    bias:
        [n], added in FP32 before the cast.
    accumulate_into:
        [m, n] (e.g. an FP32 main_grad): receives ``accumulate_into + result`` in place and is
        returned.
    fast_accumulation:
        Let Hopper's FP8 tensor cores keep partial sums in their reduced precision over the
        whole k loop (cuBLAS fast accumulation; only the FP8 per-tensor cuBLAS backend has
        it, the others accumulate in FP32 regardless). Off by default because it goes beyond
        numerics §1's exception (reduced precision inside one promotion interval): on the H200
        it gives 1.6e-3 relative error at k = 2048, vs 1e-4 with promotion. TE and torchao
        turn it on for fprop; recipes do so with ``fprop_fast_accumulation=True``.
    out:
        An [m, n] tensor of ``out_dtype`` on the operands' device with unit column stride
        (e.g. one expert's rows of a grouped result) that receives the result and is returned
        — written directly by the cuBLAS FP8 per-tensor kernel when it can (contiguous,
        16-byte aligned, no padded output columns or FP32 intermediate) and by the BF16
        tensor-core backends on CUDA (their epilogue kernel, or cuBLAS BF16 into a contiguous
        16-byte aligned ``out``), copied there otherwise.

    Returns
    -------
    torch.Tensor
        The [m, n] result in ``out_dtype`` (``accumulate_into`` or ``out`` when given).

    Raises
    ------
    ValueError
        An unknown layout; reduction lengths that differ; a ``bias``, ``accumulate_into`` or
        ``out`` of the wrong shape (``out`` also: wrong dtype or device, non-unit column
        stride, or given with ``accumulate_into``).
    TypeError
        An operand that is neither a floating tensor nor a QuantizedTensor; an ``out_dtype``
        that is not a floating dtype.
    MissingDirectionError
        An operand lacks the copy the layout reads.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.gemm import gemm
    >>> x, w = torch.randn(16, 64), torch.randn(32, 64)
    >>> q = hf.MXFP8Quantizer()
    >>> y = gemm(q(x), q(w), "TN", out_dtype=torch.float32)      # fprop: x · Wᵀ
    >>> y.shape, bool((y - x @ w.t()).norm() / (x @ w.t()).norm() < 0.1)
    (torch.Size([16, 32]), True)
    >>> gemm(q(torch.randn(16, 32)), q(w), "NN").shape           # dgrad: dy · W
    torch.Size([16, 64])
    """
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"gemm out_dtype must be a floating dtype (torch.float32, torch.bfloat16, "
                        f"torch.float16 or torch.float64); got {out_dtype!r} (an integer result "
                        "would silently truncate the product).")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use 'TN' (fprop), 'NN' (dgrad) or 'NT' (wgrad).")
    da, db = LAYOUTS[layout]
    sa, sb = operand_storage(A, da, "A"), operand_storage(B, db, "B")
    ka, kb = _reduction_len(sa, da), _reduction_len(sb, db)
    if ka != kb:
        raise ValueError(f"gemm {layout} ({GEMM_OF_LAYOUT[layout]}): reduction lengths differ: A's "
                         f"{da} copy reduces over {ka}, B's {db} copy over {kb} ({sa.describe()}, "
                         f"{sb.describe()}).")
    m = sa.cols if da == COLUMNWISE else sa.rows
    n = sb.cols if db == COLUMNWISE else sb.rows
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gemm bias must have shape [{n}]; got {tuple(bias.shape)}.")
    if accumulate_into is not None and tuple(accumulate_into.shape) != (m, n):
        raise ValueError(f"gemm {layout} ({GEMM_OF_LAYOUT[layout]}) makes a [{m}, {n}] result; "
                         f"accumulate_into has shape {tuple(accumulate_into.shape)}.")
    if out is not None:
        _check_out(out, m, n, out_dtype, layout, accumulate_into)
        if out.device != sa.device:
            raise ValueError(f"gemm {layout} ({GEMM_OF_LAYOUT[layout]}): out is on {out.device}, the "
                             f"operands on {sa.device}.")
    plain = identity_pair(sa, da, sb, db, out_dtype, bias, accumulate_into)
    if plain is not None:  # no quantized operand: torch's own op, as F.linear runs it
        res = identity_gemm(*plain, bias)
        return res if out is None else out.copy_(res)
    key_a, key_b = sa.format_key(da), sb.format_key(db)
    backend = select(key_a, key_b, layout, sa.device)
    if backend is not None:
        # passed only when asked, so a backend without the option still serves every other call
        extra: dict = {"fast_accumulation": True} if fast_accumulation else {}
        if out is not None and backend.writes_out:
            extra["out"] = out
        res = backend.run(sa, sb, layout, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into,
                          **extra)
        return res if out is None or res is out else out.copy_(res)
    # Modules report their pairs when they build quantizers; direct calls are reported here
    # (once per device, GEMM and pair, shared with the modules' reports).
    report_emulated(GEMM_OF_LAYOUT[layout], sa.label or sb.label or "a direct gemm() call",
                    key_a, key_b, layout, sa.device)
    res = emulate(sa.gemm_operand(da), sb.gemm_operand(db), out_dtype, bias, accumulate_into)
    return res if out is None else out.copy_(res)


def _check_out(out: torch.Tensor, m: int, n: int, out_dtype: torch.dtype, layout: str,
               accumulate_into: Optional[torch.Tensor]) -> None:
    """``out`` must be an [m, n] ``out_dtype`` tensor with unit column stride, and not combined
    with ``accumulate_into`` (which already names where the result goes)."""
    what = f"gemm {layout} ({GEMM_OF_LAYOUT[layout]})"
    if accumulate_into is not None:
        raise ValueError(f"{what}: pass either out or accumulate_into, not both.")
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype:
        raise ValueError(f"{what} makes a [{m}, {n}] {out_dtype} result; out is "
                         f"{tuple(out.shape)} {out.dtype}.")
    if n > 1 and out.stride(1) != 1:
        raise ValueError(f"{what}: out must have unit column stride (rows of a row-major tensor); "
                         f"got strides {out.stride()}.")


def _reduction_len(s: QuantizedStorage, direction: str) -> int:
    """K of the stored operand: the last dim for rowwise, the leading (rows) for columnwise."""
    return s.cols if direction == ROWWISE else s.rows
