"""Expert parallelism trains like one process holding every expert.

Each rank of a gloo group (2 and 4 processes on the CPU) holds ``E / P`` experts (fc1 -> GELU
-> fc2, two ``GroupedLinear``) and its own routed rows; one process runs the ``E``-expert layer
on the ranks' batches concatenated in rank order (the same router decisions, the same tokens).
Why outputs and gradients are bitwise equal: ``expert_dispatch`` gives each expert exactly the
rows, in the order, that the single process gives it (the rows of rank 0, then rank 1, ...), so
each expert's quantization and GEMMs run on the same operands with the same shapes; the
exchanges and reorderings move rows without arithmetic. Rank ``r``'s rows are scaled by
``r + 1``, so an expert that saw only one rank's rows would take another per-tensor amax (FP8
current scaling): the experts' amaxes need no cross-rank reduction because every expert's rows
are on its rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

D, H, ROWS = 64, 64, 12
RECIPES = {
    "bf16": None,  # BF16 parameters and tokens, no autocast
    "current": hf.Float8CurrentScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "hybrid": lambda: hf.CustomRecipe(qfactory=hf.factories.per_gemm(
        fprop="fp8_current", dgrad="mxfp8", wgrad="fp8_block")),
}


class _Experts(nn.Module):
    """fc1 -> GELU -> fc2 over ``n`` experts."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = hf.GroupedLinear(n, D, H, params_dtype=dtype, name="fc1")
        self.fc2 = hf.GroupedLinear(n, H, D, params_dtype=dtype, name="fc2")

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x, m_splits)), m_splits)


def _dtype(recipe: str) -> torch.dtype:
    return torch.bfloat16 if recipe == "bf16" else torch.float32


def _full(num_experts: int, recipe: str) -> _Experts:
    torch.manual_seed(0)
    return _Experts(num_experts, _dtype(recipe))


def _local(num_experts: int, world: int, rank: int, recipe: str) -> _Experts:
    """This rank's experts: the full layer's experts rank*L .. rank*L+L-1."""
    full, local = _full(num_experts, recipe), num_experts // world
    part = _Experts(local, _dtype(recipe))
    with torch.no_grad():
        for fc in ("fc1", "fc2"):
            for i in range(local):
                for p in ("weight", "bias"):
                    getattr(getattr(part, fc), f"{p}{i}").copy_(getattr(getattr(full, fc), f"{p}{rank * local + i}"))
    return part


def _batch(num_experts: int, rank: int, recipe: str) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Rank ``rank``'s rows sorted by expert, rows per expert, and the output gradient. The last
    expert gets no rows anywhere; others get none from some ranks."""
    g = torch.Generator().manual_seed(100 + rank)
    experts = torch.randint(0, num_experts - 1, (ROWS,), generator=g).sort().values
    m_splits = torch.bincount(experts, minlength=num_experts).tolist()
    x = (torch.randn(ROWS, D, generator=g) * (rank + 1)).to(_dtype(recipe))
    return x, m_splits, torch.randn(ROWS, D, generator=g).to(_dtype(recipe))


def _bits(t: torch.Tensor) -> list:
    return t.detach().float().view(torch.int32).flatten().tolist()


def _run(model: nn.Module, x: torch.Tensor, m_splits: list[int], dy: torch.Tensor, recipe: str) -> torch.Tensor:
    x.requires_grad_(True)
    if RECIPES[recipe] is None:
        y = model(x, m_splits)
    else:
        with hf.autocast(recipe=RECIPES[recipe]()):
            y = model(x, m_splits)
    y.backward(dy)
    return y


def _grads(model: _Experts, experts: range) -> dict:
    return {f"{fc}.{p}{e}": _bits(getattr(getattr(model, fc), f"{p}{i}").grad)
            for fc in ("fc1", "fc2") for i, e in enumerate(experts) for p in ("weight", "bias")}


def _ep_worker(rank: int, world: int, num_experts: int, recipes: list[str]) -> dict:
    out = {}
    for recipe in recipes:
        model = _local(num_experts, world, rank, recipe)
        ep = hf.ExpertParallel(model, num_experts)
        x, m_splits, dy = _batch(num_experts, rank, recipe)
        local_x, local_splits, handle = hf.expert_dispatch(x, m_splits)
        y = _run(ep, x, m_splits, dy, recipe)
        out[recipe] = {"y": _bits(y), "dx": _bits(x.grad), "grads": _grads(model, ep.local_experts),
                       "local_x": _bits(local_x), "local_splits": local_splits,
                       "plain": type(y) is torch.Tensor and type(local_x) is torch.Tensor}
    if world == 4:  # a 2 x 2 mesh: two expert-parallel groups of 2 ranks, each with 2 ranks' data
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        ep_rank, recipe = mesh.get_local_rank("ep"), "mxfp8"
        model = _local(4, 2, ep_rank, recipe)
        ep = hf.ExpertParallel(model, 4, mesh, mesh_dim="ep")
        x, m_splits, dy = _batch(4, ep_rank, recipe)
        y = _run(ep, x, m_splits, dy, recipe)
        out["mesh"] = {"ep_rank": ep_rank, "y": _bits(y), "dx": _bits(x.grad),
                       "grads": _grads(model, ep.local_experts)}
    return out


def _reference(num_experts: int, world: int, recipe: str, batch=None) -> tuple[list, dict]:
    """The single process: every expert, the ranks' rows regrouped by expert (rank order kept);
    ``batch(num_experts, rank, recipe)`` gives a rank's rows (default ``_batch``)."""
    batches = [(batch or _batch)(num_experts, r, recipe) for r in range(world)]
    pieces = []  # (expert, rank, rows of x, rows of dy)
    for r, (x, m_splits, dy) in enumerate(batches):
        for e, (xs, ds) in enumerate(zip(x.split(m_splits), dy.split(m_splits))):
            pieces.append((e, r, xs, ds))
    pieces.sort(key=lambda p: (p[0], p[1]))
    x = torch.cat([p[2] for p in pieces])
    dy = torch.cat([p[3] for p in pieces])
    m_splits = [sum(p[2].shape[0] for p in pieces if p[0] == e) for e in range(num_experts)]
    model = _full(num_experts, recipe)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (spawn_ranks): a CPU GEMM's blocking follows its threads
    try:
        y = _run(model, x, m_splits, dy, recipe)
    finally:
        torch.set_num_threads(threads)
    per_rank = []  # each rank's rows of y and dx, in the rank's order
    for r, (xr, ms, _) in enumerate(batches):
        at, ys, dxs = 0, {}, {}
        for e, src, xs, _dy in pieces:
            if src == r:
                ys[e], dxs[e] = y[at:at + xs.shape[0]], x.grad[at:at + xs.shape[0]]
            at += xs.shape[0]
        order = [e for e in range(num_experts) if e in ys]
        per_rank.append({"y": _bits(torch.cat([ys[e] for e in order])),
                         "dx": _bits(torch.cat([dxs[e] for e in order])),
                         "local_x": _bits(torch.cat([p[2] for p in pieces if p[0] // (num_experts // world) == r]
                                                    or [x[:0]])),
                         "local_splits": m_splits[r * (num_experts // world):(r + 1) * (num_experts // world)]})
    return per_rank, _grads(model, range(num_experts))


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_process(world: int, tmp_path) -> None:
    num_experts = 2 * world
    results = run_ranks(_ep_worker, world, (num_experts, sorted(RECIPES)), tmp_path)
    for recipe in RECIPES:
        want_rows, want_grads = _reference(num_experts, world, recipe)
        for rank, got in enumerate(results):
            got = got[recipe]
            assert got["plain"], (recipe, rank)
            # each expert reads the single process's rows, in its order
            assert got["local_splits"] == want_rows[rank]["local_splits"], (recipe, rank)
            assert got["local_x"] == want_rows[rank]["local_x"], (recipe, rank)
            assert got["y"] == want_rows[rank]["y"], (recipe, rank)
            assert got["dx"] == want_rows[rank]["dx"], (recipe, rank)
            for name, bits in got["grads"].items():
                assert bits == want_grads[name], (recipe, rank, name)
    if world == 4:  # each group of the mesh trains as one process on its two ranks' rows
        want_rows, want_grads = _reference(4, 2, "mxfp8")
        assert [got["mesh"]["ep_rank"] for got in results] == [0, 1, 0, 1]
        for rank, got in enumerate(results):
            got, r = got["mesh"], got["mesh"]["ep_rank"]
            assert got["y"] == want_rows[r]["y"] and got["dx"] == want_rows[r]["dx"], rank
            assert all(bits == want_grads[name] for name, bits in got["grads"].items()), rank
