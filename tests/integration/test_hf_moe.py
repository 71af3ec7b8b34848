"""``hybridfp.convert`` on tiny random-init transformers models (no download): Llama (dense),
Qwen2-MoE, Qwen3-MoE, Mixtral and DeepSeek-V3. The routed experts (3-D ``gate_up_proj`` /
``down_proj`` Parameters) run through ``GroupedLinear``; outputs match the unconverted model
under the all-Identity recipe; training, ``generate()``, ``save_pretrained`` /
``from_pretrained`` and ``gradient_checkpointing_enable()`` work. Skipped without transformers."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hybridfp as hfp

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, TOKENS = 64, 32, (2, 16)
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
#: architecture -> (config class, model class, its MoE fields); top-k 3 of 4 experts where the
#: config allows it, so a token's three contributions are summed in an order that matters
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=3,
                       shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=3)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=3, n_group=1,
                         topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
}
MOE = [a for a in ARCHS if a != "llama"]


def identity_recipe() -> hfp.Recipe:
    return hfp.CustomRecipe(qfactory=lambda role: hfp.IdentityQuantizer())


RECIPES = {
    "fp8": hfp.Float8CurrentScaling,
    "mxfp8": hfp.MXFP8BlockScaling,
    "hybrid": lambda: hfp.CustomRecipe(qfactory=hfp.factories.mxfp8_fwd_nvfp4_bwd),
}


def build(arch: str, seed: int = 0, **overrides):
    config_cls, model_cls, moe = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **moe, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager")
    return model


def converted(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", hfp.HighPrecisionWeightsWarning)  # nothing left silently
        return hfp.convert(model)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(seed))


def expert_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]


def grouped_ran(model) -> bool:
    """Two GroupedLinear per experts module, each having run under a recipe (quantizers built)."""
    grouped = [m for m in model.modules() if isinstance(m, hfp.GroupedLinear)]
    return len(grouped) == len(expert_params(model)) > 0 and all(m._quantizers for m in grouped)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hfp.gemm.EmulatedGemmWarning)  # the CPU has no fast kernels
        yield


@pytest.mark.parametrize("arch", MOE)
def test_every_expert_parameter_runs_through_grouped_linear(arch):
    model = converted(build(arch))
    k = model.config.num_experts_per_tok
    total = sum(p.numel() for p in expert_params(model))
    assert total > 0
    seen, rows = {}, []

    def count(module, args):
        seen[id(module.weight)] = module.weight.numel()  # the experts' own Parameter, read by hybridfp
        rows.append(int(torch.as_tensor(args[1]).sum()))

    grouped = [m for m in model.modules() if isinstance(m, hfp.GroupedLinear)]
    assert grouped and all(m.weight is not None for m in grouped)
    handles = [m.register_forward_pre_hook(count) for m in grouped]
    with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
        loss = model(input_ids=batch(), labels=batch()).loss
    loss.backward()
    for h in handles:
        h.remove()
    assert set(seen) == {id(p) for p in expert_params(model)}
    assert sum(seen.values()) == total  # every expert parameter, in every MoE layer
    assert rows == [TOKENS[0] * TOKENS[1] * k] * len(grouped)  # every (token, slot) pair grouped
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in expert_params(model))
    # what stays in high precision is the routers and the output projection, on purpose
    left = hfp.unconverted_weights(model)
    assert left and all(w.deliberate for w in left)
    assert {w.name.rsplit(".", 1)[0].rsplit(".", 1)[-1] for w in left} == {"gate", "lm_head"}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_identity_logits_match_the_unconverted_model(arch):
    model = build(arch)
    ids = batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    params = [(n, p) for n, p in model.named_parameters()]
    keys = set(model.state_dict())
    converted(model)
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params]
    assert {k for k in model.state_dict() if not k.endswith("_extra_state")} == keys
    with torch.no_grad(), hfp.autocast(recipe=identity_recipe()):
        got = model(input_ids=ids).logits
    # Identity quantizes nothing; only the FP32 sums' order differs: hybridfp's GEMMs (the CPU
    # emulation, per expert) against torch's (MKL, F.linear / torch._grouped_mm). Two orders of
    # a K-term sum (K <= 64 here) differ by at most 2 γ(K-1) Σ|a b| ≈ 7.5e-6 relative to Σ|a b|;
    # through two layers (attention softmax, RMSNorm, residuals) and the output projection the
    # logits (|logit| < 0.5 for this init) moved by at most 6e-8 when measured (Mixtral; 0 for
    # the others on one CPU, over three seeds): 1e-5 is that per-GEMM bound, >100x what is seen.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got.abs().max() < 1
    assert arch == "llama" or grouped_ran(model)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_experts_bitwise_on_exact_sums(impl):
    """One Qwen3-MoE experts module against transformers' own forward: exact-sum values (small
    integers times powers of two, a ReLU between the GEMMs, power-of-two routing weights) make
    every sum exact, so the grouping, gating, weighting and combine are compared bitwise,
    forward and backward."""
    model = build("qwen3_moe", hidden_act="relu")
    model.config._experts_implementation = impl
    ref = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(1)

    def exact(*shape):
        return torch.randint(-2, 3, shape, generator=gen).float() / 4

    with torch.no_grad():
        for p in (ref.gate_up_proj, ref.down_proj):
            p.copy_(exact(*p.shape))
    mine = copy.deepcopy(ref)
    from hybridfp.integration.transformers_moe import experts_to_grouped
    experts_to_grouped(mine, "layers.0.mlp.experts")
    tokens = 24
    index = torch.stack([torch.randperm(4, generator=gen)[:3] for _ in range(tokens)])
    weights = torch.tensor([0.5, 0.25, 0.125]).expand(tokens, 3).contiguous()
    x = exact(tokens, HIDDEN)
    grad = exact(tokens, HIDDEN)
    outs = []
    for module, region in ((ref, None), (mine, identity_recipe())):
        xi = x.clone().requires_grad_()
        if region is None:
            y = module(xi, index, weights)
        else:
            with hfp.autocast(recipe=region):
                y = module(xi, index, weights)
        y.backward(grad)
        outs.append([y.detach(), xi.grad, module.gate_up_proj.grad, module.down_proj.grad])
    for want, got in zip(*outs):
        assert torch.equal(got, want)


#: every recipe on two MoE models, every architecture under some recipe (the test's time)
STEP_ARCHS = {"fp8": ("llama", "qwen3_moe", "deepseek_v3"), "mxfp8": ("qwen2_moe", "mixtral"),
              "hybrid": ("qwen3_moe", "mixtral")}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_one_optimizer_step(recipe):
    for arch in STEP_ARCHS[recipe]:
        model = converted(build(arch))
        before = [p.detach().clone() for p in expert_params(model)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with hfp.autocast(recipe=RECIPES[recipe]()):
            loss = model(input_ids=batch(), labels=batch()).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss) and (arch == "llama" or grouped_ran(model))
        assert all(not torch.equal(b, p) for b, p in zip(before, expert_params(model)))
        with torch.no_grad(), hfp.autocast(recipe=RECIPES[recipe]()):
            assert model(input_ids=batch(), labels=batch()).loss < loss  # the same batch again


def test_experts_get_their_own_roles():
    """A factory gives the experts NVFP4 and everything else FP8, by role."""
    asked = []

    def factory(role):
        asked.append(role)
        if role.module_type == "grouped_linear":
            return hfp.factories.nvfp4(role)
        return hfp.factories.current_scaling(role)

    model = converted(build("qwen3_moe"))
    with hfp.autocast(recipe=hfp.CustomRecipe(qfactory=factory)):
        model(input_ids=batch(), labels=batch()).loss.backward()
    names = {(r.module_type, r.name) for r in asked if r.tensor_type == "weight"}
    assert ("grouped_linear", "model.layers.1.mlp.experts.gate_up_proj") in names
    assert ("grouped_linear", "model.layers.1.mlp.experts.down_proj") in names
    assert ("linear", "model.layers.1.self_attn.q_proj") in names
    for m in model.modules():
        if isinstance(m, hfp.GroupedLinear):
            assert all(isinstance(q, hfp.NVFP4Quantizer) for q in m._quantizers["weight"])
        elif isinstance(m, hfp.Linear):
            assert all(isinstance(q, hfp.Float8CurrentScalingQuantizer) for q in m._quantizers["weight"])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate(arch):
    model = build(arch).eval()
    prompt = batch()[:, :4]
    want = model.generate(prompt, max_new_tokens=4, do_sample=False)
    converted(model)
    with torch.no_grad(), hfp.autocast(recipe=identity_recipe()):
        got = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)  # greedy: logits within 1e-5 (above) pick the same tokens
    assert arch == "llama" or grouped_ran(model)
    with torch.no_grad(), hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
        assert model.generate(prompt, max_new_tokens=4, do_sample=False).shape == (2, 8)


def test_save_pretrained_from_pretrained_is_bitwise(tmp_path):
    model = converted(build("qwen3_moe"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hfp.autocast(recipe=hfp.Float8CurrentScaling()):
        model(input_ids=batch(), labels=batch()).loss.backward()
    opt.step()
    model.save_pretrained(tmp_path / "hf")
    loaded = converted(type(model).from_pretrained(tmp_path / "hf", attn_implementation="eager"))
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    got = {k: v for k, v in loaded.state_dict().items() if not k.endswith("_extra_state")}
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    outs = []
    for m in (model, loaded):
        with torch.no_grad(), hfp.autocast(recipe=hfp.Float8CurrentScaling()):
            outs.append(m(input_ids=batch(1)).logits)
    assert torch.equal(outs[0], outs[1])  # the same weights, the same arithmetic
    # hybridfp's own safetensors file: the same tensors again
    hfp.save_safetensors(model, tmp_path / "model.safetensors")
    again = converted(build("qwen3_moe", seed=1))
    hfp.load_safetensors(again, tmp_path / "model.safetensors")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in want.items())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gradient_checkpointing_is_bitwise(arch):
    grads = []
    for checkpointing in (False, True):
        model = converted(build(arch))
        model.train()
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the name is deprecated in some versions
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
            loss = model(input_ids=batch(), labels=batch()).loss
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
        assert grouped_ran(model)
    assert all(g is not None for g in grads[1][1:])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
