"""README's Python examples run as printed (a user copies them first)."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10((x.square().sum() / (x - y).square().sum()).item())


def test_readme_examples_run_and_quantize_as_the_format_table_says(capsys):
    blocks = _blocks()
    assert len(blocks) == 2, "README's examples changed: update this test"
    ns: dict = {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's once-per-pair emulation notices
        exec(compile(blocks[0], "README example 1", "exec"), ns)
        loss = ns["loss"].item()
        assert math.isfinite(loss) and 0 < loss < 10
        assert re.search(r"loss \d+\.\d{4}", capsys.readouterr().out)
        exec(compile(blocks[1], "README example 2", "exec"), ns)
    x, fwd, bwd = ns["x"], ns["fwd"], ns["bwd"]
    assert fwd.shape == bwd.shape == x.shape
    # README's format table: NVFP4 1x16 ~20.4 dB on Gaussian data; the columnwise MXFP8 copy
    # re-quantizes the NVFP4 value, so it carries (about) the same error, never less
    assert 19.0 < _sqnr_db(x, fwd) < 22.0
    assert 19.0 < _sqnr_db(x, bwd) <= _sqnr_db(x, fwd) + 0.1
