"""Tensor and sequence parallelism train like one process.

Each rank of a gloo group (2 and 4 processes on the CPU) holds the same batch and trains a
tensor-parallel copy of a tiny model (fc1 column-parallel, fc2 row-parallel: two Linears, a
LayerNormLinear and a Linear, a LayerNormMLP, a SwiGLU LayerNormMLP), with and without sequence
parallelism, a few SGD steps; the same rank trains the unparallelized model as the reference.
Before training, every parameter's ``full_tensor()`` in the state_dict is bitwise the
unparallelized one, and the SwiGLU fc1's local shard is [gate_r; up_r] (the rank's ffn slice of
each half, so the activation runs on the rank's own fc1 output).

What is bitwise (quantization only, no sum order involved): every GEMM operand that is a slice
of a tensor the reference also holds exactly — the weights (first step: the same values), the
input x of fc1 (gathered quantized under sequence parallelism) and fc2's output gradient dy (the
loss's constant weights) — must decode, on each rank, to exactly the slice of the reference's
quantization: that holds only if split per-tensor amaxes were reduced over the group and no
block straddles two ranks. fc2's input and fc1's dy come out of GEMMs of other shapes (another
FP32 summation order), so for them the check is that every rank encoded with the same
per-tensor scales, at every step (an unreduced amax gives each rank its own; delayed scaling's
shows from the second step, after the first region end's reduction).

What is bounded: the outputs, losses and trained parameters. Every TP GEMM sums over the same
terms as the reference but in another order (a row-parallel fprop and a column-parallel dgrad
add p FP32 partial sums), so an FP32 result differs by at most 2 γ(K) Σ|a_k b_k| (γ(K) = K u,
u = 2**-24, K <= 128 here: ~1.6e-5 relative to Σ|a b|). Quantizing such a result again may
flip an element to the neighbouring code (one step: 2**-3 relative for E4M3, up to 1/6 of a
block's amax for E2M1), and later steps inherit that. The bound used — the relative L2 error of
each trained parameter <= 2e-3 (FP8 / MXFP8) and 2e-2 (NVFP4), each loss within the same
relative tolerance — is a few such flips among the ~8K elements of a layer; a
wrong scale, a missing reduction or a misplaced shard moves a parameter by far more (the
whole quantization error, ~6 % for FP8 and ~25 % for NVFP4 of the update, in every element).

The SP all-gathers are counted: the forward sends fc1's local row count (one int64: every rank
checks that all hold as many rows) and then fc1's input as its quantized rowwise copy (FP8: 1
byte an element, 0.5x BF16; MXFP8 1 + 1/32; NVFP4 0.5 + 1/16), the backward fc2's dy as its
rowwise and its columnwise copies and fc1's input as its columnwise copy.
"""

from __future__ import annotations

import copy
import math
import struct

import pytest
import torch
from torch import nn

import hybridfp as hf

from spawn_ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

H, F, ROWS, STEPS, LR = 64, 128, 128, 3, 0.05
RECIPES = {
    "current": hf.Float8CurrentScaling,
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
    "mxfp8": hf.MXFP8BlockScaling,
    # stochastic rounding draws per position: a rank's shard draws differently from one process
    "nvfp4": lambda: hf.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "hybrid_nvfp4_mxfp8": lambda: hf.CustomRecipe(qfactory=hf.factories.per_gemm(
        fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")),
}
#: relative L2 bound on trained parameters and losses (see the module docstring)
BOUND = {"current": 2e-3, "delayed": 2e-3, "mxfp8": 2e-3, "nvfp4": 2e-2, "hybrid_nvfp4_mxfp8": 2e-2}
_MX, _FP4 = 1 + 1 / 32, 0.5 + 1 / 16  # MXFP8: + E8M0 per 32; NVFP4: E2M1 + E4M3 per 16
#: bytes per element of the gathered copies: (x rowwise, x columnwise, dy rowwise, dy columnwise)
GATHER_BYTES = {"current": (1, 1, 1, 1), "delayed": (1, 1, 1, 1), "mxfp8": (_MX,) * 4,
                "nvfp4": (_FP4,) * 4,
                # x: NVFP4 row (fprop), MXFP8 col (wgrad); dy: MXFP8 (dgrad, wgrad)
                "hybrid_nvfp4_mxfp8": (_FP4, _MX, _MX, _MX)}
MODELS = ("mlp", "ln_mlp", "layernorm_mlp", "swiglu_mlp")


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind in ("layernorm_mlp", "swiglu_mlp"):
        act = "swiglu" if kind == "swiglu_mlp" else "gelu"
        return nn.Sequential(hf.LayerNormMLP(H, F, activation=act, name="mlp"))
    fc1 = hf.Linear(H, F, name="fc1") if kind == "mlp" else hf.LayerNormLinear(H, F, name="fc1")
    return nn.Sequential(fc1, nn.GELU(), hf.Linear(F, H, name="fc2"))


def _plan(kind: str, sp: bool) -> dict:
    from torch.distributed.tensor import Shard
    if kind in ("layernorm_mlp", "swiglu_mlp"):
        return {"0": hf.LayerNormMLPParallel(sequence_parallel=sp)}
    if sp:
        return {"0": hf.ColwiseParallel(input_layouts=Shard(0)), "2": hf.RowwiseParallel(output_layouts=Shard(0))}
    return {"0": hf.ColwiseParallel(), "2": hf.RowwiseParallel()}


def _hex(t: torch.Tensor) -> list[str]:
    return [struct.pack(">f", v).hex() for v in t.detach().float().reshape(-1).tolist()]


def _per_tensor_entries(qt) -> list[str]:
    """The per-tensor payload entries (scales, global amaxes) of a quantized operand, as bits."""
    st = qt.qstorage
    out = []
    for d in st.directions():
        part = st.part(d)
        for name, spec in sorted(part._row_index[d].items()):
            if spec is None:
                out += _hex(part.payloads[d][name])
    return out


class _Recorder:
    """Records the operands of every quantized GEMM of a model (by layout, in call order)."""

    def __init__(self, module, attr: str = "gemm") -> None:
        self.module, self.attr, self.calls = module, attr, []
        self.orig = getattr(module, attr)

    def __enter__(self):
        def gemm(a, b, layout="TN", **kw):
            # what the GEMM reads, decoded now (a copy fprop used is dropped right after it)
            da, db = READS[layout]
            self.calls.append((layout, _deq(a, da), _deq(b, db), _per_tensor_entries(a) + _per_tensor_entries(b)))
            return self.orig(a, b, layout, **kw)
        setattr(self.module, self.attr, gemm)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.attr, self.orig)


#: the copies of A and B each GEMM layout reads
READS = {"TN": ("rowwise", "rowwise"), "NN": ("rowwise", "columnwise"), "NT": ("columnwise", "columnwise")}


def _deq(t, direction):
    return t.dequantize(direction=direction).float() if isinstance(t, hf.QuantizedTensor) else t.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _step(model, recipe, x, c):
    with hf.autocast(recipe=RECIPES[recipe]()):
        y = model(x)
    loss = (y.float() * c).sum()
    loss.backward()
    return y, loss


def _case(rank: int, world: int, kind: str, recipe: str, sp: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    import hybridfp.integration.tensor_parallel_linear as tpl
    import hybridfp.nn.linear_function as lf

    mesh = init_device_mesh("cpu", (world,))
    ref = _model(kind)
    tp = parallelize_module(copy.deepcopy(ref), mesh, _plan(kind, sp))
    out0 = _layout_checks(ref, tp, rank, world, gated=kind == "swiglu_mlp")
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(ROWS, H, generator=g), torch.randn(ROWS, H, generator=g)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    opt_r, opt_t = torch.optim.SGD(ref.parameters(), lr=LR), torch.optim.SGD(tp.parameters(), lr=LR)
    out: dict = {"loss_ref": [], "loss_tp": [], "gathered": [], "scales": [None] * STEPS, **out0}
    sent: list[int] = []
    orig_ag = dist.all_gather_into_tensor

    def counting(o, i, *a, **k):
        sent.append(i.numel() * i.element_size())
        return orig_ag(o, i, *a, **k)

    for step in range(STEPS):
        opt_r.zero_grad()
        opt_t.zero_grad()
        x_ref = x.clone().requires_grad_()  # the input's gradient runs fc1's dgrad too
        x_tp = (x[rows] if sp else x).clone().requires_grad_()
        with _Recorder(lf) as rr:
            y_ref, loss_ref = _step(ref, recipe, x_ref, c)
        dist.all_gather_into_tensor = counting
        try:
            with _Recorder(tpl) as rt:
                with hf.autocast(recipe=RECIPES[recipe]()):
                    y = tp(x_tp)
                fwd_sent = list(sent)
                sent.clear()
                loss = (y.float() * (c[rows] if sp else c)).sum()
                loss.backward()
        finally:
            dist.all_gather_into_tensor = orig_ag
        bwd_sent = list(sent)
        sent.clear()
        total = loss.detach().clone()
        if sp:
            dist.all_reduce(total)
        out["loss_ref"].append(loss_ref.item())
        out["loss_tp"].append(total.item())
        out["scales"][step] = [c[3] for c in rt.calls]
        if step == 0:
            out["y_rel"] = _rel(y, y_ref[rows] if sp else y_ref)
            out["dx_rel"] = _rel(x_tp.grad, x_ref.grad[rows] if sp else x_ref.grad)
            out["gathered"] = [fwd_sent, sorted(bwd_sent)]
            out.update(_operand_checks(rr.calls, rt.calls, rank, world, sp, gated=kind == "swiglu_mlp"))
        opt_r.step()
        opt_t.step()
    names = dict(ref.named_parameters())
    out["param_rel"] = {n: _rel(p.full_tensor(), names[n]) for n, p in tp.named_parameters()}
    return out


def _layout_checks(ref: nn.Module, tp: nn.Module, rank: int, world: int, gated: bool) -> dict:
    """Before training: the state_dict's DTensors give back the unsharded parameters bitwise,
    and a gated fc1's local shard is [gate_r; up_r] (the rank's ffn slice of each half)."""
    from torch.distributed.tensor import DTensor
    want = {n: v for n, v in ref.state_dict().items() if isinstance(v, torch.Tensor)}  # not extra state
    got = {n: (v.full_tensor() if isinstance(v, DTensor) else v) for n, v in tp.state_dict().items()
           if isinstance(v, torch.Tensor)}
    out = {"state_dict": sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)}
    if gated:
        local = {n: tp.state_dict()[n].to_local() for n in ("0.fc1_weight", "0.fc1_bias")}
        halves = {n: [h.chunk(world)[rank] for h in want[n].chunk(2)] for n in local}
        out["gate_up_local"] = all(torch.equal(local[n], torch.cat(halves[n])) for n in local)
    return out


def _operand_checks(ref_calls: list, tp_calls: list, rank: int, world: int, sp: bool,
                    gated: bool = False) -> dict:
    """First step: which quantized operands are bitwise slices of the reference's (see the
    module docstring), and each rank's per-tensor scales of the operands that are not."""
    def by(calls, layout):
        return [c for c in calls if c[0] == layout]

    (r1f, r2f), (t1f, t2f) = by(ref_calls, "TN"), by(tp_calls, "TN")
    # backward runs fc2 first: NN / NT calls in order fc2, fc1
    (r2d, r1d), (t2d, t1d) = by(ref_calls, "NN"), by(tp_calls, "NN")
    (r2w, r1w), (t2w, t1w) = by(ref_calls, "NT"), by(tp_calls, "NT")
    n1 = t1f[2].shape[0]  # fc1's rows of out_features on this rank
    k2 = t2f[2].shape[1]  # fc2's columns of in_features on this rank
    o1: object = slice(rank * n1, (rank + 1) * n1)
    if gated:  # the rank's rows of the gate half, then of the up half
        ffn = r1f[2].shape[0] // 2
        own = torch.arange(rank * n1 // 2, (rank + 1) * n1 // 2)
        o1 = torch.cat([own, ffn + own])
    o2 = slice(rank * k2, (rank + 1) * k2)
    checks = {
        "fc1 x rowwise": torch.equal(t1f[1], r1f[1]),
        "fc1 W rowwise": torch.equal(t1f[2], r1f[2][o1]),
        "fc1 W columnwise": torch.equal(t1d[2], r1d[2][o1]),
        "fc1 x columnwise": torch.equal(t1w[2], r1w[2]),
        "fc2 W rowwise": torch.equal(t2f[2], r2f[2][:, o2]),
        "fc2 W columnwise": torch.equal(t2d[2], r2d[2][:, o2]),
        "fc2 dy rowwise": torch.equal(t2d[1], r2d[1]),
        "fc2 dy columnwise": torch.equal(t2w[1], r2w[1]),
    }
    return {"bitwise": checks}


def _run(rank: int, world: int, cases: list) -> list:
    return [_case(rank, world, *case) for case in cases]


def _cases(world: int) -> list:
    return [(kind, recipe, sp) for kind in MODELS for recipe in RECIPES for sp in (False, True)]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_trains_like_one_process(world, tmp_path):
    cases = _cases(world)
    results = run_ranks(_run, world, (cases,), tmp_path)
    for i, (kind, recipe, sp) in enumerate(cases):
        what = f"{kind} {recipe} sp={sp} world={world}"
        for rank, res in enumerate(r[i] for r in results):
            assert res["state_dict"], f"{what} rank {rank}: state_dict's full_tensor() is not the unsharded model's"
            assert res.get("gate_up_local", True), f"{what} rank {rank}: fc1's local shard is not [gate_r; up_r]"
            bad = [k for k, ok in res["bitwise"].items() if not ok]
            assert not bad, f"{what} rank {rank}: operands not bitwise the reference's slice: {bad}"
            bound = BOUND[recipe]
            assert res["y_rel"] <= bound, f"{what} rank {rank}: first output rel error {res['y_rel']}"
            assert res["dx_rel"] <= bound, f"{what} rank {rank}: first input gradient rel error {res['dx_rel']}"
            for lr, lt in zip(res["loss_ref"], res["loss_tp"]):
                assert abs(lt - lr) <= bound * abs(lr), f"{what} rank {rank}: losses {res['loss_tp']} vs {res['loss_ref']}"
            worst = max(res["param_rel"].items(), key=lambda kv: kv[1])
            assert worst[1] <= bound, f"{what} rank {rank}: parameter {worst[0]} rel error {worst[1]}"
            if sp:  # one quantized copy of a rank's [ROWS / world, H] rows per all-gather
                x_row, x_col, dy_row, dy_col = (math.ceil(ROWS // world * H * b) for b in GATHER_BYTES[recipe])
                want = [[8, x_row], sorted([x_col, dy_row, dy_col])]  # 8: the row count, int64
                assert res["gathered"] == want, f"{what} rank {rank}: all-gathers sent {res['gathered']} bytes"
                assert max(x_row, x_col, dy_row, dy_col) <= 0.52 * (ROWS // world * H * 2)  # BF16: 2 bytes
            else:
                assert res["gathered"] == [[], []], f"{what}: no all-gather without sequence parallelism"
        # every step, every GEMM: the ranks encode with the same per-tensor scales (whole tensors'
        # alike anyway; a split one's only through the amax reduction: fc2's x, fc1's dy, ...)
        for step in range(STEPS):
            got = {repr(r[i]["scales"][step]) for r in results}
            assert len(got) == 1, f"{what} step {step}: the ranks' per-tensor scales differ"
