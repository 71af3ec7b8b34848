"""Every command's ``--help`` prints and exits 0: argparse formats help strings with ``%``, so a
literal percent sign left unescaped in one raises only when a user asks for help."""

import importlib
from pathlib import Path

import pytest

COMMANDS = ["bench.__main__", "bench.bench_gemm", "bench.bench_gemm_pairs", "bench.bench_grouped_gemm",
            "bench.bench_mlp", "bench.bench_moe", "bench.bench_moe_overhead", "bench.bench_offload",
            "bench.bench_quantize", "bench.bench_quantize_kernels", "bench.bench_train_step", "bench.bound_mlp", "bench.bound_moe",
            "bench.convergence", "bench.convergence_report", "bench.convergence_replicates",
            "bench.convergence_trajectory", "bench.profile_moe_host",
            "bench.sweep_dispatch", "hybridfp.train.cli", "hybridfp.analyze.validate", "hybridfp.report"]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:"), out[:200]
    assert "--help" in out


def test_every_bench_command_is_listed():
    """A new ``bench/*.py`` with a ``main`` joins the list above (its help is then tested)."""
    root = Path(__file__).resolve().parents[2] / "bench"
    mains = {f"bench.{f.stem}" for f in root.glob("*.py") if "\ndef main(" in f.read_text()}
    assert mains - set(COMMANDS) == set()
