"""Hugging Face transformers' fused MoE experts run through ``GroupedLinear``.

transformers (5.x) holds a layer's routed experts as two 3-D Parameters on one module:
``gate_up_proj`` [E, 2I, H] (gate rows first, then up rows) and ``down_proj`` [E, H, I], called
as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` by the MoE block
after the model's own router. :func:`experts_to_grouped` keeps that module (its class, its
Parameters, its state-dict keys, its activation) and gives it two ``GroupedLinear`` children
that *borrow* the Parameters (``single_parameter`` layout, [E, out, in]; they own none), and a
forward that groups the token-expert pairs by expert (ours), runs the gate-up GEMMs, the
model's own gating (``_apply_gate`` or ``act_fn(gate) * up``), the down GEMMs, and weights and
combines the rows as the model's configured experts implementation does (``index_add_`` in
expert order for "eager", the per-token sum over the top-k slots for "grouped_mm" /
"batched_mm"). Nothing here imports transformers: the layout is recognised by its attributes,
and a module is taken for routed experts only when its forward is called as theirs is; others
with 3-D ``up_proj`` / ``down_proj`` Parameters (shared experts that every token runs, called
``forward(hidden_states, gammas)``) stay as they are.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..moe import GroupedLinear

#: The combine of each transformers experts implementation: "index_add" (the module's own
#: per-expert loop) or "sum" (transformers' grouped / batched kernels: a per-token sum over k).
_COMBINE = {None: "index_add", "eager": "index_add", "grouped_mm": "sum", "batched_mm": "sum"}


@dataclass(frozen=True)
class FusedExpertsLayout:
    """What :func:`fused_experts_layout` read off an experts module.

    Parameters
    ----------
    num_experts, hidden, intermediate:
        E, H and I of ``gate_up_proj`` [E, 2I, H] (or ``up_proj`` [E, I, H]) and ``down_proj``
        [E, H, I].
    gated:
        ``gate_up_proj`` (gate and up rows, then the model's gating) rather than ``up_proj``.
    bias:
        The experts have ``*_bias`` Parameters [E, out].
    """

    num_experts: int
    hidden: int
    intermediate: int
    gated: bool
    bias: bool


def _param(module: nn.Module, name: str) -> Optional[nn.Parameter]:
    p = module._parameters.get(name)
    return p if isinstance(p, nn.Parameter) else None


def routed_experts_call(module: nn.Module) -> str:
    """Why ``module`` is not called as routed experts are, or "" when it is.

    transformers' routed experts run ``forward(hidden_states, top_k_index, top_k_weights)``
    (the signature :func:`experts_to_grouped` gives the module); other modules with 3-D
    ``up_proj`` / ``down_proj`` Parameters, such as shared experts that every token runs
    (``forward(hidden_states, gammas)``), compute something else and stay as they are.

    Parameters
    ----------
    module:
        Any module.

    Returns
    -------
    str
        "" when ``module.forward`` takes three positional arguments (or any number, or its
        signature cannot be read); else the reason, naming the signature.

    Example
    -------
    >>> import torch
    >>> from hybridfp.integration.transformers_moe import routed_experts_call
    >>> class Shared(torch.nn.Module):
    ...     def forward(self, hidden_states, gammas):
    ...         return hidden_states
    >>> routed_experts_call(Shared()).split(";")[0]
    "Shared.forward(hidden_states, gammas) is not the routed experts' forward(hidden_states, top_k_index, top_k_weights)"
    """
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a forward without a readable signature: nothing to go by
        return ""
    try:
        signature.bind(None, None, None)
    except TypeError:
        return (f"{type(module).__name__}.forward{signature} is not the routed experts' "
                "forward(hidden_states, top_k_index, top_k_weights); hybridfp converts only modules "
                "called that way (others, such as shared experts that every token runs, stay in high "
                "precision)")
    return ""


def fused_experts_layout(module: nn.Module) -> tuple[Optional[FusedExpertsLayout], str]:
    """Whether ``module`` holds transformers-style fused routed experts, and why not.

    Parameters
    ----------
    module:
        Any module.

    Returns
    -------
    tuple
        ``(layout, "")`` for a convertible experts module; ``(None, reason)`` for one that holds
        3-D ``gate_up_proj`` / ``up_proj`` and ``down_proj`` Parameters that hybridfp does not
        convert (the reason names why, checked in this order: a layout it does not take, a
        forward that is not called as routed experts' is (:func:`routed_experts_call`), another
        3-D Parameter the converted forward would not read, ...); ``(None, "")`` for any other
        module.

    Example
    -------
    >>> import torch
    >>> from hybridfp.integration.transformers_moe import fused_experts_layout
    >>> m = torch.nn.Module()
    >>> m.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 16, 8))
    >>> m.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 8))
    >>> m.act_fn = torch.nn.SiLU()
    >>> fused_experts_layout(m)[0]
    FusedExpertsLayout(num_experts=4, hidden=8, intermediate=8, gated=True, bias=False)
    """
    down = _param(module, "down_proj")
    gated = _param(module, "gate_up_proj") is not None
    up = _param(module, "gate_up_proj" if gated else "up_proj")
    if down is None or up is None or down.dim() != 3 or up.dim() != 3:
        return None, ""
    # the layout first: routed experts stored transposed and called another way (Llama4's,
    # forward(hidden_states)) are reported by the layout that keeps them out, not taken for
    # another kind of module by their call
    e, h, i = down.shape
    if getattr(module, "is_transposed", False) or tuple(up.shape) != (e, (2 if gated else 1) * i, h):
        return None, (f"experts weights {tuple(up.shape)} / {tuple(down.shape)} are not [E, out, in] "
                      "(a transposed layout): hybridfp converts gate_up_proj [E, 2I, H] with "
                      "down_proj [E, H, I]")
    if gated and not getattr(module, "is_concatenated", True):
        return None, "gate and up rows are interleaved; hybridfp converts the concatenated [gate; up] layout"
    not_routed = routed_experts_call(module)
    if not_routed:
        return None, not_routed
    # a Parameter the converted forward would not read (a separate 3-D gate_proj beside up_proj)
    # would silently drop out of the computation
    read = ("gate_up_proj" if gated else "up_proj", "down_proj")
    unread = sorted(n for n, p in module._parameters.items() if p is not None and p.dim() == 3 and n not in read)
    if unread:
        return None, (f"it also holds the 3-D Parameter(s) {unread}, which the converted forward would not "
                      f"read; hybridfp converts {read[0]} with down_proj only")
    if getattr(module, "has_post_expert_norm", False) and not isinstance(getattr(module, "post_expert_norm", None),
                                                                        nn.Module):
        return None, "has_post_expert_norm without a post_expert_norm module"
    if not callable(getattr(module, "_apply_gate", None)) and not callable(getattr(module, "act_fn", None)):
        return None, "no act_fn / _apply_gate to apply between the two GEMMs"
    num = getattr(module, "num_experts", e)
    if num != e:
        return None, f"num_experts={num} but the weights hold {e} experts"
    names = ("gate_up_proj_bias" if gated else "up_proj_bias", "down_proj_bias")
    biases = [_param(module, n) for n in names]
    if any(b is not None for b in biases):
        if any(b is None for b in biases) or tuple(biases[0].shape) != tuple(up.shape[:2]) \
                or tuple(biases[1].shape) != (e, h):
            return None, f"expert biases {names} missing or not [E, out]"
    return FusedExpertsLayout(e, h, i, gated, biases[0] is not None), ""


class _BorrowedExperts(GroupedLinear):
    """A ``GroupedLinear`` (``single_parameter`` layout) whose weight and bias are Parameters of
    another module, read at each use: a move, ``load_state_dict(assign=True)`` or FSDP2 that
    replaces the owner's Parameter is followed, and the owner alone registers, saves and loads
    them (state-dict keys unchanged)."""

    def __init__(self, owner: nn.Module, weight: str, bias: Optional[str], name: str) -> None:
        w = owner._parameters[weight]
        super().__init__(w.shape[0], w.shape[2], w.shape[1], bias=bias is not None, params_dtype=w.dtype,
                         device="meta", name=name, single_parameter=True)
        # the owner's Parameters are read at each use (``__getattr__``), never registered here
        self._parameters.pop("weight")
        self._parameters.pop("bias", None)
        # a plain attribute, not a submodule: the owner is this module's parent
        object.__setattr__(self, "_owner", owner)
        self._borrowed = {"weight": weight, "bias": bias}

    def __getattr__(self, attr: str):
        """``weight`` / ``bias``: the owner's Parameter ([E, out, in] / [E, out]; bias None
        without one); anything else as ``nn.Module`` finds it."""
        borrowed = self.__dict__.get("_borrowed")
        if borrowed is not None and attr in borrowed:
            return None if borrowed[attr] is None else self.__dict__["_owner"]._parameters[borrowed[attr]]
        return super().__getattr__(attr)


def _combine_of(module: nn.Module, who: str) -> str:
    """How ``module``'s configured experts implementation combines the rows (``_COMBINE``)."""
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl not in _COMBINE:
        raise ValueError(f"{who}: config._experts_implementation={impl!r} is not one hybridfp follows "
                         f"({sorted(k for k in _COMBINE if k)}); set it to 'eager' or 'grouped_mm' for "
                         "the converted experts.")
    return _COMBINE[impl]


def _grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward through ``GroupedLinear``: the same arguments and result as the
    transformers experts module it replaces (``self`` is that module)."""
    who = f"experts {self.hybridfp_up.name.rsplit('.', 1)[0]}"
    if getattr(self, "_is_expert_parallel", False):
        # transformers' expert parallelism marks other ranks' experts with a sentinel index
        raise NotImplementedError(f"{who}: converted experts do not run under transformers' expert "
                                  "parallelism; use hybridfp.ExpertParallel, or leave these experts "
                                  "out of convert (module_filter).")
    num_tokens, k = top_k_index.shape
    combine = _combine_of(self, who)
    expert_ids = top_k_index.reshape(-1)
    # group the (token, slot) pairs by expert; stable: within an expert, token order
    _, perm = torch.sort(expert_ids, stable=True)
    rows = perm // k
    m_splits = torch.bincount(expert_ids, minlength=self.num_experts)
    x = hidden_states[rows]
    h = self.hybridfp_up(x, m_splits)
    if not self.hybridfp_layout.gated:
        h = self.act_fn(h)
    elif callable(getattr(self, "_apply_gate", None)):  # the model's own gating (transformers 5.x)
        h = self._apply_gate(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
    y = self.hybridfp_down(h, m_splits)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    weights = top_k_weights.reshape(-1)[perm]
    if combine == "sum":  # transformers' grouped / batched kernels: back to (token, slot) order
        y = y * weights.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return y[inv].view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)
    # the module's own loop: each expert's rows weighted, then added in expert order
    y = y * weights[:, None]
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, rows, y.to(out.dtype))


class _GroupedExpertsForward:
    """A converted experts module's ``forward`` (an instance attribute): calls
    :func:`_grouped_experts_forward` on the module. An object of a module-level class, not a
    bound method, so the module pickles (``torch.save(model)``, multiprocessing's spawn: a bound
    method pickles as a lookup of its function's name on the module, which its class lacks) and
    deep-copies with the copy's forward bound to the copy; its signature is the experts' own
    ``(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        return _grouped_experts_forward(self.module, hidden_states, top_k_index, top_k_weights)

    def __repr__(self) -> str:
        return f"<hybridfp grouped forward of {type(self.module).__name__}>"


def check_experts_to_grouped(module: nn.Module, name: str = "") -> FusedExpertsLayout:
    """What :func:`experts_to_grouped` checks before it changes anything (``hybridfp.convert``
    checks every experts module first, so one it refuses leaves the model unchanged).

    Parameters
    ----------
    module, name:
        As for :func:`experts_to_grouped`.

    Returns
    -------
    FusedExpertsLayout
        The module's layout.

    Raises
    ------
    ValueError
        As :func:`experts_to_grouped` raises.

    Example
    -------
    >>> import torch
    >>> from hybridfp.integration.transformers_moe import check_experts_to_grouped
    >>> m = torch.nn.Module()
    >>> m.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 16, 8))
    >>> m.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 8))
    >>> m.act_fn = torch.nn.SiLU()
    >>> check_experts_to_grouped(m).num_experts
    4
    """
    who = f"experts_to_grouped({name or type(module).__name__})"
    layout, why = fused_experts_layout(module)
    if layout is None:
        raise ValueError(f"{who}: {why or 'no 3-D gate_up_proj / up_proj and down_proj Parameters'}.")
    _combine_of(module, who)
    return layout


def experts_to_grouped(module: nn.Module, name: str = "") -> nn.Module:
    """Run a transformers fused-experts module's GEMMs through ``GroupedLinear``, in place.

    The module keeps its class, Parameters (the same objects: optimizers and checkpoints see no
    change), state-dict keys, activation and gating; it gains two parameterless children
    ``hybridfp_up`` and ``hybridfp_down`` (QuantizerRole module_type "grouped_linear", names
    ``<name>.gate_up_proj`` (``<name>.up_proj`` without a gate) and ``<name>.down_proj``) and a
    forward that groups the token-expert pairs by expert and combines the rows as the model's
    experts implementation does.

    Parameters
    ----------
    module:
        A module :func:`fused_experts_layout` accepts (e.g. transformers' ``Qwen3MoeExperts``,
        ``MixtralExperts``, ``Qwen2MoeExperts``, ``DeepseekV3NaiveMoe``).
    name:
        Its qualified name in the model (in the quantizer roles and errors).

    Returns
    -------
    nn.Module
        ``module``.

    Raises
    ------
    ValueError
        ``module`` is not a fused experts module hybridfp converts (the message says why), or a
        ``config._experts_implementation`` whose combine hybridfp does not know.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.integration.transformers_moe import experts_to_grouped
    >>> m = torch.nn.Module()
    >>> m.num_experts = 4
    >>> m.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 8))
    >>> m.down_proj = torch.nn.Parameter(torch.randn(4, 8, 8))
    >>> m.act_fn = torch.nn.SiLU()
    >>> m = experts_to_grouped(m, "layers.0.mlp.experts")
    >>> out = m(torch.randn(5, 8), torch.randint(0, 4, (5, 2)), torch.rand(5, 2))
    >>> out.shape, m.hybridfp_up.name, m.hybridfp_up.weight is m.gate_up_proj
    (torch.Size([5, 8]), 'layers.0.mlp.experts.gate_up_proj', True)
    """
    layout = check_experts_to_grouped(module, name)
    if not hasattr(module, "num_experts"):
        module.num_experts = layout.num_experts
    up = "gate_up_proj" if layout.gated else "up_proj"
    prefix = f"{name}." if name else ""
    module.hybridfp_layout = layout
    module.hybridfp_up = _BorrowedExperts(module, up, f"{up}_bias" if layout.bias else None, prefix + up)
    module.hybridfp_down = _BorrowedExperts(module, "down_proj", "down_proj_bias" if layout.bias else None,
                                            prefix + "down_proj")
    module.forward = _GroupedExpertsForward(module)
    return module
