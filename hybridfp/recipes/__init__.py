"""Recipes, roles, factories and the autocast region."""

from . import factories
from .autocast import AutocastState, autocast, current_autocast, default_recipe, replay_region
from .recipes import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                      MXFP8BlockScaling, NVFP4BlockScaling, Recipe)
from .roles import QuantizerRole

__all__ = ["AutocastState", "CustomRecipe", "DelayedScaling", "Float8BlockScaling",
           "Float8CurrentScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "QuantizerRole", "Recipe",
           "autocast", "current_autocast", "default_recipe", "factories", "replay_region"]
