"""Every module test runs twice on the CPU: with the default decoded-copies mode ("auto", which
holds nothing decoded where GEMMs are emulated) and with "always", so every module path
(checkpointing, saved tensors, shared inputs, grouped experts, ...) also runs on copies held as
their BF16 decodes (the policy's ``decoded_copies``). On a GPU "auto" already holds them where
it matters, and the GPU tests are the expensive ones: they run once."""

from __future__ import annotations

import pytest
import torch

import hybridfp

MODES = ["auto"] + ([] if torch.cuda.is_available() else ["always"])


@pytest.fixture(autouse=True, params=MODES, ids=[f"decoded_{m}" for m in MODES])
def decoded_copies_mode(request):
    """The decoded-copies mode of this run of the test (restored afterwards)."""
    with hybridfp.policy(decoded_copies=request.param):
        yield request.param
