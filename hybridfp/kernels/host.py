"""Host-side helpers for launching device work: small metadata tensors without a stream sync.

``torch.tensor(values, device="cuda")`` (and ``cpu_tensor.to("cuda")``) copies from pageable
host memory, which PyTorch finishes with a stream synchronize: the host waits until the GPU has
drained its queue, and the GPU then idles while the host prepares the next launches. An MoE
step built ~20 such offset / split tensors and lost about 8 % of its GPU time to the bubbles
(H200, 8 experts, ``bench_moe``'s profile: 23 ``cudaStreamSynchronize`` per step). Copies
from pinned memory can be queued (``non_blocking``); PyTorch's host allocator keeps the
pinned block alive until the copy has run, so the temporary is safe to drop.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

Values = Union[Sequence[int], Sequence[float], Sequence[Sequence[int]]]


def device_tensor(values: Values, device: Union[torch.device, str], dtype: torch.dtype = torch.int64
                  ) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host-device sync: on CUDA
    through pinned memory and a queued copy; elsewhere a plain copy."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_scalar(value: float, device: Union[torch.device, str], dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """A 0-d tensor holding ``value`` (rounded once to ``dtype``) on ``device``, written by a
    fill kernel rather than copied from the host (no sync)."""
    return torch.full((), value, dtype=dtype, device=device)
