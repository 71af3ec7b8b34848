"""``GroupedTensor``: an MoE layer's per-expert quantized tensors together with the shared
encodings their copies are views of (TransformerEngine's name for the same idea: one joined
encoding plus per-expert offsets).

``moe.quantize.quantize_grouped`` encodes a copy that never straddles two experts once for
all of them (a row-local rowwise copy; a columnwise block copy of the groups zero-padded to whole
blocks; the per-expert-scaled codes of one cast pass) and hands the experts' tensors out as a
``GroupedTensor``: per direction whose every expert's copy is a view of one such encoding, one
:class:`JoinedCopy` (the shared storage, and where each expert's group starts in it). Consumers
read the joined copies from it — the grouped GEMM paths (``moe.gemm``, ``moe.gemm_joined``) and
the saved-for-backward record (``moe.saved``) — instead of finding out from the experts' views
that they are adjacent. A plain list of separately quantized experts stays valid input
everywhere and is never read as joined.

One type, two forms:

- *joined only* (``cut``): every expert present and every copy it holds a view of a joined
  copy. The per-expert ``QuantizedTensor``s are built only when something indexes or iterates
  it (bitwise the tensors ``quantize_grouped`` would otherwise return: the cuts are the same
  views), so at 64 experts a step does not build, check and re-join 64 storages per operand.
- *built* (``experts``): the producer built the per-expert tensors now (an expert may be None:
  it needs no copy), because some copies are the experts' own (encoded per expert, or
  contiguous per-expert copies such as FP8 block columnwise copies for cuBLAS); ``joined`` names
  the directions whose every present expert's copy is nevertheless a view of one storage.
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
    groups zero-padded to whole blocks) or other rows of the same row-local encoding that no
    expert reads (a rowwise copy of the padded groups).

    ``scales``: per-tensor-scaled experts (FP8 current scaling: each expert its own amax):
    FP32 [E], expert e's ``scale_inv``; ``storage`` then holds the codes at scale 1, so its own
    decode is not the experts' values — expert e's are its rows' decode times ``scales[e]``."""

    storage: QuantizedStorage
    starts: Optional[list[int]]
    scales: Optional[torch.Tensor] = None


#: joined copies -> the per-expert tensors cut out of them (one per expert)
Cutter = Callable[[dict[str, JoinedCopy]], list[QuantizedTensor]]


class GroupedTensor(Sequence[Optional[QuantizedTensor]]):
    """The experts' tensors of one grouped quantization (a ``Sequence`` of ``QuantizedTensor``,
    None for an expert without a copy) and the joined copies they are views of.

    Parameters
    ----------
    splits:
        The experts' row counts.
    joined:
        Per direction held joined, its :class:`JoinedCopy`.
    cut:
        Joined-only form: builds the per-expert tensors from ``joined`` on first access (every
        expert present, every copy it holds joined).
    experts:
        Built form: the per-expert tensors (None: no copy); exactly one of ``cut`` / ``experts``.

    Raises
    ------
    ValueError
        Joined copies not keyed by direction, a joined-only tensor without one, both or neither
        of ``cut`` / ``experts``, or ``experts`` of another length than ``splits``."""

    def __init__(self, splits: Sequence[int], joined: dict[str, JoinedCopy], cut: Optional[Cutter] = None,
                 experts: Optional[Sequence[Optional[QuantizedTensor]]] = None) -> None:
        if any(d not in DIRECTIONS for d in joined) or (cut is not None and not joined):
            raise ValueError(f"GroupedTensor needs joined copies keyed by direction; got {sorted(joined)}.")
        if (cut is None) == (experts is None):
            raise ValueError("GroupedTensor takes either cut (joined copies only) or experts (built), not both.")
        if experts is not None and len(experts) != len(splits):
            raise ValueError(f"GroupedTensor: {len(experts)} experts for {len(splits)} splits.")
        self.splits = [int(m) for m in splits]
        self._joined = dict(joined)
        self._cut = cut
        self._items: Optional[list[Optional[QuantizedTensor]]] = None if experts is None else list(experts)

    # ------------------------------------------------------------------ the sequence
    def experts(self) -> list[Optional[QuantizedTensor]]:
        """The per-expert tensors (built once, then the same objects)."""
        if self._items is None:
            self._items = self._cut(self._joined)
        return self._items

    def __len__(self) -> int:
        return len(self.splits)

    def __getitem__(self, i):  # type: ignore[override]
        return self.experts()[i]

    def __iter__(self) -> Iterator[Optional[QuantizedTensor]]:
        return iter(self.experts())

    @property
    def materialized(self) -> bool:
        """Whether the per-expert tensors were built (diagnostics and tests)."""
        return self._items is not None

    @property
    def joined_only(self) -> bool:
        """Whether every expert is present and every copy it holds is a view of a joined copy
        (the joined-only form): the joined GEMM lanes and the saved record then need nothing
        per expert."""
        return self._cut is not None

    # ------------------------------------------------------------------ joined copies
    def joined(self, direction: str) -> Optional[JoinedCopy]:
        """The experts' ``direction`` copies as one storage, if held so."""
        return self._joined.get(direction)

    def directions(self) -> tuple[str, ...]:
        """The directions every expert holds (an absent expert holds none), rowwise first."""
        return tuple(d for d in DIRECTIONS if self.has_direction(d))

    def has_direction(self, direction: str) -> bool:
        """Whether every expert holds ``direction``'s copy (joined, or its own when built)."""
        if self._cut is not None:
            return direction in self._joined
        return all(t is None or t.has_direction(direction) for t in self._items)

    def drop(self, direction: str) -> None:
        """Drop one direction from every expert (``update_usage(direction=False)`` on each)."""
        if self._cut is not None:
            if direction not in self._joined:
                return
            if len(self._joined) == 1:
                raise ValueError(f"dropping the {direction} copies would leave the experts with no copy at all.")
        self._joined.pop(direction, None)
        if self._items is not None:
            flag = {ROWWISE: "rowwise_usage", COLUMNWISE: "columnwise_usage"}[direction]
            for t in self._items:
                if t is not None:
                    t.update_usage(**{flag: False})

    def select(self, idx: Sequence[int]) -> "GroupedTensor | list[Optional[QuantizedTensor]]":
        """Experts ``idx`` (in order) as a built ``GroupedTensor`` whose joined copies are this
        one's narrowed to their rows, when they are a consecutive run (their groups lie back to
        back in every joined copy); else the list of their tensors.

        Parameters
        ----------
        idx:
            Expert indices, ascending.

        Returns
        -------
        The selected experts."""
        items = self.experts()
        chosen = [items[i] for i in idx]
        if not idx or list(idx) != list(range(idx[0], idx[0] + len(idx))):
            return chosen
        a, b = idx[0], idx[-1] + 1
        joined = {d: _narrowed(j, self.splits, a, b) for d, j in self._joined.items()}
        return GroupedTensor(self.splits[a:b], joined, experts=chosen) if joined else chosen

    @property
    def cutter(self) -> Optional[Cutter]:
        """The function that cuts the per-expert tensors out of joined copies of this layout (to
        rebuild the experts over the saved tensors handed back to backward); None when built."""
        return self._cut


def _narrowed(j: JoinedCopy, splits: Sequence[int], a: int, b: int) -> JoinedCopy:
    """``j`` restricted to experts [a, b): its storage's rows from expert a's group start to
    expert b's (or the end), the starts shifted to it, the experts' ``scales``."""
    starts = j.starts
    if starts is None:
        starts, at = [], 0
        for m in splits:
            starts.append(at)
            at += m
    lo, hi = starts[a], starts[b] if b < len(splits) else j.storage.rows
    storage = j.storage.slice_dim0(lo, hi)
    storage.is_dim0_slice = j.storage.is_dim0_slice  # the experts' copies, not a cut of them
    return JoinedCopy(storage, None if j.starts is None else [s - lo for s in starts[a:b]],
                      None if j.scales is None else j.scales[a:b])
