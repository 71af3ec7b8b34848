"""hybridfp as a torchtitan model converter, on torchtitan's own debug models (CPU).

The converter is applied the way a torchtitan job config applies its float8 / MX converters:
``model_registry(flavor, converters=[HybridFPConverter.Config(...)])``. The models are the
``debugmodel`` flavors of llama3 (dense) and qwen3 (``debugmodel_moe``: GroupedExperts with 3-D
``w1_EFD`` / ``w2_EDF`` / ``w3_EFD``), cut to CPU size after the registry built them: fewer
layers, 8 narrow experts (top 2), and SDPA instead of FlexAttention (which has no CPU backward).

Bounds against the unconverted model under the all-Identity recipe (``bf16``):
- dense: the same FP32 values reach a GEMM on both sides, but through different code (hybridfp's
  Identity GEMM vs ``F.linear``), so no bitwise claim: 1e-5 of the logits' scale (FP32 sums of
  256-768 terms reordered differ by a few ulps);
- MoE: torchtitan's own experts cast activations and weights to BF16 before ``torch._grouped_mm``
  (relative error 2^-8 per operand), hybridfp's Identity experts keep FP32; the routed output
  is a small part of the logits, whose scale bounds the difference at 2^-7 of it.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.linear import Linear as TTLinear  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, MoE  # noqa: E402
from torchtitan.models.llama3 import model_registry as llama3_registry  # noqa: E402
from torchtitan.models.qwen3 import model_registry as qwen3_registry  # noqa: E402

import hybridfp as hf  # noqa: E402
from hybridfp.integration.torchtitan import fqn_matches  # noqa: E402
from hybridfp.torchtitan import HybridFPConverter, hybridfp_weights  # noqa: E402

from spawn_ranks import as_ranks_run, run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

MODELS = {"llama3": (llama3_registry, "debugmodel", 2), "qwen3_moe": (qwen3_registry, "debugmodel_moe", 1)}
BATCH, SEQ = 1, 8
EXPERTS, TOP_K = 8, 2


def _cpu_size(cfg, layers: int):
    """The registry's config cut to CPU size (in place; works on a converted config too)."""
    cfg.layers = cfg.layers[:layers]
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        new = ScaledDotProductAttention.Config()
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    for _, moe, _, _ in cfg.traverse(MoE.Config):  # 8 experts of width 32, top 2
        moe.num_experts = moe.router.num_experts = moe.router.gate.out_features = EXPERTS
        moe.router.top_k = TOP_K
        experts, dispatcher = moe.routed_experts.inner_experts, moe.routed_experts.token_dispatcher
        experts.num_experts, experts.hidden_dim = EXPERTS, 32
        dispatcher.num_experts, dispatcher.top_k = EXPERTS, TOP_K
    return cfg


def _config(name: str, converters=None):
    registry, flavor, layers = MODELS[name]
    return _cpu_size(registry(flavor, converters=converters).model, layers)


def _build(cfg, like=None):
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    if like is not None:  # the same weights as the reference, loaded by their torchtitan names
        res = model.load_state_dict(like.state_dict(), strict=False)
        assert not res.unexpected_keys and all(k.endswith("_extra_state") for k in res.missing_keys)
    return model


def _tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _converted(name: str, recipe: str, **options):
    cfg = _config(name, [HybridFPConverter.Config(recipe=recipe, **options)])
    return cfg, _build(cfg, like=_build(_config(name)))


def test_readme_job_config_builds():
    """README's torchtitan snippet, run as printed: the job config's model is converted."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## torchtitan\n", 1)[1].split("\n## ", 1)[0]
    ns: dict = {}
    exec(compile(re.findall(r"```\n(.*?)```", section, flags=re.S)[0], "README torchtitan", "exec"), ns)
    job = ns["llama3_debugmodel_hybridfp"]()
    model_config = job.model_spec.model
    assert type(model_config).__qualname__ == "HybridFPLlama3Model.Config"
    assert type(model_config.hybridfp_recipe).__name__ == "CustomRecipe"
    assert isinstance(model_config.lm_head, TTLinear.Config) and type(model_config.lm_head) is TTLinear.Config


def test_fqn_matches_whole_names():
    assert fqn_matches("layers.0.moe.router.gate", "router")
    assert fqn_matches("lm_head", "lm_head") and fqn_matches("layers.0.attention.wo", "layers.0")
    assert not fqn_matches("layers.10.attention.wo", "layers.1")
    assert not fqn_matches("layers.0.attention.output_proj", "output")


@pytest.mark.parametrize("name", list(MODELS))
def test_identity_recipe_matches_unconverted_model(name):
    """Through torchtitan's registry: every Linear but lm_head / the router gate and every
    expert weight runs through hybridfp; logits and gradients match the unconverted model."""
    ref = _build(_config(name))
    cfg = _config(name, [HybridFPConverter.Config(recipe="high-precision")])
    model = _build(cfg, like=ref)
    # what runs through hybridfp: all weights of >= 2 dims but the embedding, lm_head, routers
    read = hybridfp_weights(model)
    kept = {n for n, r in read.items() if not r}
    assert kept == {"tok_embeddings.weight", "lm_head.weight"} | {
        n for n in read if fqn_matches(n, "router")}
    linears = [m for n, m in model.named_modules() if isinstance(m, TTLinear)]
    assert {type(m).__name__ for m in linears} == {"Linear"} and len(linears) == 1 + (name == "qwen3_moe")
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == (1 if name == "qwen3_moe" else 0)
    expert_params = {n: p for n, p in model.named_parameters() if n.endswith("_EFD") or n.endswith("_EDF")}
    assert all(read[n] for n in expert_params)
    assert sum(p.numel() for p in expert_params.values()) == sum(
        3 * c.num_experts * c.hidden_dim * c.dim for _, c, _, _ in cfg.traverse(GroupedExperts.Config))

    x = _tokens(cfg.vocab_size)
    y_ref, y = ref(x), model(x)
    y_ref.float().pow(2).mean().backward()
    y.float().pow(2).mean().backward()
    tol = 1e-5 if name == "llama3" else 2.0 ** -7
    assert (y - y_ref).abs().max() <= tol * y_ref.abs().max()
    ref_grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        g, g_ref = p.grad, ref_grads[n].grad
        assert (g - g_ref).abs().max() <= 8 * tol * g_ref.abs().max() + 1e-12, n
    for m in experts:  # the GroupedLinear read torchtitan's own Parameters, and only those
        gls = m.hybridfp_grouped_linears()
        assert [gl.weight for gl in gls] == [m.w1_EFD, m.w3_EFD, m.w2_EDF]
        assert all(gl.weight is w for gl, w in zip(gls, (m.w1_EFD, m.w3_EFD, m.w2_EDF)))
        assert [n for n, _ in m.named_parameters()] == ["w1_EFD", "w2_EDF", "w3_EFD"]


@pytest.mark.parametrize("name,recipe", [("llama3", "fp8"), ("qwen3_moe", "fp8"),
                                         ("qwen3_moe", "nvfp4-fwd-mxfp8-bwd")])
def test_quantized_recipe_trains_a_step(name, recipe):
    """FP8 and a hybrid: quantization is active (the logits differ from the unconverted
    model's), an optimizer step runs and changes every converted weight, the loss is finite."""
    cfg, model = _converted(name, recipe)
    ref = _build(_config(name))
    x = _tokens(cfg.vocab_size)
    with torch.no_grad():
        y_ref = ref(x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = model(x)
    assert not torch.equal(y, y_ref)
    loss = torch.nn.functional.cross_entropy(y.flatten(0, 1), _tokens(cfg.vocab_size, 2).flatten())
    assert math.isfinite(loss.item())
    loss.backward()
    opt.step()
    read = hybridfp_weights(model)
    for n, p in model.named_parameters():
        if read.get(n):
            assert torch.isfinite(p.grad).all() and not torch.equal(p.detach(), before[n]), n


def test_options_filter_and_recipe_path():
    """fqns / filter_fqns pick the modules; a ``module:factory`` recipe path is accepted; the
    output projection can be asked for."""
    conv = HybridFPConverter.Config(recipe="hybridfp.factories:mxfp8_fwd_nvfp4_bwd",
                                    fqns=["layers.1"], filter_fqns=["wo"]).build()
    assert isinstance(conv.recipe, hf.CustomRecipe)
    cfg = conv.convert(_config("llama3"))
    done = conv.last_conversion
    assert done.linears == ("layers.1.attention.qkv_linear.wqkv", "layers.1.feed_forward.w1",
                            "layers.1.feed_forward.w2", "layers.1.feed_forward.w3")
    assert done.skipped["layers.1.attention.wo"] == "filter_fqns 'wo'"
    assert done.skipped["layers.0.feed_forward.w1"] == "not matched by fqns"
    model = _build(cfg)
    assert sum(hybridfp_weights(model).values()) == 4
    with_head = HybridFPConverter.Config(recipe="fp8", filter_fqns=[]).build()
    with_head.convert(_config("qwen3_moe"))
    assert "lm_head" in with_head.last_conversion.linears
    assert any(fqn_matches(f, "router") for f in with_head.last_conversion.linears)
    no_experts = HybridFPConverter.Config(recipe="fp8", experts=False).build()
    no_experts.convert(_config("qwen3_moe"))
    assert no_experts.last_conversion.experts == ()


def experts_mxfp8_rest_fp8(role: Optional[hf.QuantizerRole]) -> hf.Quantizer:
    """A per-role factory named by path in the converter's options: the experts (their own
    ``grouped_linear`` roles) MXFP8, the other GEMMs FP8 current scaling."""
    from hybridfp.recipes import factories
    experts = role is not None and role.module_type == "grouped_linear"
    return (factories.mxfp8 if experts else factories.current_scaling)(role)


def test_expert_roles_take_their_own_format():
    cfg, model = _converted("qwen3_moe", "test_torchtitan:experts_mxfp8_rest_fp8")
    model(_tokens(cfg.vocab_size))
    experts = model.layers["0"].moe.routed_experts.inner_experts
    gl = experts.hybridfp_grouped_linears()[0]
    role = gl.quantizer_roles()["weight"][0]
    assert (role.module_type, role.name) == ("grouped_linear", "layers.0.moe.routed_experts.inner_experts.w1_EFD")
    wo = model.layers["0"].attention.wo
    assert str(wo.quantizer_roles()["input"][0]) == "layers.0.attention.wo.input"
    assert type(gl._quantizers["weight"][0]).__name__ == "MXFP8Quantizer"
    assert type(wo._quantizers["weight"][0]).__name__ == "Float8CurrentScalingQuantizer"


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="no-such-recipe"):
        HybridFPConverter.Config(recipe="no-such-recipe").build()
    with pytest.raises(ValueError, match="os"):
        HybridFPConverter.Config(recipe="os:system").build()


def test_unknown_linear_subclass_is_never_silent():
    """A Linear subclass the converter does not know stays in high precision with a warning
    naming it, or raises under strict=True."""
    from torchtitan.models.common.linear import ScaledBiasRowwiseLinear
    cfg = _config("llama3")
    w2 = cfg.layers[0].feed_forward.w2
    cfg.layers[0].feed_forward.w2 = ScaledBiasRowwiseLinear.Config(
        in_features=w2.in_features, out_features=w2.out_features, param_init=w2.param_init)
    with pytest.warns(UserWarning, match=r"layers\.0\.feed_forward\.w2 \(ScaledBiasRowwiseLinear"):
        HybridFPConverter.Config(recipe="fp8").build().convert(cfg)
    cfg.layers[0].feed_forward.w2 = ScaledBiasRowwiseLinear.Config(
        in_features=w2.in_features, out_features=w2.out_features, param_init=w2.param_init)
    with pytest.raises(ValueError, match="filter_fqns"):
        HybridFPConverter.Config(recipe="fp8", strict=True).build().convert(cfg)


def test_state_dict_names_unchanged_and_round_trip(tmp_path):
    """Checkpoints keep torchtitan's parameter names (its state-dict adapters see the same
    keys) plus the quantizers' ``_extra_state``; under delayed scaling a save / load
    (weights_only) carries the amax histories: the next forward of the reloaded model equals
    the original's, bitwise."""
    cfg, model = _converted("qwen3_moe", "fp8-delayed")
    ref_keys = set(_build(_config("qwen3_moe")).state_dict())
    x = _tokens(cfg.vocab_size)
    with torch.no_grad():
        model(x)  # the amax histories now hold this step
    sd = model.state_dict()
    assert {k for k in sd if not k.endswith("_extra_state")} == ref_keys
    experts_state = sd["layers.0.moe.routed_experts.inner_experts._extra_state"]
    assert sorted(experts_state) == ["w1_EFD", "w2_EDF", "w3_EFD"] and experts_state["w1_EFD"]["built"]
    torch.save(sd, tmp_path / "m.pt")
    other = _build(cfg)
    other.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    with torch.no_grad():
        y = model(x)
        assert torch.equal(other(x), y)
        fresh = _build(cfg)  # the same weights without the histories: another result
        fresh.load_state_dict({k: v for k, v in sd.items() if not k.endswith("_extra_state")}, strict=False)
        assert not torch.equal(fresh(x), y)


def test_expert_parallel_state_with_histories_is_refused_at_save():
    """Under EP each rank holds its own experts' amax histories under one state-dict key; a
    checkpoint would keep one rank's, so saving them is refused rather than resumed wrongly
    (the module is marked expert-parallel directly: the 2-rank EP run is tested above)."""
    cfg, model = _converted("qwen3_moe", "fp8-delayed")
    with torch.no_grad():
        model(_tokens(cfg.vocab_size))
    experts = model.get_submodule("layers.0.moe.routed_experts.inner_experts")
    experts._hybridfp_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism is not supported"):
        model.state_dict()


@pytest.mark.parametrize("policy", ["FullAC", "SelectiveAC"])
def test_torchtitan_activation_checkpointing_replays_bitwise(policy):
    """torchtitan's activation checkpointing (its own wrappers) on the converted MoE model: the
    recomputation replays the same GEMMs on the same operands, so outputs and gradients equal
    the run without it, bitwise."""
    from torchtitan.distributed import activation_checkpoint as ac
    cfg, model = _converted("qwen3_moe", "fp8")
    x = _tokens(cfg.vocab_size)
    y = model(x)
    y.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    getattr(ac, policy).Config().build().apply(model)
    y_ac = model(x)
    y_ac.float().pow(2).mean().backward()
    assert torch.equal(y_ac, y)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n.replace("._checkpoint_wrapped_module", "")]), n


def test_unsupported_parallelisms_are_refused():
    """What hybridfp cannot run on torchtitan's shards is refused, naming the module, the
    option and what to do, before any forward: TP / EP under torchtitan's ``spmd_types`` backend
    (its default: plain tensors typed per mesh axis, no DTensor shards), a Linear whose
    sharding config replicates the weight on the tp axis, sequence parallelism, and TP of the
    experts (each expert's GEMMs split over ranks)."""
    from types import SimpleNamespace
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import colwise_config, dense_param_placement, rowwise_config
    from torchtitan.protocols.sharding import ShardingConfig
    _, model = _converted("qwen3_moe", "fp8")
    linear = model.layers["0"].attention.wo
    experts = model.layers["0"].moe.routed_experts.inner_experts
    linear._sharding_config = colwise_config()
    with pytest.raises(NotImplementedError,
                       match=r"'layers\.0\.attention\.wo'.*TP.*spmd_backend='spmd_types'.*partial_dtensor"):
        linear.parallelize(SimpleNamespace(tp_enabled=True, spmd_backend="spmd_types"))
    linear._parallelized = False
    linear._sharding_config = ShardingConfig(state_shardings={"weight": dense_param_placement(tp=spmd.R)})
    with pytest.raises(NotImplementedError, match=r"'layers\.0\.attention\.wo'.*tp axis.*filter_fqns"):
        linear.parallelize(SimpleNamespace(tp_enabled=True, spmd_backend="partial_dtensor"))
    linear._parallelized = False
    linear._sharding_config = rowwise_config(output_sp=True)
    with pytest.raises(NotImplementedError, match=r"'layers\.0\.attention\.wo'.*enable_sequence_parallel=False"):
        linear.parallelize(SimpleNamespace(tp_enabled=True, spmd_backend="partial_dtensor"))
    with pytest.raises(NotImplementedError, match=r"inner_experts\.w1_EFD'.*TP"):
        experts.parallelize(SimpleNamespace(tp_enabled=True, ep_enabled=False))
    with pytest.raises(NotImplementedError, match=r"inner_experts\.w1_EFD'.*EP.*spmd_backend='spmd_types'"):
        experts.parallelize(SimpleNamespace(tp_enabled=False, ep_enabled=True, spmd_backend="spmd_types"))


def _fsdp_rank(rank: int, world: int, names: list, recipe: str) -> dict:
    """torchtitan's own FSDP2 application (apply_fsdp_to_decoder) on the converted models."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import fsdp
    # torchtitan sums gradients unscaled (divide factor 1: a PREMUL_SUM reduce-scatter), which
    # gloo lacks; FSDP2's default average of the ranks' identical gradients is the same value.
    fsdp.disable_fsdp_gradient_division = lambda model: None
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in names:
        cfg, model = _converted(name, recipe)
        fsdp.apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
        y = model(_tokens(cfg.vocab_size))
        y.float().pow(2).mean().backward()
        read = hybridfp_weights(model)
        out[name] = {"out": y.detach().flatten().tolist(),
                     "grads": {n: p.grad.full_tensor().flatten().tolist()
                               for n, p in model.named_parameters() if read.get(n)}}
    return out


def test_fsdp2_matches_one_process(tmp_path):
    """torchtitan's FSDP2 (apply_fsdp_to_decoder) on 2 gloo ranks, every rank given the same batch: outputs and the
    hybridfp-read weights' gradients equal the one-process converted model's (the all-gather
    is exact, so the same GEMMs run on the same operands; the reduce-scatter averages two
    identical gradients: exact)."""
    ranks = run_ranks(_fsdp_rank, 2, (["qwen3_moe"], "fp8"), tmp_path)  # Linear and experts
    for name in ["qwen3_moe"]:
        with as_ranks_run():  # bitwise claims: the reference sums as the ranks' GEMMs do
            cfg, model = _converted(name, "fp8")
            y = model(_tokens(cfg.vocab_size))
            y.float().pow(2).mean().backward()
        params = dict(model.named_parameters())
        for r in ranks:
            assert torch.equal(torch.tensor(r[name]["out"]), y.detach().flatten()), name
            assert len(r[name]["grads"]) == sum(hybridfp_weights(model).values()), name
            for n, g in r[name]["grads"].items():
                assert torch.equal(torch.tensor(g), params[n].grad.flatten()), (name, n)


def test_meta_device_build_as_torchtitan_trainer_does():
    """torchtitan's trainer builds on the meta device, then ``to_empty`` and ``init_states``:
    the converted model built so (its experts' GroupedLinear made on meta, bound to the real
    Parameters at forward) computes what the directly built one does, bitwise."""
    cfg, direct = _converted("qwen3_moe", "fp8")
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    model.load_state_dict(direct.state_dict())
    x = _tokens(cfg.vocab_size)
    y, y_direct = model(x), direct(x)
    assert torch.equal(y, y_direct)
    y.float().pow(2).mean().backward()
    y_direct.float().pow(2).mean().backward()
    for (n, p), q in zip(model.named_parameters(), direct.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_converting_twice_is_refused():
    cfg = _config("llama3", [HybridFPConverter.Config(recipe="fp8")])
    with pytest.raises(ValueError, match="converted to hybridfp already"):
        HybridFPConverter.Config(recipe="fp8").build().convert(cfg)


def test_import_hybridfp_does_not_import_torchtitan():
    """Only hybridfp/torchtitan.py imports torchtitan (or a module named torchtitan) at module
    level; the integration module imports torchtitan inside its functions."""
    import ast
    from pathlib import Path
    package = Path(hf.__file__).parent
    bad = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "torchtitan.py":
            continue
        tree = ast.parse(path.read_text())
        top = [n for node in tree.body for n in ([node] + (node.body if isinstance(node, ast.Try) else []))]
        for node in top:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any("torchtitan" in n.split(".") for n in names):
                bad.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not bad, f"module-level imports of torchtitan: {bad}"


def _tp_rank(rank: int, world: int, recipes: list) -> dict:
    """torchtitan's own tensor parallelism (llama3's sharding config, ``Model.parallelize``)
    on the converted llama3: each rank runs the batch; outputs and the weights' whole gradients."""
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.distributed import utils as dist_utils
    parallel_dims.device_type = "cpu"  # torchtitan falls back to "cuda" when no GPU is found
    dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's trainer does from its config
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    out = {}
    for recipe in recipes:
        cfg = _config("llama3", [HybridFPConverter.Config(recipe=recipe)])
        set_llama3_sharding_config(cfg, enable_sp=False)
        model = _build(cfg, like=_build(_config("llama3")))
        model.parallelize(dims)
        wo, w1 = model.layers["0"].attention.wo, model.layers["0"].feed_forward.w1
        y = model(_tokens(cfg.vocab_size))
        y = y.full_tensor() if isinstance(y, DTensor) else y
        y.float().pow(2).mean().backward()
        out[recipe] = {
            "placements": [str(wo.weight.placements), str(w1.weight.placements),
                           type(wo._tensor_parallel).__name__],
            "out": y.detach().flatten().tolist(),
            "grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten().tolist()
                      for n, p in model.named_parameters() if p.grad is not None}}
    return out


def _tp_ep_rank(rank: int, world: int) -> dict:
    """TP (llama3) and EP (qwen3-MoE) in one spawn: the processes' start-up is paid once."""
    return {"tp": _tp_rank(rank, world, ["fp8"]), "ep": _ep_rank(rank, world, ["fp8"])}


@pytest.fixture(scope="module")
def tp_ep_ranks(tmp_path_factory):
    return run_ranks(_tp_ep_rank, 2, (), tmp_path_factory.mktemp("tp_ep"))


def test_torchtitan_tensor_parallel_matches_one_process(tp_ep_ranks):
    """torchtitan's TP on 2 gloo ranks (llama3's stock sharding config, ``Model.parallelize``,
    the ``partial_dtensor`` backend): every converted Linear runs hybridfp's own parallel style
    (weights DTensors placed as torchtitan's, a hybridfp tensor-parallel plan installed), and
    the logits and every weight's whole gradient match the one-process converted model.

    Bounds: the row-parallel partial sums are all-reduced in FP32 (another summation order than
    one process's K-sum), so no bitwise claim (~1e-7 of the logits' scale here). FP8 (the
    one-process Identity model only measures FP8's own distance): the split operands
    are quantized with the whole tensor's amax (reduced over the group), so the quantization is
    the one process's; an FP32 ulp of reordering could still move a later activation across an
    E4M3 rounding step, so the logits' bound is 5e-4 of the scale: 8x under the distance between
    the one-process FP8 and Identity models (asserted). Gradients: an ulp can also move a
    gradient element across an E5M2 step, and whether any does depends on the CPU's GEMM
    kernels (none on some machines; on others a few thousand of the first layer's elements,
    up to 3 % of its gradient's largest element, 0.094 of FP8's own distance in norm). So each
    weight's gradient is held, in norm, to 0.3 of the distance between the one-process FP8 and
    Identity gradients: a rank quantizing with its own shard's scales, or skipping
    quantization, moves every element by FP8's own error (a ratio near 1) and fails it.
    """
    ranks = [r["tp"] for r in tp_ep_ranks]
    tol = 5e-4
    cfg = _config("llama3", [HybridFPConverter.Config(recipe="fp8")])
    model = _build(cfg, like=_build(_config("llama3")))
    x = _tokens(cfg.vocab_size)
    y = model(x)
    y.float().pow(2).mean().backward()
    grads = {n: p.grad.flatten() for n, p in model.named_parameters()}
    scale = y.detach().abs().max()
    _, identity = _converted("llama3", "bf16")  # FP8's own distance from the Identity model
    y_id = identity(x)
    assert (y - y_id).abs().max() > 8 * tol * scale
    y_id.float().pow(2).mean().backward()
    fp8_error = {n: (grads[n] - p.grad.flatten()).norm() for n, p in identity.named_parameters()}
    for r in ranks:
        got = r["fp8"]
        assert got["placements"] == ["(Shard(dim=1),)", "(Shard(dim=0),)", "_Plan"]
        assert (torch.tensor(got["out"]) - y.detach().flatten()).abs().max() <= tol * scale
        assert set(got["grads"]) == set(grads)
        for n, g in got["grads"].items():
            assert fp8_error[n] > 0, n  # every weight's gradient is FP8's, not the Identity's
            assert (torch.tensor(g) - grads[n]).norm() <= 0.3 * fp8_error[n], n


def _ep_rank(rank: int, world: int, recipes: list) -> dict:
    """torchtitan's own expert parallelism (qwen3's sharding config with ``enable_ep``,
    ``Model.parallelize``: expert weights ``Shard(0)`` on the ep mesh, tokens all-to-all'd) on
    the converted MoE model, every rank given the same batch."""
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    from torchtitan.distributed import utils as dist_utils
    parallel_dims.device_type = "cpu"  # torchtitan falls back to "cuda" when no GPU is found
    dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's trainer does from its config
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world,
                        spmd_backend="partial_dtensor")
    out = {}
    for recipe in recipes:
        cfg = _config("qwen3_moe", [HybridFPConverter.Config(recipe=recipe)])
        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
        model = _build(cfg, like=_build(_config("qwen3_moe")))
        model.parallelize(dims)
        experts = model.layers["0"].moe.routed_experts.inner_experts
        y = model(_tokens(cfg.vocab_size))
        y = y.full_tensor() if isinstance(y, DTensor) else y
        y.float().pow(2).mean().backward()
        out[recipe] = {
            "experts": [str(experts.w1_EFD.placements), experts.hybridfp_grouped_linears()[0].num_gemms],
            "out": y.detach().flatten().tolist(),
            "grads": {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).flatten().tolist()
                      for n, p in model.named_parameters() if p.grad is not None}}
    return out


def test_torchtitan_expert_parallel_matches_one_process(tp_ep_ranks):
    """torchtitan's EP on 2 gloo ranks: each rank's converted experts read their local shard
    (the DTensor's local tensor: EXPERTS / 2 whole experts) and run hybridfp.GroupedLinear on
    it; the logits and the gradients match the one-process converted model (each rank's
    experts see both ranks' copies of the batch: their gradients are twice the one-process
    ones, the other weights' equal them).

    Bounds: every expert is whole on one rank and quantized per expert (its own quantizer
    set): the duplicated tokens leave each expert's input and dy amaxes unchanged, so every
    operand quantizes as in one process; the GEMMs run on more rows and the routed outputs
    come back through the all-to-all, summed in another order: 1e-5 of the logits' scale
    (~1e-7 observed), 8x that for the gradients."""
    recipes = ["fp8"]
    ranks = [r["ep"] for r in tp_ep_ranks]
    tol = 1e-5
    for recipe in recipes:
        cfg = _config("qwen3_moe", [HybridFPConverter.Config(recipe=recipe)])
        model = _build(cfg, like=_build(_config("qwen3_moe")))
        y = model(_tokens(cfg.vocab_size))
        y.float().pow(2).mean().backward()
        params = dict(model.named_parameters())
        for rank, r in enumerate(ranks):
            got = r[recipe]
            assert got["experts"] == ["(Shard(dim=0),)", EXPERTS // 2]
            assert (torch.tensor(got["out"]) - y.detach().flatten()).abs().max() <= tol * y.abs().max()
            assert set(got["grads"]) == set(params)
            for n, g in got["grads"].items():
                ref = params[n].grad
                if n.endswith(("_EFD", "_EDF")):  # this rank's experts, from both ranks' tokens
                    ref = 2 * ref.chunk(2)[rank]
                ref = ref.flatten()
                assert (torch.tensor(g) - ref).abs().max() <= 8 * tol * ref.abs().max() + 1e-12, (recipe, n)
