"""Fixtures shared by the benchmark tests."""

import pytest

from bench import bench_moe, common


@pytest.fixture
def tiny(monkeypatch):
    """The MoE benchmark's ``--quick`` at 4 experts x ffn 32, 64 tokens, hidden 64, on the CPU."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(bench_moe, "QUICK_CONFIGS", [(4, 32)])
    monkeypatch.setattr(bench_moe, "QUICK_SHAPE", (64, 64))
