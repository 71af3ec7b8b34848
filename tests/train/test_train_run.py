"""End to end: ``hybridfp train`` writes its outputs, the loss falls, --resume continues bit for
bit, --jobs runs recipes in worker processes, and NAME@seed=K runs another seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridfp.train import cli
from hybridfp.train.parallel import worker_devices
from hybridfp.train.recipes_by_name import parse_recipe, parse_recipe_list

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One corpus cache for the module (the corpus is built once)."""
    return tmp_path_factory.mktemp("corpus-cache")


def _train(cache, out, *extra):
    argv = ["train", "--preset", "test", "--out", str(out), "--cache-dir", str(cache),
            "--no-progress", "--eval-interval", "5", *extra]
    assert cli.main(argv) == 0


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out, recipe):
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in _records(out) if r["recipe"] == recipe]


def test_two_recipes_write_outputs_and_learn(tmp_path, cache, capsys):
    out = tmp_path / "run"
    _train(cache, out, "--compare", "bf16,per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8", "--steps", "20")
    printed = capsys.readouterr().out
    assert f"plot:    {out / 'loss.png'}" in printed and f"summary: {out / 'summary.md'}" in printed
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recs = _records(out)
    labels = ["bf16", "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"]
    slugs = {"bf16": "bf16", labels[1]: "per_gemm-fprop=nvfp4-dgrad=mxfp8-wgrad=mxfp8"}
    for label in labels:
        mine = [r for r in recs if r["recipe"] == label]
        assert [r["step"] for r in mine] == list(range(21))
        steps = mine[1:]
        assert all(r["tokens_per_s"] > 0 and r["elapsed"] > 0 for r in steps)
        assert [r["step"] for r in mine if "val_loss" in r] == [0, 5, 10, 15, 20]
        first, last = sum(r["train_loss"] for r in steps[:3]) / 3, sum(r["train_loss"] for r in steps[-3:]) / 3
        assert last < first - 0.5, f"{label}: train loss {first:.3f} -> {last:.3f}"
        assert mine[-1]["val_loss"] < mine[0]["val_loss"] - 0.5
        assert (out / "checkpoints" / f"{slugs[label]}.pt").is_file()
    summary = (out / "summary.md").read_text()
    assert "| `bf16` |" in summary and "baseline" in summary and " %" in summary
    assert "NVFP4" in summary and "MXFP8" in summary  # the emulated GEMM pairs are listed
    assert "fprop: NVFP4" in summary and "dgrad: MXFP8" in summary
    # same data and same initial weights: the initial validation losses are identical
    v0 = {r["recipe"]: r["val_loss"] for r in recs if r["step"] == 0}
    assert v0[labels[0]] == pytest.approx(v0[labels[1]], rel=0.02)


@pytest.mark.parametrize("recipes", ["fp8-delayed,mxfp8-fwd-nvfp4-bwd"])
def test_resume_is_bitwise_identical(tmp_path, cache, recipes):
    """fp8-delayed carries quantizer state (amax history); mxfp8-fwd-nvfp4-bwd draws random
    numbers (stochastic rounding of gradients) from torch's generator."""
    full, split = tmp_path / "full", tmp_path / "split"
    _train(cache, full, "--compare", recipes, "--steps", "20")
    _train(cache, split, "--compare", recipes, "--steps", "10", "--lr-decay-steps", "20")
    _train(cache, split, "--resume", "--steps", "20")
    for label in recipes.split(","):
        assert _losses(split, label) == _losses(full, label)  # every step's losses, exactly
        lrs = [[r.get("lr") for r in _records(out) if r["recipe"] == label] for out in (split, full)]
        assert lrs[0] == lrs[1]  # the resumed scheduler continues the schedule's floats
        a = torch.load(full / "checkpoints" / f"{label}.pt", weights_only=True)
        b = torch.load(split / "checkpoints" / f"{label}.pt", weights_only=True)
        assert a["step"] == b["step"] == 20
        assert a["model"].keys() == b["model"].keys()
        for k, v in a["model"].items():  # parameters, and quantizer state as modules' extra state
            assert _same(v, b["model"][k]), f"{label}: state {k} differs after resume"
        for (ka, va), (kb, vb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items()):
            assert all(torch.equal(va[s], vb[s]) for s in ("exp_avg", "exp_avg_sq"))


def _same(a, b) -> bool:
    """Bitwise equality of nested state (tensors, dicts, lists, plain values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_resume_without_a_run_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["train", "--resume", "--out", str(tmp_path / "none"), "--no-progress"]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_python_dash_m_entry_point(tmp_path, cache):
    out = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "hybridfp.train", "--preset", "test", "--recipe", "fp8",
                        "--steps", "2", "--eval-iters", "1", "--out", str(out), "--no-progress",
                        "--cache-dir", str(cache)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "summary:" in r.stdout and (out / "summary.md").is_file()


def test_moe_preset_through_the_cli(tmp_path, cache):
    out = tmp_path / "moe"
    assert cli.main(["train", "--preset", "test-moe", "--recipe", "nvfp4-fwd-mxfp8-bwd", "--steps", "3",
                     "--eval-iters", "1", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]) == 0
    steps = [r for r in _records(out) if "train_loss" in r]
    assert len(steps) == 3 and all(r["aux_loss"] >= 1.0 - 1e-6 for r in steps)  # Switch aux >= 1
    summary = (out / "summary.md").read_text()
    assert "NVFP4" in summary and "(4 modules)" in summary  # the experts' fprop (2 layers x fc1/fc2)


def test_evaluation_does_not_move_delayed_scaling_state(tmp_path, cache):
    """Evaluating every 5 steps or only at the end gives the same delayed-scaling training
    trajectory: evaluation restores the quantizers' amax history and scales."""
    often, rarely = tmp_path / "often", tmp_path / "rarely"
    _train(cache, often, "--recipe", "fp8-delayed", "--steps", "12")
    argv = ["train", "--preset", "test", "--out", str(rarely), "--cache-dir", str(cache),
            "--no-progress", "--eval-interval", "12", "--recipe", "fp8-delayed", "--steps", "12"]
    assert cli.main(argv) == 0
    train = lambda out: [r["train_loss"] for r in _records(out) if "train_loss" in r]
    assert train(often) == train(rarely)
    assert _records(often)[-1]["val_loss"] == _records(rarely)[-1]["val_loss"]


# ------------------------------------------------- --jobs N (worker processes) and NAME@seed=K
def _by_recipe(out):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    table: dict[str, list] = {}
    for r in recs:
        table.setdefault(r["recipe"], []).append((r["step"], r.get("train_loss"), r.get("val_loss")))
    return table


def test_workers_give_the_sequential_runs_bit_for_bit(tmp_path, cache):
    # The workers get the resolved settings, so each recipe is the run it would be in-process:
    # the same losses to the last bit (CPU, same thread count). The in-process reference is one
    # 14-step run with the cosine decay fixed at 10 steps: its steps 0..10 are the 10-step run's
    # (same schedule up to step 10; --resume relies on that too), so it serves both comparisons.
    _train(cache, tmp_path / "full", "--compare", "bf16,fp8", "--steps", "14", "--lr-decay-steps", "10")
    full = _by_recipe(tmp_path / "full")
    _train(cache, tmp_path / "par", "--compare", "bf16,fp8", "--steps", "10", "--jobs", "2")
    par = _by_recipe(tmp_path / "par")
    assert list(par) == ["bf16", "fp8"]
    assert par == {k: [r for r in v if r[0] <= 10] for k, v in full.items()}
    assert all([r[0] for r in v] == list(range(11)) for v in par.values())
    summary = (tmp_path / "par" / "summary.md").read_text()
    assert "| `fp8` |" in summary and "baseline" in summary
    assert (tmp_path / "par" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # --resume continues each worker's run: equal to the uninterrupted 14-step run.
    _train(cache, tmp_path / "par", "--resume", "--steps", "14", "--jobs", "2")
    assert _by_recipe(tmp_path / "par") == full


def test_seed_suffix_runs_another_seed_on_the_same_validation_text(tmp_path, cache):
    _train(cache, tmp_path / "s", "--compare", "bf16,bf16@seed=1,bf16@seed=0", "--steps", "5")
    runs = _by_recipe(tmp_path / "s")
    assert runs["bf16@seed=0"] == runs["bf16"]  # seed 0 is the run's own seed
    assert runs["bf16@seed=1"][1][1] != runs["bf16"][1][1]  # other init and batches
    row = next(line for line in (tmp_path / "s" / "summary.md").read_text().splitlines()
               if line.startswith("| `bf16@seed=1` |"))
    assert row.split("|")[3].strip().endswith("%")  # a gap vs bf16 (the noise floor), not "baseline"


def test_seed_suffix_parsing():
    r = parse_recipe("per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8@seed=3")
    assert r.seed == 3 and r.label.endswith("@seed=3") and parse_recipe(r.label).seed == 3
    assert [x.label for x in parse_recipe_list("fp8,fp8@seed=2")] == ["fp8", "fp8@seed=2"]
    with pytest.raises(ValueError, match="must be an integer"):
        parse_recipe("bf16@seed=x")


def test_bad_jobs_and_devices(tmp_path, cache, capsys):
    assert cli.main(["train", "--preset", "test", "--out", str(tmp_path), "--cache-dir", str(cache),
                     "--jobs", "0", "--steps", "1"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
    assert worker_devices("cpu", 3) == ["cpu"] * 3


def test_a_failing_worker_leaves_the_others(tmp_path, cache, monkeypatch, capsys):
    """A recipe that fails in its worker is reported (exit status 1); the others' results
    are still gathered into the summary and metrics."""
    (tmp_path / "badfactory_mod.py").write_text("from hybridfp.quantizers import Quantizer\n"
                                                "def factory(role) -> Quantizer:\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "r"
    argv = ["train", "--preset", "test", "--out", str(out), "--cache-dir", str(cache), "--no-progress",
            "--compare", "bf16,badfactory_mod:factory", "--steps", "3", "--jobs", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "badfactory_mod:factory (exit" in err
    assert list(_by_recipe(out)) == ["bf16"]
    assert "| `bf16` |" in (out / "summary.md").read_text()
