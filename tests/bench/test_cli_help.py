"""Every command's ``--help`` prints and exits 0: argparse formats help strings with ``%``, so a
literal percent sign left unescaped in one raises only when a user asks for help."""

import importlib

import pytest

COMMANDS = ["bench.__main__", "bench.bench_gemm", "bench.bench_gemm_pairs", "bench.bench_grouped_gemm",
            "bench.bench_mlp", "bench.bench_moe", "bench.bench_moe_overhead", "bench.bench_offload",
            "bench.bench_quantize", "bench.bench_quantize_kernels", "bench.bound_mlp", "bench.bound_moe",
            "bench.convergence", "bench.convergence_report", "bench.convergence_replicates",
            "bench.convergence_trajectory",
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
