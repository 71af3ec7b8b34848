"""``python -m bench``: ``--list`` names every benchmark; without CUDA it says so in one line and exits 2."""

import json
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
    assert {"gemm", "gemm_pairs", "quantize", "mlp", "moe", "grouped_gemm", "bound_moe", "bound_mlp", "convergence",
            "bound_moe_8", "bound_mlp_fused_amax"} <= set(listed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA GPU")
def test_without_cuda_one_line_and_exit_2():
    proc = _bench()
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "CUDA" in proc.stderr
    assert "Traceback" not in proc.stderr


def _p(ratio, low=None, high=None):
    return {"ratio": ratio, "low": low or ratio - 0.01, "high": high or ratio + 0.01, "rounds": [], "clocks": {}}


def test_headlines_read_paired_ratios_and_mark_targets():
    from bench.__main__ import _gemm, _gemm_pairs, _mlp
    gemm = dict(_gemm({"rows": [
        {"shape": "8192^3 fprop", "block_pair": "1x128 x 128x128", "tensorwise_paired": _p(0.99),
         "block_paired": _p(0.955), "bf16": 700.0, "tensorwise_hybridfp": 1200.0},
        {"shape": "llama3-8b up dgrad", "tensorwise_paired": _p(1.0), "block_paired": _p(0.952)}]}))
    assert gemm["FP8 per-tensor hybridfp.gemm / raw torch._scaled_mm, 8192^3"] == "0.990x [0.980, 1.000]"
    assert gemm["FP8 block (1x128 x 128x128) hybridfp.gemm / raw, 8192^3"].endswith("BELOW 0.97x TARGET")
    assert "BELOW" in gemm["FP8 block hybridfp.gemm / raw, llama3-8b up dgrad"]
    assert not any("per-tensor" in k and "dgrad" in k for k in gemm)  # on target: not a headline
    pairs = dict(_gemm_pairs({"rows": [{"pair": "MXFP8 x MXFP8", "layout": "TN", "shape": "8192^3",
                                        "cold_vs_decoded": _p(0.93), "cold_vs_randn": _p(1.01),
                                        "warm_vs_decoded": _p(1.05), "warm_vs_randn": _p(1.1)}]}))
    cold = pairs["MXFP8 x MXFP8 TN cold / BF16 on decoded values; on randn, 8192^3"]
    assert cold.startswith("0.930x") and "BELOW" in cold and cold.endswith("1.010x [1.000, 1.020]")
    mlp = dict(_mlp({"rows": [{"model": "Llama-3-8B MLP", "variant": "hybridfp MXFP8",
                               "vs BF16 eager": _p(0.98), "vs BF16 torch.compile": _p(0.9)},
                              {"model": "Llama-3-8B MLP", "variant": "hybridfp NVFP4", "error": "y: relative error"}]}))
    assert mlp["MLP hybridfp MXFP8 vs BF16"] == ("0.980x [0.970, 0.990] BELOW 1.05x TARGET eager, "
                                                 "0.900x [0.890, 0.910] compiled")
    assert mlp["MLP hybridfp NVFP4 vs BF16"] == "y: relative error"


def test_mlp_headline_marks_each_recipe_against_its_own_target():
    from bench.__main__ import _mlp
    rows = [("hybridfp FP8 current", 1.60), ("hybridfp FP8 current + fused SwiGLU", 1.72),
            ("hybridfp MXFP8", 1.02), ("hybridfp NVFP4 (2D weights, RHT, SR)", 0.96),
            ("BF16 torch.compile", 0.5)]
    mlp = dict(_mlp({"rows": [{"model": "Llama-3-8B MLP", "variant": v, "vs BF16 eager": _p(x)} for v, x in rows]}))
    assert mlp["MLP hybridfp FP8 current vs BF16"].endswith("BELOW 1.70x TARGET eager")
    assert "BELOW" not in mlp["MLP hybridfp FP8 current + fused SwiGLU vs BF16"]  # a variant: its recipe's 1.70x
    assert mlp["MLP hybridfp MXFP8 vs BF16"].endswith("BELOW 1.05x TARGET eager")  # above 1.00x, below its 1.05x
    assert "BELOW" not in mlp["MLP hybridfp NVFP4 (2D weights, RHT, SR) vs BF16"]  # its target is 0.95x
    assert "BELOW" not in mlp["MLP BF16 torch.compile vs BF16"]  # a baseline has no target


def test_failed_benchmark_keeps_its_json_beside_the_last_good_one(tmp_path, monkeypatch):
    import bench.__main__ as main
    (tmp_path / "fake_failing_bench.py").write_text(
        "import sys, json\nout = sys.argv[sys.argv.index('--out') + 1]\n"
        "open(out, 'w').write(json.dumps({'rows': []}))\nsys.exit('baseline torchao float8 missing')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(main.BENCHMARKS, "fake", main.Benchmark("fake_failing_bench", "a failing one", quick=False))
    good = tmp_path / "fake.json"
    good.write_text("{}")
    result, status, ok = main.run_one("fake", good, quick=False)
    assert not ok and result == {"rows": []} and "exit 1" in status and "torchao" in status
    assert good.read_text() == "{}" and json.loads((tmp_path / "fake.failed.json").read_text()) == {"rows": []}


def test_timed_out_benchmark_keeps_its_partial_json_and_prints_its_output(tmp_path, monkeypatch, capsys):
    import bench.__main__ as main
    rows = [{"model": "Llama-3-8B MLP", "variant": "hybridfp MXFP8", "vs BF16 eager": _p(1.2)}]
    (tmp_path / "fake_slow_bench.py").write_text(
        "import sys, json, time\nout = sys.argv[sys.argv.index('--out') + 1]\n"
        f"open(out, 'w').write(json.dumps({{'rows': {rows!r}}}))\nprint('row 1 measured', flush=True)\n"
        "time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(main.BENCHMARKS, "fake", main.Benchmark("fake_slow_bench", "a slow one", quick=False,
                                                                 timeout_s=3.0, headline=main._mlp))
    result, status, ok = main.run_one("fake", tmp_path / "fake.json", quick=False)
    assert not ok and status == "timed out after 3 s" and result == {"rows": rows}
    assert json.loads((tmp_path / "fake.failed.json").read_text()) == {"rows": rows}
    assert not (tmp_path / "fake.json").exists()
    assert "row 1 measured" in capsys.readouterr().out
    table = main.summary({"fake": result}, {"fake": status}, {"fake": ok})
    assert "FAILED: timed out after 3 s" in table and "fake.failed.json" in table
    assert "1.200x [1.190, 1.210]" in table  # what it measured is still shown


def test_summary_of_a_failed_run_shows_every_other_ratio():
    from bench.__main__ import summary
    partial = {"rows": [{"config": "8 experts, ffn 14336", "variant": "hybridfp MXFP8", "x_fastest_bf16": _p(0.95),
                         "fastest_bf16": "BF16 grouped", "target": 0.9},
                        {"config": "8 experts, ffn 14336", "variant": "hybridfp FP8 current", "error": "RuntimeError: x"},
                        {"config": "8 experts, ffn 14336", "variant": "hybridfp MXFP8 [one weight Parameter]",
                         "not_run": "--deadline-s passed", "optional": True}]}
    table = summary({"moe": partial}, {"moe": "failed (exit 1)"}, {"moe": False})
    assert "0.950x [0.940, 0.960] vs BF16 grouped" in table and "FAILED: RuntimeError: x" in table
    assert "NOT RUN (--deadline-s passed)" in table and "FAILED: failed (exit 1)" in table


def test_timeout_override_passes_a_deadline_to_the_benchmarks_that_take_one(tmp_path, monkeypatch):
    import bench.__main__ as main
    (tmp_path / "fake_argv_bench.py").write_text(
        "import sys, json\nout = sys.argv[sys.argv.index('--out') + 1]\n"
        "open(out, 'w').write(json.dumps({'argv': sys.argv[1:]}))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(main.BENCHMARKS, "fake", main.Benchmark("fake_argv_bench", "takes a deadline", quick=False,
                                                                 deadline_flag="--deadline-s"))
    result, status, ok = main.run_one("fake", tmp_path / "fake.json", quick=False, timeout_s=200.0)
    argv = result["argv"]
    assert ok and argv[argv.index("--deadline-s") + 1] == "150"  # 3/4 of the limit: its last row and JSON fit after
    monkeypatch.setitem(main.BENCHMARKS, "fake", main.Benchmark("fake_argv_bench", "takes none", quick=False))
    result, _, ok = main.run_one("fake", tmp_path / "fake.json", quick=False, timeout_s=200.0)
    assert ok and "--deadline-s" not in result["argv"]


def test_timeout_override_replaces_the_benchmarks_own_limit(tmp_path, monkeypatch):
    import bench.__main__ as main
    (tmp_path / "fake_sleepy_bench.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(main.BENCHMARKS, "fake", main.Benchmark("fake_sleepy_bench", "slow", quick=False,
                                                                 timeout_s=600.0))
    _, status, ok = main.run_one("fake", tmp_path / "fake.json", quick=False, timeout_s=2.0)
    assert not ok and status == "timed out after 2 s"


def test_the_benchmarks_with_a_deadline_flag_accept_it():
    import bench.__main__ as main
    import importlib
    for name, b in main.BENCHMARKS.items():
        source = open(importlib.util.find_spec(b.module).origin).read()
        takes = [flag for flag in ("--deadline-s", "--budget-s") if f'"{flag}"' in source]
        assert [b.deadline_flag] == takes or (b.deadline_flag is None and not takes), \
            f"{name}: deadline_flag={b.deadline_flag} but {b.module} takes {takes or 'none'}"


def test_a_timed_out_benchmark_gets_sigterm_first_and_keeps_what_it_writes_then(tmp_path, monkeypatch):
    # the convergence driver stops its workers and writes its reports on SIGTERM: a time limit
    # must give it that chance before killing it
    import bench.__main__ as main
    (tmp_path / "fake_term_bench.py").write_text(
        "import sys, json, signal, time\nout = sys.argv[sys.argv.index('--out') + 1]\n"
        "def stop(*_):\n    open(out, 'w').write(json.dumps({'rows': [], 'stopped': 'SIGTERM'}))\n    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\nprint('started', flush=True)\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(main.BENCHMARKS, "fake", main.Benchmark("fake_term_bench", "writes on SIGTERM", quick=False,
                                                                 timeout_s=3.0))
    result, status, ok = main.run_one("fake", tmp_path / "fake.json", quick=False)
    assert not ok and status == "timed out after 3 s" and result == {"rows": [], "stopped": "SIGTERM"}


def test_a_benchmark_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    import time
    import bench.__main__ as main
    (tmp_path / "fake_stubborn_bench.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(main, "TERM_GRACE_S", 2.0)
    monkeypatch.setitem(main.BENCHMARKS, "fake", main.Benchmark("fake_stubborn_bench", "ignores SIGTERM", quick=False,
                                                                 timeout_s=2.0))
    t0 = time.monotonic()
    _, status, ok = main.run_one("fake", tmp_path / "fake.json", quick=False)
    assert not ok and status == "timed out after 2 s" and time.monotonic() - t0 < 30


def test_the_runner_evaluates_the_convergence_study_as_committed():
    """``python -m bench convergence`` evaluates on 4 validation batches, the committed study's
    setting: at the default 16 the MoE workers' evaluations fill a 10-minute budget."""
    args = BENCHMARKS["convergence"].args
    assert args[args.index("--eval-iters") + 1] == "4"


def test_moe_primary_benchmarks_name_bench_moes_primary_weight_rows():
    from bench.__main__ import MOE_PRIMARY_ROWS
    from bench.moe_rows import COMPILED_SUFFIX, COMPILED_VARIANTS, PRIMARY_SUFFIX, PRIMARY_VARIANTS
    assert MOE_PRIMARY_ROWS.split("|") == ([name + PRIMARY_SUFFIX for name in PRIMARY_VARIANTS]
                                           + [name + PRIMARY_SUFFIX + COMPILED_SUFFIX for name in COMPILED_VARIANTS])
    for name, experts in (("moe_primary", "8"), ("moe_64_primary", "64")):
        b = BENCHMARKS[name]
        assert b.module == "bench.bench_moe" and not b.default
        assert b.args == ("--experts", experts, "--variants", MOE_PRIMARY_ROWS)


def test_moe_64_compiled_pairs_each_primary_weight_row_with_its_compiled_twin():
    from bench.__main__ import MOE_COMPILED_ROWS
    from bench.moe_rows import COMPILED_SUFFIX, COMPILED_VARIANTS, PRIMARY_SUFFIX
    assert MOE_COMPILED_ROWS.split("|") == [name + PRIMARY_SUFFIX + c for name in COMPILED_VARIANTS
                                            for c in ("", COMPILED_SUFFIX)]
    b = BENCHMARKS["moe_64_compiled"]
    assert b.module == "bench.bench_moe" and not b.default
    assert b.args == ("--experts", "64", "--variants", MOE_COMPILED_ROWS)
