"""hybridfp: low-precision training in PyTorch with hybrid (per-direction) quantization."""

from . import factories, gemm, moe, nn
from .config import Policy, current_policy, policy, use_policy
from .integration import checkpoint, get_cpu_offload_context, mark_not_offload
from .integration.export import export_state_dict
from .integration.safetensors_io import load_safetensors, save_safetensors
from .integration.master_weights import MasterWeightOptimizer, memory_per_parameter, quantize_master_weights
from .integration.fsdp import QuantizedGatherWeight, enable_quantized_all_gather
from .integration.fsdp_amax import precompute_weight_amax
from .integration.fsdp_primary import QuantizedPrimaryWeight, full_quantized_weight, quantize_sharded_weights
from .integration.tensor_parallel_primary import quantize_tensor_parallel_weights
from .integration.tensor_parallel import ColwiseParallel, LayerNormMLPParallel, RowwiseParallel
from .moe import ExpertDispatch, ExpertParallel, GroupedLinear, expert_combine, expert_dispatch
from .nn.quantized_init import quantized_model_init
from .nn.weight_cache import weight_caching
from .nn import LayerNormLinear, LayerNormMLP, Linear, SwiGLU, set_names, swiglu
from .integration.transformers_convert import HighPrecisionWeightsWarning, convert, unconverted_weights
from .quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                         HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
                         Quantizer)
from .recipes import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                      MXFP8BlockScaling, NVFP4BlockScaling, QuantizerRole, Recipe, autocast)
from .tensors import MissingDirectionError, QuantizedTensor
# the function; its package stays importable as hybridfp.analyze.<module> (sys.modules)
from .analyze import analyze  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CustomRecipe", "DelayedScaling", "Float8BlockQuantizer", "Float8BlockScaling",
    "Float8CurrentScaling", "Float8CurrentScalingQuantizer", "Float8Quantizer", "GroupedLinear",
    "HybridQuantizer", "IdentityQuantizer", "LayerNormLinear", "LayerNormMLP", "Linear",
    "MXFP8BlockScaling", "MXFP8Quantizer", "MissingDirectionError", "NVFP4BlockScaling", "NVFP4Quantizer", "Policy",
    "QuantizedTensor", "Quantizer", "QuantizerRole", "Recipe", "SwiGLU", "autocast", "checkpoint",
    "get_cpu_offload_context", "mark_not_offload",
    "convert", "current_policy", "factories",
    "gemm", "moe", "nn", "policy", "quantized_model_init",
    "MasterWeightOptimizer", "QuantizedGatherWeight", "enable_quantized_all_gather", "precompute_weight_amax", "QuantizedPrimaryWeight", "full_quantized_weight", "quantize_sharded_weights", "quantize_tensor_parallel_weights", "export_state_dict", "load_safetensors", "save_safetensors", "memory_per_parameter", "quantize_master_weights", "set_names", "swiglu", "use_policy",
    "ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel",
    "weight_caching", "ExpertDispatch", "ExpertParallel", "expert_combine", "expert_dispatch",
    "HighPrecisionWeightsWarning", "unconverted_weights",
    "analyze",
]
