"""Storage of a hybrid tensor: the rowwise copy in one format, the columnwise in another.

It holds two ordinary storages, each with only its own direction: ``rowwise_storage`` (made
by the rowwise quantizer) and ``columnwise_storage`` (made by the columnwise quantizer).
Every generic operation (device moves, slicing, listing tensors) delegates to both, so a
hybrid behaves exactly like its parts.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .storage import (COLUMNWISE, DIRECTIONS, HELD_DIRECTIONS, ROWWISE, MissingDirectionError, QuantizedStorage,
                      check_direction, storage_class)
from .validation import (InvalidStateError, check_keys, check_label, check_nominal_dtype, check_shape,
                         require_dict)

#: Keys of a hybrid's saved state (``to_state``).
HYBRID_STATE_KEYS = ("cls", "shape", "dtype", "label", "parts")


class HybridStorage(QuantizedStorage):
    """Rowwise copy from one storage, columnwise copy from another."""

    format_name = "Hybrid"

    def __init__(
        self,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        rowwise_storage: Optional[QuantizedStorage],
        columnwise_storage: Optional[QuantizedStorage],
        *,
        label: str = "",
        device: torch.device | str | None = None,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.label = label
        self.meta = {}
        # An empty hybrid (a quantizer with both usages off, as TransformerEngine's) has no
        # payload to take its device from: it is given one.
        self._device = None if device is None else torch.device(device)
        if rowwise_storage is None and columnwise_storage is None and device is None:
            raise ValueError(f"{self.describe()} needs at least one of its two copies (or, empty, "
                             "a device).")
        self.parts: dict[str, Optional[QuantizedStorage]] = {
            ROWWISE: rowwise_storage, COLUMNWISE: columnwise_storage}
        for d, part in self.parts.items():
            if part is not None and part.directions() != (d,):
                raise ValueError(f"the {d} part of a hybrid must hold only its {d} copy; "
                                 f"got {part.describe()} holding {part.directions()}.")

    def decoded_directions(self) -> frozenset:
        """The directions whose part holds its copy decoded."""
        return frozenset(d for d, p in self.parts.items() if p is not None and d in p.decoded_directions())

    def with_decoded(self, directions: frozenset) -> "HybridStorage":
        """Each part of ``directions`` held as its BF16 decode (``QuantizedStorage.with_decoded``)."""
        parts = {d: (p.with_decoded(frozenset({d}) & frozenset(directions)) if p is not None else None)
                 for d, p in self.parts.items()}
        if all(parts[d] is self.parts[d] for d in parts):
            return self
        return HybridStorage(self.shape, self.dtype, parts[ROWWISE], parts[COLUMNWISE], label=self.label)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The parts' device; an empty hybrid's own."""
        for p in self.parts.values():
            if p is not None:
                return p.device
        return self._device

    @property
    def rowwise_storage(self) -> Optional[QuantizedStorage]:
        """Storage of the rowwise (forward) copy, or None."""
        return self.parts[ROWWISE]

    @property
    def columnwise_storage(self) -> Optional[QuantizedStorage]:
        """Storage of the columnwise (backward) copy, or None."""
        return self.parts[COLUMNWISE]

    def describe(self) -> str:
        """Format pair, shape and role."""
        names = "/".join(p.format_name if p else "-" for p in self.parts.values())
        role = f" (role: {self.label})" if self.label else ""
        return f"Hybrid[{names}] tensor of shape {tuple(self.shape)}{role}"

    @property
    def payloads(self):  # type: ignore[override]
        """Per-direction payload of the part holding it (read-only view)."""
        return {d: (p.payloads[d] if p is not None else None) for d, p in self.parts.items()}

    @payloads.setter
    def payloads(self, value) -> None:  # pragma: no cover - parts are the source of truth
        raise AttributeError("set the parts of a HybridStorage, not its payloads")

    def part(self, direction: str) -> QuantizedStorage:
        """The storage holding ``direction``; a clear error if it was not produced or dropped."""
        p = self.parts[check_direction(direction)]
        if p is None:
            raise MissingDirectionError(
                f"{self.describe()} holds no {direction} copy (it holds: "
                f"{', '.join(self.directions())}). Quantize with {direction}_usage=True."
            )
        return p

    def has(self, direction: str) -> bool:
        """Whether the part for ``direction`` is held."""
        return self.parts[check_direction(direction)] is not None

    def directions(self) -> tuple[str, ...]:
        """The directions whose part is held, rowwise first."""
        p = self.parts
        return HELD_DIRECTIONS[p[ROWWISE] is not None, p[COLUMNWISE] is not None]

    def _drop(self, direction: str) -> None:
        self.parts[direction] = None

    def to_state(self) -> dict:
        """Both parts' states."""
        parts = {d: (p.to_state() if p is not None else None) for d, p in self.parts.items()}
        return {"cls": "HybridStorage", "shape": tuple(self.shape), "dtype": self.dtype,
                "label": self.label, "parts": parts}

    @classmethod
    def from_state(cls, state: dict) -> "HybridStorage":
        """Rebuild both parts, each by its own (single-format) class; every field is checked.

        Raises
        ------
        InvalidStateError
            A field is missing or of the wrong kind, a part is not a single-format storage
            holding its own direction only, or disagrees with the header (see :meth:`validate`).
        """
        what = "saved Hybrid tensor"
        state = require_dict(state, f"{what} state")
        check_keys(state, HYBRID_STATE_KEYS, f"{what} state")
        saved = require_dict(state["parts"], f"{what} parts")
        check_keys(saved, DIRECTIONS, f"{what} parts")
        parts: dict[str, Optional[QuantizedStorage]] = {}
        for d in DIRECTIONS:
            p = saved[d]
            if p is None:
                parts[d] = None
                continue
            part_cls = storage_class(require_dict(p, f"{what} {d} part").get("cls"), f"{what} {d} part")
            if issubclass(part_cls, HybridStorage):
                raise InvalidStateError(f"{what}: its {d} part is a HybridStorage; a hybrid's parts are "
                                        "single-format storages.")
            parts[d] = part_cls.from_state(p)
        check_shape(state["shape"], what)
        check_nominal_dtype(state["dtype"], what)
        check_label(state["label"], what)
        try:
            out = cls(state["shape"], state["dtype"], parts[ROWWISE], parts[COLUMNWISE], label=state["label"])
        except ValueError as e:  # no part, or a part holding another direction
            raise InvalidStateError(f"{what}: {e}") from e
        out.validate()
        return out

    def validate(self) -> None:
        """The header's fields, and each part: valid itself, of the hybrid's shape, holding
        only its own direction.

        Raises
        ------
        InvalidStateError
            Naming the part and field, what it holds and what was expected.
        """
        what = self.describe()
        check_shape(tuple(self.shape), what)
        check_nominal_dtype(self.dtype, what)
        check_label(self.label, what)
        for d, p in self.row_index_parts.items():
            if p.directions() != (d,):
                raise InvalidStateError(f"{what}: its {d} part holds {list(p.directions())}; expected "
                                        f"only {d}.")
            if p.shape != self.shape:
                raise InvalidStateError(f"{what}: its {d} part has shape {tuple(p.shape)}; expected "
                                        f"{tuple(self.shape)}.")
            p.validate()

    def format_key(self, direction: str) -> tuple:
        """The key of the part holding ``direction``."""
        return self.part(direction).format_key(direction)

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        """A hybrid has no payload of its own; its parts are allocated by their quantizers."""
        raise TypeError("HybridStorage has no payload layout: allocate its two parts (see "
                        "HybridQuantizer.make_empty / HybridStorage.allocate_like).")

    def gemm_operand(self, direction: str):
        """The GEMM view of the part holding ``direction``."""
        return self.part(direction).gemm_operand(direction)

    def decode(self, direction: str) -> torch.Tensor:
        """FP32 [rows, cols] value of one copy."""
        return self.part(direction).decode(direction)

    def preferred_direction(self) -> str:
        """The copy whose format is more precise (rowwise on ties)."""
        held = [d for d in DIRECTIONS if self.has(d)]
        if not held:
            raise MissingDirectionError(
                f"{self.describe()} holds no copy (quantized with rowwise_usage=False and "
                "columnwise_usage=False): it has no value to read. Quantize with the copy you "
                "need (quantizer.set_usage(rowwise=True) or columnwise=True).")
        return max(held, key=lambda d: (self.parts[d].precision_rank, d == ROWWISE))

    @property
    def row_index_parts(self) -> dict[str, QuantizedStorage]:
        """Held parts by direction."""
        return {d: p for d, p in self.parts.items() if p is not None}

    def row_granularity(self) -> int:
        """lcm of the parts' slicing granularities."""
        g = 1
        for p in self.row_index_parts.values():
            g = math.lcm(g, p.row_granularity())
        return g

    def tensors(self) -> list[torch.Tensor]:
        """Rowwise part's tensors, then columnwise part's."""
        return [t for p in self.row_index_parts.values() for t in p.tensors()]

    def split_tensors(self) -> tuple[list[torch.Tensor], "QuantizedStorage"]:
        """The payload tensors and a skeleton holding none of them (own layout: not the slots)."""
        tensors = self.tensors()
        return tensors, self.with_tensors([None] * len(tensors))

    def with_tensors(self, tensors: list[torch.Tensor]) -> "HybridStorage":
        """Same layout, new payload tensors (order of tensors())."""
        if len(tensors) != len(self.tensors()):
            raise ValueError(f"{self.describe()} has {len(self.tensors())} payload tensors; got "
                             f"{len(tensors)}.")
        new: dict[str, Optional[QuantizedStorage]] = {ROWWISE: None, COLUMNWISE: None}
        i = 0
        for d, p in self.row_index_parts.items():
            n = len(p.tensors())
            new[d] = p.with_tensors(tensors[i:i + n])
            i += n
        return HybridStorage(self.shape, self.dtype, new[ROWWISE], new[COLUMNWISE], label=self.label)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor], *, copies: bool = False) -> "HybridStorage":
        """Apply ``fn`` to every tensor of both parts (see QuantizedStorage.map_tensors)."""
        parts = {d: (p.map_tensors(fn, copies=copies) if p else None) for d, p in self.parts.items()}
        return HybridStorage(self.shape, self.dtype, parts[ROWWISE], parts[COLUMNWISE], label=self.label)

    def copy_payload_(self, src: QuantizedStorage) -> None:
        """In-place copy from another hybrid with the same part formats."""
        if not isinstance(src, HybridStorage):
            raise ValueError(f"cannot copy {src.describe()} into {self.describe()} in place.")
        for d, p in self.row_index_parts.items():  # check both parts before writing either
            s = src.part(d)
            if type(s) is not type(p) or s.shape != p.shape or s.meta != p.meta:
                raise ValueError(f"cannot copy {src.describe()} into {self.describe()} in place: "
                                 f"the {d} formats, options or shapes differ.")
            p.check_writable(s)
        for d, p in self.row_index_parts.items():
            p.copy_payload_(src.part(d))

    def check_writable(self, src: Optional[QuantizedStorage] = None) -> None:
        """Both parts must accept the write (see QuantizedStorage.check_writable)."""
        for d, p in self.row_index_parts.items():
            p.check_writable(None if src is None else src.part(d))

    def zero_(self) -> None:
        """Zero both parts."""
        for p in self.row_index_parts.values():
            p.zero_()

    def view_leading(self, shape) -> "HybridStorage":
        """Both parts viewed with another leading shape."""
        shape = self.check_leading_view(shape)
        parts = {d: (p.view_leading(shape) if p else None) for d, p in self.parts.items()}
        return HybridStorage(shape, self.dtype, parts[ROWWISE], parts[COLUMNWISE], label=self.label)

    def slice_dim0(self, start: int, stop: int) -> "HybridStorage":
        """Both parts sliced along dim 0 (block boundaries of both formats)."""
        parts: dict[str, Optional[QuantizedStorage]] = {ROWWISE: None, COLUMNWISE: None}
        for d, p in self.row_index_parts.items():
            try:
                parts[d] = p.slice_dim0(start, stop)
            except ValueError as e:
                # A part only knows its own granularity; the hybrid needs the lcm of both.
                raise ValueError(
                    f"cannot split {self.describe()} at dim-0 entries [{start}, {stop}): its "
                    f"{d} copy ({p.format_name}) is blocked there. Split at multiples of "
                    f"{self.row_granularity()} rows, or dequantize first.") from e
        shape = next(p for p in parts.values() if p is not None).shape
        return HybridStorage(shape, self.dtype, parts[ROWWISE], parts[COLUMNWISE], label=self.label)

    def allocate_like(self, shape: torch.Size, dtype: torch.dtype, fill: Optional[float] = None,
                      device: torch.device | str | None = None) -> "HybridStorage":
        """Empty (or zero) parts of another shape."""
        parts = {d: (p.allocate_like(shape, dtype, fill, device) if p else None)
                 for d, p in self.parts.items()}
        return HybridStorage(shape, dtype, parts[ROWWISE], parts[COLUMNWISE], label=self.label)

    def _new(self, shape, payloads, dtype=None):  # type: ignore[override]
        parts = {d: (p._new(shape, p.payloads, dtype) if p else None) for d, p in self.parts.items()}
        return HybridStorage(shape, dtype or self.dtype, parts[ROWWISE], parts[COLUMNWISE], label=self.label)
