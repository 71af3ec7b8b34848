"""Diagnostic (session 16): the FP8 grouped GEMM's wgrad at the 64-expert MoE shapes as a
persistent kernel — a grid of a few programs per SM, each looping over output tiles — against the
one-program-per-tile kernel (``triton_grouped_fp8_gemm``). Each expert's reduction is its ~500
tokens, so a tile's K loop is 8 steps and pipeline fill plus the epilogue dominate; with the tile
loop flattened into the K loop (``tl.range(..., flatten=True)``) the compiler may prefetch the next
tile's operands during the current tile's epilogue. Bitwise check against the plain kernel, then
device time (do_bench, L2 flushed) per variant.

    python -m bench.diag_wgrad_persistent
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench import common
from bench.bench_grouped_fp8 import splits_for
from hybridfp.kernels import triton_grouped_fp8_gemm as tk
from hybridfp.kernels._common import bf16_nan16, expert_row_tile, swizzled_tile
from hybridfp.kernels.host import tile_plan, to_device
from hybridfp.kernels.triton_epilogue import OUT_CODE, store_out


@triton.jit
def _persistent(a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, meta_ptr, T, N, E, NAN16: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ALIGN: tl.constexpr, GROUP: tl.constexpr,
                PROMOTE: tl.constexpr, EP: tl.constexpr, FLAT: tl.constexpr, OUT: tl.constexpr):
    total = T * tl.cdiv(N, BN)
    for pid in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLAT):
        t, j = swizzled_tile(pid, T, N, BN, GROUP)
        e, te = expert_row_tile(meta_ptr, t, E, EP)
        meta = meta_ptr + (E + 1) + e.to(tl.int64) * 7
        a_off = tl.multiple_of(tl.load(meta), ALIGN)
        a_ld = tl.multiple_of(tl.load(meta + 1), ALIGN)
        b_off = tl.multiple_of(tl.load(meta + 2), ALIGN)
        b_ld = tl.multiple_of(tl.load(meta + 3), ALIGN)
        k_e = tl.multiple_of(tl.load(meta + 4), ALIGN)
        o_row = tl.load(meta + 5)
        rows = te * BM + tl.arange(0, BM)
        cols = j * BN + tl.arange(0, BN)
        rmask, cmask = rows < tl.load(meta + 6), cols < N
        kk = tl.arange(0, BK)
        a_ptrs = a_ptr + a_off + rows.to(tl.int64)[:, None] * a_ld + kk[None, :]
        b_ptrs = b_ptr + b_off + cols.to(tl.int64)[None, :] * b_ld + kk[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, k_e, BK):
            kmask = (k + kk) < k_e
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
            a_ptrs += BK
            b_ptrs += BK
        e64 = e.to(tl.int64)
        v = acc * (tl.load(sa_ptr + e64) * tl.load(sb_ptr + e64))
        optrs = out_ptr + (o_row + rows.to(tl.int64))[:, None] * N + cols.to(tl.int64)[None, :]
        store_out(optrs, v, rmask[:, None] & cmask[None, :], OUT, NAN16)


def run_persistent(a, b, ms, a_offs, a_ld, b_offs, b_ld, ks, sa, sb, out, out_rows, tile, programs, flat):
    bm, bn, bk, warps, stages = tile
    e = len(ms)
    m = torch.tensor(ms, dtype=torch.int64)
    meta = torch.stack([torch.tensor(a_offs), torch.full((e,), a_ld), torch.tensor(b_offs), torch.full((e,), b_ld),
                        torch.tensor(ks), torch.tensor(out_rows), m], 1).to(torch.int64)
    packed, row_tiles = tile_plan(m, meta, bm)
    packed = to_device(packed, out.device)
    n = out.shape[1]
    grid = (min(programs, row_tiles * triton.cdiv(n, bn)),)

    def launch():
        _persistent[grid](a, b, sa, sb, out.view(torch.int16), packed, row_tiles, n, e, NAN16=bf16_nan16(out.device),
                          BM=bm, BN=bn, BK=bk, ALIGN=16, GROUP=8, PROMOTE=min(128, bk),
                          EP=triton.next_power_of_2(e + 1), FLAT=flat, OUT=OUT_CODE[out.dtype], num_warps=warps,
                          num_stages=stages, enable_fp_fusion=False)
    return launch


def main() -> None:
    common.require_cuda()
    experts, hidden, ffn, rows = 64, 4096, 1408, 32768
    splits = splits_for(rows, experts)
    lds = [-(-m // 16) * 16 for m in splits]
    starts = [sum(lds[:i]) for i in range(experts)]
    width = sum(lds)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sa = torch.rand(experts, device="cuda") + 0.5
    sb = torch.rand(experts, device="cuda") + 0.5
    table = []
    for name, n_rows, k_rows in (("fc1 wgrad", 2 * ffn, hidden), ("fc2 wgrad", hidden, ffn)):
        a = (torch.randn(n_rows, width, device="cuda") * 4).to(torch.float8_e5m2)
        b = (torch.randn(k_rows, width, device="cuda") * 4).to(torch.float8_e4m3fn)
        out_rows = [i * n_rows for i in range(experts)]
        ref = torch.empty(experts * n_rows, k_rows, device="cuda", dtype=torch.bfloat16)
        args = (a, b, [n_rows] * experts, starts, width, starts, width, lds, sa, sb)

        def plain():
            tk.grouped_fp8_at(*args, ref, out_rows, tile=tk.WGRAD_TILE)
        plain()
        base = common.bench_ms(plain, 100, 500)
        table.append((name, f"plain {tk.WGRAD_TILE}", base, 1.0, True))
        for tile in (tk.WGRAD_TILE, (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)):
            for per_sm in (1, 2, 3):
                for flat in (False, True):
                    out = torch.full_like(ref, float("nan"))
                    try:
                        fn = run_persistent(a, b, [n_rows] * experts, starts, width, starts, width, lds, sa, sb, out,
                                            out_rows, tile, per_sm * sms, flat)
                        fn()
                        same = bool(torch.equal(out, ref))
                        ms = common.bench_ms(fn, 100, 500)
                        table.append((name, f"persistent {tile} x{per_sm}/SM flat={flat}", ms, base / ms, same))
                    except Exception as ex:  # noqa: BLE001 - report a variant that does not compile
                        table.append((name, f"persistent {tile} x{per_sm}/SM flat={flat}: {type(ex).__name__} "
                                      f"{str(ex)[:80]}", float("nan"), float("nan"), False))
    print("| GEMM | variant | ms | x plain | bitwise |\n|---|---|---|---|---|")
    for r in table:
        print(f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.3f} | {r[4]} |")


if __name__ == "__main__":
    main()
