"""``hybridfp.convert`` is never silent: weights a matmul still reads outside hybridfp are
listed in one ``HighPrecisionWeightsWarning`` (or refused with ``strict=True``); ``module_filter``
picks what converts (``recipe_filter`` its former name); the output projection and embeddings
stay in high precision unless asked. Plain PyTorch models, and tiny transformers models where
transformers is installed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import hybridfp as hfp


class _MyLinear(nn.Linear):
    """A subclass convert does not replace."""


class _TransposedExperts(nn.Module):
    """Fused experts stored [E, in, out] (gpt-oss's layout): recognised, not converted."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.is_transposed = 2, True
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 16))
        self.down_proj = nn.Parameter(torch.zeros(2, 8, 8))
        self.act_fn = nn.SiLU()


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.custom = _MyLinear(8, 8)
        self.conv = nn.Conv1d(8, 8, 1)
        self.experts = _TransposedExperts()
        self.lm_head = nn.Linear(8, 16, bias=False)


def _record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, hfp.HighPrecisionWeightsWarning)]


def test_one_warning_lists_every_weight_left_outside():
    model, caught = _record(lambda: hfp.convert(_Toy()))
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "custom.weight [8, 8]" in text and "exact nn.Linear" in text
    assert "conv.weight [8, 8, 1]" in text and "Conv1d" in text
    assert "experts.gate_up_proj [2, 8, 16]" in text and "transposed" in text
    assert "experts.down_proj [2, 8, 8]" in text
    # converted, deliberate (lm_head) and lookups / norms are not in it
    for name in ("fc.weight", "lm_head", "embed", "norm"):
        assert name not in text
    assert type(model.fc) is hfp.Linear and type(model.lm_head) is nn.Linear
    deliberate = [w for w in hfp.unconverted_weights(model) if w.deliberate]
    assert [w.name for w in deliberate] == ["lm_head.weight"] and "lm_head=True" in deliberate[0].why


def test_strict_raises_and_names_the_weights():
    with pytest.raises(ValueError, match=r"(?s)custom\.weight.*conv\.weight.*experts\.gate_up_proj.*strict"):
        hfp.convert(_Toy(), strict=True)


def test_module_filter_and_lm_head():
    def keep(name, m):
        return name not in ("custom", "conv", "experts")
    # only nn.Linear layers and experts modules can be left out on purpose: a subclass and a
    # convolution are still reported, the filtered nn.Linear is not
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    _, caught = _record(lambda: hfp.convert(model, module_filter=lambda name, m: name != "1"))
    assert not caught and type(model[1]) is nn.Linear
    assert [(w.name, w.deliberate, w.why) for w in hfp.unconverted_weights(
        model, lambda name, m: name != "1")] == [("1.weight", True, "left out by module_filter")]
    # recipe_filter: the same argument under its former name; both at once is refused
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    _, caught = _record(lambda: hfp.convert(model, recipe_filter=lambda name, m: name != "1"))
    assert not caught and type(model[0]) is hfp.Linear and type(model[1]) is nn.Linear
    with pytest.raises(TypeError, match="module_filter only"):
        hfp.convert(model, module_filter=keep, recipe_filter=keep)
    with pytest.raises(TypeError, match="module_filter only"):
        hfp.nn.convert(model, module_filter=keep, recipe_filter=keep)
    with pytest.raises(TypeError, match="module_filter must be a callable"):
        hfp.convert(model, module_filter="fc")
    # lm_head=True converts the output projection, the same Parameter
    toy = _Toy()
    w = toy.lm_head.weight
    _record(lambda: hfp.convert(toy, lm_head=True))
    assert type(toy.lm_head) is hfp.Linear and toy.lm_head.weight is w
    # the building block converts every nn.Linear, the output projection too, and says nothing
    toy = _Toy()
    _, caught = _record(lambda: hfp.nn.convert(toy))
    assert not caught and type(toy.lm_head) is hfp.Linear


def test_experts_to_grouped_refuses_what_it_cannot_convert():
    from hybridfp.integration.transformers_moe import experts_to_grouped, fused_experts_layout
    assert fused_experts_layout(nn.Linear(4, 4)) == (None, "")
    with pytest.raises(ValueError, match="transposed"):
        experts_to_grouped(_TransposedExperts(), "experts")
    m = nn.Module()
    m.gate_up_proj = nn.Parameter(torch.zeros(2, 16, 8))
    m.down_proj = nn.Parameter(torch.zeros(2, 8, 8))
    m.act_fn = nn.SiLU()
    m.config = type("Config", (), {"_experts_implementation": "sonicmoe"})()
    with pytest.raises(ValueError, match="'sonicmoe'.*'eager' or 'grouped_mm'"):
        experts_to_grouped(m, "layers.0.experts")
    m.config._experts_implementation = "eager"
    experts_to_grouped(m, "layers.0.experts")
    args = (torch.randn(3, 8), torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.rand(3, 2))
    clone = copy.deepcopy(m)  # the copy reads its own Parameters
    assert clone.hybridfp_up.weight is clone.gate_up_proj and torch.equal(clone(*args), m(*args))
    # what the forward cannot follow, changed after the conversion, is refused by name
    m.config._experts_implementation = "sonicmoe"
    with pytest.raises(ValueError, match="experts layers.0.experts: .*'sonicmoe'"):
        m(*args)
    m.config._experts_implementation, m._is_expert_parallel = "eager", True
    with pytest.raises(NotImplementedError, match="layers.0.experts.*expert parallelism"):
        m(*args)


def _hf():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_hf_lm_head_stays_high_precision_by_default(tied):
    transformers = _hf()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM._from_config(config)
    _, caught = _record(lambda: hfp.convert(model))
    assert not caught
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.up_proj) is hfp.Linear
    model = transformers.LlamaForCausalLM._from_config(config)
    hfp.convert(model, lm_head=True)
    assert type(model.lm_head) is hfp.Linear
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert hfp.unconverted_weights(model) == []


def test_hf_save_pretrained_of_a_converted_dense_model(tmp_path):
    """transformers' save_pretrained writes tensors only: the quantizer state stays out, and the
    checkpoint loads into an unconverted model with the same keys."""
    transformers = _hf()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = hfp.convert(transformers.LlamaForCausalLM._from_config(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hfp.gemm.EmulatedGemmWarning)
        with hfp.autocast(recipe=hfp.DelayedScaling(amax_history_len=4)):
            model(input_ids=torch.randint(0, 64, (2, 8)))
    model.save_pretrained(tmp_path)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert plain.state_dict().keys() == want.keys()
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in want.items())


class _ExpertMLP(nn.Module):
    """One expert of the older ModuleList layout (transformers 4.x Mixtral: w1 gate, w3 up, w2 down)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _SharedExperts(nn.Module):
    """Shared experts every token runs (Inkling's layout): 3-D gate / up / down Parameters and
    an act_fn like routed experts, but called forward(hidden_states, gammas)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(2, 16, 8) * 0.1)
        self.up_proj = nn.Parameter(torch.randn(2, 16, 8) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(2, 8, 16) * 0.1)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, gammas):
        h = hidden_states.expand(2, -1, -1)
        a = self.act_fn(torch.bmm(h, self.gate_proj.transpose(1, 2))) * torch.bmm(h, self.up_proj.transpose(1, 2))
        return (torch.bmm(a * gammas.t().unsqueeze(-1), self.down_proj.transpose(1, 2))).sum(0)


class _Routed(nn.Module):
    """Routed experts with a separate 3-D gate_proj beside up_proj: converting up_proj / down_proj
    alone would drop the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Parameter(torch.zeros(2, 16, 8)), nn.Parameter(torch.zeros(2, 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(2, 8, 16))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def test_shared_experts_stay_unconverted_and_are_listed():
    from hybridfp.integration.transformers_moe import fused_experts_layout
    block = nn.Module()
    block.shared_experts = _SharedExperts()
    x, gammas = torch.randn(5, 8), torch.rand(5, 2)
    want = block.shared_experts(x, gammas)
    _, caught = _record(lambda: hfp.convert(block))
    assert "hybridfp_up" not in block.shared_experts._modules
    assert torch.equal(block.shared_experts(x, gammas), want)  # still runs, as it did
    text = str(caught[0].message)
    for name, shape in (("gate_proj", [2, 16, 8]), ("up_proj", [2, 16, 8]), ("down_proj", [2, 8, 16])):
        assert f"shared_experts.{name} {shape}: 3-D experts weights hybridfp does not convert: " \
               "_SharedExperts.forward(hidden_states, gammas) is not the routed experts' " \
               "forward(hidden_states, top_k_index, top_k_weights)" in text
    layout, why = fused_experts_layout(_Routed())
    assert layout is None and "['gate_proj']" in why and "would not read" in why
    with pytest.raises(ValueError, match="shared_experts.down_proj"):
        hfp.convert(block, strict=True)


def test_module_filter_leaves_out_experts_convert_would_not_take():
    """A module_filter refusing shared experts or transposed experts leaves their 3-D weights out
    on purpose, as strict's advice says: no warning, no error; what the filter does not reach
    (a convolution) is still refused."""
    block = nn.Module()
    block.shared_experts, block.experts = _SharedExperts(), _TransposedExperts()

    def keep(name, m):
        return name not in ("shared_experts", "experts")
    _, caught = _record(lambda: hfp.convert(block, module_filter=keep, strict=True))
    assert not caught and "hybridfp_up" not in block.shared_experts._modules
    weights = hfp.unconverted_weights(block, keep)
    assert [w.name for w in weights] == ["shared_experts.gate_proj", "shared_experts.up_proj",
                                         "shared_experts.down_proj", "experts.gate_up_proj", "experts.down_proj"]
    assert all(w.deliberate and w.why == "left out by module_filter" for w in weights)
    # a filter that lets them through: listed, not deliberate, and strict refuses them
    assert not any(w.deliberate for w in hfp.unconverted_weights(block, lambda name, m: True))
    block.conv = nn.Conv1d(8, 8, 1)
    with pytest.raises(ValueError, match=r"(?s)conv\.weight.*leave nn\.Linear layers and experts modules out "
                                         r"with module_filter") as raised:
        hfp.convert(block, module_filter=keep, strict=True)
    assert "shared_experts" not in str(raised.value) and "experts.gate_up_proj" not in str(raised.value)


class _TransposedCalledOtherwise(nn.Module):
    """Routed experts stored [E, in, out] and called forward(hidden_states) (Llama4's layout):
    the layout keeps them out, and the reason says so."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 64))
        self.down_proj = nn.Parameter(torch.zeros(4, 32, 16))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        return hidden_states


def test_transposed_experts_called_otherwise_are_reported_by_their_layout():
    from hybridfp.integration.transformers_moe import fused_experts_layout
    layout, why = fused_experts_layout(_TransposedCalledOtherwise())
    assert layout is None and "transposed" in why and "(4, 16, 64) / (4, 32, 16)" in why
    assert "shared experts" not in why and "forward" not in why
    block = nn.Module()
    block.experts = _TransposedCalledOtherwise()
    _, caught = _record(lambda: hfp.convert(block))
    text = str(caught[0].message)
    assert "experts.gate_up_proj [4, 16, 64]: MoE experts in a layout hybridfp does not convert: " \
           "experts weights (4, 16, 64) / (4, 32, 16) are not [E, out, in]" in text
    # shared experts, [E, out, in] but called otherwise: their call is the reason, which does
    # not say what the module is
    _, why = fused_experts_layout(_SharedExperts())
    assert "is not the routed experts' forward" in why and "hybridfp converts only modules called that way" in why


def test_hf_llama4_experts_are_reported_as_transposed():
    transformers = _hf()
    llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
    from hybridfp.integration.transformers_moe import fused_experts_layout
    config = transformers.Llama4TextConfig(hidden_size=16, intermediate_size=32, num_local_experts=4)
    layout, why = fused_experts_layout(llama4.Llama4TextExperts(config))
    assert layout is None and "transposed" in why and "shared experts" not in why


def test_hf_inkling_converts_routed_experts_only():
    """Inkling holds routed experts (converted) and shared experts with 3-D up_proj / down_proj
    (left in high precision, listed): the converted model runs."""
    transformers = _hf()
    if "inkling_text" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no Inkling")
    config = transformers.AutoConfig.for_model(
        "inkling_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=2,
        swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, rel_extent=16,
        max_position_embeddings=32, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _, caught = _record(lambda: hfp.convert(model))
    mlp = model.model.layers[0].mlp
    assert "hybridfp_up" in mlp.experts._modules and "hybridfp_up" not in mlp.shared_experts._modules
    text = str(caught[0].message)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.shared_experts.{name} [2, 32, 32]: 3-D experts weights" in text
    with torch.no_grad():
        assert model(torch.randint(0, 64, (1, 8))).logits.shape == (1, 8, 64)


def test_module_list_experts_run_one_linear_per_expert():
    block = nn.Module()
    block.gate = nn.Linear(8, 4, bias=False)
    block.experts = nn.ModuleList([_ExpertMLP() for _ in range(4)])
    params = list(block.parameters())
    _, caught = _record(lambda: hfp.convert(block))
    assert not caught and [id(p) for p in block.parameters()] == [id(p) for p in params]
    assert all(type(getattr(e, n)) is hfp.Linear for e in block.experts for n in ("w1", "w2", "w3"))
    assert hfp.unconverted_weights(block) == []


def test_hf_gpt_oss_transposed_experts_are_reported():
    """gpt-oss holds its experts transposed ([E, in, out], interleaved gate / up, biases): not
    converted, and the one warning says so for each layer; strict refuses the model."""
    transformers = _hf()
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                                       layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM._from_config(config)
    _, caught = _record(lambda: hfp.convert(model))
    assert len(caught) == 1
    text = str(caught[0].message)
    for layer in range(2):
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj [4, 32, 64]: MoE experts in a layout" in text
        assert f"model.layers.{layer}.mlp.experts.down_proj [4, 32, 32]" in text
    assert "router" not in text and "lm_head" not in text and "4 weight(s)" in text
    with pytest.raises(ValueError, match="transposed"):
        hfp.convert(transformers.GptOssForCausalLM._from_config(config), strict=True)
