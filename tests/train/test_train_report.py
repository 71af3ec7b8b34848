"""Pieces of the run: LR schedule, settings from flags, summary and plot without a GPU or a run."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from hybridfp.train import cli
from hybridfp.train.checkpoint import rng_state, set_rng_state
from hybridfp.train.loop import RunResult, count_params, lr_at, make_optimizer, make_scheduler
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


def _reference_lr(step, cfg):
    """The schedule as the loop computed it before it became a torch.optim scheduler: the
    scheduler must give these floats bit for bit."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if step >= cfg.lr_decay_steps:
        return cfg.lr * cfg.min_lr_ratio
    t = (step - cfg.warmup) / max(1, cfg.lr_decay_steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(cfg):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))  # a matrix and a vector: both param groups
    return make_optimizer(model, cfg)


@pytest.mark.parametrize("flags", [
    ("--preset", "tiny"),                                                   # lr 3e-3, warmup 20, 200 steps
    ("--preset", "gpt2-small", "--steps", "600"),                           # lr 6e-4, warmup 200
    ("--preset", "test", "--steps", "50", "--lr-decay-steps", "30", "--warmup", "7", "--lr", "0.0007"),
    ("--preset", "test", "--steps", "40", "--warmup", "0"),
])
def test_scheduler_gives_the_old_schedule_bitwise_and_resumes_from_the_step(flags):
    """Over a whole run (and past the decay, as a resumed longer run sees it) the optimizer's
    learning rate at each step is the old formula's float exactly; a scheduler rebuilt at step
    k (a resumed run) continues with the same floats."""
    cfg = cli.config_from_args(_args(*flags))
    n = cfg.steps + 20
    want = [_reference_lr(s, cfg) for s in range(n)]
    opt = _optimizer(cfg)
    sched = make_scheduler(opt, cfg)
    got = []
    for _ in range(n):
        got.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert all(lrs == [w, w] for lrs, w in zip(got, want)), "not bitwise the old schedule"
    assert [lr_at(s, cfg) for s in range(n)] == want
    for k in (1, max(1, cfg.warmup - 1), cfg.warmup + 1, cfg.steps - 1, cfg.steps):
        resumed = _optimizer(cfg)
        resumed.load_state_dict(pickle.loads(pickle.dumps(opt.state_dict())))  # lr and initial_lr of another step
        sched = make_scheduler(resumed, cfg, k)
        for s in range(k, min(n, k + 30)):
            assert [g["lr"] for g in resumed.param_groups] == [want[s], want[s]], (k, s)
            resumed.step()
            sched.step()


def test_scheduler_resumes_an_optimizer_state_without_initial_lr():
    """A checkpoint's optimizer state without ``initial_lr`` (no scheduler attached when it
    was written) still resumes on the schedule."""
    cfg = cli.config_from_args(_args("--preset", "test", "--steps", "30", "--warmup", "5"))
    opt = _optimizer(cfg)
    for g in opt.param_groups:
        g["lr"] = 123.0
    make_scheduler(opt, cfg, 3)
    assert [g["lr"] for g in opt.param_groups] == [_reference_lr(3, cfg)] * 2


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


def test_weight_decay_skips_biases_also_stacked_expert_biases():
    """nanoGPT decays matrices only; a stacked expert bias [E, N] (GroupedLinear with
    ``single_parameter=True``, as converted transformers experts hold it) is a matrix by shape
    but a bias: it is not decayed, nor is any parameter whose own name says bias."""
    from hybridfp import GroupedLinear
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(3, 4),
                                 "experts": GroupedLinear(2, 3, 4, bias=True, single_parameter=True)})
    model.register_parameter("down_proj_bias", torch.nn.Parameter(torch.zeros(2, 4)))
    opt = make_optimizer(model, cli.config_from_args(_args("--preset", "test")))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    named = dict(model.named_parameters())
    assert {n for n, p in named.items() if id(p) in decayed} == {"dense.weight", "experts.weight"}
