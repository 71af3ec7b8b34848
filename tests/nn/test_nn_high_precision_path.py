"""Outside hybridfp.autocast the modules run F.linear with the parameters cast to the
activation dtype (FP32 master weights accept BF16 activations, as inside autocast)."""

import pytest
import torch
import torch.nn.functional as F

from hybridfp import GroupedLinear, LayerNormLinear, Linear


@pytest.mark.parametrize("bias", [True, False])
def test_linear_bf16_input_fp32_params(bias):
    torch.manual_seed(0)
    m = Linear(32, 16, bias=bias)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    want = F.linear(x, m.weight.bfloat16(), m.bias.bfloat16() if bias else None)
    got = m(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_layernorm_linear_bf16_input_fp32_params():
    torch.manual_seed(0)
    m = LayerNormLinear(32, 16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    h = m.norm(x)
    assert torch.equal(m(x), F.linear(h, m.weight.bfloat16(), m.bias.bfloat16()))


def test_grouped_linear_bf16_input_fp32_params():
    torch.manual_seed(0)
    m = GroupedLinear(3, 32, 16)
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    got = m(x, [3, 0, 4])
    want = torch.cat([F.linear(x[:3], m.weight0.bfloat16(), m.bias0.bfloat16()),
                      F.linear(x[3:], m.weight2.bfloat16(), m.bias2.bfloat16())])
    assert torch.equal(got, want)


def test_gradients_reach_fp32_params():
    m = Linear(8, 4)
    m(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and m.weight.grad.abs().sum() > 0
