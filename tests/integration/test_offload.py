"""hybridfp.get_cpu_offload_context on the CPU (the same code path as on CUDA, synchronous):
gradients bitwise those without offload, the saved payloads really leave the layer (their
device tensors are dropped, bytes counted), parameters / marked weights / small tensors stay,
late reloads, several forwards before one backward, a forward that raises inside the context
(the next step as without offload), autograd's in-place check on every saved tensor (raised as
without offload, never where torch would not), and clear errors for bad arguments.

Offload copies bytes and backward reads the same bytes in the same layout, so the comparisons
are bitwise (tests/README.md)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridfp as hfp
from hybridfp.integration.offload import _Moved

RECIPES = {
    "mxfp8": lambda: hfp.MXFP8BlockScaling(),
    "delayed": lambda: hfp.DelayedScaling(amax_history_len=4),
    "nvfp4": lambda: hfp.NVFP4BlockScaling(),  # stochastic rounding on gradients
}
LAYERS = 4


class Layer(nn.Module):
    def __init__(self, d: int = 32, h: int = 64) -> None:
        super().__init__()
        self.fc1 = hfp.LayerNormLinear(d, h)
        self.fc2 = hfp.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def _model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer() for _ in range(LAYERS))


def _watch_moves(context) -> list:
    """The storage addresses of the tensors ``context`` moves to the host, as it saves them."""
    moved, original = [], context._pack

    def watching(t):
        out = original(t)
        if isinstance(out, _Moved):
            moved.append(t.untyped_storage().data_ptr())
        return out

    context._pack = watching
    return moved


def _forward(layers, x, context=None, sync=None):
    h = x
    for layer in layers:
        if context is None:
            h = layer(h)
        else:
            with context:
                h = layer(h)
            h = sync(h)
    return h


class _BadBatch(Exception):
    pass


def _failed_forward(layers, recipe_name: str, fail_at: int, context=None, sync=None):
    """A forward whose layer ``fail_at`` raises after running (a bad batch), caught as a training
    loop that skips the batch catches it. Returns its input, the failing layer's input and the
    context's pass then (None without offload)."""
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(99), requires_grad=True)
    seen = []

    def failing(h):
        seen.extend([h, context.iteration if context is not None else None])
        layers[fail_at](h)  # its activations are saved (and offloaded) before it raises
        raise _BadBatch

    torch.manual_seed(99)
    with hfp.autocast(recipe=RECIPES[recipe_name]()):
        with pytest.raises(_BadBatch):
            _forward(list(layers[:fail_at]) + [failing], x, context, sync)
    return x, seen[0], seen[1]


def _steps(recipe_name: str, offload: bool, steps: int = 2, thread: bool = False, fail_at=None):
    layers = _model()
    opt = torch.optim.SGD(layers.parameters(), lr=0.5)
    context, sync = hfp.get_cpu_offload_context(enabled=offload, num_layers=LAYERS - 1, model_layers=LAYERS,
                                                min_tensor_size_to_offload=256)
    if fail_at is not None:  # first a batch whose forward raises in layer fail_at, skipped
        _failed_forward(layers, recipe_name, fail_at, context if offload else None, sync)
        if offload:
            context.stats.reset()
    out = []
    for step in range(steps):
        x = torch.randn(48, 32, generator=torch.Generator().manual_seed(step), requires_grad=True)
        torch.manual_seed(10 + step)
        with hfp.autocast(recipe=RECIPES[recipe_name]()):
            loss = (_forward(layers, x, context if offload else None, sync).float() ** 2).mean()
        if thread:
            t = threading.Thread(target=loss.backward)
            t.start()
            t.join()
        else:
            loss.backward()
        out += [loss.detach(), x.grad] + [p.grad.clone() for p in layers.parameters()]
        opt.step()
        opt.zero_grad()
    return out, context


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_offload_gradients_are_bitwise(recipe_name):
    want, _ = _steps(recipe_name, offload=False)
    got, context = _steps(recipe_name, offload=True)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    s = context.stats
    assert s.offloaded_tensors > 0 and s.offloaded_bytes > 0
    assert (s.reloaded_tensors, s.reloaded_bytes) == (s.offloaded_tensors, s.offloaded_bytes)
    assert s.late_reloads == 0  # every reload was started ahead, by the schedule


@pytest.mark.parametrize("fail_at", [0, 2, LAYERS - 1])
@pytest.mark.parametrize("recipe_name", ["mxfp8", "delayed"])
def test_a_forward_that_raises_inside_the_context_leaves_it_usable(recipe_name, fail_at):
    """A forward raising inside the context (caught, the batch skipped) ends its pass: the next
    steps run as without offload (the same failed batch first), bit for bit, on the schedule
    (every reload started ahead), instead of every later entry blaming sync_function."""
    want, _ = _steps(recipe_name, offload=False, fail_at=fail_at)
    got, context = _steps(recipe_name, offload=True, fail_at=fail_at)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    s = context.stats
    assert s.offloaded_tensors > 0 and s.late_reloads == 0
    assert (s.reloaded_tensors, s.reloaded_bytes) == (s.offloaded_tensors, s.offloaded_bytes)


def test_a_failed_pass_finishes_its_offloads_and_is_released():
    """The failed pass's offloads are finished (a partial graph kept alive holds host copies; its
    backward still gives the gradients without offload), and the pass is freed with its graph."""
    def run(offload: bool):
        layers = _model()
        context, sync = hfp.get_cpu_offload_context(enabled=offload, num_layers=2, model_layers=LAYERS,
                                                    min_tensor_size_to_offload=256)
        x, h, failed = _failed_forward(layers, "mxfp8", 2, context if offload else None, sync)
        if offload:  # layer 1's offload was due when layer 3 started: the failure finished it
            assert context.iteration is None and sorted(failed.groups) == [0, 1]
            assert all(m.device_tensor is None for g in failed.groups.values() for m in g.moved)
        h.square().sum().backward()  # the layers before the failing one, from the partial graph
        return [x.grad] + [p.grad for p in layers[:2].parameters()], weakref.ref(failed) if offload else None

    got, failed = run(True)
    for a, b in zip(got, run(False)[0]):
        assert torch.equal(a, b)
    del got
    gc.collect()
    assert failed() is None


def test_offload_backward_on_another_thread_is_bitwise():
    want, _ = _steps("mxfp8", offload=False, steps=1)
    got, _ = _steps("mxfp8", offload=True, steps=1, thread=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class _Save(torch.autograd.Function):
    """y = x * 2, saving x (so the test can watch x's lifetime)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return dy * 2 + x * 0


def test_offloaded_tensors_leave_the_device_when_their_offload_finishes():
    """Layer 0's saved activation is dropped when layer model_layers - num_layers starts (only the
    host copy is left), and backward gets the same values back."""
    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3,
                                                min_tensor_size_to_offload=1)
    x = torch.randn(64, 8, requires_grad=True)
    refs = []
    h = x
    for i in range(3):
        with context:
            a = h.sin()  # a fresh activation, saved by _Save
            refs.append(weakref.ref(a))
            h = _Save.apply(a)
        del a
        h = sync(h)
        gc.collect()
        if i == 1:
            assert refs[0]() is not None  # its offload finishes when layer 3 - 1 + 0 = 2 starts
        if i == 2:
            assert refs[0]() is None  # only the host copy is left
    assert refs[1]() is not None and refs[2]() is not None  # layers 1, 2: not offloaded
    assert context.stats.offloaded_tensors == 1 and context.stats.offloaded_bytes == 64 * 8 * 4
    h.sum().backward()
    x2 = x.detach().clone().requires_grad_()  # the same graph without offload
    h2 = x2
    for _ in range(3):
        h2 = _Save.apply(h2.sin())
    h2.sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_quantized_payloads_move_as_they_are_and_weights_stay():
    """A hybridfp Linear saves its input's columnwise copy (codes and scales: moved as bytes of
    their own dtypes) and its weight's copy (held by the weight cache: kept)."""
    seen = []
    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                                min_tensor_size_to_offload=1)
    original = context._pack

    def watching(t):
        out = original(t)
        seen.append((t.dtype, out is t))
        return out

    context._pack = watching
    lin, lin2 = hfp.Linear(64, 64), hfp.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    with hfp.autocast(recipe=hfp.Float8CurrentScaling()):
        with context:
            h = lin(x)
        h = sync(h)
        with context:
            y = lin2(h)
        y = sync(y)
    moved = [dtype for dtype, kept in seen if not kept]
    assert torch.float8_e4m3fn in moved  # the input's FP8 codes, not a dequantized copy
    assert context.stats.kept_tensors > 0  # the weight's payloads (marked by the weight cache)
    w_payloads = lin._wcache[0].qw.qstorage.tensors()
    assert all(getattr(t, "_hybridfp_not_offloaded", False) for t in w_payloads)
    y.sum().backward()


def test_quantized_weight_parameters_stay_in_place():
    """A quantized_model_init weight is saved for dgrad as the parameter's own payload tensors:
    they stay (the parameter holds them; moving them frees nothing), only the input's copy moves,
    and the gradients are bitwise those without offload."""
    def run(offload: bool):
        torch.manual_seed(0)
        with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
            layers = nn.ModuleList([hfp.Linear(64, 64), hfp.Linear(64, 64)])
        context, sync = hfp.get_cpu_offload_context(enabled=offload, num_layers=1, model_layers=2,
                                                    min_tensor_size_to_offload=1)
        moved = _watch_moves(context) if offload else []
        x = torch.randn(32, 64, requires_grad=True)
        with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
            h = _forward(layers, x, context, sync) if offload else _forward(layers, x)
        h.sum().backward()
        weight_ptrs = {t.untyped_storage().data_ptr() for t in layers[0].weight.qstorage.tensors()}
        return moved, weight_ptrs, [x.grad] + [layer.weight.grad for layer in layers]

    moved, weight_ptrs, grads = run(True)
    assert moved and not weight_ptrs & set(moved)
    for u, v in zip(grads, run(False)[2]):
        assert torch.equal(u, v)


def test_quantized_weights_of_every_module_in_one_entry_stay_in_place():
    """Two top-level layers called inside one context entry: both layers' quantized weight
    payloads stay in place (not only the first module called's), the activations move."""
    torch.manual_seed(0)
    with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
        a, b = hfp.Linear(64, 64), hfp.Linear(64, 64)
    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                                min_tensor_size_to_offload=1)
    moved = _watch_moves(context)
    x = torch.randn(32, 64, requires_grad=True)
    with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
        with context:
            h = b(a(x))
        h = sync(h)
        with context:
            y = a(h)
        y = sync(y)
    y.sum().backward()
    weights = {t.untyped_storage().data_ptr() for m in (a, b) for t in m.weight.qstorage.tensors()}
    assert moved and not weights & set(moved)


def test_quantized_expert_weights_of_a_grouped_linear_stay_in_place():
    """A GroupedLinear built in quantized_model_init saves its experts' quantized parameters'
    payloads for dgrad: they stay in place, the activations move."""
    torch.manual_seed(0)
    with hfp.quantized_model_init(recipe=hfp.Float8BlockScaling()):
        experts = [hfp.GroupedLinear(2, 128, 128, bias=False) for _ in range(2)]
    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                                min_tensor_size_to_offload=1)
    moved = _watch_moves(context)
    x = torch.randn(128, 128, requires_grad=True)
    with hfp.autocast(recipe=hfp.Float8BlockScaling()):
        h = x
        for layer in experts:
            with context:
                h = layer(h, [64, 64])
            h = sync(h)
    h.sum().backward()
    weights = {t.untyped_storage().data_ptr() for m in experts for w in m.parameters()
               if isinstance(w, hfp.QuantizedTensor) for t in w.qstorage.tensors()}
    assert weights and moved and not weights & set(moved)


def _compiled_steps(offload: bool, quantized: bool, in_place: bool, steps: int = 3):
    """Training steps of a layer compiled in place (``in_place``) or called by a compiled
    function, each call inside the offload context: the frames compiled, the gradients, the
    storages of what moved and of the quantized weight's payloads."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    if quantized:
        with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
            layer = hfp.Linear(64, 64)
    else:
        layer = nn.Sequential(nn.Linear(64, 64), nn.GELU())
    if in_place:
        layer.compile(backend=counting)
        step = lambda m, h: m(h)  # noqa: E731
    else:
        step = torch.compile(lambda m, h: m(h), backend=counting)
    context, sync = hfp.get_cpu_offload_context(enabled=offload, num_layers=3, model_layers=4,
                                                min_tensor_size_to_offload=1)
    moved = _watch_moves(context) if offload else []
    grads = []
    for i in range(steps):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i), requires_grad=True)
        with hfp.autocast(recipe=hfp.MXFP8BlockScaling(), enabled=quantized):
            h = x
            for _ in range(4):  # the same layer four times: one compiled frame serves every call
                with context:
                    h = step(layer, h)
                h = sync(h)
        h.square().sum().backward()
        grads += [x.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
    weights = {t.untyped_storage().data_ptr() for w in layer.parameters()
               if isinstance(w, hfp.QuantizedTensor) for t in w.qstorage.tensors()}
    torch._dynamo.reset()
    return len(graphs), grads, moved, weights


@pytest.mark.parametrize("in_place", [False, True], ids=["compiled_caller", "compiled_in_place"])
@pytest.mark.parametrize("quantized", [False, True], ids=["torch_linear", "quantized_weight"])
def test_compiled_layers_compile_once_over_many_entries(quantized, in_place):
    """A layer called by a compiled function, or compiled in place, inside the context entered
    twelve times: it compiles as often as without offload (no process-wide hook per entry,
    which torch.compile guards on; the saved-tensor hooks are never traced), the gradients are
    bitwise those without offload, and a quantized weight parameter's payloads stay in place."""
    graphs, grads, moved, weights = _compiled_steps(True, quantized, in_place)
    want_graphs, want, _, _ = _compiled_steps(False, quantized, in_place)
    assert graphs == want_graphs <= 1
    assert moved and not weights & set(moved)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


def test_views_of_marked_tensors_stay_in_place():
    """A saved view of a tensor marked with mark_not_offload stays (its base is held anyway);
    an unmarked one moves."""
    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                                min_tensor_size_to_offload=1)
    x = torch.randn(64, 8, requires_grad=True)
    held, free = x * 2, x * 3
    hfp.mark_not_offload(held)
    with context:
        h = _Save.apply(held[8:]) + _Save.apply(free[8:])  # dense views: offloadable as they are
    h = sync(h)
    with context:
        y = h * 1
    sync(y).sum().backward()
    assert context.stats.offloaded_tensors == 1 and context.stats.kept_tensors == 1


def test_parameters_and_small_tensors_stay_in_place():
    lin = nn.Linear(64, 64)  # F.linear saves the weight Parameter and the input
    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    x = torch.randn(8, 64, requires_grad=True)
    with context:
        h = lin(x * 1)  # a non-leaf input of 512 elements: below TE's default 2**20
    h = sync(h)
    with context:
        y = lin(h)
    sync(y).sum().backward()
    assert context.stats.offloaded_tensors == 0 and context.stats.kept_tensors == 2

    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                                min_tensor_size_to_offload=0)
    with context:
        h = lin(x * 1)
    h = sync(h)
    # the input moves; the weight (saved by addmm as weight.t(), a view of the Parameter) stays
    assert context.stats.offloaded_tensors == 1 and context.stats.kept_tensors == 1


class _WritesItsInput(nn.Module):
    """sigmoid(linear(x)), doubling x in place first if ``write``: x is the previous layer's
    output, which its sigmoid saved for backward (a bug autograd reports in backward)."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.lin, self.write = nn.Linear(32, 32), write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            x.mul_(2)
        return torch.sigmoid(self.lin(x))


@pytest.mark.parametrize("num_layers,model_layers,min_size,write_at", [
    (2, 3, 1, 1),  # layer 0's output offloaded, its device tensor dropped (layer 1 started), then written
    (2, 4, 1, 1),  # written, then its offload finished (when layer 2 started)
    (2, 5, 1, 1),  # written, its offload never finished (a pass of 3 of 5 layers): the device tensor
    (1, 3, 1, 2),  # layer 1's output: a layer that offloads nothing
    (2, 3, 10**6, 1),  # too small to move: kept in place in a layer that offloads
    (2, 3, 1, "weight"),  # a parameter (saved by addmm as weight.t()) written before backward
], ids=["offloaded_then_written", "written_then_offloaded", "offload_unfinished", "layer_not_offloaded",
        "kept_small", "parameter"])
def test_a_saved_tensor_written_in_place_raises_as_without_offload(num_layers, model_layers, min_size, write_at):
    """Saved-tensor hooks turn off autograd's check that a saved tensor is not modified in place
    before backward reads it; the context checks it itself, offloaded tensors included (the
    write would otherwise be silently lost on the host copy), and raises torch's error."""
    def run(offload: bool):
        torch.manual_seed(0)
        layers = [_WritesItsInput(i == write_at) for i in range(3)]
        context, sync = hfp.get_cpu_offload_context(enabled=offload, num_layers=num_layers,
                                                    model_layers=model_layers, min_tensor_size_to_offload=min_size)
        x = torch.randn(8, 32, requires_grad=True)
        h = _forward(layers, x, context if offload else None, sync)
        if write_at == "weight":
            with torch.no_grad():
                layers[0].lin.weight.mul_(2)  # an optimizer step before the backward
        h.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(False)
    with pytest.raises(RuntimeError, match="hybridfp CPU offload: one of the variables needed for gradient "
                                           "computation has been modified by an inplace operation"):
        run(True)


class _Legit(nn.Module):
    """Saves what a layer legitimately saves: a parameter (and a view of it), a tensor written
    in place before it is saved, one tensor saved twice by one op, a tensor saved, written in
    place and saved again (the first save unused by the loss, so never read), a dense view and
    the output of an in-place op."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # addmm saves x and weight.t()
        h.add_(1)  # written before anything saves it
        a = h * h  # h saved twice (one copy)
        a.sin()  # a saved; this output is unused, so backward never reads that save...
        a.mul_(0.5)  # ...and a may be written after it
        b = a.sin()  # a saved again at its new version (a copy of its own, of the new values)
        v = a[8:].cos()  # a dense view
        return torch.cat([b[:8], b[8:] + v]).sigmoid_()  # sigmoid_ saves its output (written by itself)


def test_legitimate_saves_do_not_raise_and_stay_bitwise():
    """No false positive of the in-place check: the saves of _Legit, in layers that offload and
    one that does not, inside torch's checkpoint (both modes) in the context, and a second
    backward of the same graph (retain_graph=True); the gradients are bitwise those without
    offload."""
    def run(offload: bool):
        torch.manual_seed(0)
        layers = nn.ModuleList(_Legit() for _ in range(4))
        context, sync = hfp.get_cpu_offload_context(enabled=offload, num_layers=3, model_layers=4,
                                                    min_tensor_size_to_offload=1)
        calls = [layers[0], lambda h: hfp.checkpoint(layers[1], h),
                 lambda h: torch.utils.checkpoint.checkpoint(layers[2], h, use_reentrant=True), layers[3]]
        x = torch.randn(24, 32, requires_grad=True)
        loss = _forward(calls, x, context if offload else None, sync).square().sum()
        loss.backward(retain_graph=True)
        grads = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
        loss.backward()
        return grads + [x.grad] + [p.grad for p in layers.parameters()], context

    got, context = run(True)
    want, _ = run(False)
    assert context.stats.offloaded_tensors > 0 and context.stats.kept_tensors > 0
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_late_reload_and_unfinished_offload_are_still_bitwise():
    """A layer whose output skips sync_function's hook is reloaded when needed (late); a pass
    shorter than model_layers never finishes its offloads (the tensors never left)."""
    def run(offload: str):
        torch.manual_seed(0)
        layers = [hfp.Linear(32, 32) for _ in range(3)]
        x = torch.randn(16, 32, requires_grad=True)
        model_layers = 3 if offload == "late" else 5
        context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=model_layers,
                                                    min_tensor_size_to_offload=1)
        with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
            h = x
            for layer in layers:
                with context:
                    h = layer(h)
                sync(h * 1)  # the hook goes on a tensor the loss does not use
        h.sum().backward()
        return x.grad, context.stats

    torch.manual_seed(0)
    layers = [hfp.Linear(32, 32) for _ in range(3)]
    x = torch.randn(16, 32, requires_grad=True)
    with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
        h = x
        for layer in layers:
            h = layer(h)
    h.sum().backward()
    late, s_late = run("late")
    unfinished, s_unfinished = run("unfinished")
    assert torch.equal(late, x.grad) and torch.equal(unfinished, x.grad)
    assert s_late.late_reloads == s_late.offloaded_tensors > 0
    assert s_unfinished.reloaded_tensors == 0 < s_unfinished.offloaded_tensors


def test_two_forwards_before_one_backward():
    """Each pass of model_layers layers is its own iteration, held by its graph."""
    def run(offload: bool):
        layers = _model()
        context, sync = hfp.get_cpu_offload_context(enabled=offload, num_layers=2, model_layers=LAYERS,
                                                    min_tensor_size_to_offload=1)
        losses = []
        for step in range(2):
            x = torch.randn(48, 32, generator=torch.Generator().manual_seed(step))
            with hfp.autocast(recipe=hfp.MXFP8BlockScaling()):
                losses.append(_forward(layers, x, context if offload else None, sync).square().mean())
        (losses[0] + losses[1]).backward()
        return [p.grad for p in layers.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(enabled=1), TypeError, "enabled must be a bool"),
    (dict(enabled=True, num_layers=1.0, model_layers=2), TypeError, "num_layers must be an int"),
    (dict(enabled=True, num_layers=2, model_layers=2), ValueError, "num_layers=2 with model_layers=2"),
    (dict(enabled=True, num_layers=-1, model_layers=2), ValueError, "num_layers=-1"),
    (dict(enabled=True, num_layers=0, model_layers=0), ValueError, "model_layers=0"),
    (dict(enabled=True, num_layers=1, model_layers=2, offload_activations=False), ValueError,
     "offload_activations=False"),
    (dict(enabled=True, num_layers=1, model_layers=2, offload_weights=True), ValueError, "offload_weights=True"),
    (dict(enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=-1), ValueError,
     "min_tensor_size_to_offload=-1"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        hfp.get_cpu_offload_context(**kwargs)


def test_misuse_is_refused():
    context, sync = hfp.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    with pytest.raises(RuntimeError, match="before the context was entered"):
        sync(torch.zeros(1))
    with context:
        with pytest.raises(RuntimeError, match="already entered"):
            context.__enter__()
        with pytest.raises(RuntimeError, match="inside the context"):
            sync(torch.zeros(1))
    with pytest.raises(RuntimeError, match="before sync_function was called"):
        with context:
            pass
    with pytest.raises(TypeError, match="layer's output tensor"):
        sync([1])


def test_disabled_is_a_no_op():
    context, sync = hfp.get_cpu_offload_context(enabled=False)
    t = torch.zeros(2)
    with context:
        pass
    assert sync(t) is t
