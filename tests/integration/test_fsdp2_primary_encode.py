"""Quantized primary weights under FSDP2: the shard encodings match one process, stale codes
are refused, and no process-wide optimizer hook is installed.

One 2-rank gloo spawn runs every case on a tiny ``hf.Linear(64, 80)`` (80 rows: 40 a rank, so
an MXFP8 32-row column block straddles the boundary):

- a hybrid with ``columnwise_source="rowwise_dequantized"``: its columnwise child's amax is the
  dequantized rowwise copy's (not the weight's), reduced over the shard group; the gathered
  weight is bitwise ``q.quantize(master)`` on both copies (same arithmetic, same order: a max);
- a NaN in an NVFP4 master: the reduced amax (kept in the payload) stays NaN, as one process's
  does (compared with NaN-equal semantics: NaN payload bits may differ);
- writes to the FP32 master without re-encoding (a foreach AdamW step, an SGD step leaving the
  largest element unchanged, a ``.data`` write that moves no version counter) make the next
  gather raise; ``torch.optim.optimizer``'s global step hooks stay untouched;
- ``precompute_weight_amax`` and ``train``'s ``weight_amax_precompute`` skip primary weights
  (their amaxes are reduced by ``quantize_sharded_weights``): a step is one all-reduce.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import counting_all_reduces, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

IN, OUT = 64, 80


def _sharded(recipe) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        model = nn.Sequential(hf.Linear(IN, OUT, bias=False))
    assert hf.enable_quantized_all_gather(model) == 1
    fully_shard(model[0])  # not the root: resharded after each forward (its parameters stay shards)
    fully_shard(model)
    return model


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise for codes, NaN-equal for floating-point scales and amaxes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]))
    return bool(torch.equal(a, b))


def _matches_one_process(param, q) -> bool:
    from hybridfp.config import policy
    got = hf.full_quantized_weight(param)
    ref = q.copy()
    ref.set_usage(rowwise=True, columnwise=True)
    with torch.no_grad(), policy(decoded_copies="never"):
        want = ref.quantize(param.full_tensor().detach())
    g, w = list(got.qstorage.tensors()), list(want.qstorage.tensors())
    return len(g) == len(w) and all(_same(a, b) for a, b in zip(g, w))


def _forward(model: nn.Module) -> str:
    try:
        with torch.no_grad(), hf.autocast(recipe=hf.Float8CurrentScaling()):
            model(torch.ones(4, IN))
        return "no error"
    except RuntimeError as e:
        return str(e)


def _worker(rank: int, world: int) -> dict:
    import torch.optim.optimizer as optim_mod

    from hybridfp.train.distributed import Parallel, weight_amax_precompute

    hooks_before = len(optim_mod._global_optimizer_post_hooks)
    out: dict = {}

    # 1. a hybrid whose columnwise child reads the dequantized rowwise copy
    model = _sharded(hf.MXFP8BlockScaling())
    p = model[0].weight
    q = hf.HybridQuantizer(hf.MXFP8Quantizer(), hf.Float8CurrentScalingQuantizer(),
                           columnwise_source="rowwise_dequantized")
    p.to_local()._slot.quantizer = q
    hf.quantize_sharded_weights(model)
    out["hybrid_rd"] = _matches_one_process(p, q)

    # 3. a NaN in the master (on rank 0's rows) encodes as one process does (NVFP4 keeps its amax)
    model = _sharded(hf.NVFP4BlockScaling())
    p = model[0].weight
    if rank == 0:
        with torch.no_grad():
            p.to_local()[3, 5] = float("nan")
    hf.quantize_sharded_weights(model)
    out["nan"] = _matches_one_process(p, p.to_local()._slot.quantizer)

    # 2. writes to the master without re-encoding are refused at the next gather
    model = _sharded(hf.Float8CurrentScaling())
    p = model[0].weight
    hf.quantize_sharded_weights(model)
    p.grad = torch.ones_like(p)
    torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True).step()
    out["adamw"] = _forward(model)
    hf.quantize_sharded_weights(model)
    out["requantized"] = _forward(model)
    local = p.to_local()
    grad = torch.zeros_like(local)
    grad.view(-1)[local.abs().argmin()] = 1.0  # the smallest element moves; the largest does not
    p.grad = torch.distributed.tensor.DTensor.from_local(grad, p.device_mesh, p.placements)
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    out["sgd_max_unchanged"] = _forward(model)
    hf.quantize_sharded_weights(model)
    with torch.no_grad():  # `.data`: a write that moves no version counter
        d = p.to_local().data
        d.view(-1)[d.abs().argmin()] += 1e-3
    out["data_write"] = _forward(model)
    hf.quantize_sharded_weights(model)

    # 4. primary weights take no precompute: a MasterWeightOptimizer step is one all-reduce
    par = Parallel(rank=rank, world=world, device="cpu", fsdp=True)
    out["train_precompute"] = weight_amax_precompute(model, par, hf.Float8CurrentScaling())
    with counting_all_reduces() as calls:
        opt = hf.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
        with hf.autocast(recipe=hf.Float8CurrentScaling()):
            model(torch.ones(4, IN)).float().square().mean().backward()
        calls.append(0)  # the step's count
        opt.step()
        out["precompute"] = hf.precompute_weight_amax(model)
        out["step_reduces"] = calls[0]
    out["after_step"] = _forward(model)
    out["hooks_added"] = len(optim_mod._global_optimizer_post_hooks) - hooks_before
    return out


def test_primary_weight_encoding_staleness_and_hooks(tmp_path) -> None:
    for rank, got in enumerate(run_ranks(_worker, 2, (), tmp_path)):
        assert got["hybrid_rd"], rank
        assert got["nan"], rank
        for case in ("adamw", "sgd_max_unchanged", "data_write"):
            assert "changed after its quantized shard was encoded" in got[case], (rank, case, got[case])
        assert got["requantized"] == "no error" and got["after_step"] == "no error", (rank, got)
        assert got["train_precompute"] == 0 and got["precompute"] == 0, (rank, got)
        assert got["step_reduces"] == 1, (rank, got["step_reduces"])
        assert got["hooks_added"] == 0, rank


def test_rowwise_dequantized_side_with_amax_history_is_refused() -> None:
    """A delayed-scaling columnwise side read from the dequantized rowwise copy: its history
    would need that copy's whole-weight amax, which the shard encodings do not record."""
    from hybridfp.integration.fsdp_primary import _check_quantizer
    q = hf.HybridQuantizer(hf.MXFP8Quantizer(), hf.Float8Quantizer(amax_history_len=4),
                           columnwise_source="rowwise_dequantized")
    with pytest.raises(ValueError, match="Linear.weight.*rowwise_dequantized.*amax history"):
        _check_quantizer(q, "Linear.weight")
    _check_quantizer(hf.HybridQuantizer(hf.MXFP8Quantizer(), hf.Float8CurrentScalingQuantizer(),
                                        columnwise_source="rowwise_dequantized"), "Linear.weight")
