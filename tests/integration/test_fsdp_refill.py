"""FSDP2's later gathers write the unsharded weight's own tensors with their version counters
preserved (autograd saved them in the forward); the caches keyed on a tensor's version must
still see the new values."""

from __future__ import annotations

import torch

import hybridfp as hf
from hybridfp.gemm.bf16_decode import decode_bf16
from hybridfp.integration.fsdp import _refill
from hybridfp.tensors import ROWWISE


def test_a_later_gather_is_seen_by_the_cached_decode() -> None:
    q = hf.MXFP8Quantizer()
    q.set_usage(rowwise=True, columnwise=False)
    g = torch.Generator().manual_seed(0)
    out = q.quantize(torch.randn(64, 64, generator=g))  # the unsharded weight, first gather
    new = q.quantize(torch.randn(64, 64, generator=g))  # the next step's gathered copies
    old = decode_bf16(out.qstorage, ROWWISE, cache=True).values.clone()  # the step's fprop
    payload = out.qstorage.payloads[ROWWISE]
    ptrs, versions = [t.data_ptr() for t in payload.values()], [t._version for t in payload.values()]
    _refill(out, new, {(ROWWISE, n): t for n, t in new.qstorage.payloads[ROWWISE].items()}, (ROWWISE,))
    # the case a cache keyed on data_ptr and _version alone cannot tell from no write at all
    assert [t.data_ptr() for t in payload.values()] == ptrs
    assert [t._version for t in payload.values()] == versions
    want = decode_bf16(new.qstorage, ROWWISE).values
    assert not torch.equal(want, old)
    assert torch.equal(decode_bf16(out.qstorage, ROWWISE, cache=True).values, want)


def test_the_shared_nvfp4_decode_scale_follows_a_preserved_version_write() -> None:
    from hybridfp.formats.nvfp4 import global_decode_scale, shared_global_decode_scale
    from hybridfp.utils.rewrites import note_rewrite
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    piece = base[1:3]
    first = shared_global_decode_scale(piece).clone()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(base):
        base.mul_(8.0)
    note_rewrite(base)
    assert torch.equal(shared_global_decode_scale(piece), global_decode_scale(piece))
    assert not torch.equal(first, global_decode_scale(piece))
