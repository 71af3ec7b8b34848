"""``hybridfp analyze``: measure every candidate format on every GEMM of a model, recommend the
cheapest format per layer and GEMM within an error budget, and emit it as a factory file.

Modules: ``candidates`` (formats, cost), ``stats`` (streaming sums), ``capture`` (probe
quantizers, operand pairing), ``run`` (``analyze()``), ``recommend`` (budget, plan,
``PlanFactory``, factory file), ``show`` (table, heatmap, summary), ``cli``.
"""

from .candidates import CANDIDATES, GEMMS, Candidate, candidate, make_quantizer
from .recommend import BUDGET_LIKE, Budget, PlanFactory, factory_source, recommend, write_factory
from .run import Analysis, analyze
from .show import heatmap, markdown_table, summary

__all__ = ["Analysis", "BUDGET_LIKE", "Budget", "CANDIDATES", "Candidate", "GEMMS", "PlanFactory", "analyze", "candidate",
           "factory_source", "heatmap", "make_quantizer", "markdown_table", "recommend", "summary",
           "write_factory"]
