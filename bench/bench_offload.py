"""CPU offload of saved activations (``hybridfp.get_cpu_offload_context``) on a 4-layer model:
peak GPU memory and step time with and without, and whether the gradients are bitwise equal.

Layer: x + fc2(swiglu(fc1(norm(x)))) with LayerNormLinear(D, 2H) and Linear(H, D), D 4096,
H 11008 (Llama-2-7B's MLP), 8192 tokens, BF16 parameters and activations. Offload: the first 3
of 4 layers (TE's schedule). Peak = ``torch.cuda.max_memory_allocated`` over one step (forward +
backward), "after forward" = allocated when the forward returns, both above the memory held
before the step (parameters, inputs). Step time: a paired ratio (``bench.protocol.paired_ratio``)
of the step with offload against the same step without it (the baseline): the median over
alternating rounds of time without / time with, with its ≥ 95 % interval (below 1: offload costs
time); "step cost" is its inverse. Output check: the forward output and the gradients with
offload equal those without, bit for bit (offload moves saved tensors, the arithmetic is the
same); a difference fails the run, as does a step without offload that cannot run (``MissingBaselineError``).

    python -m bench.bench_offload [--out results.json] [--quick] [--rounds N] [--samples N]
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

import hybridfp
from bench.common import (AccuracyError, MissingBaselineError, environment, finish, md_table, parser,
                          protocol_from, protocol_record, require_baseline, require_cuda)
from bench.protocol import Protocol, paired_ratio

RECIPES: dict[str, Callable[[], Any]] = {
    "FP8 current": lambda: hybridfp.Float8CurrentScaling(),
    "MXFP8": lambda: hybridfp.MXFP8BlockScaling(),
}
LAYERS, OFFLOADED = 4, 3


class Layer(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device="cuda")
        self.fc1 = hybridfp.LayerNormLinear(d, 2 * h, bias=False, **kw)
        self.fc2 = hybridfp.Linear(h, d, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.fc1(x).chunk(2, dim=-1)
        return x + self.fc2(hybridfp.swiglu(g, u))


def step(layers: nn.ModuleList, x: torch.Tensor, recipe: Any, offload: Any) -> torch.Tensor:
    """One forward + backward (gradients of the parameters and of ``x`` set afresh); returns the
    forward's output."""
    _clear_grads(layers, x)
    h = _forward(layers, x, recipe, offload)
    h.float().square().mean().backward()
    return h


def _clear_grads(layers: nn.ModuleList, x: torch.Tensor) -> None:
    for p in layers.parameters():
        p.grad = None
    x.grad = None


def _forward(layers: nn.ModuleList, x: torch.Tensor, recipe: Any, offload: Any) -> torch.Tensor:
    """The forward through ``layers`` under ``offload`` (its context and its sync after each layer)."""
    context, sync = offload
    with hybridfp.autocast(recipe=recipe):
        h = x
        for layer in layers:
            with context:
                h = layer(h)
            h = sync(h)
    return h


def memory_step(layers: nn.ModuleList, x: torch.Tensor, recipe: Any, offload: Any) -> dict[str, float]:
    """One forward + backward; GiB allocated when the forward returns and at the peak, above what
    was allocated before."""
    _clear_grads(layers, x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    h = _forward(layers, x, recipe, offload)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated() - base
    h.float().square().mean().backward()
    torch.cuda.synchronize()
    return dict(after_forward_gib=after_forward / 2**30,
                peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)


def check_grads(what: str, got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> None:
    """``AccuracyError`` naming the first gradient of ``got`` (with offload) that is not ``want``'s
    (without) bit for bit."""
    if len(got) != len(want):
        raise AccuracyError(f"{what}: {len(got)} gradients with offload, {len(want)} without")
    for name, a, b in zip(names, got, want):
        if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
            raise AccuracyError(f"{what}: gradient of {name} with offload differs from the one without, bit for "
                                "bit (offload must move saved tensors without changing them)")


def offload_row(recipe: str, run: Callable[[str], Any], grads: Callable[[], list[torch.Tensor]],
                names: list[str], memory: Callable[[str], dict[str, float]], stats: Any,
                protocol: Protocol) -> dict[str, Any]:
    """One recipe's row: ``run(label)`` one step without ("off", the baseline) or with ("on")
    offload, returning its forward output; ``grads()`` the gradients the last step left;
    ``memory(label)`` one measured step; ``stats`` the offload context's counters.

    Raises ``MissingBaselineError`` when the step without offload cannot run, ``AccuracyError``
    when the forward output (what ``run`` returns) or a gradient differs, bit for bit."""
    off = require_baseline(f"offload {recipe}", "the step without offload", lambda: (lambda: run("off")))
    out_off = off()  # the baseline's output and gradients, then the offloaded step's
    want = [g.clone() for g in grads()]
    out_on = run("on")
    if not torch.equal(out_on, out_off):
        raise AccuracyError(f"offload {recipe}: the forward output with offload differs from the one without, "
                            "bit for bit")
    check_grads(f"offload {recipe}", grads(), want, names)
    del want, out_off, out_on
    mem = {"off": memory("off")}
    moved, late = stats.offloaded_bytes, stats.late_reloads
    mem["on"] = memory("on")  # the counters' change over this one step
    moved, late = stats.offloaded_bytes - moved, stats.late_reloads - late
    r = paired_ratio(off, lambda: run("on"), protocol)
    return dict(recipe=recipe, bitwise=True, ms_off=r.baseline_ms, ms_on=r.candidate_ms, vs_no_offload=r.as_dict(),
                step_cost=1.0 / r.ratio, **{f"{k}_{label}": v for label, m in mem.items() for k, v in m.items()},
                peak_saved_gib=mem["off"]["peak_gib"] - mem["on"]["peak_gib"],
                offloaded_gib_per_step=moved / 2**30, late_reloads=late)


def _ci(p: dict[str, Any]) -> str:
    return f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]"


def main(argv: Optional[list[str]] = None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    protocol = protocol_from(args)
    d, h, tokens = (1024, 2816, 2048) if args.quick else (4096, 11008, 8192)
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(d, h) for _ in range(LAYERS))
    x = torch.randn(tokens, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    names = [n for n, _ in layers.named_parameters()] + ["x"]
    rows, failures = [], []
    for name, make in RECIPES.items():
        recipe = make()
        contexts = {"off": hybridfp.get_cpu_offload_context(enabled=False),
                    "on": hybridfp.get_cpu_offload_context(enabled=True, num_layers=OFFLOADED, model_layers=LAYERS)}
        try:
            rows.append(offload_row(name, lambda label: step(layers, x, recipe, contexts[label]),
                                    lambda: [p.grad for p in layers.parameters()] + [x.grad], names,
                                    lambda label: memory_step(layers, x, recipe, contexts[label]),
                                    contexts["on"][0].stats, protocol))
        except (AccuracyError, MissingBaselineError) as e:
            failures.append(str(e))
            rows.append(dict(recipe=name, error=str(e)))
    ok = [r for r in rows if "error" not in r]
    md = (f"### CPU offload, {LAYERS} layers (first {OFFLOADED} offloaded), D {d}, H {h}, {tokens} tokens, BF16\n\n"
          f"x without offload: median over {protocol.rounds} alternating rounds ({protocol.samples} steps a side "
          "each) of step time without / with offload, [≥ 95 % interval]; output and gradients equal bit for bit."
          + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 rounds or samples).") + "\n\n"
          + md_table(["recipe", "peak GiB off / on", "after fwd GiB off / on", "step ms off / on",
                      "x without offload [interval]", "moved GiB / step", "late reloads"],
                     [(r["recipe"], f"{r['peak_gib_off']:.2f} / {r['peak_gib_on']:.2f}",
                       f"{r['after_forward_gib_off']:.2f} / {r['after_forward_gib_on']:.2f}",
                       f"{r['ms_off']:.1f} / {r['ms_on']:.1f}", _ci(r["vs_no_offload"]),
                       r["offloaded_gib_per_step"], r["late_reloads"]) for r in ok]
                     + [(r["recipe"], "FAILED", r["error"]) + ("",) * 4 for r in rows if "error" in r]) + "\n")
    finish("offload", {"env": environment(), "protocol": protocol_record(protocol), "args": {"quick": args.quick},
                       "rows": rows, "failures": failures, "markdown": md}, args.out)
    if failures:
        raise SystemExit("offload failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
