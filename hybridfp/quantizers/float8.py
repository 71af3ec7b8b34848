"""FP8 per-tensor quantizers: current scaling and delayed scaling (numerics §2.1, §2.2).

Both copies share one scale; the columnwise copy is the rowwise data transposed (the layout
Hopper's TN-only FP8 GEMM consumes), so it costs a transpose, not a second quantization.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Hashable, Optional

import torch

from ..formats import fp8_tensorwise
from ..formats.common import amax_nan, as_2d, fp8_dtype as _fp8_dtype
from ..tensors import Float8Storage, QuantizedStorage
from .base import Quantizer, all_reduce_amax, check_state_keys


class NonFiniteAmaxWarning(RuntimeWarning):
    """A delayed-scaling quantizer recorded an Inf or NaN amax: that step kept the previous
    scale and left the amax out of the history (warned once per quantizer)."""


def check_amax_epsilon(value: object) -> float:
    """``amax_epsilon`` as a float.

    Raises
    ------
    ValueError
        Unless it is a finite real number >= 0 (a NaN / Inf floor makes every scale 1 or 0).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"amax_epsilon={value!r} must be a finite number >= 0 (the floor of the amax "
                         "a scale is computed from; 0 turns it off).")
    return float(value)


def check_history_len(value: object) -> int:
    """``amax_history_len`` as an int.

    Raises
    ------
    ValueError
        Unless it is an integer >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"amax_history_len={value!r} must be an integer >= 1 (the number of steps "
                         "whose amaxes the scale is computed from).")
    return int(value)


def check_margin(value: object, dtype: torch.dtype) -> int:
    """``margin`` as an int.

    Raises
    ------
    ValueError
        Unless it is an integer in [0, ``fp8_tensorwise.max_margin(dtype)``]: a larger margin
        makes the scale of a large amax zero or its inverse infinite (NaN outputs).
    """
    top = fp8_tensorwise.max_margin(dtype)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= top:
        raise ValueError(f"margin={value!r} must be an integer in [0, {top}] for {dtype} (the scale is "
                         f"divided by 2**margin; beyond {top} the scale of a large amax or its inverse "
                         "leaves FP32's range and outputs become NaN).")
    return int(value)


class _NonFiniteSeen:
    """Whether a delayed-scaling quantizer skipped an update for an Inf / NaN amax, told to the
    host without waiting for the device.

    On the CPU the flag is read at once. On CUDA a read (``.item()``) would stall the host
    until the GPU catches up, at every step; instead the OR of the flags stays on the device,
    an update queues its copy into pinned host memory behind a CUDA event, and a later update
    reads that copy once the event has completed (``Event.query`` does not wait). So the
    warning comes one or more steps late, and costs two tiny kernels and a 1-byte copy a step.
    """

    def __init__(self) -> None:
        self.warned = False
        self._seen: Optional[torch.Tensor] = None  # device: OR of the skipped flags so far
        self._host: Optional[torch.Tensor] = None  # pinned copy of ``_seen``
        self._event: Optional[Any] = None  # completes when ``_host`` holds the copy

    def note(self, skipped: torch.Tensor) -> bool:
        """Add one update's skipped flags; True when a skip is known and not yet reported."""
        if self.warned:
            return False
        if skipped.device.type != "cuda":
            return bool(skipped.any())
        flag = skipped.any()
        self._seen = flag if self._seen is None else self._seen | flag
        if self._event is not None and not self._event.query():
            return False  # the copy queued earlier has not landed; look again next update
        if self._event is not None and bool(self._host):
            return True
        if self._host is None:
            self._host = torch.zeros((), dtype=torch.bool, pin_memory=True)
        self._host.copy_(self._seen, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return False

    def report(self, q: Quantizer) -> None:
        """Warn once, naming ``q``'s role, and stop tracking."""
        self.warned, self._seen, self._host, self._event = True, None, None, None
        role = f" (role: {q.label})" if q.label else ""
        warnings.warn(f"{type(q).__name__}{role}: an amax recorded in a step was Inf or NaN; that step kept "
                      "the previous scale and left the amax out of the history. Inf / NaN in this tensor "
                      "usually means diverging training or bad inputs. (Warned once per quantizer.)",
                      NonFiniteAmaxWarning, stacklevel=4)

    def __getstate__(self) -> dict:
        # copies and pickles keep whether the warning was given, not the device-side tracking
        return {"warned": self.warned}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.warned = bool(state.get("warned", False))


def _float8_storage(q: Quantizer, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    rowwise: bool, columnwise: bool) -> Float8Storage:
    data, scale_inv = fp8_tensorwise.quantize(as_2d(x), scale, dtype)
    row = {"data": data, "scale_inv": scale_inv} if rowwise else None
    col = {"data": data.t().contiguous(), "scale_inv": scale_inv} if columnwise else None
    return Float8Storage(x.shape, x.dtype, row, col, label=q.label, fp8_dtype=dtype)


class Float8CurrentScalingQuantizer(Quantizer):
    """FP8 with a per-tensor scale computed from this tensor's own amax (numerics §2.1).

    Stateless and deterministic: quantizing the same tensor again gives the same copies. Both
    copies share the scale; the columnwise copy is the rowwise data transposed.

    Parameters
    ----------
    fp8_dtype:
        ``torch.float8_e4m3fn`` (default) / ``torch.float8_e5m2``, or "e4m3" / "e5m2".
    rowwise, columnwise:
        The copies ``quantize`` makes (see :meth:`Quantizer.set_usage`).
    force_pow_2_scales:
        Round the scale down to a power of two.
    amax_epsilon:
        A finite floor >= 0 for the amax the scale is computed from (0: none).
    with_amax_reduction:
        All-reduce (MAX) the amax over ``amax_reduction_group`` before computing the scale.
    amax_reduction_group:
        The process group of that reduction.

    Raises
    ------
    ValueError
        An ``fp8_dtype`` that is not an FP8 type, or an ``amax_epsilon`` that is negative,
        not finite, or not a number.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> q = hf.Float8CurrentScalingQuantizer("e4m3")
    >>> x = torch.tensor([[448.0, 1.0]])
    >>> q(x).dequantize()
    tensor([[448.,   1.]])
    """

    storage_cls = Float8Storage
    format_name = "fp8_current"
    reads_known_amax = True  # quantizers/fast.py: the CUDA kernel path

    def __init__(self, fp8_dtype: str | torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                 columnwise: bool = True, force_pow_2_scales: bool = False, amax_epsilon: float = 0.0,
                 with_amax_reduction: bool = False, amax_reduction_group: Optional[Any] = None) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = _fp8_dtype(fp8_dtype)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = check_amax_epsilon(amax_epsilon)
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group

    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """One amax, one scale, one cast; the columnwise copy is its transpose."""
        amax = amax_nan(x)
        if self.with_amax_reduction:
            amax = all_reduce_amax(amax, self.amax_reduction_group)
        scale = fp8_tensorwise.current_scale(amax, self.dtype, eps=self.amax_epsilon,
                                             power_2_scale=self.force_pow_2_scales)
        return _float8_storage(self, x, scale, self.dtype, rowwise, columnwise)

    def storage_meta(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype}

    def set_amax_reduction_group(self, group: Optional[Any]) -> None:
        """All-reduce the amax over ``group`` (None: local amax)."""
        self.with_amax_reduction = group is not None
        self.amax_reduction_group = group

    def share_key(self) -> Hashable:
        """Stateless and deterministic: its result is shared with quantizers of equal settings."""
        return self._settings_share_key()

    def settings(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype, "force_pow_2_scales": self.force_pow_2_scales,
                "amax_epsilon": self.amax_epsilon}

class Float8Quantizer(Quantizer):
    """FP8 delayed scaling: quantize with the scale from the last update, record the amax.

    Call :meth:`update_scale` once per step (recipes do it when an autocast region ends).
    Not requantization-safe: the scale changes between steps. Slot 0 of ``amax_history`` is
    the pending slot (the largest amax since the last update): an update commits it, unless it
    is Inf or NaN (then the step keeps its scale and history, and a
    :class:`NonFiniteAmaxWarning` is given once); :meth:`discard_step` drops it.

    Parameters
    ----------
    fp8_dtype:
        E4M3 (default) or E5M2.
    amax_history_len:
        An integer >= 1: the steps whose amaxes the scale comes from.
    amax_compute_algo:
        "max" (over the history) or "most_recent".
    margin:
        An integer in [0, ``formats.fp8_tensorwise.max_margin(fp8_dtype)``]: the scale is
        divided by ``2**margin``.

    rowwise, columnwise:
        The copies ``quantize`` makes (see :meth:`Quantizer.set_usage`).

    Raises
    ------
    ValueError
        For an option outside its range (the message names it and the range), an unknown
        ``amax_compute_algo``, or an ``fp8_dtype`` that is not an FP8 type.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> q = hf.Float8Quantizer(amax_history_len=4)
    >>> _ = q(torch.full((4, 4), 2.0))   # quantized with scale 1; records amax 2
    >>> q.update_scale()
    >>> q.scale.item()                    # 448 / 2 (E4M3 max / amax)
    224.0
    """

    storage_cls = Float8Storage
    format_name = "fp8_delayed"

    def __init__(self, fp8_dtype: str | torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                 columnwise: bool = True, amax_history_len: int = 1024, amax_compute_algo: str = "max",
                 margin: int = 0) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = _fp8_dtype(fp8_dtype)
        amax_history_len = check_history_len(amax_history_len)
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={amax_compute_algo!r} is unknown; use 'max' or 'most_recent'.")
        self.amax_compute_algo = amax_compute_algo
        self.margin = check_margin(margin, self.dtype)
        with torch.inference_mode(False):  # state outlives the call: normal tensors (see _state_to)
            self.amax_history = torch.zeros(amax_history_len, dtype=torch.float32)
            self.scale = torch.ones((), dtype=torch.float32)
        self._recorded = False  # an amax was recorded since the last update
        self._updates = 0
        self._nonfinite = _NonFiniteSeen()

    def _state_to(self, device: torch.device) -> None:
        """Keep the state on ``device`` as normal tensors: one made under
        ``torch.inference_mode()`` (a first forward or an evaluation there, a ``copy()``) is an
        inference tensor, which the in-place amax updates of a later forward outside it refuse."""
        if self.scale.device != device or self.scale.is_inference() or self.amax_history.is_inference():
            with torch.inference_mode(False):
                self.scale = self.scale.to(device, copy=True)
                self.amax_history = self.amax_history.to(device, copy=True)

    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """Cast with the current scale and record this tensor's amax in the history."""
        self.record_amax(amax_nan(x))
        return _float8_storage(self, x, self.scale.clone(), self.dtype, rowwise, columnwise)

    def record_amax(self, amax: torch.Tensor) -> None:
        """Fold this quantization's amax into the current history slot (max since the update)."""
        self._state_to(amax.device)
        fp8_tensorwise.record_amax(self.amax_history, amax)
        self._recorded = True

    def observe(self, x: torch.Tensor) -> None:
        """Record x's amax as a quantization would (an idle hybrid child)."""
        self.record_amax(amax_nan(x))

    def update_scale(self, amax_reduction_group: Optional[Any] = None) -> None:
        """End-of-step update: (optionally all-reduce the pending amax,) new scale, roll history;
        a non-finite pending amax commits nothing (decided on the device: no host sync).

        Parameters
        ----------
        amax_reduction_group:
            A process group over which the pending amax is all-reduced (MAX) first; None
            keeps the local amax.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> q = hf.Float8Quantizer(amax_history_len=2)
        >>> _ = q(torch.ones(2, 2)); q.update_scale()
        >>> q.state_version(), q.scale.item()
        (1, 448.0)
        """
        # the new state outlives the call: normal tensors even at the end of an inference_mode
        # region (the update itself is the same there, as under no_grad)
        with torch.inference_mode(False):
            self._state_to(self.scale.device)
            if amax_reduction_group is not None:
                pending = self.amax_history[0:1]
                # NaN -> Inf: a MAX reduction's NaN handling varies by backend, Inf's does not, so
                # every rank sees the non-finite amax and skips the same step
                pending.copy_(torch.where(torch.isnan(pending), torch.full_like(pending, math.inf), pending))
                all_reduce_amax(pending, amax_reduction_group)
            skipped = fp8_tensorwise.uncommitted(self.amax_history)
            self.amax_history, self.scale = fp8_tensorwise.delayed_update(
                self.amax_history, self.scale, self.dtype, margin=self.margin, algo=self.amax_compute_algo)
            self._recorded = False
            self._updates += 1
            if self._nonfinite.note(skipped):  # its device flags outlive the call too
                self._nonfinite.report(self)

    def pending_amaxes(self) -> list[torch.Tensor]:
        """The pending history slot, if an amax was recorded since the last update."""
        return [self.amax_history[0:1]] if self._recorded else []

    def finish_step(self, amax_reduction_group: Optional[Any] = None) -> None:
        """Update the scale if this quantizer recorded an amax since its last update."""
        if self._recorded:
            self.update_scale(amax_reduction_group)

    def state_version(self) -> int:
        """Number of scale updates so far (a cached quantized weight is stale after one)."""
        return self._updates

    def discard_step(self) -> None:
        """Drop the amaxes recorded since the last update (the pending slot), as if the step had
        not run: the next update sees only later ones."""
        if self._recorded:
            self._state_to(self.scale.device)
            self.amax_history[0].zero_()  # a kernel, not a host-to-device copy
            self._recorded = False

    def _state_entries(self) -> dict[str, torch.Tensor | int | bool]:
        return {"amax_history": self.amax_history, "scale": self.scale, "updates": self._updates,
                "recorded": self._recorded}

    def get_state(self) -> dict[str, torch.Tensor | int | bool]:
        """``amax_history`` (slot 0: the pending amax), ``scale``, ``updates`` (the update
        count, :meth:`state_version`) and ``recorded`` (whether slot 0 holds an amax to commit);
        tensors are copies.

        Returns
        -------
        dict
            The state, tensors and plain values only.

        Example
        -------
        >>> import hybridfp as hf
        >>> sorted(hf.Float8Quantizer(amax_history_len=8).get_state())
        ['amax_history', 'recorded', 'scale', 'updates']
        """
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in self._state_entries().items()}

    def set_state(self, state: dict) -> None:
        """Restore :meth:`get_state`'s dict bitwise (tensors copied to this quantizer's device).

        Parameters
        ----------
        state:
            A dict from :meth:`get_state` of a quantizer with the same ``amax_history_len``.

        Raises
        ------
        ValueError
            Naming missing / unexpected keys, or a tensor of another shape or dtype (another
            ``amax_history_len``).

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> a, b = hf.Float8Quantizer(amax_history_len=4), hf.Float8Quantizer(amax_history_len=4)
        >>> _ = a(torch.ones(2, 2)); a.update_scale()
        >>> b.set_state(a.get_state())
        >>> b.scale.item(), b.state_version()
        (448.0, 1)
        """
        check_state_keys(self, state, self._state_entries())
        device = self.scale.device
        with torch.inference_mode(False):  # normal tensors (see _state_to)
            self.amax_history = state["amax_history"].detach().to(device, copy=True)
            self.scale = state["scale"].detach().to(device, copy=True)
        self._updates, self._recorded = state["updates"], state["recorded"]

    def is_requantization_safe(self) -> bool:
        """False: the scale moves at every update."""
        return False

    def storage_meta(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype}

    def settings(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype, "amax_history_len": int(self.amax_history.numel()),
                "amax_compute_algo": self.amax_compute_algo, "margin": self.margin}
