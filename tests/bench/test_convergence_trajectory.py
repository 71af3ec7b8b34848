"""bench.convergence_trajectory: the paired gaps at every evaluation, by hand."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from bench import convergence_trajectory as ct


def _write(path, curves):
    """label -> {step: val_loss}; a training record at each evaluated step after 0."""
    with gzip.open(path, "wt") as f:
        for label, curve in curves.items():
            for step, v in sorted(curve.items()):
                rec = {"step": step, "recipe": label, "val_loss": v}
                if step:
                    rec.update(train_loss=2.0, tokens_per_s=100.0)
                f.write(json.dumps(rec) + "\n")
    return path


def test_gaps_by_step_by_hand(tmp_path):
    # gaps (%): step 10: +1, +3, +2 (mean 2, sd 1); step 20: +2, +4, +3 (mean 3, sd 1), r = 1
    curves = {}
    for seed, (g10, g20) in enumerate([(1.0, 2.0), (3.0, 4.0), (2.0, 3.0)]):
        curves[f"bf16@seed={seed}"] = {0: 5.0, 10: 2.0, 20: 1.0}
        curves[f"fp8@seed={seed}"] = {0: 5.0, 10: 2.0 * (1 + g10 / 100), 20: 1.0 * (1 + g20 / 100)}
    rows = ct.gaps_by_step([_write(tmp_path / "m.jsonl.gz", curves)], steps=20)["fp8"]
    assert [r["step"] for r in rows] == [0, 10, 20] and all(r["seeds"] == 3 for r in rows)
    assert rows[0]["gap_pct"] == 0.0 and rows[0]["r_final"] is None  # constant gaps: no correlation
    assert math.isclose(rows[1]["gap_pct"], 2.0) and math.isclose(rows[1]["sd"], 1.0)
    assert math.isclose(rows[2]["gap_pct"], 3.0) and math.isclose(rows[2]["sd"], 1.0)
    assert math.isclose(rows[1]["r_final"], 1.0)
    md = ct.to_markdown({"fp8": rows})
    assert "| `fp8` | 10 | 3 | +2.00 % | 1.00 % | 1.00 |" in md


def test_failed_runs_and_unpaired_seeds_are_left_out(tmp_path):
    curves = {"bf16@seed=0": {0: 5.0, 10: 2.0}, "bf16@seed=1": {0: 5.0, 10: 2.0},
              "fp8@seed=0": {0: 5.0, 10: 2.02}, "fp8@seed=1": {0: 5.0},  # stopped before step 10
              "fp8@seed=7": {0: 5.0, 10: 2.0}}  # no bf16 seed 7
    rows = ct.gaps_by_step([_write(tmp_path / "m.jsonl.gz", curves)], steps=10)["fp8"]
    assert [(r["step"], r["seeds"]) for r in rows] == [(0, 1), (10, 1)] and rows[1]["sd"] is None
    assert math.isclose(rows[1]["gap_pct"], 1.0)


def test_refusals_and_command_line(tmp_path, capsys):
    only = _write(tmp_path / "a.jsonl.gz", {"fp8@seed=0": {0: 5.0, 10: 2.0}})
    with pytest.raises(ValueError, match="no complete bf16 run"):
        ct.gaps_by_step([only])
    with pytest.raises(SystemExit, match="bench.convergence_trajectory: .*no complete bf16 run"):
        ct.main([str(only)])
    good = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": {0: 5.0, 10: 2.0}, "fp8@seed=0": {0: 5.0, 10: 2.04}})
    ct.main([str(good), "--json", str(tmp_path / "t.json")])
    assert "| `fp8` | 10 | 1 | +2.00 % |" in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())["fp8"][1]["step"] == 10


def test_the_committed_ten_seed_study_sets_its_gaps_early():
    """What docs/convergence.md states of the committed metrics: the per-seed gaps' spread at the
    first evaluation after warm-up is already that of the end, and correlates with the final gaps."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "docs" / "convergence"
    t = ct.gaps_by_step([root / "gpt100m-3seeds-446steps.metrics.jsonl.gz",
                         root / "gpt100m-fp8block-mxfp8-seeds3-9-446steps.metrics.jsonl.gz"], steps=446)
    for recipe in ("fp8-block", "mxfp8"):
        by_step = {r["step"]: r for r in t[recipe]}
        assert by_step[111]["sd"] > 0.7 and by_step[446]["sd"] > 0.9, recipe
    assert by_step[111]["r_final"] > 0.8  # mxfp8: the final ranking of the seeds is set by step 111
