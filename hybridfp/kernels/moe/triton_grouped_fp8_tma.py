"""TMA form of the grouped FP8 GEMM (``triton_grouped_fp8_gemm``): the same sums and epilogue,
with the operands read through per-expert tensor descriptors built on the device and a
persistent grid.

Why: the pointer kernel reads each FP8 tile with cp.async (one 16-byte request per thread and
row); at the 64-expert MoE's shapes that makes it no faster than BF16's grouped GEMM, and the
grouped GEMMs are a large share of an FP8 step's kernel time (a ``--profile`` run of
``python -m bench.bench_moe``). TMA plus a persistent grid speeds up the BF16 grouped GEMM the same way.

Why descriptors built on the device: each expert's operands are a sub-matrix of a joined copy
(fprop / dgrad: the expert's rows; wgrad: the expert's zero-padded block of token columns). A
descriptor whose shape is exactly that sub-matrix makes TMA fill zeros past the expert's rows
and past its reduction, so no tile ever reads another expert's codes (a host descriptor over
the whole copy would read the next expert's block in a K tail, and 0 x inf from there would
be NaN). The kernel builds two descriptors a tile, three with ``tma_store`` (the output rows
of the expert) (``tl.make_tensor_descriptor``: a 128-byte tensor map in a global workspace,
``triton.set_allocator``).

Tiles (``python -m bench.bench_grouped_gemm --part fp8`` on an NVIDIA H200): 256x128 tiles are
the fastest of the sweep at every one of the 64-expert MoE's six GEMMs and faster than the
pointer kernel; the short-K wgrad gains from the bulk stores (its epilogue is a large share of
a tile's time).

What TMA needs, checked by the host (``applies``): every base (the copy's pointer plus the
expert's byte offset) and row stride a multiple of 16 bytes (``ALIGN == 16`` in the pointer
kernel's terms), and every row count, reduction and width below 2**31 (descriptor shapes are
int32).

Accumulation and epilogue: as the pointer kernel (FP8 MMA promoted to FP32 every ``PROMOTE``
products, ``v = acc * (sa_e * sb_e) (+ bias_e)``, one rounding). A tile sums the same K tiles
in the same order as the pointer kernel with the same BK, so for equal tiles the two agree
bitwise on the GPU. Under the interpreter the codes are decoded to their FP32 values and summed
in FP32 (``CODES``), as in the pointer kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ...utils.device import sm_count, tile_plan, to_device
from .._common import expert_row_tile, swizzled_tile
from .._common_encode import bf16_nan16
from ..triton_decode import fp8_f32
from ..triton_epilogue import OUT_CODE, out_value, store_out
from .triton_grouped_gemm import TmaConfig


@dataclass(frozen=True)
class Fp8TmaConfig(TmaConfig):
    """Tile and schedule of the FP8 TMA kernel: the BF16 TMA kernel's (``TmaConfig``: tile
    ``bm`` x ``bn``, K step ``bk``, ``warps``, ``stages``, ``group_m``, ``flatten``,
    ``programs``), plus ``tma_store``: the output tile written through a per-expert descriptor
    (an asynchronous bulk store: the next tile's loads and MMAs run while it drains; rows past
    the expert's are clipped by the descriptor) instead of masked pointer stores."""

    tma_store: bool = False


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, **kw) -> Fp8TmaConfig:
    """A swept config: L2 swizzle groups of 8 row tiles (the pointer kernel's GROUP_M)."""
    return Fp8TmaConfig(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, **{"group_m": 8, **kw})


#: Configs ``python -m bench.bench_grouped_gemm --part fp8`` sweeps (name -> config).
CONFIGS: dict[str, Fp8TmaConfig] = {
    "128x128x128 w8 st4": _config(128, 128, 128, 8, 4),
    "128x128x128 w8 st4 flat": _config(128, 128, 128, 8, 4, flatten=True),
    "128x256x128 w8 st3": _config(128, 256, 128, 8, 3),
    "128x256x128 w8 st3 flat": _config(128, 256, 128, 8, 3, flatten=True),
    "128x128x64 w4 st4": _config(128, 128, 64, 4, 4),
    "128x128x64 w4 st4 flat": _config(128, 128, 64, 4, 4, flatten=True),
    "128x256x64 w8 st4 flat": _config(128, 256, 64, 8, 4, flatten=True),
    "128x128x128 w4 st3 flat": _config(128, 128, 128, 4, 3, flatten=True),
    "256x128x128 w8 st3": _config(256, 128, 128, 8, 3),
    "128x256x128 w8 st2": _config(128, 256, 128, 8, 2),
    "128x256x64 w8 st3": _config(128, 256, 64, 8, 3),
    "128x256x128 w8 st3 g16": _config(128, 256, 128, 8, 3, group_m=16),
    "256x128x64 w8 st4": _config(256, 128, 64, 8, 4),
    "128x256x128 w8 st3 store": _config(128, 256, 128, 8, 3, tma_store=True),
    "128x128x128 w8 st4 store": _config(128, 128, 128, 8, 4, tma_store=True),
    "256x128x128 w8 st3 store": _config(256, 128, 128, 8, 3, tma_store=True),
    "128x256x128 w8 st2 store": _config(128, 256, 128, 8, 2, tma_store=True),
}


@triton.jit
def _kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, meta_ptr, T, N, E, P,
            BIAS: tl.constexpr, OUT: tl.constexpr, NAN16: tl.constexpr, CODES: tl.constexpr,
            E5A: tl.constexpr, E5B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            GROUP: tl.constexpr, PROMOTE: tl.constexpr, EP: tl.constexpr, FLATTEN: tl.constexpr,
            STORE_TMA: tl.constexpr):
    # P persistent programs take the tiles of the pointer kernel's swizzled order round-robin
    tiles = T * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, P, flatten=FLATTEN):
        t, j = swizzled_tile(tile, T, N, BN, GROUP)
        e, te = expert_row_tile(meta_ptr, t, E, EP)
        te = te.to(tl.int32)  # descriptor coordinates are int32 (rows < 2**31: applies())
        # A offset, A row stride, B offset, B row stride, K, out row, rows (triton_grouped_fp8_gemm)
        meta = meta_ptr + (E + 1) + e.to(tl.int64) * 7
        a_off = tl.load(meta)
        a_ld = tl.load(meta + 1)
        b_off = tl.load(meta + 2)
        b_ld = tl.load(meta + 3)
        k_e = tl.load(meta + 4).to(tl.int32)
        o_row = tl.load(meta + 5)
        m_e = tl.load(meta + 6).to(tl.int32)
        # descriptors of exactly this expert's operands: zeros past its rows and its reduction
        # (an expert with k_e = 0 loads nothing; its descriptors get a width of 1 to stay valid)
        width = tl.maximum(k_e, 1)
        a_desc = tl.make_tensor_descriptor(a_ptr + a_off, shape=[m_e, width], strides=[a_ld, 1],
                                           block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr + b_off, shape=[N, width], strides=[b_ld, 1],
                                           block_shape=[BN, BK])
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, k_e, BK):
            a = a_desc.load([te * BM, k])
            b = b_desc.load([j * BN, k])
            if CODES:  # the interpreter: exact FP32 values of the codes, FP32 sums
                acc = tl.dot(fp8_f32(a.to(tl.int32), E5A), fp8_f32(b.to(tl.int32), E5B).T, acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        cols = j * BN + tl.arange(0, BN)
        cmask = cols < N
        e64, c64 = e.to(tl.int64), cols.to(tl.int64)
        v = acc * (tl.load(sa_ptr + e64) * tl.load(sb_ptr + e64))
        if BIAS:
            v = v + tl.load(bias_ptr + e64 * N + c64, mask=cmask, other=0.0)[None, :]
        if STORE_TMA:  # the expert's [m_e, N] output rows: rows past them are not written
            o_desc = tl.make_tensor_descriptor(out_ptr + o_row * N, shape=[m_e, N], strides=[N, 1],
                                               block_shape=[BM, BN])
            o_desc.store([te * BM, j * BN], out_value(v, OUT, NAN16, HW=not CODES))
        else:
            rows = te * BM + tl.arange(0, BM)
            optrs = out_ptr + (o_row + rows.to(tl.int64))[:, None] * N + c64[None, :]
            store_out(optrs, v, (rows < m_e)[:, None] & cmask[None, :], OUT, NAN16, HW=not CODES)


def applies(meta: np.ndarray, n: int, align: int, out: Optional[torch.Tensor] = None,
            cfg: Optional[Fp8TmaConfig] = None) -> bool:
    """Whether the TMA kernel can read the experts of ``meta`` (the pointer kernel's [E, 7]
    table: A offset, A row stride, B offset, B row stride, K, out row, rows) given the
    alignment ``align`` the host found for every base, offset, stride and K: 16 bytes, and every
    descriptor dimension within int32; with ``cfg.tma_store`` also write ``out``: a 16-byte
    aligned base and row (N elements)."""
    if align != 16 or max(int(meta[:, 4].max(initial=0)), int(meta[:, 6].max(initial=0)), n) >= 2**31:
        return False
    return not (cfg is not None and cfg.tma_store and out is not None
                and (out.data_ptr() % 16 or (n * out.element_size()) % 16))


def _workspace(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Triton's allocator for the descriptors' global workspace (128 bytes a descriptor and
    program), on the current CUDA device (the launch's)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton :func:`_workspace` as its allocator unless the program has set its own (a
    user's allocator is kept: any CUDA allocation serves)."""
    from triton.runtime import _allocation  # Triton's allocator state: no public getter

    current = _allocation._allocator.get()
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_workspace)


def launch(base_a: torch.Tensor, base_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           bias: Optional[torch.Tensor], out: torch.Tensor, meta: np.ndarray, n: int, cfg: Fp8TmaConfig,
           promote: int) -> torch.Tensor:
    """Run the TMA kernel over ``meta`` (see :func:`applies`; the caller checked it)."""
    experts = meta.shape[0]
    packed, row_tiles = tile_plan(meta[:, 6], meta, cfg.bm)
    if row_tiles == 0 or n == 0:
        return out
    device = out.device
    codes = not out.is_cuda  # the interpreter (module docstring)
    aa, bb = (base_a.view(torch.uint8), base_b.view(torch.uint8)) if codes else (base_a, base_b)
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    tiles = row_tiles * triton.cdiv(n, cfg.bn)
    programs = min(cfg.programs or (sm_count(device.index or 0) if out.is_cuda else 4), tiles)
    _ensure_allocator()
    _kernel[(programs,)](aa, bb, scale_a, scale_b, bias if bias is not None else scale_a, dst,
                         to_device(packed, device), row_tiles, n, experts, programs,
                         BIAS=bias is not None, OUT=OUT_CODE[out.dtype], NAN16=bf16_nan16(device), CODES=codes,
                         E5A=base_a.dtype == torch.float8_e5m2, E5B=base_b.dtype == torch.float8_e5m2,
                         BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group_m, PROMOTE=min(promote, cfg.bk),
                         EP=triton.next_power_of_2(experts + 1), FLATTEN=cfg.flatten, STORE_TMA=cfg.tma_store,
                         num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=False)
    return out
