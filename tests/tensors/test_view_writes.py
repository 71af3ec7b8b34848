"""Writes through a dim-0 slice, split piece, view or detached alias of a quantized tensor.

Such a tensor shares its base's payload memory but not its payload tensors' version counters.
A write through it must still reach what is keyed on the base: its cached BF16 decodes
(``gemm.bf16_decode``) and its kept initial high-precision value
(``quantized_model_init(preserve_high_precision_init_val=True)``), from which master weights
are seeded.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch

import hybridfp
from hybridfp.gemm.bf16_decode import bf16_exact_reason, decode_bf16
from hybridfp.utils.rewrites import version
from tensor_cases import assert_bitwise, case_params, make_input, quantize

#: slice writes re-encode only the slice's own blocks in these formats (no per-tensor scale)
BLOCK_LOCAL = ["mxfp8", "mxfp8_2d", "fp8_block_1d", "hybrid_identity_mxfp8"]

#: name -> a write of ones (or zeros) into entries [0, g) of dim 0, through a tensor made from w
WRITES = {
    "slice copy_": lambda w, g: w[0:g].copy_(torch.ones(g, *w.shape[1:])),
    "slice zero_": lambda w, g: w[0:g].zero_(),
    "split copy_": lambda w, g: torch.split(w, g)[0].copy_(torch.ones(g, *w.shape[1:])),
    "split_with_sizes copy_": lambda w, g: torch.split(w, [g, w.shape[0] - g])[0].copy_(
        torch.ones(g, *w.shape[1:])),
    "slice of a view copy_": lambda w, g: w.view(-1, w.shape[-1])[0:g].copy_(torch.ones(g, w.shape[-1])),
    "detach slice copy_": lambda w, g: w.detach()[0:g].copy_(torch.ones(g, *w.shape[1:])),
    "data slice copy_": lambda w, g: w.data[0:g].copy_(torch.ones(g, *w.shape[1:])),
    "slice fill_": lambda w, g: w[0:g].fill_(1.0),
}


#: name -> a write of zeros into entries [0, g) of dim 0 through a tensor made from a temporary:
#: a detached alias does not keep its source alive, so a tensor between is gone by the write
THROUGH_TEMPORARIES = {
    "data of a slice": lambda w, g: w[0:g].data.zero_(),
    "detach of a slice": lambda w, g: w[0:g].detach().zero_(),
    "slice of data of data": lambda w, g: w.data.data[0:g].zero_(),
    "slice of detach of detach": lambda w, g: w.detach().detach()[0:g].zero_(),
    "slice of detach of a slice": lambda w, g: w[0:2 * g].detach()[0:g].zero_(),
    "slice of detach of a view": lambda w, g: w.view(-1, w.shape[-1]).detach()[0:g].zero_(),
    "view of detach, sliced": lambda w, g: w.detach().view(-1, w.shape[-1])[0:g].zero_(),
    "split of detach of detach": lambda w, g: torch.split(w.detach().detach(), g)[0].zero_(),
}


def _written(name: str, shape, g: int) -> torch.Tensor:
    """The value entries [0, g) of dim 0 hold after write ``name``."""
    return (torch.zeros if "zero_" in name else torch.ones)(g, *shape[1:])


def _weight(recipe: hybridfp.Recipe = None, rows: int = 96, cols: int = 64) -> torch.nn.Parameter:
    torch.manual_seed(0)
    with hybridfp.quantized_model_init(recipe=recipe or hybridfp.MXFP8BlockScaling(),
                                       preserve_high_precision_init_val=True):
        return hybridfp.Linear(cols, rows, bias=False).weight


def _decodable(t: hybridfp.QuantizedTensor) -> list[str]:
    return [d for d in t.directions() if bf16_exact_reason(t.qstorage, d) is None]


@pytest.mark.parametrize("case", case_params(BLOCK_LOCAL))
@pytest.mark.parametrize("how", ["slice copy_", "slice zero_", "split copy_", "slice of a view copy_"])
def test_a_cached_decode_sees_a_write_through_a_slice_or_view(case, how):
    g = case.granularity()
    t = quantize(case, make_input((3 * g, 64)))
    directions = _decodable(t)
    assert directions, case.name
    for d in directions:
        decode_bf16(t.qstorage, d, cache=True)
    with torch.no_grad():
        WRITES[how](t, g)
    assert torch.equal(t.dequantize()[:g], _written(how, t.shape, g))
    for d in directions:
        fresh = decode_bf16(t.qstorage, d).values
        assert_bitwise(decode_bf16(t.qstorage, d, cache=True).values, fresh)


def test_a_write_through_a_slice_moves_the_base_payloads_version():
    """The slice's payload tensors are not the base's: the write is noted on their memory."""
    t = quantize(case_params(["mxfp8"])[0].values[0], make_input((64, 64)))
    before = [version(x) for x in t.qstorage.tensors()]
    with torch.no_grad():
        t[32:64].zero_()
    assert all(version(x) != v for x, v in zip(t.qstorage.tensors(), before))


@pytest.mark.parametrize("how", list(WRITES))
def test_the_kept_initial_value_follows_a_write_through_a_slice_or_view(how):
    w = _weight()
    init = w.get_high_precision_init_val().clone()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # fill_ dequantizes the slice
        WRITES[how](w, 32)
    kept = w.get_high_precision_init_val()
    assert kept.shape == w.shape and kept.dtype == init.dtype
    assert torch.equal(kept[:32], _written(how, w.shape, 32))
    assert torch.equal(kept[32:], init[32:])  # rows not written keep their initial value
    assert torch.equal(w.dequantize()[:32], _written(how, w.shape, 32))


def test_the_kept_value_follows_a_slice_of_a_slice_of_a_3d_view():
    """Offsets compose: rows [96, 128) of the weight through a view, a slice and a split."""
    w = _weight(rows=192)
    init = w.get_high_precision_init_val().clone()
    with torch.no_grad():
        piece = torch.split(w.view(3, 64, 64)[1:3], 1)[0]  # rows [64, 128)
        piece.view(64, 64)[32:64].copy_(torch.full((32, 64), 2.0))
    kept = w.get_high_precision_init_val()
    assert torch.equal(kept[96:128], torch.full((32, 64), 2.0))
    assert torch.equal(kept[:96], init[:96]) and torch.equal(kept[128:], init[128:])
    assert torch.equal(w.dequantize()[96:128], torch.full((32, 64), 2.0))


def test_a_kept_value_handed_out_before_a_write_stays_as_it_was():
    w = _weight()
    before = w.get_high_precision_init_val()
    snapshot = before.clone()
    with torch.no_grad():
        w[0:32].zero_()
    assert torch.equal(before, snapshot)
    assert w.get_high_precision_init_val() is not before


def test_the_kept_value_follows_a_whole_tensor_copy():
    w = _weight()
    value = torch.randn(w.shape)
    with torch.no_grad():
        w.copy_(value)
    assert torch.equal(w.get_high_precision_init_val(), value)


def test_a_write_through_a_slice_of_a_deep_copy_leaves_the_original_alone():
    w = _weight()
    init = w.get_high_precision_init_val().clone()
    c = copy.deepcopy(w)
    with torch.no_grad():
        c[0:32].zero_()
    assert torch.equal(w.get_high_precision_init_val(), init)
    assert torch.equal(c.get_high_precision_init_val()[:32], torch.zeros(32, 64))
    assert torch.equal(c.get_high_precision_init_val()[32:], init[32:])


@pytest.mark.parametrize("how", ["slice copy_", "slice zero_", "split copy_", "slice of a view copy_"])
def test_masters_seeded_after_a_write_through_a_slice_start_from_it(how):
    """A MasterWeightOptimizer built after the write starts its masters from the written rows,
    so a step with learning rate 0 leaves the weight as written."""
    torch.manual_seed(0)
    with hybridfp.quantized_model_init(recipe=hybridfp.MXFP8BlockScaling(), preserve_high_precision_init_val=True):
        lin = hybridfp.Linear(64, 96, bias=False)
    w = lin.weight
    with torch.no_grad():
        WRITES[how](w, 32)
    written = w.dequantize().clone()
    opt = hybridfp.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.0)
    assert torch.equal(opt.master_of(w)[:32], _written(how, w.shape, 32))
    with hybridfp.autocast(recipe=hybridfp.MXFP8BlockScaling()):
        lin(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert torch.equal(w.dequantize(), written)


@pytest.mark.parametrize("how", list(THROUGH_TEMPORARIES))
def test_the_kept_value_follows_a_write_through_an_alias_of_a_temporary(how):
    """The tensors between the weight and the one written are gone by the write; the weight's
    kept value still takes the rows written, and masters seeded afterwards start from them."""
    torch.manual_seed(0)
    with hybridfp.quantized_model_init(recipe=hybridfp.MXFP8BlockScaling(), preserve_high_precision_init_val=True):
        lin = hybridfp.Linear(64, 96, bias=False)
    w = lin.weight
    init = w.get_high_precision_init_val().clone()
    with torch.no_grad():
        THROUGH_TEMPORARIES[how](w, 32)
    kept = w.get_high_precision_init_val()
    assert torch.equal(kept[:32], torch.zeros(32, 64))
    assert torch.equal(kept[32:], init[32:])
    assert torch.equal(w.dequantize()[:32], torch.zeros(32, 64))
    opt = hybridfp.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.0)
    assert torch.equal(opt.master_of(w)[:32], torch.zeros(32, 64))
    assert torch.equal(opt.master_of(w)[32:], init[32:].to(opt.master_of(w).dtype))


def test_the_kept_value_follows_a_whole_write_through_an_alias_of_an_alias():
    w = _weight()
    with torch.no_grad():
        w.detach().detach().zero_()
    assert torch.equal(w.get_high_precision_init_val(), torch.zeros(w.shape))


def test_a_tensor_between_that_keeps_a_value_takes_the_write_too():
    """Every tensor of the chain that keeps a value takes its rows, the one written included."""
    w = _weight(rows=128)
    mid = w[32:96]
    mid.__dict__["_high_precision_init_val"] = w.get_high_precision_init_val()[32:96].clone()
    with torch.no_grad():
        mid.detach()[0:32].zero_()  # rows [32, 64) of w
    assert torch.equal(mid.get_high_precision_init_val()[:32], torch.zeros(32, 64))
    assert torch.equal(w.get_high_precision_init_val()[32:64], torch.zeros(32, 64))


def test_a_view_keeps_none_of_the_tensors_it_was_made_from_alive():
    w = _weight()
    source = weakref.ref(w)
    with torch.no_grad():
        middle = w[0:64]
        between = weakref.ref(middle)
        view = middle.detach()[0:32]
    del middle
    gc.collect()
    assert between() is None
    del w
    gc.collect()
    assert source() is None
    with torch.no_grad():
        view.zero_()  # every tensor it was made from is gone: nothing to write but itself
    assert torch.equal(view.dequantize(), torch.zeros(32, 64))


def test_a_chain_of_aliases_made_in_a_loop_records_only_the_tensors_keeping_a_value():
    from hybridfp.tensors.dispatch import _view_chain

    w = _weight()
    x = w
    with torch.no_grad():
        for _ in range(100):
            x = x.detach()
        x[0:32].zero_()
    assert len(_view_chain(x)) == 1 and _view_chain(x)[0][0] is w.__dict__
    assert torch.equal(w.get_high_precision_init_val()[:32], torch.zeros(32, 64))


def test_no_weak_reference_is_taken_to_a_view_or_its_source():
    """``torch.utils.swap_tensors`` refuses a tensor with a weak reference: a parameter that is
    a slice of another (an expert of a joined encoding) must stay swappable."""
    w = _weight()
    with torch.no_grad():
        piece = w[0:32]
        alias = piece.detach()
    assert [weakref.getweakrefcount(t) for t in (w, piece, alias)] == [0, 0, 0]
