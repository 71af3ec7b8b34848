"""loss.png's gap panel pairs each run with the bf16 run at its own seed, as summary.md does."""

from hybridfp.train.loop import RunResult
from hybridfp.train.plot import gap_series


def _run(label: str, train: list[float], val: float) -> RunResult:
    recs = [{"step": s, "recipe": label, "train_loss": x} for s, x in enumerate(train)]
    recs.append({"step": len(train) - 1, "recipe": label, "val_loss": val})
    return RunResult(label, label, recs)


def test_each_run_is_compared_with_the_bf16_run_at_its_seed():
    runs = [_run("bf16@seed=0", [2.0, 2.0], 2.0), _run("fp8@seed=0", [2.0, 2.0], 2.02),
            _run("bf16@seed=1", [4.0, 4.0], 4.0), _run("fp8@seed=1", [4.0, 4.0], 3.96)]
    gaps = gap_series(runs, default_seed=0, span=1)
    assert gaps["fp8@seed=0"]["val"] == ([1], [100 * (2.02 - 2.0) / 2.0])
    assert gaps["fp8@seed=1"]["val"] == ([1], [100 * (3.96 - 4.0) / 4.0])  # against bf16@seed=1, not seed 0
    assert gaps["fp8@seed=1"]["train"] == ([0, 1], [0.0, 0.0])
    # a bf16 run at another seed is drawn against the one at --seed: the seed-to-seed spread
    assert gaps["bf16@seed=1"]["val"] == ([1], [100.0])
    assert "bf16@seed=0" not in gaps


def test_a_run_without_a_same_seed_baseline_gets_no_curve():
    runs = [_run("bf16", [2.0], 2.0), _run("mxfp8@seed=3", [2.2], 2.2)]
    gaps = gap_series(runs, default_seed=0, span=1)
    assert "mxfp8@seed=3" not in gaps and gaps == {}
