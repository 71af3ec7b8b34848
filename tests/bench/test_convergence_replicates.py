"""bench.convergence_replicates: runs trained twice, their final-loss gaps and where they part, by hand."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from bench import convergence_replicates as cr
from bench.convergence_stats import seeds_to_meet


def _write(path, runs, data="packages-abc"):
    """label -> (train losses at steps 1.., final val loss at the last step); val at step 0 too."""
    with gzip.open(path, "wt") as f:
        for label, (train, final) in runs.items():
            f.write(json.dumps({"step": 0, "recipe": label, "val_loss": 5.0, "data": data}) + "\n")
            for step, loss in enumerate(train, start=1):
                f.write(json.dumps({"step": step, "recipe": label, "train_loss": loss}) + "\n")
            f.write(json.dumps({"step": len(train), "recipe": label, "val_loss": final}) + "\n")
    return path


def test_replicate_gaps_by_hand(tmp_path):
    # seeds 0-2 in both; final losses 2.0 -> 2.02 / 2.0 -> 1.98 / 2.0 -> 2.0 (gaps +1, -1, 0 %);
    # seed 2 is one trajectory bit for bit, seeds 0 / 1 part at steps 2 / 3; fp8 only on one side
    first = _write(tmp_path / "a.jsonl.gz", {
        "bf16@seed=0": ([3.0, 2.5, 2.2], 2.0), "bf16@seed=1": ([3.0, 2.5, 2.2], 2.0),
        "bf16@seed=2": ([3.0, 2.5, 2.2], 2.0), "fp8@seed=0": ([3.0, 2.5, 2.2], 2.1)})
    second = _write(tmp_path / "b.jsonl.gz", {
        "bf16@seed=0": ([3.0, 2.6, 2.2], 2.02), "bf16@seed=1": ([3.0, 2.5, 2.3], 1.98),
        "bf16@seed=2": ([3.0, 2.5, 2.2], 2.0)})
    out = cr.replicate_gaps([first], [second], steps=3)
    assert list(out) == ["bf16"]
    r = out["bf16"]
    assert r["seeds"] == 3 and r["first_difference"] == {0: 2, 1: 3, 2: None}
    assert [round(g, 9) for g in r["gaps"].values()] == [1.0, -1.0, 0.0]
    assert math.isclose(r["gap_pct"], 0.0, abs_tol=1e-12) and math.isclose(r["sd"], 1.0)
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2) sd / sqrt(n)
    assert math.isclose(r["lo"], -half, rel_tol=1e-6) and math.isclose(r["hi"], half, rel_tol=1e-6)
    assert r["seeds_to_meet"] == {"0.25": seeds_to_meet(1.0, 0.25), "0.5": seeds_to_meet(1.0, 0.5),
                                  "1.0": seeds_to_meet(1.0, 1.0)}
    assert r["seeds_to_meet"]["0.25"] > r["seeds_to_meet"]["0.5"] > r["seeds_to_meet"]["1.0"] >= 2
    md = cr.to_markdown(out)
    assert "| `bf16` | 3 | +0.00 % |" in md and "1 of 3" in md and "| `bf16` | 2 | 2.0000 | 2.0000 | +0.00 % | none |" in md


def test_a_side_may_span_files_and_short_runs_are_left_out(tmp_path):
    first = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": ([3.0, 2.0], 1.9), "bf16@seed=1": ([3.0, 2.0], 1.9),
                                             "bf16@seed=2": ([3.0], 2.5)})  # seed 2 stopped at step 1
    b0 = _write(tmp_path / "b0.jsonl.gz", {"bf16@seed=0": ([3.0, 2.0], 1.919)})
    b1 = _write(tmp_path / "b1.jsonl.gz", {"bf16@seed=1": ([3.0, 2.0], 1.9), "bf16@seed=2": ([3.0, 2.0], 1.9)})
    r = cr.replicate_gaps([first], [b0, b1], steps=2)["bf16"]
    assert r["seeds"] == 2 and math.isclose(r["gaps"][0], 1.0) and r["gaps"][1] == 0.0
    assert r["first_difference"] == {0: None, 1: None}


def test_refuses_two_corpora_no_shared_run_and_unequal_ends(tmp_path):
    a = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": ([3.0, 2.0], 1.9)})
    with pytest.raises(ValueError, match="corpus"):
        cr.replicate_gaps([a], [_write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": ([3.0, 2.0], 1.9)}, data="x")])
    with pytest.raises(ValueError, match="no run .* is complete on both sides"):
        cr.replicate_gaps([a], [_write(tmp_path / "c.jsonl.gz", {"bf16@seed=5": ([3.0, 2.0], 1.9)})])
    with pytest.raises(ValueError, match="ended at different steps.*--steps"):
        cr.replicate_gaps([a], [_write(tmp_path / "d.jsonl.gz", {"bf16@seed=0": ([3.0, 2.0, 1.8], 1.7)})])
    with pytest.raises(ValueError, match="no run .* among fp8"):
        cr.replicate_gaps([a], [a], recipes=["fp8"])


def test_cli_prints_and_writes_json(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": ([3.0], 2.0), "bf16@seed=1": ([3.0], 2.0)})
    b = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": ([3.1], 2.02), "bf16@seed=1": ([3.0], 2.0)})
    cr.main(["--first", str(a), "--second", str(b), "--steps", "1", "--json", str(tmp_path / "r.json")])
    assert "| `bf16` | 2 | +0.50 % |" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["bf16"]["first_difference"] == {"0": 1, "1": None}
    with pytest.raises(SystemExit, match="no run"):
        cr.main(["--first", str(a), "--second", str(b), "--recipe", "fp8"])
