"""``hybridfp train --hf-config``: the shipped transformers configs (a dense Llama, a Qwen3-MoE)
train under BF16, FP8 and a hybrid with the built-in GPT's outputs (metrics, plot, summary,
checkpoints); losses fall; --resume and --recompute (transformers' gradient checkpointing) give
the same run bit for bit; options it does not support are refused by name. Skipped without
transformers (the hf extra)."""

from __future__ import annotations

import json

import pytest
import torch

import hybridfp as hfp
from hybridfp.moe import GroupedLinear
from hybridfp.nn import QuantizedModule
from hybridfp.train import cli
from hybridfp.train.hf_model import build_hf_model, quantized_share, read_hf_config, shipped_configs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

HYBRID = "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"
RECIPES = ["bf16", "fp8", HYBRID]


def _train(text, out, *extra):
    """``hybridfp train`` on the small text corpus; returns the exit status."""
    return cli.main(["train", "--preset", "test", "--data", str(text), "--out", str(out), "--no-progress",
                     "--seq-len", "32", "--batch-size", "4", "--eval-iters", "1", "--eval-interval", "4",
                     *extra])


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out, label):
    return [(r["step"], r.get("train_loss"), r.get("val_loss"), r.get("aux_loss"))
            for r in _records(out) if r["recipe"] == label]


def test_shipped_configs_are_package_data():
    assert shipped_configs() == ["llama-tiny", "qwen3-moe-tiny"]
    name, config = read_hf_config("qwen3-moe-tiny")
    assert name == "qwen3-moe-tiny" and config["model_type"] == "qwen3_moe" and config["vocab_size"] == 256


@pytest.mark.parametrize("name,arch", [("llama-tiny", "LlamaForCausalLM"),
                                       ("qwen3-moe-tiny", "Qwen3MoeForCausalLM")])
def test_hf_config_trains_and_reports_like_the_gpt(tmp_path, text, name, arch, capsys):
    out = tmp_path / name
    assert _train(text, out, "--hf-config", name, "--compare", ",".join(RECIPES), "--steps", "8") == 0
    printed = capsys.readouterr().out
    assert f"--hf-config {name}" in printed and f"summary: {out / 'summary.md'}" in printed
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert f"{arch} `{name}`" in summary and "weight-matrix elements read by hybridfp modules" in summary
    assert "| `bf16` | " in summary and "baseline" in summary and "fprop: NVFP4" in summary
    recs = _records(out)
    for label in RECIPES:
        mine = [r for r in recs if r["recipe"] == label]
        assert [r["step"] for r in mine] == list(range(9))
        steps = mine[1:]
        first, last = sum(r["train_loss"] for r in steps[:3]) / 3, sum(r["train_loss"] for r in steps[-3:]) / 3
        assert last < first - 0.5, f"{name} {label}: train loss {first:.3f} -> {last:.3f}"
        assert mine[-1]["val_loss"] < mine[0]["val_loss"] - 0.5
        assert ("aux_loss" in steps[0]) == (name == "qwen3-moe-tiny")  # the router's balance term
    # the same initial weights and batches for every recipe
    v0 = [r["val_loss"] for r in recs if r["step"] == 0]
    assert max(v0) == pytest.approx(min(v0), rel=0.01)
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["hf_name"] == name and run["config"]["hf_config"] == read_hf_config(name)[1]
    ck = torch.load(out / "checkpoints" / "fp8.pt", weights_only=True)
    assert ck["step"] == 8 and any(k.startswith("hf.model.layers.0.") for k in ck["model"])


def test_resume_and_recompute_are_bitwise_the_same_run(tmp_path, text):
    """Resumed at step 2 (delayed scaling's amax history and the stochastic-rounding RNG from
    the checkpoint), and trained with gradient checkpointing: every step's losses (aux loss
    included) equal the uninterrupted run's."""
    recipes = "fp8-delayed," + HYBRID
    extra = ("--hf-config", "qwen3-moe-tiny", "--lr-decay-steps", "4", "--eval-interval", "2")
    full, split, recompute = tmp_path / "full", tmp_path / "split", tmp_path / "recompute"
    assert _train(text, full, *extra, "--compare", recipes, "--steps", "4") == 0
    assert _train(text, split, *extra, "--compare", recipes, "--steps", "2") == 0
    assert _train(text, split, "--resume", "--steps", "4", "--eval-interval", "2") == 0
    assert _train(text, recompute, *extra, "--recipe", HYBRID, "--steps", "4", "--recompute") == 0
    for label in recipes.split(","):
        assert _losses(split, label) == _losses(full, label)
    assert _losses(recompute, HYBRID) == _losses(full, HYBRID)


def test_recompute_turns_on_transformers_gradient_checkpointing():
    _, config = read_hf_config("llama-tiny")
    model = build_hf_model(config, seed=0)
    assert not model.hf.is_gradient_checkpointing
    model.recompute = True
    assert model.hf.is_gradient_checkpointing
    model.recompute = False
    assert not model.hf.is_gradient_checkpointing


def test_dense_linears_run_through_hybridfp():
    _, config = read_hf_config("llama-tiny")
    model = build_hf_model(config, seed=0)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, QuantizedModule)}
    assert names >= {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    inside, total = quantized_share(model)
    per_layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64  # q, o; k, v (2 KV heads); gate, up, down
    assert 2 * per_layer <= inside < total  # the embedding stays high precision


def test_moe_experts_run_through_hybridfp():
    """Every routed-expert parameter of the Qwen3-MoE config is read by a hybridfp GroupedLinear,
    and those run in the trainer's forward; only the embedding, lm_head and routers stay out."""
    _, config = read_hf_config("qwen3-moe-tiny")
    model = build_hf_model(config, seed=0)
    experts = {id(p): p.numel() for n, p in model.named_parameters() if ".experts." in n}
    grouped = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    assert sum(experts.values()) == 2 * 4 * 3 * 32 * 64  # 2 layers x 4 experts x (gate, up, down)
    assert set(experts) == {id(m.weight) for m in grouped}
    assert quantized_share(model) == (2 * (2 * 64 * 64 + 2 * 32 * 64) + sum(experts.values()),
                                      107008)  # the rest: embedding, lm_head, 2 routers [4, 64]
    ran = []
    for m in grouped:
        m.register_forward_hook(lambda mod, args, out: ran.append(mod.name))
    with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
        model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))[1].backward()
    assert sorted(ran) == sorted(m.name for m in grouped) and len(ran) == 4
    assert all(p.grad is not None for n, p in model.named_parameters() if ".experts." in n)


def _error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridfp train: error: "), lines
    return lines[0]


@pytest.mark.parametrize("flags,words", [
    (["--fsdp"], ["--fsdp with --hf-config", "built-in GPT"]),
    (["--tp", "2"], ["--tp 2 with --hf-config"]),
    (["--ep", "2"], ["--ep 2 with --hf-config"]),
    (["--quantized-weights"], ["--quantized-weights with --hf-config"]),
    (["--jobs", "2", "--compare", "bf16,fp8"], ["--jobs with --hf-config"]),
])
def test_unsupported_options_are_refused_by_name(tmp_path, text, capsys, flags, words):
    assert _train(text, tmp_path / "o", "--hf-config", "llama-tiny", "--steps", "1", *flags) == 2
    line = _error(capsys)
    assert all(w in line for w in words), line


def test_bad_configs_are_refused_naming_what_to_change(tmp_path, text, capsys):
    _, config = read_hf_config("llama-tiny")
    small = tmp_path / "small-vocab.json"
    small.write_text(json.dumps({**config, "vocab_size": 200}))
    assert _train(text, tmp_path / "a", "--hf-config", str(small), "--steps", "1") == 2
    assert "vocab_size 200 is smaller than the data's tokenizer vocabulary (256)" in _error(capsys)
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**config, "max_position_embeddings": 16}))
    assert _train(text, tmp_path / "b", "--hf-config", str(short), "--steps", "1") == 2
    assert "max_position_embeddings 16 is smaller than --seq-len 32" in _error(capsys)
    assert _train(text, tmp_path / "c", "--hf-config", str(tmp_path / "none.json"), "--steps", "1") == 2
    line = _error(capsys)
    assert "no such file" in line and "llama-tiny, qwen3-moe-tiny" in line
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"vocab_size": 256}))
    assert _train(text, tmp_path / "d", "--hf-config", str(bad), "--steps", "1") == 2
    assert "lacks 'model_type'" in _error(capsys)
    bad.write_text(json.dumps({**config, "vocab_size": "256"}))
    assert _train(text, tmp_path / "e", "--hf-config", str(bad), "--steps", "1") == 2
    assert "vocab_size is '256'; it must be a positive integer" in _error(capsys)


def test_resume_with_another_config_is_refused(tmp_path, text, capsys):
    out = tmp_path / "r"
    assert _train(text, out, "--hf-config", "llama-tiny", "--recipe", "bf16", "--steps", "1") == 0
    capsys.readouterr()
    assert _train(text, out, "--resume", "--hf-config", "qwen3-moe-tiny", "--steps", "2") == 2
    assert "trains another architecture" in _error(capsys)
