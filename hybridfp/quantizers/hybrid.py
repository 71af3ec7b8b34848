"""HybridQuantizer: rowwise copy in one format, columnwise copy in another (numerics §3)."""

from __future__ import annotations

from typing import Hashable, Optional

import torch

from ..tensors import HybridStorage, QuantizedStorage
from .base import Quantizer

COLUMNWISE_SOURCES = ("original", "rowwise_dequantized")


class HybridQuantizer(Quantizer):
    """Per-direction quantization: ``rowwise_quantizer`` makes the forward copy,
    ``columnwise_quantizer`` the backward one.

    ``columnwise_source``:
      - "original" (default): the columnwise quantizer reads the high-precision input.
      - "rowwise_dequantized": it reads dequantize(rowwise_quantizer(x)) (exact, in FP32), so
        backward sees the forward's quantization error (Identity child: high-precision
        backward of the forward value; a real format: double quantization).

    Only requested copies are computed; with "rowwise_dequantized" and only the columnwise
    copy requested, a transient rowwise result is made and discarded. With both usages off,
    ``quantize`` returns an empty hybrid (shape and dtype, no copy; reading a value from it
    raises), as TransformerEngine's does; its children see nothing. A child that makes no
    copy in a call still sees the input through ``observe`` (a delayed-scaling child records
    its amax).

    Parameters
    ----------
    rowwise_quantizer:
        A non-hybrid quantizer for the rowwise (forward) copy.
    columnwise_quantizer:
        A different non-hybrid quantizer object for the columnwise (backward) copy.
    columnwise_source:
        "original" or "rowwise_dequantized" (above).
    rowwise, columnwise:
        The copies ``quantize`` makes (see :meth:`Quantizer.set_usage`); the children's own
        usage flags are not read.

    Raises
    ------
    TypeError
        A child is not a Quantizer, or is itself a HybridQuantizer.
    ValueError
        Both children are the same object, the columnwise child cannot make a columnwise copy
        (row-scaled NVFP4), or ``columnwise_source`` is unknown.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> q = hf.HybridQuantizer(hf.NVFP4Quantizer(), hf.MXFP8Quantizer())
    >>> t = q(torch.randn(64, 64))
    >>> t.qstorage.describe()
    'Hybrid[NVFP4/MXFP8] tensor of shape (64, 64)'
    >>> t.dequantize(direction="rowwise").shape
    torch.Size([64, 64])
    """

    storage_cls = HybridStorage
    format_name = "hybrid"
    has_fast_kernels = False

    def __init__(self, rowwise_quantizer: Quantizer, columnwise_quantizer: Quantizer,
                 columnwise_source: str = "original", *, rowwise: bool = True,
                 columnwise: bool = True) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        for name, q in (("rowwise_quantizer", rowwise_quantizer), ("columnwise_quantizer", columnwise_quantizer)):
            if not isinstance(q, Quantizer):
                raise TypeError(f"HybridQuantizer: {name} must be a Quantizer (e.g. MXFP8Quantizer(), "
                                f"IdentityQuantizer()); got {type(q).__name__}.")
            if isinstance(q, HybridQuantizer):
                raise TypeError(f"HybridQuantizer: {name} is itself a HybridQuantizer; pass the "
                                "plain quantizer for that direction.")
        if rowwise_quantizer is columnwise_quantizer:
            raise ValueError("HybridQuantizer: rowwise_quantizer and columnwise_quantizer are the same "
                             "object; pass two distinct quantizers (e.g. q and q.copy()), since each "
                             "direction keeps its own usage flags and state.")
        try:  # fail when the hybrid is built, not at its first backward quantization
            columnwise_quantizer.check_columnwise()
        except ValueError as e:
            raise ValueError(f"HybridQuantizer: columnwise_quantizer cannot be used: {e}") from None
        if columnwise_source not in COLUMNWISE_SOURCES:
            raise ValueError(f"columnwise_source={columnwise_source!r} is unknown; use 'original' "
                             "or 'rowwise_dequantized'.")
        self.rowwise_quantizer = rowwise_quantizer
        self.columnwise_quantizer = columnwise_quantizer
        self.columnwise_source = columnwise_source

    @property
    def role(self):  # type: ignore[override]
        """The slot this hybrid serves; setting it labels both children too."""
        return self._role

    @role.setter
    def role(self, value) -> None:
        self._role = value
        for q in (getattr(self, "rowwise_quantizer", None), getattr(self, "columnwise_quantizer", None)):
            if q is not None:
                q.role = value

    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """Rowwise part from the rowwise child; columnwise part from the columnwise child."""
        if seed is None and self.uses_randomness():
            seed = self.draw_seed()
        derive = columnwise and self.columnwise_source == "rowwise_dequantized"
        row = self.rowwise_quantizer.encode(x, True, False, seed) if (rowwise or derive) else None
        col = None
        if columnwise:
            # The forward's value exactly: FP32 dequantization (rounding it to x's dtype would
            # perturb NVFP4 / non-pow2 FP8 values, so backward would not see the forward value).
            src = row.dequantize(torch.float32, "rowwise") if derive else x
            col = self.columnwise_quantizer.encode(src, False, True, seed)
        elif self.columnwise_source == "original":
            self.columnwise_quantizer.observe(x)
        if row is None:
            self.rowwise_quantizer.observe(x)
        return HybridStorage(x.shape, x.dtype, row if rowwise else None, col, label=self.label)

    def _quantize_nothing(self, x: torch.Tensor) -> QuantizedStorage:
        """The empty hybrid of ``x``'s shape, dtype and device (no child runs or observes:
        nothing is quantized)."""
        return HybridStorage(x.shape, x.dtype, None, None, label=self.label, device=x.device)

    def decodable(self, want: frozenset) -> frozenset:
        """Any of ``want`` when both children can write their copy decoded as parts
        (``decodable_part``: NVFP4 1D rowwise -> MXFP8 1D columnwise, the fused kernel's pair),
        else none."""
        ok = (self.rowwise_quantizer.decodable_part("rowwise")
              and self.columnwise_quantizer.decodable_part("columnwise"))
        return frozenset(want) if ok else frozenset()

    def _allocate(self, shape, dtype, device, rowwise, columnwise):  # type: ignore[override]
        row = self.rowwise_quantizer._allocate(shape, dtype, device, True, False) if rowwise else None
        col = self.columnwise_quantizer._allocate(shape, dtype, device, False, True) if columnwise else None
        return HybridStorage(shape, dtype, row, col, label=self.label, device=device)

    @property
    def reads_known_amax(self) -> bool:  # type: ignore[override]
        """Whether either child uses a recorded amax (see :class:`Quantizer`)."""
        return self.rowwise_quantizer.reads_known_amax or self.columnwise_quantizer.reads_known_amax

    def uses_randomness(self) -> bool:
        """True if either child draws random numbers."""
        return self.rowwise_quantizer.uses_randomness() or self.columnwise_quantizer.uses_randomness()

    def random_generator(self):
        """The first child's own generator, if any."""
        return self.rowwise_quantizer.random_generator() or self.columnwise_quantizer.random_generator()

    def finish_step(self, amax_reduction_group=None) -> None:
        """Both children finish their step."""
        self.rowwise_quantizer.finish_step(amax_reduction_group)
        self.columnwise_quantizer.finish_step(amax_reduction_group)

    def pending_amaxes(self) -> list:
        """Both children's."""
        return self.rowwise_quantizer.pending_amaxes() + self.columnwise_quantizer.pending_amaxes()

    def discard_step(self) -> None:
        """Both children discard the step."""
        self.rowwise_quantizer.discard_step()
        self.columnwise_quantizer.discard_step()

    def get_state(self) -> dict:
        """The children's states, keys prefixed ``rowwise.`` / ``columnwise.``.

        Returns
        -------
        dict
            A flat dict of tensors and plain values ({} when neither child keeps state).

        Example
        -------
        >>> import hybridfp as hf
        >>> q = hf.HybridQuantizer(hf.Float8Quantizer(amax_history_len=4), hf.IdentityQuantizer())
        >>> sorted(q.get_state())
        ['rowwise.amax_history', 'rowwise.recorded', 'rowwise.scale', 'rowwise.updates']
        """
        return {f"{prefix}.{k}": v for prefix, child in self._children() for k, v in child.get_state().items()}

    def set_state(self, state: dict) -> None:
        """Hand each child its part of ``state`` (keys ``rowwise.*`` / ``columnwise.*``).

        Parameters
        ----------
        state:
            A dict from :meth:`get_state`.

        Raises
        ------
        ValueError
            ``state`` is not a dict, a key has neither prefix, or a child's own mismatch.

        Example
        -------
        >>> import hybridfp as hf
        >>> q = hf.HybridQuantizer(hf.Float8Quantizer(amax_history_len=4), hf.IdentityQuantizer())
        >>> q.copy().set_state(q.get_state())
        """
        if not isinstance(state, dict):
            raise ValueError(f"HybridQuantizer.set_state: needs a dict from get_state(); got {type(state).__name__}.")
        stray = sorted(k for k in state if not str(k).startswith(("rowwise.", "columnwise.")))
        if stray:
            raise ValueError(f"HybridQuantizer.set_state: unexpected keys {stray} (keys start with "
                             "'rowwise.' or 'columnwise.').")
        for prefix, child in self._children():
            child.set_state({k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")})

    def _children(self) -> tuple[tuple[str, Quantizer], tuple[str, Quantizer]]:
        return (("rowwise", self.rowwise_quantizer), ("columnwise", self.columnwise_quantizer))

    def set_amax_reduction_group(self, group) -> None:
        """Both children reduce over ``group``."""
        self.rowwise_quantizer.set_amax_reduction_group(group)
        self.columnwise_quantizer.set_amax_reduction_group(group)

    def state_version(self):
        """Both children's versions."""
        return (self.rowwise_quantizer.state_version(), self.columnwise_quantizer.state_version())

    def has_state(self) -> bool:
        """Whether either child keeps state."""
        return self.rowwise_quantizer.has_state() or self.columnwise_quantizer.has_state()

    def format_key(self, direction: str):
        """The format of the child that makes ``direction``'s copy."""
        child = self.rowwise_quantizer if direction == "rowwise" else self.columnwise_quantizer
        return child.format_key(direction)

    def is_requantization_safe(self) -> bool:
        """Safe when both children are (TransformerEngine's rule), whatever the source.

        With "rowwise_dequantized" too: the columnwise child reads dequantize(rowwise(x)), and
        a safe rowwise child makes the same rowwise copy of the same x again, so quantizing
        the kept original later (only the columnwise copy, as backward does) gives the
        forward's copies bit for bit (tests/quantizers/test_te_semantics.py).

        Returns
        -------
        bool
            True when neither child draws random numbers nor keeps moving state.
        """
        return self.rowwise_quantizer.is_requantization_safe() and self.columnwise_quantizer.is_requantization_safe()

    def copy(self) -> "HybridQuantizer":
        """Copies of both children, same source mode and usage."""
        q = HybridQuantizer(self.rowwise_quantizer.copy(), self.columnwise_quantizer.copy(),
                            self.columnwise_source, rowwise=self.rowwise_usage,
                            columnwise=self.columnwise_usage)
        q.role = self.role
        return q

    def share_key(self) -> Optional[Hashable]:
        """Shared when both children are (their keys and the columnwise source decide)."""
        rk, ck = self.rowwise_quantizer.share_key(), self.columnwise_quantizer.share_key()
        return None if rk is None or ck is None else (type(self), rk, ck, self.columnwise_source)

    def settings(self) -> dict[str, object]:
        return {"rowwise": self.rowwise_quantizer, "columnwise": self.columnwise_quantizer,
                "columnwise_source": self.columnwise_source}
