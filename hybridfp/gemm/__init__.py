"""GEMM dispatch: layout -> operand copies -> backend (fast kernel or exact emulation)."""

from .backends import (BACKENDS, EMULATED, Backend, EmulatedGemmWarning, describe_key, emulate,
                       register_backend, report_emulated, select)
from .gemm import GEMM_OF_LAYOUT, LAYOUTS, gemm, operand_storage
from . import fast  # noqa: E402,F401  registers the cuBLAS FP8 backends

__all__ = ["BACKENDS", "EMULATED", "Backend", "EmulatedGemmWarning", "GEMM_OF_LAYOUT", "LAYOUTS",
           "describe_key", "emulate", "gemm", "operand_storage", "register_backend",
           "report_emulated", "select"]
