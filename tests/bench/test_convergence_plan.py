"""bench.convergence's plan without a GPU: the presets, the recipe list, workers per comparison,
runs assigned to workers by their probed cost, and the tokens per run a budget buys."""

import pytest
import torch

from bench import convergence as conv
from hybridfp.train.model import GPT, PRESETS


def test_study_presets():
    with torch.device("meta"):
        dense = GPT(PRESETS["gpt-100m"].model).num_params()
    assert dense >= 100_000_000 and dense == 101_467_136
    dense_cmp = conv.Comparison("dense", "gpt-100m", conv.DENSE, 3)
    assert dense_cmp.tokens_per_step == 16 * 512 and len(dense_cmp.runs()) == 18
    assert dense_cmp.runs()[:2] == ["bf16@seed=0", "fp8@seed=0"] and dense_cmp.runs()[-1] == "mxfp8-fwd-nvfp4-bwd@seed=2"


def test_default_recipes_parse_and_carry_targets():
    from bench.convergence_report import TARGETS
    assert conv.split_recipes(",".join(conv.DENSE)) == conv.DENSE
    assert conv.split_recipes(",".join(conv.MOE)) == conv.MOE
    assert set(TARGETS) == set(conv.DENSE) - {"bf16"}


def test_workers_split_over_comparisons():
    assert conv.split_jobs(8, [18, 6]) == [6, 2]
    assert conv.split_jobs(0, [18, 6]) == [18, 6] and conv.split_jobs(40, [18, 6]) == [18, 6]
    assert conv.split_jobs(2, [18, 6]) == [1, 1] and conv.split_jobs(5, [3, 3]) == [3, 2]


def test_assignment_balances_the_probed_cost():
    runs = conv.Comparison("dense", "gpt-100m", ("bf16", "slow"), 3).runs()
    groups = conv.assign(runs, {"bf16": 1.0, "slow": 2.0}, 3)
    assert sorted(r for g in groups for r in g) == sorted(runs)
    assert all(sum(2.0 if r.startswith("slow") else 1.0 for r in g) == 3.0 for g in groups)
    assert conv.assign(runs, {}, 8) == [[r] for r in runs]  # more workers than runs: one each


def test_tokens_per_run_fill_the_most_loaded_worker():
    cost = {"bf16": 1 / 200_000, "fp8": 1 / 100_000}
    groups = [["bf16@seed=0", "fp8@seed=0"], ["bf16@seed=1"]]
    tokens = conv.plan_tokens(groups, cost, 300.0)
    assert tokens == pytest.approx(20_000_000)  # 300 s / (5 + 10 us per token)


def test_moe_comparison_runs_and_workers():
    moe = conv.Comparison("moe", "moe-small", conv.MOE, 3)
    assert moe.runs() == [f"{r}@seed={s}" for s in range(3) for r in conv.MOE]
    assert PRESETS["moe-small"].model.n_experts == 8
    groups = conv.assign(moe.runs(), {"bf16": 1 / 100_000, "nvfp4-row-scaled-fwd-mxfp8-bwd": 1 / 60_000}, 2)
    assert [len(g) for g in groups] == [3, 3]


def test_docstring_examples_of_the_study_run():
    import doctest

    from bench import convergence_probe, convergence_report, convergence_workers
    for module in (conv, convergence_probe, convergence_report, convergence_workers):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_reports_name_runs_never_started_and_workers_on_other_data(tmp_path):
    import json
    plan = {"data": {"spec": "packages", "fingerprint": "packages-0123456789abcdef", "train_tokens": 9,
                     "val_tokens": 1},
            "comparisons": {"dense": {"preset": "test", "steps": 20, "tokens_per_run": 10240,
                                      "workers": [["bf16@seed=0", "fp8@seed=0"], ["bf16@seed=1", "fp8@seed=1"]]}}}
    w0 = tmp_path / "dense" / "w0"
    w0.mkdir(parents=True)
    (w0 / "metrics.jsonl").write_text("".join(json.dumps({"step": 20, "recipe": r, "val_loss": v}) + "\n"
                                              for r, v in (("bf16@seed=0", 1.0), ("fp8@seed=0", 1.01))))
    (w0 / "summary.md").write_text("# run\n\nData: installed packages corpus packages-0123456789abcdef (3 files).\n")
    result = conv.write_reports(tmp_path, plan, tmp_path / "out" / "results.json")
    study = result["studies"]["dense"]
    assert study["never_started"] == ["bf16@seed=1", "fp8@seed=1"] and study["workers_on_other_data"] == ["w1"]
    assert study["stats"]["seeds"]["fp8"] == {"0": 1.01}
    md = (tmp_path / "report.md").read_text()
    assert "Runs never started (their worker stopped first): `bf16@seed=1`, `fp8@seed=1`" in md
    assert "packages-0123456789abcdef" in md and "Workers without the corpus" in md
    assert json.loads((tmp_path / "out" / "results.json").read_text())["plan"] == plan


def test_bench_headline_gives_each_gap_and_verdict():
    from bench.__main__ import BENCHMARKS
    result = {"plan": {"comparisons": {"dense": {"steps": 250}}},
              "studies": {"dense": {"stats": {"rows": [
                  {"recipe": "bf16"},
                  {"recipe": "fp8", "gap_pct": 0.1, "ci_lo": 0.05, "ci_hi": 0.15, "verdict": "met"},
                  {"recipe": "x", "gap_pct": 0.1, "ci_lo": None, "ci_hi": None, "verdict": "unresolved"}]}}}}
    assert BENCHMARKS["convergence"].headline(result) == [
        ("dense: steps per run", "250"), ("dense: fp8 vs bf16", "+0.10 % [+0.05, +0.15] met")]


def test_reports_list_recipes_dropped_at_the_probe_and_runs_that_failed(tmp_path):
    import json
    plan = {"data": {"spec": "packages", "fingerprint": "packages-0123456789abcdef", "train_tokens": 9,
                     "val_tokens": 1}, "seeds": 2,
            "comparisons": {"dense": {"preset": "test", "steps": 20, "tokens_per_run": 10240, "dropped": ["mxfp8"],
                                      "workers": [["bf16@seed=0", "fp8@seed=0", "bf16@seed=1", "fp8@seed=1"]]}}}
    w0 = tmp_path / "dense" / "w0"
    w0.mkdir(parents=True)
    recs = [("bf16@seed=0", 20, 1.0), ("fp8@seed=0", 20, 1.0), ("bf16@seed=1", 20, 1.1), ("fp8@seed=1", 4, float("nan"))]
    (w0 / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "recipe": r, "val_loss": v, "train_loss": v})
                                              + "\n" for r, s, v in recs))
    result = conv.write_reports(tmp_path, plan)
    rows = {r["recipe"]: r for r in result["studies"]["dense"]["stats"]["rows"]}
    assert rows["fp8"]["verdict"] == "failed" and rows["fp8"]["failed_runs"] == {"fp8@seed=1": "diverged at step 4"}
    assert rows["mxfp8"]["verdict"] == "failed" and sorted(rows["mxfp8"]["failed_runs"]) == \
        ["mxfp8@seed=0", "mxfp8@seed=1"]
    md = (tmp_path / "report.md").read_text()
    assert "`mxfp8@seed=0` (dropped at the probe)" in md and "`fp8@seed=1` (diverged at step 4)" in md
    from bench.__main__ import BENCHMARKS
    head = dict(BENCHMARKS["convergence"].headline(result))
    assert head["dense: fp8 vs bf16"].startswith("failed") and "fp8@seed=1" in head["dense: fp8 vs bf16"]
    assert "mxfp8@seed=0" in head["dense: mxfp8 vs bf16"]


def test_bench_headline_names_a_study_that_could_not_be_analysed():
    from bench.__main__ import BENCHMARKS
    result = {"plan": {"comparisons": {"moe": {"steps": 9}}},
              "studies": {"moe": {"error": "no bf16 run to compare against.", "failed": {"bf16": ["bf16@seed=0"]}}}}
    assert ("moe: report", "failed: no bf16 run to compare against.") in BENCHMARKS["convergence"].headline(result)


def test_batch_size_and_lr_overrides_reach_the_workers_and_the_token_count(tmp_path, monkeypatch):
    import argparse
    import subprocess
    seen = {}

    class FakePopen:
        def __init__(self, argv, **kwargs):
            seen["argv"] = argv
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    args = argparse.Namespace(data="packages", cache_dir=None)
    big = conv.Comparison("dense", "gpt-100m", ("bf16", "fp8"), 3, batch_size=64, lr=5e-4)
    assert big.tokens_per_step == 64 * 512  # the plan's tokens per run follow the batch actually trained
    conv.start_worker(big, ["bf16@seed=0"], tmp_path / "w0", 10, "cpu", args, 5, 2)
    argv = seen["argv"]
    assert argv[argv.index("--batch-size") + 1] == "64" and float(argv[argv.index("--lr") + 1]) == 5e-4
    conv.start_worker(conv.Comparison("dense", "gpt-100m", ("bf16",), 1), ["bf16@seed=0"], tmp_path / "w1", 10,
                      "cpu", args, 5, 2)
    assert "--batch-size" not in seen["argv"] and "--lr" not in seen["argv"]  # the preset's own
    # every worker trains the eager SwiGLU the committed seeds trained with, and the trainer's
    # parser takes the command line as given
    from hybridfp.train import cli
    assert "--eager-swiglu" in seen["argv"]
    parser = argparse.ArgumentParser()
    cli.add_train_args(parser)
    cfg = cli.config_from_args(parser.parse_args(seen["argv"][3:]))
    assert cfg.model.fused_swiglu is False and cfg.preset == "gpt-100m"
    with pytest.raises(ValueError, match="batch_size"):
        conv.Comparison("dense", "gpt-100m", ("bf16",), 1, batch_size=0)
    with pytest.raises(ValueError, match="lr"):
        conv.Comparison("dense", "gpt-100m", ("bf16",), 1, lr=-1.0)


def test_first_seed_continues_a_study_and_its_dropped_runs(tmp_path):
    """--first-seed K trains seeds K .. K+n-1 (a study continued in a later run), and a recipe
    dropped at the probe fails at exactly those seeds."""
    import json
    c = conv.Comparison("dense", "test", ("bf16", "fp8"), 2, first_seed=3)
    assert c.runs() == ["bf16@seed=3", "fp8@seed=3", "bf16@seed=4", "fp8@seed=4"]
    with pytest.raises(ValueError, match="--first-seed"):
        conv.Comparison("dense", "test", ("bf16",), 1, first_seed=-1)
    plan = {"data": {"spec": "packages", "fingerprint": "packages-0123456789abcdef", "train_tokens": 9,
                     "val_tokens": 1}, "seeds": 2, "first_seed": 3,
            "comparisons": {"dense": {"preset": "test", "steps": 20, "tokens_per_run": 10240, "dropped": ["mxfp8"],
                                      "workers": [c.runs()]}}}
    w0 = tmp_path / "dense" / "w0"
    w0.mkdir(parents=True)
    (w0 / "metrics.jsonl").write_text("".join(json.dumps({"step": 20, "recipe": r, "val_loss": 1.0, "train_loss": 1.0})
                                              + "\n" for r in c.runs()))
    result = conv.write_reports(tmp_path, plan)
    rows = {r["recipe"]: r for r in result["studies"]["dense"]["stats"]["rows"]}
    assert rows["bf16"]["seeds"] == [3, 4]
    assert sorted(rows["mxfp8"]["failed_runs"]) == ["mxfp8@seed=3", "mxfp8@seed=4"]


def test_first_seed_is_validated_on_the_command_line():
    with pytest.raises(SystemExit, match="--first-seed"):
        conv.main(["--first-seed", "-2", "--steps", "10", "--budget-s", "60", "--device", "cpu"])
