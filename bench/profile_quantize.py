"""Where a quantize() call's time goes: each CUDA kernel's device time (torch.profiler) next to
the do_bench wall time, per quantizer and copy set, at the BF16 [16384, 4096] activation.

    python -m bench.profile_quantize [--out profile.json] [--quick]

"kernels ms" is the sum of the device time of the kernels one call launches; "wall ms" the
do_bench median of the same call; wall - kernels is what the host (Python, launches, syncs)
adds when the GPU waits for it. Each kernel row gives its own GB/s-equivalent share, so a
slow pass (amax, cast) is named.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch

from bench import common
from bench.bench_quantize import QUANTIZERS, cases
from bench.common import bench_ms, copy_bandwidth, environment, finish, md_table, parser, require_cuda

CALLS = 20


def kernel_times(fn, calls: int = CALLS) -> dict[str, float]:
    """Mean device ms per call of each kernel name that ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time_total / 1e3 / calls  # ms per call
    return dict(per)


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    warnings.simplefilter("ignore")
    env = environment()
    copy = copy_bandwidth()
    shape = (2048, 4096) if args.quick else (16384, 4096)
    x = torch.randn(*shape, device=common.DEVICE, dtype=torch.bfloat16)
    in_ms = x.numel() * x.element_size() / (copy["GBps"] / 2) / 1e6  # one read at half the copy rate
    rows: list[dict[str, Any]] = []
    for name, make in QUANTIZERS:
        for dname, _, _, q in cases(name, make):
            try:
                with torch.no_grad():
                    wall = bench_ms(lambda: q.quantize(x), warmup_ms=10, rep_ms=60)
                    ks = kernel_times(lambda: q.quantize(x))
            except Exception as e:  # noqa: BLE001 - a row records the failure
                rows.append({"quantizer": name, "directions": dname, "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append({"quantizer": name, "directions": dname, "wall_ms": wall,
                         "kernels_ms": sum(ks.values()), "kernels": ks})
    table = md_table(["quantizer", "copies", "wall ms", "kernels ms", "kernels (ms each)"], [
        (r["quantizer"], r["directions"], r.get("wall_ms"), r.get("kernels_ms"),
         r.get("error") or "; ".join(f"{k} {v:.4f}" for k, v in sorted(r["kernels"].items(), key=lambda t: -t[1])))
        for r in rows])
    md = (f"### Quantize kernels' device time, BF16 input {list(shape)}\n\n"
          f"Copy bandwidth {copy['GBps']:.0f} GB/s: reading the input once takes {in_ms:.4f} ms.\n\n" + table + "\n")
    finish("profile_quantize", {"env": env, "copy_bandwidth": copy, "shape": list(shape), "rows": rows,
                                "markdown": md}, args.out)


if __name__ == "__main__":
    main()
