"""``hybridfp.factories``: the built-in and zoo quantizer factories (see recipes/factories.py)."""

from .recipes.factories import (BASE, FORMAT_NAMES, ZOO, bf16, current_scaling, delayed_scaling,
                                float8_block_scaling, high_precision, high_precision_fwd_mxfp8_bwd,
                                mxfp8, mxfp8_fwd_high_precision_bwd, mxfp8_fwd_nvfp4_bwd, nvfp4,
                                nvfp4_1d_weight, nvfp4_row_scaled_fwd_high_precision_bwd,
                                nvfp4_row_scaled_fwd_mxfp8_bwd, per_gemm)

__all__ = ["BASE", "FORMAT_NAMES", "ZOO", *BASE, *ZOO, "per_gemm"]
