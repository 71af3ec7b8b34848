"""``hybridfp train``'s SwiGLU: ``hybridfp.swiglu`` by default, eager ``F.silu(g) * u`` with
``--eager-swiglu``. Off CUDA both run the same eager ops, so a CPU model trains bitwise the same
either way; on CUDA the fused kernels differ in the last bits. A run resumed from a run.json
written before the setting existed continues with the eager activation it trained with."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_cli_robust import _one_error_line, _run  # the same smallest run and one-line error check

from hybridfp import autocast
from hybridfp.train import cli
from hybridfp.train.model import GPT, PRESETS
from hybridfp.train.recipes_by_name import parse_recipe

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


def _step(preset: str, fused: bool, recipe: str, device: str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, gradients by name) of one seeded forward + backward of ``preset``'s model (FP32
    weights, BF16 activations, as ``hybridfp train`` runs it)."""
    torch.manual_seed(0)
    model = GPT(replace(PRESETS[preset].model, fused_swiglu=fused)).to(device)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    with autocast(recipe=parse_recipe(recipe).recipe):
        _, loss = model(x, x.roll(-1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["test", "test-moe"])
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_fused_and_eager_swiglu_train_alike_on_the_cpu(preset, recipe):
    loss_f, grads_f = _step(preset, True, recipe)
    loss_e, grads_e = _step(preset, False, recipe)
    assert torch.equal(loss_f, loss_e)
    assert grads_f.keys() == grads_e.keys() and any("mlp" in n for n in grads_f)
    for name in grads_f:
        assert torch.equal(grads_f[name], grads_e[name]), name


def test_the_option_reaches_the_model_and_the_default_is_fused():
    parser = cli.argparse.ArgumentParser()
    cli.add_train_args(parser)
    assert cli.config_from_args(parser.parse_args(["--preset", "test"])).model.fused_swiglu is True
    cfg = cli.config_from_args(parser.parse_args(["--preset", "test-moe", "--eager-swiglu"]))
    assert cfg.model.fused_swiglu is False
    model = GPT(cfg.model)
    assert model.blocks[0].mlp.fused_swiglu is False
    assert GPT(PRESETS["test"].model).blocks[0].mlp.fused is True


def test_a_run_started_before_the_option_resumes_eager(tmp_path, text, caplog):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "2") == 0
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["model"]["fused_swiglu"] is True
    del run["config"]["model"]["fused_swiglu"]  # as a run.json and checkpoint written before the option
    (out / "run.json").write_text(json.dumps(run))
    ck_path = out / "checkpoints" / "bf16.pt"
    ck = torch.load(ck_path, weights_only=True)
    del ck["config"]["model"]["fused_swiglu"]
    torch.save(ck, ck_path)
    parser = cli.argparse.ArgumentParser()
    cli.add_train_args(parser)
    saved, _ = cli.read_run_json(out / "run.json")
    assert cli.config_from_args(parser.parse_args(["--resume"]), saved).model.fused_swiglu is False
    assert _run(text, out, "--resume", "--steps", "3") == 0
    # a fused run keeps its kernel on resume: --eager-swiglu is noted and ignored
    fused = tmp_path / "fused"
    assert _run(text, fused, "--recipe", "bf16", "--steps", "2") == 0
    saved, _ = cli.read_run_json(fused / "run.json")
    with caplog.at_level("WARNING", logger="hybridfp.train"):
        cfg = cli.config_from_args(parser.parse_args(["--resume", "--eager-swiglu"]), saved)
    assert cfg.model.fused_swiglu is True and "ignoring --eager-swiglu" in caplog.text


def test_eager_swiglu_with_hf_config_is_refused(tmp_path, text, capsys):
    pytest.importorskip("transformers")
    assert _run(text, tmp_path / "hf", "--hf-config", "llama-tiny", "--recipe", "bf16", "--steps", "1",
                "--eager-swiglu") == 2
    assert "--eager-swiglu with --hf-config" in _one_error_line(capsys)
    assert not (tmp_path / "hf" / "run.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["test", "test-moe"])
def test_fused_swiglu_on_cuda_is_close_to_eager(preset):
    loss_f, grads_f = _step(preset, True, "fp8", "cuda")
    loss_e, grads_e = _step(preset, False, "fp8", "cuda")
    # the kernels round silu(g) * u once in BF16 where eager rounds silu(g) first: last bits
    # of the activation, and FP8 codes that may move by one step where a scale or value moves
    assert abs(loss_f.item() - loss_e.item()) <= 0.02 * abs(loss_e.item())
    for name in grads_f:
        ref = grads_e[name].float()
        assert (grads_f[name].float() - ref).norm() <= 0.1 * ref.norm() + 1e-6, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["test", "test-moe"])
def test_fused_swiglu_recomputed_on_cuda_is_bitwise_the_step_without(preset):
    """--recompute replays each block's forward in backward: the fused kernels (and an MoE layer's
    recorded expert amaxes, which fc2's FP8 current scaling reads) give the same bits again."""
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(PRESETS[preset].model).cuda()
        model.recompute = recompute
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).cuda()
        with autocast(recipe=parse_recipe("fp8").recipe):
            _, loss = model(x, x.roll(-1, 1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
