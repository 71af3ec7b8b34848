"""Whether the library's GEMM-path thresholds and kernel tile defaults hold away from the shapes
they were fitted at (the Llama-3-8B MLP; MoE layers of 8 x 14336 and 64 x 1408).

For each decision every alternative is timed (``bench.common.bench_ms``: do_bench medians),
forced through the policy (``hybridfp.policy(...)`` fields) or the kernel's own tile arguments,
and each cell reports the alternative the library picks (asked of the library's own decision
function: ``moe.gemm.per_group_wins``, ``moe.gemm.grouped_path``,
``moe.quantize_weights._worth_stacking``, the kernels' tile constants), the fastest measured,
and the picked one's time / the fastest's: 1.00 where the choice holds; a cell more than 3 %
slower (``TOLERANCE``) is flagged. Where picked and fastest differ, the ratio is re-measured
paired (``bench.protocol.paired_ratio``: ``ROUNDS`` alternating rounds, the median ratio and
its interval in the JSON). The sweep only measures: no threshold is
changed from its result.

Decisions (``DECISIONS``), each on one GEMM of an expert linear W_e [ffn, hidden]:

- ``bf16_per_group`` (policy ``bf16_per_group_cublas``): fprop's grouped BF16 matmul,
  cuBLAS per group vs ``torch._grouped_mm`` (picked: ``per_group_wins``);
- ``fp8_per_expert`` (``per_expert_fp8_triton_flops``): dgrad of per-tensor FP8 experts (E5M2 dy x E4M3
  W), cuBLAS per expert vs the Triton FP8 grouped GEMM (picked: ``grouped_path``, which also
  applies ``many_experts``);
- ``many_experts`` (``many_experts``, ``grouped_triton_max_flops``): fprop of NVFP4 experts (a
  global-scale epilogue), the per-expert loop vs the Triton grouped GEMM (picked:
  ``grouped_path``);
- ``stack_scaled`` (``stack_scaled_max_numel``): per-tensor FP8 weights quantized per expert vs
  stacked into one buffer (picked: ``_worth_stacking``; no token count);
- ``fp8_tile_rows`` / ``fp8_tile_wgrad``: the Triton FP8 grouped GEMM's pointer tiles ``TILE``
  (fprop) and ``WGRAD_TILE`` (wgrad) against neighbours (on CUDA the policy's TMA config runs
  wherever TMA can read the operands; the pointer tile is the fallback);
- ``fp8_tma_rows`` / ``fp8_tma_wgrad`` (``grouped_fp8_tma_rows`` / ``grouped_fp8_tma_wgrad``):
  that TMA config against neighbouring configs, fprop and wgrad (picked: the policy's field);
- ``bf16_tile``: the Triton BF16 grouped GEMM's ``TILE`` (pointer kernel, row-scaled epilogue);
- ``nvfp4_hybrid_tile`` / ``mxfp8_decode_tile``: the NVFP4 + MXFP8 fused quantize's
  ``DEFAULT_TILES["natural"]`` and the MXFP8 1x32 decode's default tile, on [tokens, hidden].

Grid: tokens {4096, 8192, 16384} x hidden {2048, 4096, 8192}; the MoE decisions also over
experts {8, 16, 32, 64} with top-k ``TOPK`` (routed rows = tokens x top-k, split unevenly) and
ffn = hidden * 28 / experts rounded to 128 (8 experts: 3.5 x hidden, 14336 at hidden 4096 as the
8-expert layer; 64 experts: 0.44 x hidden, near the 64 x 1408 layer's 0.34); the kernel tile
decisions at the smallest and largest expert counts. About 660 timings of ``warmup_ms=10,
rep_ms=60`` each (do_bench's estimate and warm-up calls included, ~0.15 s), the paired
re-measures, the operands' setup and a few dozen kernel compiles (the largest GEMMs, 32768
routed rows x hidden 8192 x ffn 28672, take ~25 ms a call); on one H100 the decisions other
than the two TMA ones take 135 s in one process. ``--only`` runs a subset; ``--deadline-s S``
starts no cell after S seconds and records the cells left as not run (``python -m bench sweep_dispatch --timeout-s T`` passes
3/4 of T), so a run cut short still writes what it measured.
``--quick``: a tiny grid (a smoke test of the script, also on the CPU). The alternatives of one
kernel (tiles, TMA configs) are first run once each and checked to give the picked one's
output (``differs``, within ``RESULT_BOUND``); one that does not is an error, not timed. A cell
that raises, or an alternative that fails in a measured cell, fails the run (non-zero exit,
after the results are written): its verdict could name the wrong fastest.

    python -m bench.sweep_dispatch [--quick] [--out F.json] [--only NAME[,NAME]] [--deadline-s S]

Prints a Markdown table (one row per cell, with the SM clock while its alternatives ran: a
throttled stretch of the sweep slows every alternative of its cells) last; the JSON has every
alternative's time and each cell's clocks (min / median / max SM clock and power).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from bench import common
from bench.common import md_table, parser, require_cuda
from bench.protocol import POLL_S, ClockPoller, Sampler, device_sampler, summarize_clocks

#: a picked alternative this much slower than the fastest is flagged
TOLERANCE = 0.03
#: do_bench per alternative: short, the grid is large (medians of ~10-400 calls)
WARMUP_MS, REP_MS = 10.0, 60.0
#: paired re-measure where picked and fastest differ: rounds x calls per side, the protocol's
#: reportable minimum (only the few cells that disagree pay for it)
ROUNDS, SAMPLES = 10, 10
#: routed experts per token by expert count (others: 1)
TOPK = {8: 2, 16: 2, 32: 4, 64: 8}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Grid:
    """The swept sizes; ``align``: ffn is rounded to a multiple of it."""

    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    experts: tuple[int, ...]
    align: int = 128


FULL = Grid((4096, 8192, 16384), (2048, 4096, 8192), (8, 16, 32, 64))
#: a smoke test: runs in the Triton interpreter on the CPU in seconds
QUICK = Grid((64,), (32,), (2, 4), align=32)


@dataclass(frozen=True)
class Cell:
    """One point of the grid: ``tokens`` None where the decision has no token count,
    ``experts`` None for the dense (quantize kernel) decisions."""

    tokens: Optional[int]
    hidden: int
    experts: Optional[int] = None
    ffn: Optional[int] = None

    @property
    def rows(self) -> int:
        """Routed rows: tokens x top-k."""
        return (self.tokens or 0) * TOPK.get(self.experts or 0, 1)

    def label(self) -> str:
        parts = [f"T{self.tokens}" if self.tokens else "", f"H{self.hidden}",
                 f"{self.experts}x{self.ffn}" if self.experts else ""]
        return " ".join(p for p in parts if p)


@dataclass
class Case:
    """A cell's alternatives (name -> call) and the one the library picks."""

    alternatives: dict[str, Callable[[], Any]]
    picked: str
    #: name -> (GEMM, path) the forced alternative must take (checked on its first call)
    paths: dict[str, str] = field(default_factory=dict)
    #: every alternative computes the same result (tiles / configs of one kernel): each one's
    #: first output is checked against the picked one's (``same_result``) before it is timed
    same_result: bool = False


@dataclass(frozen=True)
class Decision:
    """A choice of the library: ``cells(grid)`` where it is swept, ``build(cell, quick)`` its
    case (``quick``: fewer alternative tiles)."""

    name: str
    what: str
    cells: Callable[[Grid], list[Cell]]
    build: Callable[[Cell, bool], Case]


# --- cells -------------------------------------------------------------------------------------

def ffn_for(hidden: int, experts: int, align: int = 128) -> int:
    """A realistic expert width: hidden * 28 / experts rounded to ``align`` (8 experts: 3.5 x
    hidden, as Mixtral / the 8 x 14336 layer; 64 experts: 0.44 x hidden)."""
    return max(align, round(hidden * 28 / experts / align) * align)


def moe_cells(grid: Grid, experts: Optional[Sequence[int]] = None, tokens: bool = True) -> list[Cell]:
    """tokens x hidden x experts (``experts`` default: the grid's); ``tokens`` False: one cell
    per hidden x experts."""
    ts: Sequence[Optional[int]] = grid.tokens if tokens else (None,)
    return [Cell(t, h, e, ffn_for(h, e, grid.align)) for t in ts for h in grid.hidden
            for e in (experts or grid.experts)]


def splits_for(rows: int, experts: int) -> list[int]:
    """Uneven positive counts summing to ``rows``: every third expert weighted 1.25."""
    w = [1.25 if e % 3 == 0 else 1.0 for e in range(experts)]
    out = [int(rows * x / sum(w)) for x in w]
    out[-1] += rows - sum(out)
    return out


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=common.DEVICE, dtype=dtype)


def _forced(fields: Mapping[str, Any], fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run under ``hybridfp.policy(**fields)`` (and without autograd)."""
    import hybridfp

    def run() -> Any:
        with hybridfp.policy(**fields), torch.no_grad():
            return fn()
    return run


def _triton_on() -> dict[str, Any]:
    """Policy fields that turn the Triton grouped paths on for any expert count on this device."""
    return {"many_experts": 0, "grouped_triton_devices": {torch.device(common.DEVICE).type}}


# --- decisions ---------------------------------------------------------------------------------

def bf16_per_group(cell: Cell, quick: bool = False) -> Case:
    """fprop's grouped BF16 matmul [rows, hidden] x [E, hidden, ffn]."""
    from hybridfp.moe.gemm import per_group_wins, torch_grouped_mm
    sizes = splits_for(cell.rows, cell.experts)
    a, b = _randn(cell.rows, cell.hidden), _randn(cell.experts, cell.hidden, cell.ffn)
    alts = {"cuBLAS per group": _forced({"bf16_per_group_cublas": True}, lambda: torch_grouped_mm(a, b, sizes)),
            "torch._grouped_mm": _forced({"bf16_per_group_cublas": False}, lambda: torch_grouped_mm(a, b, sizes))}
    return Case(alts, "cuBLAS per group" if per_group_wins(sizes) else "torch._grouped_mm")


def _fp8_experts(sizes: Sequence[int], cols: int, dtype: torch.dtype) -> list[Any]:
    import hybridfp
    return [hybridfp.Float8CurrentScalingQuantizer(dtype)(_randn(m, cols)) for m in sizes]


def _path_name(path: str, names: Mapping[str, str]) -> str:
    return names.get(path, path)


def fp8_per_expert(cell: Cell, quick: bool = False) -> Case:
    """dgrad of per-tensor FP8 experts: dx_e [m_e, hidden] = dy_e [m_e, ffn] (E5M2) W_e (E4M3)."""
    from hybridfp.gemm.gemm import operand_storage
    from hybridfp.moe.gemm import GROUPED_FP8_TRITON, PER_EXPERT, grouped_gemm, grouped_path
    sizes = splits_for(cell.rows, cell.experts)
    dy = _fp8_experts(sizes, cell.ffn, E5M2)
    w = _fp8_experts([cell.ffn] * cell.experts, cell.hidden, E4M3)
    names = {PER_EXPERT: "cuBLAS per expert", GROUPED_FP8_TRITON: "Triton FP8 grouped"}
    sa = [operand_storage(t, "rowwise", "A") for t in dy]
    sb = [operand_storage(t, "columnwise", "B") for t in w]
    picked = _path_name(grouped_path(sa, sb, "NN", torch.bfloat16, False)[0], names)
    run = lambda: grouped_gemm(dy, w, "NN")  # noqa: E731
    cublas = {"per_expert_fp8_flops": 0.0, "per_expert_fp8_triton_flops": 0.0}
    alts = {names[PER_EXPERT]: _forced(cublas, run),
            names[GROUPED_FP8_TRITON]: _forced({k: math.inf for k in cublas} | _triton_on(), run)}
    return Case(alts, picked, {names[PER_EXPERT]: PER_EXPERT, names[GROUPED_FP8_TRITON]: GROUPED_FP8_TRITON})


def many_experts(cell: Cell, quick: bool = False) -> Case:
    """fprop of NVFP4 experts (an FP32 epilogue for the global scales): y_e = x_e W_eᵀ."""
    import hybridfp
    from hybridfp.gemm.gemm import operand_storage
    from hybridfp.moe.gemm import GROUPED_TRITON, PER_EXPERT, grouped_gemm, grouped_path
    sizes = splits_for(cell.rows, cell.experts)
    qx = hybridfp.NVFP4Quantizer()
    qx.set_usage(rowwise=True, columnwise=False)
    x = [qx(_randn(m, cell.hidden)) for m in sizes]
    w = [hybridfp.NVFP4Quantizer()(_randn(cell.ffn, cell.hidden)) for _ in sizes]
    names = {PER_EXPERT: "per-expert loop", GROUPED_TRITON: "Triton grouped"}
    sa = [operand_storage(t, "rowwise", "A") for t in x]
    sb = [operand_storage(t, "rowwise", "B") for t in w]
    picked = _path_name(grouped_path(sa, sb, "TN", torch.bfloat16, False)[0], names)
    run = lambda: grouped_gemm(x, w, "TN")  # noqa: E731
    alts = {names[PER_EXPERT]: _forced({"many_experts": 1 << 30}, run),
            names[GROUPED_TRITON]: _forced(_triton_on(), run)}
    return Case(alts, picked, {names[PER_EXPERT]: PER_EXPERT, names[GROUPED_TRITON]: GROUPED_TRITON})


def stack_scaled(cell: Cell, quick: bool = False) -> Case:
    """Per-tensor FP8 (current scaling) of the experts' [ffn, hidden] BF16 weights."""
    import hybridfp
    from hybridfp.moe.quantize_weights import _worth_stacking, quantize_weights_grouped
    qs = [hybridfp.Float8CurrentScalingQuantizer(E4M3) for _ in range(cell.experts)]
    ws = list(_randn(cell.experts, cell.ffn, cell.hidden).unbind(0))
    run = lambda: quantize_weights_grouped(qs, ws)  # noqa: E731
    alts = {"per expert": _forced({"stack_scaled_max_numel": 0}, run),
            "stacked": _forced({"stack_scaled_max_numel": 1 << 62}, run)}
    return Case(alts, "stacked" if _worth_stacking(qs, ws, None, None) else "per expert")


def _tile_case(default: Any, others: Sequence[Any], call: Callable[[Optional[Any]], Any]) -> Case:
    """The default (``call(None)``: the kernel's own choice) and each other tile."""
    alts = {f"{default} (default)": lambda: call(None)}
    alts.update({str(t): (lambda t=t: call(t)) for t in others if t != default})
    return Case(alts, f"{default} (default)", same_result=True)


#: tiles tried next to the defaults (``--quick``: the first only)
FP8_ROW_TILES = [(128, 256, 128, 8, 3), (128, 128, 128, 4, 4), (64, 128, 128, 4, 4)]
FP8_WGRAD_TILES = [(128, 128, 64, 4, 5), (128, 128, 128, 8, 4), (64, 128, 64, 4, 4)]
BF16_TILES = [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4)]
NVFP4_HYBRID_TILES = [((64, 64), 4), ((32, 128), 4)]
DECODE_TILES = [((8, 512), 4), ((4, 1024), 4)]


def _others(tiles: list[Any], quick: bool) -> list[Any]:
    return tiles[:1] if quick else tiles


def _scales(n: int) -> torch.Tensor:
    return torch.rand(n, device=common.DEVICE) + 0.5


def _fp8_rows_call(cell: Cell) -> Callable[..., Any]:
    """The Triton FP8 grouped GEMM, fprop [rows, hidden] x [ffn, hidden]ᵀ per expert, on fresh
    operands: a call taking the kernel's keyword arguments (``tile`` / ``tma``)."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as k
    sizes = splits_for(cell.rows, cell.experts)
    a = list(torch.split(_randn(cell.rows, cell.hidden).to(E4M3), sizes))
    b = list(_randn(cell.experts, cell.ffn, cell.hidden).to(E4M3).unbind(0))
    out = torch.empty(cell.rows, cell.ffn, device=common.DEVICE, dtype=torch.bfloat16)
    rows = [sum(sizes[:e]) for e in range(cell.experts)]
    sa, sb = _scales(cell.experts), _scales(cell.experts)
    return lambda **kw: k.grouped_fp8(a, b, [cell.hidden] * cell.experts, sa, sb, out, rows, **kw)


def _fp8_wgrad_call(cell: Cell) -> Callable[..., Any]:
    """The Triton FP8 grouped GEMM's wgrad, dW_e [ffn, hidden] = dy_eᵀ x_e over the expert's
    tokens (columnwise copies, rows padded to 16 as the library's), on fresh operands: a call
    taking the kernel's keyword arguments (the library passes ``WGRAD_TILE`` itself)."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as k
    sizes = splits_for(cell.rows, cell.experts)
    lds = [-(-m // 16) * 16 for m in sizes]
    a = [_randn(cell.ffn, ld).to(E5M2) for ld in lds]
    b = [_randn(cell.hidden, ld).to(E4M3) for ld in lds]
    out = torch.empty(cell.experts * cell.ffn, cell.hidden, device=common.DEVICE, dtype=torch.bfloat16)
    rows = [e * cell.ffn for e in range(cell.experts)]
    sa, sb = _scales(cell.experts), _scales(cell.experts)
    return lambda **kw: k.grouped_fp8(a, b, lds, sa, sb, out, rows, **{"tile": k.WGRAD_TILE, **kw})


def fp8_tile_rows(cell: Cell, quick: bool = False) -> Case:
    """The Triton FP8 grouped GEMM's pointer kernel, fprop [rows, hidden] x [ffn, hidden]ᵀ per expert."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as k
    run = _fp8_rows_call(cell)
    return _tile_case(k.TILE, _others(FP8_ROW_TILES, quick), lambda t: run(**({} if t is None else {"tile": t})))


def fp8_tile_wgrad(cell: Cell, quick: bool = False) -> Case:
    """The Triton FP8 grouped GEMM's pointer kernel, wgrad (``_fp8_wgrad_call``)."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as k
    run = _fp8_wgrad_call(cell)
    return _tile_case(k.WGRAD_TILE, _others(FP8_WGRAD_TILES, quick),
                      lambda t: run(**({} if t is None else {"tile": t})))


#: the pointer kernel's name among a TMA decision's alternatives (a policy field of None)
POINTER = "pointer kernel"


def _tma_case(field_name: str, others: Sequence[str], run: Callable[..., Any]) -> Case:
    """The policy's TMA config ``field_name`` (the one the library takes on CUDA wherever TMA can
    read the operands; None: the pointer kernel) and each of ``others`` (names in the kernel's
    ``CONFIGS``), each forced with ``tma=`` so that a config TMA cannot run raises instead of
    timing the pointer kernel under its name."""
    from hybridfp.config import current_policy
    from hybridfp.kernels.moe.triton_grouped_fp8_tma import CONFIGS
    default = getattr(current_policy(), field_name)

    def call(name: Optional[str]) -> Callable[[], Any]:
        return (lambda: run()) if name is None else (lambda: run(tma=CONFIGS[name]))
    picked = f"{default or POINTER} (default)"
    alts = {picked: call(default)}
    alts.update({name: call(name) for name in others if name != default})
    return Case(alts, picked, same_result=True)


#: TMA configs tried next to the policy's (``--quick``: the first only): the tiles of the
#: kernel's sweep (``bench_grouped_gemm --part fp8``) that were near the fastest at the MoE shapes
FP8_TMA_ROWS = ["128x256x128 w8 st3 store", "256x128x128 w8 st3 store", "128x256x128 w8 st3",
                "128x128x128 w8 st4 store"]
FP8_TMA_WGRAD = ["256x128x128 w8 st3", "128x256x128 w8 st3 store", "128x128x128 w8 st4 store"]


def fp8_tma_rows(cell: Cell, quick: bool = False) -> Case:
    """The Triton FP8 grouped GEMM's TMA kernel config for fprop (``Policy.grouped_fp8_tma_rows``;
    dgrad takes the same one), against its neighbours."""
    return _tma_case("grouped_fp8_tma_rows", _others(FP8_TMA_ROWS, quick), _fp8_rows_call(cell))


def fp8_tma_wgrad(cell: Cell, quick: bool = False) -> Case:
    """The Triton FP8 grouped GEMM's TMA kernel config for wgrad (``Policy.grouped_fp8_tma_wgrad``)."""
    return _tma_case("grouped_fp8_tma_wgrad", _others(FP8_TMA_WGRAD, quick), _fp8_wgrad_call(cell))


def bf16_tile(cell: Cell, quick: bool = False) -> Case:
    """The Triton BF16 grouped GEMM's pointer kernel, fprop with a row-scaled FP32 epilogue."""
    from hybridfp.kernels.moe import triton_grouped_gemm as tg
    sizes = splits_for(cell.rows, cell.experts)
    a, b = _randn(cell.rows, cell.hidden), _randn(cell.experts, cell.ffn, cell.hidden)
    sa, sb = _scales(cell.rows), _scales(cell.experts * cell.ffn).view(cell.experts, cell.ffn)

    def call(tile: Optional[tuple[int, ...]]) -> Any:
        kw = {} if tile is None else {"tile": tile}
        return tg.grouped_rows(a, b, sizes, scale_a=sa, scale_b=sb, kernel="pointer", **kw)
    return _tile_case(tg.TILE, _others(BF16_TILES, quick), call)


def nvfp4_hybrid_tile(cell: Cell, quick: bool = False) -> Case:
    """NVFP4 rowwise + MXFP8 columnwise of [tokens, hidden] BF16 in one pass ("natural")."""
    from hybridfp.kernels import triton_hybrid_nvfp4 as k
    x = _randn(cell.tokens, cell.hidden)
    amax = x.abs().amax().float()

    def call(tile: Optional[tuple[tuple[int, int], int]]) -> Any:
        kw = {} if tile is None else {"block": tile[0], "num_warps": tile[1]}
        return k.quantize(x, amax, E4M3, method="natural", **kw)
    return _tile_case(k.DEFAULT_TILES["natural"], _others(NVFP4_HYBRID_TILES, quick), call)


def mxfp8_decode_tile(cell: Cell, quick: bool = False) -> Case:
    """The MXFP8 1x32 decode of a [tokens, hidden] copy to BF16."""
    from hybridfp.kernels import triton_decode as d
    from hybridfp.kernels import triton_mxfp8
    (data, scale), _ = triton_mxfp8.quantize(_randn(cell.tokens, cell.hidden), E4M3, columnwise=False)

    def call(tile: Optional[tuple[tuple[int, int], int]]) -> Any:
        kw = {} if tile is None else {"tile": tile[0], "num_warps": tile[1]}
        return d.decode_mxfp8(data, scale, **kw)
    return _tile_case((d._TILE_1D, d._WARPS_1D), _others(DECODE_TILES, quick), call)


def _dense_cells(grid: Grid) -> list[Cell]:
    return [Cell(t, h) for t in grid.tokens for h in grid.hidden]


def _ends(grid: Grid) -> list[Cell]:
    return moe_cells(grid, sorted({min(grid.experts), max(grid.experts)}))


DECISIONS: dict[str, Decision] = {d.name: d for d in [
    Decision("bf16_per_group", "fprop grouped BF16: cuBLAS per group vs torch._grouped_mm", moe_cells, bf16_per_group),
    Decision("fp8_per_expert", "FP8 dgrad: cuBLAS per expert vs Triton FP8 grouped", moe_cells, fp8_per_expert),
    Decision("many_experts", "NVFP4 fprop: per-expert loop vs Triton grouped", moe_cells, many_experts),
    Decision("stack_scaled", "FP8 weight quantize: per expert vs stacked",
             lambda g: moe_cells(g, tokens=False), stack_scaled),
    Decision("fp8_tile_rows", "Triton FP8 grouped fprop: pointer TILE", _ends, fp8_tile_rows),
    Decision("fp8_tile_wgrad", "Triton FP8 grouped wgrad: WGRAD_TILE", _ends, fp8_tile_wgrad),
    Decision("fp8_tma_rows", "Triton FP8 grouped fprop: the policy's TMA config", _ends, fp8_tma_rows),
    Decision("fp8_tma_wgrad", "Triton FP8 grouped wgrad: the policy's TMA config", _ends, fp8_tma_wgrad),
    Decision("bf16_tile", "Triton BF16 grouped fprop: pointer TILE", _ends, bf16_tile),
    Decision("nvfp4_hybrid_tile", "NVFP4 + MXFP8 quantize: DEFAULT_TILES['natural']", _dense_cells,
             nvfp4_hybrid_tile),
    Decision("mxfp8_decode_tile", "MXFP8 1x32 decode: default tile", _dense_cells, mxfp8_decode_tile),
]}


# --- measuring and judging ---------------------------------------------------------------------

#: largest norm-wise difference ``same_result`` allows between two alternatives' outputs: tiles
#: sum in other orders (FP32 accumulators, differing in the last bits) and round once to a
#: 16-bit output, so elements differ by at most about one BF16 unit in the last place (2**-8
#: relative, 2**-7 at a binade edge); a wrong tile or descriptor is off by far more
RESULT_BOUND = 2.0 ** -7


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of an alternative's output (a tensor, or tuples / lists of them), detached copies."""
    if isinstance(out, torch.Tensor):
        return [out.detach().clone()]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def differs(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], bound: float = RESULT_BOUND) -> Optional[str]:
    """Why ``got`` (an alternative's output tensors) is not ``want`` (the picked one's) within
    ``bound``, ||a - b|| / ||b|| per tensor in FP32, or None; a NaN, another shape or another
    number of tensors fails.

    Example
    -------
    >>> import torch
    >>> from bench.sweep_dispatch import differs
    >>> differs([torch.ones(4) * (1 + 2**-9)], [torch.ones(4)]) is None
    True
    >>> differs([torch.zeros(4)], [torch.ones(4)])
    'output differs from the picked one by 1 (bound 0.0078125)'
    """
    if [t.shape for t in got] != [t.shape for t in want]:
        return f"output shapes {[tuple(t.shape) for t in got]} differ from the picked one's {[tuple(t.shape) for t in want]}"
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.float(), w.float()
        rel = float((g - w).norm() / w.norm()) if float(w.norm()) else float(g.norm())
        worst = max(worst, rel) if rel == rel else math.inf  # NaN: fails
    return None if worst <= bound else f"output differs from the picked one by {worst:.3g} (bound {bound:g})"

def judge(times: Mapping[str, Optional[float]], picked: str, paired: Optional[float] = None,
          tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The verdict of one cell from its alternatives' ms (None: the alternative failed).

    Parameters
    ----------
    times:
        Alternative name -> median ms, or None where it failed.
    picked:
        The alternative the library picks (a key of ``times``).
    paired:
        picked / fastest measured paired, where they differ (replaces the medians' ratio; at
        most 1: the picked one counts as the fastest).
    tolerance:
        ``flagged`` when the picked one is more than this fraction slower.

    Returns
    -------
    dict
        ``picked``, ``fastest`` (None if every alternative failed), ``ratio`` (picked / fastest;
        None if either failed), ``holds`` (the picked one is the fastest, or within
        ``tolerance`` of it) and ``flagged`` (not ``holds``: slower by more than ``tolerance``,
        or the picked one failed).

    Raises
    ------
    KeyError
        ``picked`` is not one of ``times``.

    Example
    -------
    >>> from bench.sweep_dispatch import judge
    >>> v = judge({"a": 1.0, "b": 1.1}, picked="b")
    >>> v["fastest"], round(v["ratio"], 2), v["flagged"]
    ('a', 1.1, True)
    >>> judge({"a": 1.0, "b": 1.02}, picked="b")["holds"]
    True
    """
    if picked not in times:
        raise KeyError(f"judge: picked alternative {picked!r} is not one of the timed {sorted(times)}.")
    ok = {k: v for k, v in times.items() if v is not None}
    fastest = min(ok, key=ok.__getitem__) if ok else None
    ratio = None
    if fastest is not None and times[picked] is not None:
        ratio = 1.0 if picked == fastest else (paired if paired is not None else times[picked] / ok[fastest])
        if ratio <= 1.0:  # the paired measurement finds the picked one as fast: it is the fastest
            fastest, ratio = picked, 1.0
    holds = ratio is not None and ratio <= 1.0 + tolerance
    return {"picked": picked, "fastest": fastest, "ratio": ratio, "holds": holds, "flagged": not holds}


def _paired_ratio(picked: Callable[[], Any], fastest: Callable[[], Any], quick: bool = False) -> dict[str, Any]:
    """picked ms / fastest ms measured alternately (``bench.protocol.paired_ratio`` with the
    picked one as its baseline, so its ratio, baseline / candidate ms, is picked / fastest),
    with its interval; ``quick``: one round of one call (a smoke test).

    Example
    -------
    >>> import time
    >>> from bench.sweep_dispatch import _paired_ratio
    >>> r = _paired_ratio(lambda: time.sleep(0.05), lambda: time.sleep(0.001), quick=True)
    >>> r["ratio"] > 1.5
    True
    """
    from bench.protocol import Protocol, paired_ratio
    r = paired_ratio(picked, fastest, Protocol(1, 1, 0) if quick else Protocol(ROUNDS, SAMPLES, warmup=1))
    return {"ratio": r.ratio, "low": r.low, "high": r.high, "picked_ms": r.baseline_ms, "fastest_ms": r.candidate_ms,
            "rounds": len(r.rounds), "coverage": r.coverage}


def _took(name: str, want: str, fn: Callable[[], Any]) -> Optional[str]:
    """None if one call of ``fn`` takes grouped path ``want``, else what it took."""
    from hybridfp.moe.gemm import PATH_COUNTS
    before = PATH_COUNTS.copy()
    fn()
    took = {path for (_, path), n in (PATH_COUNTS - before).items() if n}
    return None if took == {want} else f"{name}: forced to {want} but took {sorted(took)}"


def measure(case: Case, quick: bool = False, sampler: Optional[Sampler] = None,
            poll_s: float = POLL_S) -> dict[str, Any]:
    """Time every alternative of ``case`` and judge the cell (``quick``: a one-call paired
    re-measure); a failing alternative is kept as its error (the sweep goes on). ``sampler``
    (``bench.protocol.device_sampler``): read every ``poll_s`` seconds while the alternatives
    are timed, summarized as the row's ``clocks`` (min / median / max SM clock, power), so a
    throttled stretch of a sweep shows in its rows."""
    times: dict[str, Optional[float]] = {}
    errors: dict[str, str] = {}
    if case.same_result:  # a wrong config must not be timed as the fastest
        want: Optional[list[torch.Tensor]] = None
        for name in [case.picked] + [n for n in case.alternatives if n != case.picked]:
            try:
                got = _tensors(case.alternatives[name]())  # copies: alternatives may share an output buffer
            except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            if name == case.picked:
                want = got
            elif want is not None and (why := differs(got, want)):
                errors[name] = why
        del want
    poller = ClockPoller(sampler, poll_s) if sampler is not None else contextlib.nullcontext()
    with poller:
        for name, fn in case.alternatives.items():
            if name in errors:
                times[name] = None
                continue
            try:
                wrong = _took(name, case.paths[name], fn) if name in case.paths else None
                if wrong:
                    raise RuntimeError(wrong)
                times[name] = common.bench_ms(fn, WARMUP_MS, REP_MS)
            except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
                times[name], errors[name] = None, f"{type(e).__name__}: {str(e)[:200]}"
    row: dict[str, Any] = {"ms": times, **({"errors": errors} if errors else {})}
    if isinstance(poller, ClockPoller):
        row["clocks"] = summarize_clocks(poller.readings)
    first = judge(times, case.picked)
    if first["fastest"] not in (None, case.picked) and times[case.picked] is not None:
        row["paired"] = _paired_ratio(case.alternatives[case.picked], case.alternatives[first["fastest"]], quick)
        first = judge(times, case.picked, paired=row["paired"]["ratio"])
    return {**row, **first}


#: a row's ``not_run`` value for a cell the deadline left unmeasured
NOT_RUN = "deadline"


def sweep(names: Sequence[str], grid: Grid, quick: bool = False,
          deadline_s: Optional[float] = None) -> list[dict[str, Any]]:
    """One row per (decision, cell) of ``names`` over ``grid``; ``quick``: one tile next to each
    default and a one-call paired re-measure (a smoke test). ``deadline_s``: no cell starts
    after that many seconds; each one left is a row with ``not_run`` (:data:`NOT_RUN`)."""
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    sampler, poll_s = device_sampler()
    for name in names:
        d = DECISIONS[name]
        for cell in d.cells(grid):
            base = {"decision": name, "cell": cell.label(), "tokens": cell.tokens, "hidden": cell.hidden,
                    "experts": cell.experts, "ffn": cell.ffn, "rows": cell.rows if cell.experts else None}
            if deadline_s is not None and time.monotonic() - start >= deadline_s:
                rows.append({**base, "not_run": NOT_RUN})
                continue
            try:
                rows.append({**base, **measure(d.build(cell, quick), quick, sampler, poll_s)})
            except Exception as e:  # noqa: BLE001 - a cell whose operands cannot be built
                rows.append({**base, "error": f"{type(e).__name__}: {str(e)[:200]}", "flagged": True})
            if common.DEVICE == "cuda":
                torch.cuda.empty_cache()  # the next cell's operands may be of another size
    return rows


def headline(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Per decision: cells that hold, and the worst picked / fastest with its cell."""
    out = []
    for name in dict.fromkeys(r["decision"] for r in rows):
        mine = [r for r in rows if r["decision"] == name and not r.get("not_run")]
        left = sum(1 for r in rows if r["decision"] == name and r.get("not_run"))
        held = sum(bool(r.get("holds")) for r in mine)
        worst = max((r for r in mine if r.get("ratio") is not None), key=lambda r: r["ratio"], default=None)
        tail = f", worst {worst['ratio']:.3f}x ({worst['cell']}: {worst['fastest']})" if worst else ""
        tail += f", {left} not run (deadline)" if left else ""
        out.append((f"{name}: cells where the choice holds", f"{held} / {len(mine)}{tail}"))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated decisions (default: all of DECISIONS)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no cell after this many seconds; the cells left are recorded as not run")
    args = p.parse_args(argv)
    if args.deadline_s is not None and not args.deadline_s > 0:
        p.error(f"--deadline-s must be > 0, got {args.deadline_s}")
    names = args.only.split(",") if args.only else list(DECISIONS)
    unknown = [n for n in names if n not in DECISIONS]
    if unknown:
        p.error(f"unknown decision {', '.join(unknown)}; choose from {', '.join(DECISIONS)}")
    require_cuda()
    grid = QUICK if args.quick else FULL
    rows = sweep(names, grid, args.quick, args.deadline_s)
    md = md_table(["decision", "cell", "picked", "fastest", "picked / fastest", "flag", "SM MHz median [min, max]"],
                  [[r["decision"], r["cell"], r.get("picked"), r.get("fastest"),
                    r.get("ratio") if r.get("ratio") is not None else r.get("error"),
                    "not run" if r.get("not_run") else "FLAG" if r.get("flagged") else "", _mhz(r)] for r in rows])
    failed = failures(rows)
    common.finish("sweep_dispatch", {"env": common.environment(), "grid": {**asdict(grid), "topk": TOPK},
                                     "tolerance": TOLERANCE, "rows": rows, "headline": headline(rows),
                                     "failures": failed, "markdown": md}, args.out)
    if failed:
        raise SystemExit("sweep_dispatch failed:\n" + "\n".join(failed))


def _mhz(row: Mapping[str, Any]) -> str:
    """The row's SM clock while its alternatives were timed ("" where none was read)."""
    c = row.get("clocks") or {}
    if "sm_mhz_median" not in c:
        return ""
    return f"{c['sm_mhz_median']:.0f} [{c['sm_mhz_min']:.0f}, {c['sm_mhz_max']:.0f}]"


def failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per cell that raised and per alternative that failed in a measured cell: a cell
    judged without one of its alternatives may name the wrong fastest, so the run fails (cells
    the deadline left unmeasured are reported as not run, not as failures)."""
    out = []
    for r in rows:
        where = f"{r.get('decision')} {r.get('cell')}"
        if r.get("error"):
            out.append(f"{where}: {r['error']}")
        out += [f"{where}: {name}: {error}" for name, error in sorted(r.get("errors", {}).items())]
    return out


if __name__ == "__main__":
    main()
