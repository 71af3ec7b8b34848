"""FP8 per-tensor scaling: current scaling (numerics §2.1) and delayed scaling (numerics §2.2).

The math follows TransformerEngine (TE) so that users migrating from it get the same bits:

- current scaling: ``scale = fp8_max / max(amax, eps)`` in FP32, optionally rounded down to
  a power of two by clearing the mantissa bits (TE's ``compute_scale_from_amax``);
- delayed scaling: an amax history whose slot 0 is the one being recorded; an update takes
  ``max(history)`` (or ``history[0]``), rolls the history by -1 and zeroes slot 0, and sets
  ``scale = (fp8_max / amax) / 2**margin`` (TE's ``_default_sf_compute``).

Casts go through :func:`common.saturating_cast_fp8` (clamp in FP32, then an RNE cast), so
values beyond the finite range, ±inf included, saturate to ±fp8_max and never become NaN;
NaN inputs stay NaN. ``scale_inv = 1 / scale`` is an IEEE FP32 division.

Behaviour where numerics §2.1 / §2.2 leave a choice:

- ``current_scale`` with a NaN amax returns scale 1 (numerics §2.1: "if amax is ... not
  finite, scale = 1"). TE's kernel would produce a NaN scale there; this follows numerics, so a NaN input
  element quantizes to NaN while the other elements stay finite.
- ``eps`` is applied before the zero / non-finite test, as in TE: with ``eps > 0`` an
  all-zero tensor gets ``scale = fp8_max / eps``, not 1.
- ``delayed_update`` clamps an infinite new scale (amax so small that ``fp8_max / amax``
  overflows) to FP32_MAX, after the ``2**margin`` division. numerics §2.2 is silent and TE does
  not clamp there; an inf scale would make ``0 * scale`` NaN, so we clamp as §2.1 does.
- ``delayed_update`` accepts a history of shape [L] (scale 0-d) or [L, n] (scale [n], one
  column per tensor, TE's layout); the reduction is over dim 0.
- A non-finite amax (Inf / NaN, recorded in slot 0) is not committed: that update keeps the
  old scale and the old history (slot 0 zeroed, no roll). TE would keep it in the window and
  freeze the scale for the whole history length (1024 steps by default); numerics §2.2 asks only
  that a non-finite amax keep the old scale.
- ``margin`` is limited by :func:`max_margin`, so that the scale and its inverse stay finite
  and non-zero for every finite amax (a larger one makes outputs NaN or zero).

- Power-of-two scales are at least :func:`common.min_pow2_scale` (E4M3 2**-119, E5M2
  2**-112): rounding ``fp8_max / amax`` down for an amax above about 2.98e38 would otherwise
  give a scale whose largest code decodes to ``2**128`` = inf. Such tensors saturate to
  ``±fp8_max * min_pow2_scale`` instead, so a finite input always decodes finite.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from hybridfp.formats.common import FP32_MAX, fp8_max, min_pow2_scale, pow2_floor, saturating_cast_fp8

#: Valid values of ``delayed_update(algo=...)`` (TE's ``amax_compute_algo``).
AMAX_COMPUTE_ALGOS: tuple[str, ...] = ("max", "most_recent")


def current_scale(
    amax: torch.Tensor,
    dtype: torch.dtype,
    *,
    eps: float = 0.0,
    power_2_scale: bool = False,
) -> torch.Tensor:
    """Scale from an amax, elementwise on any shape (numerics §2.1); returns FP32.

    ``a = max(amax, eps)``; ``scale = fp8_max / a``; 1 where ``a`` is 0 or not finite;
    FP32_MAX where the division overflows; optionally rounded down to a power of two, and then
    at least ``min_pow2_scale(dtype)`` (a finite input never decodes to inf).
    """
    m = fp8_max(dtype)
    # clamp_min keeps NaN (torch propagates NaN through clamp), so the test below catches it.
    a = amax.float().clamp_min(eps)
    scale = torch.full_like(a, m) / a
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where((a == 0) | ~torch.isfinite(a), torch.ones_like(scale), scale)
    if power_2_scale:
        # scale >= 448 / FP32_MAX is always a normal FP32 number, so clearing the mantissa
        # is an exact round-down (1 and FP32_MAX map to 1 and 2**127).
        scale = pow2_floor(scale).clamp_min(min_pow2_scale(dtype))
    return scale


def quantize(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with a per-tensor FP32 ``scale``; returns ``(data, scale_inv)``.

    ``data = saturating_cast_fp8(x.float() * scale)`` keeps x's shape, in ``dtype``;
    ``scale_inv = 1 / scale`` (0-d FP32, IEEE division). Usable for current scaling (scale
    from :func:`current_scale`) and delayed scaling (scale from the last update).
    """
    s = scale.float().to(x.device)
    data = saturating_cast_fp8(x.float() * s, dtype)
    # An explicit division rather than torch.reciprocal: numerics §2 asks for IEEE division.
    scale_inv = torch.ones_like(s) / s
    return data, scale_inv


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``data.float() * scale_inv`` (exact FP8 -> FP32 upcast, one FP32 rounding), cast to out_dtype."""
    return (data.float() * scale_inv.float().to(data.device)).to(out_dtype)


def record_amax(amax_history: torch.Tensor, amax: torch.Tensor) -> None:
    """Record an amax in slot 0 of the history, in place: ``h[0] = maximum(h[0], amax)``.

    Slot 0 is the pending slot: it holds the largest amax since the last update, committed to
    the window by :func:`delayed_update`. ``torch.maximum`` propagates NaN, so a NaN amax
    reaches the update, which then commits nothing (as for Inf).
    """
    amax_history[0] = torch.maximum(amax_history[0], amax.float().to(amax_history.device))


def delayed_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    margin: int = 0,
    algo: str = "max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update (numerics §2.2); returns ``(new_history, new_scale)``.

    ``amax = history.max(0)`` (``algo="max"``) or ``history[0]`` (``"most_recent"``);
    ``new_scale = (fp8_max / amax) / 2**margin``, the old scale kept where amax <= 0 or is
    not finite, an inf result clamped to FP32_MAX. ``new_history`` is the history rolled by
    -1 along dim 0 with slot 0 zeroed (TE's layout). Where the pending amax (slot 0) is not
    finite, nothing is committed: the old scale, and the old history with slot 0 zeroed
    (decided on the device, per column: no host synchronization). The inputs are not
    modified; see :func:`uncommitted` for which columns were skipped.
    """
    if algo == "max":
        # amax (unlike max) propagates NaN, which must keep the old scale.
        amax = amax_history.float().amax(dim=0)
    elif algo == "most_recent":
        amax = amax_history[0].float()
    else:
        raise ValueError(
            f"amax compute algo {algo!r} is unknown; use one of {list(AMAX_COMPUTE_ALGOS)}."
        )
    old = scale.float()
    new = (torch.full_like(amax, fp8_max(dtype)) / amax) / float(2.0**margin)
    new = torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
    skipped = uncommitted(amax_history)
    keep = ~(amax > 0) | ~torch.isfinite(amax) | skipped
    new_scale = torch.where(keep, old, new)
    rolled = torch.roll(amax_history, -1, 0)
    rolled[0].zero_()  # a kernel: assigning a Python scalar copies it from the host (a sync)
    unrolled = amax_history.clone()
    unrolled[0].zero_()
    new_history = torch.where(skipped, unrolled, rolled)  # [n] broadcasts over [L, n]
    return new_history, new_scale


def uncommitted(amax_history: torch.Tensor) -> torch.Tensor:
    """Where the pending amax (slot 0) is Inf or NaN: the columns :func:`delayed_update` leaves
    uncommitted (a bool tensor of slot 0's shape, on its device)."""
    return ~torch.isfinite(amax_history[0])


@lru_cache(maxsize=None)
def max_margin(dtype: torch.dtype) -> int:
    """The largest ``margin`` for which :func:`delayed_update` gives a finite, non-zero scale
    with a finite inverse for every finite amax (8 for E4M3, 15 for E5M2).

    The smallest scale comes from the largest amax, FP32_MAX: ``(fp8_max / FP32_MAX) /
    2**margin``; its inverse ``scale_inv`` overflows first, so that is the bound.

    Parameters
    ----------
    dtype:
        The FP8 element dtype.

    Returns
    -------
    The bound, computed with the update's own FP32 operations.
    """
    one = torch.ones((), dtype=torch.float32)
    smallest = torch.full_like(one, fp8_max(dtype)) / torch.full_like(one, FP32_MAX)
    margin = 0
    while True:
        scale = smallest / float(2.0 ** (margin + 1))
        if not (scale > 0 and torch.isfinite(one / scale)):
            return margin
        margin += 1
