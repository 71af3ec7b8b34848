"""bench.convergence_report: gaps vs BF16 and vs the BF16 mean, from a metrics file."""

import gzip
import json

import pytest

from bench import convergence_report


def _write(path, rows):
    with gzip.open(path, "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_report_gaps_and_noise_floor(tmp_path):
    path = tmp_path / "m.jsonl.gz"
    rows = []
    for recipe, v in (("bf16", 1.0), ("bf16@seed=1", 0.98), ("fp8", 1.0099)):
        rows += [{"step": 0, "recipe": recipe, "val_loss": 5.0},
                 {"step": 10, "recipe": recipe, "train_loss": 2.0, "tokens_per_s": 100.0},
                 {"step": 20, "recipe": recipe, "train_loss": 1.5, "tokens_per_s": 300.0},
                 {"step": 20, "recipe": recipe, "val_loss": v}]
    _write(path, rows)
    text = convergence_report.report(path)
    # fp8: +0.99 % vs bf16, +1.0099/0.99 - 1 = +2.01 % vs the BF16 mean; target 0.25 %
    assert "| `fp8` | 1.0099 | +0.99 % | +2.01 % | <= 0.25 % | 300 |" in text
    assert "| `bf16@seed=1` | 0.9800 | -2.00 % | -1.01 % |  | 300 |" in text
    assert "final spread 2.02 % of their mean (0.9900)" in text
    assert "| 20 | -2.00 | +0.99 |" in text


def test_report_needs_a_bf16_run(tmp_path):
    path = tmp_path / "m.jsonl.gz"
    _write(path, [{"step": 5, "recipe": "fp8", "val_loss": 1.0}])
    with pytest.raises(SystemExit, match="no bf16 run"):
        convergence_report.report(path)
