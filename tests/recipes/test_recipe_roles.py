"""QuantizerRole (numerics §4): validation, text form, value semantics."""

from __future__ import annotations

import pickle

import pytest

from hybridfp import QuantizerRole
from hybridfp.recipes.roles import TENSOR_TYPES


def test_tensor_types_are_the_spec_list():
    assert TENSOR_TYPES == ("input", "weight", "grad_output", "output", "grad_input")


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
@pytest.mark.parametrize("module_type", ["linear", "grouped_linear", "attention"])
def test_valid_roles(module_type, tensor_type):
    r = QuantizerRole(module_type, tensor_type, "layers.3.fc1")
    assert (r.module_type, r.tensor_type, r.name) == (module_type, tensor_type, "layers.3.fc1")


def test_name_defaults_to_empty():
    assert QuantizerRole("linear", "input").name == ""


@pytest.mark.parametrize("tensor_type", ["qkv", "inputs", "", "Input", None])
@pytest.mark.parametrize("module_type", ["dpa", "", None])
def test_other_modules_and_unknown_fields_are_roles_too(module_type, tensor_type):
    """As TransformerEngine's: any module / tensor type string, None where unknown."""
    r = QuantizerRole(module_type, tensor_type)
    assert (r.module_type, r.tensor_type, r.name) == (module_type, tensor_type, "")


@pytest.mark.parametrize("field", ["module_type", "tensor_type", "name"])
def test_fields_must_be_strings_or_none(field):
    kw = {"module_type": "linear", "tensor_type": "input", "name": "fc", field: 3}
    with pytest.raises(TypeError, match=field):
        QuantizerRole(**kw)


@pytest.mark.parametrize("role, text", [
    (QuantizerRole("linear", "input", "blocks.0.attn.qkv"), "blocks.0.attn.qkv.input"),
    (QuantizerRole("grouped_linear", "grad_output", "moe.experts"), "moe.experts.grad_output"),
    (QuantizerRole("linear", "weight"), "linear.weight"),  # unnamed: the module type stands in
    (QuantizerRole("grouped_linear", "output"), "grouped_linear.output"),
])
def test_str(role, text):
    assert str(role) == text


def test_frozen_hashable_equal_and_picklable():
    a, b = QuantizerRole("linear", "weight", "fc"), QuantizerRole("linear", "weight", "fc")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != QuantizerRole("grouped_linear", "weight", "fc")
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a.tensor_type = "input"  # type: ignore[misc]
