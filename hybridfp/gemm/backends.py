"""GEMM backends: the registry fast kernels join, and the exact emulation backend.

A backend says which (operand format, operand format, layout, device) it serves; ``select``
returns the first that does, else None, meaning the exact emulation path (numerics §1:
block-decode both operands exactly in FP32, multiply with FP32 accumulation, apply per-tensor
/ per-row global scales in the epilogue, cast). Emulation runs anywhere, including CPU CI.

Two Identity copies held in the output dtype are no quantized pair at all: ``gemm`` runs them
as torch's own op in that dtype (:func:`identity_gemm`), the op ``F.linear`` and its autograd
run, so an all-Identity recipe is the module run outside autocast, bit for bit, on every
device, for inputs with contiguous rows (docs/numerics.md says where a non-contiguous input
differs; an FP32 accumulation rounded once can differ from torch's BF16 kernel in the last bit).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Optional

import torch
import torch.nn.functional as F

from ..formats import rht
from ..tensors import IdentityStorage, QuantizedStorage
from ..tensors.storage import ROWWISE, GemmOperand

FormatKey = Hashable


class EmulatedGemmWarning(UserWarning):
    """A GEMM's operand pair has no fast kernel on this device and runs exactly emulated."""


@dataclass(frozen=True)
class Backend:
    """A fast GEMM implementation for some operand-format pairs.

    ``supports(key_a, key_b, layout, device)`` says whether it takes a pair; ``run(sa, sb,
    layout, *, out_dtype, bias, accumulate_into[, fast_accumulation][, out])`` computes it (see
    :func:`hybridfp.gemm.gemm` for the arguments; ``fast_accumulation=True`` is passed only
    when a caller asks for it, so a backend without that option need not take it). ``out`` is
    passed only to a backend with ``writes_out``: it may write the result straight into that
    [m, n] tensor (and return it); whatever it returns instead is copied there by ``gemm``.
    """

    name: str
    supports: Callable[[FormatKey, FormatKey, str, torch.device], bool]
    run: Callable[..., torch.Tensor]
    writes_out: bool = False
    #: it reads both operands as their BF16 block decodes (``bf16_decode.decode_bf16``), so a
    #: copy held decoded (``tensors.decoded``) costs it nothing
    reads_bf16_decodes: bool = False


BACKENDS: list[Backend] = []
#: (device type, gemm, format A, format B) -> first role seen; what ran emulated.
EMULATED: dict[tuple[str, str, str, str], str] = {}


def register_backend(backend: Backend) -> None:
    """Add a fast backend; later registrations take precedence."""
    BACKENDS.insert(0, backend)


def select(key_a: FormatKey, key_b: FormatKey, layout: str, device: torch.device) -> Optional[Backend]:
    """The fast backend for this pair on ``device``, or None (exact emulation)."""
    for b in BACKENDS:
        if b.supports(key_a, key_b, layout, device):
            return b
    return None


def reads_bf16_decodes(key_a: FormatKey, key_b: FormatKey, layout: str, device: torch.device) -> bool:
    """Whether the GEMM of this pair on ``device`` reads both operands as BF16 decodes (its
    backend's ``reads_bf16_decodes``); False where it is emulated."""
    backend = select(key_a, key_b, layout, device)
    return backend is not None and backend.reads_bf16_decodes


def report_emulated(gemm_name: str, role: str, key_a: FormatKey, key_b: FormatKey,
                    layout: str, device: torch.device) -> bool:
    """Warn once per (device, GEMM, pair) when the pair has no fast kernel; True if emulated."""
    if select(key_a, key_b, layout, device) is not None:
        return False
    k = (torch.device(device).type, gemm_name, describe_key(key_a), describe_key(key_b))
    if k not in EMULATED:
        EMULATED[k] = role
        warnings.warn(f"hybridfp: {gemm_name} of {role} ({k[2]} x {k[3]}) has no fast kernel on "
                      f"{k[0]}; it runs on the exact emulation path.", EmulatedGemmWarning, stacklevel=4)
    return True


def report_fallback(reported: set, gemm_name: str, key_a: FormatKey, key_b: FormatKey, why: str,
                    missing: str, runs_on: str) -> None:
    """Warn once per (GEMM, pair, reason) recorded in ``reported`` that a backend's ``missing``
    path does not take this GEMM and where it runs instead (no silent slow path)."""
    k = (gemm_name, describe_key(key_a), describe_key(key_b), why)
    if k not in reported:
        reported.add(k)
        warnings.warn(f"hybridfp: {k[0]} ({k[1]} x {k[2]}) has no {missing} ({why}); it runs on {runs_on}.",
                      EmulatedGemmWarning, stacklevel=5)


def describe_key(key: FormatKey) -> str:
    """Readable format name of a key, e.g. 'MXFP8(fp8_dtype=float8_e4m3fn)'."""
    name, opts = key  # type: ignore[misc]
    shown = [f"{k}={str(v).replace('torch.', '')}" for k, v in opts if v not in (False, None)]
    return f"{name}({', '.join(shown)})" if shown else str(name)


@contextmanager
def _ieee_fp32() -> Iterator[None]:
    """FP32 matmul with FP32 products (no TF32 on CUDA, no BF16/TF32 on oneDNN CPUs),
    restored afterwards.

    Uses torch's ``fp32_precision`` API: reading the legacy ``allow_tf32`` flag raises once a
    user has set TF32 through the new API (torch >= 2.9), while the new API works whichever
    of the two the user chose. ``torch.set_float32_matmul_precision("high")`` sets both.
    """
    matmuls = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    old = [m.fp32_precision for m in matmuls]
    for m in matmuls:
        m.fp32_precision = "ieee"
    try:
        yield
    finally:
        for m, o in zip(matmuls, old):
            m.fp32_precision = o


def _to_original_domain(op: GemmOperand) -> torch.Tensor:
    """Undo the RHT of an operand paired with one that has none (one FP32 rounding)."""
    return rht.apply_inverse_rht(op.values, op.k) if op.rht else op.values


def emulate(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype,
            bias: Optional[torch.Tensor] = None, accumulate_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact reference GEMM: out[m, n] = (sum_k a[m, k] b[n, k]) * sa[m] * sb[n] (+ bias)."""
    if a.rht and b.rht:  # same R on both reduction tiles: it cancels, stay in the RHT domain
        av, bv = a.values, b.values
    else:
        av, bv = _to_original_domain(a), _to_original_domain(b)
    # torch.autocast around the caller would run this FP32 matmul in BF16: switch it off.
    with _ieee_fp32(), torch.autocast(av.device.type, enabled=False):
        acc = av @ bv.t()
    return epilogue(acc, a, b, out_dtype, bias, accumulate_into)


def epilogue(acc: torch.Tensor, a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype,
             bias: Optional[torch.Tensor] = None, accumulate_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The exact GEMM's epilogue on an FP32 accumulator: × sa[m] sb[n] (per-tensor / per-row
    global scales), + bias in FP32, then one cast (or ``accumulate_into += result``)."""
    out = acc
    if a.scale is not None or b.scale is not None:
        sa = a.scale.reshape(-1, 1) if a.scale is not None else torch.ones((), device=acc.device)
        sb = b.scale.reshape(1, -1) if b.scale is not None else torch.ones((), device=acc.device)
        out = acc * (sa * sb)
    if bias is not None:
        out = out + bias.float()
    if accumulate_into is not None:
        accumulate_into.copy_(accumulate_into.float() + out)
        return accumulate_into
    return out.to(out_dtype)


def identity_pair(sa: QuantizedStorage, da: str, sb: QuantizedStorage, db: str, out_dtype: torch.dtype,
                  bias: Optional[torch.Tensor], accumulate_into: Optional[torch.Tensor]
                  ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The two operands in their stored orientation ([m, k], [n, k]) if both are Identity copies
    held in ``out_dtype`` (a bias, if any, too) with no accumulation: the pair whose GEMM is
    torch's own op (:func:`identity_gemm`). None otherwise (other formats, mixed dtypes, an
    FP32 accumulation into ``accumulate_into``: the exact path)."""
    if type(sa) is not IdentityStorage or type(sb) is not IdentityStorage or accumulate_into is not None:
        return None
    a, b = sa.payload(da)["data"], sb.payload(db)["data"]
    if a.dtype != out_dtype or b.dtype != out_dtype or (bias is not None and bias.dtype != out_dtype):
        return None
    return (a if da == ROWWISE else a.t()), (b if db == ROWWISE else b.t())


def identity_gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [m, k] · b [n, k]ᵀ (+ bias) of high-precision tensors of one dtype, by torch's own op
    in that dtype: ``F.linear(a, b, bias)``, i.e. ``addmm(bias, a, bᵀ)`` or ``mm(a, bᵀ)``.

    This is the op sequence of ``F.linear`` and its autograd on the same tensors: fprop
    ``F.linear(x, W, b)``; dgrad ``mm(dy, W)`` (b is W's columnwise copy, a transposed view of
    W, so bᵀ is W itself); wgrad ``mm(dyᵀ, x)``. Torch's kernels accumulate BF16 / FP16
    products in FP32; FP32 matmuls follow torch's precision settings, as outside autocast.

    Parameters
    ----------
    a, b
        The operands in their stored orientation, reduction along the last dim, one dtype.
    bias
        [n] in the same dtype, or None.

    Returns
    -------
    torch.Tensor
        [m, n] in the operands' dtype.
    """
    # torch.autocast (AMP) around the caller would recast the operands: not the op F.linear
    # runs outside any autocast
    with torch.autocast(a.device.type, enabled=False):
        return F.linear(a, b, bias)
