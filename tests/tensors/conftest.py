"""Fixtures shared by the tensors tests."""

from __future__ import annotations

import pytest

from hybridfp.tensors import dispatch


@pytest.fixture(autouse=True)
def reset_fallback_warnings():
    """The once-per-op fallback warning set is module-global: start every test empty."""
    dispatch._WARNED.clear()
    yield
    dispatch._WARNED.clear()
