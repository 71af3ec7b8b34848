"""FP8 per-tensor quantizers: current scaling and delayed scaling (SPEC §2.1, §2.2).

Both copies share one scale; the columnwise copy is the rowwise data transposed (the layout
Hopper's TN-only FP8 GEMM consumes), so it costs a transpose, not a second quantization.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from ..formats import fp8_tensorwise
from ..formats.common import amax_nan, as_2d, fp8_dtype as _fp8_dtype
from ..tensors import Float8Storage, QuantizedStorage
from .base import Quantizer, all_reduce_amax


def _float8_storage(q: Quantizer, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    rowwise: bool, columnwise: bool) -> Float8Storage:
    data, scale_inv = fp8_tensorwise.quantize(as_2d(x), scale, dtype)
    row = {"data": data, "scale_inv": scale_inv} if rowwise else None
    col = {"data": data.t().contiguous(), "scale_inv": scale_inv} if columnwise else None
    return Float8Storage(x.shape, x.dtype, row, col, label=q.label, fp8_dtype=dtype)


class Float8CurrentScalingQuantizer(Quantizer):
    """FP8 with a per-tensor scale computed from this tensor's own amax."""

    storage_cls = Float8Storage
    format_name = "fp8_current"
    reads_known_amax = True  # quantizers/fast.py: the CUDA kernel path

    def __init__(self, fp8_dtype: str | torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                 columnwise: bool = True, force_pow_2_scales: bool = False, amax_epsilon: float = 0.0,
                 with_amax_reduction: bool = False, amax_reduction_group: Optional[Any] = None) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = _fp8_dtype(fp8_dtype)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        if amax_epsilon < 0:
            raise ValueError(f"amax_epsilon={amax_epsilon} must be >= 0.")
        self.amax_epsilon = float(amax_epsilon)
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
    Not requantization-safe: the scale changes between steps.
    """

    storage_cls = Float8Storage
    format_name = "fp8_delayed"

    def __init__(self, fp8_dtype: str | torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                 columnwise: bool = True, amax_history_len: int = 1024, amax_compute_algo: str = "max",
                 margin: int = 0) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = _fp8_dtype(fp8_dtype)
        if amax_history_len < 1:
            raise ValueError(f"amax_history_len={amax_history_len} must be >= 1.")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={amax_compute_algo!r} is unknown; use 'max' or 'most_recent'.")
        self.amax_compute_algo = amax_compute_algo
        self.margin = int(margin)
        self.amax_history = torch.zeros(amax_history_len, dtype=torch.float32)
        self.scale = torch.ones((), dtype=torch.float32)
        self._recorded = False  # an amax was recorded since the last update
        self._updates = 0

    def _state_to(self, device: torch.device) -> None:
        if self.scale.device != device:
            self.scale = self.scale.to(device)
            self.amax_history = self.amax_history.to(device)

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
        """End-of-step update: (optionally all-reduce the newest amax,) new scale, roll history."""
        if amax_reduction_group is not None:
            all_reduce_amax(self.amax_history[0:1], amax_reduction_group)
        self.amax_history, self.scale = fp8_tensorwise.delayed_update(
            self.amax_history, self.scale, self.dtype, margin=self.margin, algo=self.amax_compute_algo)
        self._recorded = False
        self._updates += 1

    def finish_step(self, amax_reduction_group: Optional[Any] = None) -> None:
        """Update the scale if this quantizer recorded an amax since its last update."""
        if self._recorded:
            self.update_scale(amax_reduction_group)

    def state_version(self) -> int:
        """Number of scale updates so far (a cached quantized weight is stale after one)."""
        return self._updates

    def is_requantization_safe(self) -> bool:
        """False: the scale moves at every update."""
        return False

    def storage_meta(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype}

    def settings(self) -> dict[str, object]:
        return {"fp8_dtype": self.dtype, "amax_history_len": int(self.amax_history.numel()),
                "amax_compute_algo": self.amax_compute_algo, "margin": self.margin}
