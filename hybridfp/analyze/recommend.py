"""Recommend: per layer and GEMM the cheapest format within an error budget; the factory.

Cheapest = the narrowest element (``Candidate.tier``: 4 < 8 < 16 bits); among formats of one
width that meet the budget, the fastest GEMM (``Candidate.speed``), then the most accurate. ``high_precision`` meets every budget, so a
GEMM no low-precision format serves stays unquantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..quantizers import HybridQuantizer, IdentityQuantizer, Quantizer
from ..recipes import QuantizerRole
from .candidates import CANDIDATES, GEMMS, candidate, make_quantizer
from .run import Analysis

Choice = tuple[str, str, str]  # (fprop, dgrad, wgrad) format names
#: The formats ``Budget(like=...)`` accepts: those that serve every GEMM.
BUDGET_LIKE: tuple[str, ...] = tuple(name for name, c in CANDIDATES.items() if c.gemms == GEMMS)


@dataclass(frozen=True)
class Budget:
    """An error budget per GEMM output.

    Parameters
    ----------
    db:
        Every GEMM output's SQNR must be at least this many dB.
    like:
        A format name: every GEMM output must be no worse than under that format (measured on
        the same GEMM), e.g. "mxfp8". It must serve every GEMM (``BUDGET_LIKE``): a format
        measured on some GEMMs only (``nvfp4_rht``: wgrad) sets no bar for the others.

    Raises
    ------
    ValueError
        Neither or both given, an unknown format, or one that does not serve every GEMM.

    Example
    -------
    >>> from hybridfp.analyze import Budget
    >>> Budget(db=25.0).threshold(30.0)
    25.0
    """

    db: Optional[float] = None
    like: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.db is None) == (self.like is None):
            raise ValueError("Budget: give exactly one of db= (e.g. --budget-db 25) and like= (e.g. "
                             "--budget-like mxfp8).")
        if self.like is not None and self.like not in BUDGET_LIKE:
            c = candidate(self.like)
            raise ValueError(f"Budget: like={self.like!r} cannot serve {', '.join(g for g in GEMMS if g not in c.gemms)} "
                             f"(it serves {', '.join(c.gemms)} only), so it sets no bar there; use one of "
                             f"{', '.join(BUDGET_LIKE)}, or db=.")

    def threshold(self, like_db: float) -> float:
        """The SQNR a GEMM output must reach, given that GEMM's SQNR under ``like``."""
        return float(self.db) if self.db is not None else like_db

    def describe(self) -> str:
        """One phrase for tables and the factory's docstring."""
        return f"{self.db:g} dB per GEMM output" if self.db is not None else f"no worse than {self.like}"


def recommend(analysis: Analysis, budget: Budget) -> dict[str, Choice]:
    """Per layer, the format of each GEMM (fprop, dgrad, wgrad) that meets ``budget`` cheapest.

    Parameters
    ----------
    analysis:
        From ``hybridfp.analyze``.
    budget:
        The error budget.

    Returns
    -------
    dict
        layer name -> (fprop, dgrad, wgrad) format names.

    Raises
    ------
    ValueError
        ``budget.like`` names a format the analysis did not measure, or one whose SQNR on a
        layer's GEMM is missing (names the layer and GEMM).
    """
    if budget.like is not None and budget.like not in analysis.formats:
        raise ValueError(f"budget like={budget.like!r}: the analysis did not measure it; measured: "
                         f"{', '.join(analysis.formats)}.")
    out: dict[str, Choice] = {}
    for layer in analysis.layers:
        picks = []
        for gemm in GEMMS:
            ref = analysis.output_db(layer, gemm, budget.like) if budget.like else math.nan
            if budget.like is not None and math.isnan(ref):
                raise ValueError(f"recommend: layer {layer!r}, {gemm}: no SQNR measured under the budget's "
                                 f"like={budget.like!r}, so there is no bar to compare with; analyze that "
                                 "GEMM under it, or use Budget(db=...).")
            need = budget.threshold(ref)
            ok = [f for f in analysis.formats_for(gemm)
                  if not math.isnan(analysis.output_db(layer, gemm, f)) and analysis.output_db(layer, gemm, f) >= need]
            ok.sort(key=lambda f: (CANDIDATES[f].tier, -CANDIDATES[f].speed, -analysis.output_db(layer, gemm, f)))
            picks.append(ok[0] if ok else "high_precision")
        out[layer] = (picks[0], picks[1], picks[2])
    return out


class PlanFactory:
    """A quantizer factory from a per-layer plan (picklable: a dict of strings).

    input -> Hybrid(row=fprop, col=wgrad); weight -> Hybrid(row=fprop, col=dgrad);
    grad_output -> Hybrid(row=dgrad, col=wgrad); a plain quantizer where the two agree.
    Roles of layers not in the plan (and other tensor types) get ``default`` for all GEMMs.

    Parameters
    ----------
    plan:
        layer name -> (fprop, dgrad, wgrad) format names (``CANDIDATES``).
    default:
        The formats for layers the plan does not name.

    Raises
    ------
    ValueError
        A format unknown or unable to serve its GEMM (names the layer).

    Example
    -------
    >>> import hybridfp as hf
    >>> from hybridfp.analyze import PlanFactory
    >>> f = PlanFactory({"fc": ("nvfp4_1d", "mxfp8", "mxfp8")})
    >>> q = f(hf.QuantizerRole("linear", "input", "fc"))
    >>> q.rowwise_quantizer.format_name, q.columnwise_quantizer.format_name
    ('nvfp4', 'mxfp8')
    """

    def __init__(self, plan: dict[str, Choice], default: Choice = ("high_precision",) * 3) -> None:
        for layer, choice in [*plan.items(), ("(default)", default)]:
            if len(choice) != 3:
                raise ValueError(f"PlanFactory: layer {layer!r} needs (fprop, dgrad, wgrad); got {choice!r}.")
            for gemm, name in zip(GEMMS, choice):
                try:
                    candidate(name, gemm)
                except ValueError as e:
                    raise ValueError(f"PlanFactory: layer {layer!r}, {gemm}: {e}") from None
        self.plan = {k: tuple(v) for k, v in plan.items()}
        self.default = tuple(default)

    def __call__(self, role: Optional[QuantizerRole]) -> Quantizer:
        """The quantizer for ``role``.

        Parameters
        ----------
        role:
            The slot to fill, or None.

        Returns
        -------
        Quantizer
        """
        t = None if role is None else role.tensor_type
        f, d, w = self.plan.get(role.name if role is not None else None, self.default)
        pair = {"input": (f, w), "weight": (f, d), "grad_output": (d, w)}.get(t or "")
        if pair is None:
            return IdentityQuantizer() if f == "high_precision" else make_quantizer(f, "input")
        row, col = pair
        if row == col:
            return make_quantizer(row, t)
        return HybridQuantizer(make_quantizer(row, t), make_quantizer(col, t))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlanFactory) and (self.plan, self.default) == (other.plan, other.default)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.plan.items())), self.default))

    def __repr__(self) -> str:
        return f"PlanFactory({len(self.plan)} layers, default={self.default!r})"


def factory_source(plan: dict[str, Choice], budget: Budget, summary: str = "") -> str:
    """The text of an importable factory module for ``plan`` (``factory(role) -> Quantizer``).

    Parameters
    ----------
    plan:
        From ``recommend``.
    budget:
        The budget it meets (for the docstring).
    summary:
        A paragraph for the docstring.

    Returns
    -------
    str
        Python source: ``PLAN`` (a ``PlanFactory``) and a module-level ``factory``.
    """
    rows = "\n".join(f"    {layer!r}: {tuple(choice)!r}," for layer, choice in plan.items())
    return f'''"""Recipe recommended by ``hybridfp analyze`` (budget: {budget.describe()}).

Use: ``hybridfp train --recipe <module>:factory`` or ``CustomRecipe(qfactory=factory)``.
Per layer (fprop, dgrad, wgrad) format; layers not listed run in high precision.
{chr(10).join(_wrap(summary))}
"""

from typing import Optional

from hybridfp.analyze import PlanFactory
from hybridfp.quantizers import Quantizer
from hybridfp.recipes import QuantizerRole

PLAN = PlanFactory({{
{rows}
}})


def factory(role: Optional[QuantizerRole]) -> Quantizer:
    """The recommended quantizer for ``role`` (see the module docstring)."""
    return PLAN(role)
'''


def _wrap(text: str, width: int = 96) -> list[str]:
    words, lines, line = text.split(), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return lines + ([line] if line else [])


def write_factory(path: str | Path, plan: dict[str, Choice], budget: Budget, summary: str = "") -> Path:
    """Write ``factory_source(plan, budget, summary)`` to ``path``, an importable module.

    Parameters
    ----------
    path:
        The file to write; it must end in ``.py``.
    plan:
        From ``recommend``.
    budget:
        The budget it meets (for the module's docstring).
    summary:
        A paragraph for the module's docstring.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        ``path`` does not end in ``.py``.
    """
    path = Path(path)
    if path.suffix != ".py":
        raise ValueError(f"write_factory: {path} must end in .py to be importable.")
    path.write_text(factory_source(plan, budget, summary))
    return path
