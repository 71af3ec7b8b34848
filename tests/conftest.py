"""Whole suite: without CUDA, Triton runs in interpreter mode (CPU tensors).

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function (Triton's own
``tl.max`` / ``tl.cdiv`` included), so it must be set before anything imports Triton. This file
is loaded before any test module is collected, so a test module that imports a kernel module
at its top (``hybridfp.kernels._common`` imports Triton, e.g. ``tests/gemm`` importing
``poisoned_outputs``) cannot turn the interpreter tests of the directories collected after it
into skips. ``tests/kernels/conftest.py`` does the same for runs of that directory alone.

Every test must pass on every CPU (Intel / AMD, AVX2 / AVX-512): the order of FP32 sums on the
CPU (the interpreter's numpy dots, torch's CPU matmuls) depends on the BLAS kernel the machine
selects, so two different summation orders are compared bitwise only on exact-sum inputs and
within a stated bound otherwise. ``tests/README.md`` gives the rule and how to find tests that
break it (one run per ``OPENBLAS_CORETYPE`` family, ``MKL_CBWR``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _seeded_rngs():
    """Every test starts from the same random state, whatever ran before it in its process: a
    test drawing from torch's (or Python's, numpy's) global generator would otherwise see data
    that depends on which tests ran first, and so on ``-k``, a single file or pytest-xdist's
    split, and could pass in one order and fail in another."""
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _gpu_memory_returned():
    """After each test, CUDA memory the test freed goes back to the driver: torch's caching
    allocator otherwise keeps a process's peak reserved, and under ``-n 4`` four workers share one
    GPU, so a worker that ran a 30 GB test would starve the other three for the rest of the run
    (out-of-memory failures that depend on which worker ran what). Off CUDA: nothing."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def set_policy(monkeypatch):
    """``set_policy(**changes)``: the calling thread's ``hybridfp.config`` policy with ``changes``
    (``Policy`` fields) for the rest of the test, undone with the test's other ``monkeypatch``
    changes (in reverse order). Not inside a ``with hybridfp.policy(...)`` block: leaving the
    block would restore the policy before the change and teardown the changed one."""
    from hybridfp import config

    def set_(**changes):
        monkeypatch.setattr(config._CURRENT, "policy", dataclasses.replace(config.current_policy(), **changes))

    return set_
