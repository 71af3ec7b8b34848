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
    # gaps (%) at steps 10 / 20 / 30 for five seeds; step 20's are step 30's less 1 (r = 1), step
    # 10's are step 30's reversed (r = -1)
    final = [1.0, 2.0, 3.0, 4.0, 5.0]
    curves = {}
    for seed, g30 in enumerate(final):
        g10, g20 = final[4 - seed], g30 - 1.0
        curves[f"bf16@seed={seed}"] = {0: 5.0, 10: 2.0, 20: 1.5, 30: 1.0}
        curves[f"fp8@seed={seed}"] = {0: 5.0, 10: 2.0 * (1 + g10 / 100), 20: 1.5 * (1 + g20 / 100),
                                      30: 1.0 * (1 + g30 / 100)}
    rows = ct.gaps_by_step([_write(tmp_path / "m.jsonl.gz", curves)], steps=30)["fp8"]
    assert [r["step"] for r in rows] == [0, 10, 20, 30] and all(r["seeds"] == 5 for r in rows)
    assert rows[0]["gap_pct"] == 0.0 and rows[0]["r_final"] is None and rows[3]["r_final"] is None
    sd = math.sqrt(2.5)  # of 1..5
    assert math.isclose(rows[2]["gap_pct"], 2.0) and math.isclose(rows[2]["sd"], sd)
    assert math.isclose(rows[3]["gap_pct"], 3.0) and math.isclose(rows[3]["sd"], sd)
    assert math.isclose(rows[2]["r_final"], 1.0) and math.isclose(rows[1]["r_final"], -1.0)
    md = ct.to_markdown({"fp8": rows})
    assert f"| `fp8` | 20 | 5 | +2.00 % | {sd:.2f} % | 1.00 |" in md and f"| `fp8` | 30 | 5 | +3.00 % | {sd:.2f} % | — |" in md
    three = {k: v for k, v in curves.items() if int(k[-1]) < 3}  # under five seeds: no correlation shown
    assert all(r["r_final"] is None for r in ct.gaps_by_step([_write(tmp_path / "t.jsonl.gz", three)])["fp8"])


def test_runs_that_ended_apart_need_the_planned_steps(tmp_path):
    curves = {"bf16@seed=0": {0: 5.0, 10: 2.0, 20: 1.0}, "fp8@seed=0": {0: 5.0, 10: 2.02, 20: 1.01},
              "bf16@seed=1": {0: 5.0, 10: 2.0, 20: 1.0}, "fp8@seed=1": {0: 5.0, 10: 2.04}}  # short
    path = _write(tmp_path / "m.jsonl.gz", curves)
    with pytest.raises(ValueError, match=r"ended at different steps \(\[10, 20\]\).*--steps"):
        ct.gaps_by_step([path])
    rows = ct.gaps_by_step([path], steps=20)["fp8"]  # the short run is left out, not the step
    assert [(r["step"], r["seeds"]) for r in rows] == [(0, 1), (10, 1), (20, 1)]


def test_excluded_recipes_are_left_out(tmp_path):
    curves = {"bf16@seed=0": {0: 5.0, 10: 2.0}, "fp8@seed=0": {0: 5.0, 10: 2.02}, "mxfp8@seed=0": {0: 5.0, 10: 2.04}}
    t = ct.gaps_by_step([_write(tmp_path / "m.jsonl.gz", curves)], exclude={"fp8"})
    assert list(t) == ["mxfp8"]


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
    """What docs/convergence.md states of the committed metrics: no downward trend in the per-seed
    gaps' spread after warm-up, and by the half-way evaluation they correlate with the final ones."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "docs" / "convergence"
    t = ct.gaps_by_step([root / "gpt100m-3seeds-446steps.metrics.jsonl.gz",
                         root / "gpt100m-fp8block-mxfp8-seeds3-9-446steps.metrics.jsonl.gz"], steps=446)
    sd = {recipe: {r["step"]: r["sd"] for r in t[recipe]} for recipe in ("fp8-block", "mxfp8")}
    r = {recipe: {r["step"]: r["r_final"] for r in t[recipe]} for recipe in ("fp8-block", "mxfp8")}
    for recipe in ("fp8-block", "mxfp8"):  # from the first evaluation after warm-up on: 0.77-1.26 %
        assert all(0.75 < sd[recipe][s] < 1.3 for s in (111, 222, 333, 446)), recipe
        assert r[recipe][222] > 0.75 and r[recipe][333] > 0.9, recipe  # mid-run, the final gaps show
    assert r["fp8-block"][111] < 0.5 < r["mxfp8"][111]  # at a quarter: mxfp8's already, fp8-block's not
