"""SASS instruction counts of the quantize kernels compiled offline for the H200 (sm90), no GPU needed.

The quantize kernels are instruction-issue bound (Nsight Compute): at ~4 TB/s a BF16 quantize
can spend roughly 25 instructions per element, so the static count per thread of one tile,
divided by the elements each thread handles, predicts a kernel's share of copy bandwidth before
any device time is spent. Each case compiles one kernel with Triton's nvidia backend
(``tt.divisibility`` 16 on pointers, sizes and the row stride, as the launches specialize them),
disassembles the cubin with the wheel's ``cuobjdump -sass`` and counts opcodes.

    python -m bench.tools.sass_count [--case NAME ...] [--top 8]
    python -m bench.tools.sass_count --resources --match "grouped gemm"   # registers, shared memory,
        TMA / wgmma / local-memory opcodes, warp-specialized partitions
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: arguments specialised as divisible by 16 where a kernel has them (the last line: the grouped GEMM's)
_DIV = ("x_ptr", "src_ptr", "s_ptr", "src_stride", "s_stride", "rd_ptr", "rs_ptr", "cd_ptr", "cs_ptr", "R", "C", "NBR", "sxr",
        "a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "bias_ptr", "out_ptr", "meta_ptr", "N", "sam", "sbe", "sbn", "soe",
        "som", "K", "bs_ptr", "sbs")
_NV_SIG = dict(x_ptr="*i16", ramax_ptr="*fp32", camax_ptr="*fp32", rd_ptr="*u8", rs_ptr="*u8", cd_ptr="*u8",
               cs_ptr="*u8", R="i32", C="i32", sxr="i32", RCP6="fp32", rk0="i32", rk1="i32", ck0="i32", ck1="i32")
_NV = dict(sxc=1, ROW=True, COL=True, ROW_SCALED=False, ROW_WORDS=True, COL_WORDS=True, HW=True, DTYPE=1,
           BF16_NAN=0x7FC0)
_MX_SIG = dict(x_ptr="*i16", rd_ptr="*u8", rs_ptr="*u8", cd_ptr="*u8", cs_ptr="*u8", R="i32", C="i32", NBR="i32", sxr="i32",
               RCP="fp32", map_ptr="*i32")
#: the fused NVFP4 row + MXFP8 column kernel's: MXFP8's without the row map
_NVMX_SIG = {k: v for k, v in _MX_SIG.items() if k != "map_ptr"}
_FP8 = dict(RCEIL=True, EMAX=8, MBITS=3, BIAS=7, FP8_MAX=448.0)
#: FP8 block 1D (E4M3, power-of-two scales, 1x128 / 128x1, BF16 input, the default "natural" 128 / 32 rows);
#: loops are counted once (static).
_FB_SIG = dict(x_ptr="*i16", rd_ptr="*u8", rs_ptr="*fp32", cd_ptr="*u8", cs_ptr="*fp32", R="i32", C="i32",
               sxr="i32", eps="fp32")
_FB = dict(sxc=1, POW2=True, MBITS=3, BIAS=7, FP8_MAX=448.0, B=128, DTYPE=1, CR=128, HW=True, PACK=True, RW=32,
           EVEN=True)
#: The TMA rows kernel of the grouped GEMM: host descriptors over BF16 A [M, K] / B [E * N, K],
#: BF16 output (what the MoE benchmark launches), row and column scales.
_TMA_SIG = dict(sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*fp32", out_ptr="*i16", meta_ptr="*i64", T="i32", N="i32",
                K="i32", E="i32", som="i32", P="i32")


#: TMA_CONFIGS of the kernel module spelled out (this module imports no hybridfp code at import time):
#: name -> (BM, BN, BK, warps, stages, flatten, swizzle group)
_TMA_SPECS: dict[str, tuple[int, int, int, int, int, bool, int]] = {
    "128x256x64 w8 st3": (128, 256, 64, 8, 3, False, 16),
    "128x256x64 w8 st4": (128, 256, 64, 8, 4, False, 16),
    "128x256x64 w8 st3 flat": (128, 256, 64, 8, 3, True, 16),
    "128x256x64 w8 st4 flat": (128, 256, 64, 8, 4, True, 16),
    "128x256x64 w8 st3 g8": (128, 256, 64, 8, 3, False, 8),
    "256x128x64 w8 st3": (256, 128, 64, 8, 3, False, 16),
    "128x128x64 w8 st5 flat": (128, 128, 64, 8, 5, True, 16),
}
#: FP32-output configs (TMA_F32_CONFIGS spelled out): the epilogue's layout change takes BM x BN x 4
#: bytes of shared memory beside the K ring, so the BF16 default (3 stages) does not fit
_TMA_F32_SPECS: dict[str, tuple[int, int, int, int, int, bool, int]] = {
    "128x256x64 w8 st2 flat": (128, 256, 64, 8, 2, True, 16),
    "128x128x64 w8 st4 flat": (128, 128, 64, 8, 4, True, 16),
    "128x128x64 w8 st5 flat": (128, 128, 64, 8, 5, True, 16),
    "256x128x64 w8 st2 flat": (256, 128, 64, 8, 2, True, 16),
}


def _tma_case(name: str, f32: bool = False) -> tuple:
    """The sass_count case of the TMA rows kernel at ``_TMA_SPECS[name]`` (BF16 output) or
    ``_TMA_F32_SPECS[name]`` (``f32``: FP32 output)."""
    bm, bn, bk, warps, stages, flatten, group = (_TMA_F32_SPECS if f32 else _TMA_SPECS)[name]
    sig = dict(_TMA_SIG, a_desc=f"tensordesc<bf16[{bm},{bk}]>", b_desc=f"tensordesc<bf16[{bn},{bk}]>",
               out_ptr="*fp32" if f32 else "*i16")
    consts = dict(SA=True, SB=True, BIAS=False, OUT=0 if f32 else 1, NAN16=0x7FFF, BITS=False, BM=bm, BN=bn, BK=bk, GROUP=group, EP=16,
                  FLATTEN=flatten)
    return ("moe.triton_grouped_gemm", "_tma_rows_kernel", sig, consts, bm * bn // (32 * warps), warps,
            dict(num_stages=stages, enable_fp_fusion=False))


from hybridfp.kernels.moe.triton_grouped_fp8_tma import CONFIGS as FP8_TMA_CONFIGS  # noqa: E402 (its cases)


def _fp8_tma_case(name: str) -> tuple:
    """The sass_count case of the grouped FP8 TMA kernel (device-built descriptors) at
    ``triton_grouped_fp8_tma.CONFIGS[name]``: wgrad's operands (E5M2 dy x E4M3 x), BF16 output."""
    c = FP8_TMA_CONFIGS[name]
    sig = dict(a_ptr="*fp8e5", b_ptr="*fp8e4nv", sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*fp32", out_ptr="*i16",
               meta_ptr="*i64", T="i32", N="i32", E="i32", P="i32")
    consts = dict(BIAS=False, OUT=1, NAN16=0x7FC0, CODES=False, E5A=True, E5B=False, BM=c.bm, BN=c.bn, BK=c.bk,
                  GROUP=c.group_m, PROMOTE=min(128, c.bk), EP=128, FLATTEN=c.flatten, STORE_TMA=c.tma_store)
    return ("moe.triton_grouped_fp8_tma", "_kernel", sig, consts, c.bm * c.bn // (32 * c.warps), c.warps,
            dict(num_stages=c.stages, enable_fp_fusion=False))


#: name -> (module, kernel, signature, constexprs, elements per thread of the tile, warps[, compile options]).
CASES: dict[str, tuple] = {
    "split rht (32, 8)": ("triton_split_rht", "_split_kernel",
                          dict(y_ptr="*i16", out_ptr="*i16", flags_ptr="*i32", R="i32", K="i32", KP="i32", sy0="i32",
                               sy1="i32", so0="i32"),
                          dict(DTYPE=1, SIGNS=0b1101011111101000, BR=32, BT=8), 32, 4, {"enable_fp_fusion": False}),
    "nvfp4 row+col (2, 128)": ("triton_nvfp4", "_nvfp4_1d_kernel", _NV_SIG,
                               dict(_NV, SR=False, RHT=False, BT=2, BC=128), 32, 4),
    "nvfp4 rht row+col (2, 64)": ("triton_nvfp4", "_nvfp4_1d_kernel", _NV_SIG,
                                  dict(_NV, SR=False, RHT=True, BT=2, BC=64), 16, 4),
    "nvfp4 rht+sr row+col (2, 64)": ("triton_nvfp4", "_nvfp4_1d_kernel", _NV_SIG,
                                     dict(_NV, SR=True, RHT=True, BT=2, BC=64), 16, 4),
    **{f"nvfp4 rht+sr row+col {t}": ("triton_nvfp4", "_nvfp4_1d_kernel", _NV_SIG,
                                      dict(_NV, SR=True, RHT=True, BT=t[0], BC=t[1]), t[0] * t[1] // 8, 4)
       for t in [(2, 128), (1, 256), (2, 256)]},
    "nvfp4 amax + rht amax (2, 256)": (
        "triton_nvfp4", "_nvfp4_amax_kernel",
        dict(x_ptr="*i16", amax_ptr="*i32", row_amax_ptr="*i32", rht_amax_ptr="*i32", R="i32", C="i32", sxr="i32"),
        dict(sxc=1, AMAX=True, ROW_AMAX=False, RHT_AMAX=True, DTYPE=1, BF16_NAN=0x7FC0, HW=True, BT=2, BC=256), 64, 4),
    # WIDE=2: triton_mxfp8.WIDE_STORES, what quantize launches ("slices" columnwise stores)
    **{f"mxfp8 {what} (64, 128)": ("triton_mxfp8", "_mxfp8_1d_kernel", _MX_SIG,
                                   dict(_FP8, sxc=1, ROW=row, COL=col, DTYPE=1, BR=64, BC=128, PACK=True, HW=True,
                                        MAP=mapped, WIDE=2, GRID2=True), 64, 4)
       for what, row, col, mapped in [("row+col", True, True, False), ("row", True, False, False),
                                      ("col", False, True, False), ("col, row map", False, True, True),
                                      ("row+col, row map", True, True, True)]},
    # MXFP8 1D copies written as their BF16 decodes (quantize(decoded=True): "slices", BF16 on the GPU, no scales)
    **{f"mxfp8 decoded {what} (32, 128)": ("triton_mxfp8", "_mxfp8_1d_kernel",
                                           dict(_MX_SIG, rd_ptr="*bf16", cd_ptr="*bf16"),
                                           dict(_FP8, sxc=1, ROW=row, COL=col, DTYPE=1, BR=32, BC=128, PACK=True,
                                                HW=True, MAP=mapped, WIDE=2, GRID2=True, DECODED=True, NAN16=0x7FFF),
                                           32, 4)
       for what, row, col, mapped in [("row+col", True, True, False), ("row", True, False, False),
                                      ("col", False, True, False), ("row+col, row map", True, True, True)]},
    # MXFP8 1D method="natural": the columnwise copy from natural [rs, BC] slices (the rowwise one unchanged),
    # E4M3 code words from two paired inline-PTX conversions (_common_encode.e4m3_word4), WIDE as launched
    **{f"mxfp8 natural {what} {t} rs{rs} nw{nw}": (
        "triton_mxfp8", "_mxfp8_1d_kernel", _MX_SIG,
        dict(_FP8, sxc=1, ROW=row, COL=col, DTYPE=1, BR=t[0], BC=t[1], PACK=True, HW=2, MAP=mapped, NATURAL=True,
             RS=rs, WIDE=2, GRID2=True), t[0] * t[1] // (32 * nw), nw)
       for what, row, col, mapped in [("row+col", True, True, False), ("col", False, True, False),
                                      ("col, row map", False, True, True), ("row+col, row map", True, True, True)]
       for t, nw in [((64, 128), 4), ((128, 128), 4), ((32, 128), 4), ((64, 256), 8), ((64, 256), 4), ((64, 128), 2)]
       for rs in (8, 16, 32)},
    **{f"nvfp4 row + mxfp8 col {src} (32, 64)": (
        "triton_hybrid_nvfp4", "_nvfp4_mxfp8_kernel",
        dict(_NVMX_SIG, amax_ptr="*fp32", RCP6="fp32"),
        dict(_FP8, sxc=1, ROW=True, COL=True, ROW_SCALED=False, SRC_DEQ=src == "rd", DTYPE=1, BR=32, BC=64,
             PACK=True, WORDS=True, HW=True), 32, 2) for src in ("rd", "orig")},
    # copies written as their BF16 decodes (quantize(decoded=...)): Composer-2's input (row-scaled, rows decoded,
    # columns as codes: "natural") and weights (global amax, both decoded: "trans")
    "nvfp4 row decoded + mxfp8 col rd natural row-scaled (32, 64) nw2": (
        "triton_hybrid_nvfp4", "_nvfp4_mxfp8_kernel", dict(_NVMX_SIG, amax_ptr="*fp32", RCP6="fp32", rd_ptr="*i16"),
        dict(_FP8, sxc=1, ROW=True, COL=True, ROW_SCALED=True, SRC_DEQ=True, DTYPE=1, BR=32, BC=64, PACK=True,
             WORDS=True, HW=2, WIDE=True, NATURAL=True, GRID2=True, DEC_ROW=True, NAN16=0x7FFF), 32, 2),
    "nvfp4 row + mxfp8 col both decoded rd trans global (32, 64) nw2": (
        "triton_hybrid_nvfp4", "_nvfp4_mxfp8_kernel",
        dict(_NVMX_SIG, amax_ptr="*fp32", RCP6="fp32", rd_ptr="*i16", cd_ptr="*bf16"),
        dict(_FP8, sxc=1, ROW=True, COL=True, ROW_SCALED=False, SRC_DEQ=True, DTYPE=1, BR=32, BC=64, PACK=True,
             WORDS=True, HW=True, WIDE=True, NATURAL=False, GRID2=True, DEC_ROW=True, DEC_COL=True, NAN16=0x7FFF),
        32, 2),
    # method="natural": four [8, BC] row slices per 32-row block, code words from paired conversions; row-scaled
    # (Composer-2's operand), WIDE as launched
    # (Composer-2's weights: the same kernel with one global amax, "global")
    **{f"nvfp4 row + mxfp8 col {src} {m} {scaled} {t} nw{nw}": (
        "triton_hybrid_nvfp4", "_nvfp4_mxfp8_kernel",
        dict(_NVMX_SIG, amax_ptr="*fp32", RCP6="fp32"),
        dict(_FP8, sxc=1, ROW=True, COL=True, ROW_SCALED=scaled == "row-scaled", SRC_DEQ=src == "rd", DTYPE=1,
             BR=t[0], BC=t[1], PACK=True, WORDS=True, HW=2 if m == "natural" else True, WIDE=True,
             NATURAL=m == "natural", GRID2=True),
        t[0] * t[1] // (32 * nw), nw)
       for src in ("rd", "orig") for m in ("trans", "natural") for scaled in ("row-scaled", "global")
       for t, nw in [((32, 64), 2), ((64, 64), 2), ((32, 128), 2), ((64, 128), 4), ((32, 64), 1), ((32, 32), 1)]},
    # the BF16 decodes at their default 1D tile (4, 512) / 2 warps (triton_decode._TILE_1D)
    **{f"decode {what} (4, 512)": (
        "triton_decode", "_decode_kernel",
        dict(src_ptr="*u8", s_ptr="*u8", out_ptr="*i32" if kind == 3 else "*i16", R="i32", C="i32", src_stride="i32",
             s_stride="i32", NSR="i32", NSC="i32"),
        dict(KIND=kind, E5M2=False, SR=1, SC=16 if kind == 3 else 32, SAFE_E=10, NAN16=0x7FFF, BR=4, BC=512,
             PAIRS=kind == 3, GRID2=True), 4 * 512 // 64, 2)
       for what, kind in [("nvfp4 pairs", 3), ("mxfp8", 1)]},
    "mxfp8 row + nvfp4 rht col (2, 64)": (
        "triton_hybrid_mxfp8_nvfp4", "_mxfp8_nvfp4_kernel",
        dict(x_ptr="*i16", camax_ptr="*fp32", rd_ptr="*u8", rs_ptr="*u8", cd_ptr="*u8", cs_ptr="*u8", R="i32",
             C="i32", sxr="i32", RCP="fp32", RCP6="fp32"),
        dict(_FP8, sxc=1, RHT=True, COL_WORDS=True, HW=True, DTYPE=1, BF16_NAN=0x7FC0, BT=2, BC=64), 16, 4),
    **{f"fp8 block 1x128 {what}": ("triton_fp8_block", "_fp8_block_1d_kernel", _FB_SIG,
                                   dict(_FB, ROW=row, COL=col), 128, 4)
       for what, row, col in [("row+col", True, True), ("row", True, False), ("col", False, True)]},
    "fp8 current row + block 1x128 col": (
        "triton_hybrid_fp8", "_fp8_current_block_kernel",
        dict(x_ptr="*i16", amax_ptr="*fp32", rd_ptr="*u8", sinv_ptr="*fp32", cd_ptr="*u8", cs_ptr="*fp32",
             R="i32", C="i32", sxr="i32", row_eps="fp32", col_eps="fp32"),
        dict(sxc=1, ROW_POW2=False, ROW_MBITS=3, ROW_BIAS=7, ROW_MAX=448.0, COL_POW2=True, COL_MBITS=3,
             COL_BIAS=7, COL_MAX=448.0, B=128, CW=128, RW=32, DTYPE=1, HW=True, PACK=True, NATURAL=True,
             EVEN=True), 128, 4),
    # a GEMM, not a cast: read its load opcodes (LDGSTS = cp.async vector loads; LDG x64 = the
    # 2-byte scalar operand loads without the reduction-bound alignment promise)
    **{f"grouped gemm (128, 128, 64) KALIGN {ka}": (
        "moe.triton_grouped_gemm", "_grouped_kernel",
        dict(a_ptr="*bf16", b_ptr="*bf16", sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*fp32", out_ptr="*i16",
             meta_ptr="*i64", T="i32", N="i32", E="i32", sam="i32", sbe="i32", sbn="i32", sa_e="i32", soe="i32", som="i32"),
        dict(sak=1, sbk=1, SA=True, SB=True, BIAS=False, OUT=0, NAN16=0x7FC0, BITS=False, BM=128, BN=128, BK=64,
             KALIGN=ka, GROUP=16, EP=128), 64, 8) for ka in (1, 8)},
    # the FP8 grouped GEMM's wgrad (E5M2 dy x E4M3 x, BF16 out) and the grouped FP8 quantize (row +
    # col): also the quickest offline check that a change to either still compiles for sm90
    "grouped fp8 gemm wgrad (128, 128, 64)": (
        "moe.triton_grouped_fp8_gemm", "_kernel",
        dict(a_ptr="*fp8e5", b_ptr="*fp8e4nv", sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*fp32", out_ptr="*i16",
             meta_ptr="*i64", T="i32", N="i32", E="i32"),
        dict(BIAS=False, OUT=1, NAN16=0x7FC0, CODES=False, E5A=True, E5B=False, BM=128, BN=128, BK=64, ALIGN=16,
             GROUP=8, PROMOTE=64, EP=128), 128, 4),
    "grouped fp8 quantize row+col (64, 128)": (
        "moe.triton_grouped_fp8", "_grouped_fp8_kernel",
        dict(x_ptr="*i16", amax_ptr="*fp32", meta_ptr="*i64", rd_ptr="*u8", cd_ptr="*u8", sinv_ptr="*fp32",
             C="i32", G="i32", sxr="i32", eps="fp32"),
        dict(sxc=1, POW2=False, ROW=True, COL=True, MBITS=3, BIAS=7, FP8_MAX=448.0, DTYPE=1, BR=64, BC=128, BG=128,
             HW=True, PACK=True, ANCHOR=False, GP=128), 32, 8),
    # the TMA rows kernel (kernel="tma"): UTMALDG loads feeding HGMMA, LDL / STL spills, registers
    **{f"grouped gemm tma {name}": _tma_case(name) for name in _TMA_SPECS},
    **{f"grouped gemm tma f32 {name}": _tma_case(name, f32=True) for name in _TMA_F32_SPECS},
    # the grouped FP8 GEMM's TMA kernel (descriptors built on the device, persistent grid)
    **{f"grouped fp8 gemm tma {name}": _fp8_tma_case(name) for name in FP8_TMA_CONFIGS},
}


def compile_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int,
                 **options: Any) -> Any:
    """``fn`` compiled for sm90 with the given argument types (constexprs by value); a parameter
    given neither takes its default as a constexpr (an optional argument left out, as the launch
    leaves it). ``options``: further compile options (``num_stages``, ``enable_fp_fusion``)."""
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    unknown = (set(signature) | set(constexprs)) - set(names)
    if unknown:  # a renamed argument would otherwise compile the kernel's default silently
        raise ValueError(f"sass_count: {fn.fn.__name__} has no arguments {sorted(unknown)}")
    constexprs = {**{n: p.default for n, p in params.items() if n not in signature and n not in constexprs
                     and p.default is not inspect.Parameter.empty}, **constexprs}
    sig = {n: ("constexpr" if n in constexprs else signature[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _DIV if n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def sass_text(cubin: bytes) -> str:
    """cuobjdump's SASS listing of a cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def opcode_counts(cubin: bytes) -> collections.Counter:
    """SASS opcodes of a cubin (predicated instructions counted by their opcode)."""
    return collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass_text(cubin)))


def instruction_md5(cubin: bytes) -> str:
    """md5 of the instruction stream (addresses dropped): equal for identical compiled code, so
    a change meant to leave a path alone can be checked against another tree offline."""
    lines = [line.split("*/", 1)[-1] for line in sass_text(cubin).splitlines() if "/*" in line and "*/" in line]
    return hashlib.md5("\n".join(lines).encode()).hexdigest()


def resources(compiled: Any) -> dict[str, Any]:
    """What decides a GEMM kernel's occupancy and pipelining: registers per thread and local
    memory (``cuobjdump -res-usage``), dynamic shared memory, warp-specialized partitions (TTGIR)
    and the TMA load / wgmma / spill opcodes."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = compiled.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    counts = opcode_counts(cubin)
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    return dict(regs=int(found.get("REG", 0)), stack=int(found.get("STACK", 0)), shared=compiled.metadata.shared,
                partitions=len(re.findall(r"partition\d+\(", compiled.asm["ttgir"])),
                **{op: counts[op] for op in ("UTMALDG", "HGMMA", "LDGSTS", "LDL", "STL", "USETMAXREG")})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", choices=list(CASES), help="default: every case")
    p.add_argument("--match", help="the cases whose name contains this (with or instead of --case)")
    p.add_argument("--top", type=int, default=8, help="opcodes listed per case")
    p.add_argument("--resources", action="store_true", help="registers, shared memory, TMA / wgmma / spill "
                   "opcodes per case instead (the GEMM kernels)")
    p.add_argument("--md5", action="store_true", help="print each case's instruction-stream md5 instead "
                   "(compare with the same cases compiled from another tree, e.g. a worktree of main)")
    args = p.parse_args(argv)
    import importlib
    if args.resources:
        print("| case | regs | stack | shared B | partitions | UTMALDG | HGMMA | LDGSTS | LDL | STL | USETMAXREG |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    elif not args.md5:
        print("| case | instructions / thread | per element | top opcodes |\n|---|---|---|---|")
    names = (args.case or []) + [n for n in CASES if args.match and args.match in n]
    for name in names or CASES:
        mod, kernel, sig, consts, per_thread, warps, *options = CASES[name]
        fn = getattr(importlib.import_module(f"hybridfp.kernels.{mod}"), kernel)
        compiled = compile_sm90(fn, sig, consts, warps, **(options[0] if options else {}))
        cubin = compiled.asm["cubin"]
        if args.resources:
            print(f"| {name} | " + " | ".join(str(v) for v in resources(compiled).values()) + " |", flush=True)
            continue
        if args.md5:
            print(f"{instruction_md5(cubin)}  {name}")
            continue
        counts = opcode_counts(cubin)
        total = sum(counts.values())
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
        print(f"| {name} | {total} | {total / per_thread:.0f} | {top} |")


if __name__ == "__main__":
    main()
