"""``quantize_grouped``'s fused pass for a Hybrid(NVFP4 1D with a global amax, MXFP8 1D,
"rowwise_dequantized") over row groups (Composer-2's expert weights; any such activation):
``grouped_scaled.nvfp4_mxfp8_groups`` — a segmented amax and one ``triton_hybrid_nvfp4`` pass
over the zero-padded groups — gives every expert, bit for bit, its own quantize's copies (the
NVFP4 rowwise copy with its own amax, the MXFP8 columnwise copy of its dequantized value).
Interpreter on tiny awkward splits (CPU, the kernel path forced); compiled at MoE shapes with
``-m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import assert_storage_bitwise, edge_tensor, gpu, gpu_input, interpreter_only  # noqa: E402

from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer, fast  # noqa: E402
from hybridfp.moe import quantize_scaled as grouped_scaled
from hybridfp.moe.quantize import quantize_grouped  # noqa: E402
from hybridfp.moe.quantize_weights import quantize_weights_grouped  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # empty experts' amax 0


def hybrid() -> HybridQuantizer:
    return HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), "rowwise_dequantized")


def check(x: torch.Tensor, splits, monkeypatch, weights: bool = False) -> None:
    calls = []
    real = grouped_scaled.nvfp4_mxfp8_groups
    monkeypatch.setattr(grouped_scaled, "nvfp4_mxfp8_groups", lambda *a: calls.append(1) or real(*a))
    import hybridfp.moe.quantize as qgrouped
    monkeypatch.setattr(qgrouped, "nvfp4_mxfp8_groups", grouped_scaled.nvfp4_mxfp8_groups)
    with poisoned_outputs(0x7F):
        if weights:
            got = quantize_weights_grouped([hybrid() for _ in splits], list(torch.split(x, splits)))
        else:
            got = quantize_grouped([hybrid() for _ in splits], x, splits)
    assert calls == [1]  # the fused grouped pass ran
    for e, (g, xe) in enumerate(zip(got, torch.split(x, splits))):
        want = hybrid().reference_encode(xe, True, True)
        for d in ("rowwise", "columnwise"):
            assert_storage_bitwise(g.qstorage.part(d), want.part(d), f"expert {e} {d}")


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_grouped_hybrid_equals_each_experts_encode(dtype, monkeypatch):
    """Empty experts, one-row experts, counts below / above 32; per-expert magnitudes so each
    expert's global amax differs; stacked weights (no padding) too."""
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    splits = [0, 1, 37, 0, 32, 5]
    mag = torch.cat([torch.full((m, 1), 2.0 ** (3 * e - 6)) for e, m in enumerate(splits)])
    x = (edge_tensor((sum(splits), 48), torch.float32, seed=5) * mag).to(dtype)
    check(x, splits, monkeypatch)
    w = (edge_tensor((4 * 32, 48), torch.float32, seed=6)).to(dtype)
    check(w, [32] * 4, monkeypatch, weights=True)


@gpu
def test_gpu_fused_grouped_hybrid_moe_shapes(monkeypatch):
    """Stacked expert weights (8 x [1408, 4096]) and an uneven activation split, fresh random."""
    w = gpu_input((8 * 1408, 4096), torch.bfloat16)
    check(w, [1408] * 8, monkeypatch, weights=True)
    splits = [4100, 0, 3900, 33, 4096, 8000]
    check(gpu_input((sum(splits), 2048), torch.bfloat16), splits, monkeypatch)


@interpreter_only
def test_kernels_disabled_means_no_grouped_kernels(monkeypatch):
    """Inside ``policy(quantize_kernels=False)`` the grouped padding and the fused grouped pass stay off
    too (a reference comparison must not compare the kernels with themselves)."""
    from hybridfp.kernels.moe import triton_pad_rows
    from hybridfp import policy

    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    used = []
    import hybridfp.moe.quantize as qgrouped
    monkeypatch.setattr(qgrouped, "nvfp4_mxfp8_groups", lambda *a: used.append("fused"))
    monkeypatch.setattr(triton_pad_rows, "pad_rows", lambda *a: used.append("pad"))
    splits = [0, 5, 37]
    x = edge_tensor((sum(splits), 48), torch.float32, seed=2).bfloat16()
    with policy(quantize_kernels=False):
        got = quantize_grouped([hybrid() for _ in splits], x, splits)
    assert used == []
    for g, xe in zip(got, torch.split(x, splits)):
        want = hybrid().reference_encode(xe, True, True)
        for d in ("rowwise", "columnwise"):
            assert_storage_bitwise(g.qstorage.part(d), want.part(d), d)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_local_hybrid_through_the_kernels(dtype, monkeypatch):
    """Composer-2's input hybrid (row-scaled NVFP4 -> MXFP8 from the rowwise value) on the
    kernel route: ``pad_rows`` pads the groups, the fused hybrid kernel encodes the padded
    tensor (zero padding rows: row amax 0) — every expert equals its own reference encode."""
    from hybridfp.kernels.moe import triton_pad_rows

    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    pads = []
    real = triton_pad_rows.pad_rows
    monkeypatch.setattr(triton_pad_rows, "pad_rows", lambda *a: pads.append(1) or real(*a))

    def make() -> HybridQuantizer:
        return HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), "rowwise_dequantized")
    splits = [0, 1, 37, 0, 32, 5]
    x = edge_tensor((sum(splits), 48), torch.float32, seed=8).to(dtype)
    with poisoned_outputs(0x7F):
        got = quantize_grouped([make() for _ in splits], x, splits)
    assert pads == [1]
    for e, (g, xe) in enumerate(zip(got, torch.split(x, splits))):
        want = make().reference_encode(xe, True, True)
        for d in ("rowwise", "columnwise"):
            assert_storage_bitwise(g.qstorage.part(d), want.part(d), f"expert {e} {d}")
