"""Base class of the quantized storages: the encoded rowwise / columnwise copies of a tensor.

A storage holds, per direction, a *payload*: a dict of named tensors (data, scales, global
amax). Everything generic — device moves, cloning, pinning, listing and restoring the tensors
(activation save / offload / FSDP), byte footprint, slicing along the leading dimension at
block boundaries — is done here from two per-format tables, so a new format only says:

- ``_row_index[direction][name]``: how payload tensor ``name`` is indexed by the logical
  leading (row) index: ``(axis, divisor)`` means rows ``r`` live at index ``r // divisor``
  of that axis; ``None`` means the tensor is not indexed by rows (e.g. a per-tensor scale).
- ``_payload_layout(direction, rows, cols)``: shapes and dtypes of an empty payload.
- ``gemm_operand(direction)``: one copy as a GEMM reads it (block-decoded FP32 values in the
  stored orientation, plus the global scale); ``decode`` / ``dequantize`` derive the value in
  the original orientation from it (columnwise copies are stored transposed).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch

from ..formats import rht
from .slicing import Dim0Slicing
from .validation import (InvalidStateError, check_keys, check_label, check_nominal_dtype, check_option,
                         check_payload_tensor, check_shape, require_dict)

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"
DIRECTIONS = (ROWWISE, COLUMNWISE)
#: (rowwise held, columnwise held) -> the directions held, rowwise first
HELD_DIRECTIONS: dict[tuple[bool, bool], tuple[str, ...]] = {
    (r, c): tuple(d for d, held in ((ROWWISE, r), (COLUMNWISE, c)) if held)
    for r in (False, True) for c in (False, True)}

Payload = dict[str, torch.Tensor]
RowIndex = Optional[tuple[int, int]]

#: name -> storage class, so serialized tensors are rebuilt by name (weights_only safe).
STORAGE_REGISTRY: dict[str, type["QuantizedStorage"]] = {}


class MissingDirectionError(RuntimeError):
    """A quantized tensor was asked for a copy (rowwise/columnwise) it does not hold.

    Raised when a GEMM or ``dequantize(direction=...)`` reads a copy that was not made
    (quantize with that usage flag on), when ``update_usage`` is asked to add a copy, and
    when ``Quantizer.update_quantized`` selects a copy its destination lacks. The message
    names the tensor, the copies it holds and the fix. A ``RuntimeError``.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> t = hf.MXFP8Quantizer(rowwise=False)(torch.ones(32, 32))
    >>> try:
    ...     t.dequantize(direction="rowwise")
    ... except hf.MissingDirectionError as e:
    ...     print("no rowwise copy")
    no rowwise copy
    """


#: FP8 element dtypes a format option may name.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Keys of a single-format storage's saved state (``to_state``).
STATE_KEYS = ("cls", "shape", "dtype", "label", "meta", "payloads")


def storage_class(name: object, what: str = "saved quantized tensor") -> type["QuantizedStorage"]:
    """The concrete storage class a saved state names (by its registered class name).

    Raises
    ------
    InvalidStateError
        ``name`` is not the name of a concrete registered storage class.
    """
    cls = STORAGE_REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None or cls.format_name == "?":  # "?": an abstract base (no format of its own)
        known = sorted(n for n, c in STORAGE_REGISTRY.items() if c.format_name != "?")
        raise InvalidStateError(f"{what}: field 'cls' = {name!r} is not a known storage class; expected "
                                f"one of {known}.")
    return cls


def check_direction(direction: str) -> str:
    """Validate a direction name."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is unknown; use 'rowwise' or 'columnwise'.")
    return direction


class QuantizedStorage(Dim0Slicing, ABC):
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
    #: The values an option may take (checked on load); options absent here take any value of
    #: their default's kind (a bool, a positive int).
    _meta_choices: ClassVar[dict[str, tuple]] = {}
    #: Sharing structure handed on by ``with_tensors`` (None: read it from the payloads).
    _slot_groups: Optional[list[list[tuple[str, str]]]] = None
    #: True when each row of every columnwise payload tensor continues in memory with zero
    #: codes up to its width rounded up to 16 (``moe.quantize_scaled``'s FP8 experts,
    #: each transpose [C, m_e] a column slice of one [C, Σ padded m] matrix): the copy
    #: zero-padded along its reduction is a view, which the FP8 wgrads read instead of making
    #: a padded copy. Kept by ``with_tensors`` only (same layout; saved-for-backward round
    #: trips), never by slicing or other rebuilds, which would break that promise.
    columnwise_zero_tail: bool = False

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
        """Device of the payload tensors (all on one device; the first held one's). Read on
        every GEMM and quantize of every expert: no slot bookkeeping here."""
        for p in self.payloads.values():
            if p:
                return next(iter(p.values())).device
        raise AssertionError(f"{self.describe()} holds no payload tensor")

    def describe(self) -> str:
        """Short human description for error messages: format, shape and role."""
        role = f" (role: {self.label})" if self.label else ""
        return f"{self.format_name} tensor of shape {tuple(self.shape)}{role}"

    # ------------------------------------------------------------------ directions
    def has(self, direction: str) -> bool:
        """Whether the copy for ``direction`` is held."""
        try:
            return self.payloads[direction] is not None
        except KeyError:
            check_direction(direction)  # the clear error
            raise

    def directions(self) -> tuple[str, ...]:
        """The directions held, rowwise first. (A subclass holding its copies elsewhere than
        ``payloads`` overrides ``has`` and this alike.)"""
        # no Python call per direction: an MoE layer asks this of every expert's storage per GEMM
        p = self.payloads
        return HELD_DIRECTIONS[p[ROWWISE] is not None, p[COLUMNWISE] is not None]

    def payload(self, direction: str) -> Payload:
        """The encoded tensors of one copy; a clear error if that copy is not held."""
        p = self.payloads.get(direction)
        if p is None:
            check_direction(direction)
            raise MissingDirectionError(
                f"{self.describe()} holds no {direction} copy (it holds: "
                f"{', '.join(self.directions())}). Quantize it with "
                f"{direction}_usage=True (quantizer.set_usage({direction}=True)) if this GEMM "
                f"needs it."
            )
        return p

    def unallocated(self, direction: str) -> bool:
        """Whether a payload tensor of the held ``direction`` copy has no memory (FSDP2 frees an
        all-gathered weight's memory between gathers): reading it would crash, not raise."""
        return any(t.numel() and t.untyped_storage().nbytes() == 0
                   for t in self.part(direction).payloads[direction].values())

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

    def to_state(self) -> dict:
        """Plain data (names, shapes, dtypes, tensors) describing this storage, for saving."""
        return {"cls": type(self).__name__, "shape": tuple(self.shape), "dtype": self.dtype,
                "label": self.label, "meta": dict(self.meta),
                "payloads": {d: (dict(self.payloads[d]) if self.has(d) else None) for d in DIRECTIONS}}

    @classmethod
    def from_state(cls, state: dict) -> "QuantizedStorage":
        """Inverse of :meth:`to_state`, for a state read from a file: every field is checked.

        Raises
        ------
        InvalidStateError
            A field is missing, of the wrong kind, or disagrees with the header or the format
            (see :meth:`validate`).
        """
        p = cls._checked_state(state)
        out = cls(state["shape"], state["dtype"], p[ROWWISE], p[COLUMNWISE], label=state["label"],
                  **state["meta"])
        out.validate()
        return out

    @classmethod
    def _checked_state(cls, state: object) -> dict:
        """The payloads of a saved state whose keys, header and option names are checked (what
        the constructor needs before :meth:`validate` can look at the rest)."""
        what = f"saved {cls.format_name} tensor"
        state = require_dict(state, f"{what} state")
        check_keys(state, STATE_KEYS, f"{what} state")
        check_shape(state["shape"], what)
        check_nominal_dtype(state["dtype"], what)
        check_label(state["label"], what)
        meta = require_dict(state["meta"], f"{what} options")
        unknown = sorted(str(k) for k in meta if k not in cls._meta_defaults)
        if unknown:
            raise InvalidStateError(f"{what}: unknown options {unknown}; {cls.format_name} takes "
                                    f"{sorted(cls._meta_defaults)}.")
        payloads = require_dict(state["payloads"], f"{what} payloads")
        check_keys(payloads, DIRECTIONS, f"{what} payload directions")
        if all(payloads[d] is None for d in DIRECTIONS):
            raise InvalidStateError(f"{what} holds no payload: at least one of {list(DIRECTIONS)} is needed.")
        for d in DIRECTIONS:
            if payloads[d] is not None:
                require_dict(payloads[d], f"{what} {d} payload")
        return payloads

    def validate(self) -> None:
        """Check that every field agrees with the others and with the format: nominal dtype,
        label, known option values, and per held copy the payload names, tensor kinds, shapes
        and dtypes the header shape and options imply, all on one device.

        Raises
        ------
        InvalidStateError
            Naming the field, what it holds and what was expected.
        """
        what = self.describe()
        check_shape(tuple(self.shape), what)
        check_nominal_dtype(self.dtype, what)
        check_label(self.label, what)
        for name, default in self._meta_defaults.items():
            check_option(name, self.meta[name], default, self._meta_choices.get(name), what)
        self._check_options()
        devices = set()
        for d in self.directions():
            p = require_dict(self.payloads[d], f"{what}: {d} payload")
            expected = self.expected_payload(d)
            check_keys(p, expected, f"{what}: {d} payload")
            for name, (shape, dtypes) in expected.items():
                check_payload_tensor(p[name], name, d, shape, dtypes, what)
                devices.add(p[name].device)
        if len(devices) > 1:
            raise InvalidStateError(f"{what}: payload tensors lie on several devices {sorted(map(str, devices))}; "
                                    "expected one.")

    def _check_options(self) -> None:
        """Combinations of options the format does not make (a hook; each option alone is
        checked by :meth:`validate`)."""

    def expected_payload(self, direction: str) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        """Payload name -> (shape, allowed dtypes) of the ``direction`` copy for this header."""
        layout = self._payload_layout(direction, self.rows, self.cols, self.meta)
        return {n: (tuple(s), (t,)) for n, (s, t) in layout.items()}

    def decoded_directions(self) -> frozenset:
        """The directions whose copies this storage holds as BF16 decodes (``tensors.decoded``)."""
        return frozenset()

    def column_group_block(self) -> int:
        """Rows per block of the columnwise copy: zero-padded row groups (``quantize_grouped``)
        are padded to a multiple of it (the largest row divisor of its payload tensors)."""
        return max((v[1] for v in self._row_index[COLUMNWISE].values() if v is not None), default=1)

    def with_decoded(self, directions: frozenset) -> "QuantizedStorage":
        """This storage with its copies of ``directions`` held as their BF16 decodes
        (``tensors.decoded``, the reference decode): itself where none of them is held; a
        single-format storage converts all of its copies or none (a hybrid, part by part)."""
        from .decoded import DecodedStorage  # decoded.py builds on this module
        held = set(self.directions())
        if not held & set(directions):
            return self
        if not held <= set(directions):
            raise ValueError(f"{self.describe()} holds {sorted(held)}: one storage cannot hold only its "
                             f"{sorted(held & set(directions))} copies decoded.")
        return DecodedStorage.of(self)

    def part(self, direction: str) -> "QuantizedStorage":
        """The single-format storage holding ``direction`` (itself; hybrids return a part)."""
        self.payload(direction)  # raises MissingDirectionError naming direction and role
        return self

    # ------------------------------------------------------------------ GEMM view
    @classmethod
    def key_for(cls, direction: str, meta: dict[str, object]) -> tuple:
        """Format key of one copy: GEMM backends are looked up by a pair of these."""
        return (cls.format_name, tuple(sorted(meta.items())))

    def format_key(self, direction: str) -> tuple:
        """Format key of this storage's ``direction`` copy."""
        return type(self).key_for(direction, self.meta)

    @abstractmethod
    def gemm_operand(self, direction: str) -> "GemmOperand":
        """The ``direction`` copy as a GEMM reads it (see :class:`GemmOperand`)."""

    def has_epilogue_scale(self, direction: str) -> bool:
        """Whether ``gemm_operand(direction)`` carries a per-tensor / per-row ``scale`` for the
        GEMM's epilogue (known from the format, without decoding)."""
        return False

    def epilogue_scale(self, direction: str) -> Optional[torch.Tensor]:
        """The ``scale`` that ``gemm_operand(direction)`` (and its BF16 decode) carries for the
        epilogue, without decoding the values (None: no factor)."""
        self.payload(direction)  # the clear error if the copy is not held
        return None

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """None if the ``direction`` copy's block-decoded values (``gemm_operand(direction).values``)
        are all exactly representable in BF16, so a BF16 tensor-core GEMM with FP32 accumulation
        computes the exact product; otherwise why not (formats opt in by overriding)."""
        return f"{self.format_name} values have no exact BF16 decode"

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
        """FP32 [rows, cols] value of one copy, original orientation: the GEMM view with its
        global scale applied (and, for an RHT copy, the transform undone) — one definition of
        dequantization per format, shared with the GEMM path."""
        op = self.gemm_operand(direction)
        v = op.values
        if op.scale is not None:
            v = v * (op.scale.reshape(-1, 1) if op.scale.dim() else op.scale)
        if op.rht:
            v = rht.apply_inverse_rht(v, op.k)
        return v if direction == ROWWISE else v.t()

    @classmethod
    @abstractmethod
    def _payload_layout(
        cls, direction: str, rows: int, cols: int, meta: dict[str, object]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of an empty payload of ``direction`` for a [rows, cols] tensor."""

    @classmethod
    def _shared_names(cls, meta: dict[str, object]) -> frozenset[str]:
        """Payload names both copies hold as one tensor (e.g. a per-tensor scale)."""
        return frozenset()

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
        shared = cls._shared_names(full_meta)  # one tensor for both copies, as quantize makes
        payloads: dict[str, Optional[Payload]] = {}
        for d in DIRECTIONS:
            if d not in directions:
                payloads[d] = None
                continue
            layout = cls._payload_layout(d, rows, cols, full_meta)
            payloads[d] = {
                n: (payloads[ROWWISE][n] if d == COLUMNWISE and payloads[ROWWISE] and n in shared
                    else torch.empty(s, dtype=t, device=device) if fill is None
                    else torch.zeros(s, dtype=t, device=device))
                for n, (s, t) in layout.items()
            }
        return cls(shape, dtype, payloads[ROWWISE], payloads[COLUMNWISE], label=label, **meta)

    def allocate_like(self, shape: torch.Size, dtype: torch.dtype, fill: Optional[float] = None,
                      device: torch.device | str | None = None) -> "QuantizedStorage":
        """An empty (or zero) storage of another shape with this one's format and directions."""
        return type(self).allocate(shape, dtype, device or self.device, self.directions(),
                                   label=self.label, fill=fill, **self.meta)

    def _new(self, shape: torch.Size, payloads: dict[str, Optional[Payload]], dtype: Optional[torch.dtype] = None) -> "QuantizedStorage":
        out = type(self)(shape, dtype or self.dtype, payloads[ROWWISE], payloads[COLUMNWISE],
                         label=self.label, **self.meta)
        out.is_dim0_slice = self.is_dim0_slice
        return out

    # ------------------------------------------------------------------ tensor plumbing
    def _tensor_slots(self) -> list[list[tuple[str, str]]]:
        """Payload slots (direction, name) grouped by the tensor they hold, in tensors() order.

        ``with_tensors`` hands the grouping on, so a skeleton built from None entries (as
        pack() does to save the tensors for backward separately) keeps its source's sharing.
        """
        groups = self._slot_groups
        if groups is None:
            by_id: dict[int, list[tuple[str, str]]] = {}
            for d in self.directions():
                p = self.payloads[d]
                for n in sorted(p):
                    by_id.setdefault(id(p[n]), []).append((d, n))
            # not cached on the storage: the extra container per storage makes Python's cyclic
            # GC cost more than the recomputation (MoE, 64 experts: ~20 ms a step on the CPU)
            groups = list(by_id.values())
        payloads = self.payloads
        held = [[(d, n) for d, n in g if payloads[d] is not None] for g in groups]
        return [g for g in held if g]

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct payload tensor once, in a fixed order (rowwise first, then by name).

        A tensor shared by both copies (e.g. FP8's per-tensor ``scale_inv``) is listed once, so
        offloading or cloning the list keeps it shared and the footprint unchanged.
        """
        return [self.payloads[g[0][0]][g[0][1]] for g in self._tensor_slots()]

    def split_tensors(self) -> tuple[list[torch.Tensor], "QuantizedStorage"]:
        """``(self.tensors(), self.with_tensors([None] * n))`` with the slots worked out once: the
        payload tensors and a skeleton holding none of them (what autograd saves for backward)."""
        groups = self._tensor_slots()
        tensors = [self.payloads[g[0][0]][g[0][1]] for g in groups]
        return tensors, self._with_groups(groups, [None] * len(groups))

    def shallow_copy(self) -> "QuantizedStorage":
        """A new storage object holding the same payload tensors: dropping a copy from one
        (``update_usage``) leaves the other's intact."""
        return self.with_tensors(self.tensors())

    def with_tensors(self, tensors: list[torch.Tensor]) -> "QuantizedStorage":
        """A storage of the same layout whose payload tensors are ``tensors`` (order of tensors())."""
        return self._with_groups(self._tensor_slots(), tensors)

    def _with_groups(self, groups: list[list[tuple[str, str]]], tensors: list) -> "QuantizedStorage":
        if len(tensors) != len(groups):
            raise ValueError(f"{self.describe()} has {len(groups)} payload tensors; got {len(tensors)}.")
        payloads: dict[str, Optional[Payload]] = {d: ({} if self.has(d) else None) for d in DIRECTIONS}
        for g, t in zip(groups, tensors):
            for d, n in g:
                payloads[d][n] = t
        out = self._new(self.shape, payloads)
        out._slot_groups = groups
        out.columnwise_zero_tail = self.columnwise_zero_tail
        return out

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor], *, copies: bool = False) -> "QuantizedStorage":
        """A new storage with ``fn`` applied to every payload tensor (clone, to(device), ...).

        Distinct tensors that alias the same memory (a contiguous transpose of a 1-row tensor
        is the tensor itself) stay aliased, so ``fn`` never changes the footprint.
        ``copies=True`` says ``fn`` returns new memory: the result owns all of its tensors, so
        it is no longer a dim-0 slice of a larger tensor.
        """
        done: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        out = []
        for t in self.tensors():
            key = (t.data_ptr(), t.numel(), t.dtype) if t.numel() and t.is_contiguous() else None
            prev = done.get(key) if key else None
            if prev is not None and prev.is_contiguous():
                out.append(prev.view(t.shape))
            else:
                out.append(fn(t))
                if key:
                    done.setdefault(key, out[-1])
        result = self.with_tensors(out)
        result.is_dim0_slice = self.is_dim0_slice and not copies
        # new memory holds only each tensor's own elements: no zero tail past a row's end
        result.columnwise_zero_tail = self.columnwise_zero_tail and not copies
        return result

    def copy_payload_(self, src: "QuantizedStorage") -> None:
        """In-place copy of another storage's payloads (same class, shape and directions)."""
        if type(src) is not type(self) or src.shape != self.shape or src.meta != self.meta:
            raise ValueError(f"cannot copy {src.describe()} into {self.describe()} in place: "
                             "formats, options or shapes differ.")
        for d in self.directions():
            if not src.has(d):
                raise MissingDirectionError(f"copy_ source {src.describe()} lacks the {d} copy "
                                            f"that {self.describe()} holds.")
        self.check_writable(src)
        for d in self.directions():
            for n, t in self.payloads[d].items():
                t.copy_(src.payloads[d][n])

    def nbytes(self) -> int:
        """True memory footprint of the payloads (shared tensors counted once)."""
        seen: dict[tuple[int, int], int] = {}
        for t in self.tensors():
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return sum(seen.values())


@dataclass
class GemmOperand:
    """One copy of a tensor as a GEMM reads it: stored orientation [m, k_stored], reduction
    along the last dim. ``values`` are block-decoded in FP32 (exact: element × block scale);
    ``scale`` is the remaining per-tensor (0-d) or per-row ([m]) decode factor that a GEMM
    applies in its epilogue (None = 1). ``rht``: the values are random-Hadamard transformed
    along k (``k_stored`` is then k padded to 16); ``k`` is the logical reduction length."""

    values: torch.Tensor
    scale: Optional[torch.Tensor]
    k: int
    rht: bool = False
