"""torchtitan's checkpointer on models the hybridfp converter built (CPU, one process).

torchtitan's ``CheckpointManager`` wraps the model in ``ModelWrapper``, whose ``state_dict``
reads ``shape`` / ``dtype`` of every value, and maps keys through the model's HF state-dict
adapter for HF loads and saves: its model state dicts hold tensors only. A converted module's
quantizer state is left out when it holds nothing to restore (every recipe here but delayed
scaling); delayed scaling's state is no tensor, and the checkpointer stops on it with an error
naming the module and what to do. The helpers are ``test_torchtitan.py``'s (the same CPU-size
debug models).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.checkpointer.base import ModelWrapper  # noqa: E402

from hybridfp.integration.torchtitan import StatefulQuantizerCheckpointError  # noqa: E402

from test_torchtitan import MODELS, HybridFPConverter, _build, _config, _tokens  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning"),  # CPU: expected
              # DCP on one process without a process group (what these tests mean)
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

CASES = [(name, recipe) for name in MODELS for recipe in ("mxfp8", "fp8")]


def _step(model, tokens: torch.Tensor) -> torch.Tensor:
    """One forward / backward (the quantizers are built); the output, detached."""
    y = model(tokens)
    y.float().pow(2).mean().backward()
    return y.detach()


def _manager(model, folder, adapter=None, **options) -> CheckpointManager:
    """torchtitan's DCP checkpoint manager for the model alone, as its trainer builds one (a
    resume restores the model only: there is no optimizer, scheduler or dataloader; all
    checkpoints kept: no purge thread)."""
    config = CheckpointManager.Config(enable=True, folder=str(folder), keep_latest_k=0, exclude_from_loading=[
        "optimizer", "lr_scheduler", "dataloader"], **options)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=None,
                             lr_schedulers=None, states={}, sd_adapter=adapter)


def _fresh(cfg, reference):
    """The model of ``cfg`` built from another seed: none of ``reference``'s weights."""
    torch.manual_seed(5)
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    ref = reference.state_dict()
    assert all(not torch.equal(v, ref[k]) for k, v in model.state_dict().items() if v.dim() >= 2)
    return model


@pytest.mark.parametrize("name, recipe", CASES)
def test_model_wrapper_state_dict_holds_tensors_only(name, recipe):
    """With the converter's default options: ``ModelWrapper.state_dict`` (every save, resume
    and HF load) works before and after a step, with the unconverted model's keys, and the
    model loads its own state dict with ``strict=True``."""
    cfg = _config(name, [HybridFPConverter.Config(recipe=recipe)])
    model = _build(cfg)
    wrapper = ModelWrapper(model)  # the CheckpointManager's, made before training
    keys = set(_build(_config(name)).state_dict())
    for _ in range(2):  # before the quantizers exist, then after a step built them
        sd = wrapper.state_dict()
        assert set(sd) == keys and all(isinstance(v, torch.Tensor) for v in sd.values())
        _step(model, _tokens(cfg.vocab_size))
    sd = model.state_dict()
    assert set(sd) == keys
    res = model.load_state_dict(sd, strict=True)
    assert not res.missing_keys and not res.unexpected_keys


@pytest.mark.parametrize("name, recipe", CASES)
def test_dcp_save_and_resume_through_torchtitan_checkpointer(name, recipe, tmp_path):
    """torchtitan's CheckpointManager saves the trained model (DCP, one process) and loads it
    into a model built from another seed: the same outputs, bitwise."""
    cfg = _config(name, [HybridFPConverter.Config(recipe=recipe)])
    model = _build(cfg)
    x = _tokens(cfg.vocab_size, seed=2)
    _step(model, _tokens(cfg.vocab_size))
    assert _manager(model, tmp_path / "ckpt").save(curr_step=1, last_step=True)
    resumed = _fresh(cfg, model)
    assert _manager(resumed, tmp_path / "ckpt").load()  # finds step-1 in the folder
    with torch.no_grad():
        assert torch.equal(resumed(x), model(x))


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_save_and_load_with_lm_head_converted(name, tmp_path):
    """``lm_head`` converted too (``filter_fqns=["router"]``): the model's HF adapter maps the
    state dict (``to_hf`` / ``from_hf``, the unconverted model's HF keys), and torchtitan's
    checkpointer saves it in HF format (``last_save_in_hf``) and loads it back
    (``initial_load_in_hf``) into a model built from another seed: the same outputs, bitwise."""
    registry, flavor, _ = MODELS[name]
    converters = [HybridFPConverter.Config(recipe="mxfp8", filter_fqns=["router"])]
    cfg = _config(name, converters)
    model = _build(cfg)
    assert "lm_head" in {n for n, m in model.named_modules() if type(m).__name__ == "HybridFPLinear"}
    adapter = registry(flavor, converters=converters).state_dict_adapter(cfg, None)
    _step(model, _tokens(cfg.vocab_size))

    keys = set(_build(_config(name)).state_dict())  # the unconverted model's
    hf = adapter.to_hf(model.state_dict())  # once a KeyError on 'lm_head._extra_state' (llama3)
    assert set(hf) == set(adapter.to_hf(_build(_config(name)).state_dict()))
    assert set(adapter.to_hf(ModelWrapper(model).state_dict())) == set(hf)  # the checkpointer's way
    other = _fresh(cfg, model)
    back = adapter.from_hf(hf)
    res = other.load_state_dict(back, strict=False)
    # missing: only what torchtitan's HF format leaves out (qwen3's expert_bias_E buffer)
    assert not res.unexpected_keys and set(res.missing_keys) == keys - set(back)

    assert _manager(model, tmp_path / "save", adapter, last_save_in_hf=True).save(curr_step=1, last_step=True)
    loaded = _fresh(cfg, model)
    assert _manager(loaded, tmp_path / "load", adapter, initial_load_path=str(tmp_path / "save" / "step-1"),
                    initial_load_in_hf=True).load()
    x = _tokens(cfg.vocab_size, seed=2)
    with torch.no_grad():
        y = model(x)
        assert torch.equal(loaded(x), y) and torch.equal(other(x), y)


def test_delayed_scaling_is_refused_by_torchtitan_checkpointer(tmp_path):
    """Delayed scaling keeps quantizer state (amax histories) that torchtitan's checkpointer
    cannot hold: its state dict reads stop with an error naming the module, delayed scaling
    and what to do, before the first step (the checkpointer's resume) and after it (its save).
    A plain ``torch.save`` still carries the state (``test_torchtitan.py``'s round trip)."""
    cfg = _config("qwen3_moe", [HybridFPConverter.Config(recipe="fp8-delayed")])
    model = _build(cfg)
    manager = _manager(model, tmp_path / "ckpt")
    what = r"HybridFP\w+ layers\.0\.\S+: .*delayed scaling.*recipe that keeps no quantizer state"
    with pytest.raises(StatefulQuantizerCheckpointError, match=what):
        manager.states["model"].state_dict()
    _step(model, _tokens(cfg.vocab_size))
    with pytest.raises(StatefulQuantizerCheckpointError, match=what):
        manager.save(curr_step=1, last_step=True)
    experts = "layers.0.moe.routed_experts.inner_experts._extra_state"
    state = model.state_dict()[experts]
    assert sorted(state) == ["w1_EFD", "w2_EDF", "w3_EFD"] and state["w1_EFD"]["built"]
    with pytest.raises(StatefulQuantizerCheckpointError, match="HybridFPGroupedExperts layers.0.moe"):
        state.shape
