"""bench.convergence with a fixed plan: both comparisons train (the unit-test presets, CPU, 3 steps)
and their metrics feed bench.convergence_report — the path ``python -m bench convergence`` runs on a GPU.

The presets are ``test``/``test-moe`` (2 layers, 8 x 64-token batches), not ``tiny``/``tiny-moe``:
the driver's code path does not depend on the model size, and with evaluations every step (a
3-step plan gives ``--eval-interval 1``) the tiny presets' 8 validation batches of 16 x 128 tokens
per evaluation made this test take ~70 s alone (~97 s in the suite) instead of ~30 s."""

import json
import subprocess
import sys
from pathlib import Path

from bench import convergence_report

ROOT = Path(__file__).resolve().parents[2]


def test_fixed_plan_trains_both_studies_and_reports(tmp_path):
    out = tmp_path / "conv"
    argv = [sys.executable, "-m", "bench.convergence", "--out", str(out), "--dense-preset", "test",
            "--moe-preset", "test-moe", "--dense-recipes", "bf16,bf16@seed=1,fp8", "--moe-recipes", "bf16",
            "--dense-steps", "3", "--moe-steps", "3", "--device", "cpu"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert {k: v["steps"] for k, v in plan.items()} == {"dense": 3, "moe": 3}
    for study, preset in (("dense", "test"), ("moe", "test-moe")):
        assert (out / study / "loss.png").stat().st_size > 0
        assert f"Preset `{preset}`" in (out / study / "summary.md").read_text()  # the preset flags reach train
    text = convergence_report.report(out / "dense" / "metrics.jsonl")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["bf16", "bf16@seed=1", "fp8"]
    assert "BF16 runs: 2" in text
