"""The Triton block-decode kernels (``hybridfp.kernels.triton_decode``) equal the reference
BF16 decode (``bf16_decode.reference_decode_bf16``: ``gemm_operand(direction).values`` rounded
to BF16) bit for bit, and ``decode_bf16``'s cache follows the payload.

CPU: the kernels under ``TRITON_INTERPRET=1`` on tiny, awkward and empty shapes of every
format, plus exhaustive tables (every FP8 code x every E8M0 byte / power-of-two exponent,
subnormal results included; every E2M1 code x every E4M3 scale). GPU (``-m gpu``): real
shapes with fresh random inputs, outputs poisoned.
"""

from __future__ import annotations

import gc

import pytest
import torch
from quantize_kernel_cases import edge_tensor, gpu, gpu_input, interpreter_only

from hybridfp import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer,
                      NVFP4Quantizer)
from hybridfp.formats import mxfp8, nvfp4
from hybridfp.gemm import bf16_decode
from hybridfp.gemm.bf16_decode import DECODERS, decode_bf16, reference_decode_bf16
from hybridfp.kernels import triton_decode
from hybridfp.kernels._common import poisoned_outputs
from hybridfp import policy
from hybridfp.tensors import (COLUMNWISE, ROWWISE, Float8BlockStorage, Float8Storage, MXFP8Storage,
                              NVFP4Storage)

# NaN / inf / overflow inputs are deliberate; numpy (the interpreter) warns about them.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: name -> quantizer maker: every storage layout the decoders cover.
QUANTIZERS = {
    "fp8_e4m3": lambda: Float8CurrentScalingQuantizer(E4M3),
    "fp8_e5m2": lambda: Float8CurrentScalingQuantizer(E5M2),
    "block_1d": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "block_2d": lambda: Float8BlockQuantizer(block_scaling_dim=2),
    "block_1d_e5m2": lambda: Float8BlockQuantizer(E5M2, block_scaling_dim=1),
    "mxfp8_1d": lambda: MXFP8Quantizer(),
    "mxfp8_2d": lambda: MXFP8Quantizer(with_2d_quantization=True),
    "mxfp8_e5m2": lambda: MXFP8Quantizer(E5M2),
    "nvfp4_1d": lambda: NVFP4Quantizer(),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_rht": lambda: NVFP4Quantizer(with_rht=True),
    "nvfp4_row_scaled": lambda: NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False),
}
SHAPES = [(3, 40), (33, 50), (130, 136), (2, 5, 36), (1, 1)]
EMPTY = [(0, 48), (5, 0)]
GPU_SHAPES = [(4096, 4096), (1000, 3000), (4097, 129)]


def assert_operand_bitwise(got, want, what: str) -> None:
    """Same BF16 bits (NaN included: the kernels write torch's NaN for the device), same
    epilogue scale, k and RHT flag."""
    assert got.values.dtype == want.values.dtype == torch.bfloat16, what
    assert got.values.shape == want.values.shape, f"{what}: {got.values.shape} != {want.values.shape}"
    diff = got.values.contiguous().view(torch.int16) != want.values.contiguous().view(torch.int16)
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} of {diff.numel()} values differ"
    assert (got.k, got.rht) == (want.k, want.rht), what
    if want.scale is None:
        assert got.scale is None, what
    else:
        assert torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32)), what


def _storages(name: str, x: torch.Tensor):
    """Quantized on ``x``'s device by the reference (kernels off): what is tested is the decode
    of a given payload (the CUDA quantize kernels equal the reference bitwise,
    tests/kernels/test_kernels_*; this keeps their compilation out of these tests, and the
    PyTorch reference runs on the GPU in milliseconds where the CPU took seconds)."""
    q = QUANTIZERS[name]()
    if name == "nvfp4_row_scaled":
        q.set_usage(rowwise=True, columnwise=False)
    with policy(quantize_kernels=False):
        return q(x).qstorage


def _check_all_copies(name: str, x: torch.Tensor) -> None:
    s = _storages(name, x)
    for d in s.directions():
        part = s.part(d)
        with poisoned_outputs():
            got = DECODERS[type(part)](part, d)
        assert_operand_bitwise(got, reference_decode_bf16(part, d), f"{name} {tuple(x.shape)} {d}")


# ---------------------------------------------------------------------------- CPU (interpreter)
@interpreter_only
@pytest.mark.parametrize("shape", SHAPES + EMPTY, ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_decode_matches_reference(name, shape):
    """Every stored copy of every format, edge values included (NaN / inf only where the
    format keeps them as such: they make whole blocks NaN elsewhere, checked separately)."""
    _check_all_copies(name, edge_tensor(shape, torch.float32, seed=len(shape) + shape[-1]))


@interpreter_only
@pytest.mark.parametrize("name", ["mxfp8_1d", "nvfp4_1d", "block_1d"])
def test_decode_grid_fallback(monkeypatch, name):
    """Past the 2D grid's row-tile limit (patched down to 2 here) the decode launches on the 1D
    grid (``_common.tile_grid``): the same values."""
    from hybridfp.kernels import _common
    monkeypatch.setattr(_common, "GRID_Y_MAX", 2)
    assert not _common.tile_grid(40, 64, 4, 512)[1]
    _check_all_copies(name, edge_tensor((40, 64), torch.float32, seed=7))


@interpreter_only
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "mxfp8_1d", "mxfp8_e5m2", "block_1d", "nvfp4_1d"])
def test_decode_specials(name):
    """NaN / inf inputs: NaN blocks (MXFP8 scale 0xFF, NVFP4 NaN E4M3 scale) and E5M2 inf."""
    _check_all_copies(name, edge_tensor((33, 72), torch.float32, seed=5, specials=True))


def _all_codes(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(dtype)


@interpreter_only
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_mxfp8_every_code_times_every_scale(dtype):
    """Row e holds all 256 codes (8 blocks) with E8M0 byte e: 0 (2**-127) .. 254, 255 (NaN)
    — subnormal, overflowing and NaN products included."""
    data = _all_codes(dtype).repeat(256, 1)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    ref = mxfp8.dequantize_1d(data, scale).to(torch.bfloat16)
    got = triton_decode.decode_mxfp8(data, scale)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@interpreter_only
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_block_every_code_times_every_pow2(dtype):
    """Power-of-two scale_inv 2**-149 (FP32 subnormals) .. 2**127, 1x128 blocks."""
    exps = torch.arange(-149, 128)
    data = _all_codes(dtype).repeat(exps.numel(), 1)
    scale_inv = torch.exp2(exps.double()).float()[:, None].repeat(1, 2)
    assert bool((scale_inv > 0).all())
    ref = torch.cat([data[:, :128].float() * scale_inv[:, :1], data[:, 128:].float() * scale_inv[:, 1:]], 1)
    got = triton_decode.decode_fp8_block(data, scale_inv, block=128, block_dim=1)
    assert torch.equal(got.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))


@interpreter_only
def test_nvfp4_every_code_times_every_scale():
    """Row s: the 16 E2M1 codes twice (a 1x16 block... two of them) with E4M3 scale byte s."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    packed = nvfp4.pack_fp4(codes[None, :].repeat(256, 1))
    scale = torch.arange(256, dtype=torch.uint8).view(E4M3)[:, None].repeat(1, 2)
    ref = nvfp4.decode_blocks_1d(packed, scale, 32).to(torch.bfloat16)
    got = triton_decode.decode_nvfp4(packed, scale, 32)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@interpreter_only
def test_strided_payload_is_decoded_as_stored():
    """A dim-0 slice of a columnwise copy is a strided view of its payload."""
    data, scale = mxfp8.quantize_1d(edge_tensor((40, 96), torch.float32, seed=9))
    view = data[:, :64]
    assert not view.is_contiguous()
    got = triton_decode.decode_mxfp8(view, scale[:, :2])
    assert torch.equal(got.view(torch.int16),
                       mxfp8.dequantize_1d(view, scale[:, :2]).to(torch.bfloat16).view(torch.int16))


def test_decoder_rejects_wrong_scale_shape():
    data, scale = mxfp8.quantize_1d(torch.randn(4, 64))
    with pytest.raises(ValueError, match="MXFP8 scale"):
        triton_decode.decode_mxfp8(data, scale[:, :1])


def test_every_exact_storage_has_a_kernel_decoder():
    assert set(DECODERS) == {MXFP8Storage, NVFP4Storage, Float8Storage, Float8BlockStorage}


# ---------------------------------------------------------------------------- cache (any device)
def _mx_weight() -> torch.Tensor:
    return MXFP8Quantizer()(torch.randn(64, 96))


def test_cache_hits_until_the_payload_changes_in_place():
    w = _mx_weight()
    s = w.qstorage
    first = decode_bf16(s, ROWWISE, cache=True)
    assert decode_bf16(s, ROWWISE, cache=True) is first
    assert decode_bf16(s, ROWWISE) is not first  # cache=False never reuses
    # Rebuilt from the same payload tensors (how backward re-assembles saved weights): a hit.
    rebuilt = s.with_tensors(s.tensors())
    assert decode_bf16(rebuilt, ROWWISE, cache=True) is first
    # In-place re-quantization bumps the payload versions: a new, correct decode.
    MXFP8Quantizer().update_quantized(torch.randn(64, 96) * 3, w)
    again = decode_bf16(s, ROWWISE, cache=True)
    assert again is not first
    assert torch.equal(again.values, reference_decode_bf16(s, ROWWISE).values)
    # A scale rewritten alone also invalidates.
    s.payload(ROWWISE)["scale"].add_(1)
    assert decode_bf16(s, ROWWISE, cache=True) is not again


def test_cache_is_per_direction_and_outside_the_payload():
    w = _mx_weight()
    s = w.qstorage
    n_tensors, state = len(s.tensors()), s.to_state()
    row = decode_bf16(s, ROWWISE, cache=True)
    col = decode_bf16(s, COLUMNWISE, cache=True)
    assert row.values.shape == (64, 96) and col.values.shape == (96, 64)
    assert decode_bf16(s, COLUMNWISE, cache=True) is col
    assert len(s.tensors()) == n_tensors
    after = s.to_state()["payloads"]
    assert after.keys() == state["payloads"].keys()
    for d, p in after.items():  # the same payload tensors, nothing added
        assert p.keys() == state["payloads"][d].keys()
        assert all(p[n] is state["payloads"][d][n] for n in p)


def test_cache_entry_dies_with_its_payload():
    bf16_decode.clear_decode_cache()
    w = _mx_weight()
    decode_bf16(w.qstorage, ROWWISE, cache=True)
    assert len(bf16_decode._CACHE) == 1
    del w
    gc.collect()
    assert len(bf16_decode._CACHE) == 0


def test_inference_tensors_are_decoded_but_not_cached():
    with torch.inference_mode():
        w = _mx_weight()
    s = w.qstorage
    assert decode_bf16(s, ROWWISE, cache=True) is not decode_bf16(s, ROWWISE, cache=True)


# ---------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_gpu_decode_matches_reference(name, shape):
    """Fresh random inputs (see ``_storages``); the decode kernel vs the reference (torch on
    the GPU), outputs poisoned."""
    _check_all_copies(name, gpu_input(shape, torch.bfloat16))


@gpu
def test_gpu_exhaustive_tables():
    for dtype in (E4M3, E5M2):
        data = _all_codes(dtype).repeat(256, 1).cuda()
        scale = torch.arange(256, dtype=torch.uint8, device="cuda")[:, None].repeat(1, 8)
        ref = mxfp8.dequantize_1d(data, scale).to(torch.bfloat16)
        assert torch.equal(triton_decode.decode_mxfp8(data, scale).view(torch.int16), ref.view(torch.int16))
        exps = torch.arange(-149, 128, device="cuda")
        d2 = _all_codes(dtype).cuda().repeat(exps.numel(), 1)
        si = torch.exp2(exps.double()).float()[:, None].repeat(1, 2)
        ref2 = torch.cat([d2[:, :128].float() * si[:, :1], d2[:, 128:].float() * si[:, 1:]], 1)
        got2 = triton_decode.decode_fp8_block(d2, si, block=128, block_dim=1)
        assert torch.equal(got2.view(torch.int16), ref2.to(torch.bfloat16).view(torch.int16))


@gpu
def test_gpu_nvfp4_exhaustive_table():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    packed = nvfp4.pack_fp4(codes[None, :].repeat(256, 1)).cuda()
    sc = torch.arange(256, dtype=torch.uint8).view(E4M3)[:, None].repeat(1, 2).cuda()
    ref3 = nvfp4.decode_blocks_1d(packed, sc, 32).to(torch.bfloat16)
    assert torch.equal(triton_decode.decode_nvfp4(packed, sc, 32).view(torch.int16), ref3.view(torch.int16))


# ---------------------------------------------------------------------------- NVFP4 pairs
NVFP4_PAIR_SHAPES = [(1, 2), (3, 16), (17, 30), (40, 96), (33, 530), (64, 512)]


@interpreter_only
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("shape", NVFP4_PAIR_SHAPES, ids=str)
def test_nvfp4_pairs_equal_per_element(shape, block_2d):
    """The int32-pair store and the per-element store give the same bits as the reference
    (random codes incl. -0.0, random scale bytes incl. subnormal E4M3 and NaN 0x7F)."""
    r, c = shape
    g = torch.Generator().manual_seed(r * 1000 + c)
    packed = torch.randint(0, 256, (r, -(-c // 2)), dtype=torch.uint8, generator=g)
    sr = -(-r // 16) if block_2d else r
    scale = torch.randint(0, 256, (sr, -(-c // 16)), dtype=torch.uint8, generator=g).view(E4M3)
    rep = scale.repeat_interleave(16, 0)[:r] if block_2d else scale
    ref = nvfp4.decode_blocks_1d(packed, rep, c).to(torch.bfloat16).view(torch.int16)
    for pairs in (False, True):
        got = triton_decode.decode_nvfp4(packed, scale, c, block_2d=block_2d, pairs=pairs)
        assert torch.equal(got.view(torch.int16), ref), pairs


def test_nvfp4_pairs_need_even_columns():
    packed = torch.zeros(2, 2, dtype=torch.uint8)
    scale = torch.zeros(2, 1, dtype=torch.uint8).view(E4M3)
    with pytest.raises(ValueError, match="even number of columns"):
        triton_decode.decode_nvfp4(packed, scale, 3, pairs=True)


@gpu
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 14336), (4113, 1000), (16, 30)], ids=str)
def test_gpu_nvfp4_pairs(shape, block_2d):
    """The pair-store variant on a CUDA GPU at real and awkward shapes, fresh random bytes,
    poisoned output (this test passing is why triton_decode.PAIRS_BY_DEFAULT holds "cuda")."""
    r, c = shape
    packed = torch.randint(0, 256, (r, -(-c // 2)), dtype=torch.uint8, device="cuda")
    sr = -(-r // 16) if block_2d else r
    scale = torch.randint(0, 256, (sr, -(-c // 16)), dtype=torch.uint8, device="cuda").view(E4M3)
    rep = scale.repeat_interleave(16, 0)[:r] if block_2d else scale
    ref = nvfp4.decode_blocks_1d(packed, rep, c).to(torch.bfloat16).view(torch.int16)
    for pairs in (False, True):
        with poisoned_outputs():
            got = triton_decode.decode_nvfp4(packed, scale, c, block_2d=block_2d, pairs=pairs)
        assert torch.equal(got.view(torch.int16), ref), pairs
