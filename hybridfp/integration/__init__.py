"""Integration with the rest of the training stack: activation recompute (a thin alias of
torch.utils.checkpoint) and CPU offload of saved activations."""

from .offload import CpuOffloadContext, OffloadStats, get_cpu_offload_context, mark_not_offload
from .recompute import checkpoint

__all__ = ["CpuOffloadContext", "OffloadStats", "checkpoint", "get_cpu_offload_context", "mark_not_offload"]
