"""Quantized copies held as their exact BF16 block decode (no codes, no block scales).

On Hopper every MXFP8 GEMM runs on BF16 tensor cores: each copy is block-decoded into BF16
(exact: E4M3 / E5M2 x E8M0 has at most 4 significant bits) and cuBLAS multiplies the decodes
(``gemm/bf16_tensorcore.py``). A copy that is only ever read by such GEMMs — a gradient's two
copies, a weight's copies quantized for one step — can be written decoded by the quantize
kernel itself: one pass instead of a quantize writing codes and a decode reading them back
(1 + 3 bytes an element of traffic and a launch, for 1 more byte written).

A decoded storage holds, per direction, ``data``: the values ``source.gemm_operand(direction)
.values`` rounded to BF16 (a no-op rounding: ``bf16_exact_reason`` is None for the sources
allowed here) in the stored orientation (columnwise copies transposed, as the source's), plus
the source's payload entries that define its epilogue factor (NVFP4's global ``amax``, per
tensor or per row: S_dec stays out of the values, as in the source's GEMM operand). It keeps
the source's options and format key, so GEMM backends, reports and error messages treat it as
the source format (``DECODED_CLASSES``; an NVFP4 copy with RHT is not eligible: its values live
in the transformed domain with a padded length). Values, dequantization and every GEMM result
are bitwise those of the source storage on the BF16 path (the GEMMs decode the same BF16 values
there); against the exact FP32 emulation, MXFP8 blocks with an E8M0 scale below 2**-124 holding
FP8 subnormals differ by less than 2**-133 an element (``MXFP8Storage.bf16_exact_reason``).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from ..formats import mxfp8, nvfp4
from .mxfp8 import MXFP8Storage
from .nvfp4 import NVFP4Storage, check_row_scaled
from .storage import COLUMNWISE, ROWWISE, GemmOperand, QuantizedStorage
from .validation import InvalidStateError


class DecodedStorage(QuantizedStorage):
    """Base of the decoded storages: BF16 ``data`` per direction, the source format's key."""

    #: the storage class whose copies these are the decodes of
    source: ClassVar[type[QuantizedStorage]]
    #: source payload entries kept as they are (those its epilogue factor is computed from)
    kept: ClassVar[tuple[str, ...]] = ()
    #: rows per block of the source's columnwise copy
    source_block: ClassVar[int] = 1
    _row_index = {ROWWISE: {"data": (0, 1)}, COLUMNWISE: {"data": (1, 1)}}

    @classmethod
    def key_for(cls, direction: str, meta: dict[str, object]) -> tuple:
        """The source format's key: every backend and report sees the source format."""
        return cls.source.key_for(direction, meta)

    def describe(self) -> str:
        """As the source format's, marked as held decoded."""
        role = f" (role: {self.label})" if self.label else ""
        return f"{self.format_name} tensor (held as its BF16 decode) of shape {tuple(self.shape)}{role}"

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        r, c = (rows, cols) if direction == ROWWISE else (cols, rows)
        return {"data": ((r, c), torch.bfloat16)}

    def decoded_directions(self) -> frozenset:
        """Every held direction."""
        return frozenset(self.directions())

    def column_group_block(self) -> int:
        """The source format's columnwise block (the decoded data is indexed by single rows, but
        zero-padded groups were padded to the source's blocks)."""
        return self.source_block

    def with_decoded(self, directions: frozenset) -> "DecodedStorage":
        """Itself: every copy is decoded already."""
        return self

    def bf16_exact_reason(self, direction: str) -> Optional[str]:
        """None: the values are BF16 already."""
        self.payload(direction)
        return None

    def gemm_operand(self, direction: str) -> GemmOperand:
        """The held values in FP32 (exact), stored orientation, the source's epilogue factor."""
        data = self.payload(direction)["data"]
        return GemmOperand(data.float(), self.epilogue_scale(direction), data.shape[1])

    @staticmethod
    def eligible(storage: QuantizedStorage, direction: str) -> Optional[str]:
        """None if ``storage``'s ``direction`` copy can be held decoded, else why not."""
        cls = DECODED_CLASSES.get(type(storage))
        if cls is None:
            return f"only {sorted(c.__name__ for c in DECODED_CLASSES)} copies can be held decoded in BF16"
        return cls._ineligible(storage, direction)

    @classmethod
    def _ineligible(cls, storage: QuantizedStorage, direction: str) -> Optional[str]:
        return None

    @staticmethod
    def of(storage: QuantizedStorage) -> "DecodedStorage":
        """The decoded storage of ``storage``'s held copies, by the reference decode
        (``gemm_operand``, PyTorch ops). Quantize kernels write decoded copies directly; this
        serves the paths without one (CPU, empty inputs)."""
        for d in storage.directions():
            why = DecodedStorage.eligible(storage, d)
            if why is not None:
                raise TypeError(f"{storage.describe()}: its {d} copy cannot be held decoded ({why}).")
        cls = DECODED_CLASSES[type(storage)]
        payloads = {d: ({"data": storage.gemm_operand(d).values.to(torch.bfloat16),
                         **{n: t for n, t in storage.payload(d).items() if n in cls.kept}}
                        if storage.has(d) else None) for d in (ROWWISE, COLUMNWISE)}
        out = cls(storage.shape, storage.dtype, payloads[ROWWISE], payloads[COLUMNWISE], label=storage.label,
                  **storage.meta)
        return out


class DecodedMXFP8Storage(DecodedStorage):
    """MXFP8 copies (1x32 / 32x1 blocks) held as their BF16 decode."""

    source = MXFP8Storage
    source_block = mxfp8.BLOCK
    format_name = MXFP8Storage.format_name
    precision_rank = MXFP8Storage.precision_rank
    _meta_defaults = MXFP8Storage._meta_defaults
    _meta_choices = MXFP8Storage._meta_choices


class DecodedNVFP4Storage(DecodedStorage):
    """NVFP4 copies (1x16 / 16x16 blocks, no RHT) held as their BF16 block decode ``e2m1 *
    fp32(S_dec_b)``, with the global ``amax`` (per tensor, or per row when row-scaled) their
    epilogue factor S_dec comes from, as ``NVFP4Storage``'s."""

    source = NVFP4Storage
    source_block = nvfp4.BLOCK
    format_name = NVFP4Storage.format_name
    precision_rank = NVFP4Storage.precision_rank
    _meta_defaults = NVFP4Storage._meta_defaults
    kept = ("amax",)

    @property
    def _row_index(self):  # type: ignore[override]
        return {ROWWISE: {"data": (0, 1), "amax": (0, 1) if self.meta["row_scaled"] else None},
                COLUMNWISE: {"data": (1, 1), "amax": None}}

    @classmethod
    def _payload_layout(cls, direction: str, rows: int, cols: int, meta: dict[str, object]):
        out = super()._payload_layout(direction, rows, cols, meta)
        out["amax"] = ((rows,) if direction == ROWWISE and meta["row_scaled"] else (), torch.float32)
        return out

    @classmethod
    def _shared_names(cls, meta: dict[str, object]) -> frozenset[str]:
        return NVFP4Storage._shared_names(meta)

    def _check_options(self) -> None:
        """NVFP4's combinations, and no RHT copy (its values live in the transformed domain)."""
        check_row_scaled(self)
        if self.has(COLUMNWISE) and self.meta["rht"]:
            raise InvalidStateError(f"{self.describe()}: a columnwise copy with rht=True cannot be "
                                    "held decoded (its values live in the transformed domain).")

    @classmethod
    def _ineligible(cls, storage: QuantizedStorage, direction: str) -> Optional[str]:
        if direction == COLUMNWISE and storage.meta["rht"]:
            return "an RHT copy's values live in the transformed domain"
        return None

    def has_epilogue_scale(self, direction: str) -> bool:
        """Yes: the global (or per-row) S_dec."""
        return True

    def epilogue_scale(self, direction: str) -> Optional[torch.Tensor]:
        """S_dec from the global amax (per tensor, or per row when row-scaled)."""
        return nvfp4.shared_global_decode_scale(self.payload(direction)["amax"])


#: source storage class -> the class holding its copies decoded. A format opts in here when
#: its copies decode exactly into BF16 and a kernel writes them.
DECODED_CLASSES: dict[type[QuantizedStorage], type[DecodedStorage]] = {
    MXFP8Storage: DecodedMXFP8Storage, NVFP4Storage: DecodedNVFP4Storage}
