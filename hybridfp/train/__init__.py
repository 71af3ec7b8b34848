"""``hybridfp train``: the main job — train a small GPT (dense or MoE) built from hybridfp
modules under one or several recipes, on data that ships with Python, and compare them.

Modules: ``data`` (corpora, token files, batches), ``corpus`` (``--data packages``), ``model`` / ``moe`` (GPT, presets),
``recipes_by_name`` (command-line recipe names), ``loop`` (one recipe's training),
``checkpoint`` (bitwise resume from tensors and plain data), ``files`` (atomic writes),
``plot`` / ``report`` (loss.png, summary.md), ``parallel`` (``--jobs``), ``distributed`` /
``dist_checkpoint`` (``--fsdp`` / ``--ep`` under torchrun, sharded checkpoints), ``hf_model``
(``--hf-config``: a transformers architecture as the model), ``cli``.
"""

from .cli import DEFAULT_COMPARE, main, train_main
from .data import DataError, TokenData, load_data, load_packages_corpus
from .hf_model import HFCausalLM, build_hf_model, read_hf_config, shipped_configs
from .loop import RunResult, TrainConfig, train_recipe
from .model import GPT, PRESETS, GPTConfig, Preset
from .moe import MoE
from .recipes_by_name import NamedRecipe, known_names, parse_recipe, parse_recipe_list

__all__ = ["DEFAULT_COMPARE", "DataError", "GPT", "GPTConfig", "HFCausalLM", "MoE", "NamedRecipe", "PRESETS",
           "Preset", "RunResult", "TokenData", "TrainConfig", "build_hf_model", "known_names", "load_data",
           "load_packages_corpus", "main",
           "parse_recipe", "parse_recipe_list", "read_hf_config", "shipped_configs", "train_main", "train_recipe"]
