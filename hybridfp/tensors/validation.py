"""Field checks for a quantized tensor's saved state.

``torch.load(weights_only=True)`` rebuilds a QuantizedTensor from plain data: a storage class
name, the header (logical shape, nominal dtype, role label), format options and the payload
tensors of each direction. A file is data, not code: nothing in it is trusted until every field
is checked against the others and against the format (a header shape that disagrees with the
payloads would otherwise reach a GEMM, which reads the payload's rows). These helpers raise
:class:`InvalidStateError` naming the field, what it holds and what was expected; the storages
(``QuantizedStorage.from_state`` / ``validate``) decide what is expected.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from ..formats.common import HIGH_PRECISION_DTYPES


class InvalidStateError(ValueError):
    """A saved quantized tensor whose fields disagree with each other or with its format."""


def require_dict(value: Any, what: str) -> dict:
    """``value`` if it is a dict, else a clear error naming ``what``."""
    if not isinstance(value, dict):
        raise InvalidStateError(f"{what} must be a dict; got {type(value).__name__}.")
    return value


def check_keys(mapping: dict, expected: Iterable[str], what: str) -> None:
    """``mapping`` has exactly the keys ``expected`` (order free)."""
    expected = tuple(expected)
    missing = [k for k in expected if k not in mapping]
    unexpected = sorted(str(k) for k in mapping if k not in expected)
    if missing or unexpected:
        raise InvalidStateError(f"{what} must have the keys {list(expected)}: missing {missing}, "
                                f"unexpected {unexpected}.")


def check_shape(value: Any, what: str) -> torch.Size:
    """A logical shape: a tuple / list / torch.Size of non-negative ints."""
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise InvalidStateError(f"{what} shape must be a tuple of non-negative ints; got {value!r}.")
    return torch.Size(value)


def check_nominal_dtype(value: Any, what: str) -> torch.dtype:
    """The nominal (dequantized) dtype: one a quantizer reads."""
    if value not in HIGH_PRECISION_DTYPES:
        raise InvalidStateError(f"{what} dtype must be one of {list(HIGH_PRECISION_DTYPES)}; got {value!r}.")
    return value


def check_label(value: Any, what: str) -> str:
    """The role label: a string."""
    if not isinstance(value, str):
        raise InvalidStateError(f"{what} label must be a str; got {type(value).__name__}.")
    return value


def check_flag(value: Any, what: str) -> bool:
    """A boolean flag (``requires_grad``, ``is_param``, boolean format options)."""
    if not isinstance(value, bool):
        raise InvalidStateError(f"{what} must be True or False; got {value!r}.")
    return value


def check_option(name: str, value: Any, default: Any, choices: Optional[tuple], what: str) -> None:
    """One format option: among ``choices`` when given, else of its default's kind (a bool, a
    positive int)."""
    if choices is not None:
        # a tuple of dtypes or ints: compare by type too, so True is not taken for 1
        if not any(type(value) is type(c) and value == c for c in choices):
            raise InvalidStateError(f"{what} option {name}={value!r} is unknown; expected one of "
                                    f"{list(choices)}.")
    elif isinstance(default, bool):
        check_flag(value, f"{what} option {name}")
    elif isinstance(default, int):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidStateError(f"{what} option {name}={value!r} must be a positive int.")
    else:  # every option has a rule above; a new kind of option must add one
        raise InvalidStateError(f"{what} option {name} has no check for values like {default!r}.")


def check_payload_tensor(t: Any, name: str, direction: str, shape: tuple[int, ...],
                         dtypes: tuple[torch.dtype, ...], what: str) -> None:
    """One payload entry: a plain tensor of the expected shape and one of ``dtypes``."""
    field = f"{what}: {direction} payload {name!r}"
    if type(t) is not torch.Tensor:
        raise InvalidStateError(f"{field} must be a torch.Tensor; got {type(t).__name__}.")
    if t.dtype not in dtypes:
        want = dtypes[0] if len(dtypes) == 1 else f"one of {list(dtypes)}"
        raise InvalidStateError(f"{field} has dtype {t.dtype}; expected {want}.")
    if tuple(t.shape) != tuple(shape):
        raise InvalidStateError(f"{field} has shape {tuple(t.shape)}; expected {tuple(shape)}.")


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor (the object, or a view of the same memory with
    the same geometry)."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())
