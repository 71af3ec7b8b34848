"""Diagnosis (H200): why the fused SwiGLU forward took ~0.95 ms inside the FP8-current MLP step
(s12 profile) against ~0.45 ms standalone at the same 16384x14336 shape.

In one process: (1) the step's g / u as the gate / up Linears hand them over (shape, strides,
contiguity, data pointers' alignment), (2) ``swiglu_forward`` timed (CUDA graph-free
``do_bench``) on those exact tensors and on fresh contiguous ones, with and without the amax,
(3) one profiled step's kernels by device time. Prints a short report.

    python -m bench.diag_swiglu_in_step
"""

from __future__ import annotations

import torch
import triton.testing

import hybridfp
from bench import common
from bench.bench_mlp import MLP, D, H, TOKENS, hybridfp_linear
from bench.common import profile_step, require_cuda
from hybridfp.kernels import triton_swiglu


def main() -> None:
    require_cuda()
    torch.manual_seed(0)
    model = MLP(hybridfp_linear, D, H, act=hybridfp.swiglu)
    x = torch.randn(TOKENS, D, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, D, device=common.DEVICE, dtype=torch.bfloat16)
    seen: dict[str, torch.Tensor] = {}

    def grab(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        seen["g"], seen["u"] = g, u
        return hybridfp.swiglu(g, u)

    model.act = grab
    recipe = hybridfp.Float8CurrentScaling()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with hybridfp.autocast(recipe=recipe):
            y = model(x)
        y.backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    g, u = seen["g"].detach(), seen["u"].detach()
    print(f"step g: {tuple(g.shape)} strides {g.stride()} contiguous {g.is_contiguous()} "
          f"ptr%256 {g.data_ptr() % 256} dtype {g.dtype}; u strides {u.stride()} ptr%256 {u.data_ptr() % 256}")
    fg, fu = torch.randn_like(g), torch.randn_like(u)
    buf = triton_swiglu.amax_buffer(g, 1)
    rows = []
    for name, (a, b) in {"step tensors": (g, u), "fresh contiguous": (fg, fu)}.items():
        for amax in (False, True):
            fn = (lambda a=a, b=b: triton_swiglu.swiglu_forward(a, b, amax_out=buf)) if amax else (
                lambda a=a, b=b: triton_swiglu.swiglu_forward(a, b))
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            rows.append((name, amax, ms))
    print("| inputs | amax | ms |\n|---|---|---|")
    for name, amax, ms in rows:
        print(f"| {name} | {amax} | {ms:.4f} |")
    text = profile_step(step, "FP8 current MLP step, fused SwiGLU")
    print("\n".join(text.splitlines()[:30]))


if __name__ == "__main__":
    main()
