"""torch.utils.checkpoint on hybridfp modules, both modes: gradients bitwise those of the step
without recompute, for every built-in recipe, backward inside or after the autocast region,
nested modules, two forwards before one backward, backward on another thread, retained graphs;
and the quantizers' state after the step is the same (a recomputation records nothing).

Both sides run the same operations on the same shapes in the same order (the recomputation
repeats the forward), so the comparisons are bitwise (tests/README.md)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch import nn

import hybridfp as hfp
from hybridfp.factories import per_gemm

RECIPES = {
    "delayed": lambda: hfp.DelayedScaling(amax_history_len=4),
    "fp8_current": lambda: hfp.Float8CurrentScaling(),
    "fp8_block": lambda: hfp.Float8BlockScaling(),
    "mxfp8": lambda: hfp.MXFP8BlockScaling(),
    "nvfp4": lambda: hfp.NVFP4BlockScaling(),  # RHT + stochastic rounding on gradients
    "hybrid": lambda: hfp.CustomRecipe(qfactory=per_gemm("nvfp4", "mxfp8", "fp8_block")),
}
MODES = {"reentrant": True, "non_reentrant": False}


class MLP(nn.Module):
    """gate / up read one input (shared quantization), SwiGLU, down: nested hybridfp modules."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = hfp.Linear(d, h), hfp.Linear(d, h), hfp.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(hfp.swiglu(self.gate(x), self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int = 32, h: int = 64) -> None:
        super().__init__()
        self.attn = hfp.LayerNormLinear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d, h)
        self.ffn = hfp.LayerNormMLP(d, h, activation="swiglu")  # two quantizer sets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.gelu(self.attn(x))
        x = x + self.mlp(self.norm(x))
        return x + self.ffn(x)


class Model(nn.Module):
    """Blocks called the way Hugging Face models call them under gradient checkpointing:
    ``self._gradient_checkpointing_func(block.__call__, hidden)``."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = hfp.Linear(32, 32)
        self.use_reentrant = None  # None: no checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.use_reentrant is None:
                x = block(x)
            else:
                x = tc.checkpoint(block.__call__, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def _model(use_reentrant=None) -> Model:
    torch.manual_seed(0)
    m = Model()
    hfp.set_names(m)
    m.use_reentrant = use_reentrant
    return m


def _input(seed: int) -> torch.Tensor:
    return torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y.float() ** 2).mean()


def _states(model: nn.Module) -> list:
    return [m.get_extra_state() for m in model.modules() if isinstance(m, hfp.nn.QuantizedModule)]


def _flat(obj):
    """Tensors and plain values of nested dicts / lists, in order."""
    if isinstance(obj, dict):
        return [v for k in sorted(obj) for v in _flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [v for o in obj for v in _flat(o)]
    return [obj]


def _assert_same(got, want) -> None:
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if torch.is_tensor(a):
            assert torch.equal(a, b), f"item {i} differs"
        else:
            assert a == b, f"item {i}: {a!r} != {b!r}"


def _steps(recipe_name: str, use_reentrant, backward_inside: bool, steps: int = 2, thread: bool = False):
    """``steps`` training steps (forward in a region, backward inside or after it, SGD):
    every step's output and gradients, then the quantizers' state."""
    model = _model(use_reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in range(steps):
        x = _input(step)
        torch.manual_seed(100 + step)  # stochastic rounding draws
        with hfp.autocast(recipe=RECIPES[recipe_name]()):
            loss = _loss(model(x))
            if backward_inside:
                loss.backward()
        if not backward_inside:
            if thread:
                t = threading.Thread(target=loss.backward)
                t.start()
                t.join()
            else:
                loss.backward()
        out.append([loss.detach(), x.grad] + [p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return out, _states(model)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_torch_checkpoint_backward_after_region_is_bitwise(recipe_name, mode):
    """Backward after the region: delayed scaling has moved its scales by then; the
    recomputation uses the forward's."""
    want = _steps(recipe_name, None, backward_inside=False)
    got = _steps(recipe_name, MODES[mode], backward_inside=False)
    _assert_same(got, want)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe_name", ["delayed", "nvfp4", "mxfp8"])
def test_torch_checkpoint_backward_inside_region_is_bitwise(recipe_name, mode):
    want = _steps(recipe_name, None, backward_inside=True)
    got = _steps(recipe_name, MODES[mode], backward_inside=True)
    _assert_same(got, want)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe_name", ["delayed", "nvfp4"])
def test_torch_checkpoint_backward_on_another_thread_is_bitwise(recipe_name, mode):
    want = _steps(recipe_name, None, backward_inside=False)
    got = _steps(recipe_name, MODES[mode], backward_inside=False, thread=True)
    _assert_same(got, want)


@pytest.mark.parametrize("mode", list(MODES))
def test_backward_inside_a_later_region_uses_the_forwards_state(mode):
    """Backward run inside the next step's region: the recomputation replays the forward's
    region and scales, not the live region's (delayed scaling moved them in between)."""
    out = {}
    for name, use_reentrant in (("plain", None), ("ckpt", MODES[mode])):
        model = _model(use_reentrant)
        recipe = RECIPES["delayed"]()
        with hfp.autocast(recipe=recipe):
            model(_input(0))
        with hfp.autocast(recipe=recipe):
            loss = _loss(model(_input(1)))
        with hfp.autocast(recipe=recipe):
            loss.backward()
        out[name] = ([p.grad for p in model.parameters()], _states(model))
    _assert_same(out["ckpt"], out["plain"])


def _two_forwards(use_reentrant, recipe_name: str):
    """Two forwards, each in its own region (delayed scaling updates between them), then one
    backward through both."""
    model = _model(use_reentrant)
    recipe = RECIPES[recipe_name]()
    losses = []
    for step in range(2):
        torch.manual_seed(200 + step)
        with hfp.autocast(recipe=recipe):
            losses.append(_loss(model(_input(10 + step))))
    torch.manual_seed(300)
    (losses[0] + 2 * losses[1]).backward()
    return [torch.stack(losses).detach()] + [p.grad for p in model.parameters()], _states(model)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe_name", ["delayed", "nvfp4", "hybrid"])
def test_two_forwards_before_one_backward_are_bitwise(recipe_name, mode):
    _assert_same(_two_forwards(MODES[mode], recipe_name), _two_forwards(None, recipe_name))


@pytest.mark.parametrize("mode", list(MODES))
def test_retained_graph_recomputes_again(mode):
    """A second backward over a retained graph replays the records from the start."""
    grads = {}
    for name, use_reentrant in (("plain", None), ("ckpt", MODES[mode])):
        model = _model(use_reentrant)
        with hfp.autocast(recipe=RECIPES["delayed"]()):
            loss = _loss(model(_input(3)))
        loss.backward(retain_graph=True)
        with hfp.autocast(recipe=RECIPES["delayed"]()):
            model(_input(4))  # another region: the scales move again
        loss.backward()
        grads[name] = [p.grad for p in model.parameters()]
    _assert_same(grads["ckpt"], grads["plain"])


def test_checkpoint_with_a_high_precision_forward_recomputes_in_high_precision():
    """A module that ran outside any region in the checkpointed forward (after it had run
    quantized) recomputes in high precision: its record says so."""
    grads = []
    for use_reentrant in (None, True, False):
        model = _model(use_reentrant)
        with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
            model(_input(0))  # builds the quantizers
        x = _input(1)
        _loss(model(x)).backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    _assert_same(grads[1], grads[0])
    _assert_same(grads[2], grads[0])


@pytest.mark.parametrize("mode", list(MODES))
def test_recompute_calling_other_modules_is_refused(mode):
    """A checkpointed function that runs other hybridfp modules when recomputed would replay
    another module's record: refused with a clear error."""
    a, b = hfp.Linear(32, 32, name="a"), hfp.Linear(32, 32, name="b")
    calls = []

    def fn(x):
        calls.append(1)
        return (a if len(calls) == 1 else b)(x)

    x = torch.randn(4, 32, requires_grad=True)
    with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
        y = tc.checkpoint(fn, x, use_reentrant=MODES[mode])
    with pytest.raises(RuntimeError, match="where the forward called Linear a"):
        y.sum().backward()


def _nested(outer, inner):
    """Two delayed-scaling steps of a checkpoint (``outer`` mode) holding another (``inner``
    mode; None: none) and a module after it; the input's gradients."""
    torch.manual_seed(0)
    a, b = hfp.Linear(32, 32, name="a"), hfp.Linear(32, 32, name="b")
    x = torch.randn(4, 32, requires_grad=True)

    def inner_fn(t):
        return b(torch.relu(a(t)))

    def outer_fn(t):
        return a(inner_fn(t) if inner is None else tc.checkpoint(inner_fn, t, use_reentrant=inner))

    grads = []
    for _ in range(2):
        with hfp.autocast(recipe=hfp.DelayedScaling(amax_history_len=4)):
            y = outer_fn(x) if outer is None else tc.checkpoint(outer_fn, x, use_reentrant=outer)
        (y.float() ** 2).sum().backward()
        grads.append(x.grad.clone())
    return grads


@pytest.mark.parametrize("outer,inner", [(True, True), (True, False), (False, True)])
def test_nested_checkpoints_are_bitwise(outer, inner):
    """A call inside nested checkpoints is recorded for each of them."""
    _assert_same(_nested(outer, inner), _nested(None, None))


def test_non_reentrant_checkpoint_nested_in_a_non_reentrant_recompute_is_refused():
    """torch shows only the innermost hooks, so hybridfp cannot find the forward of a module
    that runs inside a non-reentrant checkpoint nested in a non-reentrant recomputation: it
    raises instead of quantizing otherwise than the forward did."""
    with pytest.raises(RuntimeError, match="Linear a: torch.utils.checkpoint is recomputing a segment whose "
                                           "forward hybridfp cannot find"):
        _nested(False, False)


def test_records_belong_to_their_forward_and_go_with_it():
    """Each checkpointed forward keeps its records on torch's object for it; none outlives it."""
    import gc
    import weakref

    from hybridfp.nn import recompute

    lin = hfp.Linear(32, 32)
    seen = []

    def fn(x):
        seen.append(recompute.recording_segment())
        return lin(x)

    with hfp.autocast(recipe=hfp.DelayedScaling()):
        y1 = tc.checkpoint(fn, torch.randn(4, 32, requires_grad=True), use_reentrant=False)
        y2 = tc.checkpoint(fn, torch.randn(4, 32, requires_grad=True), use_reentrant=False)
    first, second = seen
    assert first is not second and len(first.records) == len(second.records) == 1
    # delayed scaling: the record holds copies (a region end moves the module's own state)
    assert (first.records[0].quantizers["input"][0] is not lin._quantizers["input"][0]
            and first.records[0].quantizers["grad_output"][0] is lin._quantizers["grad_output"][0])
    ref = weakref.ref(first)
    seen.clear()
    del first, second
    y1.sum().backward()
    assert seen == [None]  # the recomputation records nothing (it replays)
    del y1
    gc.collect()
    assert ref() is None
    y2.sum().backward()


def test_saved_tensor_hooks_inside_the_checkpointed_function_are_refused_in_a_later_region():
    """The non-reentrant recomputation of a module under saved-tensor hooks of its own
    (``save_on_cpu``) is not torch's checkpoint as hybridfp recognises it: run inside the next
    step's autocast region it would use (and record into) that region's quantizers, so it is
    refused by name. (The reentrant recomputation is recognised: it replays the forward.)"""
    torch.manual_seed(0)
    a, b = hfp.Linear(32, 32, name="a"), hfp.Linear(32, 32, name="b")

    def f(t):
        h = torch.relu(a(t))
        with torch.autograd.graph.save_on_cpu():
            return b(h)
    recipe = hfp.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32, requires_grad=True)
    with tc.set_checkpoint_early_stop(False):
        with hfp.autocast(recipe=recipe):
            y = tc.checkpoint(f, x, use_reentrant=False)
        with hfp.autocast(recipe=recipe), pytest.raises(RuntimeError, match="Linear b: forward run during backward"):
            y.float().sum().backward()


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_eager_checkpoint_around_a_compiled_module_is_refused(mode, fullgraph):
    """Its recomputation runs the compiled graph, not hybridfp's recorded call: retraced in the
    backward pass outside the region it would compute high-precision gradients silently."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = hfp.Linear(32, 32, name="lin")
    f = torch.compile(lin, fullgraph=fullgraph, backend="aot_eager")
    x = torch.randn(8, 32, requires_grad=True)
    with hfp.autocast(recipe=hfp.Float8CurrentScaling()):
        y = tc.checkpoint(f, x, use_reentrant=MODES[mode])
    with pytest.raises(Exception, match="Linear lin: (forward run during backward|torch.utils.checkpoint is recomputing)"):
        y.float().sum().backward()
    torch._dynamo.reset()
