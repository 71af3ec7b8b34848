"""bench.sweep_dispatch on the CPU: the quick sweep runs every decision, each cell's "picked" is
what the library's own decision functions answer, and the holds / flagged verdict."""

from __future__ import annotations

import doctest
import json
import time

import pytest
import torch

import hybridfp
from bench import common, sweep_cases as sc, sweep_dispatch as sd
from bench.protocol import clock_spread
from hybridfp.gemm.gemm import operand_storage
from hybridfp.kernels import triton_decode, triton_hybrid_nvfp4
from hybridfp.kernels.moe import triton_grouped_fp8_gemm, triton_grouped_gemm
from hybridfp.moe.gemm import GROUPED_FP8_TRITON, GROUPED_TRITON, grouped_path, per_group_wins
from hybridfp.moe.quantize_weights import _worth_stacking


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``python -m bench.sweep_dispatch --quick --out F`` with the benchmark device set to the CPU."""
    mp = pytest.MonkeyPatch()
    mp.setattr(common, "DEVICE", "cpu")
    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    try:
        sd.main(["--quick", "--out", str(out)])
    finally:
        mp.undo()
    return json.loads(out.read_text())


def test_quick_sweep_covers_every_decision(quick):
    rows = quick["rows"]
    assert [r["decision"] for r in rows] == [n for n in sc.DECISIONS for _ in sc.DECISIONS[n].cells(sc.QUICK)]
    assert all("error" not in r and "errors" not in r for r in rows), [r for r in rows if "error" in r or "errors" in r]
    for r in rows:
        assert r["picked"] in r["ms"] and r["fastest"] in r["ms"] and r["ratio"] >= 1.0
        assert r["flagged"] == (not r["holds"]) == (r["ratio"] > 1 + sd.TOLERANCE)
    assert {label.split(":")[0] for label, _ in quick["headline"]} == set(sc.DECISIONS)
    assert quick["markdown"].count("\n") == len(rows) + 1


def _expected_picks(cell: sc.Cell) -> dict[str, str]:
    """What the library answers for ``cell``, asked of its own functions on operands built here."""
    sizes = sc.splits_for(cell.rows, cell.experts)
    fp8 = [hybridfp.Float8CurrentScalingQuantizer(torch.float8_e5m2)(torch.randn(m, cell.ffn)) for m in sizes]
    w8 = [hybridfp.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.randn(cell.ffn, cell.hidden))
          for _ in sizes]
    fp8_path = grouped_path([operand_storage(t, "rowwise", "A") for t in fp8],
                            [operand_storage(t, "columnwise", "B") for t in w8], "NN", torch.bfloat16, False)[0]
    qx = hybridfp.NVFP4Quantizer()
    qx.set_usage(rowwise=True, columnwise=False)
    x4 = [qx(torch.randn(m, cell.hidden)) for m in sizes]
    w4 = [hybridfp.NVFP4Quantizer()(torch.randn(cell.ffn, cell.hidden)) for _ in sizes]
    nvfp4_path = grouped_path([operand_storage(t, "rowwise", "A") for t in x4],
                              [operand_storage(t, "rowwise", "B") for t in w4], "TN", torch.bfloat16, False)[0]
    qs = [hybridfp.Float8CurrentScalingQuantizer(torch.float8_e4m3fn) for _ in sizes]
    stack = _worth_stacking(qs, list(torch.randn(cell.experts, cell.ffn, cell.hidden).unbind(0)), None, None)
    return {"bf16_per_group": "cuBLAS per group" if per_group_wins(sizes) else "torch._grouped_mm",
            "fp8_per_expert": "Triton FP8 grouped" if fp8_path == GROUPED_FP8_TRITON else "cuBLAS per expert",
            "many_experts": "Triton grouped" if nvfp4_path == GROUPED_TRITON else "per-expert loop",
            "stack_scaled": "stacked" if stack else "per expert",
            "fp8_tile_rows": f"{triton_grouped_fp8_gemm.TILE} (default)",
            "fp8_tile_wgrad": f"{triton_grouped_fp8_gemm.WGRAD_TILE} (default)",
            "bf16_tile": f"{triton_grouped_gemm.TILE} (default)",
            "fp8_tma_rows": f"{hybridfp.current_policy().grouped_fp8_tma_rows or sc.POINTER} (default)",
            "fp8_tma_dgrad": f"{hybridfp.current_policy().grouped_fp8_tma_rows or sc.POINTER} (default)",
            "fp8_tma_wgrad": f"{hybridfp.current_policy().grouped_fp8_tma_wgrad or sc.POINTER} (default)"}


def test_picked_is_the_library_answer(quick):
    dense = {"nvfp4_hybrid_tile": f"{triton_hybrid_nvfp4.DEFAULT_TILES['natural']} (default)",
             "mxfp8_decode_tile": f"{(triton_decode._TILE_1D, triton_decode._WARPS_1D)} (default)"}
    for r in quick["rows"]:
        if r["experts"] is None:
            want = dense[r["decision"]]
        else:
            cell = sc.Cell(r["tokens"], r["hidden"], r["experts"], r["ffn"])
            want = _expected_picks(cell if r["tokens"] else sc.Cell(64, r["hidden"], r["experts"], r["ffn"]))[r["decision"]]
        assert r["picked"] == want, (r["decision"], r["cell"])


@pytest.mark.parametrize("fields, name, want", [
    ({"per_group_min_mean": 0}, "bf16_per_group", "cuBLAS per group"),
    ({"per_group_max_groups": 0}, "bf16_per_group", "torch._grouped_mm"),
    ({"grouped_triton_devices": {"cpu"}}, "fp8_per_expert", "Triton FP8 grouped"),
    ({"grouped_triton_devices": {"cpu"}, "per_expert_fp8_triton_flops": 0.0}, "fp8_per_expert", "cuBLAS per expert"),
    # dgrad against the Triton kernel has its own crossover: the general one does not move it
    ({"grouped_triton_devices": {"cpu"}, "per_expert_fp8_flops": 0.0}, "fp8_per_expert", "Triton FP8 grouped"),
    ({"grouped_triton_devices": {"cpu"}}, "many_experts", "Triton grouped"),
    ({"stack_scaled_max_numel": 0}, "stack_scaled", "per expert"),
    ({"grouped_fp8_tma_rows": "128x256x128 w8 st3 store"}, "fp8_tma_rows", "128x256x128 w8 st3 store (default)"),
    ({"grouped_fp8_tma_rows": None}, "fp8_tma_rows", f"{sc.POINTER} (default)"),
    ({"grouped_fp8_tma_rows": "128x128x128 w8 st4 store"}, "fp8_tma_dgrad", "128x128x128 w8 st4 store (default)"),
    ({"grouped_fp8_tma_wgrad": "128x128x128 w8 st4 store"}, "fp8_tma_wgrad", "128x128x128 w8 st4 store (default)"),
])
def test_picked_follows_the_policy(fields, name, want, monkeypatch):
    """A case built under another policy picks what the library's functions answer under it."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    cell = sc.moe_cells(sc.QUICK)[0]
    with hybridfp.policy(**fields):
        case = sc.DECISIONS[name].build(cell, True)
        assert case.picked == want == _expected_picks(cell)[name]
    assert set(case.alternatives) >= {want}


@pytest.mark.parametrize("name", ["fp8_tma_rows", "fp8_tma_dgrad", "fp8_tma_wgrad"])
def test_tma_alternatives_run_the_config_they_name(name, monkeypatch):
    """Every TMA alternative launches the TMA kernel with its own config (forced: never the
    pointer kernel under a config's name); the pointer kernel's alternative launches none."""
    from hybridfp.kernels.moe.triton_grouped_fp8_tma import CONFIGS
    monkeypatch.setattr(common, "DEVICE", "cpu")
    launched = []
    real = triton_grouped_fp8_gemm.launch_tma
    monkeypatch.setattr(triton_grouped_fp8_gemm, "launch_tma",
                        lambda *a, **kw: launched.append(a[8]) or real(*a, **kw))
    with hybridfp.policy(grouped_fp8_tma_rows=None, grouped_fp8_tma_wgrad=None):
        case = sc.DECISIONS[name].build(sc.moe_cells(sc.QUICK)[0], True)
    assert case.picked == f"{sc.POINTER} (default)" and len(case.alternatives) == 2
    for alt, fn in case.alternatives.items():
        launched.clear()
        fn()
        assert launched == ([] if alt == case.picked else [CONFIGS[alt]]), alt


def test_a_cell_records_the_clocks_its_alternatives_ran_at(monkeypatch):
    """With a clock sampler each row carries the readings taken while its alternatives were
    timed (on the CPU the sweep has none: no ``clocks``)."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(common, "bench_ms", lambda fn, *a: (fn(), time.sleep(0.05), 1.0)[2])  # the poller reads meanwhile
    readings = iter([{"sm_mhz": 1980.0, "power_w": 300.0}, {"sm_mhz": 1200.0, "power_w": 700.0}])
    case = sc.Case({"a": lambda: None, "b": lambda: None}, "a")
    row = sd.measure(case, sampler=lambda: next(readings, {}), poll_s=0.001)
    assert row["clocks"]["sm_mhz_min"] == 1200.0 and row["clocks"]["sm_mhz_max"] == 1980.0
    assert row["clocks"]["power_w_median"] == 500.0
    assert clock_spread(row["clocks"], "sm_mhz") == "1590 [1200, 1980]" and clock_spread({}, "sm_mhz") == ""
    assert "clocks" not in sd.measure(case)


def test_an_alternative_with_another_result_is_not_timed(monkeypatch):
    """Tiles and configs of one kernel must agree: one whose output differs from the picked
    one's (compared on copies: the alternatives write one buffer) is an error, not a time."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    timed = []
    monkeypatch.setattr(common, "bench_ms", lambda fn, *a: (timed.append(fn), 1.0)[1])
    buf = torch.zeros(8)
    writes = lambda v: lambda: buf.fill_(v)  # noqa: E731
    case = sc.Case({"a": writes(1.0), "b": writes(1.0 + 2**-10), "c": writes(2.0)}, "a", same_result=True)
    row = sd.measure(case)
    assert set(row["errors"]) == {"c"} and "differs from the picked one by 1 " in row["errors"]["c"]
    assert row["ms"] == {"a": 1.0, "b": 1.0, "c": None} and len(timed) == 2
    assert sd.failures([{"decision": "d", "cell": "x", **row}]) == [f"d x: c: {row['errors']['c']}"]


def test_judge_on_synthetic_timings():
    assert sd.judge({"a": 2.0, "b": 1.0}, "b") == {"picked": "b", "fastest": "b", "ratio": 1.0, "holds": True,
                                                    "flagged": False}
    v = sd.judge({"a": 1.0, "b": 1.029}, "b")
    assert v["fastest"] == "a" and v["ratio"] == pytest.approx(1.029) and v["holds"] and not v["flagged"]
    v = sd.judge({"a": 1.0, "b": 1.031}, "b")
    assert v["ratio"] == pytest.approx(1.031) and v["flagged"] and not v["holds"]
    # the paired ratio replaces the medians' where they differ
    assert sd.judge({"a": 1.0, "b": 1.2}, "b", paired=1.01)["holds"]
    assert sd.judge({"a": 1.0, "b": 1.01}, "b", paired=1.1)["flagged"]
    v = sd.judge({"a": 1.0, "b": 1.01}, "b", paired=0.98)  # paired: the picked one is as fast
    assert (v["fastest"], v["ratio"], v["holds"]) == ("b", 1.0, True)
    # a failed alternative: ignored unless it is the picked one
    assert sd.judge({"a": None, "b": 1.0}, "b")["holds"]
    v = sd.judge({"a": 1.0, "b": None}, "b")
    assert (v["fastest"], v["ratio"], v["flagged"]) == ("a", None, True)
    with pytest.raises(KeyError, match="'c' is not one of the timed"):
        sd.judge({"a": 1.0}, "c")


def test_a_failed_cell_or_alternative_fails_the_run(monkeypatch, tmp_path):
    """A cell judged without one of its alternatives could name the wrong fastest: the run
    writes its results, then exits non-zero naming the cell and the alternative."""
    rows = [{"decision": "bf16_per_group", "cell": "c1", "errors": {"per_group": "RuntimeError: boom"}},
            {"decision": "bf16_per_group", "cell": "c2", "error": "ValueError: no operands", "flagged": True},
            {"decision": "bf16_per_group", "cell": "c3", "not_run": sd.NOT_RUN},
            {"decision": "bf16_per_group", "cell": "c4", "ms": {"a": 1.0}}]
    assert sd.failures(rows) == ["bf16_per_group c1: per_group: RuntimeError: boom",
                                 "bf16_per_group c2: ValueError: no operands"]
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(sd, "sweep", lambda names, grid, quick, deadline_s: rows)
    out = tmp_path / "sweep.json"
    with pytest.raises(SystemExit, match=r"sweep_dispatch failed:\nbf16_per_group c1: per_group: RuntimeError"):
        sd.main(["--quick", "--only", "bf16_per_group", "--out", str(out)])
    assert json.loads(out.read_text())["failures"] == sd.failures(rows)


def test_unknown_decision_is_refused(capsys):
    with pytest.raises(SystemExit):
        sd.main(["--only", "bf16_per_group,nope"])
    assert "unknown decision nope" in capsys.readouterr().err


def test_docstring_examples_run(monkeypatch):
    """judge's verdicts and the paired re-measure's orientation (picked / fastest: above 1 when
    the picked alternative is the slower), timed on the CPU."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    result = doctest.testmod(sd)
    assert result.attempted >= 5 and result.failed == 0


def test_paired_remeasure_uses_a_reportable_protocol(monkeypatch):
    """A cell whose pick is not the fastest is re-measured under a protocol whose figures may
    be reported (>= 10 rounds of >= 10 calls a side), and the interval's coverage is kept."""
    import bench.protocol as protocol
    from bench.sweep_dispatch import _paired_ratio

    seen = []
    real = protocol.paired_ratio

    def spy(a, b, proto=protocol.Protocol(), **kw):
        seen.append(proto)
        fake = lambda fn, n, flush: [fn() for _ in range(n)]
        return real(a, b, proto, timer=fake, sampler=lambda: {})

    monkeypatch.setattr(protocol, "paired_ratio", spy)
    r = _paired_ratio(lambda: 3.0, lambda: 2.0)
    assert seen and seen[0].reportable, seen
    assert r["ratio"] == 1.5 and r["rounds"] >= 10 and r["coverage"] >= 0.95


def test_deadline_records_the_cells_left_as_not_run(monkeypatch):
    """A cell starts only before the deadline; each one after it is a row marked not run, which
    the headline counts apart from the measured cells (a run cut short still reports)."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    clock = iter([0.0, 0.5, 2.0])  # the start, then before each cell
    monkeypatch.setattr(sd.time, "monotonic", lambda: next(clock))
    rows = sd.sweep(["stack_scaled"], sc.QUICK, True, deadline_s=1.0)
    assert len(rows) == 2 and "not_run" not in rows[0] and rows[0]["picked"] in rows[0]["ms"]
    assert rows[1]["not_run"] == sd.NOT_RUN and "ms" not in rows[1]
    (label, text), = sd.headline(rows)
    assert text.startswith(f"{int(rows[0]['holds'])} / 1") and text.endswith("1 not run (deadline)")


def test_deadline_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        sd.main(["--quick", "--deadline-s", "0"])
    assert "--deadline-s must be > 0" in capsys.readouterr().err


def test_the_runner_gives_the_sweep_a_deadline():
    from bench.__main__ import BENCHMARKS
    assert BENCHMARKS["sweep_dispatch"].deadline_flag == "--deadline-s"
