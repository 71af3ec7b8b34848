"""A cached quantized weight is never served after FSDP2 gathered new values into its weight.

FSDP2 all-gathers a high-precision weight into the same unsharded Parameter at every unshard
and keeps its version counter, while the optimizer steps (and a load writes) the sharded
Parameter. A cache entry that outlives its autocast region (``hybridfp.weight_caching()``,
``is_first_microbatch``) matches that Parameter by identity and version counter, so without
more it served the codes of the shard's previous values. Two gloo ranks on the CPU check, for
a plain ``fully_shard`` model, a 2-D (dp, tp) mesh with hybridfp's tensor-parallel styles (FSDP2
over two ranks, and over one rank where it copies instead of gathering) and the quantized
all-gather:

- a ``weight_caching()`` scope spanning an optimizer step (SGD, which moves the shard's version
  counter, and a foreach and a fused Adam, which do not) or a load of the shards: the region
  after it computes what a fresh quantization computes, bitwise (current scaling: a
  quantization is a function of the values alone), and differs from the region before;
- ``is_first_microbatch=False`` after a step raises, naming the in-place change;
- without a step the entry is reused across the scope's regions and by
  ``is_first_microbatch=False``, although FSDP2 gathered the weight again for each region;
- a frozen layer keeps its copy across a step; a write through the shard's local tensor is
  seen; a watched model moves to another dtype (no weak reference to a Parameter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

D, ROWS = 64, 16
KINDS = ("plain", "tp_dp2", "tp_tp2", "quantized_gather")
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True),
}


def _build(kind: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(hf.Linear(D, D, bias=False), nn.GELU(), hf.Linear(D, D, bias=False))
    kwargs: dict = {}
    if kind.startswith("tp_"):
        mesh = init_device_mesh("cpu", (2, 1) if kind == "tp_dp2" else (1, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(model, mesh["tp"], {"0": hf.ColwiseParallel(), "2": hf.RowwiseParallel()})
        kwargs["mesh"] = mesh["dp"]
    if kind == "quantized_gather":
        assert hf.enable_quantized_all_gather(model) == 2
    for layer in (model[0], model[2]):
        fully_shard(layer, **kwargs)  # resharded after forward: gathered again for every region
    fully_shard(model, **kwargs)
    return model


def _forward(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with hf.autocast(recipe=hf.Float8CurrentScaling()):
        if not kwargs:
            return model(x)
        return model[2](model[1](model[0](x, **kwargs)), **kwargs)  # the layers' own arguments


def _fresh(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output with the weights quantized anew (a region outside any scope)."""
    with torch.no_grad():
        return _forward(model, x)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    y = _forward(model, x, **kwargs)
    y.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return y.detach()


def _tensors(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _worker(rank: int, world: int) -> dict:
    x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for kind in KINDS:
        res = out[kind] = {}
        for name, make in OPTIMIZERS.items():
            model = _build(kind)
            opt = make(model.parameters())
            with hf.weight_caching():
                before = _step(model, opt, x)
                with torch.no_grad():
                    after = _forward(model, x)
            fresh = _fresh(model, x)
            res[f"step_{name}"] = [torch.equal(after, fresh), not torch.equal(before, fresh)]

        model = _build(kind)
        opt = OPTIMIZERS["sgd"](model.parameters())
        saved = _tensors(model)
        _step(model, opt, x)
        with hf.weight_caching():
            with torch.no_grad():
                stepped = _forward(model, x)
            model.load_state_dict(saved, strict=False)  # the shards as before the step
            with torch.no_grad():
                loaded = _forward(model, x)
        fresh = _fresh(model, x)
        res["load"] = [torch.equal(loaded, fresh), not torch.equal(stepped, fresh)]
        if kind == "quantized_gather":
            continue  # the module reads the gathered QuantizedTensor: nothing is cached

        # without a step: the scope's later regions reuse the entry (FSDP2 gathered again)
        model = _build(kind)
        opt = OPTIMIZERS["sgd"](model.parameters())
        with hf.weight_caching():
            _forward(model, x).float().sum().backward()
            entry = model[0]._wcache[0]
            with torch.no_grad():
                _forward(model, x)
            res["reused_in_scope"] = model[0]._wcache[0] is entry
        opt.zero_grad()

        # is_first_microbatch: reused within a step, refused after one
        _forward(model, x, is_first_microbatch=True).float().sum().backward()
        entry = model[0]._wcache[0]
        _forward(model, x, is_first_microbatch=False).float().sum().backward()
        res["reused_microbatch"] = model[0]._wcache[0] is entry
        opt.step()
        opt.zero_grad()
        try:
            with torch.no_grad():
                _forward(model, x, is_first_microbatch=False)
            res["after_step"] = "reused"
        except RuntimeError as e:
            res["after_step"] = str(e)

        # a frozen first layer (no gradients: the step leaves it as it was) keeps its copy
        model = _build(kind)
        for p in model[0].parameters():
            p.requires_grad_(False)
        opt = OPTIMIZERS["adam_foreach"](model.parameters())
        _step(model, opt, x, is_first_microbatch=True)
        try:
            with torch.no_grad(), hf.autocast(recipe=hf.Float8CurrentScaling()):
                # the frozen layer reuses its copy; the stepped one quantizes anew
                model[2](model[1](model[0](x, is_first_microbatch=False)), is_first_microbatch=True)
            res["frozen_kept"] = True
        except RuntimeError as e:
            res["frozen_kept"] = str(e)

        # a write through the shard's local tensor, inside a scope
        model = _build(kind)
        with hf.weight_caching():
            with torch.no_grad():
                before = _forward(model, x)
                model[0].weight.to_local().mul_(2)
                written = _forward(model, x)
        res["local_write"] = [torch.equal(written, _fresh(model, x)), not torch.equal(before, written)]

        # a watched model moves to another dtype (Module.to swaps DTensor parameters, which
        # swap_tensors refuses for a tensor with a weak reference)
        try:
            model.to(torch.float32)
            res["moved"] = True
        except RuntimeError as e:
            res["moved"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_worker, 2, (), tmp_path_factory.mktemp("fsdp2_weight_caching"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_scope_spanning_a_step_quantizes_the_stepped_weight(results: list[dict], kind: str, optimizer: str) -> None:
    for rank, res in enumerate(results):
        fresh, moved = res[kind][f"step_{optimizer}"]
        assert moved, f"rank {rank}: the step left the output as it was; the check proves nothing"
        assert fresh, f"rank {rank}: the region after the step served the weight quantized before it"


@pytest.mark.parametrize("kind", KINDS)
def test_scope_spanning_a_load_quantizes_the_loaded_weight(results: list[dict], kind: str) -> None:
    for rank, res in enumerate(results):
        fresh, moved = res[kind]["load"]
        assert moved, f"rank {rank}: the load left the output as it was; the check proves nothing"
        assert fresh, f"rank {rank}: the region after the load served the weight quantized before it"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "quantized_gather"])
def test_unchanged_shards_gathered_again_reuse_the_entry(results: list[dict], kind: str) -> None:
    for rank, res in enumerate(results):
        assert res[kind]["reused_in_scope"], f"rank {rank}: weight_caching() quantized again without a step"
        assert res[kind]["reused_microbatch"], f"rank {rank}: is_first_microbatch=False quantized again"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "quantized_gather"])
def test_is_first_microbatch_false_after_a_step_raises(results: list[dict], kind: str) -> None:
    for rank, res in enumerate(results):
        assert "changed in place since the kept weight was quantized" in res[kind]["after_step"], (
            f"rank {rank}: {res[kind]['after_step']}")


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "quantized_gather"])
def test_a_frozen_layer_keeps_its_copy_across_a_step(results: list[dict], kind: str) -> None:
    for rank, res in enumerate(results):
        assert res[kind]["frozen_kept"] is True, f"rank {rank}: {res[kind]['frozen_kept']}"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "quantized_gather"])
def test_a_write_through_the_local_shard_is_seen(results: list[dict], kind: str) -> None:
    for rank, res in enumerate(results):
        fresh, moved = res[kind]["local_write"]
        assert moved, f"rank {rank}: the write left the output as it was; the check proves nothing"
        assert fresh, f"rank {rank}: the region after the write served the weight quantized before it"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "quantized_gather"])
def test_a_watched_model_can_move(results: list[dict], kind: str) -> None:
    for rank, res in enumerate(results):
        assert res[kind]["moved"] is True, f"rank {rank}: {res[kind]['moved']}"
