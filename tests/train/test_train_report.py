"""Pieces of the run: LR schedule, settings from flags, summary and plot without a GPU or a run."""

from __future__ import annotations

import pytest
import torch

from hybridfp.train import cli
from hybridfp.train.checkpoint import rng_state, set_rng_state
from hybridfp.train.loop import RunResult, count_params, lr_at
from hybridfp.train.model import GPT, PRESETS
from hybridfp.train.plot import ema, plot_losses
from hybridfp.train.report import relative_gap, summary_markdown


def _args(*argv):
    return cli.build_parser().parse_args(["train", *argv])


def test_lr_schedule_warmup_cosine_floor():
    cfg = cli.config_from_args(_args("--preset", "test", "--steps", "100", "--lr", "1.0", "--warmup", "10"))
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    floor = pytest.approx(cfg.min_lr_ratio)
    assert lr_at(100, cfg) == floor and lr_at(500, cfg) == floor
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 120))


def test_settings_from_flags_and_preset():
    cfg = cli.config_from_args(_args("--preset", "tiny", "--tokens", "100000", "--seq-len", "64"))
    assert cfg.seq_len == 64 and cfg.batch_size == PRESETS["tiny"].batch_size
    assert cfg.steps == -(-100000 // (64 * cfg.batch_size)) and cfg.lr_decay_steps == cfg.steps
    assert cfg.device == "cpu" and cfg.dtype == "bf16"
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        cli.config_from_args(_args("--steps", "0"))
    with pytest.raises(ValueError, match="--batch-size must be at least 1"):
        cli.config_from_args(_args("--batch-size", "0"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        cli.config_from_args(_args("--device", "cuda"))


def test_count_params_allocates_nothing_and_matches():
    cfg = cli.config_from_args(_args("--preset", "test"))
    assert count_params(cfg, 256) == GPT(PRESETS["test"].model).num_params()


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def _result(label, vals, emulated=()):
    recs = [{"step": 0, "recipe": label, "val_loss": vals[0]}]
    recs += [{"step": i, "recipe": label, "train_loss": v, "val_loss": v} for i, v in enumerate(vals[1:], 1)]
    return RunResult(label, f"{label} recipe", recs, list(emulated), tokens=1000, train_seconds=2.0)


def test_summary_gaps_and_emulated_pairs(tmp_path):
    cfg = cli.config_from_args(_args("--preset", "test"))
    results = [_result("bf16", [5.0, 3.0, 2.0]), _result("fp8", [5.0, 3.1, 2.1], ["fprop: A x B (2 modules)"])]
    md = summary_markdown(results, cfg, {"params": 1234, "data": "unit"})
    assert "| `bf16` | 2.0000 | baseline |" in md and "| `fp8` | 2.1000 | +5.00 % |" in md
    assert "500" in md  # tokens/s = 1000 / 2
    assert "  - fprop: A x B (2 modules)" in md and "- `bf16`: none" in md
    assert relative_gap(2.1, 2.0) == pytest.approx(5.0) and relative_gap(None, 2.0) is None
    no_base = summary_markdown(results[1:], cfg, {})
    assert "add it to --compare" in no_base
    png = plot_losses(results, tmp_path / "p" / "loss.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert plot_losses(results[1:], tmp_path / "q.png").is_file()  # no baseline: still a plot


def test_ema_is_bias_corrected():
    assert ema([2.0, 2.0, 2.0], span=10) == pytest.approx([2.0, 2.0, 2.0])
