"""NVFP4 quantizer (numerics §2.5): 1D / 2D blocks, RHT on the columnwise copy, stochastic
rounding, row-scaled forward activations."""

from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from ..formats import nvfp4, rht
from ..formats.common import amax_nan, as_2d
from ..tensors import NVFP4Storage, QuantizedStorage
from .base import Quantizer, all_reduce_amax


class NVFP4Quantizer(Quantizer):
    """E2M1 elements, E4M3 scale per 16 elements, FP32 global scale.

    Options (all off by default; numerics §2.5 lists the NVIDIA recipe defaults per role):

    - ``with_rht``: random Hadamard transform of the columnwise copy (the wgrad operand;
      R cancels inside wgrad). ``with_post_rht_amax`` (default True) takes that copy's global
      amax after the transform, so nothing saturates.
    - ``with_2d_quantization``: 16x16 tiles (weights); both copies hold identical values.
    - ``stochastic_rounding``: unbiased random rounding (gradients), drawn from torch's
      generator (``generator`` or the device default), so ``torch.manual_seed`` reproduces it.
    - ``row_scaled_nvfp4``: one global amax per row (forward activations only: rowwise copy).

    Parameters
    ----------
    rowwise, columnwise:
        The copies ``quantize`` makes (see :meth:`Quantizer.set_usage`).
    with_rht:
        Random Hadamard transform of the columnwise copy.
    with_post_rht_amax:
        With ``with_rht``: take the columnwise global amax after the transform.
    with_2d_quantization:
        16x16 tiles (weights).
    stochastic_rounding:
        Unbiased random rounding; the quantizer is then not requantization-safe.
    row_scaled_nvfp4:
        One global amax per row; the quantizer then makes no columnwise copy.
    with_amax_reduction:
        All-reduce (MAX) the global amax over ``amax_reduction_group``.
    amax_reduction_group:
        The process group of that reduction.
    generator:
        The ``torch.Generator`` stochastic-rounding seeds are drawn from (None: torch's
        default CPU generator).

    Raises
    ------
    ValueError
        ``row_scaled_nvfp4`` with ``with_rht``, ``with_2d_quantization``,
        ``stochastic_rounding`` or ``with_amax_reduction``; ``with_rht`` with
        ``with_2d_quantization``. ``quantize`` / ``make_empty`` raise it too when a row-scaled
        quantizer is asked for a columnwise copy.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> x = torch.randn(128, 128)
    >>> t = hf.NVFP4Quantizer(with_rht=True)(x)
    >>> bool((t.dequantize(direction="columnwise") - x).norm() / x.norm() < 0.15)
    True
    >>> q = hf.NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)
    >>> q(x).directions()
    ('rowwise',)
    """

    storage_cls = NVFP4Storage
    format_name = "nvfp4"

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True, with_rht: bool = False,
                 with_post_rht_amax: bool = True, with_2d_quantization: bool = False,
                 stochastic_rounding: bool = False, row_scaled_nvfp4: bool = False,
                 with_amax_reduction: bool = False, amax_reduction_group: Optional[Any] = None,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        if row_scaled_nvfp4 and (with_rht or with_2d_quantization or stochastic_rounding):
            raise ValueError("row_scaled_nvfp4=True cannot be combined with with_rht, "
                             "with_2d_quantization or stochastic_rounding (numerics §2.5): row scaling "
                             "is for forward activations only.")
        if with_rht and with_2d_quantization:
            raise ValueError("with_rht=True applies to the columnwise copy of 1D-scaled tensors; "
                             "with_2d_quantization=True (weights) keeps both copies identical. "
                             "Choose one.")
        if row_scaled_nvfp4 and with_amax_reduction:
            raise ValueError("row_scaled_nvfp4 uses per-row amaxes; with_amax_reduction has no "
                             "meaning there. Turn one off.")
        self.with_rht = bool(with_rht)
        self.with_post_rht_amax = bool(with_post_rht_amax)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.row_scaled_nvfp4 = bool(row_scaled_nvfp4)
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.generator = generator

    def _global_amax(self, x2: torch.Tensor) -> torch.Tensor:
        amax = amax_nan(x2)
        if self.with_amax_reduction:
            amax = all_reduce_amax(amax, self.amax_reduction_group)
        return amax

    def _sr(self, seed: Optional[int], direction: int, device: torch.device) -> dict[str, object]:
        """Stochastic-rounding arguments: a generator per (seed, direction), so the columnwise
        draws are the same whether or not a rowwise copy (or another child) drew first."""
        if not self.stochastic_rounding:
            return {"stochastic_rounding": False}
        g = torch.Generator(device=device)
        g.manual_seed((seed * 2 + direction) % (2**63))
        return {"stochastic_rounding": True, "generator": g}

    def reference_encode(self, x: torch.Tensor, rowwise: bool, columnwise: bool,
                         seed: Optional[int] = None) -> QuantizedStorage:
        """Quantize the requested copies (columnwise: 16x1 blocks of the transpose, RHT'd)."""
        x2 = as_2d(x)
        if columnwise:
            self.check_columnwise()
        if self.stochastic_rounding and seed is None:
            seed = self.draw_seed()
        row = col = None
        amax = None
        if self.with_2d_quantization:
            # One quantization serves both copies, stochastic rounding included: numerics §2.5
            # says 2D copies hold identical values (fprop and dgrad see the same weight).
            amax = self._global_amax(x2)
            d, s = nvfp4.quantize_2d(x2, amax, **self._sr(seed, 0, x.device))
            row = {"data": d, "scale": s, "amax": amax} if rowwise else None
            if columnwise:
                col = {"data": _transpose_packed(d, x2.shape[1]), "scale": s.t().contiguous(), "amax": amax}
        else:
            if rowwise:
                ramax = amax_nan(x2, dim=1) if self.row_scaled_nvfp4 else self._global_amax(x2)
                amax = None if self.row_scaled_nvfp4 else ramax
                d, s = nvfp4.quantize_1d(x2, ramax, **self._sr(seed, 0, x.device))
                row = {"data": d, "scale": s, "amax": ramax}
            if columnwise:
                xt = x2.t()
                if self.with_rht:
                    xt = rht.apply_rht(xt, out_dtype=x.dtype)
                    camax = self._global_amax(xt) if self.with_post_rht_amax else (
                        amax if amax is not None else self._global_amax(x2))
                else:
                    camax = amax if amax is not None else self._global_amax(x2)
                d, s = nvfp4.quantize_1d(xt, camax, **self._sr(seed, 1, x.device))
                col = {"data": d, "scale": s, "amax": camax}
        return NVFP4Storage(x.shape, x.dtype, row, col, label=self.label, **self.storage_meta())

    def check_columnwise(self) -> None:
        """Row-scaled NVFP4 is forward-only: it has no columnwise copy."""
        if self.row_scaled_nvfp4:
            raise ValueError(
                f"row-scaled NVFP4{' (role: ' + self.label + ')' if self.label else ''} is "
                "forward-only and has no columnwise copy. Use HybridQuantizer(rowwise_quantizer="
                "NVFP4Quantizer(row_scaled_nvfp4=True), columnwise_quantizer=<backward format>) "
                "or set_usage(columnwise=False).")

    def _allocate(self, shape, dtype, device, rowwise, columnwise):  # type: ignore[override]
        if columnwise:
            self.check_columnwise()
        return super()._allocate(shape, dtype, device, rowwise, columnwise)

    def uses_randomness(self) -> bool:
        """True with stochastic rounding."""
        return self.stochastic_rounding

    def random_generator(self) -> Optional[torch.Generator]:
        """The generator given at construction (None: torch's default)."""
        return self.generator

    def set_amax_reduction_group(self, group: Optional[Any]) -> None:
        """All-reduce the per-tensor global amax over ``group`` (row-scaled amaxes stay local)."""
        if not self.row_scaled_nvfp4:
            self.with_amax_reduction = group is not None
            self.amax_reduction_group = group

    def is_requantization_safe(self) -> bool:
        """False with stochastic rounding: a second quantization draws new random numbers."""
        return not self.stochastic_rounding

    def decodable_part(self, direction: str) -> bool:
        """As a hybrid's rowwise child, 1D without stochastic rounding: the fused NVFP4 -> MXFP8
        kernel's rowwise copy (its block decode; S_dec stays with the amax)."""
        return direction == "rowwise" and not self.with_2d_quantization and not self.stochastic_rounding

    def storage_meta(self) -> dict[str, object]:
        return {"block_2d": self.with_2d_quantization, "rht": self.with_rht,
                "row_scaled": self.row_scaled_nvfp4}

    def share_key(self) -> Optional[Hashable]:
        """Shared with quantizers of equal settings unless stochastic rounding draws fresh
        random numbers at every quantization."""
        return None if self.stochastic_rounding else self._settings_share_key()

    def settings(self) -> dict[str, object]:
        return {"with_rht": self.with_rht, "with_post_rht_amax": self.with_post_rht_amax,
                "with_2d_quantization": self.with_2d_quantization,
                "stochastic_rounding": self.stochastic_rounding,
                "row_scaled_nvfp4": self.row_scaled_nvfp4}

def _transpose_packed(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Transpose packed E2M1 codes [R, ceil(C/2)] -> [C, ceil(R/2)] (exact: codes move)."""
    codes = nvfp4.unpack_fp4(packed, cols)
    return nvfp4.pack_fp4(codes.t().contiguous())
