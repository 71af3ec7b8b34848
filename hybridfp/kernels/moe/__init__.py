"""Triton kernels only the MoE wing (:mod:`hybridfp.moe`) launches: grouped GEMMs (BF16 and FP8,
pointer and TMA forms), the experts' FP8 current-scaling quantize, and the zero-padded row
groups of a grouped columnwise copy."""
