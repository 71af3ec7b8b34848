"""An all-Identity recipe is the module run outside autocast, bit for bit.

Every role's IdentityQuantizer keeps the tensors as they are, so each GEMM of the autocast
run is the very torch op that ``F.linear`` and its autograd run outside autocast: fprop
``addmm(b, x, Wᵀ)`` (``mm`` without bias), dgrad ``mm(dy, W)``, wgrad ``mm(dyᵀ, x)``, with the
same operand shapes, strides and dtypes. The comparison is bitwise because it compares one
op sequence with itself (``test_the_gemms_are_the_same_aten_calls`` checks exactly that), not
two summation orders: it holds on every CPU and BLAS. The shapes are ones where an FP32
accumulation rounded once differs from torch's own BF16 / FP32 kernels on common CPUs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import assert_bitwise, assert_grads_bitwise, make_data, make_module, run_step
from torch.utils._python_dispatch import TorchDispatchMode

from hybridfp import CustomRecipe
from hybridfp.factories import high_precision

ROWS, IN, OUT = 256, 1024, 256
KINDS = ["linear", "layernorm", "rmsnorm"]
DTYPES = [torch.bfloat16, torch.float32]


def all_identity() -> CustomRecipe:
    """IdentityQuantizer for every role."""
    return CustomRecipe(qfactory=high_precision)


def setup(kind: str, dtype: torch.dtype, bias: bool = True, seed: int = 3):
    module = make_module(kind, in_features=IN, out_features=OUT, bias=bias, params_dtype=dtype)
    x, dy = make_data(dtype, seed=seed, rows=ROWS, in_features=IN, out_features=OUT)
    return module, x, dy


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_all_identity_recipe_equals_no_autocast(kind, dtype, bias):
    module, x, dy = setup(kind, dtype, bias)
    want = run_step(copy.deepcopy(module), x, dy, None)
    got = run_step(copy.deepcopy(module), x, dy, all_identity())
    assert_bitwise(got.y, want.y, f"{kind} {dtype} output")
    assert_bitwise(got.dx, want.dx, f"{kind} {dtype} input grad")
    assert_grads_bitwise(got.grads, want.grads, f"{kind} {dtype}")  # weight, bias, norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_leading_dims_fold_as_f_linear_folds_them(dtype):
    """A [B, S, K] input: F.linear runs the GEMM on its [B*S, K] view, as the module does."""
    module, x, dy = setup("linear", dtype)
    x3, dy3 = x.view(4, ROWS // 4, IN), dy.view(4, ROWS // 4, OUT)
    want = run_step(copy.deepcopy(module), x3, dy3, None)
    got = run_step(copy.deepcopy(module), x3, dy3, all_identity())
    assert_bitwise(got.y, want.y, "output")
    assert_bitwise(got.dx, want.dx, "input grad")
    assert_grads_bitwise(got.grads, want.grads, "linear 3D")


class GemmLog(TorchDispatchMode):
    """Records every GEMM aten call: op, operand shapes, strides and dtypes."""

    GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.GEMMS:
            self.calls.append((func.name(), tuple((tuple(a.shape), a.stride(), a.dtype) for a in args
                                                  if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["linear", "layernorm"])
def test_the_gemms_are_the_same_aten_calls(kind, dtype):
    """What makes the bitwise claim legitimate: the same kernels on the same operand layouts."""
    module, x, dy = setup(kind, dtype)
    logs = []
    for recipe in (None, all_identity()):
        with GemmLog() as log:
            run_step(copy.deepcopy(module), x, dy, recipe)
        logs.append(sorted(log.calls))
    assert len(logs[0]) == 3, logs[0]  # fprop, dgrad, wgrad
    assert logs[1] == logs[0]
