"""bench.convergence end to end on the CPU with fixed steps: the packages corpus (capped), two
seeds per recipe over two workers, merged metrics, the report with paired intervals and the
corpus fingerprint each worker trained on — the path ``python -m bench convergence`` runs on a GPU.

The preset is ``test`` (2 layers, 8 x 64-token batches), the steps 2 and the MoE comparison
left out: the driver's code path does not depend on the model, the step count or which
comparison it runs (tests/bench/test_convergence_plan.py covers the MoE comparison's plan)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fixed_plan_trains_every_seed_and_reports(tmp_path):
    out = tmp_path / "conv"
    argv = [sys.executable, "-m", "bench.convergence", "--out", str(out), "--dense-preset", "test",
            "--dense-recipes", "bf16,fp8", "--moe-recipes", "", "--seeds", "2",
            "--jobs", "2", "--steps", "2", "--eval-iters", "1", "--device", "cpu", "--data", "packages:300k",
            "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "results.json")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["workers"] == {"dense": 2} and plan["data"]["fingerprint"].startswith("packages-")
    dense = plan["comparisons"]["dense"]
    assert dense["steps"] == 2 and sorted(r for w in dense["workers"] for r in w) == \
        ["bf16@seed=0", "bf16@seed=1", "fp8@seed=0", "fp8@seed=1"]
    result = json.loads((tmp_path / "results.json").read_text())
    study = result["studies"]["dense"]
    assert study["workers_on_other_data"] == [] and "error" not in study
    assert all(plan["data"]["fingerprint"] in line for line in study["data_lines"].values())
    fp8 = next(r for r in study["stats"]["rows"] if r["recipe"] == "fp8")
    assert fp8["seeds"] == [0, 1] and fp8["method"] == "paired (2 seeds)" and fp8["verdict"] in (
        "met", "missed", "unresolved")
    assert not [p for p in out.rglob("checkpoints/*")]  # the study reads metrics only: no checkpoint written
    report = (out / "report.md").read_text()
    assert plan["data"]["fingerprint"] in report and "| `fp8` | 2 |" in report
    # every run's first record names the corpus it read; the gaps at each evaluation follow the table
    assert study["stats"]["corpus"] == plan["data"]["fingerprint"] and study["stats"]["runs_without_corpus"] == []
    assert [r["step"] for r in study["trajectory"]["fp8"]][-1] == 2 and study["trajectory"]["fp8"][-1]["seeds"] == 2
    assert "Per-seed gaps to `bf16` at each evaluation" in report
