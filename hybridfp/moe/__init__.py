"""hybridfp's mixture-of-experts wing: the MoE layer and what only it needs.

``GroupedLinear`` (one linear per expert, the experts' rows joined), ``quantize_grouped`` /
``quantize_weights_grouped`` (the experts' row groups quantized with shared encodings where the
formats allow), ``grouped_gemm`` (the experts' GEMMs of one layout in one grouped kernel call
when exact) and ``GroupedTensor`` (the experts' quantized tensors held as joined copies plus
per-expert offsets), and expert parallelism (``ExpertParallel``, ``expert_dispatch`` /
``expert_combine``: the experts spread over a group's ranks, tokens exchanged all-to-all).
Dense code never imports this package; it builds on the dense layers below.
"""

from .grouped_tensor import GroupedTensor, JoinedCopy
from .gemm import grouped_gemm
from .grouped_linear import GroupedLinear
from .expert_parallel import ExpertParallel
from .expert_parallel_comm import ExpertDispatch, expert_combine, expert_dispatch
from .quantize import quantize_grouped
from .quantize_weights import quantize_weights_grouped

__all__ = ["ExpertDispatch", "ExpertParallel", "GroupedTensor", "GroupedLinear", "JoinedCopy",
           "expert_combine", "expert_dispatch", "grouped_gemm", "quantize_grouped",
           "quantize_weights_grouped"]
