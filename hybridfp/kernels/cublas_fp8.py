"""cuBLAS FP8 GEMMs through ``torch._scaled_mm``: pure functions on raw tensors.

Every operand copy is stored ``[rows, k]`` row-major with the reduction along the last dim,
so every GEMM is ``out[m, n] = (a[m, k] · sa) (b[n, k] · sb)ᵀ`` — cuBLAS's TN layout, the
only one Hopper's FP8 tensor cores take. ``b.t()`` is handed over as a column-major [k, n]
view (no copy). Scales are dequantization factors (the storages' ``scale_inv``).

Scale layouts torch 2.11 accepts (its ``_scaled_mm`` checks, verified on the H200):

| operand            | scale passed                | shape                 | strides          |
|--------------------|-----------------------------|-----------------------|------------------|
| per-tensor a / b   | scale_inv                   | 0-d                   | -                |
| 1x128 a            | column-major copy of s[m,kb]| [m, kb]               | (1, m)           |
| 128x128 a          | s[mb, kb] as stored         | [mb, kb]              | (kb, 1)          |
| 1x128 b            | sᵀ made contiguous          | [kb, n]               | (n, 1)           |
| 128x128 b          | sᵀ (a view)                 | [kb, nb]              | (1, kb)          |

(kb = ceil(k/128); mb, nb likewise.) Limits: k and n multiples of 16; not E5M2 x E5M2;
block scaling only on sm90 and not 128x128 x 128x128; a bias only with a 16-bit output of
the bias's own dtype (otherwise it is added here in FP32 before the cast, which is what the
exact emulation does).
"""

from __future__ import annotations

from typing import Optional

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
BLOCK = 128
#: Output dtypes cuBLAS writes directly; anything else is computed in FP32 and cast.
MM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Block-dim pairs (a, b) cuBLAS serves: 1 = 1x128 blocks, 2 = 128x128 tiles.
BLOCK_PAIRS = ((1, 1), (1, 2), (2, 1))


def dtype_pair_supported(a_dtype: torch.dtype, b_dtype: torch.dtype) -> bool:
    """E4M3/E5M2 in any combination except E5M2 x E5M2 (cuBLAS rejects that one)."""
    return a_dtype in FP8_DTYPES and b_dtype in FP8_DTYPES and not (a_dtype == b_dtype == E5M2)


def tensorwise_shape_supported(m: int, n: int, k: int) -> bool:
    """torch's alignment rule for FP8 GEMMs: k and n multiples of 16 (m is free)."""
    return k % 16 == 0 and n % 16 == 0 and m > 0 and n > 0 and k > 0


def block_shape_supported(m: int, n: int, k: int, a_block_dim: int, b_block_dim: int) -> bool:
    """Shapes the block-scaled cuBLAS path is used for.

    k must be a multiple of 128 (whole scaling blocks along the reduction); n a multiple of
    16. The scale tensors' leading dimensions must be 16-byte aligned for cuBLAS (TE pads
    them to 4 floats; torch's stride checks leave no room to pad): the leading dim of a
    1x128 A's scales is m, of a 1x128 B's scales n, of a 128x128 operand's ceil(k/128).
    On the H200 (torch 2.11): m % 4 != 0 is refused (CUBLAS_STATUS_NOT_SUPPORTED), and
    k/128 % 4 != 0 with a 128x128 operand gives WRONG results without an error.
    """
    if (a_block_dim, b_block_dim) not in BLOCK_PAIRS or m <= 0 or n <= 0:
        return False
    if k <= 0 or k % BLOCK or n % 16:
        return False
    if a_block_dim == 1 and m % 4:
        return False
    if 2 in (a_block_dim, b_block_dim) and (k // BLOCK) % 4:
        return False
    return True


def _ready(t: torch.Tensor) -> torch.Tensor:
    """Row-major operand data with a 16-byte aligned pointer and row stride (a copy only when
    not). A row stride above the width is taken as it is: on the H200 (torch 2.11)
    ``_scaled_mm`` reads such column slices of a wider buffer (an MoE expert's columnwise copy
    in the joined [C, Σ m] matrix) as fast as contiguous operands, bitwise equal."""
    rows, cols = t.shape
    row_major = (cols <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) >= cols)
    if not row_major or (rows > 1 and t.stride(0) * t.element_size() % 16):
        t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype, bias: Optional[torch.Tensor], use_fast_accum: bool,
               fuse_bias: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``_scaled_mm(a, bᵀ)`` with the emulation's epilogue order: scale, + bias (FP32), cast.

    cuBLAS's bias epilogue computes ``cast(alpha · acc + bias)`` in FP32, the same as the
    emulation up to FP32 rounding of the scale product; it takes only a bias of the output's
    16-bit dtype. Any other bias (FP32 bias, FP32 output, or ``fuse_bias=False``) is added
    here to an FP32 result before the cast, exactly as the emulation does. ``out`` (an
    [m, n] ``out_dtype`` tensor): cuBLAS writes there when no FP32 intermediate is needed
    (else the result is returned, not copied: the caller copies).
    """
    fuse = (bias is not None and fuse_bias and out_dtype in (torch.bfloat16, torch.float16)
            and bias.dtype == out_dtype)
    mm_dtype = out_dtype if out_dtype in MM_OUT_DTYPES and (bias is None or fuse) else torch.float32
    direct = (out is not None and out.dtype == mm_dtype == out_dtype and out.is_contiguous()
              and out.data_ptr() % 16 == 0)  # cuBLAS wants 16-byte aligned outputs
    kw = {"out": out} if direct else {}
    res = torch._scaled_mm(_ready(a), _ready(b).t(), scale_a=scale_a, scale_b=scale_b,
                           bias=bias if fuse else None, out_dtype=mm_dtype,
                           use_fast_accum=use_fast_accum, **kw)
    if bias is not None and not fuse:
        res = res + bias.float()
    return res if res.dtype == out_dtype else res.to(out_dtype)


def gemm_tensorwise(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                    *, out_dtype: torch.dtype = torch.bfloat16, bias: Optional[torch.Tensor] = None,
                    use_fast_accum: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[m, n] = (a · sa)(b · sb)ᵀ`` for per-tensor FP8 ``a`` [m, k], ``b`` [n, k].

    ``use_fast_accum``: let the tensor cores keep partial sums in their reduced-precision
    accumulator over the whole k loop (TE does so for fprop only); off, cuBLAS promotes them
    into FP32 at a fixed k interval.
    """
    return _scaled_mm(a, b, _scalar(a_scale_inv), _scalar(b_scale_inv), out_dtype, bias, use_fast_accum,
                      fuse_bias=True, out=out)


def _scalar(scale_inv: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale as the 0-d FP32 tensor ``_scaled_mm`` takes; one already so is passed
    as is (no view op: an MoE layer's per-expert GEMMs read 64 experts' scales a call)."""
    s = scale_inv.float()
    return s if s.dim() == 0 else s.reshape(())


def pad_fp8(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 ``t`` [r, c] zero-padded to [rows, cols] (code 0 is +0 in E4M3 and E5M2: padding the
    reduction with zeros leaves every dot product exact, padding rows adds discarded outputs)."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=torch.uint8, device=t.device)
    out[:r, :c] = t.view(torch.uint8)
    return out.view(t.dtype)


def block_scale_a(scale_inv: torch.Tensor, block_dim: int) -> torch.Tensor:
    """The A-side block scales in the layout cuBLAS reads (table above)."""
    if block_dim == 1:
        return scale_inv.t().contiguous().t()  # [m, kb], stride (1, m)
    return scale_inv.contiguous()  # [mb, kb] row-major


def block_scale_b(scale_inv: torch.Tensor, block_dim: int) -> torch.Tensor:
    """The B-side block scales in the layout cuBLAS reads (table above)."""
    if block_dim == 1:
        return scale_inv.t().contiguous()  # [kb, n] row-major
    return scale_inv.contiguous().t()  # [kb, nb], stride (1, kb)


def gemm_blockwise(a: torch.Tensor, a_scale_inv: torch.Tensor, a_block_dim: int,
                   b: torch.Tensor, b_scale_inv: torch.Tensor, b_block_dim: int, *,
                   out_dtype: torch.dtype = torch.bfloat16,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[m, n] = Σ_k a[m, k] sa[m, k/128] b[n, k] sb[n, k/128]`` (DeepSeek-V3 style).

    ``a_scale_inv`` / ``b_scale_inv`` as the storages hold them: [rows, kb] for 1x128
    blocks, [ceil(rows/128), kb] for 128x128 tiles. cuBLAS applies each k block's scales
    when it promotes that block's partial sums into FP32, so there is no fast-accumulation
    mode (TE uses none for block scaling either). The bias goes through the FP32 epilogue
    here; cuBLAS's own bias epilogue gives correct results with block scales for a BF16 bias at
    1x128 x 128x128, but no GPU test covers every pair, so it is not used.
    """
    if (a_block_dim, b_block_dim) not in BLOCK_PAIRS:
        raise ValueError(f"cuBLAS block-scaled FP8 takes 1x128 x 1x128, 1x128 x 128x128 or "
                         f"128x128 x 1x128 operands; got block dims ({a_block_dim}, {b_block_dim}).")
    return _scaled_mm(a, b, block_scale_a(scale_inv=a_scale_inv, block_dim=a_block_dim),
                      block_scale_b(scale_inv=b_scale_inv, block_dim=b_block_dim),
                      out_dtype, bias, use_fast_accum=False, fuse_bias=False)
