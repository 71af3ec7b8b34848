"""torch.compile of the dense modules: one graph, no break, bitwise the eager results.

The compiled calls run with ``backend="aot_eager"``: AOTAutograd traces forward and backward
(the custom ops of hybridfp/nn/ops.py and the autograd around them) but runs each op as eager
does, so the CPU executes the same arithmetic in the same order and bitwise equality is the
right claim. Inductor would fuse and reorder the norms' FP32 reductions (another summation
order: tests/README.md), so under inductor only Linears, whose results are outputs of the
custom ops (with at most one elementwise op between them, which inductor rounds as eager does),
are compared bitwise (test_inductor_linear_bitwise, test_inductor_reused_buffer_is_quantized_anew).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import hybridfp as hf
from hybridfp import factories

RECIPES = {
    "current": hf.Float8CurrentScaling,
    "block": hf.Float8BlockScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid_mxfp8_nvfp4": lambda: hf.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd),
    "hybrid_hp_mxfp8": lambda: hf.CustomRecipe(qfactory=factories.high_precision_fwd_mxfp8_bwd),
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
}
MODULES = {
    "Linear": lambda: hf.Linear(64, 32),
    "LayerNormLinear": lambda: hf.LayerNormLinear(64, 32),
    "LayerNormMLP": lambda: hf.LayerNormMLP(64, 128),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("module", sorted(MODULES))
def test_one_graph_no_break(module: str, recipe: str) -> None:
    torch.manual_seed(0)
    m = MODULES[module]()
    x = torch.randn(8, 64, requires_grad=True)
    with hf.autocast(recipe=RECIPES[recipe]()):
        explained = torch._dynamo.explain(m)(x)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1


def _run(m, x: torch.Tensor, recipe, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)  # NVFP4 stochastic rounding draws its seeds from torch's generator
    x = x.clone().requires_grad_()
    with hf.autocast(recipe=recipe):
        y = m(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return [y.detach(), x.grad]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("module", sorted(MODULES))
def test_fullgraph_bitwise_eager(module: str, recipe: str) -> None:
    """Three steps (delayed scaling: the scales move at each region end, the graph stays)."""
    torch.manual_seed(1)
    eager = MODULES[module]()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    for step in range(3):
        x = torch.randn(8, 64)
        a = _run(eager, x, RECIPES[recipe](), 100 + step)
        b = _run(compiled, x, RECIPES[recipe](), 100 + step)
        a += [p.grad.clone() for p in eager.parameters()]
        b += [p.grad.clone() for p in twin.parameters()]
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    if recipe == "delayed":  # the amax histories moved the same way
        sa, sb = eager.get_extra_state()["quantizers"], twin.get_extra_state()["quantizers"]
        for k in sa:
            for name, t in sa[k]["state"].items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(t, sb[k]["state"][name]), (k, name)


def test_no_grad_and_3d_input() -> None:
    torch.manual_seed(2)
    m = hf.Linear(64, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 4, 64)
    with torch.no_grad(), hf.autocast(recipe=hf.MXFP8BlockScaling()):
        assert torch.equal(compiled(x), m(x))


def test_recipe_change_recompiles() -> None:
    """The recipe's configuration is guarded: another recipe traces again, bitwise eager."""
    torch.manual_seed(3)
    m = hf.Linear(64, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64)
    for recipe in (hf.MXFP8BlockScaling(), hf.Float8CurrentScaling(), hf.MXFP8BlockScaling(scale_rule="floor")):
        with torch.no_grad(), hf.autocast(recipe=recipe):
            assert torch.equal(compiled(x), m(x))


def test_policy_change_recompiles() -> None:
    """The decoded-copies policy changes the saved copies: it is guarded too."""
    torch.manual_seed(5)
    m = hf.Linear(64, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for mode in ("never", "always", "never"):
        outs = []
        for mod in (m, compiled):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
            with hf.policy(decoded_copies=mode), hf.autocast(recipe=hf.MXFP8BlockScaling()):
                y = mod(x)
            y.sum().backward()
            outs.append((y.detach(), x.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


class _GatedMLP(torch.nn.Module):
    """Hugging Face's gated MLP: gate and up read the same input (shared quantization)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = hf.Linear(64, 96), hf.Linear(64, 96), hf.Linear(96, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_shared_input_gated_mlp_bitwise() -> None:
    torch.manual_seed(6)
    eager = _GatedMLP()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64)
    a = _run(eager, x, hf.MXFP8BlockScaling(), 0) + [p.grad for p in eager.parameters()]
    b = _run(compiled, x, hf.MXFP8BlockScaling(), 0) + [p.grad for p in twin.parameters()]
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_gpt_two_layers_one_graph_bitwise() -> None:
    """hybridfp train's GPT (RMSNorm, RoPE attention, fused SwiGLU MLP), two layers."""
    from hybridfp.train.model import GPT, GPTConfig

    torch.manual_seed(7)
    eager = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32), act_dtype=torch.float32)
    twin = copy.deepcopy(eager)
    idx = torch.randint(0, 256, (2, 16))
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        explained = torch._dynamo.explain(twin)(idx, idx)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    losses = []
    for model in (eager, compiled):
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            out = model(idx, idx)
        loss = out[1] if isinstance(out, tuple) else out
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for p, q in zip(eager.parameters(), twin.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_is_first_microbatch_reuses_the_kept_weight() -> None:
    torch.manual_seed(8)
    m = hf.Linear(64, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64)
    with torch.no_grad():
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            ref = m(x, is_first_microbatch=True)
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            got = compiled(x, is_first_microbatch=False)
    assert torch.equal(ref, got)


def test_checkpoint_inside_compiled_region_is_refused() -> None:
    """Its recomputation would run the forward op outside the autocast region: a clear error."""
    m = hf.Linear(64, 32)
    compiled = torch.compile(lambda x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False),
                             fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64, requires_grad=True)
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        y = compiled(x)
    with pytest.raises(RuntimeError, match="Linear: its compiled quantized GEMM ran outside hybridfp.autocast"):
        y.sum().backward()


def test_inductor_linear_bitwise() -> None:
    """With inductor (the default backend) a Linear's outputs are still bitwise eager: y, dx,
    dW and db are all outputs of the custom ops, which run the eager code; nothing of the
    module's arithmetic is left for inductor to fuse or reorder."""
    torch.manual_seed(9)
    eager = hf.Linear(64, 32)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(8, 64)
    a = _run(eager, x, hf.Float8CurrentScaling(), 0) + [eager.weight.grad, eager.bias.grad]
    b = _run(compiled, x, hf.Float8CurrentScaling(), 0) + [twin.weight.grad, twin.bias.grad]
    for u, v in zip(a, b):
        assert torch.equal(u, v)


class _ReadsTwice(torch.nn.Module):
    """a reads h, then b reads h * 3: h is dead after a, so inductor computes h * 3 in place in
    h's buffer (same storage, shape and version counter as the h that a quantized)."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.a, self.b = (hf.Linear(64, 64, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(x)
        return self.a(h) + self.b(h * 3)


def test_inductor_reused_buffer_is_quantized_anew() -> None:
    """Under inductor b quantizes its own input, not the copies a made of the buffer's previous
    value: bitwise eager (whose shared input memo sees two different tensors)."""
    torch.manual_seed(12)
    eager = _ReadsTwice()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(8, 64)
    with torch.no_grad(), hf.autocast(recipe=hf.Float8CurrentScaling()):
        assert torch.equal(compiled(x), eager(x))


def test_backward_runs_with_its_own_forward_recipe() -> None:
    """A forward under recipe A, one under B, then A's backward: it reads A's gradient quantizer
    (E5M2), as the eager backward does, not the module's latest (B's E4M3). Also under a
    saved-tensor hook that hands back copies (save_on_cpu with pinning copies even on the CPU):
    the copied record still names its own forward."""
    torch.manual_seed(13)
    eager = hf.Linear(64, 32)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    a_recipe, b_recipe = hf.Float8CurrentScaling(), hf.Float8CurrentScaling(fp8_format="E4M3")
    x1, x2 = torch.randn(8, 64), torch.randn(8, 64)
    for hooks in (contextlib.nullcontext, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)):
        res = []
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
            with hooks():
                with hf.autocast(recipe=a_recipe):
                    y1 = m(a)
                with hf.autocast(recipe=b_recipe):
                    y2 = m(b)
            y1.backward(torch.linspace(-1.3, 1.7, y1.numel()).reshape(y1.shape))
            res.append([a.grad, m.weight.grad.clone()])
            y2.backward(torch.linspace(-1.3, 1.7, y2.numel()).reshape(y2.shape))
            res[-1] += [b.grad, m.weight.grad.clone()]
        for u, v in zip(*res):
            assert torch.equal(u, v)


def test_backward_runs_under_its_own_forward_policy() -> None:
    """The backward op runs under the policy its forward ran under, as the eager backward does
    (here the gradient quantizer sees quantize_kernels=False although the backward runs after
    the policy block ended)."""
    seen: list[bool] = []

    class Watching(hf.Float8CurrentScalingQuantizer):
        def quantize(self, x: torch.Tensor):
            seen.append(hf.current_policy().quantize_kernels)
            return super().quantize(x)

    def factory(role):
        tensor_type = None if role is None else role.tensor_type
        return Watching(fp8_dtype=torch.float8_e5m2) if tensor_type == "grad_output" else hf.Float8CurrentScalingQuantizer()

    torch.manual_seed(14)
    eager = hf.Linear(64, 32)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64)
    grads = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_()
        with hf.policy(quantize_kernels=False), hf.autocast(recipe=hf.CustomRecipe(factory)):
            y = m(xi)
        seen.clear()
        y.sum().backward()
        assert seen == [False]
        grads.append([xi.grad, m.weight.grad])
    for u, v in zip(*grads):
        assert torch.equal(u, v)


def test_equal_custom_recipe_made_each_step_compiles_once() -> None:
    """An equal CustomRecipe(per_gemm(...)) made each step passes the guards (the module keeps
    its quantizers across equal recipes too); another per_gemm traces again."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from hybridfp.recipes.factories import per_gemm

    torch.manual_seed(15)
    eager = hf.Linear(64, 32)
    twin = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, fullgraph=True, backend=counter)
    x = torch.randn(8, 64)
    for formats in [("mxfp8", "mxfp8", "nvfp4")] * 3 + [("mxfp8", "mxfp8", "mxfp8")]:
        recipe = hf.CustomRecipe(per_gemm(*formats))
        with torch.no_grad(), hf.autocast(recipe=recipe):
            assert torch.equal(compiled(x), eager(x))
    assert counter.frame_count == 2


def test_new_row_counts_trace_again() -> None:
    """A second row count makes Dynamo mark the dim dynamic; the ops specialize it (the saved
    copies' block shapes come from concrete sizes), so each count runs bitwise eager."""
    torch.manual_seed(10)
    eager = hf.Linear(64, 32)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    for rows in (8, 16, 40):
        x = torch.randn(rows, 64)
        a = _run(eager, x, hf.MXFP8BlockScaling(), 0) + [eager.weight.grad.clone()]
        b = _run(compiled, x, hf.MXFP8BlockScaling(), 0) + [twin.weight.grad.clone()]
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_autocast_inside_the_compiled_function() -> None:
    """The region is entered outside the compiled code: the ops read it when they run, and its
    end (delayed scaling's update) runs in ``autocast``'s exit. Entered inside, Dynamo cannot
    trace the region's construction: ``fullgraph=True`` raises, and without it Dynamo runs that
    frame eagerly and compiles each module's call as its own graph (bitwise eager)."""
    torch.manual_seed(11)
    m = hf.Linear(64, 32)

    def step(x: torch.Tensor) -> torch.Tensor:
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            return m(x)

    x = torch.randn(8, 64)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="aot_eager")(x), step(x))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_training_steps_in_new_regions_compile_once(activation: str, recipe: str) -> None:
    """A step per autocast region (as training runs) reuses the first step's graph: nothing the
    modules set on the region inside the traced frame (the fused SwiGLU's amax records, which
    FP8 current scaling reads) is guarded on, which would recompile every step and hit Dynamo's
    limit on the ninth under fullgraph=True."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    counter = CompileCounterWithBackend("aot_eager")
    m = torch.compile(hf.LayerNormMLP(64, 128, activation=activation), fullgraph=True, backend=counter)
    for step in range(4):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        with hf.autocast(recipe=RECIPES[recipe]()):
            y = m(x)
        y.float().pow(2).mean().backward()
    assert counter.frame_count == 1
