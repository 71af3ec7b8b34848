"""``hybridfp train --hf-config``: a Hugging Face transformers architecture as the trained model.

    config = json.load(PATH)                             # or a shipped name: llama-tiny, qwen3-moe-tiny
    model = AutoModelForCausalLM.from_config(config)    # random init (seeded), no download
    hybridfp.convert(model)                              # its linears (and experts) run through hybridfp
    with hybridfp.autocast(recipe=recipe):
        logits = model(input_ids=x).logits              # under torch.autocast for --dtype bf16

:class:`HFCausalLM` gives the transformers model the interface of the built-in GPT
(``forward(idx, targets) -> (logits, loss)``, ``last_ce_loss`` / ``last_aux_loss``,
``recompute``, ``num_params``), so the training loop, evaluation, checkpoints, plots and summary
are the same. ``transformers`` is the optional ``hf`` extra.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..integration.transformers_convert import convert
from ..nn import QuantizedModule

#: The configs that ship with hybridfp (``--hf-config NAME``), in this package's hf_configs/.
CONFIG_DIR = Path(__file__).resolve().parent / "hf_configs"


def shipped_configs() -> list[str]:
    """The names of the configs that ship with hybridfp (``--hf-config NAME``).

    Returns
    -------
    list[str]
        Sorted names, e.g. ``llama-tiny``.

    Example
    -------
    >>> from hybridfp.train.hf_model import shipped_configs
    >>> shipped_configs()
    ['llama-tiny', 'qwen3-moe-tiny']
    """
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def read_hf_config(spec: str) -> tuple[str, dict[str, Any]]:
    """The config a ``--hf-config`` value names: a JSON file (a transformers ``config.json``)
    or the name of a shipped config.

    Parameters
    ----------
    spec:
        A path, or a name of :func:`shipped_configs`.

    Returns
    -------
    tuple
        (a short name for the run: the file's stem, the config as a dict with ``model_type``).

    Raises
    ------
    ValueError
        The file is missing, not JSON, not an object, or lacks ``model_type`` / a positive
        integer ``vocab_size``.

    Example
    -------
    >>> from hybridfp.train.hf_model import read_hf_config
    >>> name, config = read_hf_config("llama-tiny")
    >>> name, config["model_type"], config["vocab_size"]
    ('llama-tiny', 'llama', 256)
    """
    path = Path(spec)
    if not path.is_file() and (CONFIG_DIR / f"{spec}.json").is_file():
        path = CONFIG_DIR / f"{spec}.json"
    if not path.is_file():
        raise ValueError(f"--hf-config {spec}: no such file; pass a transformers config.json or one of "
                         f"the shipped configs ({', '.join(shipped_configs())}).")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--hf-config {path}: not valid JSON ({' '.join(str(e).split())}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"--hf-config {path}: holds a {type(config).__name__}, not a config object.")
    for key in ("model_type", "vocab_size"):
        if key not in config:
            raise ValueError(f"--hf-config {path}: lacks {key!r} (a transformers config.json names its "
                             "model_type, e.g. 'llama', and its vocab_size).")
    vocab = config["vocab_size"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ValueError(f"--hf-config {path}: vocab_size is {vocab!r}; it must be a positive integer.")
    return path.stem, config


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("--hf-config needs transformers, which is not installed: "
                          "pip install 'hybridfp[hf]'") from None
    return transformers


def check_hf_config(config: dict[str, Any], vocab_size: int, seq_len: int) -> None:
    """Refuse a config that cannot train on the data: a vocabulary smaller than the tokenizer's,
    or positions fewer than ``seq_len``.

    Parameters
    ----------
    config:
        The config dict (:func:`read_hf_config`).
    vocab_size:
        The data's vocabulary (the byte corpus: 256).
    seq_len:
        The run's ``--seq-len``.

    Raises
    ------
    ValueError
        Naming both numbers and what to change.

    Example
    -------
    >>> from hybridfp.train.hf_model import check_hf_config
    >>> check_hf_config({"vocab_size": 128, "model_type": "llama"}, 256, 64)
    Traceback (most recent call last):
    ...
    ValueError: --hf-config: vocab_size 128 is smaller than the data's tokenizer vocabulary (256); set vocab_size to 256 or more in the config.
    """
    if config["vocab_size"] < vocab_size:
        raise ValueError(f"--hf-config: vocab_size {config['vocab_size']} is smaller than the data's tokenizer "
                         f"vocabulary ({vocab_size}); set vocab_size to {vocab_size} or more in the config.")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions < seq_len:
        raise ValueError(f"--hf-config: max_position_embeddings {positions} is smaller than --seq-len "
                         f"{seq_len}; lower --seq-len or raise max_position_embeddings in the config.")


class HFCausalLM(nn.Module):
    """A transformers causal LM with the built-in GPT's interface.

    ``forward(idx, targets)`` returns FP32 logits and the loss: cross-entropy on ``targets``
    (already shifted, as the trainer's batches are), plus, in training mode, the config's
    ``router_aux_loss_coef`` times the model's load-balancing loss when it reports one (MoE
    configs with ``output_router_logits``). With ``act_dtype`` BF16 the forward runs under
    ``torch.autocast`` (hybridfp's modules take its dtype, as ``nn.Linear`` does); parameters
    stay FP32. Setting ``recompute`` turns transformers' gradient checkpointing on / off
    (``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``; non-reentrant).

    Parameters
    ----------
    model:
        A transformers ``*ForCausalLM`` (converted or not).
    act_dtype:
        BF16 (autocast) or FP32.
    """

    def __init__(self, model: nn.Module, act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.hf, self.act_dtype = model, act_dtype
        self._recompute = False
        self.last_ce_loss: Optional[torch.Tensor] = None
        self.last_aux_loss: Optional[torch.Tensor] = None

    @property
    def recompute(self) -> bool:
        """Whether transformers' gradient checkpointing is on (non-reentrant ``torch.utils.checkpoint``)."""
        return self._recompute

    @recompute.setter
    def recompute(self, on: bool) -> None:
        # transformers 5.x names it activation checkpointing (the gradient_ names are deprecated)
        if on:
            if hasattr(self.hf, "activation_checkpointing_enable"):
                self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self._recompute:
            (getattr(self.hf, "activation_checkpointing_disable", None) or self.hf.gradient_checkpointing_disable)()
        self._recompute = bool(on)

    def num_params(self) -> int:
        """Parameter count (tied weights once)."""
        return sum(p.numel() for p in self.parameters())

    @contextlib.contextmanager
    def _activations(self, device: torch.device) -> Iterator[None]:
        if self.act_dtype == torch.float32:
            yield
        else:
            with torch.autocast(device.type, dtype=self.act_dtype):
                yield

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """idx [B, T] token ids -> logits [B, T, vocab] (FP32) and the loss if targets given."""
        with self._activations(idx.device):
            out = self.hf(input_ids=idx, use_cache=False)
        logits = out.logits.float()
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        self.last_ce_loss = loss.detach()
        aux = getattr(out, "aux_loss", None)
        self.last_aux_loss = None if aux is None else aux.float().detach()
        if aux is not None and self.training:
            loss = loss + getattr(self.hf.config, "router_aux_loss_coef", 0.0) * aux.float()
        return logits, loss


def build_hf_model(config: dict[str, Any], seed: int, act_dtype: torch.dtype = torch.bfloat16,
                   device: str = "cpu") -> HFCausalLM:
    """The architecture of ``config``, randomly initialized from ``seed`` (the same weights for
    every recipe), converted to hybridfp (:func:`hybridfp.convert`'s defaults pick what runs
    quantized).

    Parameters
    ----------
    config:
        A transformers config as a dict (:func:`read_hf_config`).
    seed:
        ``torch.manual_seed`` before the weights are drawn.
    act_dtype:
        Activation dtype (:class:`HFCausalLM`).
    device:
        Where the model lives.

    Returns
    -------
    HFCausalLM
        The converted model, wrapped.

    Raises
    ------
    ImportError
        transformers is not installed (the ``hf`` extra).
    ValueError
        transformers does not know the config's ``model_type``, or the config is invalid.
    """
    transformers = _transformers()
    kw = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        hf_config = transformers.AutoConfig.for_model(config["model_type"], **kw)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--hf-config: transformers {transformers.__version__} cannot build this config "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:300]}).") from None
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    convert(model)
    return HFCausalLM(model.to(device), act_dtype)


def quantized_share(model: nn.Module) -> tuple[int, int]:
    """How many of the model's matrix parameters (>= 2-D) a hybridfp module reads, of all of them.

    Parameters
    ----------
    model:
        Any module.

    Returns
    -------
    tuple[int, int]
        (elements of the matrices hybridfp modules read, elements of every matrix), tied
        weights once.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.train.hf_model import quantized_share
    >>> model = torch.nn.Sequential(torch.nn.Embedding(4, 8), torch.nn.Linear(8, 8, bias=False))
    >>> quantized_share(hf.convert(model))
    (64, 96)
    """
    # a module that borrows another's Parameter (converted MoE experts) reads it as ``weight``
    inside = {id(p) for m in model.modules() if isinstance(m, QuantizedModule)
              for p in (*m.parameters(), getattr(m, "weight", None)) if isinstance(p, torch.Tensor)}
    mats = {id(p): p.numel() for p in model.parameters() if p.dim() >= 2}
    return sum(n for i, n in mats.items() if i in inside), sum(mats.values())


__all__ = ["CONFIG_DIR", "HFCausalLM", "build_hf_model", "check_hf_config", "quantized_share",
           "read_hf_config", "shipped_configs"]
