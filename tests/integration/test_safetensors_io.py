"""``save_safetensors`` / ``load_safetensors``: a safetensors file that keeps quantized weights'
payloads and the quantizers' state, loaded back bitwise (payload bytes, forward output, the next
training step with FP32 masters) for each built-in recipe's weight format and a hybrid; plain
high-precision models too; tampered files refused naming the key."""

from __future__ import annotations

import io
import json
import sys
import warnings

import pytest
import torch

import hybridfp as hfp
from master_cases import RECIPES, Model, batches, build, quantized_weights, step

st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

NAMES = ["delayed", "fp8_current", "fp8_block", "mxfp8", "nvfp4", "hybrid_per_gemm"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _opt(model):
    return hfp.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2, weight_decay=0.1)


def _fresh(recipe, quantized=True) -> Model:
    torch.manual_seed(7)  # other initial values: loading must replace them
    with hfp.quantized_model_init(enabled=quantized, recipe=recipe):
        return Model()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same(a, b) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if isinstance(p, hfp.QuantizedTensor):
            assert type(q) is hfp.QuantizedTensor and type(p.qstorage) is type(q.qstorage), n
            assert p.directions() == q.directions(), n
            xs, ys = p.qstorage.tensors(), q.qstorage.tensors()
            assert len(xs) == len(ys), n
            for x, y in zip(xs, ys):
                assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), n
        else:
            assert torch.equal(p, q), n


def _same_extra(a, b) -> None:
    for (n, m), m2 in zip(a.named_modules(), b.modules()):
        if isinstance(m, hfp.Linear | hfp.LayerNormLinear | hfp.LayerNormMLP):
            sa, sb = m.get_extra_state(), m2.get_extra_state()
            assert sa.keys() == sb.keys(), n
            for k, e in sa.get("quantizers", {}).items():
                f = sb["quantizers"][k]
                assert (e["kind"], e["format"]) == (f["kind"], f["format"]), (n, k)
                for key, v in e["state"].items():
                    w = f["state"][key]
                    assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (n, k, key)


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bitwise(name, tmp_path):
    recipe = RECIPES[name]()
    model = build(recipe, quantized=True)
    opt = _opt(model)
    xs = batches(3)
    torch.manual_seed(5)
    for x in xs[:2]:
        step(model, opt, recipe, x)
    path = tmp_path / "model.safetensors"
    hfp.save_safetensors(model, path, metadata={"note": "two steps"})
    saved_opt = _roundtrip(opt.state_dict())
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["note"] == "two steps"
        assert any(".__hybridfp__.rowwise." in k for k in f.keys())

    other = _fresh(RECIPES[name]())
    hfp.load_safetensors(other, path)
    _same(model, other)
    other_recipe = RECIPES[name]()
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        want = model(xs[2])
    with torch.no_grad(), hfp.autocast(recipe=other_recipe):
        got = other(xs[2])
    assert torch.equal(want, got)
    _same_extra(model, other)

    other_opt = _opt(other)
    other_opt.load_state_dict(saved_opt)
    torch.manual_seed(11)
    step(model, opt, recipe, xs[2])
    torch.manual_seed(11)
    step(other, other_opt, other_recipe, xs[2])
    _same(model, other)
    _same_extra(model, other)


def test_plain_model_round_trip(tmp_path):
    recipe = RECIPES["delayed"]()
    model = build(recipe, quantized=False)
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        model(batches(1)[0])
    path = tmp_path / "plain.safetensors"
    hfp.save_safetensors(model, path)
    assert not quantized_weights(model)
    other = _fresh(RECIPES["delayed"](), quantized=False)
    hfp.load_safetensors(other, path)
    _same(model, other)
    with torch.no_grad(), hfp.autocast(recipe=RECIPES["delayed"]()):
        other(batches(1)[0])
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        model(batches(1)[0])
    _same_extra(model, other)
    # a plain torch file: safetensors itself reads the high-precision tensors
    assert torch.equal(st.load_file(str(path))["out.weight"], model.out.weight.detach())


def _saved(tmp_path, name="mxfp8"):
    recipe = RECIPES[name]()
    model = build(recipe, quantized=True)
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        model(batches(1)[0])
    path = tmp_path / "model.safetensors"
    hfp.save_safetensors(model, path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    return recipe, path, st.load_file(str(path)), meta


def _rewrite(tmp_path, tensors, meta):
    path = tmp_path / "tampered.safetensors"
    st.save_file(tensors, str(path), metadata=meta)
    return path


def _key(tensors, part):
    return next(k for k in sorted(tensors) if part in k)


def test_wrong_payload_dtype_is_refused(tmp_path):
    recipe, _, tensors, meta = _saved(tmp_path)
    key = _key(tensors, "out.weight.__hybridfp__.rowwise.data")
    tensors[key] = tensors[key].view(torch.uint8)
    with pytest.raises(ValueError, match="out.weight") as e:
        hfp.load_safetensors(_fresh(recipe), _rewrite(tmp_path, tensors, meta))
    assert "dtype" in str(e.value)


def test_wrong_plain_dtype_is_refused(tmp_path):
    recipe, _, tensors, meta = _saved(tmp_path)
    tensors["out.bias"] = tensors["out.bias"].to(torch.float64)
    with pytest.raises(ValueError, match=r"out\.bias.*float64"):
        hfp.load_safetensors(_fresh(recipe), _rewrite(tmp_path, tensors, meta))


def test_missing_keys_are_refused(tmp_path):
    recipe, _, tensors, meta = _saved(tmp_path)
    key = _key(tensors, "mlp.fc1_weight.__hybridfp__.columnwise")
    del tensors[key]
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        hfp.load_safetensors(_fresh(recipe), _rewrite(tmp_path, tensors, meta))
    recipe, _, tensors, meta = _saved(tmp_path)
    del tensors["out.bias"]
    with pytest.raises(KeyError, match=r"out\.bias"):
        hfp.load_safetensors(_fresh(recipe), _rewrite(tmp_path, tensors, meta))
    # strict=False loads the rest and reports the missing entry
    result = hfp.load_safetensors(_fresh(recipe), _rewrite(tmp_path, tensors, meta), strict=False)
    assert "out.bias" in result.missing_keys


def test_unknown_storage_class_is_refused(tmp_path):
    recipe, _, tensors, meta = _saved(tmp_path)
    key = next(k for k in meta if k.endswith("out.weight"))
    state = json.loads(meta[key])
    state["storage"]["cls"] = "os.system"
    meta[key] = json.dumps(state)
    with pytest.raises(ValueError, match=r"out\.weight.*'os\.system' is not a known storage class"):
        hfp.load_safetensors(_fresh(recipe), _rewrite(tmp_path, tensors, meta))


def test_bad_metadata_json_is_refused(tmp_path):
    recipe, _, tensors, meta = _saved(tmp_path)
    key = next(k for k in meta if k.endswith("qkv.weight"))
    meta[key] = meta[key][:-5]
    with pytest.raises(ValueError, match=r"qkv\.weight.*JSON"):
        hfp.load_safetensors(_fresh(recipe), _rewrite(tmp_path, tensors, meta))


def test_other_format_in_model_is_refused(tmp_path):
    _, path, _, _ = _saved(tmp_path, "mxfp8")
    with pytest.raises(ValueError, match=r"weight.*MXFP8Storage.*NVFP4Storage|weight.*NVFP4Storage.*MXFP8Storage"):
        hfp.load_safetensors(_fresh(RECIPES["nvfp4"]()), path)


def test_reserved_metadata_key_is_refused(tmp_path):
    model = build(RECIPES["mxfp8"](), quantized=True)
    with pytest.raises(ValueError, match="__hybridfp__"):
        hfp.save_safetensors(model, tmp_path / "m.safetensors", metadata={"__hybridfp__.x": "y"})


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"hybridfp\[safetensors\]"):
        hfp.save_safetensors(hfp.Linear(16, 16), tmp_path / "m.safetensors")
