"""Which of a run's GEMMs run on the exact emulation path (summary.md's list).

A GEMM backend is chosen by the operands' format keys, and a key cannot show the dtype an
Identity copy holds: the BF16 tensor-core backends serve Identity keys, but an Identity copy
held in FP32 / FP16 does not decode into BF16, so such a GEMM runs the exact emulation (an
IEEE FP32 GEMM on CUDA) although ``select`` names a backend for its key. Here each GEMM is
judged from the run's own model and quantizers, with the dtype each Identity copy holds, so
the answer belongs to the run even when several recipes run in one process
(``hybridfp.gemm.EMULATED`` is process-wide).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..gemm import EMULATED, describe_key, select
from ..nn import GEMMS, QuantizedModule
from ..quantizers import HybridQuantizer, IdentityQuantizer, Quantizer
from ..recipes import AutocastState
from ..tensors import COLUMNWISE, ROWWISE
from .recipes_by_name import NamedRecipe


def identity_held_dtype(q: Quantizer, direction: str, source: torch.dtype) -> Optional[torch.dtype]:
    """The dtype ``q``'s ``direction`` copy holds if that copy is an Identity one, else None.

    Parameters
    ----------
    q:
        The slot's quantizer (a HybridQuantizer is looked into per direction).
    direction:
        "rowwise" or "columnwise".
    source:
        The dtype of the tensor the slot quantizes (the activation dtype for input and
        grad_output, the parameter dtype for weight).

    Returns
    -------
    torch.dtype or None
        The Identity quantizer's cast dtype; without a cast, the dtype of what it reads: the
        source, or FP32 for a columnwise copy made from the rowwise dequantized value.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.train.emulated import identity_held_dtype
    >>> identity_held_dtype(hf.IdentityQuantizer(), "rowwise", torch.float32)
    torch.float32
    >>> identity_held_dtype(hf.IdentityQuantizer(torch.bfloat16), "rowwise", torch.float32)
    torch.bfloat16
    >>> identity_held_dtype(hf.MXFP8Quantizer(), "rowwise", torch.float32) is None
    True
    """
    if isinstance(q, HybridQuantizer):
        if direction == COLUMNWISE and q.columnwise_source == "rowwise_dequantized":
            source = torch.float32  # the hybrid hands its child the FP32 dequantized value
        q = q.rowwise_quantizer if direction == ROWWISE else q.columnwise_quantizer
    if not isinstance(q, IdentityQuantizer):
        return None
    return q.dtype or source


def _weight_dtype(m: torch.nn.Module) -> torch.dtype:
    """The dtype of the module's (first) weight matrix."""
    w = next((p for p in m.parameters(recurse=False) if p.dim() >= 2), None)
    return w.dtype if w is not None else torch.float32


def _bias_dtype(m: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype of the module's bias, None without one."""
    return next((p.dtype for n, p in m.named_parameters(recurse=False) if "bias" in n), None)


def gemm_operand_quantizers(qs: dict[str, list[Quantizer]], gemm_name: str, slot_a: str, slot_b: str,
                            backward_override: Optional[str]) -> tuple[Quantizer, Quantizer]:
    """The quantizers whose copies a GEMM reads: the module's, except in dgrad / wgrad under a
    recipe's ``backward_override``, where the plain tensors are multiplied (an Identity without
    a cast).

    Parameters
    ----------
    qs : the module's quantizers by slot (``QuantizedModule.quantizers``).
    gemm_name : "fprop", "dgrad" or "wgrad".
    slot_a, slot_b : the slots of its two operands.
    backward_override : the recipe's (None: the quantized backward).

    Returns
    -------
    tuple[Quantizer, Quantizer]
        The quantizers of operands A and B.
    """
    if backward_override is not None and gemm_name != "fprop":
        return IdentityQuantizer(), IdentityQuantizer()
    return qs[slot_a][0], qs[slot_b][0]


def gemm_path_notes(m: QuantizedModule, qs: dict[str, list[Quantizer]], act_dtype: torch.dtype,
                    device: torch.device, backward_override: Optional[str] = None) -> dict[str, Optional[str]]:
    """Per GEMM of ``m``: None where it does not run the exact emulation, else a note.

    Two Identity copies held in the output dtype (and a bias, if any, of it too) run as
    torch's own op (``hybridfp.gemm``'s identity pair): not the emulation.

    Parameters
    ----------
    m : a hybridfp module.
    qs : its quantizers by slot.
    act_dtype : the activation dtype (input and grad_output copies, fprop / dgrad outputs).
    device : where it runs.
    backward_override : the recipe's; with one, dgrad and wgrad read the plain tensors.

    Returns
    -------
    dict[str, Optional[str]]
        GEMM name -> None (not emulated), "" (the pair has no fast kernel), or which Identity
        copy is not held in BF16 (a backend serves the keys but not that copy).
    """
    w_dtype = _weight_dtype(m)
    source = {"input": act_dtype, "grad_output": act_dtype, "weight": w_dtype}
    out_of = {"fprop": act_dtype, "dgrad": act_dtype, "wgrad": w_dtype}
    bias = _bias_dtype(m)
    notes: dict[str, Optional[str]] = {}
    for gemm_name, layout, (slot_a, dir_a), (slot_b, dir_b) in GEMMS:
        qa, qb = gemm_operand_quantizers(qs, gemm_name, slot_a, slot_b, backward_override)
        held = {slot_a: identity_held_dtype(qa, dir_a, source[slot_a]),
                slot_b: identity_held_dtype(qb, dir_b, source[slot_b])}
        out = out_of[gemm_name]
        if (all(d == out for d in held.values())
                and (gemm_name != "fprop" or bias is None or bias == out)):
            notes[gemm_name] = None  # torch's own op in that dtype
            continue
        ka, kb = qa.format_key(dir_a), qb.format_key(dir_b)
        if select(ka, kb, layout, device) is None:
            key = (device.type, gemm_name, describe_key(ka), describe_key(kb))
            notes[gemm_name] = "" if key in EMULATED else None
            continue
        # a backend serves the keys: every one that takes an Identity key reads BF16 values,
        # so an Identity copy held in another dtype sends the GEMM to the exact emulation
        wide = [f"{slot} held in {str(d).replace('torch.', '')}" for slot, d in held.items()
                if d is not None and d != torch.bfloat16]
        notes[gemm_name] = ", ".join(wide) if wide else None
    return notes


def emulated_pairs(model: torch.nn.Module, named: NamedRecipe, device: str,
                   act_dtype: Optional[torch.dtype] = None) -> list[str]:
    """The (GEMM, format of A x format of B) pairs this run's modules ran on the exact
    emulation path on ``device``, with how many modules each.

    Pairs without a fast kernel are those ``hybridfp.gemm.EMULATED`` recorded; pairs a
    backend serves by their format keys are listed too where an Identity copy is held in
    FP32 / FP16 (the key cannot show it; that GEMM runs the emulation), with the copy named.

    Parameters
    ----------
    model:
        The run's model (its hybridfp modules are inspected).
    named:
        The run's recipe.
    device:
        Where it ran.
    act_dtype:
        The activation dtype (input and grad_output copies); None: ``model.act_dtype``, else
        BF16.

    Returns
    -------
    list[str]
        E.g. ``"fprop: Identity x Identity [weight held in float32] (4 modules)"``, in GEMM
        order; empty when none ran emulated.
    """
    act = act_dtype or getattr(model, "act_dtype", None) or torch.bfloat16
    state, dev = AutocastState(named.recipe), torch.device(device)
    counts: dict[str, int] = {}
    for m in model.modules():
        if not isinstance(m, QuantizedModule):
            continue
        qs = m.quantizers(state)
        override = named.recipe.backward_override
        notes = gemm_path_notes(m, qs, act, dev, override)
        for gemm_name, layout, (slot_a, dir_a), (slot_b, dir_b) in GEMMS:
            note = notes[gemm_name]
            if note is None:
                continue
            qa, qb = gemm_operand_quantizers(qs, gemm_name, slot_a, slot_b, override)
            a, b = describe_key(qa.format_key(dir_a)), describe_key(qb.format_key(dir_b))
            key = f"{gemm_name}: {a} x {b}" + (f" [{note}]" if note else "")
            counts[key] = counts.get(key, 0) + 1
    order = [g[0] for g in GEMMS]
    keys = sorted(counts, key=lambda k: order.index(k.split(":")[0]))  # stable: fprop, dgrad, wgrad
    return [f"{k} ({counts[k]} module{'s' * (counts[k] > 1)})" for k in keys]
