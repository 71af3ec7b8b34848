"""CPU offload of saved activations (``hybridfp.get_cpu_offload_context``) on a 4-layer model:
peak GPU memory and step time with and without, and whether the gradients are bitwise equal.

Layer: x + fc2(swiglu(fc1(norm(x)))) with LayerNormLinear(D, 2H) and Linear(H, D), D 4096,
H 11008 (Llama-2-7B's MLP), 8192 tokens, BF16 parameters and activations. Offload: the first 3
of 4 layers (TE's schedule). Peak = ``torch.cuda.max_memory_allocated`` over one step (forward +
backward), "after forward" = allocated when the forward returns, both above the memory held
before the step (parameters, inputs). Step ms: median of alternating timed steps, each
synchronized.

    python -m bench.bench_offload [--out results.json] [--quick]
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

import hybridfp
from bench.common import environment, finish, md_table, parser, require_cuda

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


def step(layers: nn.ModuleList, x: torch.Tensor, recipe: Any, offload: Any) -> dict[str, float]:
    """One forward + backward; memory figures in GiB above what was allocated before."""
    for p in layers.parameters():
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    context, sync = offload
    with hybridfp.autocast(recipe=recipe):
        h = x
        for layer in layers:
            with context:
                h = layer(h)
            h = sync(h)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated() - base
    h.float().square().mean().backward()
    torch.cuda.synchronize()
    return dict(ms=(time.perf_counter() - t0) * 1e3, after_forward_gib=after_forward / 2**30,
                peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    require_cuda()
    d, h, tokens = (1024, 2816, 2048) if args.quick else (4096, 11008, 8192)
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(d, h) for _ in range(LAYERS))
    x = torch.randn(tokens, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    rows = []
    for name, make in RECIPES.items():
        recipe = make()
        plain = (hybridfp.get_cpu_offload_context(enabled=False))
        offload = hybridfp.get_cpu_offload_context(enabled=True, num_layers=OFFLOADED, model_layers=LAYERS)
        grads = {}
        for label, o in (("off", plain), ("on", offload)):
            step(layers, x, recipe, o)  # warm-up (and the gradients compared below)
            grads[label] = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
            x.grad = None
        bitwise = all(torch.equal(a, b) for a, b in zip(grads["on"], grads["off"]))
        del grads
        runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        for _ in range(3 if args.quick else 7):
            for label, o in (("off", plain), ("on", offload)):
                runs[label].append(step(layers, x, recipe, o))
                x.grad = None
        med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
        stats = offload[0].stats
        per_step = max(1, len(runs["on"]) + 1)
        rows.append(dict(recipe=name, bitwise=bitwise, **{f"{k}_{label}": v for label, m in med.items() for k, v in m.items()},
                         peak_saved_gib=med["off"]["peak_gib"] - med["on"]["peak_gib"],
                         step_cost=med["on"]["ms"] / med["off"]["ms"],
                         offloaded_gib_per_step=stats.offloaded_bytes / per_step / 2**30,
                         late_reloads=stats.late_reloads))
    md = (f"### CPU offload, {LAYERS} layers (first {OFFLOADED} offloaded), D {d}, H {h}, {tokens} tokens, BF16\n\n"
          + md_table(["recipe", "peak GiB off / on", "after fwd GiB off / on", "step ms off / on", "step cost",
                      "moved GiB / step", "late reloads", "bitwise grads"],
                     [(r["recipe"], f"{r['peak_gib_off']:.2f} / {r['peak_gib_on']:.2f}",
                       f"{r['after_forward_gib_off']:.2f} / {r['after_forward_gib_on']:.2f}",
                       f"{r['ms_off']:.1f} / {r['ms_on']:.1f}", f"{r['step_cost']:.3f}x",
                       r["offloaded_gib_per_step"], r["late_reloads"], r["bitwise"]) for r in rows]) + "\n")
    finish("offload", {"env": environment(), "args": {"quick": args.quick}, "rows": rows, "markdown": md}, args.out)


if __name__ == "__main__":
    main()
