"""Recipe names on the command line -> hybridfp recipes.

Accepted (case-insensitive, ``_`` and ``-`` interchangeable):

- built-in recipes: ``bf16`` (every operand cast to BF16, FP32 accumulation, on the same code
  path: the baseline), ``high-precision`` (alias ``hp``: no cast, each GEMM in its operands'
  own dtype; with FP32 master weights, FP32 GEMMs on the exact path), ``fp8`` (current
  scaling), ``fp8-delayed``, ``fp8-block``, ``mxfp8``, ``nvfp4``, and the base factory names
  (``current_scaling``, ``delayed_scaling``...);
- every zoo factory by name (``hybridfp.factories.ZOO``), plus short aliases without
  ``row-scaled`` (``nvfp4-fwd-mxfp8-bwd``) and with ``hp`` for ``high-precision``;
- ``per_gemm:fprop=F,dgrad=D,wgrad=W`` with format names from ``hybridfp.factories.FORMAT_NAMES``;
- ``package.module:attr`` — a ``Recipe`` instance; a ``Recipe`` subclass (instantiated); a
  factory ``def f(role) -> Quantizer`` (wrapped in ``CustomRecipe``); or a function
  ``def f() -> Recipe`` (called). The return annotation is what makes a function one of ours:
  nothing else named on the command line is ever called (``os:system`` is refused unrun).
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..recipes import factories
from ..quantizers import Quantizer
from ..recipes import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                       MXFP8BlockScaling, NVFP4BlockScaling, Recipe)

PER_GEMM_KEYS = ("fprop", "dgrad", "wgrad")


@dataclass
class NamedRecipe:
    """A parsed ``--recipe``: its canonical label, the recipe, and a one-line description."""

    label: str
    recipe: Recipe
    description: str
    #: The run's own seed (``NAME@seed=K``), else None: the run's ``--seed``.
    seed: Optional[int] = None

    @property
    def slug(self) -> str:
        """File-name-safe form of the label (checkpoint names)."""
        return re.sub(r"[^A-Za-z0-9._=-]+", "-", self.label).strip("-")


# label -> (maker, description). Built-ins first, then the zoo (numerics §5).
BUILTIN: dict[str, tuple[Callable[[], Recipe], str]] = {
    "bf16": (lambda: CustomRecipe(qfactory=factories.bf16),
             "BF16 operands, FP32 accumulation (Identity quantizers casting to BF16)"),
    "high-precision": (lambda: CustomRecipe(qfactory=factories.high_precision),
                       "no cast: GEMMs in the operands' own dtype (FP32 weights: FP32 GEMMs)"),
    "fp8": (Float8CurrentScaling, "FP8 per-tensor current scaling (E4M3 fwd, E5M2 grads)"),
    "fp8-delayed": (DelayedScaling, "FP8 per-tensor delayed scaling (amax history)"),
    "fp8-block": (Float8BlockScaling, "FP8 block scaling (1x128 / 128x128, DeepSeek-V3)"),
    "mxfp8": (MXFP8BlockScaling, "MXFP8 E4M3, 1x32 E8M0 scales"),
    "nvfp4": (NVFP4BlockScaling, "NVFP4 with NVIDIA's defaults (2D weights, RHT, SR)"),
}


def _zoo_description(f: Callable) -> str:
    """The first paragraph of a zoo factory's docstring, minus the "unvalidated" preamble."""
    para = " ".join((f.__doc__ or f.__name__).strip().split("\n\n")[0].split())
    return "zoo (unvalidated): " + para.split(": ", 1)[-1]


ZOO: dict[str, tuple[Callable[[], Recipe], str]] = {
    name.replace("_", "-"): ((lambda f=f: CustomRecipe(qfactory=f)), _zoo_description(f))
    for name, f in factories.ZOO.items()
}
ALIASES: dict[str, str] = {
    "hp": "high-precision",
    "current-scaling": "fp8", "fp8-current": "fp8",
    "delayed-scaling": "fp8-delayed",
    "float8-block-scaling": "fp8-block",
}
for _zoo in ZOO:
    for _alias in {_zoo.replace("row-scaled-", ""), _zoo.replace("high-precision", "hp"),
                   _zoo.replace("row-scaled-", "").replace("high-precision", "hp")} - {_zoo}:
        ALIASES[_alias] = _zoo


def known_names() -> list[str]:
    """Every accepted plain name (canonical names and aliases)."""
    return [*BUILTIN, *ZOO, *sorted(ALIASES)]


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown recipe {name!r}. Known names: {', '.join([*BUILTIN, *ZOO])} "
        f"(aliases: {', '.join(sorted(ALIASES))}); or per_gemm:fprop=F,dgrad=D,wgrad=W with F/D/W in "
        f"{', '.join(factories.FORMAT_NAMES)}; or package.module:function for your own factory.")


def parse_per_gemm(spec: str) -> NamedRecipe:
    """``per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8`` -> CustomRecipe(per_gemm(...))."""
    body = spec.split(":", 1)[1]
    kv: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in PER_GEMM_KEYS:
            raise ValueError(f"per_gemm recipe {spec!r}: {item!r} is not one of fprop=F, dgrad=D, wgrad=W.")
        if key in kv:  # a second value would silently win
            raise ValueError(f"per_gemm recipe {spec!r}: {key} is given twice; give each of fprop, dgrad "
                             "and wgrad once.")
        kv[key] = value.strip().lower().replace("-", "_")
    missing = [k for k in PER_GEMM_KEYS if k not in kv]
    if missing:
        raise ValueError(f"per_gemm recipe {spec!r} lacks {', '.join(missing)}; give all three, e.g. "
                         "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8.")
    factory = factories.per_gemm(**kv)
    label = "per_gemm:" + ",".join(f"{k}={kv[k]}" for k in PER_GEMM_KEYS)
    return NamedRecipe(label, CustomRecipe(qfactory=factory),
                       f"per GEMM: fprop {kv['fprop']}, dgrad {kv['dgrad']}, wgrad {kv['wgrad']}")


def _annotated_return(obj: Any) -> Optional[type]:
    """The class a Python function (or a callable instance's ``__call__``) is annotated to
    return; None for anything else (builtins, classes, unannotated or non-class annotations)."""
    if isinstance(obj, type):
        return None
    target = obj if inspect.isfunction(obj) or inspect.ismethod(obj) else getattr(type(obj), "__call__", None)
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        return None
    try:
        ret = typing.get_type_hints(target).get("return")
    except Exception:  # an annotation that does not resolve: not a declared factory
        return None
    return ret if isinstance(ret, type) else None


def _takes(obj: Callable, n_args: int) -> bool:
    """Whether ``obj`` can be called with ``n_args`` positional arguments."""
    try:
        inspect.signature(obj).bind(*([None] * n_args))
    except (TypeError, ValueError):
        return False
    return True


def parse_user_recipe(spec: str) -> NamedRecipe:
    """``package.module:attr`` -> NamedRecipe.

    ``attr`` must be a ``Recipe`` instance, a ``Recipe`` subclass (instantiated), a quantizer
    factory annotated ``def f(role) -> Quantizer`` (wrapped in ``CustomRecipe``), or a function
    annotated ``def f() -> Recipe`` (called once). Anything else is refused without being
    called: a command line must not run arbitrary callables (``os:system``).

    Parameters
    ----------
    spec:
        ``package.module:attr`` (``attr`` may be dotted).

    Returns
    -------
    NamedRecipe
        Labelled ``spec``.

    Raises
    ------
    ValueError
        The module does not import, has no such attribute, or the attribute is none of the above.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"recipe {spec!r}: cannot import module {module_name!r} ({e}); is it on "
                         "PYTHONPATH?") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"recipe {spec!r}: module {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if isinstance(obj, Recipe):
        return NamedRecipe(spec, obj, f"user recipe {type(obj).__name__}")
    if isinstance(obj, type) and issubclass(obj, Recipe):
        return NamedRecipe(spec, obj(), f"user recipe {obj.__name__}()")
    ret = _annotated_return(obj)
    if ret is not None and issubclass(ret, Quantizer) and _takes(obj, 1):
        return NamedRecipe(spec, CustomRecipe(qfactory=obj), "user factory (CustomRecipe)")
    if ret is not None and issubclass(ret, Recipe) and _takes(obj, 0):
        recipe = obj()
        if not isinstance(recipe, Recipe):
            raise ValueError(f"recipe {spec!r}: {attr}() is annotated to return a Recipe but returned a "
                             f"{type(recipe).__name__}.")
        return NamedRecipe(spec, recipe, f"user recipe {type(recipe).__name__} from {attr}()")
    raise ValueError(
        f"recipe {spec!r}: {attr} is a {type(obj).__name__}"
        + (f" annotated to return {ret.__name__}" if ret is not None else "")
        + "; it must be a hybridfp Recipe, a Recipe subclass, a factory annotated "
        "`def f(role) -> Quantizer`, or a function annotated `def f() -> Recipe` (nothing else named "
        "on the command line is called).")


#: The seeds a run accepts (``--seed``, ``NAME@seed=K``): torch.manual_seed's signed 64-bit
#: range, its top value left out since the training generator is seeded with seed + 1.
SEED_RANGE = (-2**63, 2**63 - 2)


def parse_recipe(spec: str) -> NamedRecipe:
    """One recipe name/spec -> NamedRecipe (see the module docstring).

    A ``@seed=K`` suffix runs the recipe with seed K (init, data order, stochastic rounding),
    e.g. ``bf16,bf16@seed=1`` measures the seed-to-seed noise floor of a comparison."""
    spec = spec.strip()
    base, sep, seed_text = spec.rpartition("@seed=")
    if sep:
        try:
            seed = int(seed_text)
        except ValueError:
            raise ValueError(f"recipe {spec!r}: the seed after '@seed=' must be an integer, e.g. "
                             "bf16@seed=1.") from None
        low, high = SEED_RANGE
        if not low <= seed <= high:  # torch.manual_seed would overflow mid-run, after run.json is written
            raise ValueError(f"recipe {spec!r}: the seed after '@seed=' is out of range; pass one from {low} "
                             f"to {high} (a 64-bit integer), e.g. bf16@seed=1.")
        named = parse_recipe(base)
        return NamedRecipe(f"{named.label}@seed={seed}", named.recipe,
                           f"{named.description}, seed {seed}", seed)
    if not spec:
        raise _unknown(spec)
    if _normalize(spec.split(":", 1)[0]) == "per-gemm" and ":" in spec:
        return parse_per_gemm(spec)
    if ":" in spec:
        return parse_user_recipe(spec)
    name = _normalize(spec)
    name = ALIASES.get(name, name)
    table = BUILTIN if name in BUILTIN else ZOO if name in ZOO else None
    if table is None:
        raise _unknown(spec)
    maker, description = table[name]
    return NamedRecipe(name, maker(), description)


def split_recipe_list(text: str) -> list[str]:
    """Split a --compare list on commas, keeping ``per_gemm:fprop=..,dgrad=..,wgrad=..`` whole."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key = item.partition("=")[0].strip()
        if out and "=" in item and key in PER_GEMM_KEYS and _normalize(out[-1]).startswith("per-gemm:"):
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def parse_recipe_list(text: str) -> list[NamedRecipe]:
    """A --compare list -> recipes, in order, without duplicates (by label)."""
    seen: dict[str, NamedRecipe] = {}
    for spec in split_recipe_list(text):
        r = parse_recipe(spec)
        seen.setdefault(r.label, r)
    if not seen:
        raise ValueError("--compare needs at least one recipe name, e.g. --compare bf16,fp8,mxfp8.")
    return list(seen.values())
