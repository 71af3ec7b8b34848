"""``Policy``: every behaviour switch of the library in one frozen, validated object.

The policy chooses *how* hybridfp computes — which copies a module holds decoded, whether
quantize kernels run, which grouped GEMM path an MoE layer's GEMMs take and with which kernel
config. Results are bitwise the same under every policy except where a field says otherwise
(the grouped paths' FP32 summation order, documented in ``moe/gemm.py``; "always" decoded
copies on emulated GEMMs). The defaults are what the library measures fastest on an
NVIDIA H200; change them for comparisons, benchmarks and tests::

    with hybridfp.policy(quantize_kernels=False):      # the PyTorch reference quantizers
        ...
    with hybridfp.use_policy(hybridfp.Policy(decoded_copies="never")):
        ...

A policy belongs to the thread that set it, as ``hybridfp.autocast`` regions and
``torch.autocast`` do: each thread starts with the default ``Policy()``, whatever policy the
thread that started it has. Autograd may run a backward pass on another thread, so the
modules' autograd functions keep the policy of their forward and re-enter it in backward, and
``hybridfp.checkpoint`` recomputes under the policy of the forward it replays.

This module is the bottom layer of the package: it imports nothing from hybridfp.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator, Optional

#: The values of :attr:`Policy.decoded_copies`.
DECODED_COPIES_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class Policy:
    """How hybridfp computes; see the module docstring. Every field is validated on
    construction (a ``ValueError`` / ``TypeError`` naming the field). Frozen: derive a changed
    policy with ``dataclasses.replace`` or :func:`policy`.

    Parameters
    ----------
    **fields:
        Each field declared below (``decoded_copies``, ``quantize_kernels``,
        ``many_experts``, ...), documented where it is declared; unset fields keep their
        defaults. Only ``decoded_copies`` and the grouped-path switches can change results
        (as their docstrings say).

    Raises
    ------
    ValueError
        An unknown ``decoded_copies`` mode, or a count / threshold that is not a number >= 0.
    TypeError
        A switch that is not a bool (``bf16_per_group_cublas``: bool or None), a set field that
        is not a collection of str, or a TMA config that is not a non-empty str or None.

    Example
    -------
    >>> import hybridfp as hf
    >>> p = hf.Policy(decoded_copies="never", quantize_kernels=False)
    >>> with hf.use_policy(p):
    ...     hf.current_policy().decoded_copies
    'never'
    >>> hf.current_policy().decoded_copies
    'auto'
    """

    decoded_copies: str = "auto"
    """How modules hold the copies of ``nn.base.DECODED_COPIES`` (the copies that are only ever
    GEMM operands). "auto" (default): as BF16 decodes where the quantizers can write them
    (``Quantizer.decodable``: 1D MXFP8's two copies, an NVFP4 -> MXFP8 hybrid's either) and
    every GEMM that reads them decodes them anyway (``gemm.reads_bf16_decodes``: MXFP8 / NVFP4
    pairs on CUDA's BF16 tensor cores) — one pass instead of a quantize and a decode; "always":
    wherever the quantizers can, on any device (the CPU runs the same plumbing); "never": codes
    and scales. Results are bitwise the same in every mode wherever the GEMMs decode to BF16
    ("auto" holds nothing else; on emulated pairs "always" rounds MXFP8 values below 2**-133 to
    BF16's grid, see ``tensors.decoded``). A module whose policy changed rebuilds its
    quantizers at its next forward."""

    decoded_unverified_on_cuda: frozenset = frozenset()
    """Quantizer class names whose decoded copies "auto" leaves off on CUDA until their GPU
    tests pass (tests/nn/test_nn_decoded.py, tests/nn/test_nn_gpu.py). Default empty: every
    class passes them on the H200. "always" holds any listed class's copies on any device."""

    decode_kernel_unverified_on_cuda: frozenset = frozenset()
    """Storage class names (e.g. ``"MXFP8Storage"``) whose Triton BF16 decode kernel stays off
    CUDA until its GPU bitwise tests pass (tests/kernels/test_kernels_decode.py); their copies
    are decoded by the reference there (PyTorch ops on the GPU: exact, slower). Default empty:
    every decode kernel passes them on the H200."""

    split_unverified_on_cuda: frozenset = frozenset()
    """Plain-side format names (``"Identity"``, ``"MXFP8"``, ...) of a one-sided RHT pair kept
    off CUDA's ``split_bf16`` backend (they stay on the reported exact emulation) until
    tests/gemm/test_gemm_split_rht.py's GPU test passes for them. Default empty: every plain
    side passes it on the H200."""

    quantize_kernels: bool = True
    """Whether ``Quantizer.encode`` and the grouped quantize passes (padding, fused grouped
    passes, row-mapped columnwise copies) may run the fast kernels. Default True; False runs
    the PyTorch reference everywhere (the kernels are tested bitwise against it), e.g. to
    compare with it."""

    cache_weight_decodes: bool = True
    """Whether fprop and dgrad on BF16 tensor cores (Hopper's MXFP8 / NVFP4 GEMMs) keep the
    decoded BF16 copy of their weight operand for later calls while its payload is unchanged
    (the micro-batches of one step decode each weight copy once). False decodes at every call,
    e.g. to time the decode with the GEMM."""

    many_experts: int = 16
    """On CUDA the Triton grouped GEMMs (``moe/gemm_triton.py``, and
    ``moe/gemm_fp8.py`` for per-tensor FP8) are taken by default from this many experts on:
    the per-expert loop then costs a launch sequence per expert and the layer turns host-bound.
    Default 16, between the 8- and 64-expert MoE layers that ``python -m bench.bench_moe --ab``
    compares both paths on."""

    grouped_triton_max_flops: float = 2e11
    """From :attr:`many_experts` experts on, fprop of pairs that take the Triton grouped GEMM of
    ``moe/gemm_triton.py`` (an epilogue factor such as NVFP4's global scale, a bias, a non-BF16
    output) takes it by default only while the mean expert GEMM is below this many FLOPs;
    larger experts run the per-expert loop, whose GEMMs are long enough to hide its launches
    (dgrad and wgrad, not measured, keep the expert-count rule).
    Per-tensor FP8 pairs have their own limit (:attr:`per_expert_fp8_triton_flops`); a device
    listed in :attr:`grouped_triton_devices` or a caller's ``use_triton`` ignores it. Default
    2e11: ``python -m bench.sweep_dispatch --only many_experts`` (NVFP4 fprop, 4096-16384
    tokens x hidden 2048-8192 x 16-64 experts, an NVIDIA H100) found the loop the faster in
    every such cell from 2.4e11 FLOPs per expert GEMM on (by 1.14-1.32x) and the Triton kernel
    the faster in every one below 1.3e11."""

    grouped_triton_devices: frozenset = frozenset()
    """Device types (``"cuda"``, ``"cpu"``) on which the Triton grouped GEMMs are taken for any
    number of experts. Default empty: below :attr:`many_experts` the per-expert loop keeps
    them (``python -m bench.bench_moe --ab`` compares the two). Tests add ``"cpu"`` to run them
    in the Triton interpreter."""

    grouped_triton_native_fp8: bool = False
    """Whether experts' pairs that have a native cuBLAS FP8 kernel (FP8 per-tensor / block) may
    take the BF16 Triton grouped GEMM too, decoded into BF16 (exact). Default False: per expert
    they run on FP8 tensor cores (the BF16 path's wgrad runs with KALIGN 1; ``python -m
    bench.bench_moe --ab`` times both)."""

    over_scaled_grouped_mm: bool = False
    """Whether fprop / dgrad of E4M3 experts given as per-expert lists take the Triton FP8
    grouped GEMM instead of ``torch._scaled_grouped_mm`` (``moe/gemm.py``'s path 2).
    Default False; a benchmarking switch (``python -m bench.bench_moe``'s "[FP8 Triton grouped
    everywhere]" row). Joined copies take the Triton FP8 path for every GEMM regardless."""

    grouped_fp8_tma_rows: Optional[str] = "256x128x128 w8 st3"
    """The Triton FP8 grouped GEMM's TMA kernel config for fprop / dgrad on CUDA, where it can
    read the operands (16-byte aligned: joined copies always are): a name in
    ``kernels/moe/triton_grouped_fp8_tma.py``'s ``CONFIGS``, or None for the pointer kernel.
    Default: 256x128 tiles, BK 128, 8 warps, 3 stages: the fastest config of ``python -m
    bench.bench_grouped_gemm --part fp8`` at the 64-expert MoE's six GEMMs on an NVIDIA H200.
    The interpreter keeps the pointer kernel (CUDA only)."""

    grouped_fp8_tma_wgrad: Optional[str] = "256x128x128 w8 st3 store"
    """As :attr:`grouped_fp8_tma_rows`, for wgrad. Default: the same tiles with the bulk-store
    epilogue (wgrad's short K loop leaves the store exposed)."""

    bf16_per_group_cublas: Optional[bool] = None
    """The grouped BF16 matmul of ``moe/gemm.py``'s path 1 on CUDA: True, cuBLAS per group
    (``grouped_bf16.per_group_mm``, the same result semantics); False, ``torch._grouped_mm``
    (CUTLASS, one launch); None (default), ``grouped.per_group_wins`` decides by the groups'
    count and size (:attr:`per_group_max_groups`, :attr:`per_group_min_mean`)."""

    per_group_max_groups: int = 16
    """``per_group_wins``: cuBLAS per group only for at most this many groups (each is a launch
    and host work, which a many-expert MoE step cannot afford) ..."""

    per_group_min_mean: int = 2048
    """... of at least this many rows (or reduction columns) on average. Default 16 and 2048:
    the group counts and sizes up to which cuBLAS per expert is the faster of the two on an
    NVIDIA H200 (``python -m bench.bench_moe --ab`` times both at 8 and 64 experts)."""

    stack_scaled_max_numel: int = 1 << 25
    """Largest expert weight (elements) stacked into one buffer for a grouped per-tensor-scaled
    quantization (``moe.quantize_weights_grouped``). The stack is a full read and write of the
    weights; quantizing each expert on its own costs two launches (amax, cast) instead. On an
    NVIDIA H200 stacking an 8-expert layer's [28672, 4096] BF16 weights costs more than the
    launches it saves; at 64 experts of [2816, 4096] (11.5M elements) the step is host-bound and
    one launch for all beats 128. Results are the same bits either way."""

    per_expert_fp8_flops: float = 2.5e11
    """Mean GEMM size (FLOPs per non-empty expert) from which per-tensor FP8 experts run as one
    cuBLAS ``_scaled_mm`` per expert rather than a grouped kernel. Default 2.5e11: between the
    8-expert MoE layer (experts of ~4096 rows, hidden 4096, ffn 14336: about 4.8e11 FLOPs per
    expert GEMM), where cuBLAS per expert is the faster on an NVIDIA H200, and small experts
    whose GEMMs are too short to hide a launch's host work (``python -m bench.bench_grouped_gemm``
    and ``python -m bench.bench_moe --ab`` time both). Fprop / dgrad of per-tensor FP8 experts
    that would take the Triton FP8 grouped GEMM use :attr:`per_expert_fp8_triton_flops`
    instead."""

    per_expert_fp8_triton_flops: float = 4.5e10
    """As :attr:`per_expert_fp8_flops`, for fprop / dgrad of per-tensor FP8 experts that would
    otherwise take the Triton FP8 grouped GEMM (joined copies; E5M2 gradients in dgrad, E4M3 /
    E5M2 mixes, a bias, a non-BF16 output). Measured on dgrad; fprop runs the same kernel and
    tile config on the same shape class ([m_e, k] x [k, n]). Default 4.5e10: ``python -m
    bench.sweep_dispatch --only fp8_per_expert`` (dgrad, 4096-16384 tokens x hidden
    2048-8192 x 8-64 experts, an NVIDIA H100) found cuBLAS per expert the faster in every cell
    from 6.0e10 FLOPs per expert GEMM on (1.30-1.59x at 16-64 experts) and the Triton kernel
    the faster in every cell below 3.0e10; at 3.0e10 each won some cells (by up to 7.5 %)."""

    def __post_init__(self) -> None:
        if self.decoded_copies not in DECODED_COPIES_MODES:
            raise ValueError(f"Policy.decoded_copies={self.decoded_copies!r} is unknown; use one of "
                             f"{DECODED_COPIES_MODES}.")
        for name in ("decoded_unverified_on_cuda", "decode_kernel_unverified_on_cuda", "split_unverified_on_cuda",
                     "grouped_triton_devices"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (frozenset, set, tuple, list)) or not all(
                    isinstance(v, str) for v in value):
                raise TypeError(f"Policy.{name} must be a set of names (str); got {value!r}.")
            object.__setattr__(self, name, frozenset(value))
        for name in ("quantize_kernels", "cache_weight_decodes", "grouped_triton_native_fp8", "over_scaled_grouped_mm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Policy.{name} must be True or False; got {getattr(self, name)!r}.")
        if self.bf16_per_group_cublas is not None and not isinstance(self.bf16_per_group_cublas, bool):
            raise TypeError(f"Policy.bf16_per_group_cublas must be True, False or None; got "
                            f"{self.bf16_per_group_cublas!r}.")
        for name in ("grouped_fp8_tma_rows", "grouped_fp8_tma_wgrad"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise TypeError(f"Policy.{name} must be a TMA config name or None; got {value!r}.")
        for name in ("many_experts", "per_group_max_groups", "per_group_min_mean", "stack_scaled_max_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Policy.{name} must be an integer >= 0; got {value!r}.")
        for name in ("per_expert_fp8_flops", "per_expert_fp8_triton_flops", "grouped_triton_max_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"Policy.{name} must be a number >= 0; got {value!r}.")


#: The policy every thread starts with.
DEFAULT_POLICY = Policy()


class _ThreadPolicy(threading.local):
    """Each thread's policy: a new thread starts with :data:`DEFAULT_POLICY`."""

    def __init__(self) -> None:
        self.policy = DEFAULT_POLICY


_CURRENT = _ThreadPolicy()


def current_policy() -> Policy:
    """The calling thread's policy.

    Returns
    -------
    Policy
        The policy set by the innermost :func:`use_policy` / :func:`policy` block of this
        thread, else the default ``Policy()``.

    Example
    -------
    >>> import hybridfp as hf
    >>> hf.current_policy() == hf.Policy()
    True
    """
    return _CURRENT.policy


@contextmanager
def use_policy(p: Policy) -> Iterator[Policy]:
    """Run the block under policy ``p`` in the calling thread; the previous policy is restored
    when the block ends (also when it raises).

    Parameters
    ----------
    p:
        The policy to run under.

    Returns
    -------
    contextmanager
        Yielding ``p``.

    Raises
    ------
    TypeError
        ``p`` is not a :class:`Policy` (raised on entering the block).

    Example
    -------
    >>> import hybridfp as hf
    >>> with hf.use_policy(hf.Policy(quantize_kernels=False)) as p:
    ...     hf.current_policy() is p
    True
    """
    if not isinstance(p, Policy):
        raise TypeError(f"use_policy needs a hybridfp Policy; got {type(p).__name__}.")
    old, _CURRENT.policy = _CURRENT.policy, p
    try:
        yield p
    finally:
        _CURRENT.policy = old


@contextmanager
def policy(**changes: Any) -> Iterator[Policy]:
    """Run the block under the calling thread's policy with ``changes`` applied (field names of
    :class:`Policy`), e.g. ``with hybridfp.policy(quantize_kernels=False):``.

    Parameters
    ----------
    **changes:
        Field name -> new value.

    Returns
    -------
    contextmanager
        Yielding the policy in force inside the block.

    Raises
    ------
    TypeError
        A name that is not a field of :class:`Policy`, or a value of the wrong type.
    ValueError
        A value out of range (as :class:`Policy` checks).

    Example
    -------
    >>> import hybridfp as hf
    >>> with hf.policy(decoded_copies="never"):
    ...     hf.current_policy().decoded_copies
    'never'
    """
    known = {f.name for f in fields(Policy)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"Policy has no field {', '.join(map(repr, unknown))}; its fields are "
                        f"{', '.join(sorted(known))}.")
    with use_policy(replace(current_policy(), **changes)) as p:
        yield p
