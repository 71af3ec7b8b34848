"""bench_moe_overhead's micro-batch and quantized-primary-weight steps and its gradient count (CPU)."""

import json
import warnings

import pytest
import torch

import hybridfp
from bench import bench_moe_overhead as bo


def _layer(single_parameter: bool = False) -> hybridfp.GroupedLinear:
    torch.manual_seed(0)
    return hybridfp.GroupedLinear(4, 32, 48, bias=False, params_dtype=torch.bfloat16,
                                  single_parameter=single_parameter)


def _io(splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return (torch.randn(sum(splits), 32, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(sum(splits), 48, dtype=torch.bfloat16))


@pytest.mark.parametrize("single_parameter, per_pass", [(False, 4), (True, 1)])
def test_accumulations_count_each_parameter_each_pass(single_parameter, per_pass):
    splits = [5, 0, 7, 3]
    m = _layer(single_parameter)
    x, dy = _io(splits)
    step = bo.make_step(m, x, dy, splits, hybridfp.Float8CurrentScaling(), micro_batches=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
        assert bo.accumulations_per_step(m, step) == 3 * per_pass
        assert bo.accumulations_per_step(m, step) == 3 * per_pass  # the first count's hooks are gone


def test_micro_batches_accumulate_the_passes_gradients():
    splits = [5, 0, 7, 3]
    m = _layer()
    x, dy = _io(splits)
    recipe = hybridfp.CustomRecipe(qfactory=hybridfp.factories.high_precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bo.make_step(m, x, dy, splits, recipe, micro_batches=1)()
        once = [p.grad.float().clone() for p in m.parameters()]
        bo.make_step(m, x, dy, splits, recipe, micro_batches=2)()
    # the same pass twice: each gradient doubles (a power of two: exact in BF16)
    for a, b in zip(once, m.parameters()):
        assert torch.equal(b.grad.float(), 2 * a)


def test_primary_weights_step_reencodes_from_the_masters():
    splits = [5, 0, 7, 3]
    recipe = hybridfp.Float8CurrentScaling()
    torch.manual_seed(0)
    m, masters, reencode = bo.primary_weights_layer(recipe, 4, 32, 48)
    assert all(isinstance(w, hybridfp.QuantizedTensor) for w in m.weights()) and len(masters) == 4
    x, dy = _io(splits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = bo.make_step(m, x, dy, splits, recipe, micro_batches=2, before_step=reencode)
        step()
        assert bo.accumulations_per_step(m, step) == 2 * 4
        with torch.no_grad():  # an optimizer update of expert 2's master: the next step encodes it
            masters[2].zero_()
        kept = m.weights()[0].dequantize().clone()
        step()
    assert torch.count_nonzero(m.weights()[2].dequantize()) == 0
    assert torch.equal(m.weights()[0].dequantize(), kept)


def test_main_writes_the_counts(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    monkeypatch.setattr(bo, "RECIPES", {k: bo.RECIPES[k] for k in ("bf16 (high_precision)", "fp8 current")})
    bo.main(["--quick", "--experts", "4", "--hidden", "32", "--ffn", "48", "--tokens-per-expert", "4",
             "--micro-batches", "2", "--primary-weights", "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["bf16 (high_precision)", "fp8 current"]
    assert all(r["grad_accumulations"] == 8 and r["ops"] > 0 and r["python_calls"] > 0 for r in rows)


@pytest.mark.parametrize("argv, text", [(["--micro-batches", "0"], "--micro-batches"),
                                        (["--primary-weights", "--single-parameter"], "single_parameter")])
def test_main_refuses_bad_options(argv, text, capsys):
    with pytest.raises(SystemExit) as stop:
        bo.main(argv)
    assert stop.value.code == 2 and text in capsys.readouterr().err
