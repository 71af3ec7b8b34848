"""Capture: a recipe of probe quantizers that see every GEMM operand, passing it unquantized.

Each slot of each hybridfp module gets a ``ProbeQuantizer`` (an Identity quantizer, so the
model runs in high precision) that reports the tensor it is asked to quantize to a
``Recorder``. The recorder pairs the operands of each GEMM (numerics §1) and measures every
candidate format on them at once: fprop when a layer's input and weight are both seen, dgrad
and wgrad when its grad_output arrives. It then drops its reference to the input, which
autograd held for backward anyway; nothing is kept past the layer's backward but sums.

The probe wraps ``quantize`` on the instance: MoE's grouped quantize then calls it once per
expert (``moe/plan.py``: a wrapped ``quantize`` must see every call).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Optional

import torch

from ..quantizers import IdentityQuantizer, Quantizer
from ..recipes import QuantizerRole
from ..tensors import QuantizedTensor
from .candidates import CANDIDATES, OPERANDS, dequantized, make_quantizer
from .stats import ErrorSums, OperandStats

SLOTS = ("input", "weight", "grad_output")


class ProbeQuantizer(IdentityQuantizer):
    """Passes tensors through unquantized and reports each to its recorder.

    Parameters
    ----------
    recorder:
        The ``Recorder`` to report to.
    key:
        (layer name, set index): the index tells a GroupedLinear's experts apart.
    tensor_type:
        "input", "weight" or "grad_output".
    """

    def __init__(self, recorder: "Recorder", key: tuple[str, int], tensor_type: str) -> None:
        super().__init__()
        self.recorder, self.key, self.tensor_type = recorder, key, tensor_type
        self.quantize = self._probe  # type: ignore[method-assign]

    def _probe(self, x: torch.Tensor) -> QuantizedTensor:
        self.recorder.see(self.key, self.tensor_type, x.detach())
        return IdentityQuantizer.quantize(self, x)

    def share_key(self) -> Optional[Hashable]:
        """Never shared: every layer must report its own input."""
        return None


class Recorder:
    """Pairs each GEMM's operands and accumulates every candidate's error on them.

    Parameters
    ----------
    formats:
        Candidate names to measure (default: all of ``CANDIDATES``).
    max_rows:
        Measure at most this many rows (tokens) of each GEMM, evenly spaced; None: all. A cap
        bounds the analysis' time on long batches.
    """

    def __init__(self, formats: Optional[tuple[str, ...]] = None, max_rows: Optional[int] = None) -> None:
        self.formats = tuple(formats or CANDIDATES)
        for f in self.formats:
            if f not in CANDIDATES:
                raise ValueError(f"analyze(formats=...): {f!r} is unknown; use names from "
                                 f"{', '.join(CANDIDATES)}.")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"analyze(max_rows={max_rows}) must be at least 1 (or None: every row).")
        self.max_rows = max_rows
        #: (layer, gemm, format) -> error sums; (layer, tensor_type) -> outlier statistics.
        self.errors: dict[tuple[str, str, str], ErrorSums] = defaultdict(ErrorSums)
        self.operands: dict[tuple[str, str], OperandStats] = defaultdict(OperandStats)
        self.module_types: dict[str, str] = {}
        self._made: dict[tuple[str, str], int] = defaultdict(int)
        self._held: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
        #: per probe key, the inputs of calls whose backward has not run yet (latest last)
        self._inputs: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)
        self._pending: set[tuple[str, int]] = set()
        self._delayed: dict[tuple, Quantizer] = {}

    # ------------------------------------------------------------------ the recipe's factory
    def factory(self, role: Optional[QuantizerRole]) -> Quantizer:
        """The ``CustomRecipe`` factory: a probe for hybridfp's three GEMM slots."""
        if role is None or role.tensor_type not in SLOTS:
            return IdentityQuantizer()
        name = role.name or role.module_type or "(unnamed)"
        index = self._made[(name, role.tensor_type)]
        self._made[(name, role.tensor_type)] += 1
        self.module_types[name] = role.module_type or ""
        return ProbeQuantizer(self, (name, index), role.tensor_type)

    # ------------------------------------------------------------------ operands
    def see(self, key: tuple[str, int], tensor_type: str, x: torch.Tensor) -> None:
        """One operand arrives (2D view, FP32).

        Parameters
        ----------
        key:
            (layer name, set index) of the probe that saw it.
        tensor_type:
            "input", "weight" or "grad_output".
        x:
            The tensor the layer asked to quantize.

        Raises
        ------
        ValueError
            A grad_output whose token count differs from the input it pairs with (a layer
            whose calls' backwards run out of order).
        """
        x2 = x.reshape(-1, x.shape[-1]).float()
        held = self._held[key]
        inputs = self._inputs[key]
        if tensor_type == "grad_output":
            if "weight" in held:
                self._measure(key, "dgrad", x2, held["weight"])
            if inputs:
                # a layer called several times before its backward (shared, tied or
                # recomputed): autograd runs backward in reverse order of forward, so the
                # latest input pairs with the first grad_output
                x_in = inputs.pop()
                if x_in.shape[0] != x2.shape[0]:
                    raise ValueError(f"analyze: layer {key[0]!r}: a grad_output of {x2.shape[0]} tokens "
                                     f"pairs with an input of {x_in.shape[0]}; its calls' backwards ran "
                                     "out of reverse order, so wgrad cannot pair them.")
                self._measure(key, "wgrad", x2, x_in)
            return
        old = inputs[-1] if tensor_type == "input" and inputs else held.get(tensor_type)
        if old is not None and old.data_ptr() == x2.data_ptr() and old.shape == x2.shape:
            if tensor_type == "weight" and key in self._pending:
                self._pending.discard(key)  # the same weight for a new call's input
                self._measure(key, "fprop", inputs[-1], old)
            return  # the same tensor again (re-quantized for backward): measured already
        if tensor_type == "input":
            inputs.append(x2)
            self._pending.add(key)
        else:
            held[tensor_type] = x2
        if key in self._pending and inputs and "weight" in held:
            self._pending.discard(key)
            self._measure(key, "fprop", inputs[-1], held["weight"])

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """At most ``max_rows`` tokens, evenly spaced (not the first ones: early positions of a
        sequence are not typical of it)."""
        if self.max_rows is None or t.shape[0] <= self.max_rows:
            return t
        step = -(-t.shape[0] // self.max_rows)
        return t[::step].contiguous()

    def _quantizer(self, fmt: str, key: tuple[str, int], tensor_type: str, direction: str) -> Quantizer:
        if fmt != "fp8_delayed":
            return make_quantizer(fmt, tensor_type, direction)
        # delayed scaling scales by the previous steps' amaxes: one quantizer per operand copy,
        # calibrated on its first tensor (as ``hybridfp.report``'s "after 1 update")
        slot = (key, tensor_type, direction)
        q = self._delayed.get(slot)
        if q is None:
            q = self._delayed[slot] = make_quantizer(fmt, tensor_type, direction)
            q._calibrate = True  # type: ignore[attr-defined]
            q._delayed = True  # type: ignore[attr-defined]
        return q

    def _measure(self, key: tuple[str, int], gemm: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Measure every candidate on one GEMM: a, b as ARCHITECTURE.md's table orders them."""
        (ta, da), (tb, dbn) = OPERANDS[gemm]
        a = self._rows(a)
        if gemm == "wgrad":  # both operands are indexed by token
            b = self._rows(b)
        ref = self._product(gemm, a, b)
        axes = (1 if da == "rowwise" else 0, 1 if dbn == "rowwise" else 0)
        name = key[0]
        with torch.no_grad():
            for fmt in self.formats:
                if gemm not in CANDIDATES[fmt].gemms:
                    continue
                qa = self._quantizer(fmt, key, ta, da)
                qb = self._quantizer(fmt, key, tb, dbn)
                xa, na = self._decode(qa, a, da)
                xb, nb = self._decode(qb, b, dbn)
                self.errors[(name, gemm, fmt)].add(ref, self._product(gemm, xa, xb), (a, b), (xa, xb),
                                                   na + nb, axes)
            # each operand once per step, blocked along the reduction of its first GEMM
            if gemm == "fprop":
                self.operands[(name, "input")].add(a, 1)
                self.operands[(name, "weight")].add(b, 1)
            elif gemm == "dgrad":
                self.operands[(name, "grad_output")].add(a, 1)

    @staticmethod
    def _decode(q: Quantizer, x: torch.Tensor, direction: str) -> tuple[torch.Tensor, int]:
        if getattr(q, "_calibrate", False):
            q.quantize(x)
            q.update_scale()  # type: ignore[attr-defined]
            q._calibrate = False  # type: ignore[attr-defined]
        out = dequantized(q, x, direction)
        if getattr(q, "_delayed", False):
            q.update_scale()  # type: ignore[attr-defined]
        return out

    @staticmethod
    def _product(gemm: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """fprop: a [M, K] b [N, K] -> a bᵀ; dgrad: a [M, N] b [N, K] -> a b; wgrad: aᵀ b."""
        if gemm == "fprop":
            return a @ b.t()
        if gemm == "dgrad":
            return a @ b
        return a.t() @ b

    def layers(self) -> list[str]:
        """Layer names in the order first seen."""
        return list(dict.fromkeys(k[0] for k in self.errors))

