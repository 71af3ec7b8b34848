"""The MoE benchmark's torchao float8 baseline: the BF16 grouped layer (``BF16MoE``,
``torch._grouped_mm``) with its two expert weights converted by torchao's MoE training
prototype (``torchao.prototype.moe_training``, ``Float8TrainingOpConfig``: FP8 rowwise, E4M3
operands and gradients; written against torchao 0.17.0), under ``torch.compile`` as torchao
means it to run (an eager twin of the row, by name, for when compilation fails). Run by name
only (``bench_moe --variants``); the hybridfp FP8 rows of such a run are paired against it.

What torchao 0.17.0 requires, and how the row meets it:

- ``quantize_`` with ``Float8TrainingOpConfig`` wraps each converted Parameter in
  ``Float8TrainingWeightWrapperTensor``; its ``__torch_function__`` takes a ``torch._grouped_mm``
  of a 2D A, the wrapped 3D B and ``offs`` to torchao's FP8 rowwise grouped GEMM
  (``prototype/moe_training/tensor.py``, ``fp8_grouped_mm.py``). B must be the [E, K, N]
  transposed view of an [E, N, K] weight (column-major: ``BF16MoE`` passes ``w.transpose(1, 2)``),
  K and N multiples of 16, ``offs`` int32. Only the experts' ``w1`` and ``w2`` are converted
  (``FqnToConfig`` by Parameter name): the router stays as it is.
- Its weight gradient is a 2D x 2D ``torch._scaled_grouped_mm`` grouped along the tokens with
  both operands contiguous along them, so each group must start 16-byte aligned: every expert's
  token count a multiple of 16 in FP8 (CUDA's grouped GEMM asserts on the device otherwise).
  The benchmark's skewed routing gives any counts, and the config's own padding
  (``pad_token_groups_for_grouped_mm=True``) is not implemented for FP8 in 0.17.0 (it asserts).
  So the row pads as torchtitan does for torchao's FP8 MoE: torchao's
  ``generate_permute_indices`` (``prototype/moe_training/ep/kernels.py``; each expert's rows
  rounded up to 16, an empty expert given 16) orders the rows, and the routing's own gather and
  scatter use that order, the padding rows zeros that add nothing to y, dx or dW. Same routing
  (experts, weights) as every other row; the padding's cost (up to 15 more rows an expert in
  every GEMM, the index kernel) is the row's. (torchao's other padding, ``utils.pad_token_groups``,
  is MXFP8's: a CUDA kernel on sm100 only, elsewhere a loop over the experts with host syncs.)
- ``torch._scaled_grouped_mm``'s FP8 rowwise kernel runs on sm90 (no CPU kernel): the row needs
  an H100 / H200.
- torchao quantizes each weight inside every grouped GEMM call (forward and backward of every
  micro-batch; nothing kept across them), hybridfp once a step: each row as its library runs it.
- torchao 0.17.0's own training test skips FP8 rowwise under ``torch.compile`` (pytorch/ao#4048):
  where compilation fails, ``TORCHAO_EAGER_ROW`` times the same layer eagerly.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from bench import common
from bench.bench_mlp import torchao_baselines, torchao_status
from bench.common import MissingBaselineError
from bench.moe_layer import TOP_K, BF16MoE, Routing

TORCHAO_ROW = "torchao float8 rowwise (compiled)"
#: the same layer eager: by name, where torch.compile of the converted layer fails
TORCHAO_EAGER_ROW = "torchao float8 rowwise (eager)"
TORCHAO_ROWS = (TORCHAO_ROW, TORCHAO_EAGER_ROW)
#: (forward operands, backward gradients): Float8TrainingOpConfig's float8_dtype, E4M3 for all three GEMMs
TORCHAO_FORMATS = ("e4m3", "e4m3")
#: rows an expert's token group is padded to a multiple of: 16 bytes of E4M3 (the FP8 wgrad's rule)
ALIGN = 16
#: the Parameters of ``BF16MoE`` the conversion targets: the experts' weights, not the router
EXPERT_WEIGHTS = ("w1", "w2")
#: torchao's signature of ``generate_permute_indices``: (counts, experts, ranks, rows, alignment)
Fill = Callable[[torch.Tensor, int, int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def selected(only: Optional[list[str]]) -> list[str]:
    """The torchao rows ``only`` (``--variants``) names: they run by name only.

    Parameters
    ----------
    only:
        The run's ``--variants`` names, or None (every default row).

    Returns
    -------
    list[str]
        The names of ``TORCHAO_ROWS`` in ``only``.
    """
    return [n for n in TORCHAO_ROWS if only is not None and n in only]


def paired_with_torchao(name: str) -> bool:
    """Whether row ``name`` is also paired against the torchao rows of its run.

    Parameters
    ----------
    name:
        A row's name.

    Returns
    -------
    bool
        True for every hybridfp FP8 row (not MXFP8 or NVFP4): bench_mlp's rule for pairing its
        FP8 rows with torchao's dense float8 (``bench_mlp.torchao_baselines``).
    """
    return bool(torchao_baselines(name))


def _missing(rows: Sequence[str], why: str) -> MissingBaselineError:
    """The error naming ``rows``, why they cannot run and what to do."""
    return MissingBaselineError(f"bench_moe: the baseline {', '.join(map(repr, rows))} cannot run: {why}; "
                                "every ratio against it needs it (or leave it out of --variants)")


def _torchao(rows: Sequence[str]) -> tuple[Any, Any, Any, Fill]:
    """(Float8TrainingOpConfig, FqnToConfig, quantize_, generate_permute_indices) from torchao.

    Raises
    ------
    MissingBaselineError
        torchao, or its MoE training prototype, cannot be imported (naming ``rows``)."""
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.prototype.moe_training.ep.kernels import generate_permute_indices
        from torchao.quantization import FqnToConfig, quantize_
    except Exception as err:  # noqa: BLE001 - any import failure: the baseline is missing
        _, version = torchao_status()
        # a missing module wants an install; any other failure is torchao's own import (its kernels
        # are defined at import on a GPU machine, against the Triton it supports)
        todo = ("install it: pip install torchao==0.17.0" if isinstance(err, ModuleNotFoundError) else
                "torchao is installed but its import fails here: use torchao 0.17.0 with the Triton it "
                "supports (measured with Triton 3.6)")
        raise _missing(rows, f"torchao's MoE training prototype (torchao.prototype.moe_training, written "
                             f"against 0.17.0) is not importable ({type(err).__name__}: {str(err)[:160]}; "
                             f"torchao: {version}); {todo}") from err
    return Float8TrainingOpConfig, FqnToConfig, quantize_, generate_permute_indices


def require(rows: Sequence[str]) -> str:
    """Check that torchao's float8 MoE rows ``rows`` can run here: torchao's prototype importable
    and an sm90 CUDA GPU (``common.DEVICE``).

    Parameters
    ----------
    rows:
        The torchao rows the run selected (``selected``); none: nothing is checked.

    Returns
    -------
    str
        torchao's version ("" when ``rows`` is empty).

    Raises
    ------
    MissingBaselineError
        Naming the rows, what is missing and what to do.
    """
    if not rows:
        return ""
    _torchao(rows)
    _, version = torchao_status()
    if common.DEVICE != "cuda" or not torch.cuda.is_available():
        raise _missing(rows, "torchao's FP8 rowwise grouped GEMM (torch._scaled_grouped_mm) needs a CUDA GPU of "
                             "sm90 and has no CPU kernel; run it on an H100 / H200")
    cap = torch.cuda.get_device_capability()
    if cap < (9, 0):
        raise _missing(rows, f"torch._scaled_grouped_mm's FP8 rowwise kernel needs sm90; this GPU is "
                             f"sm{cap[0]}{cap[1]}; run it on an H100 / H200")
    return version


class PaddedRouting(Routing):
    """The layer's routing (the same experts and weights) with each expert's rows padded to a
    multiple of ``ALIGN`` in torchao's order (``fill``: its ``generate_permute_indices``): the
    padding rows gather an extra zero row of x and scatter into an extra output row, dropped."""

    def __init__(self, x: torch.Tensor, router: torch.Tensor, top_k: int, offset: Optional[torch.Tensor],
                 fill: Fill) -> None:
        super().__init__(x, router, top_k, offset)
        experts, rows = router.shape[0], self.order.numel()
        # torchao's bound on the padded rows (static: no sync, one compiled graph for any routing)
        length = -(-(rows + experts * ALIGN) // ALIGN) * ALIGN
        with torch.no_grad():
            index, _, self.offs = fill(self.counts.to(torch.int32), experts, 1, length, ALIGN)
        pad = index < 0  # padding rows, and the rows past the last group
        source = index.clamp_min(0).long()
        self.token = torch.where(pad, x.shape[0], self.token[source])
        self.weight = torch.where(pad, 0.0, self.weight[source])

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(1, x.shape[1])])[self.token]

    def unpermute(self, y: torch.Tensor, tokens: int) -> torch.Tensor:
        # rows past the last group are never written by the GEMM: they land in the dropped row
        return super().unpermute(y, tokens + 1)[:-1]


class TorchaoMoE(BF16MoE):
    """``BF16MoE`` computed with ``torch._grouped_mm`` on torchao-padded token groups
    (``PaddedRouting``); ``torchao_layer`` converts its expert weights."""

    fill: Fill

    def route(self, x: torch.Tensor, offset: Optional[torch.Tensor] = None) -> Routing:
        return PaddedRouting(x, self.router, TOP_K, offset, self.fill)


def torchao_layer(base: BF16MoE, rows: Sequence[str] = (TORCHAO_ROW,)) -> TorchaoMoE:
    """``base``'s layer (its router, its weights' values) with the experts' weights converted to
    torchao's FP8 rowwise training (the converted Parameters wrap ``base``'s weight storage;
    ``base``'s own Parameters are left as they are).

    Parameters
    ----------
    base:
        The benchmark's BF16 layer.
    rows:
        The rows it is built for (named when torchao is missing).

    Returns
    -------
    TorchaoMoE
        The converted layer, eager.

    Raises
    ------
    MissingBaselineError
        torchao's prototype cannot be imported.
    """
    config_cls, fqn_config, quantize_, fill = _torchao(rows)
    layer = base.sharing("grouped", kind=TorchaoMoE)
    layer.fill = fill
    config = config_cls()  # FP8 rowwise, E4M3, BF16 out; no padding (FP8 has none in 0.17.0)
    quantize_(layer, fqn_config(OrderedDict((w, config) for w in EXPERT_WEIGHTS)), filter_fn=None)
    return layer


def build(name: str, base: BF16MoE, compile_backend: str) -> nn.Module:
    """Row ``name``'s layer.

    Parameters
    ----------
    name:
        ``TORCHAO_ROW`` or ``TORCHAO_EAGER_ROW``.
    base:
        The benchmark's BF16 layer.
    compile_backend:
        ``torch.compile``'s backend, the compiled BF16 baseline's.

    Returns
    -------
    nn.Module
        ``torchao_layer(base)``, under ``torch.compile`` for ``TORCHAO_ROW``.

    Raises
    ------
    MissingBaselineError
        torchao's prototype cannot be imported.
    """
    layer = torchao_layer(base, (name,))
    # dynamic=False: the layer runs BF16MoE.forward, which the compiled BF16 baseline traced first at
    # the unpadded row count; automatic dynamic shapes would retrace it with a symbolic row count
    # here, where the baseline's graph has fixed shapes
    return torch.compile(layer, backend=compile_backend, dynamic=False) if name == TORCHAO_ROW else layer
