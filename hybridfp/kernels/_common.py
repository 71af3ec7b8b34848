"""Triton helpers shared by the kernels: tiles, launches, loads and stores, NaN-propagating
amaxes (the element encodes and scale rules are in :mod:`._common_encode`).

Addressing: kernels form one 64-bit base pointer per program (tile origin) and int32 offsets
inside the tile (:func:`tile_offsets`); 64-bit arithmetic on every element cost more than the
quantization itself. The wrappers check that a tile's offsets fit in int32
(:func:`check_int32_tiles`).

Inputs: BF16 is read as its raw int16 bits and widened by a shift (:func:`load_f32`): the
interpreter's BF16 -> FP32 conversion flushes BF16 subnormals to zero.

NaN: Triton's max reductions drop NaN on the GPU, so block amaxes reduce the magnitude bits
as integers (:func:`amax_nan`) and a NaN amax becomes the positive quiet NaN, as ``torch.amax``
of ``|x|`` gives.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch
import triton
import triton.language as tl

#: Input dtype -> constexpr code for :func:`load_f32` and ``_common_encode.round_to_dtype`` (0 = FP32).
DTYPE_CODE: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: What the quantize entry points return: (rowwise, columnwise), each (data, scales) or None.
Copies = Tuple[Optional[Tuple[torch.Tensor, torch.Tensor]], Optional[Tuple[torch.Tensor, torch.Tensor]]]
_POISON: list[Optional[int]] = [None]


@contextmanager
def poisoned_outputs(byte: int = 0x7F) -> Iterator[None]:
    """Inside the block every kernel output is filled with ``byte`` before its launch, so a test
    sees any element a kernel fails to write."""
    old = _POISON[0]
    _POISON[0] = byte
    try:
        yield
    finally:
        _POISON[0] = old


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs (poisoned inside :func:`poisoned_outputs`)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _POISON[0] is not None and t.numel():
        t.reshape(-1).view(torch.uint8).fill_(_POISON[0])
    return t


#: Largest tile extent (rows or columns) any kernel uses; bounds the int32 tile offsets.
MAX_TILE: int = 256


def check_int32_tiles(*extents: int) -> None:
    """Raise if an int32 offset inside a tile could overflow: every kernel's in-tile offset is
    below ``MAX_TILE * (sum of the tensor extents and strides it multiplies)``."""
    if MAX_TILE * (sum(abs(e) for e in extents) + 1) >= 2**31:
        raise ValueError(f"tensor extents/strides {extents} are too large for the int32 in-tile "
                         "offsets of the Triton quantize kernels.")


def kernel_input(x2: torch.Tensor) -> torch.Tensor:
    """What a kernel reads for ``x2``: BF16 as its raw int16 bits (see :func:`load_f32`)."""
    return x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2


@triton.jit
def load_f32(ptrs, mask, DTYPE: tl.constexpr):
    """Load an input tile as FP32. BF16 (``DTYPE == 1``) comes as int16 bits and is widened
    by a shift: the interpreter's BF16 -> FP32 conversion flushes BF16 subnormals to zero."""
    if DTYPE == 1:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def tile_offsets(rows, cols, sr, sc):
    """int32 offsets ``rows * sr + cols * sc`` of a tile (``rows`` [BR], ``cols`` [BC] are
    tile-local indices; the caller adds the tile origin to a 64-bit base pointer)."""
    return rows[:, None] * sr + cols[None, :] * sc


@triton.jit
def store_transposed_u8(ptr, code, lr, lc, r0, c0, R, C, PACK: tl.constexpr):
    """Store a [BR, BC] uint8 tile ``code`` (tile-local rows ``lr``, columns ``lc``; tile origin
    (r0, c0) of an [R, C] tensor) into the transposed [C, R] byte array at ``ptr``. With
    ``PACK`` (R % 4 == 0) four consecutive rows go as one little-endian int32, so the
    transposition moves 32-bit words instead of bytes."""
    store_transposed_rows_u8(ptr, code, lr, lc, r0, c0, R, R, C, PACK)


@triton.jit
def store_transposed_rows_u8(ptr, code, lr, lc, l0, c0, LD, LIMIT, C, PACK: tl.constexpr):
    """Store a [BR, BC] uint8 tile ``code`` as rows ``l0 + lr`` (those below ``LIMIT``) and
    columns ``c0 + lc`` (below ``C``) of a transposed byte array with row stride ``LD``: element
    (r, c) at ``ptr + c * LD + r``. ``PACK`` (LD and l0 multiples of 4, ``ptr`` 4-byte
    aligned): four consecutive rows go as one little-endian int32 word (a word whose first row
    is below LIMIT is stored whole)."""
    cmask = (c0 + lc) < C
    if PACK:
        BR: tl.constexpr = code.shape[0]
        BC: tl.constexpr = code.shape[1]
        w = tl.reshape(code.to(tl.int32), [BR // 4, 4, BC])
        w = tl.sum(w << (tl.arange(0, 4) * 8)[None, :, None], axis=1)  # disjoint bits: sum == or
        l4 = tl.arange(0, BR // 4)
        wmask = ((l0 // 4 + l4) < (LIMIT + 3) // 4)[:, None] & cmask[None, :]
        base = ptr.to(tl.pointer_type(tl.int32)) + c0.to(tl.int64) * (LD // 4) + l0 // 4
        tl.store(base + tile_offsets(l4, lc, 1, LD // 4), w, mask=wmask)
    else:
        base = ptr + c0.to(tl.int64) * LD + l0
        tl.store(base + tile_offsets(lr, lc, 1, LD), code, mask=((l0 + lr) < LIMIT)[:, None] & cmask[None, :])


@triton.jit
def _cat_rows(a, b):
    """[BC, N] and [BC, N] -> [BC, 2N] (a's rows first); the joined axis stays in each thread."""
    BC: tl.constexpr = a.shape[0]
    N: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [BC, 2 * N])


@triton.jit
def _row(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    """Tile row ``r`` (tile-local; ``rmax`` rows left in the tensor) of columns ``lc``: [BC].
    The row test is a vector (``lc * 0 + r``): the interpreter rejects a scalar & vector mask.
    ``MAP``: the row is source row ``mbase[r]`` of ``xbase`` (then the column base of the whole
    source), zeros where that entry is negative (a row map: ``load_rows32_t``)."""
    ok = (lc * 0 + r) < rmax
    if MAP:
        src = tl.load(mbase + lc * 0 + r, mask=ok, other=-1)  # one address per row: a broadcast
        return load_f32(xbase + src.to(tl.int64) * sxr + lc * sxc, cmask & ok & (src >= 0), DTYPE)
    else:
        return load_f32(xbase + r * sxr + lc * sxc, cmask & ok, DTYPE)


@triton.jit
def _rows4(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    a = tl.join(_row(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                _row(xbase, r + 1, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    b = tl.join(_row(xbase, r + 2, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                _row(xbase, r + 3, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    return _cat_rows(a, b)


@triton.jit
def _rows16(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase, MAP: tl.constexpr):
    a = _cat_rows(_rows4(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                  _rows4(xbase, r + 4, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    b = _cat_rows(_rows4(xbase, r + 8, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                  _rows4(xbase, r + 12, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))
    return _cat_rows(a, b)


@triton.jit
def load_rows32_t(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE: tl.constexpr, mbase=None, MAP: tl.constexpr = False):
    """Tile rows ``r .. r + 31`` of columns ``lc`` as a TRANSPOSED [BC, 32] FP32 tile (0 past
    the tensor: ``rmax`` rows left from the tile origin, ``cmask`` the column mask). ``MAP``:
    tile row i is source row ``mbase[i]`` (``mbase`` the row map at the tile origin; negative:
    a zero row) of the source whose column base is ``xbase``, so a zero-padded copy of row
    groups is read without being written first.

    Why: a 32x1 (or 128x1) columnwise block reduced over a natural [rows, BC] tile is a
    cross-warp reduction (shared memory, barriers) plus a byte transpose for the store. Here
    the tile is built from 32 row loads joined along a new minor axis, and ``tl.join`` keeps
    that axis inside each thread: with BC = 32 * num_warps every thread holds the 32 rows of
    one column, so the block amax is register-local and the transposed codes leave as
    contiguous words (:func:`store_words_t`). Each row load is still coalesced across the warp
    (consecutive threads, consecutive columns)."""
    return _cat_rows(_rows16(xbase, r, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP),
                     _rows16(xbase, r + 16, lc, rmax, cmask, sxr, sxc, DTYPE, mbase, MAP))


@triton.jit
def store_words_t(ptr, code, lc, c0, r, R, C, PACK: tl.constexpr, WIDE: tl.constexpr = False):
    """Store a transposed [BC, 32] uint8 code tile (rows ``r .. r + 31`` of columns ``c0 + lc``
    of an [R, C] tensor; ``r`` absolute) into the [C, R] byte array at ``ptr``. With ``PACK``
    (R % 4 == 0) each column's 32 codes go as eight little-endian int32 words: two 16-byte
    stores per thread, or with ``WIDE`` one [BC, 8] word store, which the compiler lays out
    two threads per column (through shared memory) so that each L2 write request carries a
    whole 32-byte sector instead of half of one (Nsight Compute: the transposed copies are
    bound by the L2's request rate, not by bytes); else bytewise."""
    BC: tl.constexpr = code.shape[0]
    cmask = (c0 + lc) < C
    if PACK:
        w = tl.reshape(code.to(tl.int32), [BC, 8, 4])
        w = tl.sum(w << (tl.arange(0, 4) * 8)[None, None, :], axis=2)  # disjoint bits: sum == or
        store_code_words_t(ptr, w, lc, c0, r, R, C, WIDE)
    else:
        l32 = tl.arange(0, 32)
        base = ptr + c0.to(tl.int64) * R + r
        tl.store(base + tile_offsets(lc, l32, R, 1), code, mask=cmask[:, None] & ((r + l32) < R)[None, :])


@triton.jit
def store_code_words_t(ptr, w, lc, c0, r, R, C, WIDE: tl.constexpr = False):
    """Store [BC, 8] int32 code words (rows ``r .. r + 31`` of columns ``c0 + lc``, word j = rows
    4j .. 4j + 3; R % 4 == 0) into the [C, R] byte array at ``ptr``, as :func:`store_words_t`
    does (``WIDE``: one [BC, 8] store, else two 16-byte stores per thread)."""
    BC: tl.constexpr = w.shape[0]
    cmask = (c0 + lc) < C
    base = ptr.to(tl.pointer_type(tl.int32)) + c0.to(tl.int64) * (R // 4) + r // 4
    if WIDE:
        l8 = tl.arange(0, 8)
        tl.store(base + tile_offsets(lc, l8, R // 4, 1), w, mask=cmask[:, None] & ((r // 4 + l8) < R // 4)[None, :])
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(w, [BC, 2, 4]), (0, 2, 1)))  # words 0-3, 4-7
        l4 = tl.arange(0, 4)
        off = tile_offsets(lc, l4, R // 4, 1)
        tl.store(base + off, lo, mask=cmask[:, None] & ((r // 4 + l4) < R // 4)[None, :])
        tl.store(base + off + 4, hi, mask=cmask[:, None] & ((r // 4 + 4 + l4) < R // 4)[None, :])


@triton.jit
def program_tile(C, BR: tl.constexpr, BC: tl.constexpr, GRID2: tl.constexpr = False):
    """(pr, pc): the [BR, BC] tile of this program, tiles numbered row-major over C columns;
    ``GRID2``: launched on :func:`tile_grid`'s 2D grid (column tile, row tile), where no integer
    division is needed (~30 instructions a thread, ~1 an element for 32-element threads)."""
    if GRID2:
        return tl.program_id(1), tl.program_id(0)
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    return pid // nc, pid % nc


#: the most row tiles :func:`tile_grid` puts on a 2D grid (CUDA's limit of the grid's y extent)
GRID_Y_MAX = 65535


def tile_grid(rows: int, cols: int, br: int, bc: int) -> tuple[tuple[int, ...], bool]:
    """(launch grid, GRID2 for :func:`program_tile`) of [br, bc] tiles: (column tiles, row tiles)
    while the row tiles fit the grid's y extent (the x index runs fastest, so programs start in the
    same row-major order as on a 1D grid), else one dimension of all tiles."""
    nr, nc = triton.cdiv(rows, br), triton.cdiv(cols, bc)
    if nr <= GRID_Y_MAX:
        return (nc, nr), True
    return (nr * nc,), False


@triton.jit
def load_tile(x_ptr, R, C, sxr, sxc, DTYPE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """This program's [BR, BC] FP32 tile: (x, mask, tile-local rows and columns, origin, (pr, pc))."""
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    mask = ((r0 + lr) < R)[:, None] & ((c0 + lc) < C)[None, :]
    x = load_f32(x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc + tile_offsets(lr, lc, sxr, sxc),
                 mask, DTYPE)
    return x, mask, lr, lc, r0, c0, pr, pc


@triton.jit
def nan_max(a, b):
    """Elementwise max that propagates NaN (``tl.maximum`` drops it on the GPU)."""
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def amax_nan(x, axis: tl.constexpr):
    """max|x| over ``axis`` in FP32; the positive quiet NaN where the slice holds a NaN.

    One integer reduction of the magnitude bits ``bits & 0x7FFFFFFF``: non-negative FP32
    numbers order like their bits, and every NaN's bits lie above +inf's, so the max is the
    amax, or a NaN (made the canonical quiet NaN). Half the cross-thread work of a float max
    plus a separate NaN flag."""
    m = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=axis)
    return tl.where(m > 0x7F800000, 0x7FC00000, m).to(tl.float32, bitcast=True)


@triton.jit
def amax_bits(a):
    """int32 bits of a non-negative amax (or NaN), ordered like the values: NaN canonicalized to
    0x7FC00000, which sorts above +inf, so an integer atomic max propagates NaN."""
    return tl.where(a != a, 0x7FC00000, a.to(tl.int32, bitcast=True))


@triton.jit
def amax_kernel(x_ptr, out_ptr, R, C, sxr, sxc: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr):
    """Global max|x| of a strided 2D tensor: one tile per program, an int32 atomic max of the
    amax bits into ``out_ptr`` (zeroed by the caller)."""
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    mask = ((r0 + lr) < R)[:, None] & ((c0 + lc) < C)[None, :]
    base = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    x = load_f32(base + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE)
    a = amax_nan(amax_nan(x, 1), 0)
    tl.atomic_max(out_ptr, amax_bits(a))


def global_amax(x2: torch.Tensor, *, block: tuple[int, int] = (64, 128)) -> torch.Tensor:
    """max|x2| (FP32 0-d, NaN-propagating) of a non-empty 2D tensor with one launch."""
    rows, cols = x2.shape
    check_int32_tiles(*x2.stride())
    out = torch.zeros((), dtype=torch.int32, device=x2.device)
    br, bc = block
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    amax_kernel[grid](kernel_input(x2), out, rows, cols, x2.stride(0), x2.stride(1),
                      DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc, num_warps=8)
    return out.view(torch.float32)


@triton.jit
def swizzled_tile(pid, T, N, BN: tl.constexpr, GROUP: tl.constexpr):
    """(row tile t of a T-entry tile table, column tile j) of program ``pid`` in a grid of
    T x cdiv(N, BN) programs, swizzled: GROUP consecutive row tiles sweep the column tiles
    together, so a wave's operands stay in L2 (the grouped GEMMs)."""
    per_group = GROUP * tl.cdiv(N, BN)
    first = (pid // per_group) * GROUP
    size = tl.minimum(T - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def expert_row_tile(meta_ptr, t, E, EP: tl.constexpr):
    """(expert e, its row tile index) of row tile ``t`` of a grouped GEMM whose per-expert tile
    counts are given as the prefix sums ``meta_ptr[0 .. E]`` (non-decreasing, ``meta_ptr[E]`` the
    total T > t; ``EP`` a power of two > E). One vector load and a count instead of a per-tile
    table: e is the last expert whose first tile is at or before t (experts without tiles share
    their neighbour's prefix and are skipped), so the host builds E + 1 numbers, not T rows."""
    i = tl.arange(0, EP)
    firsts = tl.load(meta_ptr + i, mask=i <= E, other=t + 1)
    e = tl.sum((firsts <= t).to(tl.int32), 0) - 1
    return e, t - tl.load(meta_ptr + e)
