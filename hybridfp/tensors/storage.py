"""Base class of the quantized storages: the encoded rowwise / columnwise copies of a tensor.

A storage holds, per direction, a *payload*: a dict of named tensors (data, scales, global
amax). Everything generic — device moves, cloning, pinning, listing and restoring the tensors
(activation save / offload / FSDP), byte footprint, slicing along the leading dimension at
block boundaries — is done here from two per-format tables, so a new format only says:

- ``_row_index[direction][name]``: how payload tensor ``name`` is indexed by the logical
  leading (row) index: ``(axis, divisor)`` means rows ``r`` live at index ``r // divisor``
  of that axis; ``None`` means the tensor is not indexed by rows (e.g. a per-tensor scale).
- ``_payload_layout(direction, rows, cols)``: shapes and dtypes of an empty payload.
- ``_decode(direction, payload)``: the FP32 [rows, cols] value of one copy, in the tensor's
  original orientation (columnwise copies are stored transposed; the storage undoes that).
"""

from __future__ import annotations

import math
from typing import Callable, ClassVar, Optional

import torch

from ..formats.common import ceil_div

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"
DIRECTIONS = (ROWWISE, COLUMNWISE)

Payload = dict[str, torch.Tensor]
RowIndex = Optional[tuple[int, int]]

#: name -> storage class, so serialized tensors are rebuilt by name (weights_only safe).
STORAGE_REGISTRY: dict[str, type["QuantizedStorage"]] = {}


class MissingDirectionError(RuntimeError):
    """A quantized tensor was asked for a copy (rowwise/columnwise) it does not hold."""


def check_direction(direction: str) -> str:
    """Validate a direction name."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is unknown; use 'rowwise' or 'columnwise'.")
    return direction


class QuantizedStorage:
    """Rowwise and/or columnwise encoded copies of one high-precision tensor of ``shape``.

    ``dtype`` is the nominal (high-precision) dtype: what ``dequantize()`` returns by default.
    ``meta`` holds the format options needed to decode (element dtype, block layout, ...).
    ``label`` names the tensor's role in error messages (set by the quantizer when known).
    """

    format_name: ClassVar[str] = "?"
    #: Precision order used by ``dequantize(direction=None)`` to prefer the better copy.
    precision_rank: ClassVar[int] = 0
    _row_index: ClassVar[dict[str, dict[str, RowIndex]]] = {}
    _meta_defaults: ClassVar[dict[str, object]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        STORAGE_REGISTRY[cls.__name__] = cls

    def __init__(
        self,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        rowwise: Optional[Payload] = None,
        columnwise: Optional[Payload] = None,
        *,
        label: str = "",
        **meta: object,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.label = label
        unknown = set(meta) - set(self._meta_defaults)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown options {sorted(unknown)}.")
        self.meta = {**self._meta_defaults, **meta}
        self.payloads: dict[str, Optional[Payload]] = {ROWWISE: rowwise, COLUMNWISE: columnwise}
        if rowwise is None and columnwise is None:
            raise ValueError(f"{self.describe()} needs at least one of rowwise / columnwise.")

    # ------------------------------------------------------------------ geometry
    @property
    def rows(self) -> int:
        """Flattened leading size (the M of an [M, K] GEMM operand)."""
        return math.prod(self.shape[:-1]) if len(self.shape) > 0 else 1

    @property
    def cols(self) -> int:
        """Last (contiguous) dimension."""
        return self.shape[-1] if len(self.shape) > 0 else 1

    @property
    def device(self) -> torch.device:
        """Device of the payload tensors."""
        return next(iter(self.tensors())).device

    def describe(self) -> str:
        """Short human description for error messages: format, shape and role."""
        role = f" (role: {self.label})" if self.label else ""
        return f"{self.format_name} tensor of shape {tuple(self.shape)}{role}"

    # ------------------------------------------------------------------ directions
    def has(self, direction: str) -> bool:
        """Whether the copy for ``direction`` is held."""
        return self.payloads[check_direction(direction)] is not None

    def directions(self) -> tuple[str, ...]:
        """The directions held, rowwise first."""
        return tuple(d for d in DIRECTIONS if self.has(d))

    def payload(self, direction: str) -> Payload:
        """The encoded tensors of one copy; a clear error if that copy is not held."""
        p = self.payloads[check_direction(direction)]
        if p is None:
            raise MissingDirectionError(
                f"{self.describe()} holds no {direction} copy (it holds: "
                f"{', '.join(self.directions())}). Quantize it with "
                f"{direction}_usage=True (quantizer.set_usage({direction}=True)) if this GEMM "
                f"needs it."
            )
        return p

    def update_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Drop copies no longer needed. Only dropping is possible: adding needs the source."""
        for direction, want in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
            if want and not self.has(direction):
                raise MissingDirectionError(
                    f"Cannot add a {direction} copy to {self.describe()} after quantization: "
                    "the high-precision source is gone. Re-quantize from the source with "
                    f"{direction}_usage=True."
                )
        keep = [d for d, w in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if w is not False]
        if not any(self.has(d) for d in keep):
            raise ValueError(f"update_usage would leave {self.describe()} with no copy at all.")
        for direction, want in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
            if want is False:
                self._drop(direction)

    def _drop(self, direction: str) -> None:
        self.payloads[direction] = None

    # ------------------------------------------------------------------ values
    def dequantize(self, dtype: Optional[torch.dtype] = None, direction: Optional[str] = None) -> torch.Tensor:
        """High-precision value of one copy (default: the more precise one), original shape."""
        if direction is None:
            direction = self.preferred_direction()
        out = self.decode(direction)
        return out.reshape(self.shape).to(dtype or self.dtype)

    def preferred_direction(self) -> str:
        """The held copy with the highest precision (rowwise on ties)."""
        return self.directions()[0]

    def decode(self, direction: str) -> torch.Tensor:
        """FP32 [rows, cols] value of one copy, original orientation."""
        return self._decode(direction, self.payload(direction))

    def _decode(self, direction: str, payload: Payload) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define _decode")

    @classmethod
    def _payload_layout(
        cls, direction: str, rows: int, cols: int, meta: dict[str, object]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError(f"{cls.__name__} must define _payload_layout")

    # ------------------------------------------------------------------ construction
    @classmethod
    def allocate(
        cls,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None,
        directions: tuple[str, ...],
        *,
        label: str = "",
        fill: Optional[float] = None,
        **meta: object,
    ) -> "QuantizedStorage":
        """An uninitialized (or ``fill``-ed) storage with the payload shapes of ``shape``."""
        shape = torch.Size(shape)
        rows = math.prod(shape[:-1]) if len(shape) else 1
        cols = shape[-1] if len(shape) else 1
        full_meta = {**cls._meta_defaults, **meta}
        payloads: dict[str, Optional[Payload]] = {}
        for d in DIRECTIONS:
            if d not in directions:
                payloads[d] = None
                continue
            layout = cls._payload_layout(d, rows, cols, full_meta)
            payloads[d] = {
                n: (torch.empty(s, dtype=t, device=device) if fill is None
                    else torch.zeros(s, dtype=t, device=device))
                for n, (s, t) in layout.items()
            }
        return cls(shape, dtype, payloads[ROWWISE], payloads[COLUMNWISE], label=label, **meta)

    def allocate_like(self, shape: torch.Size, dtype: torch.dtype, fill: Optional[float] = None) -> "QuantizedStorage":
        """An empty (or zero) storage of another shape with this one's format and directions."""
        return type(self).allocate(shape, dtype, self.device, self.directions(), label=self.label,
                                   fill=fill, **self.meta)

    def _new(self, shape: torch.Size, payloads: dict[str, Optional[Payload]], dtype: Optional[torch.dtype] = None) -> "QuantizedStorage":
        return type(self)(shape, dtype or self.dtype, payloads[ROWWISE], payloads[COLUMNWISE],
                          label=self.label, **self.meta)

    # ------------------------------------------------------------------ tensor plumbing
    def tensors(self) -> list[torch.Tensor]:
        """Every payload tensor, in a fixed order (rowwise first, then by name)."""
        out = []
        for d in self.directions():
            p = self.payloads[d]
            out.extend(p[n] for n in sorted(p))
        return out

    def with_tensors(self, tensors: list[torch.Tensor]) -> "QuantizedStorage":
        """A storage of the same layout whose payload tensors are ``tensors`` (order of tensors())."""
        it = iter(tensors)
        payloads: dict[str, Optional[Payload]] = {}
        for d in DIRECTIONS:
            p = self.payloads[d]
            payloads[d] = None if p is None else {n: next(it) for n in sorted(p)}
        return self._new(self.shape, payloads)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedStorage":
        """A new storage with ``fn`` applied to every payload tensor (clone, to(device), ...)."""
        return self.with_tensors([fn(t) for t in self.tensors()])

    def copy_payload_(self, src: "QuantizedStorage") -> None:
        """In-place copy of another storage's payloads (same class, shape and directions)."""
        if type(src) is not type(self) or src.shape != self.shape or src.meta != self.meta:
            raise ValueError(f"cannot copy {src.describe()} into {self.describe()} in place: "
                             "formats, options or shapes differ.")
        for d in self.directions():
            if not src.has(d):
                raise MissingDirectionError(f"copy_ source {src.describe()} lacks the {d} copy "
                                            f"that {self.describe()} holds.")
            for n, t in self.payloads[d].items():
                t.copy_(src.payloads[d][n])

    def nbytes(self) -> int:
        """True memory footprint of the payloads (shared tensors counted once)."""
        seen: dict[tuple[int, int], int] = {}
        for t in self.tensors():
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return sum(seen.values())

    def view_leading(self, shape: torch.Size | tuple[int, ...]) -> "QuantizedStorage":
        """Same payloads, another leading shape (the last dimension must stay)."""
        shape = torch.Size(shape)
        if len(shape) == 0 or shape[-1] != self.cols or math.prod(shape) != math.prod(self.shape):
            raise ValueError(
                f"{self.describe()} can only be viewed with the same last dimension "
                f"({self.cols}) and element count; got {tuple(shape)}. Dequantize first for "
                "other views."
            )
        return self._new(shape, dict(self.payloads))

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
        payloads: dict[str, Optional[Payload]] = {}
        for d in DIRECTIONS:
            p = self.payloads[d]
            payloads[d] = None if p is None else {
                n: self._slice_entry(d, n, t, r0, r1, rows) for n, t in p.items()}
        return self._new(torch.Size((stop - start, *self.shape[1:])), payloads)

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
