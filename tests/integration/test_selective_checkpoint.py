"""Selective activation checkpointing (``torch.utils.checkpoint.checkpoint(..., context_fn=
partial(create_selective_checkpoint_contexts, policy))``) on hybridfp modules: outputs and
gradients bitwise those of the step without checkpointing, and the quantizers' state after the
step the same, for policies that save ops the weight quantization runs (``aten.amax``,
``aten.abs``), the GEMM (``aten.mm``) and every op.

torch's selective checkpoint saves the outputs of the ops its policy picks in the forward and
hands the k-th saved output of an op to the k-th call of that op in the recomputation. The
recomputation mostly finds the weights quantized in the cache (no op) where the forward
quantized them (ops), so hybridfp runs the weight cache's work hidden from the two modes
(``recompute.hidden_from_selective_checkpoint``), and the quantizer builds and the copies a
recomputation replays too: both passes show the modes the same calls. Shown, the skipped calls
shift every later call's number: wrong saved outputs (silently wrong gradients) or shape errors.

Both sides run the same operations on the same shapes in the same order (the recomputation
repeats the forward; saved outputs are the forward's own), so the comparisons are bitwise
(tests/README.md)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import hybridfp as hfp
from hybridfp.nn import recompute
from hybridfp.quantizers import NVFP4Quantizer

aten = torch.ops.aten

RECIPES = {
    "fp8_current": lambda: hfp.Float8CurrentScaling(),
    "delayed": lambda: hfp.DelayedScaling(amax_history_len=4),
    "mxfp8": lambda: hfp.MXFP8BlockScaling(),
    "fp8_block": lambda: hfp.Float8BlockScaling(),
    # stochastic rounding of gradients only (backward, not recomputed): allowed under checkpoint;
    # a forward role rounding stochastically is refused (test at the end)
    "nvfp4": lambda: hfp.NVFP4BlockScaling(),
}
#: The ops a policy saves (MUST_SAVE); "all": every op.
POLICIES = {"amax": [aten.amax.default], "abs": [aten.abs.default], "mm": [aten.mm.default], "all": None}


def _context_fn(policy_name: str):
    ops = POLICIES[policy_name]

    def policy(ctx, op, *args, **kwargs):
        if ops is None or op in ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    # saving every op saves outputs that are written in place afterwards (a padded block
    # buffer filled after ``new_full``), which torch refuses unless allowed
    return functools.partial(create_selective_checkpoint_contexts, policy,
                             allow_cache_entry_mutation=ops is None)


class Block(nn.Module):
    """LayerNormLinear, a gated MLP whose gate / up read one input (shared quantization),
    LayerNormMLP (two quantizer sets), and a Linear called twice (its second call finds the
    weight cached in the forward too)."""

    def __init__(self, d: int = 32, h: int = 64) -> None:
        super().__init__()
        self.attn = hfp.LayerNormLinear(d, d)
        self.norm = nn.LayerNorm(d)
        self.gate, self.up, self.down = hfp.Linear(d, h), hfp.Linear(d, h), hfp.Linear(h, d)
        self.ffn = hfp.LayerNormMLP(d, h, activation="swiglu")
        self.proj = hfp.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.gelu(self.attn(x))
        h = self.norm(x)
        x = x + self.down(hfp.swiglu(self.gate(h), self.up(h)))
        x = x + self.ffn(x)
        return x + self.proj(self.proj(x))


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = hfp.Linear(32, 32)

    def forward(self, x: torch.Tensor, policy_name=None) -> torch.Tensor:
        for block in self.blocks:
            if policy_name is None:
                x = block(x)
            else:
                x = tc.checkpoint(block, x, use_reentrant=False, context_fn=_context_fn(policy_name))
        return self.head(x)


def _model() -> Model:
    torch.manual_seed(0)
    m = Model()
    hfp.set_names(m)
    return m


def _input(seed: int) -> torch.Tensor:
    return torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _states(model: nn.Module) -> list:
    return [m.get_extra_state() for m in model.modules() if isinstance(m, hfp.nn.QuantizedModule)]


def _flat(obj) -> list:
    """Tensors and plain values of nested dicts / lists, in order."""
    if isinstance(obj, dict):
        return [v for k in sorted(obj) for v in _flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [v for item in obj for v in _flat(item)]
    return [obj]


def _assert_same(got, want) -> None:
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if torch.is_tensor(b):
            assert torch.is_tensor(a) and a.shape == b.shape and torch.equal(a, b), f"item {i} differs"
        else:
            assert a == b, f"item {i}: {a!r} != {b!r}"


def _steps(recipe_name: str, policy_name, backward_inside: bool = False, steps: int = 2) -> list:
    """``steps`` training steps (forward in a region, backward after or inside it, SGD): each
    step's output, input gradient, every parameter's gradient and the quantizers' state."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated GEMMs on the CPU
        for step in range(steps):
            x = _input(step)
            torch.manual_seed(100 + step)  # NVFP4's stochastic rounding of gradients
            with hfp.autocast(recipe=RECIPES[recipe_name]()):
                y = model(x, policy_name)
                loss = (y.float() ** 2).mean()
                if backward_inside:
                    loss.backward()
            if not backward_inside:
                loss.backward()
            out.append([y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()] + [_states(model)])
            opt.step()
            opt.zero_grad()
    return out


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_selective_checkpoint_is_bitwise(recipe_name, policy_name):
    """y, x.grad and every parameter's gradient of two steps, and the quantizer state after
    each (delayed scaling's history and scale: the recomputation records into copies)."""
    _assert_same(_steps(recipe_name, policy_name), _steps(recipe_name, None))


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_selective_checkpoint_backward_inside_region_is_bitwise(recipe_name):
    _assert_same(_steps(recipe_name, "amax", backward_inside=True),
                 _steps(recipe_name, None, backward_inside=True))


@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
def test_selective_checkpoint_with_decoded_copies_is_bitwise(recipe_name):
    """Copies held as their BF16 decodes: the decode is part of the hidden weight quantization."""
    with hfp.policy(decoded_copies="always"):
        got = _steps(recipe_name, "amax", steps=1)
        want = _steps(recipe_name, None, steps=1)
    _assert_same(got, want)


def _two_linears(recipe_name: str, policy_name, before_segment: bool, later_region: bool) -> list:
    """Two Linears, the second checkpointed with ``policy_name`` (None: not checkpointed).
    ``before_segment``: the second also runs before the segment in the same region on the same
    input (the segment's forward finds its weight cached and its input's quantization in the
    region's memo). ``later_region``: another region runs the second before the backward (the
    recomputation finds another region's entry: it quantizes the weight again)."""
    torch.manual_seed(0)
    a, b = hfp.Linear(64, 64, name="a"), hfp.Linear(64, 64, name="b")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hfp.autocast(recipe=RECIPES[recipe_name]()):
            h = a(x)
            extra = b(h) if before_segment else 0
            if policy_name is None:
                y = b(h)
            else:
                y = tc.checkpoint(b, h, use_reentrant=False, context_fn=_context_fn(policy_name))
        if later_region:
            with hfp.autocast(recipe=RECIPES[recipe_name]()):
                extra = extra + b(x.detach() * 2)
        ((y.float() + extra) ** 2).mean().backward()
    return [y.detach(), x.grad, a.weight.grad, b.weight.grad, _states(a), _states(b)]


@pytest.mark.parametrize("policy_name", ["amax", "abs", "mm"])
@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8", "delayed"])
@pytest.mark.parametrize("before_segment,later_region", [(True, False), (False, True), (True, True)])
def test_cache_and_memo_hits_in_either_pass_are_bitwise(recipe_name, policy_name, before_segment,
                                                        later_region):
    """The forward finds the weight cached and the input quantized (a call before the segment),
    or the recomputation finds no entry (a later region replaced it), or both: the calls the
    modes see are the same in both passes all the same."""
    _assert_same(_two_linears(recipe_name, policy_name, before_segment, later_region),
                 _two_linears(recipe_name, None, before_segment, later_region))


def test_grouped_linear_under_selective_checkpoint_is_bitwise():
    """GroupedLinear quantizes its experts' weights through its own ``quantized_weights``."""
    results = []
    for policy_name in (None, "amax", "all"):
        torch.manual_seed(0)
        m = hfp.GroupedLinear(3, 32, 32, name="experts")
        x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        splits = [8, 4, 12]

        def f(x):
            return m(m(x, splits), splits)  # the second call finds the weights cached

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
                y = f(x) if policy_name is None else tc.checkpoint(
                    f, x, use_reentrant=False, context_fn=_context_fn(policy_name))
            (y.float() ** 2).mean().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in m.parameters()])
    _assert_same(results[1], results[0])
    _assert_same(results[2], results[0])


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def test_other_dispatch_modes_still_see_the_weight_quantization():
    """Only torch's selective checkpoint modes are taken off the stack: a mode of the user's
    (an op counter, FlopCounterMode) sees the forward's weight quantization as without it."""
    counts = []
    for policy_name in (None, "amax"):
        torch.manual_seed(0)
        lin = hfp.Linear(64, 64, name="lin")
        x = torch.randn(32, 64, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _CountOps() as mode, hfp.autocast(recipe=hfp.Float8CurrentScaling()):
                if policy_name is None:
                    lin(x)
                else:
                    tc.checkpoint(lin, x, use_reentrant=False, context_fn=_context_fn(policy_name))
        counts.append(mode.counts)
    # the input's and the weight's amax
    assert counts[0][aten.amax.default] == 2
    assert counts[1][aten.amax.default] == counts[0][aten.amax.default]
    assert counts[1][aten.mm.default] == counts[0][aten.mm.default]


def test_mode_stack_is_the_same_after_a_module_call():
    """The modes taken off for the weight quantization are back, in their order, after the call
    (so the segment's later ops are saved as the policy says), and after an error too."""
    lin = hfp.Linear(32, 32, name="lin")
    seen = []

    def f(x):
        before = _get_current_dispatch_mode_stack()
        y = lin(x)
        seen.append((before, _get_current_dispatch_mode_stack()))
        return y

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # without early stop the recomputation runs on after the call's last saved tensor
        with tc.set_checkpoint_early_stop(False):
            with _CountOps():
                with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
                    y = tc.checkpoint(f, torch.randn(4, 32, requires_grad=True), use_reentrant=False,
                                      context_fn=_context_fn("amax"))
                y.sum().backward()
    assert len(seen) == 2  # the forward and the recomputation
    for before, after in seen:
        assert [type(m) for m in before] == [_CountOps, type(before[1])]
        assert isinstance(before[1], recompute.SAC_MODES)
        assert [id(m) for m in after] == [id(m) for m in before]

    caching = recompute.SAC_MODES[0](lambda *a, **k: CheckpointPolicy.MUST_SAVE, {})
    with _CountOps() as outer, caching:
        stack = _get_current_dispatch_mode_stack()
        with pytest.raises(ValueError, match="inside"):
            with recompute.hidden_from_selective_checkpoint():
                assert _get_current_dispatch_mode_stack() == [outer]
                raise ValueError("inside")
        assert _get_current_dispatch_mode_stack() == stack


def test_torch_selective_checkpoint_modes_are_found():
    """The two mode classes are read from torch.utils.checkpoint by name: a torch that renames
    them fails here rather than leave the weight quantization shown to selective checkpoint."""
    assert [c.__name__ for c in recompute.SAC_MODES] == ["_CachingTorchDispatchMode", "_CachedTorchDispatchMode"]


def _sr_input(role):
    return NVFP4Quantizer(stochastic_rounding=role is not None and role.tensor_type == "input")


def test_stochastic_forward_rounding_under_selective_checkpoint_is_refused():
    """As under a plain checkpoint (tests/nn/test_recompute_random_forward.py): a forward role
    that rounds stochastically is not replayed draw for draw."""
    m = hfp.Linear(64, 64, name="proj")
    x = torch.randn(16, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hfp.autocast(recipe=hfp.CustomRecipe(qfactory=_sr_input)):
            with pytest.raises(NotImplementedError, match="Linear proj: its input quantizer .* rounds stochastically"):
                tc.checkpoint(m, x, use_reentrant=False, context_fn=_context_fn("amax"))
