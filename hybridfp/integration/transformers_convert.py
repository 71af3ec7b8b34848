"""``hybridfp.convert``: a model's linears and MoE experts to hybridfp, and what stays behind.

The model-level conversion: transformers-style fused experts (``transformers_moe.py``) into
``GroupedLinear``, every ``nn.Linear`` into ``Linear`` (``hybridfp.nn.convert``, the building
block), the output projection (``lm_head``) and embeddings left in high precision unless asked,
and then every weight a matmul still reads outside hybridfp listed: in one
:class:`HighPrecisionWeightsWarning`, or an error with ``strict=True``. transformers itself is
never imported: models are recognised by their modules' attributes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from ..nn import set_names
from ..nn.base import QuantizedModule
from ..nn.convert import _linear_targets, _replace_linears
from .export import EXTRA_STATE_SUFFIX
from .transformers_moe import (check_experts_to_grouped, experts_to_grouped, fused_experts_layout,
                               routed_experts_call)

ModuleFilter = Callable[[str, nn.Module], bool]

#: Modules whose weights are read by a lookup or elementwise, never by a matmul.
_NOT_MATMUL = (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


class HighPrecisionWeightsWarning(UserWarning):
    """After ``hybridfp.convert``: weights that matmuls still read in high precision, outside
    hybridfp, and that were not left out on purpose (``module_filter``, ``lm_head``, routers).

    Example
    -------
    >>> import warnings, torch, hybridfp as hf
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = hf.convert(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 1)))
    >>> [str(w.message).splitlines()[1] for w in caught if w.category is hf.HighPrecisionWeightsWarning]
    ['  1.weight [4, 4, 1]: a Parameter of Conv1d, a module hybridfp does not convert']
    """


@dataclass(frozen=True)
class UnconvertedWeight:
    """One weight a matmul reads outside hybridfp.

    Parameters
    ----------
    name:
        The Parameter's qualified name.
    shape:
        Its shape.
    why:
        Why it was not converted (and what would convert it).
    deliberate:
        Left out on purpose (an ``nn.Linear`` or a module with 3-D experts weights that
        ``module_filter`` refuses, the ``lm_head`` default, a MoE router): neither warned about
        nor refused by ``strict``.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> model.lm_head = torch.nn.Linear(4, 8)
    >>> w, = hf.unconverted_weights(hf.convert(model))
    >>> w.name, w.shape, w.deliberate
    ('lm_head.weight', (8, 4), True)
    """

    name: str
    shape: tuple[int, ...]
    why: str
    deliberate: bool


def _output_projection(model: nn.Module) -> Optional[nn.Module]:
    """The model's output projection: transformers' ``get_output_embeddings()``, else a module
    named ``lm_head``."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return head
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head":
            return m
    return None


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, _NOT_MATMUL) or "Norm" in type(m).__name__ or "Embedding" in type(m).__name__


def _routers(model: nn.Module) -> dict[int, str]:
    """id(Parameter) -> its experts module's name, for the routers of fused experts blocks: the
    [E, H] Parameters of the experts' sibling modules (transformers' ``TopKRouter.weight``)."""
    out: dict[int, str] = {}
    for name, block in model.named_modules():
        for child_name, child in block.named_children():
            if child_name != "experts":
                continue
            down = child._parameters.get("down_proj")
            if down is None or down.dim() != 3:
                continue
            for sib_name, sib in block.named_children():
                for p in (sib.parameters() if sib is not child else ()):
                    if tuple(p.shape) == (down.shape[0], down.shape[1]):
                        out[id(p)] = f"{name}.{child_name}" if name else child_name
    return out


def _holds_experts_weights(m: nn.Module) -> bool:
    """``m`` holds 3-D ``gate_up_proj`` / ``up_proj`` and ``down_proj`` Parameters, in a layout
    convert takes or not (:func:`fused_experts_layout` accepts it or says why not)."""
    layout, reason = fused_experts_layout(m)
    return layout is not None or bool(reason)


def unconverted_weights(model: nn.Module, module_filter: Optional[ModuleFilter] = None, *,
                        lm_head: bool = False) -> list[UnconvertedWeight]:
    """Every weight (a Parameter of >= 2 dimensions) a matmul reads outside hybridfp.

    Embeddings, norms and biases are not listed (lookups, elementwise products, additions); a
    Parameter a hybridfp module reads (a Linear's, converted experts') is not listed even where another
    module holds it too (tied embeddings).

    Parameters
    ----------
    model:
        The model (converted or not).
    module_filter, lm_head:
        As given to :func:`convert`: what they left out is marked ``deliberate`` (for
        ``module_filter``, the ``nn.Linear`` layers and modules with 3-D experts weights it
        refuses).

    Returns
    -------
    list[UnconvertedWeight]
        In ``named_parameters`` order.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Conv1d(8, 8, 1))
    >>> [(w.name, w.deliberate) for w in hf.unconverted_weights(model)]
    [('0.weight', False), ('1.weight', False)]
    """
    head = _output_projection(model)
    read_by_hybridfp: set[int] = set()
    for m in model.modules():
        if isinstance(m, QuantizedModule):
            read_by_hybridfp.update(id(p) for p in (getattr(m, "weight", None), getattr(m, "bias", None))
                                    if p is not None)
            read_by_hybridfp.update(id(p) for p in m.parameters())
    routers = _routers(model)
    out: list[UnconvertedWeight] = []
    seen: set[int] = set()
    for name, m in model.named_modules():
        if _is_norm(m) or isinstance(m, QuantizedModule):
            continue
        for pname, p in m.named_parameters(recurse=False):
            # a bias (even an experts' [E, out] one) is added, not read by a matmul
            if p.dim() < 2 or pname == "bias" or pname.endswith("_bias") or id(p) in read_by_hybridfp \
                    or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{name}.{pname}" if name else pname
            deliberate = True
            if m is head and not lm_head:
                why = "the output projection (lm_head) stays in high precision by default; convert(..., lm_head=True) converts it"
            elif id(p) in routers:
                why = f"the router of {routers[id(p)]}: its scores pick the experts and stay in high precision"
            elif module_filter is not None and (type(m) is nn.Linear or _holds_experts_weights(m)) \
                    and not module_filter(name, m):
                # the filter is called on the modules it picks from only (nn.Linear, experts)
                # an experts module convert would not take either (shared experts, a transposed
                # layout) is still one the filter can leave out: strict's advice holds for it
                why = "left out by module_filter"
            else:
                deliberate = False
                reason = fused_experts_layout(m)[1]
                if reason and reason == routed_experts_call(m):
                    why = f"3-D experts weights hybridfp does not convert: {reason}"
                elif reason:
                    why = f"MoE experts in a layout hybridfp does not convert: {reason}"
                elif type(m) is nn.Linear:
                    why = "an nn.Linear not converted (hybridfp.convert converts it)"
                elif isinstance(m, nn.Linear):
                    why = f"{type(m).__name__} subclasses nn.Linear; convert replaces exact nn.Linear modules only"
                else:
                    why = f"a Parameter of {type(m).__name__}, a module hybridfp does not convert"
            out.append(UnconvertedWeight(full, tuple(p.shape), why, deliberate))
    return out


def _keep_extra_state_out_of_save_pretrained(model: nn.Module) -> None:
    """transformers' ``save_pretrained`` writes tensors only: the hybridfp modules' quantizer
    state (``_extra_state``, a dict) goes in its list of keys not to save, so the checkpoint
    holds the same keys as the unconverted model's. Each hybridfp module's own state-dict hook
    (``nn.quantizer_state``) does so for every enclosing ``PreTrainedModel`` whose
    ``state_dict()`` is taken (``convert(model.model)`` then ``model.save_pretrained``); the
    converted model's own set is filled now too (a ``state_dict`` passed to ``save_pretrained``)."""
    ignore = getattr(model, "_keys_to_ignore_on_save", None)
    if isinstance(ignore, set):
        ignore.update(k for k in model.state_dict(keep_vars=True) if k.endswith(EXTRA_STATE_SUFFIX))


def convert(model: nn.Module, module_filter: Optional[ModuleFilter] = None, *, lm_head: bool = False,
            strict: bool = False, recipe_filter: Optional[ModuleFilter] = None) -> nn.Module:
    """Run a model's matmuls through hybridfp, in place, and say which ones do not.

    - transformers-style fused MoE experts (3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj``
      [E, H, I] Parameters: Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, ...) run through two
      ``GroupedLinear`` that read the same Parameters (:func:`experts_to_grouped`; roles
      module_type "grouped_linear", names ``<experts>.gate_up_proj`` / ``<experts>.down_proj``);
      the model's router, gating and combine are kept. Only routed experts, called
      ``forward(hidden_states, top_k_index, top_k_weights)``, convert: modules with such
      Parameters called otherwise (shared experts) stay in high precision and are listed.
    - Every ``nn.Linear`` (exactly that type) becomes a ``hybridfp.Linear`` holding the same
      Parameters and the layer's hooks (:func:`hybridfp.nn.convert`); ModuleList-of-Linear
      experts so run one ``Linear`` per expert. A model that is itself an ``nn.Linear`` is
      replaced too: use the returned module.
    - The output projection (``get_output_embeddings()`` or a module named ``lm_head``) stays
      in high precision unless ``lm_head=True``; embeddings and norms are never converted.

    Then every other weight a matmul reads outside hybridfp is listed (name, shape, why) in one
    :class:`HighPrecisionWeightsWarning`, or refused with ``strict=True``. Parameters, their
    objects and the state-dict keys of the Parameters are unchanged (optimizers built before
    keep working; transformers' ``save_pretrained`` writes the unconverted model's keys, also
    where only a part of the model was converted: ``convert(model.model)``). Every decision
    (``module_filter``'s calls, the checks that may refuse a module) is made before the model
    changes: an error leaves it unconverted (``strict`` raises after the conversion).

    Parameters
    ----------
    model:
        The model, converted in place.
    module_filter:
        ``(qualified_name, module) -> bool``: which ``nn.Linear`` layers and experts modules to
        convert; None: all of them. It is called on those modules only (never on a
        convolution or another module). The weights of those it refuses are left out on
        purpose (neither listed nor refused by ``strict``), experts modules convert would not
        take (shared experts, a transposed layout) included.
    lm_head:
        Convert the output projection too.
    strict:
        Raise instead of warning when a weight stays outside hybridfp.
    recipe_filter:
        The former name of ``module_filter`` (the same argument).

    Returns
    -------
    nn.Module
        ``model``; where ``model`` is itself an ``nn.Linear`` (and not the output projection or
        refused by the filter), its new ``hybridfp.Linear``.

    Raises
    ------
    TypeError
        Both ``module_filter`` and ``recipe_filter`` given, or a filter that is not callable.
    ValueError
        ``strict=True`` and weights a matmul reads outside hybridfp remain (listed); an
        ``nn.Linear`` whose replacement would drop something (an accelerate hook, a legacy
        backward hook, weight_norm: :func:`hybridfp.nn.convert`) or experts with a
        ``config._experts_implementation`` hybridfp does not follow (nothing converted then).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    >>> w = model[0].weight
    >>> model = hf.convert(model, module_filter=lambda name, m: name != "2")
    >>> type(model[0]).__module__, type(model[2]).__module__, model[0].weight is w
    ('hybridfp.nn.linear', 'torch.nn.modules.linear', True)
    """
    if recipe_filter is not None:
        if module_filter is not None:
            raise TypeError("convert: pass module_filter only (recipe_filter is its former name), not both.")
        module_filter = recipe_filter
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"convert: module_filter must be a callable (qualified_name, module) -> bool; got "
                        f"{type(module_filter).__name__}.")
    head = _output_projection(model)

    def accept(name: str, m: nn.Module) -> bool:
        if m is head and not lm_head:
            return False
        return module_filter is None or bool(module_filter(name, m))

    # every decision first (the filter's calls, the checks that may refuse), then the changes:
    # a filter or a check that raises leaves the model as it was
    experts = [(name, m) for name, m in model.named_modules()
               if "hybridfp_up" not in m._modules and fused_experts_layout(m)[0] is not None and accept(name, m)]
    for name, m in experts:
        check_experts_to_grouped(m, name)
    linears = _linear_targets(model, accept)
    for name, m in experts:
        experts_to_grouped(m, name)
    model = set_names(_replace_linears(model, linears))
    _keep_extra_state_out_of_save_pretrained(model)
    left = [w for w in unconverted_weights(model, module_filter, lm_head=lm_head) if not w.deliberate]
    if left:
        listing = "\n".join(f"  {w.name} {list(w.shape)}: {w.why}" for w in left)
        message = (f"hybridfp.convert: {len(left)} weight(s) are still read by matmuls in high precision, "
                   f"outside hybridfp:\n{listing}")
        if strict:
            raise ValueError(message + "\nConvert those modules, leave nn.Linear layers and experts modules "
                             "out with module_filter, or call convert without strict=True.")
        warnings.warn(HighPrecisionWeightsWarning(message), stacklevel=2)
    return model
