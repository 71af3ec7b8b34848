"""Sharded safetensors checkpoints (Hugging Face layout): ``save_safetensors(...,
max_shard_size=...)`` writes ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``;
``load_safetensors`` reads the directory or the index back bitwise (quantized payloads, quantizer
state, the next training step), refuses an index and shards that disagree naming the shard or
tensor, and a plain export loads into a plain torch model with transformers' own loader."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

import hybridfp as hfp
from master_cases import RECIPES, batches, build, step
from test_safetensors_io import _fresh, _opt, _roundtrip, _same, _same_extra

st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

INDEX = "model.safetensors.index.json"
SMALL = 6000  # bytes: the test model (~60 KB of tensors) spreads over many shards


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _index(folder) -> dict:
    with open(os.path.join(folder, INDEX)) as f:
        return json.load(f)


def _shard_contents(folder) -> dict[str, tuple[dict, set]]:
    out = {}
    for name in sorted(set(_index(folder)["weight_map"].values())):
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            out[name] = (f.metadata(), set(f.keys()))
    return out


def _trained(name: str, steps: int = 2):
    recipe = RECIPES[name]()
    model = build(recipe, quantized=True)
    opt = _opt(model)
    torch.manual_seed(5)
    for x in batches(steps):
        step(model, opt, recipe, x)
    return recipe, model, opt


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4", "delayed"])
@pytest.mark.parametrize("via", ["directory", "index"])
def test_sharded_round_trip_is_bitwise(name, via, tmp_path):
    recipe, model, opt = _trained(name)
    folder = tmp_path / "ckpt"
    hfp.save_safetensors(model, folder, metadata={"note": "two steps"}, max_shard_size=SMALL)
    index = _index(folder)
    contents = _shard_contents(folder)
    assert len(contents) >= 4 and index["metadata"]["note"] == "two steps"
    assert index["metadata"]["total_size"] == sum(
        os.path.getsize(folder / n) for n in contents) - sum(_header_bytes(folder / n) for n in contents)
    for shard, (meta, keys) in contents.items():
        assert meta["note"] == "two steps" and meta["format"] == "pt"
        assert {k for k, f in index["weight_map"].items() if f == shard} == keys
        # every quantized weight / quantizer state described here has all its tensors here
        for k, v in meta.items():
            if k.startswith("__hybridfp__.quantized.") or k.startswith("__hybridfp__.extra."):
                assert set(_tensor_refs(json.loads(v))) <= keys, (shard, k)

    other = _fresh(RECIPES[name]())
    hfp.load_safetensors(other, folder if via == "directory" else folder / INDEX)
    _same(model, other)
    other_recipe = RECIPES[name]()
    x = batches(3)[2]
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        want = model(x)
    with torch.no_grad(), hfp.autocast(recipe=other_recipe):
        got = other(x)
    assert torch.equal(want, got)
    _same_extra(model, other)
    other_opt = _opt(other)
    other_opt.load_state_dict(_roundtrip(opt.state_dict()))  # a copy: the next step moves the state
    torch.manual_seed(11)
    step(model, opt, recipe, x)
    torch.manual_seed(11)
    step(other, other_opt, other_recipe, x)
    _same(model, other)


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _tensor_refs(value):
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            yield value["__tensor__"]
        else:
            for v in value.values():
                yield from _tensor_refs(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tensor_refs(v)


def test_a_quantized_weight_split_across_shards_is_reassembled(tmp_path):
    """The loader resolves a header's tensors over the whole checkpoint: a payload moved into
    another shard (and the weight_map updated) still loads bitwise."""
    recipe, model, _ = _trained("mxfp8", steps=1)
    folder = tmp_path / "ckpt"
    hfp.save_safetensors(model, folder, max_shard_size=SMALL)
    index = _index(folder)
    key = "mlp.fc1_weight.__hybridfp__.columnwise.data"
    src = index["weight_map"][key]
    dst = next(f for f in sorted(set(index["weight_map"].values())) if f != src)
    a, b = _load_shard(folder, src), _load_shard(folder, dst)
    b[1][key] = a[1].pop(key)
    _save_shard(folder, src, *a)
    _save_shard(folder, dst, *b)
    index["weight_map"][key] = dst
    _write_index(folder, index)
    other = _fresh(RECIPES["mxfp8"]())
    hfp.load_safetensors(other, folder)
    _same(model, other)


def _load_shard(folder, name):
    with safe_open(os.path.join(folder, name), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def _save_shard(folder, name, meta, tensors):
    st.save_file(tensors, os.path.join(folder, name), metadata=meta)


def _write_index(folder, index):
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f)


def test_plain_export_loads_shard_by_shard_into_a_plain_torch_model(tmp_path):
    """export_state_dict saved sharded is an ordinary Hugging Face checkpoint: transformers'
    load_sharded_checkpoint (safetensors.torch.load_file per shard) fills a torch.nn model."""
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
        q = torch.nn.Sequential(hfp.Linear(64, 128), torch.nn.GELU(), hfp.Linear(128, 64))
    exported = hfp.export_state_dict(q, dtype=torch.float32)
    folder = tmp_path / "plain"
    hfp.save_safetensors(exported, folder, max_shard_size="20KB")
    assert len(set(_index(folder)["weight_map"].values())) >= 3
    plain = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    result = trainer_utils.load_sharded_checkpoint(plain, str(folder), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in plain.state_dict().items():
        assert torch.equal(v, exported[k]), k
    assert torch.equal(plain[0].weight, q[0].weight.dequantize(torch.float32))


def test_max_shard_size_forms_and_one_shard(tmp_path):
    from hybridfp.integration.safetensors_shards import parse_shard_size
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("500MB") == 5 * 10**8
    assert parse_shard_size("2GiB") == 2 * 2**30 and parse_shard_size("1.5kb") == 1500
    assert parse_shard_size(4096) == 4096
    model = build(RECIPES["mxfp8"](), quantized=True)
    for bad in ("5XB", "GB", 0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_shard_size"):
            hfp.save_safetensors(model, tmp_path / "bad", max_shard_size=bad)
    folder = tmp_path / "ckpt"
    hfp.save_safetensors(model, folder, max_shard_size=SMALL)
    assert (folder / INDEX).exists()
    # everything fits: one model.safetensors and no index, as Hugging Face writes it; the
    # earlier save's shards and index are removed (one checkpoint per directory)
    hfp.save_safetensors(model, folder, max_shard_size="5GB")
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    other = _fresh(RECIPES["mxfp8"]())
    hfp.load_safetensors(other, folder)
    _same(model, other)
    with pytest.raises(FileNotFoundError, match="neither"):
        hfp.load_safetensors(other, tmp_path)


def _saved(tmp_path):
    recipe = RECIPES["mxfp8"]()
    model = build(recipe, quantized=True)
    folder = tmp_path / "ckpt"
    hfp.save_safetensors(model, folder, metadata={"note": "a"}, max_shard_size=SMALL)
    return recipe, folder, _index(folder)


def test_missing_shard_is_refused(tmp_path):
    recipe, folder, index = _saved(tmp_path)
    name = sorted(set(index["weight_map"].values()))[1]
    os.remove(folder / name)
    with pytest.raises(FileNotFoundError, match=name):
        hfp.load_safetensors(_fresh(recipe), folder)


def test_weight_map_naming_a_missing_tensor_is_refused(tmp_path):
    recipe, folder, index = _saved(tmp_path)
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["ghost.weight"] = first
    _write_index(folder, index)
    with pytest.raises(KeyError, match=rf"ghost\.weight.*{first}"):
        hfp.load_safetensors(_fresh(recipe), folder)


def test_tensor_in_another_shard_than_the_weight_map_says_is_refused(tmp_path):
    recipe, folder, index = _saved(tmp_path)
    names = sorted(set(index["weight_map"].values()))
    held = {n: [k for k, f in index["weight_map"].items() if f == n] for n in names}
    src = next(n for n in names if len(held[n]) > 1)  # still named by the weight_map after the edit
    key, dst = held[src][0], next(n for n in names if n != src)
    index["weight_map"][key] = dst
    _write_index(folder, index)
    with pytest.raises(ValueError, match=rf"shard '{src}' holds the tensor '{re.escape(key)}'.*maps to '{dst}'"):
        hfp.load_safetensors(_fresh(recipe), folder)


def test_mismatched_metadata_is_refused(tmp_path):
    recipe, folder, index = _saved(tmp_path)
    name = sorted(set(index["weight_map"].values()))[2]
    meta, tensors = _load_shard(folder, name)
    _save_shard(folder, name, {**meta, "note": "b"}, tensors)  # a shard of another save
    with pytest.raises(ValueError, match=rf"metadata of the shard '{name}'.*note"):
        hfp.load_safetensors(_fresh(recipe), folder)
    _save_shard(folder, name, meta, tensors)
    index["metadata"]["__hybridfp__.version"] = "0"
    _write_index(folder, index)
    with pytest.raises(ValueError, match=r"metadata of the shard .*__hybridfp__\.version"):
        hfp.load_safetensors(_fresh(recipe), folder)


@pytest.mark.parametrize("name", ["../escape.safetensors", "sub/x.safetensors", ""])
def test_shard_names_outside_the_directory_are_refused(tmp_path, name):
    recipe, folder, index = _saved(tmp_path)
    index["weight_map"][next(iter(index["weight_map"]))] = name
    _write_index(folder, index)
    with pytest.raises(ValueError, match="not a file name in the index's directory"):
        hfp.load_safetensors(_fresh(recipe), folder / INDEX)
