"""``bench/tools/sass_count.py`` names each case's kernel by module and function: every case must
resolve to a kernel the tree has, with every argument it leaves out defaulted and no argument
the kernel lacks (a case that only failed when compiled, minutes into a run, is caught here)."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("triton")

from bench.tools import sass_count  # noqa: E402


@pytest.mark.parametrize("name", list(sass_count.CASES))
def test_case_resolves_to_a_kernel_of_the_tree(name: str) -> None:
    mod, kernel, signature, constexprs, per_thread, warps, *_ = sass_count.CASES[name]
    fn = getattr(importlib.import_module(f"hybridfp.kernels.{mod}"), kernel)
    params = inspect.signature(fn.fn).parameters
    unknown = (set(signature) | set(constexprs)) - set(params)
    assert not unknown, f"{name}: {sorted(unknown)} are not parameters of {mod}.{kernel}"
    missing = [n for n, p in params.items()
               if n not in signature and n not in constexprs and p.default is inspect.Parameter.empty]
    assert not missing, f"{name}: {mod}.{kernel}'s arguments {missing} have neither a type nor a value"
    assert per_thread > 0 and warps > 0
