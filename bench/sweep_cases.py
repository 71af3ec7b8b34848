"""The decisions ``bench.sweep_dispatch`` sweeps: the grid and its cells, and per decision a
cell's alternatives (forced through the policy or the kernel's own arguments) and the one the
library picks, asked of the library's own decision functions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from bench import common


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


def _fp8_rows_call(cell: Cell, dgrad: bool = False) -> Callable[..., Any]:
    """The Triton FP8 grouped GEMM on an expert's rows, on fresh operands: fprop, [rows, hidden]
    x [ffn, hidden]ᵀ per expert (E4M3 x E4M3), or with ``dgrad`` dx = dy [rows, ffn] (E5M2) x
    W, W's columnwise copy [hidden, ffn] (E4M3) as the library passes it. A call taking the
    kernel's keyword arguments (``tile`` / ``tma``)."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as k
    red, width = (cell.ffn, cell.hidden) if dgrad else (cell.hidden, cell.ffn)
    sizes = splits_for(cell.rows, cell.experts)
    a = list(torch.split(_randn(cell.rows, red).to(E5M2 if dgrad else E4M3), sizes))
    b = list(_randn(cell.experts, width, red).to(E4M3).unbind(0))
    out = torch.empty(cell.rows, width, device=common.DEVICE, dtype=torch.bfloat16)
    rows = [sum(sizes[:e]) for e in range(cell.experts)]
    sa, sb = _scales(cell.experts), _scales(cell.experts)
    return lambda **kw: k.grouped_fp8(a, b, [red] * cell.experts, sa, sb, out, rows, **kw)


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


def _with_tile(run: Callable[..., Any]) -> Callable[[Optional[Any]], Any]:
    """``run`` as ``_tile_case`` calls it: with ``tile=t``, or its own default for None."""
    return lambda t: run(**({} if t is None else {"tile": t}))


def fp8_tile_rows(cell: Cell, quick: bool = False) -> Case:
    """The Triton FP8 grouped GEMM's pointer kernel, fprop [rows, hidden] x [ffn, hidden]ᵀ per expert."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as k
    return _tile_case(k.TILE, _others(FP8_ROW_TILES, quick), _with_tile(_fp8_rows_call(cell)))


def fp8_tile_wgrad(cell: Cell, quick: bool = False) -> Case:
    """The Triton FP8 grouped GEMM's pointer kernel, wgrad (``_fp8_wgrad_call``)."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as k
    return _tile_case(k.WGRAD_TILE, _others(FP8_WGRAD_TILES, quick), _with_tile(_fp8_wgrad_call(cell)))


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
    """The Triton FP8 grouped GEMM's TMA kernel config for fprop (``Policy.grouped_fp8_tma_rows``),
    against its neighbours."""
    return _tma_case("grouped_fp8_tma_rows", _others(FP8_TMA_ROWS, quick), _fp8_rows_call(cell))


def fp8_tma_dgrad(cell: Cell, quick: bool = False) -> Case:
    """The same config for dgrad (the policy has one for fprop and dgrad: E5M2 dy, the reduction
    over ffn), against the same neighbours."""
    return _tma_case("grouped_fp8_tma_rows", _others(FP8_TMA_ROWS, quick), _fp8_rows_call(cell, dgrad=True))


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
    # every expert count: the library runs these configs from many_experts (16) on
    Decision("fp8_tma_rows", "Triton FP8 grouped fprop: the policy's TMA config", moe_cells, fp8_tma_rows),
    Decision("fp8_tma_dgrad", "Triton FP8 grouped dgrad: the policy's TMA config", moe_cells, fp8_tma_dgrad),
    Decision("fp8_tma_wgrad", "Triton FP8 grouped wgrad: the policy's TMA config", moe_cells, fp8_tma_wgrad),
    Decision("bf16_tile", "Triton BF16 grouped fprop: pointer TILE", _ends, bf16_tile),
    Decision("nvfp4_hybrid_tile", "NVFP4 + MXFP8 quantize: DEFAULT_TILES['natural']", _dense_cells,
             nvfp4_hybrid_tile),
    Decision("mxfp8_decode_tile", "MXFP8 1x32 decode: default tile", _dense_cells, mxfp8_decode_tile),
]}
