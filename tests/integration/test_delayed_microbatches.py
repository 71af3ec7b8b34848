"""Several autocast regions per optimizer step (gradient accumulation) with delayed scaling.

A quantized primary weight (``quantized_model_init``) holds the one encoding made when its
master is re-quantized at the optimizer step; ``hybridfp.weight_caching()`` makes a
high-precision weight the same: quantized at its first region of the step, reused by the later
ones across delayed scaling's scale updates, no weight amax recorded there. k regions per step,
N steps: the two runs are bitwise equal (losses, masters, quantizer state, the next forward)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hfp
from hybridfp.factories import per_gemm
from master_cases import RECIPES, ROWS, D, build, quantized_weights

STEPS, MICRO = 3, 3
CASES = {
    "delayed": RECIPES["delayed"],
    "delayed_most_recent": lambda: hfp.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent"),
    # a delayed-scaling weight beside stateless input / gradient formats
    "delayed_weight_hybrid": lambda: hfp.CustomRecipe(qfactory=lambda role: (
        hfp.Float8Quantizer(amax_history_len=2) if role is not None and role.tensor_type == "weight"
        else per_gemm("mxfp8", "mxfp8", "fp8_block")(role))),
    "mxfp8": RECIPES["mxfp8"],  # stateless: the scope changes nothing
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _data() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    # scaled per micro-batch so that each region moves the activations' amaxes
    return [[torch.randn(ROWS, D, generator=g) * (1 + i) for i in range(MICRO)] for _ in range(STEPS)]


def _train(model, opt, recipe, data, scoped: bool) -> list[torch.Tensor]:
    losses = []
    for micro in data:
        with hfp.weight_caching(enabled=scoped):
            for x in micro:
                with hfp.autocast(recipe=recipe):
                    loss = model(x).square().mean() / MICRO
                loss.backward()
                losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def _states(model) -> dict:
    return {n: m.get_extra_state() for n, m in model.named_modules() if isinstance(m, hfp.nn.QuantizedModule)}


def _assert_same_states(a: dict, b: dict) -> None:
    for n, sa in a.items():
        for k, qa in sa["quantizers"].items():
            for f, v in qa["state"].items():
                w = b[n]["quantizers"][k]["state"][f]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (n, k, f)


@pytest.mark.parametrize("name", list(CASES))
def test_micro_batch_regions_train_bitwise_as_quantized_primary_weights(name):
    recipe_hp, recipe_q = CASES[name](), CASES[name]()
    hp, q = build(recipe_hp, quantized=False), build(recipe_q, quantized=True)
    assert len(quantized_weights(q)) == 4
    opt_hp = torch.optim.AdamW(hp.parameters(), lr=1e-2, weight_decay=0.1)
    opt_q = hfp.MasterWeightOptimizer(torch.optim.AdamW, q.parameters(), lr=1e-2, weight_decay=0.1)
    data = _data()
    torch.manual_seed(5)
    losses_hp = _train(hp, opt_hp, recipe_hp, data, scoped=True)
    torch.manual_seed(5)
    losses_q = _train(q, opt_q, recipe_q, data, scoped=False)  # a held weight needs no scope
    for i, (a, b) in enumerate(zip(losses_hp, losses_q)):
        assert torch.equal(a, b), f"{name}: loss of region {i} differs: {a.item()} vs {b.item()}"
    hp_params = dict(hp.named_parameters())
    for n, p in q.named_parameters():
        master = opt_q.master_of(p)
        assert torch.equal(master if master is not None else p, hp_params[n]), n
    x = _data()[0][0]
    with torch.no_grad(), hfp.weight_caching(), hfp.autocast(recipe=recipe_hp):
        y_hp = hp(x)
    with torch.no_grad(), hfp.autocast(recipe=recipe_q):
        y_q = q(x)
    assert torch.equal(y_hp, y_q)
    # the held weights recorded their amax when re-quantized, the FP32 weights in this forward:
    # both committed at its region's end
    _assert_same_states(_states(hp), _states(q))


def test_grouped_linear_experts_alike():
    """GroupedLinear's experts (quantized together, cached as one entry) follow the same rule."""
    splits = [0, 19, ROWS - 19]

    def build_experts(recipe, quantized):
        torch.manual_seed(0)
        with hfp.quantized_model_init(enabled=quantized, recipe=recipe, preserve_high_precision_init_val=True):
            return hfp.GroupedLinear(3, D, D // 2)

    def train(m, opt, recipe, scoped):
        losses = []
        for micro in _data():
            with hfp.weight_caching(enabled=scoped):
                for x in micro:
                    with hfp.autocast(recipe=recipe):
                        loss = m(x, splits).square().mean() / MICRO
                    loss.backward()
                    losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses

    recipe_hp, recipe_q = hfp.DelayedScaling(amax_history_len=4), hfp.DelayedScaling(amax_history_len=4)
    hp, q = build_experts(recipe_hp, False), build_experts(recipe_q, True)
    losses_hp = train(hp, torch.optim.AdamW(hp.parameters(), lr=1e-2), recipe_hp, scoped=True)
    opt_q = hfp.MasterWeightOptimizer(torch.optim.AdamW, q.parameters(), lr=1e-2)
    losses_q = train(q, opt_q, recipe_q, scoped=False)
    for i, (a, b) in enumerate(zip(losses_hp, losses_q)):
        assert torch.equal(a, b), f"loss of region {i} differs: {a.item()} vs {b.item()}"
    for n, p in q.named_parameters():
        master = opt_q.master_of(p)
        assert torch.equal(master if master is not None else p, dict(hp.named_parameters())[n]), n


def test_weight_quantized_once_per_step_inside_the_scope():
    """Delayed scaling's weight quantizer records one amax per step inside the scope (one
    update), one per region without it; an in-place optimizer step inside the scope is seen."""
    recipe = hfp.DelayedScaling(amax_history_len=4)
    lin = hfp.Linear(D, D)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def updates() -> int:
        return lin.get_extra_state()["quantizers"]["weight.0"]["state"]["updates"]

    def region() -> None:
        with hfp.autocast(recipe=recipe):
            y = lin(torch.randn(ROWS, D))
        y.square().mean().backward()

    with hfp.weight_caching():
        for _ in range(MICRO):
            region()
        assert updates() == 1
        opt.step()  # the version counter moves: the next region quantizes anew
        region()
        region()
        assert updates() == 2
    for _ in range(2):
        region()
    assert updates() == 4


def test_is_first_microbatch_false_is_accepted_across_updates_inside_the_scope():
    recipe = hfp.DelayedScaling()
    lin = hfp.Linear(D, D)
    x = torch.randn(ROWS, D)
    with torch.no_grad():
        with hfp.weight_caching():
            with hfp.autocast(recipe=recipe):
                lin(x, is_first_microbatch=True)
            with hfp.autocast(recipe=recipe):
                lin(x, is_first_microbatch=False)  # the weight's scale moved: the copy serves
        assert lin.get_extra_state()["quantizers"]["weight.0"]["state"]["updates"] == 1
        with hfp.autocast(recipe=recipe), pytest.raises(RuntimeError, match="weight_caching"):
            lin(x, is_first_microbatch=False)  # outside the scope the update expires the copy


def test_checkpoint_replay_after_the_scope_reads_the_served_weight():
    """A region the scope served, checkpointed and run backward after the scope ended,
    recomputes with the weight its forward read: gradients bitwise those without checkpoint."""
    recipe_a, recipe_b = hfp.DelayedScaling(amax_history_len=4), hfp.DelayedScaling(amax_history_len=4)
    a, b = build(recipe_a, quantized=False), build(recipe_b, quantized=False)
    data = _data()[0]

    def run(model, recipe, ckpt: bool) -> None:
        with hfp.weight_caching():
            ys = []
            for x in data:
                with hfp.autocast(recipe=recipe):
                    ys.append(torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) if ckpt else model(x))
            ys[0].square().mean().backward()
        for y in ys[1:]:  # after the scope (and after the regions' scale updates)
            y.square().mean().backward()

    run(a, recipe_a, ckpt=False)
    run(b, recipe_b, ckpt=True)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), n
