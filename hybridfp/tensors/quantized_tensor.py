"""``QuantizedTensor``: a ``torch.Tensor`` subclass wrapping a quantized storage.

It has the logical shape and nominal (high-precision) dtype of the tensor it encodes, so it
can be an ``nn.Parameter``, flow through autograd and be saved with ``torch.save``. Its data
lives in ``storage`` (rowwise and/or columnwise copies). Ops are routed through
``__torch_dispatch__`` to a table of handlers (``hybridfp.tensors.dispatch``); ops without a
handler dequantize, run in high precision and warn once naming the op.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .storage import QuantizedStorage, storage_class
from .validation import check_flag, require_dict

#: The attribute naming a quantized parameter in messages ("Linear.weight"); optimizer state
#: made from the parameter (``zeros_like``) carries it too, as "state of ...".
PARAM_NAME_ATTR = "_hybridfp_param_name"

#: ``Tensor.data``'s own descriptor: :attr:`QuantizedTensor.data` reads through it.
_TENSOR_DATA = torch._C.TensorBase.data

#: aten op -> handler(func, args, kwargs). Filled by ``hybridfp.tensors.dispatch``.
DISPATCH_TABLE: dict[Any, Callable[..., Any]] = {}
#: Called for ops without a handler; set by ``hybridfp.tensors.dispatch``.
FALLBACK: list[Callable[..., Any]] = []


def implements(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a ``__torch_dispatch__`` handler for one or more aten ops."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            DISPATCH_TABLE[op] = fn
        return fn

    return deco


class QuantizedTensor(torch.Tensor):
    """A quantized tensor: logical shape/dtype of the source, payload in ``storage``.

    ``quantizer`` (optional) is the quantizer that made it; in-place updates
    (``copy_`` from a high-precision tensor, optimizer steps) re-quantize through it.
    Usually made by ``Quantizer.quantize`` rather than constructed directly; ``torch.save`` /
    ``torch.load(weights_only=True)`` round-trip it (the quantizer is not saved).

    Parameters
    ----------
    storage:
        The quantized storage (``hybridfp.tensors``): shape, nominal dtype, device and copies.
    quantizer:
        The quantizer that made it, or None.
    requires_grad:
        Whether it requires grad.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> t = hf.Float8CurrentScalingQuantizer()(torch.ones(4, 8))
    >>> t.qstorage.describe(), t.dtype
    ('FP8 per-tensor tensor of shape (4, 8)', torch.float32)
    >>> t.dequantize(torch.bfloat16).dtype
    torch.bfloat16
    """

    _storage: QuantizedStorage
    _quantizer: Optional[Any]

    @staticmethod
    def __new__(cls, storage: QuantizedStorage, quantizer: Optional[Any] = None,
                requires_grad: bool = False) -> "QuantizedTensor":
        t = torch.Tensor._make_wrapper_subclass(
            cls, storage.shape, dtype=storage.dtype, device=storage.device,
            requires_grad=requires_grad,
        )
        t._storage = storage
        t._quantizer = quantizer
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        handler = DISPATCH_TABLE.get(func)
        if handler is not None:
            return handler(func, args, kwargs or {})
        return FALLBACK[0](func, args, kwargs or {})

    # ------------------------------------------------------------------ .data
    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        """A detached alias of this tensor (torch's ``.data``): a QuantizedTensor over the same
        payloads.

        Assigning replaces what this tensor holds by what a QuantizedTensor holds, as torch's
        ``.data =`` does for a plain tensor: its payloads, nominal dtype, device and quantizer.
        ``nn.Module.to(device)`` / ``.cuda()`` / ``.to(dtype)`` / ``.half()`` convert a Parameter
        through it, as do EMA swaps (``p.data, ema.data = ema.data, p.data``) and
        ``torch.nn.utils.vector_to_parameters`` (which assigns plain tensors: refused). The
        Parameter stays the same object (optimizers keep it); its version counter, autograd
        state and name stay; its kept initial value follows the assigned tensor (see
        ``hybridfp.tensors.dispatch.assign_data``).

        Raises
        ------
        TypeError
            Assigning a tensor that is not a QuantizedTensor (e.g. from ``Module.double()``, or
            a plain value): a quantized tensor cannot alias it. Write a value in with
            ``param.copy_(t)`` (re-quantized by its quantizer), assign
            ``param.quantizer.quantize(t)``, or replace the Parameter.
        RuntimeError
            torch refuses the pair (``set_data``: e.g. a meta tensor into a CPU one); nothing
            changed.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
        ...     lin = hf.Linear(32, 32, bias=False)
        >>> lin.weight.data = lin.weight.quantizer.quantize(torch.ones(32, 32))
        >>> lin.weight.dequantize().unique().tolist()
        [1.0]
        >>> _ = lin.to(torch.bfloat16)  # nominal dtype only: the codes are kept
        >>> lin.weight.dtype, lin.weight.dequantize().dtype
        (torch.bfloat16, torch.bfloat16)
        """
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        from .dispatch import assign_data  # dispatch imports this module
        assign_data(self, new)

    # ------------------------------------------------------------------ public API
    @property
    def qstorage(self) -> QuantizedStorage:
        """The quantized storage (rowwise / columnwise payloads)."""
        return self._storage

    @property
    def quantizer(self) -> Optional[Any]:
        """The quantizer that produced this tensor, if known."""
        return self._quantizer

    def set_quantizer(self, quantizer: Any) -> None:
        """Attach the quantizer used for in-place re-quantization (e.g. after loading)."""
        self._quantizer = quantizer

    def dequantize(self, dtype: Optional[torch.dtype] = None, direction: Optional[str] = None) -> torch.Tensor:  # type: ignore[override]
        """High-precision value in the original shape and orientation.

        Parameters
        ----------
        dtype:
            The result's dtype (None: the nominal dtype, ``self.dtype``).
        direction:
            "rowwise", "columnwise", or None for the more precise copy held (rowwise on ties).

        Returns
        -------
        torch.Tensor
            A plain tensor of ``self.shape``.

        Raises
        ------
        MissingDirectionError
            The ``direction`` copy is not held (or no copy is: an empty hybrid).
        ValueError
            An unknown ``direction``.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> t = hf.MXFP8Quantizer(columnwise=False)(torch.ones(2, 32))
        >>> t.dequantize(direction="rowwise").sum().item()
        64.0
        >>> try:
        ...     t.dequantize(direction="columnwise")
        ... except hf.MissingDirectionError:
        ...     print("no columnwise copy")
        no columnwise copy
        """
        return self._storage.dequantize(dtype, direction)

    def has_direction(self, direction: str) -> bool:
        """Whether the ``direction`` copy is held."""
        return self._storage.has(direction)

    def directions(self) -> tuple[str, ...]:
        """The copies held."""
        return self._storage.directions()

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop copies no longer needed (a dropped copy cannot be re-added).

        Parameters
        ----------
        rowwise_usage, columnwise_usage:
            False drops that copy; True requires it to be held; None leaves it.

        Raises
        ------
        MissingDirectionError
            True for a copy that is not held (adding one needs the high-precision source).
        ValueError
            The call would leave no copy.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> t = hf.MXFP8Quantizer()(torch.ones(32, 32))
        >>> t.update_usage(columnwise_usage=False)
        >>> t.directions()
        ('rowwise',)
        """
        self._storage.update_usage(rowwise_usage, columnwise_usage)

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The initial high-precision value kept by
        ``quantized_model_init(preserve_high_precision_init_val=True)`` (on the CPU), or None
        (TransformerEngine's name). Seed FP32 master weights with it.

        The kept value follows in-place writes made through ``__torch_dispatch__`` (``copy_``,
        ``zero_``, ``nn.init`` and other in-place ops) into this tensor, and into a dim-0 slice,
        ``split`` piece, ``view`` / ``reshape``, ``detach()`` / ``.data`` of it (or of those,
        in turn): the elements written take the value written (a quantized source: its
        dequantized value), the others keep theirs, so masters seeded from it start where the
        tensor now is. Writes made to the payload tensors directly (``quantizer.update_quantized``)
        leave it as it was; ``hybridfp.quantize_master_weights`` sets it to the master value it
        writes, and ``MasterWeightOptimizer``'s first step frees it (its masters hold the value
        from then on).

        Returns
        -------
        Optional[torch.Tensor]
            The kept value, of the tensor's shape, or None when none is kept (or it was freed
            with :meth:`clear_high_precision_init_val`).
        """
        return self.__dict__.get("_high_precision_init_val")

    def clear_high_precision_init_val(self) -> None:
        """Free the value :meth:`get_high_precision_init_val` returns (TransformerEngine's name)."""
        self.__dict__.pop("_high_precision_init_val", None)

    def quantized_nbytes(self) -> int:
        """Bytes held by the payloads (the format's true footprint)."""
        return self._storage.nbytes()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"QuantizedTensor({self._storage.describe()}, holds={list(self.directions())}, "
                f"dtype={self.dtype}, device={self.device})")

    def __reduce_ex__(self, protocol: int):  # type: ignore[override]
        is_param = bool(getattr(self, "_is_param", False))  # a saved nn.Parameter loads as one
        return (_rebuild_quantized_tensor, (storage_state(self._storage), self.requires_grad, is_param))


def storage_state(storage: QuantizedStorage) -> dict[str, Any]:
    """A plain-data description of a storage (safe for ``torch.load(weights_only=True)``)."""
    return storage.to_state()


def storage_from_state(state: dict[str, Any]) -> QuantizedStorage:
    """Inverse of :func:`storage_state` (the class is looked up by name in the registry).

    The state usually comes from a file: every field is checked before anything reads it.

    Raises
    ------
    InvalidStateError
        (a ValueError) naming the field that is missing, of the wrong kind, or disagrees with
        the header or the format, and what was expected.
    """
    state = require_dict(state, "saved quantized tensor state")
    return storage_class(state.get("cls")).from_state(state)


def _rebuild_quantized_tensor(state: dict[str, Any], requires_grad: bool,
                              is_param: bool = False) -> QuantizedTensor:
    # called by torch.load with whatever the file holds: check the flags as well as the state
    check_flag(requires_grad, "saved quantized tensor requires_grad")
    check_flag(is_param, "saved quantized tensor is_param")
    t = QuantizedTensor(storage_from_state(state), None, requires_grad=requires_grad)
    if is_param:
        t._is_param = True  # what nn.Parameter(QuantizedTensor) sets (its isinstance check)
    return t


torch.serialization.add_safe_globals([_rebuild_quantized_tensor])
