"""The Triton grouped GEMM kernels against ``torch._grouped_mm`` and cuBLAS, at the MoE layer's shapes.

- ``bf16``: ``kernels/moe/triton_grouped_gemm.py`` (BF16 operands, the per-row / per-column FP32
  epilogue of row-scaled NVFP4) at the 8-expert MoE's fc1 / fc2 fprop (awkward counts, an empty
  expert). Every TMA config (``TMA_CONFIGS``) against ``torch._grouped_mm`` without an epilogue
  (the speed the kernel should approach), the pointer kernel at its default tile, and cuBLAS per
  expert with an FP32 output plus the epilogue as torch ops. ``torch._grouped_mm`` with an FP32
  output is no baseline: torch refuses it for BF16 inputs.
- ``fp8``: ``kernels/moe/triton_grouped_fp8_gemm.py`` / ``triton_grouped_fp8_tma.py`` at the
  64-expert MoE's six GEMMs (hidden 4096, ffn 1408, 32768 routed rows, uneven counts): the
  pointer kernel's default tile and the TMA configs (``CONFIGS``) against the per-expert cuBLAS
  ``_scaled_mm`` loop, ``torch._scaled_grouped_mm`` where it applies (E4M3 fprop / dgrad) and
  ``torch._grouped_mm`` on BF16 operands of the same shape (the MoE benchmark's baseline).

Every ratio is paired (``bench.protocol.paired_ratio``: the median over alternating rounds of
baseline time / variant time, with its ≥ 95 % interval; > 1: faster than the baseline); a
variant's ms and TFLOP/s are its side's median in its first pair, a baseline's the median of its
sides over all its pairs. Every output (baselines' too) is checked first against the FP32 product
of the same operand values, expert by expert, scales applied (``check_grouped``, within
``OUTPUT_BOUND``); one beyond it fails the run, as does a baseline that cannot run
(``MissingBaselineError``, by name). A config that does not fit (shared memory) is reported as
its error.

    python -m bench.bench_grouped_gemm [--out results.json] [--quick] [--part bf16|fp8] [--rounds N] [--samples N]
        [--configs 'NAME|NAME']           # only these TMA configs
        [--f32]                           # bf16: the FP32-output configs (TMA_F32_CONFIGS)
        [--pointer-tiles [--wgrad]]       # the pointer kernels' tile sweeps instead
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Optional, Sequence

import torch

from bench import common
from bench.common import (AccuracyError, MissingBaselineError, check_error, environment, error_bound, finish,
                          md_table, parser, protocol_from, protocol_record, require_baseline, require_cuda)
from bench.protocol import Protocol, paired_ratio

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: (A_e [m_e, k_e], B_e [n, k_e], row scale [m_e] or None, column scale [n] / scalar or None): one
#: expert's product ``(A_e @ B_e^T) * row[:, None] * col``; a grouped output stacks them by rows
Block = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]
#: a timed call returning its output (a tensor, or a list of per-expert tensors) and its blocks
Case = tuple[Callable[[], Any], list[Block]]
#: bound on a grouped GEMM's relative error vs the FP32 product of the same operand values: the
#: operands are exact (BF16 or FP8 values multiplied again in FP32), so only the FP32
#: accumulation and the BF16 output's rounding remain: one GEMM's bound at BF16
OUTPUT_BOUND = error_bound("bf16", "bf16", 1, 0)


def grouped_rel_error(out: Any, blocks: Sequence[Block]) -> float:
    """Relative Frobenius error of a grouped GEMM's output against its FP32 reference, computed
    one expert at a time (the reference of a whole MoE GEMM need not fit at once).

    ``out``: [sum m_e, n] (or [E, m, n], or a list of the non-empty experts' [m_e, n]): the
    experts' products stacked by rows, in ``blocks`` order."""
    if isinstance(out, (list, tuple)):
        out = torch.cat([o.reshape(-1, o.shape[-1]) for o in out]) if out else torch.empty(0, 0)
    out = out.reshape(-1, out.shape[-1])
    rows = sum(a.shape[0] for a, _, _, _ in blocks)
    if out.shape[0] != rows:
        raise AccuracyError(f"grouped output has {out.shape[0]} rows; its experts' blocks hold {rows}")
    num = den = 0.0
    r = 0
    for a, b, rs, cs in blocks:
        m = a.shape[0]
        if m == 0:
            continue
        ref = a.float() @ b.float().t()
        if rs is not None:
            ref = ref * rs.float()[:, None]
        if cs is not None:
            ref = ref * cs.float()
        got = out[r:r + m].float()
        num += (got - ref).square().sum().item()
        den += ref.square().sum().item()
        r += m
    return (num ** 0.5 / den ** 0.5) if den > 0 else (0.0 if num == 0 else float("inf"))


def check_grouped(what: str, out: Any, blocks: Sequence[Block], bound: float = OUTPUT_BOUND) -> float:
    """``grouped_rel_error`` of ``out``, raising ``AccuracyError`` naming ``what`` beyond ``bound``."""
    err = grouped_rel_error(out, blocks)
    check_error(what, err, bound)
    return err


def _does_not_fit(e: Exception) -> bool:
    """Whether ``e`` is Triton's refusal of a tile config needing more shared memory or registers
    than the GPU has (a sweep's config that does not fit, not a kernel failure)."""
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # no Triton: nothing of it was refused
        return False
    return isinstance(e, OutOfResources)


def measure(part: str, gemm: str, flop: float, baselines: dict[str, tuple[str, Case]],
            variants: dict[str, Case], protocol: Protocol, failures: list[str]) -> list[dict[str, Any]]:
    """Rows of one GEMM: each baseline (``key -> (name, case)``: the row field its ratios go to)
    and each variant checked, then every variant paired against every baseline.

    A variant Triton refuses for want of shared memory or registers (a tile config that does not
    fit this GPU) is a row with its ``error``; one that raises anything else, or is beyond its
    bound, is such a row and also goes to ``failures`` (the run then fails). Raises
    ``MissingBaselineError`` naming a baseline that cannot run, ``AccuracyError`` for a baseline
    beyond its bound."""
    where = f"grouped_gemm {part} {gemm}"
    steps: dict[str, Callable[[], Any]] = {}
    for key, (name, (step, blocks)) in baselines.items():
        steps[key] = require_baseline(where, name, lambda step=step: step)
        check_grouped(f"{where}: baseline {name}", step(), blocks)
    rows: list[dict[str, Any]] = []
    base_ms: dict[str, list[float]] = {key: [] for key in baselines}
    for variant, (step, blocks) in variants.items():
        row: dict[str, Any] = dict(part=part, gemm=gemm, variant=variant)
        try:
            row["rel_err"] = check_grouped(f"{where}: {variant}", step(), blocks)
            pairs = {key: paired_ratio(base, step, protocol) for key, base in steps.items()}
        except AccuracyError as e:
            failures.append(str(e))
            rows.append({**row, "error": str(e)})
            continue
        except Exception as e:  # noqa: BLE001 - reported in the row; only a config that does not fit passes
            error, fits = f"{type(e).__name__}: {str(e)[:100]}", not _does_not_fit(e)
            rows.append({**row, "error": error, **({} if fits else {"does_not_fit": True})})
            if fits:
                failures.append(f"{where}: {variant}: {error}")
            continue
        ms = next(iter(pairs.values())).candidate_ms
        row.update(ms=ms, tflops=flop / ms / 1e9)
        for key, r in pairs.items():
            row[key] = r.as_dict()
            row[key + "_text"] = f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}]"
            base_ms[key].append(r.baseline_ms)
        rows.append(row)
    head = []
    for key, (name, _) in baselines.items():
        ms = statistics.median(base_ms[key]) if base_ms[key] else None
        head.append(dict(part=part, gemm=gemm, variant=name, baseline=key, ms=ms,
                         tflops=flop / ms / 1e9 if ms else None))
    return head + rows

# --- BF16 grouped GEMM, the 8-expert MoE's fprop ---------------------------------------------

#: (name, rows per expert, K, N): fc1 and fc2 of the 8-expert MoE layer of bench_moe
BF16_SHAPES = [("fc1 fprop 8x(4096->28672)", [4099, 0, 1, 5077, 6000, 31, 8192, 9368], 4096, 28672),
               ("fc2 fprop 8x(14336->4096)", [4099, 0, 1, 5077, 6000, 31, 8192, 9368], 14336, 4096)]
#: ((BM, BN, BK, warps, stages), group_m: the L2 swizzle's row tiles per group, 1 = none)
BF16_TILES = [((128, 256, 64, 8, 3), 1), ((128, 128, 64, 8, 3), 8), ((128, 256, 64, 8, 3), 8),
              ((128, 256, 64, 8, 3), 16), ((128, 256, 64, 8, 4), 8), ((256, 128, 64, 8, 3), 8),
              ((256, 128, 64, 8, 4), 8), ((128, 256, 32, 8, 5), 8), ((128, 128, 64, 4, 4), 8)]

#: ``variants(tg, a, b, sa, sb, splits)``: name -> (the call, whether its output carries the
#: row-scaled NVFP4 epilogue's scales)
Variants = Callable[..., dict[str, tuple[Callable[[], Any], bool]]]


def bf16_blocks(a: torch.Tensor, b: torch.Tensor, splits: list[int], sa: Optional[torch.Tensor] = None,
                sb: Optional[torch.Tensor] = None) -> list[Block]:
    """Expert e's block of the BF16 grouped GEMM: its rows of ``a`` times ``b[e]`` ([n, k]), with the
    per-row / per-column scales where given."""
    out, r = [], 0
    for e, m in enumerate(splits):
        out.append((a[r:r + m], b[e], None if sa is None else sa[r:r + m], None if sb is None else sb[e]))
        r += m
    return out


def _bf16_sweep(variants: Variants, protocol: Protocol, failures: list[str]) -> list[dict[str, Any]]:
    """One row per (shape, variant), each paired against ``torch._grouped_mm`` (no epilogue)."""
    from hybridfp.kernels.moe import triton_grouped_gemm as tg
    rows: list[dict[str, Any]] = []
    dev = common.DEVICE
    for name, splits, k, n in BF16_SHAPES:
        m = sum(splits)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(len(splits), n, k, device=dev, dtype=torch.bfloat16)
        sa = torch.rand(m, device=dev) + 0.5
        sb = torch.rand(len(splits), n, device=dev) + 0.5
        offs = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
        plain, epi = bf16_blocks(a, b, splits), bf16_blocks(a, b, splits, sa, sb)
        base = {"vs_grouped_mm": ("torch._grouped_mm (no epilogue)",
                                  (lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=offs), plain))}
        cases = {v: (step, epi if scaled else plain) for v, (step, scaled) in variants(tg, a, b, sa, sb, splits).items()}
        rows += measure("bf16", name, 2.0 * m * n * k, base, cases, protocol, failures)
    return rows


def bf16_pointer_tiles(tiles: list[tuple[tuple[int, int, int, int, int], int]], protocol: Protocol,
                       failures: list[str]) -> list[dict[str, Any]]:
    """The pointer kernel at each (tile, swizzle group) of ``tiles``."""
    def variants(tg, a, b, sa, sb, splits):
        return {f"pointer {t} g{g}": ((lambda t=t, g=g: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, tile=t,
                                                                        group_m=g, kernel="pointer")), True)
                for t, g in tiles}
    return _bf16_sweep(variants, protocol, failures)


def _per_expert_fp32_epilogue(a: torch.Tensor, b: torch.Tensor, splits: list[int], sa: torch.Tensor,
                              sb: torch.Tensor) -> list[torch.Tensor]:
    """The alternative the kernel must beat, per expert: cuBLAS BF16 GEMM to FP32
    (``torch.mm(out_dtype=)``, as ``gemm/bf16_tensorcore.py`` calls it), the scales and the cast
    as torch ops."""
    outs, r = [], 0
    for e, m in enumerate(splits):
        if m:
            out = torch.mm(a[r:r + m], b[e].t(), out_dtype=torch.float32)
            outs.append(out.mul_(sa[r:r + m, None]).mul_(sb[e]).bfloat16())
        r += m
    return outs


def bf16_tma(configs: Optional[list[str]], protocol: Protocol, failures: list[str]) -> list[dict[str, Any]]:
    """The TMA kernel at every ``TMA_CONFIGS`` entry next to the baselines, all with the row-scaled
    NVFP4 epilogue (per-row and per-column FP32 scales, BF16 output)."""
    def variants(tg, a, b, sa, sb, splits):
        out = {"per-expert torch.mm FP32 out + epilogue as 3 torch passes":
               (lambda: _per_expert_fp32_epilogue(a, b, splits, sa, sb), True),
               f"pointer {tg.TILE} g{tg.GROUP_M}":
               (lambda: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, kernel="pointer"), True)}
        for cname, cfg in tg.TMA_CONFIGS.items():
            if configs and cname not in configs:
                continue
            out[_bf16_tma_name(cname, cfg)] = (
                (lambda cfg=cfg: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, kernel="tma", tma=cfg)), True)
        return out
    from hybridfp.kernels.moe import triton_grouped_gemm as tg
    default = {_bf16_tma_name(c, cfg) for c, cfg in tg.TMA_CONFIGS.items() if cfg == tg.TMA_CONFIG}
    return mark_library_default(_bf16_sweep(variants, protocol, failures), default)


def _bf16_tma_name(cname: str, cfg: Any) -> str:
    """A BF16 TMA config's variant name (its swizzle group named where its name does not)."""
    return f"tma {cname}" + ("" if " g" in cname else f" g{cfg.group_m}")


def mark_library_default(rows: list[dict[str, Any]], defaults: set[str]) -> list[dict[str, Any]]:
    """``rows`` with ``library_default`` True on each row whose variant is in ``defaults``: the
    config the library runs for that GEMM (the headline reports it, not the sweep's fastest)."""
    for row in rows:
        if row.get("variant") in defaults:
            row["library_default"] = True
    return rows


def bf16_tma_f32(configs: Optional[list[str]], protocol: Protocol, failures: list[str]) -> list[dict[str, Any]]:
    """The TMA kernel's FP32-output configs (``TMA_F32_CONFIGS``) with the same epilogue, next to
    cuBLAS per expert with an FP32 output (``torch.mm(out_dtype=)``, no epilogue)."""
    def variants(tg, a, b, sa, sb, splits):
        def per_expert():
            outs, r = [], 0
            for e, m in enumerate(splits):
                if m:
                    outs.append(torch.mm(a[r:r + m], b[e].t(), out_dtype=torch.float32))
                r += m
            return outs
        out = {"per-expert torch.mm FP32 out (no epilogue)": (per_expert, False)}
        for cname, cfg in tg.TMA_F32_CONFIGS.items():
            if configs and cname not in configs:
                continue
            out[f"tma f32 {cname}"] = ((lambda cfg=cfg: tg.grouped_rows(
                a, b, splits, scale_a=sa, scale_b=sb, kernel="tma", tma=cfg, out_dtype=torch.float32)), True)
        return out
    from hybridfp.kernels.moe import triton_grouped_gemm as tg
    default = {f"tma f32 {c}" for c, cfg in tg.TMA_F32_CONFIGS.items() if cfg == tg.TMA_F32_CONFIG}
    return mark_library_default(_bf16_sweep(variants, protocol, failures), default)


# --- FP8 grouped GEMM, the 64-expert MoE's six GEMMs -----------------------------------------

HIDDEN, FFN, ROWS, EXPERTS = 4096, 1408, 32768, 64
#: ((BM, BN, BK, warps, stages), group_m, promote)
FP8_TILES = [((128, 128, 128, 8, 4), 8, 128), ((128, 128, 128, 8, 4), 8, 1 << 30), ((128, 256, 128, 8, 3), 8, 128),
             ((128, 128, 128, 4, 4), 8, 128), ((128, 128, 64, 4, 5), 8, 64), ((64, 128, 128, 4, 4), 8, 128),
             ((128, 64, 128, 4, 4), 8, 128), ((128, 128, 128, 8, 3), 1, 128)]
#: ``--pointer-tiles --wgrad``: the reduction-grouped GEMMs only (short K loops: each expert's few
#: hundred tokens), over shallower / smaller tiles that let more programs share an SM
FP8_WGRAD_TILES = [((128, 128, 64, 4, 5), 8, 64), ((128, 128, 64, 4, 3), 8, 64), ((128, 128, 64, 4, 4), 8, 64),
                   ((64, 128, 64, 4, 4), 8, 64), ((128, 64, 64, 4, 4), 8, 64), ((128, 128, 32, 4, 6), 8, 32),
                   ((128, 256, 64, 8, 3), 8, 64), ((256, 128, 64, 8, 3), 8, 64), ((128, 128, 64, 8, 4), 8, 64),
                   ((128, 128, 64, 4, 5), 16, 64), ((128, 128, 64, 4, 5), 2, 64), ((64, 64, 64, 4, 4), 8, 64)]


def splits_for(rows: int, experts: int) -> list[int]:
    """Uneven positive counts that sum to ``rows`` (every 3rd expert weighted 1.25, not multiples
    of 32)."""
    w = [1.25 if e % 3 == 0 else 1.0 for e in range(experts)]
    base = [int(rows * x / sum(w)) for x in w]
    base[-1] += rows - sum(base)
    assert min(base) > 0 and sum(base) == rows
    return base


def _fp8(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, device=common.DEVICE) * 4).to(dtype)


def _fp8_cases(splits: list[int]) -> list[tuple[str, dict[str, Any]]]:
    """(name, operands) per GEMM of one GroupedLinear pair (fc1 4096 -> 2x1408 gate/up, fc2 1408
    -> 4096): fprop / dgrad rows grouped, wgrad reduction grouped over the experts' tokens."""
    e = len(splits)
    lds = [-(-m // 16) * 16 for m in splits]
    out = []
    for name, k, n in (("fc1", HIDDEN, 2 * FFN), ("fc2", FFN, HIDDEN)):
        x = _fp8((sum(splits), k), E4M3)
        w = _fp8((e, n, k), E4M3)
        wt = _fp8((e, k, n), E4M3)
        dy = _fp8((sum(splits), n), E5M2)
        dyc = [_fp8((n, ld), E5M2) for ld in lds]
        xc = [_fp8((k, ld), E4M3) for ld in lds]
        out.append((f"{name} fprop", dict(a=list(torch.split(x, splits)), b=list(w.unbind(0)), ks=[k] * e,
                                          m=sum(splits), n=n, k=k, rows=True)))
        out.append((f"{name} dgrad (E5M2 dy)", dict(a=list(torch.split(dy, splits)), b=list(wt.unbind(0)), ks=[n] * e,
                                                    m=sum(splits), n=k, k=n, rows=True)))
        out.append((f"{name} wgrad", dict(a=dyc, b=xc, ks=lds, m=n, n=k, k=sum(splits), rows=False)))
    return out


def _cublas_loop(c: dict[str, Any]) -> Callable[[], Any]:
    """cuBLAS ``_scaled_mm`` per expert (unit scales), returning the experts' outputs."""
    one = torch.ones((), device=common.DEVICE)

    def run() -> list[torch.Tensor]:
        return [torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
                for a, b in zip(c["a"], c["b"]) if a.shape[0] and a.shape[1]]
    return run


def fp8_blocks(c: dict[str, Any], sa: Optional[torch.Tensor] = None,
               sb: Optional[torch.Tensor] = None) -> list[Block]:
    """Expert e's block of one FP8 case: A_e times B_e, scaled by ``sa[e] * sb[e]`` where given
    (the Triton kernels' per-expert scales). An expert the cuBLAS loop skips (no rows or an
    empty reduction) has no rows."""
    return [(a, b, None, None if sa is None else sa[e] * sb[e]) for e, (a, b) in enumerate(zip(c["a"], c["b"]))
            if a.shape[0] and a.shape[1] or sa is not None]


def _bf16_grouped(c: dict[str, Any], splits: list[int], decoded: bool = False) -> Case:
    """BF16 ``torch._grouped_mm`` on fresh randn operands of the case's shape (the MoE benchmark's
    baseline) or, ``decoded``, on the case's own FP8 values widened to BF16 (exactly: a GEMM's
    speed under a power cap depends on its operands' values, so the FP8 kernels are also
    compared on theirs), in the same layouts: rows grouped, or for wgrad 2D x 2D grouped along K,
    and its blocks."""
    dev, e = common.DEVICE, len(splits)
    bf16 = torch.bfloat16
    if c["rows"]:
        if decoded:  # A_e [m_e, k], B_e [n, k]
            bf_a = torch.cat(c["a"]).to(bf16)
            bf_b = torch.stack(c["b"]).to(bf16).transpose(1, 2).contiguous()  # row-major as randn's
        else:
            bf_a = torch.randn(c["m"], c["k"], device=dev, dtype=bf16)
            bf_b = torch.randn(e, c["k"], c["n"], device=dev, dtype=bf16)
        offs = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
        blocks, r = [], 0
        for i, m in enumerate(splits):
            blocks.append((bf_a[r:r + m], bf_b[i].t(), None, None))
            r += m
    else:  # CUTLASS needs 16-byte aligned group offsets: the 16-padded token counts, +0.4 % work
        if decoded:  # A_e [m, k_e], B_e [n, k_e]
            bf_a = torch.cat(c["a"], dim=1).to(bf16)
            bf_b = torch.cat(c["b"], dim=1).to(bf16).t().contiguous()  # row-major as randn's
        else:
            bf_a = torch.randn(c["m"], sum(c["ks"]), device=dev, dtype=bf16)
            bf_b = torch.randn(sum(c["ks"]), c["n"], device=dev, dtype=bf16)
        offs = torch.tensor(c["ks"], device=dev).cumsum(0).to(torch.int32)
        blocks, r = [], 0
        for kk in c["ks"]:
            blocks.append((bf_a[:, r:r + kk], bf_b[r:r + kk].t(), None, None))
            r += kk
    return (lambda: torch._grouped_mm(bf_a, bf_b, offs=offs)), blocks


def fp8(tiles: list[tuple[tuple[int, int, int, int, int], int, int]], protocol: Protocol, failures: list[str],
        only: str = "", tma: bool = False, configs: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """One row per (GEMM, variant), each paired against cuBLAS per expert and BF16
    ``torch._grouped_mm`` on randn and on the case's FP8 values; ``tma``: the pointer kernel at
    its default tile and the TMA configs (``tiles`` ignored), else the pointer kernel at each of
    ``tiles``."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as tk
    from hybridfp.kernels.moe.triton_grouped_fp8_tma import CONFIGS
    dev = common.DEVICE
    splits = splits_for(ROWS, EXPERTS)
    rows: list[dict[str, Any]] = []
    sa = torch.rand(EXPERTS, device=dev) + 0.5
    sb = torch.rand(EXPERTS, device=dev) + 0.5
    from hybridfp import current_policy
    pol = current_policy()  # the TMA configs the library runs (rows / wgrad)
    for name, c in _fp8_cases(splits):
        if only not in name:
            continue
        flop = 2.0 * c["m"] * c["n"] * c["k"] if c["rows"] else 2.0 * EXPERTS * c["m"] * c["n"] * (c["k"] / EXPERTS)
        out_rows = [sum(splits[:i]) for i in range(EXPERTS)] if c["rows"] else [i * c["m"] for i in range(EXPERTS)]
        out = torch.empty((c["m"] if c["rows"] else EXPERTS * c["m"], c["n"]), device=dev, dtype=torch.bfloat16)
        scaled = fp8_blocks(c, sa, sb)
        base = {"vs_cublas": ("cuBLAS _scaled_mm per expert", (_cublas_loop(c), fp8_blocks(c))),
                "vs_grouped_mm": ("BF16 torch._grouped_mm", _bf16_grouped(c, splits)),
                "vs_grouped_mm_decoded": ("BF16 torch._grouped_mm on the FP8 values",
                                          _bf16_grouped(c, splits, decoded=True))}
        variants: dict[str, Case] = {}
        if c["rows"] and c["a"][0].dtype == E4M3:
            whole = torch.cat(c["a"])
            stacked = torch.stack(c["b"]).transpose(1, 2)
            ra = torch.ones(c["m"], device=dev)
            rb = torch.ones(EXPERTS, c["n"], device=dev)
            offs = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
            variants["torch._scaled_grouped_mm"] = ((lambda: torch._scaled_grouped_mm(
                whole, stacked, ra, rb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False)), fp8_blocks(c))
        if tma:
            tiles = [(tk.TILE if c["rows"] else tk.WGRAD_TILE, tk.GROUP_M, tk.PROMOTE)]
            for cname, cfg in CONFIGS.items():
                if configs and cname not in configs:
                    continue
                variants[f"tma {cname}"] = ((lambda cfg=cfg: tk.grouped_fp8(c["a"], c["b"], c["ks"], sa, sb, out,
                                                                           out_rows, tma=cfg)), scaled)
        for t, g, p in tiles:
            variants[f"pointer {t} g{g} promote {p}"] = (
                (lambda t=t, g=g, p=p: tk.grouped_fp8(c["a"], c["b"], c["ks"], sa, sb, out, out_rows,
                                                      tile=t, group_m=g, promote=p)), scaled)
        default = {f"tma {pol.grouped_fp8_tma_rows if c['rows'] else pol.grouped_fp8_tma_wgrad}"} if tma else set()
        rows += mark_library_default(measure("fp8", name, flop, base, variants, protocol, failures), default)
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--part", choices=["bf16", "fp8"], default=None, help="one kernel family only")
    p.add_argument("--configs", default=None, help="only these '|'-separated TMA config names")
    p.add_argument("--f32", action="store_true", help="bf16: the FP32-output TMA configs")
    p.add_argument("--pointer-tiles", action="store_true", help="the pointer kernels' tile sweeps instead")
    p.add_argument("--wgrad", action="store_true", help="with --pointer-tiles: fp8 wgrad GEMMs over FP8_WGRAD_TILES")
    args = p.parse_args(argv)
    require_cuda()
    protocol = protocol_from(args)
    configs = args.configs.split("|") if args.configs else None
    if args.quick and configs is None:  # the kernels' defaults only
        from hybridfp import current_policy
        from hybridfp.kernels.moe import triton_grouped_gemm as tg
        pol = current_policy()
        configs = [k for k, v in tg.TMA_CONFIGS.items() if v == tg.TMA_CONFIG] + [
            c for c in (pol.grouped_fp8_tma_rows, pol.grouped_fp8_tma_wgrad) if c]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        if args.part in (None, "bf16"):
            if args.pointer_tiles:
                rows += bf16_pointer_tiles(BF16_TILES[:2] if args.quick else BF16_TILES, protocol, failures)
            else:
                rows += (bf16_tma_f32 if args.f32 else bf16_tma)(configs, protocol, failures)
        if args.part in (None, "fp8"):
            if args.pointer_tiles:
                rows += fp8(FP8_WGRAD_TILES if args.wgrad else FP8_TILES[:1] if args.quick else FP8_TILES,
                            protocol, failures, "wgrad" if args.wgrad else "")
            else:
                rows += fp8([], protocol, failures, tma=True, configs=configs)
    except (MissingBaselineError, AccuracyError) as e:  # a baseline missing or wrong: no ratio holds
        failures.append(str(e))
    columns = [("kernel", "part"), ("GEMM", "gemm"), ("variant", "variant"), ("ms", "ms"), ("TFLOP/s", "tflops"),
               ("rel err", "rel_err"), ("x torch._grouped_mm [interval]", "vs_grouped_mm_text"),
               ("x torch._grouped_mm on the FP8 values (fp8) [interval]", "vs_grouped_mm_decoded_text"),
               ("x cuBLAS per expert (fp8) [interval]", "vs_cublas_text")]
    md = md_table([h for h, _ in columns], [[r.get(k, r.get("error") if k == "ms" else None) for _, k in columns]
                                            for r in rows])
    md = (f"Paired ratios: median over {protocol.rounds} alternating rounds ({protocol.samples} calls a side each) "
          "of baseline time / variant time, [≥ 95 % interval]; rel err: output vs the FP32 product of the same "
          f"operands (bound {OUTPUT_BOUND:.3g})."
          + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 rounds or samples).") + "\n\n" + md)
    finish("grouped_gemm", {"env": environment(), "protocol": protocol_record(protocol), "rows": rows,
                            "failures": failures, "markdown": md}, args.out)
    if failures:
        raise SystemExit("grouped_gemm failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
