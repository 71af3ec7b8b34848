"""``GroupedTensor``: an MoE layer's per-expert quantized tensors held as the shared encodings
they are views of, the per-expert objects built only when someone asks for them
(TransformerEngine's name for the same idea: one joined encoding plus per-expert offsets).

``moe.quantize.quantize_grouped`` encodes a copy that never straddles two experts once for
all of them (a row-local rowwise copy; a columnwise block copy of the groups zero-padded to whole
blocks). Where every expert's tensor is nothing but views of those encodings, it returns them as
a ``GroupedTensor``: per direction one :class:`JoinedCopy` (the shared storage, and where each
expert's group starts in it), plus a function that cuts the per-expert tensors out of them. The
grouped GEMM (``moe.gemm_joined``) and the saved-for-backward record (``moe.saved``)
read the joined copies directly, so at 64 experts a step does not build, check and re-join 64
storages per operand; anything else indexes or iterates it and gets the per-expert
``QuantizedTensor``s ``quantize_grouped`` would otherwise return, built once (bitwise the same objects' contents: the cuts are the
same views).
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from ..tensors.quantized_tensor import QuantizedTensor
from ..tensors.storage import COLUMNWISE, DIRECTIONS, ROWWISE, QuantizedStorage


class JoinedCopy(NamedTuple):
    """One direction's copy of every expert, as one storage.

    ``starts`` None: the experts' copies are consecutive row blocks of ``storage`` in order,
    unpadded (its rows are Σ m_e; a BF16 Identity columnwise copy is the same rows, read
    transposed). Otherwise each expert's group starts at logical row ``starts[e]`` of
    ``storage``, the rows up to the next start holding zero codes (a columnwise block copy of the
    groups zero-padded to whole blocks).

    ``scales``: per-tensor-scaled experts (FP8 current scaling: each expert its own amax):
    FP32 [E], expert e's ``scale_inv``; ``storage`` then holds the codes at scale 1, so its own
    decode is not the experts' values — expert e's are its rows' decode times ``scales[e]``."""

    storage: QuantizedStorage
    starts: Optional[list[int]]
    scales: Optional[torch.Tensor] = None


#: joined copies -> the per-expert tensors cut out of them (one per expert)
Cutter = Callable[[dict[str, JoinedCopy]], list[QuantizedTensor]]


class GroupedTensor(Sequence[QuantizedTensor]):
    """The experts' tensors of one grouped quantization (a ``Sequence`` of ``QuantizedTensor``),
    held as joined copies; ``cut`` builds the per-expert tensors on first access."""

    def __init__(self, splits: Sequence[int], joined: dict[str, JoinedCopy], cut: Cutter) -> None:
        if not joined or any(d not in DIRECTIONS for d in joined):
            raise ValueError(f"GroupedTensor needs joined copies keyed by direction; got {sorted(joined)}.")
        self.splits = [int(m) for m in splits]
        self._joined = dict(joined)
        self._cut = cut
        self._items: Optional[list[QuantizedTensor]] = None

    # ------------------------------------------------------------------ the sequence
    def experts(self) -> list[QuantizedTensor]:
        """The per-expert tensors (built once, then the same objects)."""
        if self._items is None:
            self._items = self._cut(self._joined)
        return self._items

    def __len__(self) -> int:
        return len(self.splits)

    def __getitem__(self, i):  # type: ignore[override]
        return self.experts()[i]

    def __iter__(self) -> Iterator[QuantizedTensor]:
        return iter(self.experts())

    @property
    def materialized(self) -> bool:
        """Whether the per-expert tensors were built (diagnostics and tests)."""
        return self._items is not None

    # ------------------------------------------------------------------ joined copies
    def joined(self, direction: str) -> Optional[JoinedCopy]:
        """The experts' ``direction`` copies as one storage, if held."""
        return self._joined.get(direction)

    def directions(self) -> tuple[str, ...]:
        """The directions every expert holds, rowwise first."""
        return tuple(d for d in DIRECTIONS if d in self._joined)

    def has_direction(self, direction: str) -> bool:
        """Whether every expert holds ``direction``'s copy."""
        return direction in self._joined

    def drop(self, direction: str) -> None:
        """Drop one direction from every expert (``update_usage(direction=False)`` on each)."""
        if direction not in self._joined:
            return
        if len(self._joined) == 1:
            raise ValueError(f"dropping the {direction} copies would leave the experts with no copy at all.")
        del self._joined[direction]
        if self._items is not None:
            flag = {ROWWISE: "rowwise_usage", COLUMNWISE: "columnwise_usage"}[direction]
            for t in self._items:
                t.update_usage(**{flag: False})

    @property
    def cutter(self) -> Cutter:
        """The function that cuts the per-expert tensors out of joined copies of this layout (to
        rebuild the experts over the saved tensors handed back to backward)."""
        return self._cut
