"""Block-decoded GEMM operands in BF16, for GEMMs that run on BF16 tensor cores exactly.

Hopper has no MXFP8/NVFP4 tensor-core path, but an element times its block scale is exact
in BF16 for these formats (E4M3/E5M2 x E8M0: at most 4 significant bits; E2M1 x E4M3: at
most 6; BF16 keeps 8), so a GEMM of block-decoded BF16 operands with FP32 accumulation
computes numerics §1's exact product. Per-tensor / per-row factors (FP8 ``scale_inv``, NVFP4
``S_dec``) stay out of the values and go to the epilogue, as in :class:`GemmOperand`.

``bf16_exact_reason(storage, direction)`` says why a copy cannot be decoded exactly in BF16
(None when it can); ``decode_bf16(storage, direction)`` returns the operand:

- on CUDA, through the Triton decode kernel registered for the storage's class
  (``DECODERS``; ``hybridfp.kernels.triton_decode``, bitwise equal to the reference), except
  the classes the policy's ``decode_kernel_unverified_on_cuda`` names;
- elsewhere (CPU CI), by the reference: ``storage.gemm_operand(direction)`` rounded to BF16;
- a BF16 Identity copy is its own data (a view; nothing to decode, on any device).

``cache=True`` memoizes the decoded copy per payload (a weight used by several micro-batches
of a step is decoded once): the entry hangs off the copy's ``data`` tensor in a weak-keyed
table, so it lives exactly as long as that tensor and is neither a payload tensor (not in
``tensors()``) nor saved by ``to_state()``. It is used while every payload tensor of the copy
is the same object with the same ``data_ptr`` and version — in-place re-quantization
(``copy_`` / ``update_quantized``) bumps the versions and so invalidates it, and so do a write
through a dim-0 slice, split piece or view of the tensor (payload tensors of their own over the
same memory, whose version counters are not the tensor's: the write is noted on the memory) and
FSDP2's gather into the same tensors, which keeps their version counters but notes the rewrite
(``utils.rewrites``).
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config import current_policy
from ..tensors import Float8BlockStorage, Float8Storage, IdentityStorage, MXFP8Storage, NVFP4Storage
from ..tensors.decoded import DECODED_CLASSES
from ..tensors.storage import COLUMNWISE, ROWWISE, GemmOperand, QuantizedStorage
from ..utils.rewrites import version

HAVE_TRITON = importlib.util.find_spec("triton") is not None

#: payload ``data`` tensor -> {direction: (validity key, decoded operand)}.
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def bf16_exact_reason(storage: QuantizedStorage, direction: str) -> Optional[str]:
    """None if ``storage``'s ``direction`` copy block-decodes exactly into BF16, else why not."""
    return storage.part(direction).bf16_exact_reason(direction)


# ---------------------------------------------------------------------------- kernel decoders
# Each imports ``kernels.triton_decode`` at its first call: importing Triton fixes its interpreted /
# compiled mode and costs about a second (see ``quantizers/fast.py``).
def _mxfp8(s: QuantizedStorage, direction: str) -> GemmOperand:
    from ..kernels import triton_decode
    p = s.payload(direction)
    v = triton_decode.decode_mxfp8(p["data"], p["scale"], block_2d=bool(s.meta["block_2d"]))
    return GemmOperand(v, None, p["data"].shape[1])


def _fp8(s: QuantizedStorage, direction: str) -> GemmOperand:
    from ..kernels import triton_decode
    p = s.payload(direction)
    return GemmOperand(triton_decode.decode_fp8(p["data"]), s.epilogue_scale(direction), p["data"].shape[1])


def _fp8_block(s: QuantizedStorage, direction: str) -> GemmOperand:
    from ..kernels import triton_decode
    p = s.payload(direction)
    v = triton_decode.decode_fp8_block(p["data"], p["scale_inv"], block=int(s.meta["block"]),
                                       block_dim=int(s.meta["block_dim"]))
    return GemmOperand(v, None, p["data"].shape[1])


def _nvfp4(s: QuantizedStorage, direction: str) -> GemmOperand:
    """As ``NVFP4Storage.gemm_operand``: an RHT copy keeps its 16-padded stored length."""
    from ..kernels import triton_decode
    p = s.payload(direction)
    k, stored, rht_on = s.reduction_layout(direction)
    v = triton_decode.decode_nvfp4(p["data"], p["scale"], stored, block_2d=bool(s.meta["block_2d"]))
    return GemmOperand(v, s.epilogue_scale(direction), k, rht_on)


#: storage class -> its Triton decode (CUDA). A new format opts in here.
DECODERS: dict[type, Callable[[QuantizedStorage, str], GemmOperand]] = {
    MXFP8Storage: _mxfp8,
    NVFP4Storage: _nvfp4,
    Float8Storage: _fp8,
    Float8BlockStorage: _fp8_block,
}


def _identity(s: QuantizedStorage, direction: str) -> GemmOperand:
    """A BF16 copy as held (columnwise: the transposed view) — bitwise the reference."""
    v = s.payload(direction)["data"]
    v = v if direction == ROWWISE else v.t()
    return GemmOperand(v, None, v.shape[1])


def _decoded(s: QuantizedStorage, direction: str) -> GemmOperand:
    """A copy held as its BF16 decode (``tensors.decoded``): its data, stored orientation, and
    the source format's epilogue factor (NVFP4's S_dec from the amax it keeps)."""
    v = s.payload(direction)["data"]
    return GemmOperand(v, s.epilogue_scale(direction), v.shape[1])


#: storage class -> a decode that is already free (no kernel, nothing worth caching).
VIEWS: dict[type, Callable[[QuantizedStorage, str], GemmOperand]] = {
    IdentityStorage: _identity, **{cls: _decoded for cls in DECODED_CLASSES.values()}}


def _identity_transposed(s: QuantizedStorage, direction: str) -> Optional[torch.Tensor]:
    """A BF16 Identity columnwise copy's values transposed: its data as held (a rowwise copy's
    transpose would be a view op; None)."""
    return s.payload(direction)["data"] if direction == COLUMNWISE else None


#: storage class -> ``decode_bf16(s, direction).values.t()`` as a tensor the copy holds, or None.
HELD_TRANSPOSES: dict[type, Callable[[QuantizedStorage, str], Optional[torch.Tensor]]] = {
    IdentityStorage: _identity_transposed}


def held_transpose(storage: QuantizedStorage, direction: str) -> Optional[torch.Tensor]:
    """``decode_bf16(storage, direction).values.t()`` (the copy's decode carries no scale and no
    RHT) when it is a tensor the copy holds, so a caller that wants the transpose (a grouped GEMM
    operand copied in the other layout) needs no transposed view taken and transposed back, per
    expert; else None (also when the copy has no exact BF16 decode: ``decode_bf16`` says why)."""
    s = storage.part(direction)
    transposed = HELD_TRANSPOSES.get(type(s))
    if transposed is None or s.bf16_exact_reason(direction) is not None:
        return None
    return transposed(s, direction)


def reference_decode_bf16(storage: QuantizedStorage, direction: str) -> GemmOperand:
    """The FP32 block decode of :meth:`QuantizedStorage.gemm_operand` rounded to BF16 — a
    no-op rounding whenever ``bf16_exact_reason`` is None (what the kernels must equal)."""
    op = storage.part(direction).gemm_operand(direction)
    return GemmOperand(op.values.to(torch.bfloat16), op.scale, op.k, op.rht)


def decode_bf16(storage: QuantizedStorage, direction: str, *, cache: bool = False) -> GemmOperand:
    """The ``direction`` copy as a GEMM reads it, block-decoded into BF16 (exact; see module doc).

    ``cache``: reuse / keep the decoded copy while the payload is unchanged (for weights).
    """
    s = storage.part(direction)
    reason = s.bf16_exact_reason(direction)
    if reason is not None:
        raise ValueError(f"{s.describe()}: the {direction} copy cannot be decoded exactly in "
                         f"BF16 ({reason}); use the exact FP32 emulation (hybridfp.gemm.emulate).")
    view = VIEWS.get(type(s))
    if view is not None:
        return view(s, direction)
    on_gpu = (HAVE_TRITON and s.device.type == "cuda"
              and type(s).__name__ not in current_policy().decode_kernel_unverified_on_cuda)
    decoder = DECODERS.get(type(s)) if on_gpu else None
    if not cache:
        return _run(decoder, s, direction)
    data = s.payload(direction)["data"]
    key = _validity(s, direction)
    if key is None:  # inference tensors have no version counter: nothing to validate against
        return _run(decoder, s, direction)
    hit = _CACHE.get(data, {}).get(direction)
    if hit is not None and _same(hit[0], key):
        return hit[1]
    op = _run(decoder, s, direction)
    _CACHE.setdefault(data, {})[direction] = (key, op)
    return op


def decode_bf16_joined(joined: QuantizedStorage, parts: Sequence[QuantizedStorage], direction: str, *,
                       cache: bool = False) -> GemmOperand:
    """``decode_bf16(joined, direction)`` for a storage that views the ``parts``' copies as one
    (``moe.joined``: the experts' stacked weights). ``cache``: keep the decode under the first
    part's data tensor while every part's payload is unchanged (the joined storage itself is a
    new object on every call), so micro-batches reuse one decode of all the experts' weights."""
    if not cache or type(joined.part(direction)) in VIEWS:
        # a free decode is not cached: its values are the payload itself, and an entry holding
        # them would keep its own weak key alive (decoded copies: one leaked weight copy a step)
        return decode_bf16(joined, direction)
    keys = [_validity(p.part(direction), direction) for p in parts]
    if any(k is None for k in keys):
        return decode_bf16(joined, direction)
    data = parts[0].part(direction).payload(direction)["data"]
    slot = f"joined {direction}"
    hit = _CACHE.get(data, {}).get(slot)
    if (hit is not None and hit[0][0] == tuple(joined.shape) and len(hit[0][1]) == len(keys)
            and all(_same(a, b) for a, b in zip(hit[0][1], keys))):
        return hit[1]
    op = decode_bf16(joined, direction)
    _CACHE.setdefault(data, {})[slot] = ((tuple(joined.shape), keys), op)
    return op


def _run(decoder: Optional[Callable[[QuantizedStorage, str], GemmOperand]], s: QuantizedStorage,
         direction: str) -> GemmOperand:
    if decoder is None:
        return reference_decode_bf16(s, direction)
    with torch.cuda.device(s.device):  # Triton launches on the current device
        return decoder(s, direction)


def _validity(s: QuantizedStorage, direction: str) -> Optional[tuple]:
    """What a cached decode depends on: class, shape, options and every payload tensor of the
    copy (held, so its id cannot be recycled while the entry lives; the ``data`` tensor itself
    is the weak key and is not held)."""
    p = s.payload(direction)
    if any(t.is_inference() for t in p.values()):
        return None
    tensors = tuple((n, None if n == "data" else t, t.data_ptr(), version(t)) for n, t in sorted(p.items()))
    return (type(s), tuple(s.shape), tuple(sorted(s.meta.items(), key=lambda kv: kv[0])), tensors)


def _same(old: tuple, new: tuple) -> bool:
    """Validity keys equal, payload tensors compared by identity (``==`` on tensors is elementwise)."""
    if old[:3] != new[:3] or len(old[3]) != len(new[3]):
        return False
    return all(a[0] == b[0] and a[1] is b[1] and a[2:] == b[2:] for a, b in zip(old[3], new[3]))


def clear_decode_cache() -> None:
    """Drop every cached decoded copy (e.g. to free memory before evaluation)."""
    _CACHE.clear()
