"""Quantized copies held as their exact BF16 block decode (no codes, no block scales).

On Hopper every MXFP8 GEMM runs on BF16 tensor cores: each copy is block-decoded into BF16
(exact: E4M3 / E5M2 x E8M0 has at most 4 significant bits) and cuBLAS multiplies the decodes
(``gemm/bf16_tensorcore.py``). A copy that is only ever read by such GEMMs — a gradient's two
copies, a weight's copies quantized for one step — can be written decoded by the quantize
kernel itself: one pass instead of a quantize writing codes and a decode reading them back
(1 + 3 bytes an element of traffic and a launch, for 1 more byte written).

A decoded storage holds, per direction, ``data``: the values ``source.gemm_operand(direction)
.values`` rounded to BF16 (a no-op rounding: ``bf16_exact_reason`` is None for the sources
allowed here) in the stored orientation (columnwise copies transposed, as the source's). It
keeps the source's class name, options and format key, so GEMM backends, reports and error
messages treat it as the source format; only formats whose copies carry no per-tensor /
per-row epilogue factor are eligible (``DECODED_CLASSES``). Values, dequantization and every
GEMM result are bitwise those of the source storage.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from .mxfp8 import MXFP8Storage
from .storage import COLUMNWISE, ROWWISE, GemmOperand, QuantizedStorage


class DecodedStorage(QuantizedStorage):
    """Base of the decoded storages: BF16 ``data`` per direction, the source format's key."""

    #: the storage class whose copies these are the decodes of
    source: ClassVar[type[QuantizedStorage]]
    _row_index = {ROWWISE: {"data": (0, 1)}, COLUMNWISE: {"data": (1, 1)}}

    def describe(self) -> str:
        """As the source format's, marked as held decoded."""
        role = f" (role: {self.label})" if self.label else ""
        return f"{self.format_name} tensor (held as its BF16 decode) of shape {tuple(self.shape)}{role}"

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        r, c = (rows, cols) if direction == ROWWISE else (cols, rows)
        return {"data": ((r, c), torch.bfloat16)}

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """None: the values are BF16 already."""
        self.payload(direction)
        return None

    def gemm_operand(self, direction: str) -> GemmOperand:
        """The held values in FP32 (exact), stored orientation, no epilogue factor."""
        data = self.payload(direction)["data"]
        return GemmOperand(data.float(), None, data.shape[1])

    @staticmethod
    def of(storage: QuantizedStorage) -> "DecodedStorage":
        """The decoded storage of ``storage``'s held copies, by the reference decode
        (``gemm_operand``; CPU or any device, PyTorch ops). Kernels write it directly."""
        cls = DECODED_CLASSES.get(type(storage))
        if cls is None:
            raise TypeError(f"{storage.describe()}: only {sorted(c.__name__ for c in DECODED_CLASSES)} copies can "
                            "be held decoded in BF16.")
        payloads = {d: ({"data": storage.gemm_operand(d).values.to(torch.bfloat16)} if storage.has(d) else None)
                    for d in (ROWWISE, COLUMNWISE)}
        out = cls(storage.shape, storage.dtype, payloads[ROWWISE], payloads[COLUMNWISE], label=storage.label,
                  **storage.meta)
        out.columnwise_zero_padded = storage.columnwise_zero_padded
        return out


class DecodedMXFP8Storage(DecodedStorage):
    """MXFP8 copies (1x32 / 32x1 blocks) held as their BF16 decode."""

    source = MXFP8Storage
    format_name = MXFP8Storage.format_name
    precision_rank = MXFP8Storage.precision_rank
    _meta_defaults = MXFP8Storage._meta_defaults


#: source storage class -> the class holding its copies decoded. A format opts in here when
#: its copies decode exactly into BF16 with no epilogue factor and a kernel writes them.
DECODED_CLASSES: dict[type[QuantizedStorage], type[DecodedStorage]] = {MXFP8Storage: DecodedMXFP8Storage}
