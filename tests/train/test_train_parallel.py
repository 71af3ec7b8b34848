"""``hybridfp train --jobs N`` (recipes in worker processes) and ``NAME@seed=K`` runs."""

from __future__ import annotations

import json

import pytest

from hybridfp.train import cli
from hybridfp.train.parallel import worker_devices
from hybridfp.train.recipes_by_name import parse_recipe, parse_recipe_list

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus-cache")


def _train(cache, out, *extra):
    argv = ["train", "--preset", "test", "--out", str(out), "--cache-dir", str(cache),
            "--no-progress", "--eval-interval", "5", *extra]
    assert cli.main(argv) == 0


def _by_recipe(out):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    table: dict[str, list] = {}
    for r in recs:
        table.setdefault(r["recipe"], []).append((r["step"], r.get("train_loss"), r.get("val_loss")))
    return table


def test_workers_give_the_sequential_runs_bit_for_bit(tmp_path, cache):
    # The workers get the resolved settings, so each recipe is the run it would be in-process:
    # the same losses to the last bit (CPU, same thread count).
    _train(cache, tmp_path / "seq", "--compare", "bf16,fp8", "--steps", "10")
    _train(cache, tmp_path / "par", "--compare", "bf16,fp8", "--steps", "10", "--jobs", "2")
    seq, par = _by_recipe(tmp_path / "seq"), _by_recipe(tmp_path / "par")
    assert list(par) == ["bf16", "fp8"] and par == seq
    summary = (tmp_path / "par" / "summary.md").read_text()
    assert "| `fp8` |" in summary and "baseline" in summary
    assert (tmp_path / "par" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # --resume continues each worker's run: equal to an uninterrupted 14-step run.
    _train(cache, tmp_path / "par", "--resume", "--steps", "14", "--jobs", "2")
    _train(cache, tmp_path / "full", "--compare", "bf16,fp8", "--steps", "14", "--lr-decay-steps", "10")
    assert _by_recipe(tmp_path / "par") == _by_recipe(tmp_path / "full")


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
