"""The MoE FFN layer every MoE benchmark times: FP32 top-k routing with a seeded schedule of
router-logit offsets (uneven, moving expert loads), the BF16 layer (``torch._grouped_mm`` or a
loop of ``torch.mm``; FP32 for the error reference), the same layer on two hybridfp
GroupedLinear, and one training step of it (micro-batches, weights quantized once a step)."""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hybridfp
from bench import common
from hybridfp.nn.base import QuantizedModule
from hybridfp.utils.device import clear_step_metadata

TOKENS, HIDDEN, TOP_K = 16384, 4096, 2
#: routing: steps of per-micro-batch offsets cycled through, and the standard deviation of the
#: experts' log-popularity (0.3: the busiest expert's load ~1.45x the mean at 8 experts, ~2.8x at
#: 64, medians over the schedule at 4096 tokens: uneven as a layer trained without a strong
#: balancing loss routes)
ROUTING_STEPS, ROUTING_SKEW = 16, 0.3


class RoutingSchedule:
    """Seeded router-logit offsets, one [tokens, experts] FP32 tensor per micro-batch of each of
    ``steps`` steps (cycled through): every micro-batch routes anew, with uneven expert loads.

    Each offset is a fresh log-popularity per expert, normal with standard deviation ``skew``
    (lognormal popularities: a few busy experts, many idle ones), plus standard normal noise per
    token and expert (a new router input: the layer's own router logits are ~N(0, 1) too).
    """

    def __init__(self, tokens: int, experts: int, micro_batches: int, steps: int = ROUTING_STEPS,
                 skew: float = ROUTING_SKEW, seed: int = 0) -> None:
        if micro_batches < 1 or steps < 1 or skew < 0:
            raise ValueError(f"RoutingSchedule: micro_batches ({micro_batches}) and steps ({steps}) must be "
                             f">= 1 and skew ({skew}) >= 0")
        g = torch.Generator().manual_seed(seed)
        self.micro_batches = micro_batches
        self.offsets = [[(skew * torch.randn(experts, generator=g)
                          + torch.randn(tokens, experts, generator=g)).to(common.DEVICE)
                         for _ in range(micro_batches)] for _ in range(steps)]

    def __call__(self, step: int) -> list[torch.Tensor]:
        """The offsets of step ``step``'s micro-batches."""
        return self.offsets[step % len(self.offsets)]

    def imbalance(self, x: torch.Tensor, router: torch.Tensor) -> float:
        """Median over all micro-batches of the busiest expert's load / the mean load."""
        loads = []
        for step in self.offsets:
            for off in step:
                c = Routing(x, router, TOP_K, off).counts.float()
                loads.append((c.max() / c.mean()).item())
        return sorted(loads)[len(loads) // 2]


class SyncClock:
    """The host's wait for the routing's counts: ``counts`` reads them (``.tolist()``, the one sync
    of a micro-batch, as GroupedLinear takes host splits) and adds the time it took to
    ``seconds``. A step started on an idle GPU waits there for the micro-batches before it, so
    its host time minus ``seconds`` is the time the host spent enqueueing work."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def counts(self, counts: torch.Tensor) -> list[int]:
        """``counts.tolist()``, its time added to ``seconds``.

        Parameters
        ----------
        counts:
            The routing's rows per expert (a device tensor: reading it waits for the GPU).

        Returns
        -------
        list[int]
            The counts on the host."""
        t0 = time.perf_counter()
        out = counts.tolist()
        self.seconds += time.perf_counter() - t0
        return out


class Routing:
    """Top-k routing in FP32 (``offset``: added to the logits) and the permutation that groups
    the assignments by expert."""

    def __init__(self, x: torch.Tensor, router: torch.Tensor, top_k: int, offset: Optional[torch.Tensor] = None) -> None:
        logits = x.float() @ router.float().t()
        if offset is not None:
            logits = logits + offset
        probs, experts = torch.softmax(logits, -1).topk(top_k, dim=-1)
        flat = experts.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.token = self.order // top_k  # token of each permuted row
        self.weight = probs.reshape(-1)[self.order]
        self.counts = torch.bincount(flat, minlength=router.shape[0])
        self.offs = self.counts.cumsum(0).to(torch.int32)

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.token]

    def unpermute(self, y: torch.Tensor, tokens: int) -> torch.Tensor:
        out = y.new_zeros(tokens, y.shape[-1])
        return out.index_add(0, self.token, y * self.weight.to(y.dtype)[:, None])


def swiglu(h: torch.Tensor) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def _per_expert(x: torch.Tensor, w: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """x's rows of each expert times that expert's weight (one ``torch.mm`` each: cuBLAS)."""
    return torch.cat([torch.mm(xe, we.t()) for xe, we in zip(x.split(splits), w)])


class BF16MoE(nn.Module):
    """The BF16 layer: stacked [E, out, in] expert weights; ``gemm`` "grouped"
    (``torch._grouped_mm``) or "per_expert" (a loop of ``torch.mm``, after one host sync for the
    splits, as GroupedLinear takes them); ``dtype`` float32 for the reference."""

    #: the grouped layer's activation as ``hybridfp.swiglu`` (one Triton kernel each way, the
    #: gradient written as one tensor) instead of eager ``F.silu(g) * u`` (:meth:`with_fused_swiglu`)
    fused_swiglu = False

    def __init__(self, e: int, d: int, f: int, gemm: str = "grouped", dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.gemm, self.sync = gemm, SyncClock()
        self.router = nn.Parameter(torch.randn(e, d, device=common.DEVICE) * d ** -0.5)
        self.w1 = nn.Parameter(torch.randn(e, 2 * f, d, device=common.DEVICE, dtype=dtype) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, f, device=common.DEVICE, dtype=dtype) * f ** -0.5)

    def sharing(self, gemm: str, kind: Optional[type] = None) -> "BF16MoE":
        """The same layer (these Parameters) computed with ``gemm``; ``kind``: a subclass to build
        instead (one that routes differently, ``moe_torchao.TorchaoMoE``)."""
        m = (kind or BF16MoE).__new__(kind or BF16MoE)
        nn.Module.__init__(m)
        m.gemm, m.sync, m.router, m.w1, m.w2 = gemm, SyncClock(), self.router, self.w1, self.w2
        return m

    def with_fused_swiglu(self) -> "BF16MoE":
        """The grouped layer on these Parameters with the fused SwiGLU."""
        m = self.sharing("grouped")
        m.fused_swiglu = True
        return m

    def reference(self) -> "BF16MoE":
        """An FP32 copy computed per expert (no TF32: torch's default): the error reference."""
        m = BF16MoE.__new__(BF16MoE)
        nn.Module.__init__(m)
        m.gemm, m.sync = "per_expert", SyncClock()
        for name in ("router", "w1", "w2"):
            setattr(m, name, nn.Parameter(getattr(self, name).detach().float().clone()))
        return m

    def route(self, x: torch.Tensor, offset: Optional[torch.Tensor] = None) -> Routing:
        """The routing of ``x`` (its permutation, weights and group offsets)."""
        return Routing(x, self.router, TOP_K, offset)

    def forward(self, x: torch.Tensor, offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        r = self.route(x, offset)
        if self.gemm == "grouped":
            h = torch._grouped_mm(r.permute(x), self.w1.transpose(1, 2), offs=r.offs)
            a = hybridfp.swiglu(h) if self.fused_swiglu else swiglu(h)
            y = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=r.offs)
        else:
            splits = self.sync.counts(r.counts)
            y = _per_expert(swiglu(_per_expert(r.permute(x), self.w1, splits)), self.w2, splits)
        return r.unpermute(y, x.shape[0])

    def expert_grads(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(fc1's, fc2's) weight gradients, [E, out, in]."""
        return self.w1.grad, self.w2.grad


class HybridMoE(nn.Module):
    """The same layer with two hybridfp GroupedLinear (weights copied from the baseline).
    ``fused_swiglu``: the activation is ``hybridfp.swiglu`` on fc1's [rows, 2F] output with the
    experts' splits (one Triton kernel each way, its gradient written as one tensor, each
    expert's amax recorded for FP8 current scaling) instead of eager ``F.silu(g) * u``
    (:meth:`with_fused_swiglu`)."""

    fused_swiglu = False

    def __init__(self, base: BF16MoE, pack_weights: bool = True, single_parameter: bool = False) -> None:
        super().__init__()
        e, f2, d = base.w1.shape
        self.router, self.sync = nn.Parameter(base.router.detach().clone()), SyncClock()
        kw = {"bias": False, "params_dtype": torch.bfloat16, "device": common.DEVICE, "pack_weights": pack_weights,
              "single_parameter": single_parameter}
        self.fc1 = hybridfp.GroupedLinear(e, d, f2, name="experts.fc1", **kw)
        self.fc2 = hybridfp.GroupedLinear(e, f2 // 2, d, name="experts.fc2", **kw)
        with torch.no_grad():
            for fc, w in ((self.fc1, base.w1), (self.fc2, base.w2)):
                for mine, theirs in zip(fc.weights(), w):  # views of ``weight`` with single_parameter
                    mine.copy_(theirs)

    def forward(self, x: torch.Tensor, offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        r = Routing(x, self.router, TOP_K, offset)
        splits = self.sync.counts(r.counts)  # GroupedLinear takes host splits (one sync, as TE's)
        h = self.fc1(r.permute(x), splits)
        # the fused SwiGLU given the experts' rows records each expert's amax for fc2 / fc1's backward
        a = hybridfp.swiglu(h, splits=splits) if self.fused_swiglu else swiglu(h)
        return r.unpermute(self.fc2(a, splits), x.shape[0])

    def with_fused_swiglu(self) -> "HybridMoE":
        """This layer (its modules, weights and masters: a shallow copy) with the fused SwiGLU."""
        m = copy.copy(self)
        m.fused_swiglu = True
        return m

    def expert_grads(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(fc1's, fc2's) weight gradients, [E, out, in] (None where a weight has none)."""
        out = []
        for fc in (self.fc1, self.fc2):
            if fc.single_parameter:
                out.append(fc.weight.grad)
                continue
            gs = [getattr(fc, f"weight{i}").grad for i in range(fc.num_gemms)]
            out.append(None if any(g is None for g in gs) else torch.stack(gs))
        return out[0], out[1]


class PrimaryWeightsMoE(HybridMoE):
    """The hybridfp layer built under ``hybridfp.quantized_model_init(recipe=recipe)``: its
    expert weights held quantized (both copies), with FP32 masters (the BF16 values, widened).
    ``before_step`` re-encodes them from the masters (``hybridfp.quantize_master_weights``, as
    ``MasterWeightOptimizer.step`` does after its update): once a step, inside the timed step."""

    def __init__(self, base: BF16MoE, recipe: hybridfp.Recipe) -> None:
        with hybridfp.quantized_model_init(recipe=recipe):
            super().__init__(base)
        # the masters as MasterWeightOptimizer lays them out (a joined layer's in one [E, N, K]
        # buffer, read in place by the re-encode), holding the BF16 values
        opt = hybridfp.MasterWeightOptimizer(torch.optim.SGD, self.quantized_weights(), lr=0.0)
        self.masters = [opt.master_of(w) for w in self.quantized_weights()]
        with torch.no_grad():
            for m, w in zip(self.masters, (*base.w1, *base.w2)):
                m.copy_(w)
        self.before_step()

    def quantized_weights(self) -> list[torch.Tensor]:
        """The experts' weight parameters, fc1's then fc2's (the masters' order)."""
        return [getattr(fc, f"weight{i}") for fc in (self.fc1, self.fc2) for i in range(fc.num_gemms)]

    def before_step(self) -> None:
        hybridfp.quantize_master_weights(self.quantized_weights(), self.masters)


def moe_layer(e: int, f: int, tokens: int = TOKENS, d: int = HIDDEN, single_parameter: bool = False
              ) -> tuple[BF16MoE, "HybridMoE", torch.Tensor, torch.Tensor]:
    """(the BF16 baseline layer, the hybridfp layer with its weights, x, dy): seeded, on
    ``common.DEVICE``, as every MoE benchmark and diagnosis builds them; ``single_parameter``:
    the hybridfp layer's GroupedLinears hold one [E, N, K] weight Parameter each."""
    torch.manual_seed(0)
    base = BF16MoE(e, d, f)
    x = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16)
    return base, HybridMoE(base, single_parameter=single_parameter), x, dy


class Step:
    """One timed step: ``micro_batches`` forward + backward passes of ``x`` (gradients
    accumulating, as between two optimizer updates) in one autocast region, hybridfp's quantized
    weights cleared once at its start (re-quantized as after an optimizer update, then reused by
    the later micro-batches: a cached weight lives for its autocast region; a layer with a
    ``before_step`` method, ``PrimaryWeightsMoE``, has it called there instead). With a
    ``schedule``, call i routes its micro-batches with the schedule's step i (``reset`` starts
    again at step 0). Returns the micro-batches' outputs."""

    def __init__(self, model: nn.Module, x: torch.Tensor, dy: torch.Tensor, ctx: Optional[Callable[[], Any]],
                 micro_batches: int = 1, schedule: Optional[RoutingSchedule] = None) -> None:
        if schedule is not None and schedule.micro_batches != micro_batches:
            raise ValueError(f"Step: the routing schedule has {schedule.micro_batches} micro-batches a step, "
                             f"the step {micro_batches}")
        self.model, self.x, self.dy, self.ctx = model, x, dy, ctx
        self.micro_batches, self.schedule, self.calls = micro_batches, schedule, 0
        self.caches = [m for m in model.modules() if isinstance(m, QuantizedModule)]
        self.before_step = getattr(model, "before_step", None)

    def reset(self) -> None:
        """The next call routes with the schedule's first step."""
        self.calls = 0

    def release(self) -> None:
        """Drop the gradients the last call left (the layers of a run take turns: only the one
        running needs its gradients in memory)."""
        self.model.zero_grad(set_to_none=True)
        self.x.grad = None

    def __call__(self) -> list[torch.Tensor]:
        offsets = self.schedule(self.calls) if self.schedule is not None else [None] * self.micro_batches
        self.calls += 1
        self.model.zero_grad(set_to_none=True)
        self.x.grad = None
        for m in self.caches:
            m.invalidate_weight_cache()  # re-quantize weights every step (as after an optimizer step)
        if self.before_step is not None:
            self.before_step()  # quantized primary weights: re-encoded from their masters
        ys = []
        with (nullcontext() if self.ctx is None else self.ctx()):
            for off in offsets:
                # every pass routes anew: the metadata shared by one routing's calls is built once a pass
                clear_step_metadata()
                y = self.model(self.x, off)
                y.backward(self.dy)
                ys.append(y)
        return ys


def make_step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, ctx: Optional[Callable[[], Any]],
              micro_batches: int = 1, schedule: Optional[RoutingSchedule] = None) -> Step:
    """:class:`Step` (``schedule`` None: every micro-batch routes by the layer's router alone)."""
    return Step(model, x, dy, ctx, micro_batches, schedule)
