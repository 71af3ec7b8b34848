"""What numerics §5 says each factory returns, spelled out as (class name, settings) trees.

``describe(q)`` turns a quantizer into ``(class name, settings())`` with hybrid children
described recursively, so two quantizers compare equal exactly when their classes and every
number-determining option agree. The expectations below are written as literal settings
dicts (not by calling the constructors under test), so a changed default is caught here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import hybridfp as hf
from hybridfp import Quantizer, QuantizerRole
from hybridfp.recipes.roles import TENSOR_TYPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RD = "rowwise_dequantized"
GRADS = ("grad_output", "grad_input")
MODULE_TYPES = ("linear", "grouped_linear")
#: Every role a factory can be asked about: both module types x every tensor type, and None.
ROLES: list[Optional[QuantizerRole]] = [None] + [
    QuantizerRole(m, t, "blocks.0.mlp") for m in MODULE_TYPES for t in TENSOR_TYPES]


def role_id(role: Optional[QuantizerRole]) -> str:
    return "None" if role is None else f"{role.module_type}.{role.tensor_type}"


def describe(q: Quantizer) -> tuple[str, dict[str, Any]]:
    """(class name, settings) with quantizer-valued settings (hybrid children) described."""
    return (type(q).__name__,
            {k: describe(v) if isinstance(v, Quantizer) else v for k, v in q.settings().items()})


# ------------------------------------------------------------------ numerics §2 / §5 building blocks
def identity() -> tuple:
    return ("IdentityQuantizer", {"dtype": None})


def fp8_delayed(dtype: torch.dtype) -> tuple:
    return ("Float8Quantizer", {"fp8_dtype": dtype, "amax_history_len": 1024,
                                "amax_compute_algo": "max", "margin": 0})


def fp8_current(dtype: torch.dtype) -> tuple:
    return ("Float8CurrentScalingQuantizer", {"fp8_dtype": dtype, "force_pow_2_scales": False,
                                              "amax_epsilon": 0.0})


def fp8_block(dim: int) -> tuple:
    return ("Float8BlockQuantizer", {"fp8_dtype": E4M3, "block_scaling_dim": dim,
                                     "force_pow_2_scales": True, "amax_epsilon": 0.0})


def mxfp8() -> tuple:
    return ("MXFP8Quantizer", {"fp8_dtype": E4M3, "scale_rule": "rceil", "with_2d_quantization": False})


def nvfp4(rht: bool = False, two_d: bool = False, sr: bool = False, row_scaled: bool = False) -> tuple:
    return ("NVFP4Quantizer", {"with_rht": rht, "with_post_rht_amax": True,
                               "with_2d_quantization": two_d, "stochastic_rounding": sr,
                               "row_scaled_nvfp4": row_scaled})


def hybrid(row: tuple, col: tuple, src: str = "original") -> tuple:
    return ("HybridQuantizer", {"rowwise": row, "columnwise": col, "columnwise_source": src})


NV_INPUT = nvfp4(rht=True)            # NVFP4 recipe, input and "else": RHT on the columnwise copy
NV_WEIGHT = nvfp4(two_d=True)         # NVFP4 recipe, weight: 16x16 blocks
NV_GRAD = nvfp4(rht=True, sr=True)    # NVFP4 recipe, gradients: RHT + stochastic rounding
NV_1D = nvfp4()                       # plain 1D NVFP4
NV_ROW = nvfp4(row_scaled=True)       # row-scaled NVFP4 (forward activations)


def _t(role: Optional[QuantizerRole]) -> Optional[str]:
    return None if role is None else role.tensor_type


def base_expected(name: str, role: Optional[QuantizerRole]) -> tuple:
    """numerics §5 base factories. "Gradients" are grad_output and grad_input (numerics §2.1 HYBRID:
    E5M2 for gradients, as the built-in recipes do)."""
    t = _t(role)
    grad = t in GRADS
    if name == "high_precision":
        return identity()
    if name == "bf16":
        return ("IdentityQuantizer", {"dtype": torch.bfloat16})
    if name == "delayed_scaling":
        return fp8_delayed(E5M2 if grad else E4M3)
    if name == "current_scaling":
        return fp8_current(E5M2 if grad else E4M3)
    if name == "float8_block_scaling":
        return fp8_block(2 if t == "weight" else 1)
    if name == "mxfp8":
        return mxfp8()
    if name == "nvfp4":
        return NV_WEIGHT if t == "weight" else NV_GRAD if grad else NV_INPUT  # every backward slot: RHT + SR
    raise KeyError(name)


def zoo_expected(name: str, role: Optional[QuantizerRole]) -> tuple:
    """numerics §5 zoo, entry by entry."""
    t = _t(role)
    grouped = role is not None and role.module_type == "grouped_linear"
    if name == "high_precision_fwd_mxfp8_bwd":
        return mxfp8() if t == "grad_output" else hybrid(identity(), mxfp8())
    if name == "mxfp8_fwd_nvfp4_bwd":
        return {"input": hybrid(mxfp8(), NV_INPUT), "weight": hybrid(mxfp8(), NV_1D, RD),
                "grad_output": NV_GRAD}.get(t, mxfp8())
    if name == "nvfp4_1d_weight":
        return hybrid(NV_1D, NV_1D, RD) if t == "weight" else base_expected("nvfp4", role)
    if name == "mxfp8_fwd_high_precision_bwd":
        # numerics §5 lists input, weight and grad_output only; other roles get the forward format.
        return {"input": hybrid(mxfp8(), identity(), RD), "weight": hybrid(mxfp8(), identity(), RD),
                "grad_output": identity()}.get(t, mxfp8())
    if name == "nvfp4_row_scaled_fwd_mxfp8_bwd":
        if grouped and t == "input":
            return hybrid(NV_ROW, mxfp8(), RD)
        if grouped and t == "weight":
            return hybrid(NV_1D, mxfp8(), RD)
        return mxfp8()
    if name == "nvfp4_row_scaled_fwd_high_precision_bwd":
        return {"input": hybrid(NV_ROW, identity(), RD), "weight": hybrid(NV_1D, identity(), RD)
                }.get(t, identity())
    raise KeyError(name)


#: Built-in recipe equal to each base factory (high_precision has none).
BUILTIN = {
    "delayed_scaling": hf.DelayedScaling, "current_scaling": hf.Float8CurrentScaling,
    "float8_block_scaling": hf.Float8BlockScaling, "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
}
