"""The fused SwiGLU kernels with and without the amax of their outputs (``known_amax``), at the
Llama-3-8B MLP's 16384 x 14336, against the amax passes they replace (``_common.global_amax`` of h, and of dg and du). CUDA-graph device time, ms.

    python -m bench.bench_swiglu_amax [--out results.json] [--quick]
"""

from __future__ import annotations

import torch

from bench.bench_quantize_kernels import graph_ms
from bench.common import environment, finish, md_table, parser, require_cuda


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    from hybridfp.kernels import _common, triton_swiglu as k

    m, n = (2048, 1024) if args.quick else (16384, 14336)
    g, u, dh = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    h = k.swiglu_forward(g, u)
    rows_out = [{"variant": "without amax", "fwd ms": graph_ms(lambda: k.swiglu_forward(g, u)),
                 "bwd ms": graph_ms(lambda: k.swiglu_backward(dh, g, u)),
                 "amax passes replaced ms": graph_ms(lambda: _common.global_amax(h))
                 + 2 * graph_ms(lambda: _common.global_amax(dh))}]
    b1, b2 = k.amax_buffer(g, 1), k.amax_buffer(g, 2)
    rows_out.append({"variant": "with amax", "fwd ms": graph_ms(lambda: k.swiglu_forward(g, u, amax_out=b1)),
                     "bwd ms": graph_ms(lambda: k.swiglu_backward(dh, g, u, amax_out=b2)),
                     "amax passes replaced ms": None})
    r0, r1 = rows_out
    r1["saved ms"] = r0["amax passes replaced ms"] - (r1["fwd ms"] - r0["fwd ms"]) - (r1["bwd ms"] - r0["bwd ms"])
    r0["saved ms"] = None
    cols = list(rows_out[0])
    md = (f"### Fused SwiGLU with the amax of its outputs, {m}x{n} BF16 (CUDA-graph device time)\n\n"
          + md_table(cols, [[r[c] for c in cols] for r in rows_out]) + "\n")
    finish("swiglu_amax", {"env": environment(), "rows": rows_out, "markdown": md}, args.out)


if __name__ == "__main__":
    main()
