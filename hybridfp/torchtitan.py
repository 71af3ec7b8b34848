"""hybridfp as a torchtitan model converter (needs torchtitan >= 0.3.0; ``pip install
'hybridfp[torchtitan]'``). ``import hybridfp`` never imports this module nor torchtitan.

torchtitan's job configs are Python functions returning a ``Trainer.Config``; converters go in
``model_registry(flavor, converters=[...])`` next to torchtitan's own float8 / MX ones::

    from hybridfp.torchtitan import HybridFPConverter
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def llama3_debugmodel_hybridfp():
        config = llama3_debugmodel()
        config.model_spec = model_registry(
            "debugmodel", converters=[HybridFPConverter.Config(recipe="mxfp8")])
        return config

and ``torchrun ... -m torchtitan.train --module my_configs --config llama3_debugmodel_hybridfp``.
The model transform itself lives in :mod:`hybridfp.integration.torchtitan`; this module adds
the recipe names (those of ``hybridfp train --recipe``), which live above the integration layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

try:
    from torchtitan.components.quantization import QuantizationConverter
except ImportError as e:  # pragma: no cover - the tests skip without torchtitan
    raise ImportError("hybridfp.torchtitan needs torchtitan >= 0.3.0 (Python >= 3.11): "
                      "pip install 'hybridfp[torchtitan]'") from e

from .integration.torchtitan import (DEFAULT_SKIP, ModelConfigConversion, convert_model_config,
                                     hybridfp_weights)
from .train.recipes_by_name import parse_recipe

__all__ = ["HybridFPConverter", "ModelConfigConversion", "hybridfp_weights"]

logger = logging.getLogger(__name__)


class HybridFPConverter(QuantizationConverter):
    """torchtitan model converter: the selected ``Linear`` layers become hybridfp ``Linear``,
    the MoE ``GroupedExperts`` run through ``hybridfp.GroupedLinear`` (the same Parameters), and
    the model's forward runs inside ``hybridfp.autocast(recipe)``.

    Options (``HybridFPConverter.Config``; torchtitan's converter configs are mutable
    ``kw_only`` / ``slots`` dataclasses, so this one is too):

    - ``recipe``: a name of ``hybridfp train --recipe`` (``fp8``, ``mxfp8``, ``nvfp4``,
      ``bf16`` (Identity quantizers casting to BF16), ``high-precision`` (Identity without a
      cast), a zoo hybrid such as ``nvfp4-fwd-mxfp8-bwd``,
      ``per_gemm:fprop=...``) or ``package.module:factory`` (a ``Recipe``, a ``Recipe``
      subclass, an annotated ``def f(role) -> Quantizer`` or ``def f() -> Recipe``);
    - ``fqns``: convert only modules whose fqn contains one of these dotted runs (empty: all);
    - ``filter_fqns``: keep these in high precision (default ``lm_head``, ``output``, ``router``);
    - ``experts``: convert ``GroupedExperts`` (default True);
    - ``strict``: raise (instead of warning) when an unknown ``Linear`` / ``GroupedExperts``
      subclass would stay in high precision.

    Composes with torchtitan's FSDP2 and activation checkpointing, and with its tensor / expert
    parallelism under ``parallelism.spmd_backend="partial_dtensor"`` (converted ``Linear`` run
    ``hybridfp.ColwiseParallel`` / ``RowwiseParallel`` from their stock sharding configs;
    converted experts run on their local shard); other backends are refused, naming the option.

    Parameters
    ----------
    config:
        ``HybridFPConverter.Config``; ``config.build()`` makes the converter, as torchtitan's
        ``model_registry`` does.

    Raises
    ------
    ValueError
        An unknown recipe name or a ``module:attr`` that is no recipe (from ``__init__``).

    Example
    -------
    >>> from hybridfp.torchtitan import HybridFPConverter
    >>> conv = HybridFPConverter.Config(recipe="mxfp8").build()
    >>> type(conv.recipe).__name__, conv.config.filter_fqns
    ('MXFP8BlockScaling', ['lm_head', 'output', 'router'])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "fp8"
        """A ``hybridfp train --recipe`` name or ``package.module:factory``."""

        fqns: list[str] = field(default_factory=list)
        """Convert only modules matching one of these (dotted runs of names); empty: all."""

        filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_SKIP))
        """Modules kept in high precision: the output projection and the routers by default."""

        experts: bool = True
        """Run MoE GroupedExperts through hybridfp.GroupedLinear."""

        strict: bool = False
        """Raise instead of warning when an unknown Linear / GroupedExperts type stays unconverted."""

    def __init__(self, config: "HybridFPConverter.Config") -> None:
        self.config = config
        self.recipe = parse_recipe(config.recipe).recipe
        self.last_conversion: ModelConfigConversion = ModelConfigConversion()

    def convert(self, model_config):  # type: ignore[no-untyped-def]
        """Rewrite ``model_config`` (torchtitan calls this before building the model).

        Parameters
        ----------
        model_config:
            The torchtitan model config.

        Returns
        -------
        config
            The converted root config, a subclass of ``model_config``'s class (see
            :func:`hybridfp.integration.torchtitan.convert_model_config`); what was converted is
            kept in ``last_conversion``.

        Raises
        ------
        TypeError
            ``model_config`` is no torchtitan model config.
        ValueError
            ``strict`` and a ``Linear`` / ``GroupedExperts`` subclass hybridfp does not know is
            not filtered out.
        """
        c = self.config
        root, done = convert_model_config(model_config, self.recipe, fqns=c.fqns,
                                          filter_fqns=c.filter_fqns, experts=c.experts,
                                          strict=c.strict)
        self.last_conversion = done
        logger.info("hybridfp (%s): %d Linear and %d GroupedExperts converted; kept in high "
                    "precision: %s", c.recipe, len(done.linears), len(done.experts),
                    ", ".join(f"{k} ({v})" for k, v in done.skipped.items()) or "none")
        return root
