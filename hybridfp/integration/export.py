"""``export_state_dict``: a model's state dict as plain tensors (quantized weights dequantized),
for formats that take only plain tensors (safetensors) and for loading into a plain PyTorch
model as high-precision weights."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..tensors import QuantizedTensor

#: The suffix of the state-dict entries that hold hybridfp modules' quantizer state.
EXTRA_STATE_SUFFIX = "_extra_state"


def export_state_dict(model: nn.Module, dtype: Optional[torch.dtype] = torch.bfloat16) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as plain, contiguous tensors: each ``QuantizedTensor`` (a weight
    held by ``quantized_model_init``) dequantized from its rowwise copy, floating-point tensors
    in ``dtype``, the quantizers' state (``_extra_state`` entries) left out.

    ``safetensors.torch.save_file`` takes the result; so does ``load_state_dict`` of the same
    architecture built from plain ``torch.nn`` modules (high-precision weights). To resume
    training keep ``model.state_dict()`` itself (``torch.save`` or
    ``torch.distributed.checkpoint``): it holds the quantized payloads and the quantizer state.

    Parameters
    ----------
    model:
        Any module (hybridfp modules with quantized or high-precision weights).
    dtype:
        The floating-point dtype of the exported tensors (None: each tensor's own dtype; a
        quantized weight's nominal dtype).

    Returns
    -------
    dict[str, torch.Tensor]
        Name -> plain tensor.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
    ...     lin = hf.Linear(32, 16)
    >>> sd = hf.export_state_dict(lin)
    >>> {k: (type(v).__name__, v.dtype) for k, v in sd.items()}
    {'weight': ('Tensor', torch.bfloat16), 'bias': ('Tensor', torch.bfloat16)}
    >>> plain = torch.nn.Linear(32, 16, dtype=torch.bfloat16)
    >>> plain.load_state_dict(sd)
    <All keys matched successfully>
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name.rsplit(".", 1)[-1] == EXTRA_STATE_SUFFIX:
            continue
        if isinstance(value, QuantizedTensor):
            value = value.dequantize(dtype)
        elif dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(dtype)
        out[name] = value.detach().contiguous()
    return out
