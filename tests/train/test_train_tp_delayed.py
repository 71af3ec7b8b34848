"""``hybridfp train --tp K`` with FP8 delayed scaling: every rank holds one process's scales.

A rank records the amax of its shard of a weight (and of a column-parallel output gradient,
split along its features) and of its data-parallel rows; the model all-reduces (MAX) its
stateful quantizers' pending amaxes over every rank at the end of each forward, inside the
autocast region, so the region's end updates every rank's scales from the whole tensors'
amaxes. Checked here on the quantizer states themselves: after a training step and the next
forward (which commits the step's gradient amaxes) every rank's amax histories and scales
are bitwise the same (a rank's own rows or shard would give it its own amaxes), and they are one
process's on the global batch: the inputs' and weights' within 1 % (the activations may round
differently after a row-parallel GEMM's FP32 sum, ``test_train_tp``; bitwise equal were seen),
the output gradients' within 5 % (2.5 % seen): the first backward quantizes dy with the initial
scale 1, where E5M2 keeps small gradients as subnormals, and a data-parallel rank's dy is
twice one process's (its loss is the mean over half the rows), one more bit kept; the earlier
layers' gradients differ by that rounding. The losses of whole runs (and resuming one bitwise)
are checked in ``test_train_tp_resume``.
"""

from __future__ import annotations

import pytest
import torch

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

B, T = 8, 32


def _model_and_batch():
    from hybridfp.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, mlp_hidden=128, block_size=T, vocab_size=96),
                torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 96, (B, T), generator=g)
    return model, x, torch.roll(x, -1, 1)


def _two_steps(model, x, y, group) -> list[list]:
    """A training step and the next forward under delayed scaling; each quantizer's slot, amax
    history and scale."""
    import hybridfp as hf
    from hybridfp.train.tensor_parallel import stateful_quantizers

    recipe = hf.DelayedScaling(amax_history_len=4)
    with hf.autocast(recipe=recipe, amax_reduction_group=group):
        _, loss = model(x, y)
    loss.backward()
    with hf.autocast(recipe=recipe, amax_reduction_group=group):
        model(x, y)
    return [[q.role.tensor_type, *q.amax_history.tolist(), q.scale.item()] for q in stateful_quantizers(model)]


def _ranks_fn(rank: int, world: int) -> list[list]:
    import os

    import hybridfp as hf
    from hybridfp.train.distributed import init_parallel, shard_model
    from hybridfp.train.loop import amax_group

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    par = init_parallel("cpu", fsdp=False, ep=1, n_experts=0, tp=2, n_head=2)
    model, x, y = _model_and_batch()
    shard_model(model, par, hf.DelayedScaling())
    rows = par.rows(B)
    return _two_steps(model, x[rows], y[rows], amax_group(model, hf.DelayedScaling(), par))


def test_tensor_parallel_delayed_scaling_shares_one_process_scales(tmp_path) -> None:
    """(dp=2, tp=2) on 4 ranks against one process on the global batch. A rank's loss is the
    mean over its half of the rows (the trainer averages the gradients over dp afterwards), so
    its output gradients, their amaxes, are twice one process's and their scales half: the
    same FP8 codes (a power-of-two factor)."""
    model, x, y = _model_and_batch()
    want = _two_steps(model, x, y, None)
    got = run_ranks(_ranks_fn, 4, (), tmp_path)
    assert all(g == got[0] for g in got[1:])  # one scale on every rank, bitwise
    assert [g[0] for g in got[0]] == [w[0] for w in want]
    assert len(want) >= 5 * 3  # every hybridfp linear's three slots
    for g, w in zip(got[0], want):
        dp, rtol = (2, 5e-2) if w[0] == "grad_output" else (1, 1e-2)
        g = torch.tensor([*(a / dp for a in g[1:-1]), g[-1] * dp])
        assert torch.allclose(g, torch.tensor(w[1:]), rtol=rtol, atol=0), (g, w)
