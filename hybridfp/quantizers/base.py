"""Quantizer base class: usage flags, the straight-through ``quantize``, empty/in-place helpers.

A quantizer turns a high-precision tensor into a :class:`QuantizedTensor` holding only the
copies its usage flags ask for (``rowwise_usage`` for the forward GEMM operand,
``columnwise_usage`` for the transposed/backward one). Each format subclass implements
``encode(x, rowwise, columnwise) -> storage``; the rest is shared.
"""

from __future__ import annotations

import copy as _copy
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from ..formats.common import check_input
from ..tensors import QuantizedStorage, QuantizedTensor
from .backends import select_quantize_kernel
from ..tensors.storage import COLUMNWISE, ROWWISE, MissingDirectionError, check_direction


def all_reduce_amax(amax: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """All-reduce (MAX) ``amax`` in place over ``group`` so every rank uses the same scale.

    A ``group`` with a ``reduce_amax(amax)`` method stands for an amax already reduced
    elsewhere (FSDP2's quantized primary weights: one coalesced all-reduce for every weight,
    ``integration/fsdp_primary.py``); it writes that amax into ``amax`` and returns it."""
    reduce = getattr(group, "reduce_amax", None)
    if reduce is not None:
        return reduce(amax)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def reduce_pending_amaxes(quantizers: list["Quantizer"], group: Any) -> int:
    """All-reduce (MAX) the pending amaxes of ``quantizers`` over ``group`` in one collective
    per device, in place, so their ``finish_step(None)`` then updates from the global amaxes
    (TransformerEngine coalesces the region-end reduction the same way). NaN becomes Inf
    first: a MAX reduction's NaN handling varies by backend, Inf's does not, so every rank
    sees the non-finite amax and skips the same step.

    Parameters
    ----------
    quantizers:
        The quantizers finishing a step (each counted once; order must match across ranks).
    group:
        The process group.

    Returns
    -------
    int
        The number of all-reduces issued (one per device holding pending amaxes, else 0).
    """
    seen, slots = set(), []
    for q in quantizers:
        if id(q) not in seen:
            seen.add(id(q))
            slots.extend(q.pending_amaxes())
    by_device: dict = {}
    for t in slots:
        by_device.setdefault(t.device, []).append(t)
    for ts in by_device.values():
        flat = torch.cat([t.reshape(-1) for t in ts]).float()
        flat = torch.where(torch.isnan(flat), torch.full_like(flat, math.inf), flat)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
    return len(by_device)


def check_state_keys(q: "Quantizer", state: dict, want: dict[str, Any]) -> None:
    """Check a state handed to ``q.set_state`` against the entries ``q`` keeps (``want``: name
    -> current value): the same keys, and tensors of the same shape and dtype.

    Raises
    ------
    ValueError
        Naming the quantizer (and role), and the missing / unexpected keys or the mismatching
        tensor.
    """
    who = f"{type(q).__name__}" + (f" (role: {q.label})" if q.label else "")
    if not isinstance(state, dict):
        raise ValueError(f"{who}.set_state: needs a dict from get_state(); got {type(state).__name__}.")
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{who}.set_state: the state does not match this quantizer: missing keys "
                         f"{missing}, unexpected keys {unexpected}.")
    for name, cur in want.items():
        new = state[name]
        if torch.is_tensor(cur):
            if not torch.is_tensor(new) or new.shape != cur.shape or new.dtype != cur.dtype:
                got = (f"{tuple(new.shape)} {new.dtype}" if torch.is_tensor(new) else type(new).__name__)
                raise ValueError(f"{who}.set_state: {name!r} must be a tensor of shape {tuple(cur.shape)} "
                                 f"and dtype {cur.dtype} (this quantizer's settings); got {got}.")
        elif type(new) is not type(cur):
            raise ValueError(f"{who}.set_state: {name!r} must be a {type(cur).__name__}; got "
                             f"{type(new).__name__}.")


class _QuantizeSTE(torch.autograd.Function):
    """Quantize in forward; pass the gradient straight through in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantizer: "Quantizer") -> QuantizedTensor:  # type: ignore[override]
        return quantizer._quantize_no_grad(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if isinstance(grad, QuantizedTensor):
            grad = grad.dequantize()
        return grad, None


class Quantizer(ABC):
    """Base of every quantizer. Subclasses set ``storage_cls`` and implement ``reference_encode``.

    A quantizer is called like a function: ``q(x)`` is ``q.quantize(x)``.

    Parameters
    ----------
    rowwise:
        Make the rowwise copy (the forward GEMM operand) on ``quantize``.
    columnwise:
        Make the columnwise copy (the transposed, backward GEMM operand) on ``quantize``.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> q = hf.MXFP8Quantizer(columnwise=False)
    >>> q(torch.randn(32, 64)).directions()
    ('rowwise',)
    """

    storage_cls: ClassVar[type[QuantizedStorage]]
    #: Short format name used in reports and error messages.
    format_name: ClassVar[str] = "?"
    #: Whether running the PyTorch reference on a GPU is a slow fallback worth reporting
    #: (False for the passthrough and for the hybrid, whose children report themselves).
    has_fast_kernels: ClassVar[bool] = True
    #: Whether quantizing uses an amax recorded by the kernel that wrote the input
    #: (``hybridfp.tensors.known_amax``) instead of its own amax pass; modules tell the autocast
    #: region, so kernels that can record one (the fused SwiGLU) do it only where it is read.
    reads_known_amax: ClassVar[bool] = False
    _hold_decoded: frozenset = frozenset()  # see ``hold_decoded`` (a class default for subclasses' own __init__)

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        #: The slot this quantizer serves (a QuantizerRole or None), set by recipes.
        self.role: Optional[Any] = None

    # ------------------------------------------------------------------ decoded copies
    def decodable(self, want: frozenset) -> frozenset:
        """The directions of ``want`` whose copies this quantizer's ``encode`` can write as
        their exact BF16 block decode (``tensors.decoded``) while its other copies keep codes;
        formats opt in (default none)."""
        return frozenset()

    def decodable_part(self, direction: str) -> bool:
        """Whether this quantizer, as a hybrid's ``direction`` child, can write that copy
        decoded (the hybrid kernel's part; default no)."""
        return False

    @property
    def hold_decoded(self) -> frozenset:
        """The directions whose copies ``encode`` returns as their BF16 decode instead of codes:
        the same values and GEMM results, for copies only read by GEMMs that decode them anyway
        (BF16 tensor cores), one pass instead of a quantize and a decode. Set by modules."""
        return self._hold_decoded

    @hold_decoded.setter
    def hold_decoded(self, directions) -> None:
        want = frozenset(directions)
        for d in want:
            check_direction(d)
        if self.decodable(want) != want:
            role = f" (role: {self.label})" if self.label else ""
            raise ValueError(f"{self!r}{role} cannot hold its {'+'.join(sorted(want))} copies decoded in BF16 "
                             "(1D MXFP8 quantizers hold both copies decoded; NVFP4 -> MXFP8 hybrids any); "
                             "leave hold_decoded empty.")
        self._hold_decoded = want

    # ------------------------------------------------------------------ usage
    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Choose which copies the next ``quantize`` produces.

        Parameters
        ----------
        rowwise:
            Make the rowwise copy; None keeps the current flag.
        columnwise:
            Make the columnwise copy; None keeps the current flag.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> q = hf.Float8CurrentScalingQuantizer()
        >>> q.set_usage(rowwise=False)
        >>> q(torch.randn(16, 16)).directions()
        ('columnwise',)
        """
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    @property
    def label(self) -> str:
        """Role text for error messages ('' when unknown)."""
        return "" if self.role is None else str(self.role)

    # ------------------------------------------------------------------ quantize
    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize ``x`` into the copies this quantizer's usage flags request.

        The gradient passes straight through (the backward of ``quantize`` is the identity).

        Parameters
        ----------
        x:
            A float32, bfloat16 or float16 tensor of any shape (blocks run along the last dim).

        Returns
        -------
        QuantizedTensor
            Of ``x``'s shape and dtype, holding the requested copies and pointing back to this
            quantizer.

        Raises
        ------
        TypeError
            ``x`` is already a QuantizedTensor, not a tensor, or not of a float dtype above.
        ValueError
            Both usage flags are off (a HybridQuantizer returns an empty hybrid instead), or
            the format cannot make a requested copy (row-scaled NVFP4's columnwise copy).

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> x = torch.randn(64, 128)
        >>> qt = hf.MXFP8Quantizer().quantize(x)
        >>> qt.shape, qt.directions()
        (torch.Size([64, 128]), ('rowwise', 'columnwise'))
        >>> bool((qt.dequantize() - x).abs().max() < 0.5)
        True
        """
        if isinstance(x, QuantizedTensor):
            raise TypeError(f"{self!r}: input is already a QuantizedTensor "
                            f"({x.qstorage.describe()}); dequantize() it first.")
        check_input(x, f"input of {self!r}" + (f" (role: {self.label})" if self.label else ""))
        if torch.is_grad_enabled() and x.requires_grad:
            return _QuantizeSTE.apply(x, self)
        return self._quantize_no_grad(x)

    __call__ = quantize

    def _quantize_no_grad(self, x: torch.Tensor) -> QuantizedTensor:
        if not (self.rowwise_usage or self.columnwise_usage):
            return QuantizedTensor(self._quantize_nothing(x), self)
        seed = self.draw_seed() if self.uses_randomness() else None
        storage = self.encode(x.detach(), self.rowwise_usage, self.columnwise_usage, seed)
        return QuantizedTensor(storage, self)

    def _quantize_nothing(self, x: torch.Tensor) -> QuantizedStorage:
        """``quantize`` with both usages off. A plain quantizer refuses, as TransformerEngine's
        do (a tensor of one format with no copy has nothing to be); a hybrid returns an empty
        one (see HybridQuantizer).

        Raises
        ------
        ValueError
            Always, naming the quantizer and what to enable.
        """
        role = f" (role: {self.label})" if self.label else ""
        raise ValueError(f"{self!r}{role} has rowwise_usage=False and columnwise_usage=False: "
                         "enable at least one with set_usage().")

    def encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
               seed: Optional[int] = None) -> QuantizedStorage:
        """Encode ``x`` (any shape, last dim contiguous) into a storage with the given copies,
        with a registered fast kernel when one fits, else :meth:`reference_encode`.

        ``seed``: the random seed of this quantization (stochastic rounding), drawn once per
        ``quantize`` call and shared by a hybrid's children, so a copy's random draws do not
        depend on which other copies or children exist; None draws one where needed.
        """
        kernel = select_quantize_kernel(self, x, rowwise, columnwise)
        if kernel is not None:
            storage = kernel.run(self, x, rowwise, columnwise, seed)
        else:
            storage = self.reference_encode(x, rowwise, columnwise, seed)
        if self.hold_decoded:
            # kernels write decoded copies themselves; this is the reference (CPU, empty inputs)
            storage = storage.with_decoded(self.hold_decoded)
        return storage

    @abstractmethod
    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """The PyTorch reference encode (the definition kernels are tested against)."""

    # ------------------------------------------------------------------ randomness and state
    def uses_randomness(self) -> bool:
        """Whether quantizing draws random numbers (stochastic rounding)."""
        return False

    def random_generator(self) -> Optional[torch.Generator]:
        """The generator seeds are drawn from (None: torch's default CPU generator)."""
        return None

    def draw_seed(self) -> int:
        """One 62-bit seed from torch's generator: ``torch.manual_seed`` reproduces runs."""
        g = self.random_generator()
        device = g.device if g is not None else "cpu"
        return int(torch.randint(0, 2**62, (1,), generator=g, device=device).item())

    def observe(self, x: torch.Tensor) -> None:
        """See ``x`` without producing a copy (a hybrid's idle child): stateful quantizers record
        what they would have (delayed scaling: the amax), so their state tracks the plain
        quantizer's. No-op for stateless formats."""

    def finish_step(self, amax_reduction_group: Optional[Any] = None) -> None:
        """End of a training step (autocast region): update any per-step state (no-op here)."""

    def pending_amaxes(self) -> list[torch.Tensor]:
        """The amaxes recorded since the last ``finish_step`` that it would all-reduce, as views
        of the live state (:func:`reduce_pending_amaxes` reduces many quantizers' at once); none
        for stateless formats."""
        return []

    def discard_step(self) -> None:
        """Forget what was recorded since the last ``finish_step`` (the autocast region raised),
        so the state is as before the step. No-op for stateless formats."""

    def get_state(self) -> dict[str, torch.Tensor | int | float | bool | str]:
        """The quantizer's state as tensors and plain values (a module's extra state):
        ``{}`` for stateless formats.

        Returns
        -------
        dict
            Name -> tensor (a copy, not the live state) / int / float / bool / str.

        Example
        -------
        >>> import hybridfp as hf
        >>> hf.MXFP8Quantizer().get_state()
        {}
        """
        return {}

    def set_state(self, state: dict) -> None:
        """Restore a state from :meth:`get_state`, bitwise.

        Parameters
        ----------
        state:
            A dict as :meth:`get_state` returns.

        Raises
        ------
        ValueError
            If ``state`` is not a dict or has keys this quantizer does not keep (a stateless
            one keeps none).

        Example
        -------
        >>> import hybridfp as hf
        >>> q = hf.MXFP8Quantizer()
        >>> q.set_state(q.get_state())
        """
        check_state_keys(self, state, {})

    def set_amax_reduction_group(self, group: Optional[Any]) -> None:
        """All-reduce per-tensor amaxes over ``group`` (no-op for formats without them)."""

    def state_version(self) -> Hashable:
        """Changes whenever the quantizer's state changes what it would produce (cache key)."""
        return 0

    def has_state(self) -> bool:
        """Whether ``finish_step`` / ``state_version`` can ever do anything: a class that
        overrides either. Modules call them only on such quantizers (an MoE layer holds three
        per expert, and most formats keep no state), decided when they build their quantizers:
        a method replaced on one instance later is not seen; override it in a subclass."""
        cls = type(self)
        return cls.finish_step is not Quantizer.finish_step or cls.state_version is not Quantizer.state_version

    def format_key(self, direction: str) -> Hashable:
        """The format of the ``direction`` copy this quantizer makes (GEMM backend lookup)."""
        return self.storage_cls.key_for(direction, {**self.storage_cls._meta_defaults, **self.storage_meta()})

    def storage_meta(self) -> dict[str, object]:
        """Storage options (element dtype, block layout...) this quantizer produces."""
        return {}

    def _directions(self, rowwise: bool, columnwise: bool) -> tuple[str, ...]:
        return tuple(d for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on)

    # ------------------------------------------------------------------ helpers
    def make_empty(self, shape: torch.Size | tuple[int, ...], *, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None, requires_grad: bool = False) -> QuantizedTensor:
        """An uninitialized quantized tensor of ``shape`` with this quantizer's copies, to be
        filled by :meth:`update_quantized`.

        Parameters
        ----------
        shape:
            The logical (high-precision) shape.
        dtype:
            The nominal dtype (what ``dequantize()`` returns).
        device:
            Where the buffers live (None: the CPU).
        requires_grad:
            Whether the result requires grad.

        Returns
        -------
        QuantizedTensor
            Holding the copies of this quantizer's usage flags, values unset.

        Raises
        ------
        ValueError
            The format cannot make a requested copy (row-scaled NVFP4's columnwise copy).

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> q = hf.MXFP8Quantizer()
        >>> t = q.make_empty((32, 64))
        >>> _ = q.update_quantized(torch.ones(32, 64), t)
        >>> t.dequantize().sum().item()
        2048.0
        """
        storage = self._allocate(torch.Size(shape), dtype, device or "cpu",
                                 self.rowwise_usage, self.columnwise_usage)
        return QuantizedTensor(storage, self, requires_grad=requires_grad)

    def _allocate(self, shape: torch.Size, dtype: torch.dtype, device: torch.device | str,
                  rowwise: bool, columnwise: bool) -> QuantizedStorage:
        return self.storage_cls.allocate(shape, dtype, device, self._directions(rowwise, columnwise),
                                         label=self.label, **self.storage_meta())

    def update_quantized(self, src: torch.Tensor, dst: QuantizedTensor, *,
                         directions: Optional[tuple[str, ...]] = None) -> QuantizedTensor:
        """Re-quantize ``src`` into ``dst``'s existing buffers, in place.

        The copies written are those of this quantizer's usage (TransformerEngine's
        semantics), or ``directions`` when given (``dst.copy_(src)`` passes the copies ``dst``
        holds). A copy ``dst`` holds outside them is dropped from ``dst``, not kept: it would
        still hold the old value next to the new one, so fprop and the backward GEMMs would
        silently read two different tensors.

        Parameters
        ----------
        src:
            The new high-precision value, of ``dst``'s shape.
        dst:
            A quantized tensor made by this quantizer (or ``make_empty``).
        directions:
            The copies to write ("rowwise" / "columnwise"); None: this quantizer's usage.

        Returns
        -------
        QuantizedTensor
            ``dst``.

        Raises
        ------
        ValueError
            Shapes differ, an unknown direction name, or no copy selected.
        TypeError
            ``src`` is not a float32 / bfloat16 / float16 tensor.
        MissingDirectionError
            A selected copy ``dst`` does not hold (a copy cannot be added in place).

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> q = hf.Float8CurrentScalingQuantizer()
        >>> t = q.quantize(torch.zeros(16, 16))
        >>> _ = q.update_quantized(torch.ones(16, 16), t)
        >>> t.dequantize().mean().item()
        1.0
        """
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"update_quantized: source shape {tuple(src.shape)} differs from "
                             f"destination {dst.qstorage.describe()}.")
        check_input(src, "update_quantized source")
        want = self._update_directions(dst, directions)
        # write dst's own layout: its decoded copies decoded, its codes as codes, whatever this
        # quantizer holds now (make_empty allocates codes; a module may hold decoded copies)
        held, self._hold_decoded = self._hold_decoded, dst.qstorage.decoded_directions() & frozenset(want)
        try:
            storage = self.encode(src.detach(), ROWWISE in want, COLUMNWISE in want,
                                  self.draw_seed() if self.uses_randomness() else None)
        finally:
            self._hold_decoded = held
        stale = [d for d in dst.directions() if d not in want]
        if stale:
            dst.update_usage(**{f"{d}_usage": False for d in stale})
        dst.qstorage.copy_payload_(storage)
        return dst

    def _update_directions(self, dst: QuantizedTensor, directions: Optional[tuple[str, ...]]) -> tuple[str, ...]:
        """The copies ``update_quantized`` writes, each checked to be held by ``dst``."""
        if directions is None:
            want = self._directions(self.rowwise_usage, self.columnwise_usage)
        else:
            want = tuple(d for d in (ROWWISE, COLUMNWISE) if d in {check_direction(x) for x in directions})
        if not want:
            raise ValueError(f"update_quantized: {self!r} selects no copy (rowwise_usage=False and "
                             "columnwise_usage=False); enable the copies to write with set_usage().")
        for d in want:
            if not dst.has_direction(d):
                raise MissingDirectionError(
                    f"update_quantized: {dst.qstorage.describe()} holds no {d} copy to write in place "
                    f"(it holds: {', '.join(dst.directions()) or 'none'}); quantize anew with "
                    f"{d}_usage=True, or set_usage({d}=False) on {self!r} to leave it out.")
        return want

    def check_columnwise(self) -> None:
        """Raise a clear error if this quantizer cannot make a columnwise copy (default: it can)."""

    def is_requantization_safe(self) -> bool:
        """Whether quantizing the same input again later reproduces the same result."""
        return True

    def share_key(self) -> Optional[Hashable]:
        """A key under which this quantizer's result may be handed to another quantizer with the
        same key: equal keys promise bit-identical copies of the same input, whichever
        quantizer runs (no state, no randomness). None (the default, and for any quantizer that
        does not opt in): never shared. Modules use it to quantize an input that several
        layers read (a gated MLP's gate and up) once."""
        return None

    def _settings_share_key(self) -> Hashable:
        """``share_key`` of a stateless, deterministic format whose ``settings()`` and
        ``storage_meta()`` name every option that changes its numbers; the amax reduction
        group (per-tensor scales all-reduced over it) is compared by identity."""
        return (type(self), tuple(sorted(self.settings().items())), tuple(sorted(self.storage_meta().items())),
                bool(getattr(self, "with_amax_reduction", False)), id(getattr(self, "amax_reduction_group", None)))

    def copy(self) -> "Quantizer":
        """An independent quantizer with the same settings and a copy of any state; process
        groups and random generators are shared, not copied (they are handles, not state)."""
        shared = [getattr(self, n, None) for n in ("amax_reduction_group", "generator")]
        return _copy.deepcopy(self, {id(o): o for o in shared if o is not None})

    def settings(self) -> dict[str, object]:
        """The options that determine the numbers (used for parity checks and reports)."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.settings().items())
        return f"{type(self).__name__}({opts})"


def set_usages(quantizers: Sequence[Quantizer], rowwise: Sequence[Optional[bool]],
               columnwise: Sequence[Optional[bool]]) -> None:
    """``q.set_usage(rowwise=r, columnwise=c)`` for each quantizer and its pair of flags, in one
    call: an MoE layer sets every expert's quantizers before each grouped quantization, and a
    quantizer that keeps ``Quantizer.set_usage`` has its flags assigned here without a Python
    call of its own (one that overrides it is called).

    Parameters
    ----------
    quantizers:
        The quantizers, in order.
    rowwise, columnwise:
        One flag each per quantizer (None keeps that quantizer's current flag).

    Raises
    ------
    ValueError
        The three sequences differ in length.

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.quantizers.base import set_usages
    >>> qs = [hf.Float8CurrentScalingQuantizer(), hf.MXFP8Quantizer()]
    >>> set_usages(qs, [True, False], [False, True])
    >>> [(q.rowwise_usage, q.columnwise_usage) for q in qs]
    [(True, False), (False, True)]
    """
    if not len(quantizers) == len(rowwise) == len(columnwise):
        raise ValueError(f"set_usages: {len(quantizers)} quantizers but {len(rowwise)} rowwise and "
                         f"{len(columnwise)} columnwise flags; pass one of each per quantizer.")
    base = Quantizer.set_usage
    for q, r, c in zip(quantizers, rowwise, columnwise):
        if type(q).set_usage is not base:
            q.set_usage(rowwise=r, columnwise=c)
            continue
        if r is not None:
            q.rowwise_usage = bool(r)
        if c is not None:
            q.columnwise_usage = bool(c)
