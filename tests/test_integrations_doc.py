"""docs/integrations.md's Python snippets run as printed, in order, in one namespace (plain
PyTorch, transformers dense / MoE / gradient checkpointing / saving, hybridfp train
--hf-config, torchtitan). Skipped without transformers (the hf extra; the test extra installs
it); the torchtitan snippet, the last, is skipped without torchtitan."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _sections() -> list[tuple[str, str]]:
    """(section title, code) for every ```python block, in document order."""
    out, title = [], ""
    for part in re.split(r"(?m)^(## .*)$", DOC.read_text()):
        if part.startswith("## "):
            title = part[3:].strip()
            continue
        out += [(title, code) for code in re.findall(r"```python\n(.*?)```", part, flags=re.S)]
    return out


def test_integrations_doc_snippets_run(capsys):
    pytest.importorskip("transformers")
    sections = _sections()
    titles = [t for t, _ in sections]
    for expected in ("Plain PyTorch", "Hugging Face transformers: dense models",
                     "Hugging Face transformers: MoE models", "Gradient checkpointing", "Saving and loading",
                     "torchtitan"):
        assert expected in titles, f"docs/integrations.md lost its {expected!r} snippet"
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's once-per-pair emulation notices
        for i, (title, code) in enumerate(sections):
            if title == "torchtitan":
                continue
            exec(compile(code, f"docs/integrations.md block {i + 1} ({title})", "exec"), ns)
    printed = capsys.readouterr().out
    assert re.search(r"^Linear loss \d+\.\d{4}$", printed, flags=re.M)
    assert "hybridfp.nn.linear ['lm_head.weight']" in printed  # only the output projection stays out
    assert "4 expert Parameters through GroupedLinear" in printed
    pytest.importorskip("torchtitan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (title, code) in enumerate(sections):
            if title == "torchtitan":
                exec(compile(code, f"docs/integrations.md block {i + 1} ({title})", "exec"), ns)
    assert re.search(r"^torchtitan: \d+ of \d+ weights through hybridfp$", capsys.readouterr().out, flags=re.M)
