"""``bf16_tensorcore``: exact GEMMs of block-scaled pairs on BF16 tensor cores (Hopper).

Hopper has no MXFP8 / NVFP4 MMA, but block-decoded values of these formats are exact in BF16
(``bf16_decode``), so for a pair whose two copies decode exactly:

    A_bf16, B_bf16 = decode(A), decode(B)          # Triton, one pass each (weights: cached)
    acc = torch.mm(A_bf16, B_bf16ᵀ, out_dtype=fp32)  # cuBLAS BF16, FP32 accumulation
    out = cast(acc * sa[:, None] * sb[None, :] + bias)   # one epilogue pass (triton_epilogue)

which is numerics §1's exact GEMM up to the order of the FP32 accumulation (products of BF16
values are exact in FP32). Without scales, bias or accumulation a BF16 output comes straight
from ``torch.mm`` (cuBLAS rounds its FP32 accumulator once). cuBLAS may otherwise reduce
split-K partial sums in BF16 (torch's ``allow_bf16_reduced_precision_reduction``, on by
default); that is switched off around the call.

Pairs (format keys; any layout; CUDA sm80+ with Triton): both operands among MXFP8, NVFP4
(1D / 2D / row-scaled / RHT), FP8 per-tensor, power-of-two FP8 block and Identity, with
either both or neither copy RHT'd (two RHT copies stay in the transformed domain: R cancels).
The cuBLAS FP8 backends (``fast.py``) are registered after this one and so take precedence
for their pairs (FP8 per-tensor x per-tensor, FP8 block pairs): FP8 tensor cores are faster.
Left to the exact emulation, and reported by the build-time report as such: FP8 block with
FP32 (non power-of-two) scales.

One RHT copy against a non-RHT one (e.g. MXFP8 dy.col x NVFP4-RHT x.col in wgrad) is the
second backend registered here, ``bf16_split_rht`` (same formats and devices): the exact GEMM
undoes the RHT of the one side in FP32, which does not keep values in BF16, so that side's
FP32 values are split into hi + mid + lo BF16 parts and multiplied in up to three BF16 GEMMs
summed in FP32 (``split_bf16``; exact, checked on the device). Values the split cannot hold
exactly (below ~2**-110, non-finite) send that call to ``emulate``, reported once.

What a format key cannot show — an Identity copy held in FP32 / FP16 — is found in ``run``:
such a GEMM runs ``emulate`` (an IEEE FP32 cuBLAS GEMM on CUDA, the fastest exact GEMM of
FP32 values; there is deliberately no separate "cublas_fp32" backend, which would be
``emulate`` under another name) and is reported once per (GEMM, pair, reason) with an
``EmulatedGemmWarning``.

Decoded weights: operand B of fprop (TN) and dgrad (NN) is the weight in a linear layer
(numerics §1), so its decode is cached on its payload (``decode_bf16(cache=True)``): micro-batches
of one step decode each weight copy once. ``hybridfp.policy(cache_weight_decodes=False)`` turns
that off (the cache holds a BF16 copy per weight copy until the quantized weight is dropped).
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterator, Optional

import torch

from ..config import current_policy
from ..tensors.storage import GemmOperand, QuantizedStorage
from .backends import Backend, FormatKey, _ieee_fp32, emulate, epilogue, register_backend, report_fallback
from .bf16_decode import decode_bf16
from .gemm import GEMM_OF_LAYOUT, LAYOUTS
from .split_bf16 import INEXACT, split_gemm

HAVE_TRITON = importlib.util.find_spec("triton") is not None
#: Format names whose copies can decode exactly into BF16 (given the options checked below).
FORMATS = frozenset({"MXFP8", "NVFP4", "FP8 per-tensor", "FP8 block", "Identity"})
#: Layouts whose operand B is a linear layer's weight (numerics §1): its decode is cached.
WEIGHT_B_LAYOUTS = frozenset({"TN", "NN"})
_REPORTED: set[tuple[str, str, str, str]] = set()


def _opts(key: FormatKey) -> Optional[tuple[str, dict]]:
    try:
        name, opts = key  # type: ignore[misc]
        return name, dict(opts)
    except (TypeError, ValueError):
        return None


def _rht_flags(key_a: FormatKey, key_b: FormatKey) -> Optional[tuple[bool, bool]]:
    """Each copy's RHT flag if both copies decode exactly into BF16 (known formats,
    power-of-two FP8 block scales), else None."""
    pa, pb = _opts(key_a), _opts(key_b)
    if pa is None or pb is None:
        return None
    for name, opts in (pa, pb):
        if name not in FORMATS or (name == "FP8 block" and not opts.get("pow2_scales", False)):
            return None
    return bool(pa[1].get("rht", False)), bool(pb[1].get("rht", False))


def pair_supported(key_a: FormatKey, key_b: FormatKey) -> bool:
    """Whether both copies decode exactly into BF16 and can meet in one BF16 GEMM (format
    level, any device): known formats, power-of-two FP8 block scales, RHT on both or neither."""
    flags = _rht_flags(key_a, key_b)
    return flags is not None and flags[0] == flags[1]


def split_pair_supported(key_a: FormatKey, key_b: FormatKey) -> bool:
    """Whether both copies decode exactly into BF16 and exactly one is RHT'd: the pairs of
    ``bf16_split_rht`` (format level, any device)."""
    flags = _rht_flags(key_a, key_b)
    return flags is not None and flags[0] != flags[1]


@lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _device_ok(device: torch.device) -> bool:
    device = torch.device(device)
    return (HAVE_TRITON and device.type == "cuda" and torch.cuda.is_available()
            and _capability(device) >= (8, 0))  # BF16 tensor cores


def supports(key_a: FormatKey, key_b: FormatKey, layout: str, device: torch.device) -> bool:
    """Backend predicate: a supported pair, on a CUDA device with BF16 tensor cores."""
    return layout in LAYOUTS and pair_supported(key_a, key_b) and _device_ok(device)




def supports_split(key_a: FormatKey, key_b: FormatKey, layout: str, device: torch.device) -> bool:
    """``bf16_split_rht``'s predicate: a one-sided RHT pair, on a CUDA device with BF16 tensor
    cores, whose plain side the policy's ``split_unverified_on_cuda`` does not name. Identity
    (BF16) x NVFP4-RHT reaches ~1.6e-5 relative error at 8192x4096x14336 on an NVIDIA H200: the
    tensor cores' own BF16 accumulation error at k = 14336 with 8-bit significands on both
    sides, so the GPU test bounds it by a plain cuBLAS BF16 GEMM's error at the shape."""
    if not (layout in LAYOUTS and split_pair_supported(key_a, key_b) and _device_ok(device)):
        return False
    names = {o[0] for o in (_opts(key_a), _opts(key_b)) if o is not None}
    return not (names & current_policy().split_unverified_on_cuda)


@contextmanager
def exact_bf16_gemm(device: torch.device) -> Iterator[None]:
    """No BF16 split-K reductions in cuBLAS, no autocast around the GEMM; restored after."""
    flags = torch.backends.cuda.matmul
    old = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        flags.allow_bf16_reduced_precision_reduction = old


def bf16_gemm(a: GemmOperand, b: GemmOperand, *, out_dtype: torch.dtype = torch.bfloat16,
              bias: Optional[torch.Tensor] = None,
              accumulate_into: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[m, n] = (Σ_k a[m, k] b[n, k]) * sa[m] * sb[n] (+ bias) of BF16-decoded operands.

    CUDA: cuBLAS BF16 with FP32 accumulation + the Triton epilogue. Elsewhere: an IEEE FP32
    matmul of the same BF16 values (exact products, FP32 accumulation) and ``emulate``'s
    epilogue, so the path is testable on the CPU. ``out`` (an [m, n] ``out_dtype`` tensor, no
    ``accumulate_into``): on CUDA the result is written there where the kernel can (the Triton
    epilogue: any strides; cuBLAS BF16: contiguous, 16-byte aligned, operands not recording
    gradients), e.g. the grouped per-expert path's rows of the joined output; any other result
    comes back as a new tensor, which the caller copies (``Backend.writes_out``).
    """
    av, bv = a.values, b.values
    if av.dtype != torch.bfloat16 or bv.dtype != torch.bfloat16:
        raise ValueError(f"bf16_gemm takes BF16-decoded operands; got {av.dtype} and {bv.dtype}.")
    if av.shape[1] != bv.shape[1] or a.rht != b.rht:
        raise ValueError(f"bf16_gemm: operands disagree on the reduction: A [{av.shape[0]}, "
                         f"{av.shape[1]}] (rht={a.rht}) vs B [{bv.shape[0]}, {bv.shape[1]}] "
                         f"(rht={b.rht}); a one-sided RHT pair goes through run_split (split_bf16).")
    if av.device.type != "cuda":
        return emulate(GemmOperand(av.float(), a.scale, a.k, a.rht),
                       GemmOperand(bv.float(), b.scale, b.k, b.rht), out_dtype, bias, accumulate_into)
    plain = a.scale is None and b.scale is None and bias is None and accumulate_into is None
    if plain and out_dtype == torch.bfloat16:
        with exact_bf16_gemm(av.device):
            # FP32 accumulation, one rounding to BF16. Into ``out`` only where cuBLAS sees what a
            # fresh result would give it (contiguous, 16-byte aligned), so it picks the same kernel;
            # not while autograd records the operands (mm's out= has no derivative; BF16
            # Identity copies are the inputs themselves)
            recording = torch.is_grad_enabled() and (av.requires_grad or bv.requires_grad)
            if out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0 and not recording:
                return torch.mm(av, bv.t(), out=out)
            return torch.mm(av, bv.t())
    return finish(bf16_mm_fp32(av, bv), a, b, out_dtype, bias, accumulate_into, out)


def bf16_mm_fp32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [m, k] · y [n, k]ᵀ of BF16 matrices in FP32: exact products, FP32 accumulation.

    CUDA: cuBLAS BF16 with an FP32 output (no BF16 split-K reductions). Elsewhere: an IEEE
    FP32 matmul of the same values (what ``emulate`` runs), so CPU tests run the same path.
    """
    if x.device.type == "cuda":
        with exact_bf16_gemm(x.device):
            return torch.mm(x, y.t(), out_dtype=torch.float32)
    with _ieee_fp32(), torch.autocast(x.device.type, enabled=False):
        return x.float() @ y.float().t()


def finish(acc: torch.Tensor, a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype,
           bias: Optional[torch.Tensor] = None, accumulate_into: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``emulate``'s epilogue on an FP32 accumulator: global / per-row scales of ``a`` and
    ``b``, bias, one cast (or ``accumulate_into +=``); one Triton pass on CUDA, which writes
    into ``out`` when given (elsewhere the result may be a new tensor)."""
    plain = a.scale is None and b.scale is None and bias is None and accumulate_into is None
    if plain and out_dtype == torch.float32:
        return acc if out is None else out.copy_(acc)
    if acc.device.type != "cuda":
        return epilogue(acc, a, b, out_dtype, bias, accumulate_into)
    # imported at the first CUDA GEMM (Triton's import fixes its interpreted / compiled mode;
    # see quantizers/fast.py)
    from ..kernels import triton_epilogue
    if not triton_epilogue.supported(out_dtype, accumulate_into):
        return epilogue(acc, a, b, out_dtype, bias, accumulate_into)
    with torch.cuda.device(acc.device):
        return triton_epilogue.epilogue(acc, a.scale, b.scale, bias, out_dtype, accumulate_into, out=out)


def _emulated(sa: QuantizedStorage, sb: QuantizedStorage, layout: str, why: str,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor],
              accumulate_into: Optional[torch.Tensor],
              missing: str = "BF16 tensor-core path here") -> torch.Tensor:
    """The exact FP32 emulation for a GEMM the BF16 paths cannot take exactly, reported once."""
    da, db = LAYOUTS[layout]
    report_fallback(_REPORTED, GEMM_OF_LAYOUT[layout], sa.format_key(da), sb.format_key(db), why,
                    missing, "the exact emulation path (an IEEE FP32 GEMM)")
    return emulate(sa.gemm_operand(da), sb.gemm_operand(db), out_dtype, bias, accumulate_into)


def _reason(s: QuantizedStorage, direction: str, what: str) -> Optional[str]:
    why = s.bf16_exact_reason(direction)
    return None if why is None else f"{what}: {why}"


def _on_bf16(sa: QuantizedStorage, sb: QuantizedStorage, layout: str, out_dtype: torch.dtype,
             bias: Optional[torch.Tensor], accumulate_into: Optional[torch.Tensor],
             compute: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``compute(pa, pb, a, b)`` on both copies decoded into BF16 (B's decode cached when it is
    a weight), or the reported emulation where a copy does not decode exactly into BF16."""
    da, db = LAYOUTS[layout]
    pa, pb = sa.part(da), sb.part(db)
    why = _reason(pa, da, "A") or _reason(pb, db, "B")
    if why is not None:
        return _emulated(pa, pb, layout, why, out_dtype, bias, accumulate_into)
    a = decode_bf16(pa, da)
    b = decode_bf16(pb, db, cache=current_policy().cache_weight_decodes and layout in WEIGHT_B_LAYOUTS)
    return compute(pa, pb, a, b)


def run(sa: QuantizedStorage, sb: QuantizedStorage, layout: str, *,
        out_dtype: torch.dtype = torch.bfloat16, bias: Optional[torch.Tensor] = None,
        accumulate_into: Optional[torch.Tensor] = None, fast_accumulation: bool = False,
        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The GEMM ``layout`` selects on two single-format storages (see the module doc).
    ``fast_accumulation`` changes nothing here: BF16 tensor cores accumulate in FP32. ``out``:
    see :func:`bf16_gemm` (``Backend.writes_out``)."""
    return _on_bf16(sa, sb, layout, out_dtype, bias, accumulate_into, lambda pa, pb, a, b: bf16_gemm(
        a, b, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into, out=out))


def run_split(sa: QuantizedStorage, sb: QuantizedStorage, layout: str, *,
              out_dtype: torch.dtype = torch.bfloat16, bias: Optional[torch.Tensor] = None,
              accumulate_into: Optional[torch.Tensor] = None, fast_accumulation: bool = False,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A one-sided RHT pair (``bf16_split_rht``): decode both copies into BF16, then
    ``split_gemm`` (the RHT side inverse-transformed and split into BF16 parts, up to three
    BF16 GEMMs summed in FP32) and ``emulate``'s epilogue. Copies that do not decode into BF16,
    or RHT values the split cannot hold exactly, run ``emulate`` (reported once per reason).
    ``fast_accumulation`` changes nothing here: BF16 tensor cores accumulate in FP32; ``out``: see
    :func:`bf16_gemm`."""
    def compute(pa: QuantizedStorage, pb: QuantizedStorage, a: GemmOperand, b: GemmOperand) -> torch.Tensor:
        acc = split_gemm(a, b, bf16_mm_fp32)
        if acc is None:
            side = "A" if a.rht else "B"
            return _emulated(pa, pb, layout, f"{side}: {INEXACT}", out_dtype, bias, accumulate_into,
                             missing="exact BF16 split path here")
        return finish(acc, a, b, out_dtype, bias, accumulate_into, out)
    return _on_bf16(sa, sb, layout, out_dtype, bias, accumulate_into, compute)


BF16_TENSORCORE_BACKEND = Backend("bf16_tensorcore", supports, run, writes_out=True, reads_bf16_decodes=True)
register_backend(BF16_TENSORCORE_BACKEND)
#: Disjoint from bf16_tensorcore's pairs (exactly one copy RHT'd), so the order is immaterial.
BF16_SPLIT_RHT_BACKEND = Backend("bf16_split_rht", supports_split, run_split, writes_out=True)
register_backend(BF16_SPLIT_RHT_BACKEND)
