"""``hybridfp.analyze(model, batches)``: run a few high-precision steps under probe quantizers."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ..gemm import EmulatedGemmWarning
from ..recipes import CustomRecipe, autocast
from .candidates import CANDIDATES
from .capture import Recorder
from .stats import ErrorSums, OperandStats


@dataclass
class Analysis:
    """What ``analyze`` measured: per (layer, GEMM, format) error sums, per (layer, operand)
    outlier statistics, and the layers in the order first seen."""

    errors: dict[tuple[str, str, str], ErrorSums]
    operands: dict[tuple[str, str], OperandStats]
    layers: list[str]
    formats: tuple[str, ...]
    module_types: dict[str, str] = field(default_factory=dict)
    batches: int = 0

    def output_db(self, layer: str, gemm: str, fmt: str) -> float:
        """SQNR (dB) of ``layer``'s ``gemm`` output under ``fmt``; nan where not measured."""
        e = self.errors.get((layer, gemm, fmt))
        return math.nan if e is None else e.output_db

    def operand_db(self, layer: str, gemm: str, fmt: str) -> tuple[float, float]:
        """SQNR (dB) of the GEMM's two operands (A, B as ``candidates.OPERANDS`` orders them)."""
        e = self.errors.get((layer, gemm, fmt))
        return (math.nan, math.nan) if e is None else (e.a_db, e.b_db)

    def formats_for(self, gemm: str) -> list[str]:
        """The measured formats that may serve ``gemm``."""
        return [f for f in self.formats if gemm in CANDIDATES[f].gemms]


def _default_loss(out: Any) -> torch.Tensor:
    """The loss of a model output: a scalar as is; (logits, loss) -> loss; any other tensor
    -> ½·mean(out²) (a stand-in: pass ``loss_fn`` for the real loss)."""
    if isinstance(out, (tuple, list)):
        scalars = [o for o in out if isinstance(o, torch.Tensor) and o.dim() == 0]
        if scalars:
            return scalars[-1]
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"analyze: the model returned a {type(out).__name__}; pass loss_fn=(model, batch) "
                        "-> scalar loss.")
    return out if out.dim() == 0 else 0.5 * out.float().pow(2).mean()


def analyze(model: nn.Module, batches: Iterable[Any], *, loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
            formats: Optional[tuple[str, ...]] = None, max_rows: Optional[int] = None,
            seed: int = 0) -> Analysis:
    """Measure every candidate format on every GEMM of ``model``'s hybridfp modules.

    Runs forward + backward on each batch in high precision (Identity quantizers that record
    each operand), measuring per layer and GEMM (fprop, dgrad, wgrad) each format's operand
    and output SQNR, bytes per element and flushed blocks, plus each operand's outlier
    statistics. Only sums are kept across GEMMs. The model's gradients are left as computed
    (no optimizer step); zero them before training on.

    Parameters
    ----------
    model:
        A module containing hybridfp ``Linear`` / ``LayerNormLinear`` / ``LayerNormMLP`` /
        ``GroupedLinear`` layers (names set with ``hybridfp.nn.set_names`` name the rows).
    batches:
        Inputs: a tuple / list is unpacked into ``model(*batch)``, anything else is ``model(batch)``.
    loss_fn:
        (model, batch) -> scalar loss; default: the model's scalar output, the scalar of a
        (logits, loss) pair, else ½·mean(output²).
    formats:
        Candidate names (``from hybridfp.analyze import CANDIDATES``); default all.
    max_rows:
        Measure ``max_rows`` evenly spaced tokens of each GEMM only; None: all.
    seed:
        Seeds torch's generator first (stochastic rounding draws from it).

    Returns
    -------
    Analysis

    Raises
    ------
    ValueError
        No batch given, no hybridfp GEMM seen, an unknown format or a bad ``max_rows``.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin = hf.Linear(64, 32)
    >>> a = hf.analyze(lin, [torch.randn(32, 64)], formats=("mxfp8", "nvfp4_1d"))
    >>> a.output_db(a.layers[0], "fprop", "mxfp8") > a.output_db(a.layers[0], "fprop", "nvfp4_1d")
    True
    """
    recorder = Recorder(formats, max_rows)
    recipe = CustomRecipe(qfactory=recorder.factory)
    torch.manual_seed(seed)
    n = 0
    with warnings.catch_warnings():
        # the probes are Identity pairs on the emulation path by design: not the user's concern
        warnings.simplefilter("ignore", EmulatedGemmWarning)
        for batch in batches:
            with autocast(recipe=recipe):
                out = loss_fn(model, batch) if loss_fn is not None else _default_loss(
                    model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
            out.backward()
            n += 1
    if n == 0:
        raise ValueError("analyze: batches is empty; give at least one batch.")
    if not recorder.errors:
        raise ValueError("analyze: no hybridfp GEMM ran; the model needs hybridfp Linear / LayerNormLinear / "
                         "LayerNormMLP / GroupedLinear layers (hybridfp.convert swaps nn.Linear) whose "
                         "parameters require gradients.")
    return Analysis(dict(recorder.errors), dict(recorder.operands), recorder.layers(), recorder.formats,
                    dict(recorder.module_types), n)

