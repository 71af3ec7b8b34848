"""Reading the experts' joined copies (``GroupedTensor.joined``, ``moe/grouped_tensor.py``).

The grouped GEMM paths take a joined copy in a few forms, checked here on the copy's format
(its payload row-index table), never on the experts' addresses: back-to-back rowwise rows
(``joined_row_storage``), rowwise rows at padded group starts (``padded_row_span``), columnwise
copies of the zero-padded groups side by side (``joined_column_storage``). ``joined_of`` gives
an operand's joined copy: a plain list of experts (each quantized on its own) has none.

``column_slices``: column slices of one tensor in one op.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..tensors.storage import COLUMNWISE, ROWWISE, QuantizedStorage
from .grouped_tensor import GroupedTensor, JoinedCopy


def column_slices(t: torch.Tensor, begins: Sequence[int], widths: Sequence[int]) -> list[torch.Tensor]:
    """Columns [begin_e, begin_e + width_e) of 2D ``t`` for every e (in order, not overlapping)
    as views, from one ``split`` over the slices and the gaps between them (one op for all MoE
    experts instead of a ``narrow`` each)."""
    sizes, at = [], 0
    for b, w in zip(begins, widths):
        sizes += [b - at, w]
        at = b + w
    sizes.append(t.shape[1] - at)
    return list(torch.split(t, sizes, dim=1)[1::2])


# ---------------------------------------------------------------------------- a GroupedTensor's joined copies
def joined_of(ts: Sequence, direction: str) -> Optional[JoinedCopy]:
    """``ts``'s joined ``direction`` copy when ``ts`` is a ``GroupedTensor`` holding one (its
    producer states it); None for a list (separately quantized experts are never joined)."""
    return ts.joined(direction) if isinstance(ts, GroupedTensor) else None


def joined_row_storage(j: Optional[JoinedCopy], direction: str, splits: Sequence[int],
                       single_rows: bool = True) -> Optional[QuantizedStorage]:
    """``j``'s storage when it holds the experts' rowwise copies back to back (no padding between
    the groups; no per-expert ``scales``), with every payload tensor contiguous and indexed by
    rows: by single rows (``single_rows``: per-row scales included) or by blocks of rows that
    every expert fills whole (the experts' joined weights). None otherwise."""
    if j is None or direction != ROWWISE or j.scales is not None or not _unpadded(j, splits):
        return None
    s = j.storage.part(ROWWISE)
    index = s._row_index[ROWWISE]
    if s.rows == 0:
        return None
    for name, t in s.payload(ROWWISE).items():
        spec = index.get(name)
        if spec is None or spec[0] != 0 or not t.is_contiguous():
            return None
        if spec[1] != 1 and (single_rows or any(m % spec[1] for m in splits)):
            return None
    return s


def padded_row_span(j: Optional[JoinedCopy], direction: str) -> Optional[tuple[QuantizedStorage, list[int]]]:
    """(``j``'s storage, each expert's first row in it) when it holds the experts' rowwise
    copies at padded group starts (a rowwise copy of the zero-padded groups; the rows between
    the groups are padding rows the callers skip), every payload tensor contiguous and indexed
    by single rows. None otherwise."""
    if j is None or direction != ROWWISE or j.scales is not None or j.starts is None:
        return None
    s = j.storage.part(ROWWISE)
    index = s._row_index[ROWWISE]
    if any(index.get(n) != (0, 1) or not t.is_contiguous() for n, t in s.payload(ROWWISE).items()):
        return None
    return s, list(j.starts)


def joined_column_storage(j: Optional[JoinedCopy], direction: str) -> Optional[tuple[QuantizedStorage, list[int]]]:
    """(``j``'s storage, each expert's group start in it) when it holds the experts' columnwise
    copies of the zero-padded groups side by side (every payload tensor indexed by columns; no
    per-expert ``scales``). None otherwise (a BF16 Identity copy: the rows, read transposed)."""
    if j is None or direction != COLUMNWISE or j.scales is not None or j.starts is None:
        return None
    s = j.storage.part(COLUMNWISE)
    index = s._row_index[COLUMNWISE]
    if s.rows == 0 or any(index.get(n) is None or index[n][0] != 1 for n in s.payload(COLUMNWISE)):
        return None
    return s, list(j.starts)


def _unpadded(j: JoinedCopy, splits: Sequence[int]) -> bool:
    """Whether ``j``'s groups lie back to back: no starts, or starts at the splits' prefix sums."""
    if j.starts is None:
        return True
    at = 0
    for s, m in zip(j.starts, splits):
        if s != at:
            return False
        at += m
    return j.storage.rows == at
