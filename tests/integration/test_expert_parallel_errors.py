"""Expert parallelism refuses what it cannot run correctly, with a message naming what to fix.

Checks local to a rank run in this process (a one-rank gloo group on a ``HashStore``); what
only the ranks together can see (different numbers of experts, row widths or dtypes) runs in
two gloo processes, where every rank must raise the same error at the same step, so the group
stays usable after it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybridfp as hf

from spawn_ranks import run_ranks


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_needs_torch_distributed() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        hf.expert_dispatch(torch.randn(2, 4), [2])
    with pytest.raises(RuntimeError, match="init_process_group"):
        hf.ExpertParallel(hf.GroupedLinear(1, 4, 4), 1)


def test_local_errors(one_rank) -> None:
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden\]"):
        hf.expert_dispatch(x.view(5, 2, 4), [2, 3])
    with pytest.raises(ValueError, match="m_splits sum to 4 but x has 5 rows"):
        hf.expert_dispatch(x, [1, 3])
    with pytest.raises(ValueError, match="negative"):
        hf.expert_dispatch(x, [6, -1])
    with pytest.raises(TypeError, match="m_splits"):
        hf.expert_dispatch(x, [2.0, 3.0])
    with pytest.raises(TypeError, match="ProcessGroup, a DeviceMesh or None"):
        hf.expert_dispatch(x, [2, 3], "world")
    with pytest.raises(ValueError, match="mesh_dim is for a DeviceMesh"):
        hf.expert_dispatch(x, [2, 3], mesh_dim=0)
    with pytest.raises(ValueError, match="GroupedLinear fc has num_gemms=2.*num_gemms=3"):
        hf.ExpertParallel(torch.nn.ModuleDict({"fc": hf.GroupedLinear(2, 8, 8)}), 3)
    with pytest.raises(ValueError, match="num_experts=0 must be a positive multiple"):
        hf.ExpertParallel(hf.GroupedLinear(1, 8, 8), 0)
    ep = hf.ExpertParallel(hf.GroupedLinear(2, 8, 8), 2)
    with pytest.raises(ValueError, match="m_splits has 3 entries; it needs one per global expert"):
        ep(x, [1, 2, 2])
    _, _, handle = hf.expert_dispatch(x, [2, 3])
    with pytest.raises(ValueError, match=r"y must be \[5, out\]"):
        hf.expert_combine(torch.randn(4, 8), handle)
    with pytest.raises(TypeError, match="ExpertDispatch that expert_dispatch"):
        hf.expert_combine(x, {"rows": 5})


def test_wire_quantizer_errors(one_rank) -> None:
    x = torch.randn(4, 64)
    hybrid = hf.HybridQuantizer(hf.MXFP8Quantizer(), hf.Float8CurrentScalingQuantizer())
    with pytest.raises(TypeError, match="single-format hybridfp Quantizer.*forward \\(rowwise\\) format"):
        hf.expert_dispatch(x, [4], wire_quantizer=hybrid)
    with pytest.raises(TypeError, match="wire_quantizer must be"):
        hf.expert_dispatch(x, [4], wire_quantizer="mxfp8")
    with pytest.raises(ValueError, match="blocks spanning several rows"):
        hf.expert_dispatch(x, [4], wire_quantizer=hf.MXFP8Quantizer(with_2d_quantization=True))
    with pytest.raises(ValueError, match="blocks spanning several rows"):
        hf.expert_dispatch(x, [4], wire_quantizer=hf.Float8BlockQuantizer())  # 128x128 blocks
    with pytest.raises(ValueError, match="stochastic rounding"):
        hf.expert_dispatch(x, [4], wire_quantizer=hf.NVFP4Quantizer(stochastic_rounding=True))


def _ranks_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    def error(fn) -> str:
        try:
            fn()
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    x = torch.randn(4, 8)
    out = {
        # 3 experts cannot be split over 2 ranks
        "indivisible": error(lambda: hf.expert_dispatch(torch.randn(3, 8), [1, 1, 1])),
        "indivisible_module": error(lambda: hf.ExpertParallel(hf.GroupedLinear(1, 8, 8), 3)),
        # the ranks pass different numbers of experts: caught before any rows move
        "experts": error(lambda: hf.expert_dispatch(x, [1, 1, 1, 1] if rank == 0 else [1, 1, 0, 1, 0, 1])),
        # different row widths, even unchecked: the routing message carries them
        "width": error(lambda: hf.expert_dispatch(torch.randn(4, 8 if rank == 0 else 16), [2, 2], check=False)),
        "dtype": error(lambda: hf.expert_dispatch(x.to(torch.bfloat16 if rank else torch.float32), [2, 2])),
    }
    # one rank's own inputs are wrong: it raises its error, the others name it (none waits)
    out["one_refuses"] = error(lambda: hf.expert_dispatch(x, [2, 2] if rank == 0 else [1, 1]))
    out["one_refuses_module"] = error(lambda: hf.ExpertParallel(hf.GroupedLinear(1, 8, 8), 2)(
        x, [2, 2] if rank == 0 else [2, 1, 1]))
    _, _, handle = hf.expert_dispatch(x, [2, 2])
    out["one_refuses_combine"] = error(lambda: hf.expert_combine(torch.randn(handle.rows + rank, 8), handle))
    # one rank sends its rows quantized, the other in FP32
    out["wire"] = error(lambda: hf.expert_dispatch(
        torch.randn(4, 64), [2, 2], check=False, wire_quantizer=hf.MXFP8Quantizer() if rank == 0 else None))
    _, _, handle = hf.expert_dispatch(x, [2, 2])
    out["combine_width"] = error(lambda: hf.expert_combine(torch.randn(handle.rows, 8 + rank), handle))
    # a 2-D mesh: the expert-parallel dimension is named; without the name it is refused
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    out["mesh_no_dim"] = error(lambda: hf.ExpertParallel(hf.GroupedLinear(1, 8, 8), 2, mesh))
    ep = hf.ExpertParallel(hf.GroupedLinear(1, 8, 8), 2, mesh, mesh_dim="ep")
    out["mesh_ok"] = list(ep(x, [3, 1]).shape) + [ep.ep_rank, list(ep.local_experts)]
    # a rank without tokens still takes part (plain and quantized rows, forward and backward)
    for wire in (None, hf.MXFP8Quantizer()):
        ep = hf.ExpertParallel(hf.GroupedLinear(1, 64, 8), 2, wire_quantizer=wire)
        rows = torch.randn(4 if rank == 0 else 0, 64, requires_grad=True)
        y = ep(rows, [3, 1] if rank == 0 else [0, 0])
        y.sum().backward()
        out[f"empty-{wire is not None}"] = [list(y.shape), list(rows.grad.shape)]
    return out


def test_errors_across_ranks(tmp_path) -> None:
    for rank, got in enumerate(run_ranks(_ranks_worker, 2, (), tmp_path)):
        assert "m_splits has 3 entries (experts) but the expert-parallel group has 2 ranks" in got["indivisible"]
        assert "num_experts=3 must be a positive multiple of the expert-parallel group's size (2)" \
            in got["indivisible_module"]
        assert "disagree on the number of experts (len(m_splits)): [4, 6] (by rank)" in got["experts"], got
        assert f"rank {1 - rank} sends rows of width {16 if rank == 0 else 8}" in got["width"], got
        assert "disagree on x's dtype" in got["dtype"], got
        assert "disagree on the experts' output width: [8, 9]" in got["combine_width"], got
        assert "every rank must pass an equal wire_quantizer (or none)" in got["wire"], got
        own = {"one_refuses": "m_splits sum to 2 but x has 4 rows",
               "one_refuses_module": "m_splits has 3 entries; it needs one per global expert (2)",
               "one_refuses_combine": "y must be [4, out]"}
        for case, message in own.items():
            if rank == 1:
                assert message in got[case], (case, got[case])
            else:
                assert "rank(s) [1] of the expert-parallel group refused their inputs" in got[case], got[case]
        assert f"rank {1 - rank} sends {256 if rank == 0 else 66} bytes a row" in got["wire"], got
        assert "pass mesh_dim= naming the expert-parallel one" in got["mesh_no_dim"], got
        assert got["mesh_ok"] == [4, 8, rank, [rank]]
        rows = 4 if rank == 0 else 0
        assert got["empty-False"] == got["empty-True"] == [[rows, 8], [rows, 64]], got
