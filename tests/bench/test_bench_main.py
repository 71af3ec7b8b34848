"""``python -m bench``: ``--list`` names every benchmark; without CUDA it says so in one line and exits 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.__main__ import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_list_names_every_benchmark():
    proc = _bench("--list")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert listed == list(BENCHMARKS)
    assert {"gemm", "gemm_pairs", "quantize", "mlp", "moe", "grouped_gemm", "bound_moe", "convergence"} <= set(listed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA GPU")
def test_without_cuda_one_line_and_exit_2():
    proc = _bench()
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "CUDA" in proc.stderr
    assert "Traceback" not in proc.stderr
