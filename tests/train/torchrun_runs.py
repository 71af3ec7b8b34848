"""``hybridfp train`` under ``torchrun`` in a subprocess, and its logged records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

COMMON = ["--no-progress", "--eval-interval", "2", "--eval-iters", "2"]


def torchrun(n: int, *argv: str) -> subprocess.CompletedProcess:
    """``python -m hybridfp.train *argv`` on ``n`` ranks (one thread each); fails the test on a
    non-zero exit, showing the output's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(n), "-m", "hybridfp.train", *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def records(out: Path, recipe: str) -> list[dict]:
    """The metrics records of ``recipe`` in run directory ``out``."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["recipe"] == recipe]


def losses(out: Path, recipe: str) -> list[tuple]:
    """(step, train loss, val loss) of every record of ``recipe`` in run directory ``out``."""
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in records(out, recipe)]
