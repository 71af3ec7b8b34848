"""The MoE benchmark's targets: one table per config (bench.moe_targets) that bench_moe's rows,
its report and ``python -m bench``'s headline read; a row below its target is marked, Composer-2
has none; bench_moe's files stay small, and its help says how long a run takes."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from bench import bench_moe, common, moe_targets
from bench.__main__ import _moe
from bench.protocol import PairedRatio

FP8, MX = "hybridfp FP8 current", "hybridfp MXFP8"
C2 = "hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)"
E8, E64 = "8 experts, ffn 14336", "64 experts, ffn 1408"


def test_each_config_has_its_targets_against_the_fastest_bf16():
    assert bench_moe.CONFIGS == moe_targets.CONFIGS == ((8, 14336), (64, 1408))
    expected = {E8: {FP8: 1.30, MX: 0.95}, E64: {FP8: 1.20, MX: 0.95}}
    for config, targets in expected.items():
        for recipe, goal in targets.items():
            assert moe_targets.target(config, recipe) == goal
            assert moe_targets.target(config, recipe + bench_moe.SINGLE_PARAM_SUFFIX) == goal
        assert moe_targets.target(config, C2) is None  # Composer-2 has no stated target
        assert moe_targets.target(config, "hybridfp BF16 (high_precision)") is None
    assert moe_targets.target((64, 1408), FP8) == 1.20 and moe_targets.target((8, 14336), FP8) == 1.30
    assert moe_targets.target("8 experts, ffn 512", FP8) is None  # --quick's shapes: no target
    assert not hasattr(bench_moe, "TARGETS")  # one table, not a second copy in bench_moe
    assert doctest.testmod(moe_targets).failed == 0


def _pr(ratio: float) -> PairedRatio:
    return PairedRatio(ratio, ratio - 0.01, ratio + 0.01, 10.0 * ratio, 10.0, ((10.0 * ratio, 10.0),), {})


@pytest.mark.parametrize("config, recipe, ratio, goal, marked", [
    (E64, FP8, 1.19, 1.20, True), (E64, FP8, 1.20, 1.20, False), (E64, FP8, 1.25, 1.20, False),
    (E8, FP8, 1.25, 1.30, True), (E8, FP8, 1.30, 1.30, False),
    (E8, MX, 0.93, 0.95, True), (E64, MX + bench_moe.SINGLE_PARAM_SUFFIX, 0.95, 0.95, False),
    (E8, C2, 0.50, None, False), (E64, C2, 0.50, None, False)])
def test_a_row_below_its_target_is_marked(monkeypatch, config, recipe, ratio, goal, marked):
    monkeypatch.setattr(common, "DEVICE", "cpu")  # no GPU-busy profile
    monkeypatch.setattr(bench_moe, "pair", lambda baseline, candidate, protocol: _pr(ratio))
    steps = {name: (None, None) for name in bench_moe.BASELINES + (recipe,)}
    row = {"config": config, "variant": recipe}
    bench_moe.time_row(row, steps, bench_moe.BF16_COMPILED, bench_moe.Protocol())
    assert row["target"] == goal
    row["fastest_bf16"] = bench_moe.BF16_COMPILED
    table = bench_moe.markdown_table([row])
    assert ("BELOW" in table) == marked
    if marked:
        assert f"{ratio:.3f} [{ratio - 0.01:.3f}, {ratio + 0.01:.3f}] BELOW {goal:.2f}x TARGET" in table
    # the headline reads the table, not the target a JSON row recorded (an older run's 0.9 / 1.3)
    stale = dict(row, target=0.9 if recipe.startswith(MX) else 1.3 if recipe.startswith(FP8) else 0.9)
    (_, value), = _moe({"rows": [stale]})
    assert ("BELOW" in value) == marked
    if marked:
        assert f"BELOW {goal:.2f}x TARGET" in value


def test_bench_moe_files_stay_under_600_lines():
    bench = Path(bench_moe.__file__).parent
    for name in ("bench_moe.py", "moe_rows.py", "moe_targets.py"):
        lines = len((bench / name).read_text().splitlines())
        assert lines <= 600, f"{name}: {lines} lines"


def test_help_says_how_long_a_full_run_takes(capsys):
    with pytest.raises(SystemExit):
        bench_moe.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    # each recipe row is paired with all three BF16 baselines: the time counts three pairings a row
    assert "(2 + 3 x recipe rows + variant rows) x 2 x rounds x samples steps" in text and "--experts 8" in text
    assert "about 18 for every row" in text
    doc = " ".join(bench_moe.__doc__.split())
    assert "(2 + 3 x recipe rows + variant rows) x 200 x the step time" in doc and "about 18 minutes" in doc
