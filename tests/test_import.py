"""``import hybridfp`` imports neither Triton nor Dynamo.

Triton reads ``TRITON_INTERPRET`` once, when it is imported, and pytest imports hybridfp
before any conftest runs (``filterwarnings`` names hybridfp's warning classes): an import of
Triton there would fix the compiled mode for the whole run, and the CPU interpreter tests would
fail. Users pay for neither import until they use a kernel or torch.compile.
"""

from __future__ import annotations

import subprocess
import sys


def test_import_hybridfp_imports_neither_triton_nor_dynamo() -> None:
    code = ("import sys, hybridfp; "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
