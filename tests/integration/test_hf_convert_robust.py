"""``hybridfp.convert`` / ``hybridfp.nn.convert`` where models are pickled, partly converted,
filtered, hooked or are a bare ``nn.Linear``:

- a converted MoE model pickles (``torch.save(model)``, multiprocessing's spawn) and
  deep-copies, and the copy computes what the original does;
- ``save_pretrained`` of any ``PreTrainedModel`` around or inside the converted part writes
  tensors only (``convert(model.model)``, then ``model.save_pretrained``), while
  ``state_dict()`` keeps the quantizers' state;
- ``module_filter`` sees ``nn.Linear`` and experts modules only, and a filter or a check that
  raises leaves the model unconverted;
- hooks on a replaced ``nn.Linear`` move to its ``hybridfp.Linear`` (or convert refuses, naming
  the module, when they cannot: accelerate's, legacy backward hooks, weight_norm);
- a model that is itself an ``nn.Linear`` is replaced (the returned module).

Tiny random-init transformers models (no download); the transformers tests skip without it."""

from __future__ import annotations

import copy
import gc
import inspect
import io
import pickle
import types
import warnings

import pytest
import torch
from torch import nn

import hybridfp as hfp

VOCAB, TOKENS = 64, (2, 12)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
}


def _hf():
    return pytest.importorskip("transformers")


def build(arch: str, seed: int = 0):
    transformers = _hf()
    config_cls, moe = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **moe})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def quietly_converted(model: nn.Module) -> nn.Module:
    """``hybridfp.convert`` with nothing left behind silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", hfp.HighPrecisionWeightsWarning)
        return hfp.convert(model)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(seed))


def experts_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if "gate_up_proj" in m._parameters]


def logits(model: nn.Module, recipe=None, seed: int = 1) -> torch.Tensor:
    with torch.no_grad(), hfp.autocast(recipe=recipe or hfp.Float8CurrentScaling()):
        return model(input_ids=batch(seed)).logits


def unconverted(model: nn.Module) -> bool:
    """No hybridfp module and no converted experts forward anywhere in ``model``."""
    return not any(isinstance(m, hfp.nn.QuantizedModule) or "forward" in m.__dict__ for m in model.modules())


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hfp.gemm.EmulatedGemmWarning)  # the CPU has no fast kernels
        yield


# ---------------------------------------------------------------------------------------- pickle


def test_a_converted_moe_model_pickles_and_computes_the_same():
    model = quietly_converted(build("qwen3_moe"))
    want = logits(model)
    buf = io.BytesIO()
    torch.save(model, buf)  # the whole model: weights_only=False is the user's choice
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    # the same weights, the same arithmetic, in the same order
    assert torch.equal(logits(loaded), want)
    for experts in experts_of(loaded):
        assert experts.hybridfp_up.weight is experts.gate_up_proj
        assert all(m._quantizers for m in (experts.hybridfp_up, experts.hybridfp_down))  # ran through hybridfp
    # one module alone, with pickle (as multiprocessing's spawn sends it); one that has not run
    # yet: plain pickle cannot write float8 tensors (torch's limitation; torch.save can), and an
    # FP8 run leaves a cached float8 weight in the module
    experts = experts_of(quietly_converted(build("qwen3_moe")))[0]
    again = pickle.loads(pickle.dumps(experts))
    assert again.hybridfp_down.weight is again.down_proj
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    w = torch.full((5, 2), 0.5)
    with torch.no_grad():
        assert torch.equal(again(x, idx, w), experts(x, idx, w))
    # transformers may read the experts' signature
    assert list(inspect.signature(experts.forward).parameters) == ["hidden_states", "top_k_index", "top_k_weights"]


def test_a_deep_copy_of_a_converted_moe_model_runs_its_own_weights():
    model = quietly_converted(build("qwen3_moe"))
    twin = copy.deepcopy(model)
    assert torch.equal(logits(twin), logits(model))
    for experts in experts_of(twin):
        assert experts.hybridfp_up.weight is experts.gate_up_proj
        with torch.no_grad():
            experts.down_proj.zero_()  # the copy's experts now add nothing
    assert not torch.equal(logits(twin), logits(model))
    assert all(e.down_proj.abs().sum() > 0 for e in experts_of(model))


# ------------------------------------------------------------------------------- save_pretrained


def _loads_cleanly(path, model: nn.Module, auto: str = "AutoModelForCausalLM") -> None:
    """``path`` loads into a fresh unconverted model with no missing / unexpected keys, holding
    ``model``'s tensors."""
    transformers = _hf()
    plain, info = getattr(transformers, auto).from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    got = plain.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_save_pretrained_after_converting_the_decoder_only(arch, tmp_path):
    model = build(arch)
    quietly_converted(model.model)  # the decoder: lm_head (or a vision tower) left out
    assert type(model.lm_head) is nn.Linear and not unconverted(model.model)
    with hfp.autocast(recipe=hfp.DelayedScaling(amax_history_len=4)):
        model(input_ids=batch())  # quantizer state (amax histories) to keep out of the checkpoint
    model.save_pretrained(tmp_path)
    _loads_cleanly(tmp_path, model)
    # torch checkpoints keep the quantizers' state
    state = model.state_dict()
    extra = [k for k in state if k.endswith("_extra_state")]
    assert extra and all(k.startswith("model.") for k in extra)
    again = build(arch, seed=1)
    quietly_converted(again.model)
    again.load_state_dict(state)
    assert torch.equal(logits(again, hfp.DelayedScaling(amax_history_len=4)),
                       logits(model, hfp.DelayedScaling(amax_history_len=4)))


def test_save_pretrained_of_a_part_of_a_converted_model(tmp_path):
    model = quietly_converted(build("qwen3_moe"))
    with hfp.autocast(recipe=hfp.DelayedScaling(amax_history_len=4)):
        model(input_ids=batch())
    model.model.save_pretrained(tmp_path / "decoder")  # the inner PreTrainedModel
    _loads_cleanly(tmp_path / "decoder", model.model, auto="AutoModel")
    model.save_pretrained(tmp_path / "whole")
    _loads_cleanly(tmp_path / "whole", model)


def test_save_pretrained_with_a_hybridfp_module_built_in_directly(tmp_path):
    """A hybridfp.Linear placed into a transformers model by hand (no convert call) keeps its
    quantizer state out of save_pretrained too (the hook is the module's own)."""
    model = build("llama")
    old = model.model.layers[0].mlp.down_proj
    lin = hfp.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    with torch.no_grad():
        lin.weight.copy_(old.weight)
    model.model.layers[0].mlp.down_proj = lin
    with hfp.autocast(recipe=hfp.DelayedScaling(amax_history_len=4)):
        model(input_ids=batch())
    assert "model.layers.0.mlp.down_proj._extra_state" in model.state_dict()
    model.save_pretrained(tmp_path)
    _loads_cleanly(tmp_path, model)


# --------------------------------------------------------------------------------- module_filter


def test_module_filter_sees_linears_and_experts_only():
    seen = []

    def spy(name, m):
        seen.append((name, type(m).__name__))
        return True

    with pytest.warns(hfp.HighPrecisionWeightsWarning, match="Conv1d"):
        hfp.convert(nn.Sequential(nn.Linear(32, 32), nn.Conv1d(32, 32, 1)), module_filter=spy)
    assert seen == [("0", "Linear")]
    # a filter that reads what linears have (torchao's habit) meets nothing else
    by_width = lambda name, m: m.in_features % 16 == 0  # noqa: E731
    with pytest.warns(hfp.HighPrecisionWeightsWarning, match="Conv1d"):
        model = hfp.convert(nn.Sequential(nn.Linear(32, 32), nn.Conv1d(32, 32, 1)), module_filter=by_width)
    assert type(model[0]) is hfp.Linear
    seen.clear()
    hfp.convert(build("qwen3_moe"), module_filter=spy)
    kinds = {kind for _, kind in seen}
    assert kinds == {"Linear", "Qwen3MoeExperts"}


def test_module_filter_on_gpt2_conv1d():
    transformers = _hf()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.warns(hfp.HighPrecisionWeightsWarning, match="Conv1D"):
        hfp.convert(model, module_filter=lambda name, m: m.in_features % 16 == 0)


def test_a_filter_that_raises_leaves_the_model_unconverted():
    model = build("qwen3_moe")
    params = [(n, id(p)) for n, p in model.named_parameters()]

    def refuse_late(name, m):
        if name == "model.layers.1.self_attn.o_proj":
            raise RuntimeError("no")
        return True

    with pytest.raises(RuntimeError, match="no"):
        hfp.convert(model, module_filter=refuse_late)
    assert unconverted(model)
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    quietly_converted(model)  # and it converts afterwards
    assert not unconverted(model)


def test_experts_refused_late_leave_the_model_unconverted():
    model = build("qwen3_moe")
    experts_of(model)[-1].config = types.SimpleNamespace(_experts_implementation="no_such_kernel")
    with pytest.raises(ValueError, match="_experts_implementation='no_such_kernel'"):
        hfp.convert(model)
    assert unconverted(model)


# ------------------------------------------------------------------------------------------ hooks


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


@pytest.mark.parametrize("convert", [hfp.convert, hfp.nn.convert], ids=["hybridfp.convert", "nn.convert"])
def test_hooks_move_to_the_new_linear(convert):
    model = _mlp()
    calls = []

    def note(what):
        def hook(module, *args, **kwargs):
            calls.append((what, type(module)))
        return hook

    def doubles(module, args, kwargs, output):
        calls.append(("forward", type(module)))
        return output * 2

    first, last = model[0], model[2]
    handles = [
        first.register_forward_pre_hook(note("pre"), with_kwargs=True),
        first.register_forward_hook(doubles, with_kwargs=True, always_call=True),
        last.register_full_backward_pre_hook(note("backward pre")),
        last.register_full_backward_hook(note("backward")),
        last.register_state_dict_post_hook(note("state_dict")),
        last.register_load_state_dict_pre_hook(note("load pre")),
        last.register_load_state_dict_post_hook(note("load post")),
    ]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    model(x).sum().backward()
    model.load_state_dict(model.state_dict())
    want = [(what, nn.Linear) for what, _ in calls]
    # outside autocast a hybridfp.Linear runs F.linear on the same Parameters: the same output
    y_before = model(x)
    calls.clear()
    del first, last  # the replaced modules go: the hooks must not need them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hfp.HighPrecisionWeightsWarning)
        model = convert(model)
    gc.collect()
    assert type(model[0]) is hfp.Linear and type(model[2]) is hfp.Linear
    model(x).sum().backward()
    model.load_state_dict(model.state_dict())
    assert [(what, nn.Linear if kind is hfp.Linear else kind) for what, kind in calls] == want
    assert all(kind is hfp.Linear for _, kind in calls), calls  # the hooks receive the new module
    calls.clear()
    assert torch.equal(model(x), y_before)  # the forward hook's doubling still applies
    for h in handles:  # the handles still remove them
        h.remove()
    calls.clear()
    model(x).sum().backward()
    model.load_state_dict(model.state_dict())
    assert calls == []


def test_hooks_on_a_converted_hf_model_still_run():
    model = build("llama")
    seen = []
    q = model.model.layers[0].self_attn.q_proj
    q.register_forward_hook(lambda module, args, out: seen.append(type(module)))
    quietly_converted(model)
    logits(model)
    assert seen == [hfp.Linear]


def _accelerate_like(lin: nn.Linear) -> nn.Linear:
    """What accelerate's ``add_hook_to_module`` leaves on a module."""
    lin._hf_hook = object()
    lin._old_forward = lin.forward
    lin.forward = lambda *args, **kwargs: lin._old_forward(*args, **kwargs)
    return lin


def _weight_norm(lin: nn.Linear) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.utils.weight_norm(lin)


def _buffer(lin: nn.Linear) -> nn.Linear:
    lin.register_buffer("mask", torch.ones(8, 8))
    return lin


def _legacy_backward_hook(lin: nn.Linear) -> nn.Linear:
    lin.register_backward_hook(lambda module, grad_in, grad_out: None)
    return lin


@pytest.mark.parametrize("convert", [hfp.convert, hfp.nn.convert], ids=["hybridfp.convert", "nn.convert"])
@pytest.mark.parametrize("spoil, match", [
    (_accelerate_like, "accelerate hook"),
    (_weight_norm, "weight_g"),
    (_buffer, "mask"),
    (_legacy_backward_hook, "register_full_backward_hook"),
])
def test_what_a_replacement_would_drop_is_refused(convert, spoil, match):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), spoil(nn.Linear(8, 8)))
    with pytest.raises(ValueError, match=rf"nn\.Linear 1 .*{match}"):
        convert(model)
    # nothing converted, not even the layer before
    assert not any(isinstance(m, hfp.nn.QuantizedModule) for m in model.modules())
    # left out by the filter, the rest converts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hfp.HighPrecisionWeightsWarning)
        convert(model, module_filter=lambda name, m: name != "1")
    assert type(model[0]) is hfp.Linear


# ------------------------------------------------------------------------------------ root Linear


@pytest.mark.parametrize("convert", [hfp.convert, hfp.nn.convert], ids=["hybridfp.convert", "nn.convert"])
def test_a_model_that_is_an_nn_linear_is_replaced(convert):
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    want = lin(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hfp.HighPrecisionWeightsWarning)
        new = convert(lin)
    assert type(new) is hfp.Linear and new.weight is lin.weight and new.bias is lin.bias
    assert torch.equal(new(x), want)  # F.linear outside autocast, the same Parameters
    with hfp.autocast(recipe=hfp.Float8CurrentScaling()):
        new(x)
    assert new._quantizers
    # refused by the filter: the same module back, left out on purpose
    with warnings.catch_warnings():
        warnings.simplefilter("error", hfp.HighPrecisionWeightsWarning)
        assert convert(lin, module_filter=lambda name, m: False) is lin


def test_an_unconverted_nn_linear_is_not_called_a_subclass():
    w, = hfp.unconverted_weights(nn.Linear(4, 4))
    assert "subclass" not in w.why and "nn.Linear" in w.why
