"""torchtitan's model-config tree, converted to hybridfp before the model is built.

torchtitan (>= 0.3.0) builds every model from a tree of ``Config`` dataclasses, and its model
converters (float8, MX, LoRA) rewrite that tree before ``build()``. :func:`convert_model_config`
does the same for hybridfp:

- each selected ``Linear.Config`` becomes the config of a hybridfp ``Linear`` that is also a
  torchtitan ``Module`` (its ``param_init`` / ``sharding_config`` kept, so ``init_states``
  initializes it as before; parameter names ``weight`` / ``bias`` unchanged);
- each selected ``GroupedExperts.Config`` becomes a ``GroupedExperts`` whose three expert GEMMs
  run through :class:`hybridfp.GroupedLinear` (one ``[E, out, in]`` weight each) on the very
  Parameters ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` torchtitan created (same names, same objects:
  optimizers, checkpoints and torchtitan's state-dict adapters see no change);
- the root config becomes a subclass whose model runs its ``forward`` inside
  ``hybridfp.autocast(recipe)`` (a pipeline stage is a copy of the model: each stage does too).

Under torchtitan's tensor parallelism a converted ``Linear`` runs hybridfp's own parallel style
(:mod:`hybridfp.integration.torchtitan_parallel`); under its expert parallelism the converted
experts run ``GroupedLinear`` on their local shard (whole experts). Both need torchtitan's
``partial_dtensor`` backend; TP of the experts themselves is refused.

Checkpoints: torchtitan's checkpointer (``ModelWrapper``, its HF state-dict adapters) takes
model state dicts of tensors only. A converted module's quantizer state (its ``_extra_state``
entry) is left out of ``state_dict`` when it holds nothing to restore (every recipe but delayed
scaling), and loading without it is fine (``strict=True`` too). Delayed scaling's state (amax
histories, scales) is a dict: kept for ``torch.save`` as before, but torchtitan's checkpointer
stops on it with :class:`StatefulQuantizerCheckpointError` (:class:`QuantizerStateDict`).

torchtitan is imported only when these functions run, never when hybridfp is imported. The
converter torchtitan's job config names is ``hybridfp.torchtitan.HybridFPConverter``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..moe import GroupedLinear
from ..nn.base import SLOTS
from ..nn.linear import Linear as HybridLinear
from ..nn.quantizer_state import holds_quantizer_state
from ..recipes import QuantizerRole, Recipe, autocast

#: Module fqns kept in high precision unless the caller says otherwise: the output projection
#: (torchtitan names it ``lm_head``; older models ``output``) and the MoE routers' gates.
DEFAULT_SKIP: tuple[str, ...] = ("lm_head", "output", "router")

#: GroupedExperts' Parameters, their hybridfp GroupedLinear names and (in, out) sizes' keys.
_EXPERT_WEIGHTS = ("w1_EFD", "w3_EFD", "w2_EDF")


def fqn_matches(fqn: str, pattern: str) -> bool:
    """Whether ``pattern``'s dotted parts appear as a contiguous run of ``fqn``'s parts.

    ``"lm_head"`` matches ``"lm_head"``; ``"router"`` matches ``"layers.3.moe.router.gate"``;
    ``"layers.0"`` matches ``"layers.0.attention.wo"`` but not ``"layers.10.attention.wo"``
    (a plain substring test would).

    Parameters
    ----------
    fqn:
        A module's qualified name.
    pattern:
        A name or dotted run of names.

    Returns
    -------
    bool

    Example
    -------
    >>> from hybridfp.integration.torchtitan import fqn_matches
    >>> fqn_matches("layers.3.moe.router.gate", "router"), fqn_matches("layers.10.wo", "layers.1")
    (True, False)
    """
    parts, want = fqn.split("."), pattern.split(".")
    return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


@dataclass(frozen=True)
class ModelConfigConversion:
    """What :func:`convert_model_config` did.

    Attributes
    ----------
    linears, experts:
        Fqns of the ``Linear`` / ``GroupedExperts`` configs now built as hybridfp modules.
    skipped:
        ``fqn -> why`` for those kept in high precision (a filter, an unsupported subclass).
    """

    linears: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    skipped: dict = field(default_factory=dict)


class StatefulQuantizerCheckpointError(AttributeError):
    """torchtitan's checkpointer read a converted module's quantizer state as a tensor: the
    state of a recipe that keeps state (delayed scaling), which is no tensor.

    An ``AttributeError`` (what reading a tensor attribute of a dict raises), so that code
    asking ``hasattr(value, "shape")`` still sees a non-tensor.
    """


class QuantizerStateDict(dict):
    """A converted module's ``_extra_state`` entry that holds quantizer state (delayed
    scaling's amax histories and scales): the dict hybridfp's ``get_extra_state`` returns, for
    ``torch.save`` / ``load_state_dict`` as before (it pickles as an ``OrderedDict``, so
    ``torch.load(weights_only=True)`` takes it), but reading the tensor attributes torchtitan's
    checkpointer reads of every state-dict value (``shape``, ``dtype``, ``device``) raises
    :class:`StatefulQuantizerCheckpointError`, naming the module and what to do.

    Parameters
    ----------
    state:
        The module's quantizer state.
    who:
        The module, for the error.

    Example
    -------
    >>> from hybridfp.integration.torchtitan import QuantizerStateDict
    >>> d = QuantizerStateDict({"version": 1}, "layers.0.attention.wq")
    >>> d["version"], hasattr(d, "shape")
    (1, False)
    """

    __slots__ = ("who",)

    def __init__(self, state: dict, who: str) -> None:
        super().__init__(state)
        self.who = who

    def __reduce__(self) -> tuple:
        # a plain mapping in pickles (allowed by torch.load(weights_only=True)) and copies
        return (OrderedDict, (), None, None, iter(self.items()))

    def _refuse(self, attr: str) -> Any:
        raise StatefulQuantizerCheckpointError(
            f"hybridfp torchtitan converter: {self.who}: its state-dict entry '_extra_state' holds "
            "quantizer state (delayed scaling's amax history and scale), a dict, not a tensor (read: "
            f"{attr!r}); torchtitan's checkpointer takes tensors only (its ModelWrapper, behind every "
            "save, resume and HF load), so it cannot save or load this state. Train under torchtitan "
            "with a recipe that keeps no quantizer state (fp8 = current scaling, fp8-block, mxfp8, "
            "nvfp4, ...), whose checkpoints hold tensors only, or save this model yourself with "
            "torch.save(model.state_dict()), which carries the state.")

    shape = property(lambda self: self._refuse("shape"))
    dtype = property(lambda self: self._refuse("dtype"))
    device = property(lambda self: self._refuse("device"))


def _tensor_state_dict(destination: dict, prefix: str, keeps_state: bool, who: str,
                       holds: Callable[[Any], bool] = holds_quantizer_state) -> None:
    """Make a converted module's ``_extra_state`` entry of ``destination`` fit torchtitan's
    checkpointer: dropped when it holds no quantizer state (``holds(entry)`` False) and the
    recipe keeps none (``keeps_state``), else a :class:`QuantizerStateDict`."""
    key = prefix + "_extra_state"
    if key not in destination:
        return
    state = destination[key]
    if keeps_state or holds(state):
        destination[key] = QuantizerStateDict(state, who)
    else:
        del destination[key]


def _recipe_keeps_state(recipe: Recipe, module_type: str, names: Sequence[str]) -> bool:
    """Whether a quantizer ``recipe`` makes for these modules' slots keeps state (delayed
    scaling): known before the modules build theirs, so that their state-dict entry is there
    from the first ``state_dict`` on (torchtitan's checkpointer caches the keys at its start)."""
    return any(recipe.quantizer(QuantizerRole(module_type, slot, name)).get_state()
               for name in names for slot in SLOTS)


def _tt() -> Any:
    """torchtitan's classes this module converts (imported on first use)."""
    try:
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import GroupedExperts
        from torchtitan.protocols.module import Module
    except ImportError as e:  # pragma: no cover - the tests skip without torchtitan
        raise ImportError("hybridfp's torchtitan converter needs torchtitan >= 0.3.0: "
                          "pip install 'hybridfp[torchtitan]'") from e
    return Linear, GroupedExperts, Module


def _name(cls: type, name: str) -> None:
    """Readable names for a class made in a function and its nested Config (logs, reprs)."""
    cls.__name__ = cls.__qualname__ = name
    cls.Config.__qualname__ = f"{name}.Config"  # type: ignore[attr-defined]


def _refuse_sharded(who: str, parallel_dims: Any, what: Sequence[str]) -> None:
    """Refuse torchtitan parallelisms whose shards a module cannot read (never a silent
    wrong result): ``what`` names ParallelDims' ``<x>_enabled`` properties."""
    on = [w for w in what if getattr(parallel_dims, f"{w}_enabled", False)]
    if on:
        raise NotImplementedError(
            f"{who}: torchtitan's {' / '.join(w.upper() for w in on)} sharding is not supported by "
            "hybridfp's torchtitan converter yet (each expert's GEMMs would be split over ranks; "
            "FSDP2, EP and the dense layers' TP are supported). Set those degrees to 1, or keep "
            "these modules in high precision with the converter's filter_fqns (or experts=False).")


@functools.lru_cache(maxsize=None)
def hybrid_linear_class() -> type:
    """The hybridfp ``Linear`` that is also a torchtitan ``Module`` (built once).

    Returns
    -------
    type
        ``HybridFPLinear``; its ``Config`` extends torchtitan's ``Linear.Config`` with
        ``hybridfp_name`` (the module's fqn, used in quantizer roles).
    """
    TTLinear, _, Module = _tt()

    class HybridFPLinear(HybridLinear, Module):
        """hybridfp ``Linear`` built from torchtitan's ``Linear.Config``."""

        @dataclass(kw_only=True, slots=True)
        class Config(TTLinear.Config):
            hybridfp_name: str = ""
            hybridfp_keeps_state: bool = False
            """The converter's recipe keeps quantizer state (delayed scaling)."""

        def __init__(self, config: "HybridFPLinear.Config") -> None:
            HybridLinear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                                  name=config.hybridfp_name)
            self._hybridfp_keeps_state = config.hybridfp_keeps_state

        def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
            # tensors only for torchtitan's checkpointer (module docstring); a missing entry
            # loads fine (QuantizerStateMixin._load_from_state_dict)
            super()._save_to_state_dict(destination, prefix, keep_vars)
            _tensor_state_dict(destination, prefix, self._hybridfp_keeps_state, self._who())

        def parallelize(self, parallel_dims: Any) -> None:
            # TP: hybridfp's own styles from the stock sharding_config (torchtitan_parallel.py)
            from .torchtitan_parallel import parallelize_linear
            parallelize_linear(self, parallel_dims, Module)

    _name(HybridFPLinear, "HybridFPLinear")
    return HybridFPLinear


def _local(t: torch.Tensor, who: str, expert_parallel: bool) -> torch.Tensor:
    """The rank's experts under torchtitan's expert parallelism (``Shard(0)`` on the ``ep``
    mesh: whole experts, so each runs on its own whole weight); any other DTensor refused."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        if expert_parallel:
            return t.to_local()  # autograd: the gradient reaches the DTensor Parameter
        raise NotImplementedError(
            f"{who}: the expert weights are DTensors placed {t.placements} outside torchtitan's "
            "expert parallelism; hybridfp's torchtitan converter runs experts on whole experts "
            "only (FSDP2, EP, pipeline parallelism), or keep them in high precision (experts=False).")
    return t


@functools.lru_cache(maxsize=None)
def hybrid_experts_class(parent: type) -> type:
    """A subclass of torchtitan's ``GroupedExperts`` (or of ``parent``, one of its subclasses
    with the same three weights) whose GEMMs run through :class:`hybridfp.GroupedLinear`.

    Parameters
    ----------
    parent:
        ``GroupedExperts`` itself (other subclasses are refused by the converter).

    Returns
    -------
    type
        ``HybridFP<parent>``; its ``Config`` adds ``hybridfp_name`` (the module's fqn).
    """
    _, _, Module = _tt()

    class HybridFPGroupedExperts(parent):  # type: ignore[misc, valid-type]
        """torchtitan's experts (the same Parameters) on hybridfp GroupedLinear GEMMs.

        The three GroupedLinear are kept outside the module tree (in a plain list): their
        weights are this module's own Parameters, bound at each forward, so ``state_dict``,
        FSDP2 and the optimizer see only ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` (and the
        quantizers' state as this module's ``_extra_state``).
        """

        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):  # type: ignore[name-defined, misc]
            hybridfp_name: str = ""
            hybridfp_keeps_state: bool = False
            """The converter's recipe keeps quantizer state (delayed scaling)."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self._hybridfp_keeps_state = config.hybridfp_keeps_state
            self._hybridfp_name = config.hybridfp_name
            E, F_, D = config.num_experts, config.hidden_dim, config.dim
            sizes = {"w1_EFD": (D, F_), "w3_EFD": (D, F_), "w2_EDF": (F_, D)}
            prefix = f"{config.hybridfp_name}." if config.hybridfp_name else ""
            # A plain list: not submodules (no second state_dict entry for the same weights).
            self._hybridfp_experts = [
                GroupedLinear(E, *sizes[w], bias=False, device="meta", single_parameter=True,
                              name=prefix + w) for w in _EXPERT_WEIGHTS]

        def parallelize(self, parallel_dims: Any) -> None:
            who = f"hybridfp experts {self._hybridfp_experts[0].name!r}"
            # expert TP splits each expert's GEMMs (and their scales): not supported
            _refuse_sharded(who, parallel_dims, ("tp", "etp"))
            ep = bool(getattr(parallel_dims, "ep_enabled", False))
            if ep:
                from .torchtitan_parallel import refuse_backend
                refuse_backend(who, parallel_dims, "EP")
            Module.parallelize(self, parallel_dims)
            if ep:  # the weights are now Shard(0) on the ep mesh: this rank's experts only
                self._hybridfp_expert_parallel = True
                local = self.w1_EFD.to_local().shape[0]
                self._hybridfp_experts = [
                    GroupedLinear(local, gl.in_features, gl.out_features, bias=False, device="meta",
                                  single_parameter=True, name=gl.name) for gl in self._hybridfp_experts]

        def hybridfp_grouped_linears(self) -> list[GroupedLinear]:
            """The three GroupedLinear (w1, w3, w2), bound to this module's current Parameters
            (under expert parallelism: this rank's experts, the local tensors of its shards)."""
            ep = getattr(self, "_hybridfp_expert_parallel", False)
            for gl, w in zip(self._hybridfp_experts, _EXPERT_WEIGHTS):
                p = _local(getattr(self, w), gl.name, ep)
                if gl.weight is not p:
                    # the same Parameter object (re-binds after FSDP2 / to_empty), or the EP
                    # shard's local tensor (no Parameter: set past Module.__setattr__'s check)
                    gl._parameters["weight"] = p
            return self._hybridfp_experts

        def get_extra_state(self) -> dict:
            """The three GroupedLinear's quantizer state (delayed scaling's amax histories),
            by weight name: the checkpoint carries it as hybridfp ``Linear``'s carries its own.

            Raises
            ------
            NotImplementedError
                Under expert parallelism with a recipe that keeps state: each rank holds its own
                experts' histories under one key, which a checkpoint would keep one rank's of.
            """
            if getattr(self, "_hybridfp_expert_parallel", False) and any(
                    gl.stateful_quantizers() for gl in self._hybridfp_experts):
                raise NotImplementedError(
                    f"{self._hybridfp_experts[0].name}: saving the experts' quantizer state (delayed "
                    "scaling's amax histories) under torchtitan's expert parallelism is not supported: "
                    "each rank holds its own experts' state under one key. Use a recipe without state "
                    "(current scaling, MXFP8, NVFP4) with EP, or train without EP.")
            return {w: gl.get_extra_state() for gl, w in zip(self._hybridfp_experts, _EXPERT_WEIGHTS)}

        def set_extra_state(self, state: Any) -> None:
            if not isinstance(state, dict) or set(state) != set(_EXPERT_WEIGHTS):
                raise ValueError(f"{self._hybridfp_experts[0].name}: the checkpoint's experts state "
                                 f"must map {list(_EXPERT_WEIGHTS)} to GroupedLinear states; got "
                                 f"{sorted(state) if isinstance(state, dict) else type(state).__name__}.")
            for gl, w in zip(self._hybridfp_experts, _EXPERT_WEIGHTS):
                gl.set_extra_state(state[w])

        def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
            # tensors only for torchtitan's checkpointer (module docstring)
            super()._save_to_state_dict(destination, prefix, keep_vars)
            _tensor_state_dict(destination, prefix, self._hybridfp_keeps_state,
                               f"{type(self).__name__} {self._hybridfp_name}".rstrip(),
                               lambda s: not isinstance(s, dict) or any(map(holds_quantizer_state, s.values())))

        def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                                  missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
            # a state dict without the quantizer state (left out when it holds none): the
            # experts' quantizers start fresh, as hybridfp Linear's do
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
            key = prefix + "_extra_state"
            if key not in state_dict and key in missing_keys:
                missing_keys.remove(key)

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            gl1, gl3, gl2 = self.hybridfp_grouped_linears()
            splits = num_tokens_per_expert_E
            h = F.silu(gl1(x_RD, splits)) * gl3(x_RD, splits)
            return gl2(h, splits).type_as(x_RD)

    _name(HybridFPGroupedExperts, f"HybridFP{parent.__name__}")
    return HybridFPGroupedExperts


@functools.lru_cache(maxsize=None)
def autocast_model_class(parent: type) -> type:
    """A subclass of the root model class ``parent`` whose ``forward`` runs inside
    ``hybridfp.autocast`` with the recipe its config holds.

    Parameters
    ----------
    parent:
        The torchtitan model class (``Llama3Model``, ``Qwen3Model``...).

    Returns
    -------
    type
        ``HybridFP<parent>``; its ``Config`` adds ``hybridfp_recipe`` (a ``hybridfp.Recipe``).
    """

    class HybridFPModel(parent):  # type: ignore[misc, valid-type]
        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):  # type: ignore[name-defined, misc]
            hybridfp_recipe: Optional[Recipe] = None

            def to_dict(self) -> dict:  # the recipe is logged by name, not as an object
                d = parent.Config.to_dict(self)
                d["hybridfp_recipe"] = type(self.hybridfp_recipe).__name__
                return d

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.hybridfp_recipe = config.hybridfp_recipe

        @functools.wraps(parent.forward)  # torchtitan reads forward's signature
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with autocast(recipe=self.hybridfp_recipe):
                return parent.forward(self, *args, **kwargs)

    _name(HybridFPModel, f"HybridFP{parent.__name__}")
    return HybridFPModel


def _replace(parent: Any, attr: Any, new: Any) -> None:
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)


def _copy(cfg: Any, cls: type, **extra: Any) -> Any:
    return cls(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init}, **extra)


def convert_model_config(model_config: Any, recipe: Recipe, *, fqns: Sequence[str] = (),
                         filter_fqns: Sequence[str] = DEFAULT_SKIP, experts: bool = True,
                         strict: bool = False) -> tuple[Any, ModelConfigConversion]:
    """Rewrite a torchtitan model config so the built model trains with hybridfp.

    Parameters
    ----------
    model_config:
        A torchtitan ``BaseModel.Config`` (``model_registry(flavor).model``); its nested
        configs are replaced in place.
    recipe:
        The hybridfp recipe the model's forward runs under.
    fqns:
        Convert only modules whose fqn matches one of these (:func:`fqn_matches`); empty: all.
    filter_fqns:
        Keep modules matching any of these in high precision (default :data:`DEFAULT_SKIP`:
        ``lm_head`` / ``output`` and the routers).
    experts:
        Run ``GroupedExperts`` through ``hybridfp.GroupedLinear`` (False: keep them as they are).
    strict:
        Raise instead of warning when a ``Linear`` / ``GroupedExperts`` subclass the converter
        does not know would stay in high precision.

    Returns
    -------
    (config, ModelConfigConversion)
        The new root config (a subclass of ``model_config``'s class) and what was converted.

    Raises
    ------
    TypeError
        ``recipe`` is not a ``hybridfp.Recipe``; ``model_config`` is no torchtitan model config.
    ValueError
        ``strict`` and an unknown ``Linear`` / ``GroupedExperts`` subclass is not filtered out;
        ``model_config`` converted already.
    """
    import warnings

    if not isinstance(recipe, Recipe):
        raise TypeError(f"convert_model_config: recipe must be a hybridfp.Recipe; got "
                        f"{type(recipe).__name__}.")
    TTLinear, GroupedExperts, _ = _tt()
    if not hasattr(model_config, "traverse") or not hasattr(type(model_config), "_owner"):
        raise TypeError(f"convert_model_config: model_config must be a torchtitan model Config "
                        f"(model_registry(flavor).model); got {type(model_config).__name__}.")
    if hasattr(model_config, "hybridfp_recipe"):
        raise ValueError("convert_model_config: model_config is converted to hybridfp already (list "
                         "HybridFPConverter once in model_registry's converters).")
    linears, convert_experts, skipped, unknown = [], [], {}, []

    def selected(fqn: str) -> Optional[str]:
        if fqns and not any(fqn_matches(fqn, p) for p in fqns):
            return "not matched by fqns"
        hit = [p for p in filter_fqns if fqn_matches(fqn, p)]
        return f"filter_fqns {hit[0]!r}" if hit else None

    def convert_each(base: type, new_config: Any, done: list, keeps_state: Any,
                     off: Optional[str] = None) -> None:
        """Swap every config of exactly ``base`` (not filtered) for ``new_config(cfg)``;
        ``keeps_state(fqn)``: whether the recipe's quantizers for it keep state."""
        for fqn, cfg, parent, attr in list(model_config.traverse(base)):
            why = off or selected(fqn)
            if why is None and type(cfg) is not base:
                why = f"{type(cfg).__qualname__} is not torchtitan's plain {base.__qualname__}"
                unknown.append(f"{fqn} ({why})")
            if why is not None or parent is None:
                skipped[fqn] = why or "the root config"
                continue
            _replace(parent, attr, _copy(cfg, new_config(cfg), hybridfp_name=fqn,
                                         hybridfp_keeps_state=keeps_state(fqn)))
            done.append(fqn)

    lin_config = hybrid_linear_class().Config
    convert_each(TTLinear.Config, lambda cfg: lin_config, linears,
                 lambda fqn: _recipe_keeps_state(recipe, HybridLinear.module_type, [fqn]))
    convert_each(GroupedExperts.Config, lambda cfg: hybrid_experts_class(type(cfg)._owner).Config,
                 convert_experts,
                 lambda fqn: _recipe_keeps_state(recipe, GroupedLinear.module_type,
                                                 [f"{fqn}.{w}" for w in _EXPERT_WEIGHTS]),
                 None if experts else "experts=False")
    if unknown:
        msg = ("hybridfp torchtitan converter: these weights stay in high precision, their "
               "module type being unknown to it: " + "; ".join(unknown)
               + ". Name them in filter_fqns to keep them so knowingly.")
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    root_cls = autocast_model_class(type(model_config)._owner)
    root = _copy(model_config, root_cls.Config, hybridfp_recipe=recipe)
    return root, ModelConfigConversion(tuple(linears), tuple(convert_experts), skipped)


def hybridfp_weights(model: torch.nn.Module) -> dict[str, bool]:
    """Every parameter of 2 or more dims of a (converted) torchtitan model -> whether a
    hybridfp GEMM reads it.

    Embedding tables and the modules kept in high precision map to False.

    Parameters
    ----------
    model:
        A model built from a config :func:`convert_model_config` returned (or any model).

    Returns
    -------
    dict[str, bool]
        Parameter fqn -> read by hybridfp.
    """
    read: set[int] = set()
    for m in model.modules():
        if isinstance(m, HybridLinear):
            read.add(id(m.weight))
        glists = getattr(m, "hybridfp_grouped_linears", None)
        if callable(glists):
            read.update(id(getattr(m, w)) for w in _EXPERT_WEIGHTS)
    return {n: id(p) in read for n, p in model.named_parameters() if p.dim() >= 2}
