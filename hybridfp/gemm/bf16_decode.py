"""Block-decoded GEMM operands in BF16, for GEMMs that run on BF16 tensor cores exactly.

Hopper has no MXFP8/NVFP4 tensor-core path, but an element times its block scale is exact
in BF16 for these formats (E4M3/E5M2 x E8M0: at most 4 significant bits; E2M1 x E4M3: at
most 6; BF16 keeps 8), so a GEMM of block-decoded BF16 operands with FP32 accumulation
computes SPEC §1's exact product. Per-tensor / per-row factors (FP8 ``scale_inv``, NVFP4
``S_dec``) stay out of the values and go to the epilogue, as in :class:`GemmOperand`.

``bf16_exact_reason(storage, direction)`` says why a copy cannot be decoded exactly in BF16
(None when it can); ``decode_bf16(storage, direction)`` returns the operand:

- on CUDA, through the Triton decode kernel registered for the storage's class
  (``DECODERS``; ``hybridfp.kernels.triton_decode``, bitwise equal to the reference), except
  the classes in ``UNVERIFIED_ON_CUDA``;
- elsewhere (CPU CI), by the reference: ``storage.gemm_operand(direction)`` rounded to BF16;
- a BF16 Identity copy is its own data (a view; nothing to decode, on any device).

A decoded copy kept beside the payload (``hybridfp.tensors.decoded``: written there by a
quantize kernel in the same pass as the codes, ``Quantizer.decoded_copies``, or by an earlier
cached decode) is used whenever it is still valid. ``cache=True`` keeps the decode made here
too (a weight used by several micro-batches of a step is decoded once); the entry lives
exactly as long as the copy's ``data`` tensor and is invalidated by in-place re-quantization.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Callable, Optional, Sequence

import torch
from ..formats import nvfp4
from ..tensors import Float8BlockStorage, Float8Storage, IdentityStorage, MXFP8Storage, NVFP4Storage
from ..tensors import decoded
from ..tensors.storage import ROWWISE, GemmOperand, QuantizedStorage

HAVE_TRITON = importlib.util.find_spec("triton") is not None
#: The table of kept decoded copies (``hybridfp.tensors.decoded``), named here for tests.
_CACHE = decoded._TABLE


def bf16_exact_reason(storage: QuantizedStorage, direction: str) -> Optional[str]:
    """None if ``storage``'s ``direction`` copy block-decodes exactly into BF16, else why not."""
    return storage.part(direction).bf16_exact_reason(direction)


def _kernels() -> ModuleType:
    """``hybridfp.kernels.triton_decode``, imported at first use: importing Triton fixes its
    interpreted / compiled mode and costs about a second (see ``quantizers/fast.py``)."""
    return importlib.import_module("hybridfp.kernels.triton_decode")


# ---------------------------------------------------------------------------- kernel decoders
def _mxfp8(s: QuantizedStorage, direction: str) -> GemmOperand:
    p = s.payload(direction)
    v = _kernels().decode_mxfp8(p["data"], p["scale"], block_2d=bool(s.meta["block_2d"]))
    return GemmOperand(v, None, p["data"].shape[1])


def _fp8(s: QuantizedStorage, direction: str) -> GemmOperand:
    p = s.payload(direction)
    return GemmOperand(_kernels().decode_fp8(p["data"]), p["scale_inv"], p["data"].shape[1])


def _fp8_block(s: QuantizedStorage, direction: str) -> GemmOperand:
    p = s.payload(direction)
    v = _kernels().decode_fp8_block(p["data"], p["scale_inv"], block=int(s.meta["block"]),
                                    block_dim=int(s.meta["block_dim"]))
    return GemmOperand(v, None, p["data"].shape[1])


def _nvfp4(s: QuantizedStorage, direction: str) -> GemmOperand:
    """As ``NVFP4Storage.gemm_operand``: an RHT copy keeps its 16-padded stored length."""
    p = s.payload(direction)
    k, stored, rht_on = s.reduction_layout(direction)
    v = _kernels().decode_nvfp4(p["data"], p["scale"], stored, block_2d=bool(s.meta["block_2d"]))
    return GemmOperand(v, nvfp4.shared_global_decode_scale(p["amax"]), k, rht_on)


#: storage class -> its Triton decode (CUDA). A new format opts in here.
DECODERS: dict[type, Callable[[QuantizedStorage, str], GemmOperand]] = {
    MXFP8Storage: _mxfp8,
    NVFP4Storage: _nvfp4,
    Float8Storage: _fp8,
    Float8BlockStorage: _fp8_block,
}
#: Kernels kept off CUDA until their GPU bitwise tests pass (tests/kernels/test_kernels_decode.py);
#: those copies are decoded by the reference (PyTorch ops on the GPU: exact, slower). Empty since
#: the NVFP4 kernel's -0.0 bug (Triton 3.6 negates as ``0 - x``) was found and fixed (issue #5).
UNVERIFIED_ON_CUDA: frozenset = frozenset()


def _identity(s: QuantizedStorage, direction: str) -> GemmOperand:
    """A BF16 copy as held (columnwise: the transposed view) — bitwise the reference."""
    v = s.payload(direction)["data"]
    v = v if direction == ROWWISE else v.t()
    return GemmOperand(v, None, v.shape[1])


#: storage class -> a decode that is already free (no kernel, nothing worth caching).
VIEWS: dict[type, Callable[[QuantizedStorage, str], GemmOperand]] = {IdentityStorage: _identity}


def reference_decode_bf16(storage: QuantizedStorage, direction: str) -> GemmOperand:
    """The FP32 block decode of :meth:`QuantizedStorage.gemm_operand` rounded to BF16 — a
    no-op rounding whenever ``bf16_exact_reason`` is None (what the kernels must equal)."""
    op = storage.part(direction).gemm_operand(direction)
    return GemmOperand(op.values.to(torch.bfloat16), op.scale, op.k, op.rht)


def decode_bf16(storage: QuantizedStorage, direction: str, *, cache: bool = False) -> GemmOperand:
    """The ``direction`` copy as a GEMM reads it, block-decoded into BF16 (exact; see module doc).

    A decoded copy kept for this payload (see the module doc) is returned as is. ``cache``:
    keep the decode made here while the payload is unchanged (for weights).
    """
    s = storage.part(direction)
    reason = s.bf16_exact_reason(direction)
    if reason is not None:
        raise ValueError(f"{s.describe()}: the {direction} copy cannot be decoded exactly in "
                         f"BF16 ({reason}); use the exact FP32 emulation (hybridfp.gemm.emulate).")
    view = VIEWS.get(type(s))
    if view is not None:
        return view(s, direction)
    kept = decoded.recall(s, direction)
    if kept is not None:
        return kept
    on_gpu = HAVE_TRITON and s.device.type == "cuda" and type(s) not in UNVERIFIED_ON_CUDA
    op = _run(DECODERS.get(type(s)) if on_gpu else None, s, direction)
    if cache:
        decoded.remember(s, direction, op)
    return op


def decode_bf16_joined(joined: QuantizedStorage, parts: Sequence[QuantizedStorage], direction: str, *,
                       cache: bool = False) -> GemmOperand:
    """``decode_bf16(joined, direction)`` for a storage that views the ``parts``' copies as one
    (``gemm.joined``: the experts' stacked weights). ``cache``: keep the decode under the first
    part's data tensor while every part's payload is unchanged (the joined storage itself is a
    new object on every call), so micro-batches reuse one decode of all the experts' weights."""
    if not cache:
        return decode_bf16(joined, direction)
    keys = [decoded.validity(p.part(direction), direction) for p in parts]
    if any(k is None for k in keys):
        return decode_bf16(joined, direction)
    first, slot, key = parts[0].part(direction), f"joined {direction}", (tuple(joined.shape), keys)
    hit = decoded.recall(first, direction, slot, check=lambda old: (
        old[0] == key[0] and len(old[1]) == len(keys) and all(decoded.same(a, b) for a, b in zip(old[1], keys))))
    if hit is not None:
        return hit
    op = decode_bf16(joined, direction)
    decoded.remember(first, direction, op, slot, key=key)
    return op


def _run(decoder: Optional[Callable[[QuantizedStorage, str], GemmOperand]], s: QuantizedStorage,
         direction: str) -> GemmOperand:
    if decoder is None:
        return reference_decode_bf16(s, direction)
    with torch.cuda.device(s.device):  # Triton launches on the current device
        return decoder(s, direction)


def clear_decode_cache() -> None:
    """Drop every kept decoded copy (e.g. to free memory before evaluation)."""
    decoded.clear()
