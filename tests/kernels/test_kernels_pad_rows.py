"""The row-group padding kernel (hybridfp/kernels/moe/triton_pad_rows.py) and ``quantize_grouped``'s
``pad_row_groups`` on top of it: the padded source of a shared columnwise block encoding equals, bit
for bit, the PyTorch zero-fill + ``index_copy_`` form, for BF16 / FP16 / FP32 (NaN payloads,
-0.0 and subnormals included: the elements move as raw bits), empty and one-row groups,
strided sources, poisoned outputs. Interpreter on tiny shapes (CPU); compiled at an MoE shape
with ``-m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import edge_tensor, gpu, gpu_input, interpreter_only  # noqa: E402

from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.kernels.moe.triton_pad_rows import pad_rows  # noqa: E402
from hybridfp.moe import quantize as qgrouped

#: empty groups first and last, one-row groups, counts below / above / at a block
SPLITS = [0, 1, 37, 0, 32, 5, 70, 0]


def reference_padded(src: torch.Tensor, splits, block: int) -> torch.Tensor:
    """Zero rows after each group up to a multiple of ``block``, by plain slicing."""
    parts = []
    for xe in torch.split(src, splits):
        pad = -(-xe.shape[0] // block) * block - xe.shape[0]
        parts += [xe, src.new_zeros(pad, src.shape[1])]
    return torch.cat(parts)


def specials(src: torch.Tensor) -> torch.Tensor:
    """NaN with a payload, -0.0 and a subnormal in the first rows (their bits must survive)."""
    out = src.clone()
    if out.numel() >= 3:
        bits = {torch.float32: (0x7FC01234, torch.int32), torch.float16: (0x7E12, torch.int16),
                torch.bfloat16: (0x7FC1, torch.int16)}[out.dtype]
        out.view(bits[1]).view(-1)[0] = bits[0]
        out.view(-1)[1] = -0.0
        out.view(-1)[2] = torch.finfo(out.dtype).tiny / 4
    return out


def check(src: torch.Tensor, splits, block: int) -> None:
    with poisoned_outputs(0x7F):
        got, starts = qgrouped.pad_row_groups(src, splits, block)
    want = reference_padded(src, splits, block)
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = torch.int32 if src.element_size() == 4 else torch.int16
    assert torch.equal(got.contiguous().view(bits), want.view(bits))
    assert starts == qgrouped._offsets(splits, block)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [32, 128])
def test_pad_rows_matches_the_reference_bitwise(dtype, block, monkeypatch):
    """The kernel path, forced on the CPU tensors the interpreter runs on."""
    monkeypatch.setattr(qgrouped.fast, "device_ok", lambda x: True)
    src = specials(edge_tensor((sum(SPLITS), 40), torch.float32, seed=3, specials=True).to(dtype))
    check(src, SPLITS, block)
    wide = specials(edge_tensor((sum(SPLITS), 2 * 40), torch.float32, seed=4).to(dtype))
    check(wide[:, ::2], SPLITS, block)  # not unit column stride: the PyTorch form takes it
    check(wide[:, :40], SPLITS, block)  # row stride 80


@interpreter_only
def test_pad_rows_edges_and_errors():
    src = torch.randn(5, 3)
    row_map = torch.tensor([4, -1, 0, -1, -1, 2], dtype=torch.int32)
    got = pad_rows(src, row_map)
    assert torch.equal(got, torch.stack([src[4], torch.zeros(3), src[0], torch.zeros(3), torch.zeros(3), src[2]]))
    assert pad_rows(src, torch.zeros(0, dtype=torch.int32)).shape == (0, 3)
    with pytest.raises(ValueError, match="int32 row map"):
        pad_rows(src, row_map.long())
    with pytest.raises(ValueError, match="contiguous"):
        pad_rows(src, torch.zeros(12, dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="unit column stride"):
        pad_rows(torch.randn(4, 6)[:, ::2], row_map)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_padded_moe_shape(dtype):
    """An MoE activation (16384 x 2 rows, hidden 4096) over 8 uneven experts, fresh random."""
    splits = [4100, 3900, 0, 4096, 4001, 4200, 4000, 8471]
    check(gpu_input((sum(splits), 4096), dtype, specials=True), splits, 32)
    check(gpu_input((sum(SPLITS), 136), dtype, specials=True), SPLITS, 128)
