"""Whole suite: without CUDA, Triton runs in interpreter mode (CPU tensors).

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function (Triton's own
``tl.max`` / ``tl.cdiv`` included), so it must be set before anything imports Triton. This file
is loaded before any test module is collected, so a test module that imports a kernel module
at its top (``hybridfp.kernels._common`` imports Triton) cannot turn the interpreter tests of
the directories collected after it into skips (session 21: ``tests/gemm`` importing
``poisoned_outputs`` skipped ~1200 of them). ``tests/kernels/conftest.py`` does the same for
runs of that directory alone.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
