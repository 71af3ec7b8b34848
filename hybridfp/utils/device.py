"""Host-side helpers for launching device work: small metadata tensors without a stream sync.

Bottom layer (imports only torch and numpy): formats, kernels, quantizers and gemm all use it.

``torch.tensor(values, device="cuda")`` (and ``cpu_tensor.to("cuda")``) copies from pageable
host memory, which PyTorch finishes with a stream synchronize: the host waits until the GPU has
drained its queue, and the GPU then idles while the host prepares the next launches. An 8-expert
MoE step needs ~20 such offset / split tensors, so as many ``cudaStreamSynchronize`` calls per
step if they were built that way. Copies from pinned memory can be queued
(``non_blocking``); outside CUDA-graph capture PyTorch's pinned-memory cache keeps the block
until the copy has run (it records an event on the copy's stream), so the temporary is safe to
drop. (Under graph capture a captured copy would read the host block at replay time: these
helpers are not meant for captured regions.)
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Callable, Hashable, Sequence, Union

import numpy as np
import torch

Values = Union[Sequence[int], Sequence[float], Sequence[Sequence[int]]]


def device_tensor(values: Values, device: Union[torch.device, str], dtype: torch.dtype = torch.int64
                  ) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host-device sync: on CUDA
    through pinned memory and a queued copy; elsewhere a plain copy."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: Union[torch.device, str]) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without a host-device sync (as :func:`device_tensor`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@lru_cache(maxsize=None)
def _constant(values: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # a normal tensor even when first asked for under torch.inference_mode(): it is shared with
    # later calls outside it, and an inference tensor cannot be saved for backward there
    with torch.inference_mode(False):
        return device_tensor(list(values), device, dtype)


def device_constant(values: Sequence[float], device: Union[torch.device, str], dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """A constant table (e.g. the E2M1 values, the RHT signs) on ``device``, copied once per
    (values, device, dtype) and shared afterwards: callers must not write to it."""
    return _constant(tuple(values), torch.device(device), dtype)


#: Recent ``step_metadata`` tensors (a handful: one MoE step's routing makes a few).
_STEP_METADATA: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
STEP_METADATA_KEPT = 16


def step_metadata(key: Hashable, device: Union[torch.device, str], build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()`` (a small read-only metadata tensor on ``device``: group offsets, row maps)
    remembered by ``key`` for later calls on the same device and stream. An MoE step asks for the
    same ones several times (every layer's input and gradient share the routing's splits; each
    build is a pinned copy and a few launches of host work); callers must not
    write to the result. The key also holds the current CUDA stream (a tensor is never read on
    another stream before its producing work there has run) and whether inference mode is on (an
    inference tensor cannot be saved for backward). Under CUDA-graph capture nothing is
    remembered (a captured tensor is only computed at replay)."""
    device = torch.device(device)
    stream = None
    if device.type == "cuda":
        if device.index is None:  # "cuda" is the current device: its stream handles are its own
            device = torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_current_stream_capturing():
            return build()
        stream = torch.cuda.current_stream(device).cuda_stream
    full = (key, device, stream, torch.is_inference_mode_enabled())
    hit = _STEP_METADATA.get(full)
    if hit is not None:
        return hit
    out = _STEP_METADATA[full] = build()
    while len(_STEP_METADATA) > STEP_METADATA_KEPT:
        try:  # first in, first out; another thread may have removed it already
            _STEP_METADATA.popitem(last=False)
        except KeyError:
            break
    return out


@lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (one persistent program each)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def clear_step_metadata() -> None:
    """Forget every remembered :func:`step_metadata` tensor (a new routing builds its own)."""
    _STEP_METADATA.clear()


def row_groups(splits: Sequence[int], device: Union[torch.device, str]) -> torch.Tensor:
    """The group of each row of row groups of ``splits`` rows each: int32 [sum(splits)] on
    ``device`` (one queued copy of the counts), remembered by :func:`step_metadata` for the calls
    of one routing (an MoE step's x, h, dy and dh share it): read-only.

    Parameters
    ----------
    splits:
        Rows of each group, in order.
    device:
        Where the tensor lives.

    Returns
    -------
    torch.Tensor
        ``[0] * splits[0] + [1] * splits[1] + ...`` as int32.

    Example
    -------
    >>> row_groups([2, 0, 3], "cpu").tolist()
    [0, 0, 2, 2, 2]
    """
    splits = tuple(map(int, splits))

    def build() -> torch.Tensor:
        count = device_tensor(list(splits), device, torch.int32)
        return torch.arange(len(splits), dtype=torch.int32, device=device).repeat_interleave(
            count, output_size=sum(splits))  # output_size: no device sync
    return step_metadata(("row groups", splits), device, build)


def step_metadata_count() -> int:
    """How many :func:`step_metadata` tensors are remembered now (at most ``STEP_METADATA_KEPT``)."""
    return len(_STEP_METADATA)


def tile_plan(rows: np.ndarray, fields: np.ndarray, bm: int) -> tuple[torch.Tensor, int]:
    """Metadata of a grouped GEMM whose programs find their expert themselves
    (``hybridfp.kernels._common.expert_row_tile``): int64 host tensor of the experts' row tile prefix sums
    [E + 1] (expert e gets ceil(rows[e] / bm) row tiles) followed by ``fields`` [E, F]
    flattened; and T, the number of row tiles. ``rows``: [E] int64 (0: no program).
    numpy: a few ops on [E] host vectors, each ~10x cheaper than a torch CPU op."""
    firsts = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    # clamped: the kernels' lookup needs non-decreasing sums (callers reject negative counts)
    np.cumsum((np.maximum(rows, 0) + (bm - 1)) // bm, out=firsts[1:])
    return torch.from_numpy(np.concatenate([firsts, fields.reshape(-1)])), int(firsts[-1])
