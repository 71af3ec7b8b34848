"""Kernel tests: without CUDA, the Triton kernels run in interpreter mode on CPU tensors.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function (Triton's own
``tl.max`` / ``tl.cdiv`` included), so it must be set before Triton is imported. hybridfp
imports Triton only at the first kernel call (``hybridfp.quantizers.fast``), so setting it
here is early enough in a whole-suite run. Should something have imported Triton in compiled
mode before this file, the interpreter tests skip with that reason
(``quantize_kernel_cases.interpreter_only``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
