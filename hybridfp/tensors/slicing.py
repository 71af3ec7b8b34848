"""Views of the leading dims and dim-0 slices of a storage, without re-quantizing.

Mixed into :class:`~hybridfp.tensors.storage.QuantizedStorage`; everything here is derived
from the format's ``_row_index`` table (see the storage module docstring). A proper dim-0
slice is a view: it shares the whole tensor's per-tensor entries (global scale / amax), so
writes into it are refused where they would re-encode those (``check_writable``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from ..formats.common import ceil_div

if TYPE_CHECKING:
    from .storage import QuantizedStorage


class Dim0Slicing:
    """Leading-dim views, dim-0 slices at block boundaries, and the write guard for slices."""

    #: True for a proper dim-0 slice (and its views): it shares the whole tensor's per-tensor
    #: entries (global scale / amax), so writes must not re-encode them.
    is_dim0_slice: bool = False

    def check_leading_view(self, shape: torch.Size | tuple[int, ...]) -> torch.Size:
        """``shape`` if it keeps the last dimension and the element count; else a clear error."""
        shape = torch.Size(shape)
        if len(shape) == 0 or shape[-1] != self.cols or math.prod(shape) != math.prod(self.shape):
            raise ValueError(
                f"{self.describe()} can only be viewed with the same last dimension "
                f"({self.cols}) and element count; got {tuple(shape)}. Dequantize first for "
                "other views."
            )
        return shape

    def view_leading(self, shape: torch.Size | tuple[int, ...]) -> "QuantizedStorage":
        """Same payloads, another leading shape (the last dimension must stay)."""
        return self._new(self.check_leading_view(shape), dict(self.payloads))

    def slice_dim0(self, start: int, stop: int) -> "QuantizedStorage":
        """Entries [start, stop) of dimension 0, without re-quantizing.

        Both ends, in flattened rows, must fall on the format's block boundaries (``stop`` may
        also be the end).
        """
        if len(self.shape) < 2:
            raise ValueError(f"cannot slice {self.describe()} along its last (blocked) dimension; "
                             "dequantize first.")
        n0 = self.shape[0]
        start, stop = max(0, min(start, n0)), max(0, min(stop, n0))
        stop = max(stop, start)
        per = math.prod(self.shape[1:-1])
        r0, r1, rows = start * per, stop * per, self.rows
        payloads = {d: (None if p is None else {n: self._slice_entry(d, n, t, r0, r1, rows)
                                                for n, t in p.items()})
                    for d, p in self.payloads.items()}
        out = self._new(torch.Size((stop - start, *self.shape[1:])), payloads)
        out.is_dim0_slice = self.is_dim0_slice or (start, stop) != (0, n0)
        return out

    def _per_tensor_entries(self) -> list[tuple[str, str]]:
        return [(d, n) for d in self.directions() for n, spec in self._row_index[d].items()
                if spec is None]

    def check_writable(self, src: Optional["QuantizedStorage"] = None) -> None:
        """Refuse a write that would change rows outside a dim-0 slice.

        A slice shares the whole tensor's per-tensor scale / amax: re-encoding the slice with
        another one would change how every other row decodes. Copying a payload whose
        per-tensor entries are bitwise equal (e.g. another slice of the same tensor) is fine.
        """
        entries = self._per_tensor_entries() if self.is_dim0_slice else []
        if src is not None and all(
                torch.equal(self.payloads[d][n], src.payloads[d][n]) for d, n in entries):
            return
        if entries:
            names = sorted({n for _, n in entries})
            raise ValueError(
                f"cannot write into {self.describe()}: it is a dim-0 slice sharing the whole "
                f"tensor's per-tensor {', '.join(names)}, so re-encoding it would change the "
                "other rows. Write the whole tensor, or clone() the slice first.")

    def zero_(self) -> None:
        """Set every value to 0 in place (all-zero codes decode to 0 in every format).

        A dim-0 slice keeps the per-tensor entries it shares with the whole tensor.
        """
        keep = set(self._per_tensor_entries()) if self.is_dim0_slice else set()
        for d in self.directions():
            for n, t in self.payloads[d].items():
                if (d, n) not in keep:
                    t.zero_()

    def row_granularity(self) -> int:
        """Smallest row count at which ``slice_rows`` may cut (lcm of all divisors held)."""
        g = 1
        for d in self.directions():
            for spec in self._row_index[d].values():
                if spec is not None:
                    g = math.lcm(g, spec[1])
        return g

    def _slice_entry(self, d: str, name: str, t: torch.Tensor, start: int, stop: int, rows: int) -> torch.Tensor:
        spec = self._row_index[d][name]
        if spec is None:
            return t
        axis, div = spec
        if start % div or (stop % div and stop != rows):
            raise ValueError(
                f"cannot split {self.describe()} at rows [{start}, {stop}): the {d} copy's "
                f"'{name}' is blocked every {div} rows. Split at multiples of "
                f"{self.row_granularity()} rows, or dequantize first."
            )
        hi = t.shape[axis] if stop == rows else ceil_div(stop, div)
        return t.narrow(axis, start // div, hi - start // div)
