"""Block-decoded copies kept beside a storage's payload: a cache, never a payload.

A GEMM on the BF16 tensor-core path (``hybridfp.gemm.bf16_decode``) reads each copy
block-decoded into BF16. Two producers put that decode here: the GEMM itself for weights
(decoded once, reused by every micro-batch of the step) and a quantize kernel that writes the
decoded copy in the same pass as the codes (``Quantizer.decoded_copies``), so the GEMM skips a
decode pass that would read the codes back from memory.

An entry hangs off the copy's ``data`` tensor in a weak-keyed table: it lives exactly as long
as that tensor, is not in ``tensors()`` and is not saved by ``to_state()`` (a saved or moved
copy decodes again). It is used only while every payload tensor of the copy is the same object
with the same ``data_ptr`` and ``_version``: in-place re-quantization (``copy_`` /
``update_quantized``) bumps the versions and so invalidates it.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.utils.weak import WeakIdKeyDictionary

from .storage import QuantizedStorage

#: payload ``data`` tensor -> {slot: (validity key, decoded value)}.
_TABLE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def validity(s: QuantizedStorage, direction: str) -> Optional[tuple]:
    """What a decoded copy depends on: class, shape, options and every payload tensor of the
    copy (held, so its id cannot be recycled while the entry lives; the ``data`` tensor itself
    is the weak key and is not held). None for inference tensors (no version counter)."""
    p = s.payload(direction)
    if any(t.is_inference() for t in p.values()):
        return None
    tensors = tuple((n, None if n == "data" else t, t.data_ptr(), t._version) for n, t in sorted(p.items()))
    return (type(s), tuple(s.shape), tuple(sorted(s.meta.items(), key=lambda kv: kv[0])), tensors)


def same(old: tuple, new: tuple) -> bool:
    """Validity keys equal, payload tensors compared by identity (``==`` on tensors is elementwise)."""
    if old[:3] != new[:3] or len(old[3]) != len(new[3]):
        return False
    return all(a[0] == b[0] and a[1] is b[1] and a[2:] == b[2:] for a, b in zip(old[3], new[3]))


def remember(s: QuantizedStorage, direction: str, value: Any, slot: Optional[str] = None,
             key: Any = None) -> bool:
    """Keep ``value`` (the decoded ``direction`` copy of single-format storage ``s``) under
    ``slot`` (default: the direction) while the copy is unchanged; ``key`` replaces the
    default validity key (``validity(s, direction)``). False (nothing kept) for inference
    tensors."""
    key = validity(s, direction) if key is None else key
    if key is None:
        return False
    _TABLE.setdefault(s.payload(direction)["data"], {})[slot or direction] = (key, value)
    return True


def recall(s: QuantizedStorage, direction: str, slot: Optional[str] = None,
           check: Any = None) -> Any:
    """The value kept for ``s``'s ``direction`` copy under ``slot``, if still valid, else None.
    ``check(old_key)``: the validity test when the entry was kept with its own key."""
    hit = _TABLE.get(s.payload(direction)["data"], {}).get(slot or direction)
    if hit is None:
        return None
    if check is not None:
        return hit[1] if check(hit[0]) else None
    key = validity(s, direction)
    return hit[1] if key is not None and same(hit[0], key) else None


def clear() -> None:
    """Drop every kept decoded copy (e.g. to free memory before evaluation)."""
    _TABLE.clear()
