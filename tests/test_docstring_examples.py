"""The ``Example`` sections of the public docstrings run as written (doctest), so what a user
copies from ``help()`` works."""

from __future__ import annotations

import doctest
import importlib
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: Every library module whose docstrings hold an example (``>>>``), found from the sources so a
#: new example is run without a change here.
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "hybridfp").rglob("*.py") if ">>> " in p.read_text())


#: The benchmarks' modules with examples: their statistics and planning helpers run on the CPU.
BENCH_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "bench").rglob("*.py") if ">>> " in p.read_text())


def test_examples_are_found():
    assert "hybridfp.quantizers.hybrid" in MODULES and "hybridfp.nn.linear" in MODULES
    assert "bench.convergence_stats" in BENCH_MODULES and "bench.protocol" in BENCH_MODULES


def _run_examples(name: str) -> None:
    module = importlib.import_module(name)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's once-per-pair emulation notices
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} example lines of {name} failed (see above)"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    _run_examples(name)


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_bench_docstring_examples_run(name, monkeypatch):
    from bench import common
    monkeypatch.setattr(common, "DEVICE", "cpu")  # the examples that time a call do it on the CPU here
    _run_examples(name)
