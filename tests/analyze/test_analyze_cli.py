"""``hybridfp analyze --preset tiny``: the table, heatmap and factory; the factory trains."""

from __future__ import annotations

import importlib
import pickle
import re
import sys

import pytest

from hybridfp.train import cli
from hybridfp.train.recipes_by_name import parse_recipe


def test_analyze_tiny_writes_outputs_and_its_factory_trains(tmp_path, monkeypatch, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over {i * 7 % 13} lazy dogs\n"
                            for i in range(300)))
    out = tmp_path / "an"
    assert cli.main(["analyze", "--preset", "tiny", "--data", str(text), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"factory: {out / 'recommended_recipe.py'}" in printed and "Budget: no worse than mxfp8" in printed
    table = (out / "analysis.md").read_text()
    assert "| blocks.3.mlp.proj | wgrad |" in table and "kurtosis" in table
    assert re.search(r"\| nvfp4_1d \| 4 \| 0\.5\d\d \|", table)  # the cost table: bits, bytes read
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    monkeypatch.syspath_prepend(str(out))
    named = parse_recipe("recommended_recipe:factory")
    assert named.description == "user factory (CustomRecipe)"
    module = importlib.import_module("recommended_recipe")
    assert pickle.loads(pickle.dumps(module.factory)) is module.factory  # module-level
    assert pickle.loads(pickle.dumps(module.PLAN)) == module.PLAN
    run = tmp_path / "run"
    try:
        assert cli.main(["train", "--preset", "tiny", "--recipe", "recommended_recipe:factory", "--data",
                         str(text), "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-iters",
                         "1", "--out", str(run), "--no-progress"]) == 0
    finally:
        sys.modules.pop("recommended_recipe", None)
    assert (run / "checkpoints").is_dir() and (run / "metrics.jsonl").read_text().count("\n") >= 2


def test_analyze_refuses_bad_options(tmp_path, capsys):
    assert cli.main(["analyze", "--batches", "0", "--out", str(tmp_path)]) == 2
    assert "hybridfp analyze: error: --batches must be at least 1" in capsys.readouterr().err
    assert cli.main(["analyze", "--max-rows", "-1", "--out", str(tmp_path)]) == 2
    assert "--max-rows must be at least 0" in capsys.readouterr().err


def test_analyze_hf_config_sees_the_converted_experts(tmp_path, capsys):
    # a transformers architecture: its fused MoE experts run through GroupedLinear, so they are analysed
    pytest.importorskip("transformers")
    out = tmp_path / "an"
    assert cli.main(["analyze", "--hf-config", "qwen3-moe-tiny", "--out", str(out)]) == 0
    assert f"factory: {out / 'recommended_recipe.py'}" in capsys.readouterr().out
    table = (out / "analysis.md").read_text()
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert f"| model.layers.0.mlp.experts.gate_up_proj | {gemm} |" in table
        assert f"| model.layers.1.mlp.experts.down_proj | {gemm} |" in table
    assert "lm_head" not in table  # kept in high precision by convert, so never a hybridfp GEMM

