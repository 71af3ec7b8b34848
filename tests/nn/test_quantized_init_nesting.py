"""Which modules ``quantized_model_init`` quantizes when hybridfp modules are built inside the
constructor of another: every module it creates is quantized once (a user's adapter built
inside a subclass of ``hybridfp.Linear`` included), and the parts LayerNormLinear /
LayerNormMLP build only to take over their initialised weights are quantized once, under the
owner's roles. A module created on the meta device with ``preserve_high_precision_init_val``
has no initial value to keep: a clear error naming the option."""

from __future__ import annotations

import pytest
import torch

import hybridfp as hf
from hybridfp.tensors import QuantizedTensor


class _WithAdapter(hf.Linear):
    """A Linear subclass building another hybridfp module in its constructor."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.adapter = hf.Linear(n, n // 2)


class _Block(torch.nn.Module):
    """A plain module holding a LayerNormMLP and a Linear built in a QuantizedModule's stead."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = hf.LayerNormMLP(32, 64)
        self.head = _WithAdapter(32)


@pytest.mark.parametrize("recipe", [hf.MXFP8BlockScaling, hf.Float8CurrentScaling])
def test_a_module_built_inside_another_is_quantized(recipe):
    with hf.quantized_model_init(recipe=recipe()):
        m = _WithAdapter(32)
    assert isinstance(m.weight, QuantizedTensor) and isinstance(m.adapter.weight, QuantizedTensor)
    x = torch.randn(4, 32)
    with hf.autocast(recipe=recipe()):
        y = m.adapter(m(x))
    assert y.shape == (4, 16) and torch.isfinite(y).all()


def test_parts_taken_over_are_quantized_once_under_the_owners_roles():
    """LayerNormMLP's fc1 / fc2 weights and LayerNormLinear's weight are quantized with the
    owner's roles (``<name>.fc1`` ...), not as the temporary Linears they were built as."""
    with hf.quantized_model_init(recipe=hf.Float8CurrentScaling()):
        mlp = hf.LayerNormMLP(32, 64, name="mlp")
        lnl = hf.LayerNormLinear(32, 16, name="lnl")
        block = _Block()
    for p in (mlp.fc1_weight, mlp.fc2_weight, lnl.weight, block.mlp.fc1_weight, block.head.adapter.weight):
        assert isinstance(p, QuantizedTensor)
    assert [str(p._quantizer.role) for p in (mlp.fc1_weight, mlp.fc2_weight, lnl.weight)] == [
        "mlp.fc1.weight", "mlp.fc2.weight", "lnl.weight"]
    assert all(isinstance(p, torch.nn.Parameter) and not isinstance(p, QuantizedTensor)
               for p in (mlp.layer_norm_weight, lnl.layer_norm_weight))


def test_meta_device_with_a_kept_initial_value_is_refused_by_name():
    with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling(), preserve_high_precision_init_val=True):
        with pytest.raises(ValueError, match="preserve_high_precision_init_val=True.*Linear.weight is on the meta device"):
            hf.Linear(32, 32, device="meta")
    with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
        lin = hf.Linear(32, 32, device="meta")  # without a kept value: built, its weight quantized (meta)
    assert isinstance(lin.weight, QuantizedTensor) and lin.weight.is_meta
