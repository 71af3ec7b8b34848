"""Does ``torch._scaled_mm`` take row-major FP8 operands with a row stride larger than their
width (a column slice of a wider [C, R] buffer, e.g. one expert's columnwise copy inside an
all-experts transpose) without a copy, and is the result the contiguous operands' bitwise?

A design question for MoE FP8 columnwise copies held as one joined [C, Σ padded m] matrix (see
notes/next_steps.md): ``kernels/cublas_fp8._ready`` copies any non-contiguous operand today.
Prints, per case, whether the call ran, its time against the contiguous operands', and
whether the results are equal.

    python -m bench.diag_scaled_mm_strides
"""

from __future__ import annotations

import torch

from bench.common import bench_ms, require_cuda


#: (m, n, k, width of the buffer the strided operands are column slices of): a 64-expert wgrad
#: (ffn 1408) and the 8-expert layer's fc1 / fc2 wgrads (ffn 14336, ~4096 tokens per expert)
SHAPES = [(4096, 2816, 512, 32768), (28672, 4096, 4096, 32896), (4096, 14336, 4096, 32896)]


def main() -> None:
    require_cuda()
    for m, n, k, wide in SHAPES:
        print(f"[{m}, {k}] x [{n}, {k}] in rows of {wide}:")
        _case(m, n, k, wide)


def _case(m: int, n: int, k: int, wide: int) -> None:
    one = torch.ones((), device="cuda")
    a_buf = (torch.randn(m, wide, device="cuda") * 4).to(torch.float8_e5m2)
    b_buf = (torch.randn(n, wide, device="cuda") * 4).to(torch.float8_e4m3fn)
    a, b = a_buf[:, 1024:1024 + k], b_buf[:, 1024:1024 + k]  # row stride 32768 > k
    ac, bc = a.contiguous(), b.contiguous()
    want = torch._scaled_mm(ac, bc.t(), one, one, out_dtype=torch.bfloat16)
    t_c = bench_ms(lambda: torch._scaled_mm(ac, bc.t(), one, one, out_dtype=torch.bfloat16), 50, 200)
    for name, x, y in (("A strided", a, bc), ("B strided", ac, b), ("both strided", a, b)):
        try:
            got = torch._scaled_mm(x, y.t(), one, one, out_dtype=torch.bfloat16)
            t = bench_ms(lambda: torch._scaled_mm(x, y.t(), one, one, out_dtype=torch.bfloat16), 50, 200)
            print(f"  {name}: ran, {t:.3f} ms vs contiguous {t_c:.3f} ms, bitwise equal: {torch.equal(got, want)}")
        except Exception as e:  # noqa: BLE001 - the question is whether it raises
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
