"""GEMM dispatch: layout -> operand copies -> backend (fast kernel or exact emulation)."""

from .backends import (BACKENDS, EMULATED, Backend, EmulatedGemmWarning, describe_key, emulate,
                       reads_bf16_decodes, register_backend, report_emulated, select)
from .gemm import GEMM_OF_LAYOUT, LAYOUTS, gemm, operand_storage
# Registration order matters (later registrations take precedence): the cuBLAS FP8 backends
# come after the BF16 tensor-core one, so they keep the pairs FP8 tensor cores serve.
from . import bf16_tensorcore  # noqa: E402,F401  registers the exact BF16 tensor-core backend
from . import fast  # noqa: E402,F401  registers the cuBLAS FP8 backends

__all__ = ["BACKENDS", "EMULATED", "Backend", "EmulatedGemmWarning", "GEMM_OF_LAYOUT", "LAYOUTS",
           "describe_key", "emulate", "gemm", "operand_storage", "reads_bf16_decodes", "register_backend",
           "report_emulated", "select"]
