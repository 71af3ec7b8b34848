"""Hugging Face's ``gradient_checkpointing_enable()`` on a tiny Llama converted to hybridfp:
gradients bitwise those of the model without it, in both of torch's modes (transformers picks
``use_reentrant`` from ``gradient_checkpointing_kwargs``; its default differs across versions).
Skipped without ``transformers``; tests/integration/test_torch_checkpoint.py covers the same
calls (``torch.utils.checkpoint(layer.__call__, ...)``) without it."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hfp

transformers = pytest.importorskip("transformers")

RECIPES = {
    "delayed": lambda: hfp.DelayedScaling(amax_history_len=4),
    "mxfp8": lambda: hfp.MXFP8BlockScaling(),
    "nvfp4": lambda: hfp.NVFP4BlockScaling(),
}


def _llama(checkpointing: dict | None):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    hfp.convert(model)
    model.train()
    if checkpointing is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the name is deprecated in some versions
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    return model


def _steps(recipe_name: str, checkpointing: dict | None):
    model = _llama(checkpointing)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(2):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        torch.manual_seed(50 + step)
        with hfp.autocast(recipe=RECIPES[recipe_name]()):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_gradient_checkpointing_enable_is_bitwise(recipe_name, use_reentrant):
    want = _steps(recipe_name, None)
    got = _steps(recipe_name, {"use_reentrant": use_reentrant})
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_converted_llama_has_hybridfp_layers():
    model = _llama(None)
    # seven linears per layer; the output projection stays in high precision by default
    assert sum(isinstance(m, hfp.Linear) for m in model.modules()) == 2 * 7
    assert type(model.lm_head) is torch.nn.Linear
