"""hybridfp.analyze edge cases: a budget format that serves only some GEMMs, the documented
names, a layer applied twice before its backward."""

from __future__ import annotations

import argparse
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridfp
import hybridfp as hf
from hybridfp.analyze import CANDIDATES, GEMMS, Analysis, Budget, recommend
from hybridfp.analyze.cli import add_analyze_args
from hybridfp.analyze.stats import ErrorSums

ROOT = Path(__file__).resolve().parents[2]
PARTIAL = [name for name, c in CANDIDATES.items() if c.gemms != GEMMS]


@pytest.mark.parametrize("name", PARTIAL)
def test_budget_like_refuses_a_format_that_does_not_serve_every_gemm(name):
    with pytest.raises(ValueError, match=rf"like={name!r}.*cannot serve"):
        Budget(like=name)


def test_cli_budget_like_offers_only_formats_serving_every_gemm():
    p = argparse.ArgumentParser()
    add_analyze_args(p)
    action = next(a for a in p._actions if a.dest == "budget_like")
    assert "mxfp8" in action.choices
    assert not set(PARTIAL) & set(action.choices)


def _sums(db: float) -> ErrorSums:
    return ErrorSums(out_signal=10 ** (db / 10), out_noise=1.0)


def test_recommend_refuses_a_budget_reference_that_was_not_measured():
    """A like= reference missing for one GEMM is an error naming the layer and GEMM, never a
    comparison against NaN that silently keeps the GEMM in high precision."""
    errors = {("fc", g, f): _sums(db) for g in GEMMS for f, db in (("high_precision", 300.0), ("mxfp8", 30.0))}
    del errors[("fc", "dgrad", "mxfp8")]
    a = Analysis(errors, {}, ["fc"], ("high_precision", "mxfp8"))
    with pytest.raises(ValueError, match=r"'fc'.*dgrad.*mxfp8"):
        recommend(a, Budget(like="mxfp8"))


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_docs_analysis_python_example_runs():
    blocks = _python_blocks((ROOT / "docs" / "analysis.md").read_text())
    assert blocks, "docs/analysis.md has no runnable ```python example"
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/analysis.md example {i + 1}", "exec"), ns)


def _documented_names() -> list[tuple[str, str]]:
    """(where, dotted name) for every ``hybridfp.analyze.<name>`` the docs and docstrings use as
    an attribute (``python -m hybridfp.analyze.<module>`` and imports are module paths)."""
    texts = {"docs/analysis.md": (ROOT / "docs" / "analysis.md").read_text(),
             "README.md": (ROOT / "README.md").read_text()}
    for path in sorted((ROOT / "hybridfp" / "analyze").glob("*.py")):
        texts[str(path.relative_to(ROOT))] = path.read_text()
    texts["hybridfp.analyze.__doc__"] = inspect.getdoc(hf.analyze) or ""
    out = []
    for where, text in texts.items():
        for m in re.finditer(r"(-m |from |import )?(hybridfp\.analyze(?:\.\w+)+)", text):
            if m.group(1) is None:
                out.append((where, m.group(2)))
    return out


def test_every_documented_hybridfp_analyze_attribute_resolves():
    names = _documented_names()
    for where, dotted in names:
        obj = hybridfp
        for part in dotted.split(".")[1:]:
            assert hasattr(obj, part), f"{where}: {dotted} does not resolve (hybridfp.analyze is the function)"
            obj = getattr(obj, part)


class Twice(nn.Module):
    """One layer applied twice in one forward (as a tied or shared block)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = hf.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc(x))


def test_a_layer_applied_twice_pairs_each_call_with_its_own_operands():
    """Each call's fprop and wgrad are measured on that call's operands: the high-precision
    output energies equal those of the two products computed here (same operands)."""
    torch.manual_seed(0)
    m = Twice()
    x = torch.randn(32, 16)
    a = hf.analyze(m, [x], formats=("high_precision",))
    w = m.fc.weight.detach()
    xr = x.clone().requires_grad_(True)
    h = xr @ w.t()
    h.retain_grad()
    y = h @ w.t()
    y.retain_grad()
    (0.5 * y.pow(2).mean()).backward()
    hd = h.detach()
    want = {"fprop": (x @ w.t()).double().pow(2).sum() + (hd @ w.t()).double().pow(2).sum(),
            "dgrad": (y.grad @ w).double().pow(2).sum() + (h.grad @ w).double().pow(2).sum(),
            "wgrad": (y.grad.t() @ hd).double().pow(2).sum() + (h.grad.t() @ x).double().pow(2).sum()}
    layer = a.layers[0]
    for gemm, energy in want.items():
        got = a.errors[(layer, gemm, "high_precision")].out_signal
        assert got == pytest.approx(energy.item(), rel=1e-5), gemm
