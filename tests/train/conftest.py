"""Fixtures shared by the training-CLI tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A small text corpus (byte tokens): a run of a few steps takes about a second."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over {i * 7 % 13} lazy dogs\n"
                            for i in range(300)))
    return path
