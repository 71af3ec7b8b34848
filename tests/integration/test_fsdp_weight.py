"""``QuantizedGatherWeight`` outside FSDP2: the plain weight it wraps, in every other use.

A model prepared with ``enable_quantized_all_gather`` but not (yet, or not wholly) sharded
trains exactly as before, its optimizer state and its saved state are plain tensors (loadable
with ``weights_only=True``), and a deep copy's weights are weights of their own.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import hybridfp as hf

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(hf.Linear(64, 64), torch.nn.GELU(), hf.Linear(64, 32))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        y = model(x)
    y.square().sum().backward()
    opt.step()
    opt.zero_grad()
    return y.detach()


def test_unsharded_weights_train_as_plain_ones() -> None:
    plain, wrapped = _model(), _model()
    assert hf.enable_quantized_all_gather(wrapped) == 2
    assert type(wrapped[0].weight).__name__ == "QuantizedGatherWeight"
    opt_p, opt_w = torch.optim.AdamW(plain.parameters()), torch.optim.AdamW(wrapped.parameters())
    for _ in range(2):
        assert torch.equal(_step(plain, opt_p), _step(wrapped, opt_w))
    assert torch.equal(plain[0].weight.detach(), wrapped[0].weight._hp)
    assert all(type(t) is torch.Tensor for st in opt_w.state.values() for t in st.values() if torch.is_tensor(t))


def test_saved_state_is_plain_tensors() -> None:
    model = _model()
    hf.enable_quantized_all_gather(model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert type(loaded["0.weight"]) is torch.Tensor
    assert torch.equal(loaded["0.weight"], model[0].weight._hp)


def test_a_deep_copy_has_weights_of_its_own() -> None:
    model = _model()
    hf.enable_quantized_all_gather(model)
    twin = copy.deepcopy(model)
    assert twin[0].weight._slot is not model[0].weight._slot
    assert twin[0].weight._hp.data_ptr() != model[0].weight._hp.data_ptr()


def test_bad_options_refused_and_quantized_parameters_become_primary_weights() -> None:
    with pytest.raises(ValueError, match="copies='sideways'"):
        hf.enable_quantized_all_gather(_model(), copies="sideways")
    with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
        held = hf.Linear(64, 32)
    want = held.weight.dequantize()
    assert hf.enable_quantized_all_gather(held) == 1
    # the Parameter FSDP2 will shard is the FP32 master, seeded from the held weight's value
    assert isinstance(held.weight.data, hf.QuantizedPrimaryWeight)
    assert torch.equal(held.weight.data._hp.float(), want.float())
