"""The Llama-3-8B MLP step with and without the shared input quantization (gate and up read one
quantization of x, ``hybridfp/nn/shared_input.py``), alternating in one process; "separate"
runs the same step with the Linears' memo switched off. Also the device time of one step's
kernels (torch.profiler): a steadier measure of the small saving than the wall time.

    python -m bench.bench_shared_input [--out results.json] [--quick]
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Any, Callable, Iterator
from unittest import mock

import torch

import hybridfp
from bench import common
from bench.bench_moe import device_ms
from bench.bench_mlp import FUSED_RECIPES, MLP, RECIPES, fused_swiglu, hybridfp_linear, make_step
from bench.common import bench_pair, environment, finish, md_table, parser, require_cuda


@contextlib.contextmanager
def no_sharing() -> Iterator[None]:
    """Linears quantize their inputs without the region's memo inside (this process only: a
    measuring switch)."""
    from hybridfp.nn import linear_function, shared_input

    def separate(x, q, rowwise, columnwise, scratch):
        return shared_input.quantize_input(x, q, rowwise, columnwise, None)
    with mock.patch.object(linear_function, "quantize_input", separate):
        yield


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    tokens, d, h = (1024, 256, 512) if args.quick else (16384, 4096, 14336)
    torch.manual_seed(0)
    x = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16)
    base = MLP(hybridfp_linear, d, h)
    rows: list[dict[str, Any]] = []
    for name, recipe in RECIPES:
        if name not in FUSED_RECIPES:
            continue
        model = fused_swiglu(base)
        r = recipe()

        def ctx(r=r) -> Any:
            return hybridfp.autocast(recipe=r)

        def off(r=r) -> Any:
            stack = contextlib.ExitStack()
            stack.enter_context(no_sharing())
            stack.enter_context(hybridfp.autocast(recipe=r))
            return stack
        shared: Callable[[], Any] = make_step(model, list(base.parameters()), ctx, x, dy)
        separate = make_step(model, list(base.parameters()), off, x, dy)
        y1 = shared().detach().clone()
        y0 = separate().detach().clone()
        on_ms, off_ms = bench_pair(shared, separate, rounds=5)
        dev_on = statistics.median(device_ms(shared) for _ in range(3)) if x.is_cuda else on_ms
        dev_off = statistics.median(device_ms(separate) for _ in range(3)) if x.is_cuda else off_ms
        rows.append({"recipe": name + " + fused SwiGLU", "separate ms": off_ms, "shared ms": on_ms,
                     "saved ms": off_ms - on_ms, "kernel ms separate": dev_off, "kernel ms shared": dev_on,
                     "kernel ms saved": dev_off - dev_on, "outputs equal": bool(torch.equal(y0, y1))})
        if x.is_cuda:
            torch.cuda.empty_cache()
    cols = list(rows[0])
    md = (f"### MLP {tokens}x{d}->{h}->{d} fwd+bwd: gate and up quantize x separately vs once "
          "(do_bench medians, alternating; \"kernel ms\": device time of one step's kernels, torch.profiler, "
          "median of 3)\n\n" + md_table(cols, [[r[c] for c in cols] for r in rows]) + "\n")
    finish("shared_input", {"env": environment(), "rows": rows, "markdown": md}, args.out)


if __name__ == "__main__":
    main()
