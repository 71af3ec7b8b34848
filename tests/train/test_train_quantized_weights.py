"""``hybridfp train --quantized-weights`` (weights held quantized, FP32 masters) and
``--recompute`` (torch.utils.checkpoint per block) give the plain run's losses bit for bit, and a
quantized-weight run resumes bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

import hybridfp as hfp
from hybridfp.train import cli

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")
RECIPES = "fp8-delayed,mxfp8-fwd-nvfp4-bwd"  # amax history; stochastic rounding of gradients


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus-cache")


def _train(cache, out, *extra):
    argv = ["train", "--preset", "test", "--out", str(out), "--cache-dir", str(cache),
            "--no-progress", "--eval-interval", "3", "--compare", RECIPES, *extra]
    assert cli.main(argv) == 0


def _losses(out, val_of_delayed: bool = True):
    """Every record's losses. A delayed-scaling weight held quantized is encoded once per step
    (when re-quantized from its master), a high-precision weight in every autocast region: the
    evaluation's regions after its first then read another encoding (README), so its
    validation losses are compared only where both runs hold the weights alike."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted((r["recipe"], r["step"], r.get("train_loss"),
                   r.get("val_loss") if val_of_delayed or r["recipe"] != "fp8-delayed" else None) for r in recs)


def test_quantized_weights_and_recompute_give_the_plain_run(tmp_path, cache):
    runs = {"plain": (), "quantized": ("--quantized-weights",), "recompute": ("--recompute",),
            "both": ("--quantized-weights", "--recompute")}
    for name, flags in runs.items():
        _train(cache, tmp_path / name, "--steps", "6", *flags)
    assert _losses(tmp_path / "recompute") == _losses(tmp_path / "plain")
    assert _losses(tmp_path / "both") == _losses(tmp_path / "quantized")
    assert _losses(tmp_path / "quantized", False) == _losses(tmp_path / "plain", False)
    ck = torch.load(tmp_path / "quantized" / "checkpoints" / "fp8-delayed.pt", weights_only=True)
    held = [k for k, v in ck["model"].items() if isinstance(v, hfp.QuantizedTensor)]
    assert held and all(k.endswith("weight") for k in held)
    assert set(ck["optimizer"]) == {"optimizer", "master_params", "weight_digests"}


def test_quantized_weights_resume_bitwise(tmp_path, cache):
    full, split = tmp_path / "full", tmp_path / "split"
    _train(cache, full, "--steps", "6", "--quantized-weights")
    _train(cache, split, "--steps", "3", "--lr-decay-steps", "6", "--quantized-weights")
    _train(cache, split, "--resume", "--steps", "6")
    assert _losses(split) == _losses(full)


def test_parser_knows_the_flags():
    args = cli.build_parser().parse_args(["train", "--quantized-weights", "--recompute"])
    cfg = cli.config_from_args(args)
    assert cfg.quantized_weights and cfg.recompute
