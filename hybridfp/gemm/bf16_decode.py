"""Block-decoded GEMM operands in BF16, for GEMMs that run on BF16 tensor cores exactly.

Hopper has no MXFP8/NVFP4 tensor-core path, but an element times its block scale is exact
in BF16 for these formats (E4M3/E5M2 x E8M0: at most 4 significant bits; E2M1 x E4M3: at
most 6; BF16 keeps 8), so a GEMM of block-decoded BF16 operands with FP32 accumulation
computes SPEC §1's exact product. Per-tensor / per-row factors (FP8 ``scale_inv``, NVFP4
``S_dec``) stay out of the values and go to the epilogue, as in :class:`GemmOperand`.

``bf16_exact_reason(storage, direction)`` says why a copy cannot be decoded exactly in BF16
(None when it can); ``decode_bf16(storage, direction)`` returns the operand.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..tensors.storage import GemmOperand, QuantizedStorage


def bf16_exact_reason(storage: QuantizedStorage, direction: str) -> Optional[str]:
    """None if ``storage``'s ``direction`` copy block-decodes exactly into BF16, else why not."""
    return storage.part(direction).bf16_exact_reason(direction)


def decode_bf16(storage: QuantizedStorage, direction: str) -> GemmOperand:
    """The ``direction`` copy as a GEMM reads it, block-decoded into BF16 (exact; see module doc).

    Reference implementation: the FP32 block decode of :meth:`QuantizedStorage.gemm_operand`,
    rounded to BF16 — a no-op rounding whenever ``bf16_exact_reason`` is None.
    """
    reason = bf16_exact_reason(storage, direction)
    if reason is not None:
        raise ValueError(f"{storage.describe()}: the {direction} copy cannot be decoded exactly in "
                         f"BF16 ({reason}); use the exact FP32 emulation (hybridfp.gemm.emulate).")
    op = storage.gemm_operand(direction)
    return GemmOperand(op.values.to(torch.bfloat16), op.scale, op.k, op.rht)
