"""Recipe names on the command line: every built-in and zoo name, aliases, per_gemm:, module:function."""

from __future__ import annotations

import pytest

from hybridfp import factories
from hybridfp.recipes import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                              MXFP8BlockScaling, NVFP4BlockScaling, Recipe)
from hybridfp.train import cli
from hybridfp.train.recipes_by_name import (known_names, parse_recipe, parse_recipe_list,
                                            split_recipe_list)


@pytest.mark.parametrize("name", known_names())
def test_every_known_name_parses_to_a_recipe(name):
    r = parse_recipe(name)
    assert isinstance(r.recipe, Recipe)
    assert r.label in known_names() and r.description


@pytest.mark.parametrize("name,cls", [("fp8", Float8CurrentScaling), ("fp8-delayed", DelayedScaling),
                                      ("fp8_block", Float8BlockScaling), ("MXFP8", MXFP8BlockScaling),
                                      ("nvfp4", NVFP4BlockScaling), ("current_scaling", Float8CurrentScaling)])
def test_builtin_names_give_builtin_recipes(name, cls):
    assert type(parse_recipe(name).recipe) is cls


def test_bf16_is_the_bf16_cast_factory():
    r = parse_recipe("bf16")
    assert r.label == "bf16" and r.recipe.qfactory is factories.bf16


@pytest.mark.parametrize("name", ["high-precision", "high_precision", "hp"])
def test_high_precision_is_the_no_cast_identity_factory(name):
    r = parse_recipe(name)
    assert r.label == "high-precision" and r.recipe.qfactory is factories.high_precision


@pytest.mark.parametrize("zoo", list(factories.ZOO))
def test_every_zoo_factory_by_its_name(zoo):
    for spelling in (zoo, zoo.replace("_", "-"), zoo.upper()):
        r = parse_recipe(spelling)
        assert isinstance(r.recipe, CustomRecipe) and r.recipe.qfactory is factories.ZOO[zoo]


@pytest.mark.parametrize("alias,zoo", [("nvfp4-fwd-mxfp8-bwd", "nvfp4_row_scaled_fwd_mxfp8_bwd"),
                                       ("mxfp8-fwd-nvfp4-bwd", "mxfp8_fwd_nvfp4_bwd"),
                                       ("hp-fwd-mxfp8-bwd", "high_precision_fwd_mxfp8_bwd"),
                                       ("mxfp8-fwd-hp-bwd", "mxfp8_fwd_high_precision_bwd"),
                                       ("nvfp4-fwd-hp-bwd", "nvfp4_row_scaled_fwd_high_precision_bwd")])
def test_short_aliases(alias, zoo):
    assert parse_recipe(alias).recipe.qfactory is factories.ZOO[zoo]


def test_per_gemm_spec():
    r = parse_recipe("per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8")
    assert r.recipe.qfactory == factories.per_gemm(fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")
    assert r.label == "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"
    assert "/" not in r.slug and ":" not in r.slug and "," not in r.slug
    # order of keys and case do not matter; fp8-delayed spelled with a hyphen is accepted
    r2 = parse_recipe("per-gemm:wgrad=MXFP8,fprop=nvfp4,dgrad=fp8-delayed")
    assert r2.recipe.qfactory == factories.per_gemm(fprop="nvfp4", dgrad="fp8_delayed", wgrad="mxfp8")


@pytest.mark.parametrize("spec,needle", [
    ("per_gemm:fprop=nvfp4,dgrad=mxfp8", "lacks wgrad"),
    ("per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=fp3", "fp3"),
    ("per_gemm:fprop=nvfp4,dgrad=mxfp8,xgrad=mxfp8", "xgrad"),
])
def test_per_gemm_errors(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_recipe(spec)


def test_per_gemm_unknown_format_lists_formats():
    with pytest.raises(ValueError) as e:
        parse_recipe("per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=fp3")
    assert "mxfp8" in str(e.value) and "fp8_block" in str(e.value)


def test_module_function_factory(tmp_path, monkeypatch):
    (tmp_path / "my_recipes.py").write_text(
        "from hybridfp import MXFP8Quantizer, IdentityQuantizer, Float8CurrentScaling, Quantizer\n"
        "def fwd_only(role) -> Quantizer:\n"
        "    return MXFP8Quantizer() if role is not None and role.tensor_type != 'grad_output' "
        "else IdentityQuantizer()\n"
        "RECIPE = Float8CurrentScaling(use_power_2_scales=True)\n"
        "CLS = Float8CurrentScaling\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = parse_recipe("my_recipes:fwd_only")
    assert isinstance(r.recipe, CustomRecipe) and r.recipe.qfactory.__name__ == "fwd_only"
    assert r.label == "my_recipes:fwd_only"
    assert parse_recipe("my_recipes:RECIPE").recipe.use_power_2_scales is True
    assert type(parse_recipe("my_recipes:CLS").recipe) is Float8CurrentScaling
    with pytest.raises(ValueError, match="NOT_CALLABLE is a int"):
        parse_recipe("my_recipes:NOT_CALLABLE")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        parse_recipe("my_recipes:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        parse_recipe("no_such_module_xyz:f")


def test_builtin_module_function():
    assert parse_recipe("hybridfp.factories:nvfp4").recipe.qfactory is factories.nvfp4


@pytest.mark.parametrize("bad", ["fp9", "nvfp4-fwd", "", "bf-16"])
def test_unknown_name_lists_known_names(bad):
    with pytest.raises(ValueError) as e:
        parse_recipe(bad)
    msg = str(e.value)
    for known in ("bf16", "fp8", "fp8-delayed", "fp8-block", "mxfp8", "nvfp4", "mxfp8-fwd-nvfp4-bwd",
                  "nvfp4-fwd-mxfp8-bwd", "per_gemm:", "package.module:function"):
        assert known in msg


def test_compare_list_keeps_per_gemm_whole():
    text = "bf16, fp8,per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8,mxfp8-fwd-nvfp4-bwd"
    assert split_recipe_list(text) == ["bf16", "fp8", "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8",
                                       "mxfp8-fwd-nvfp4-bwd"]
    labels = [r.label for r in parse_recipe_list(text + ",BF16")]  # duplicate dropped
    assert labels == ["bf16", "fp8", "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8", "mxfp8-fwd-nvfp4-bwd"]


def test_default_compare_has_bf16_an_fp8_and_an_nvfp4_mxfp8_hybrid():
    labels = [r.label for r in parse_recipe_list(cli.DEFAULT_COMPARE)]
    assert labels[0] == "bf16" and "fp8" in labels
    assert any("nvfp4" in lab and "mxfp8" in lab for lab in labels)


def test_cli_unknown_recipe_exits_with_the_list(capsys):
    assert cli.main(["train", "--recipe", "fp9", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'fp9'" in err and "mxfp8-fwd-nvfp4-bwd" in err


def test_cli_list_recipes(capsys):
    assert cli.main(["train", "--list-recipes"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4-fwd-mxfp8-bwd" in out and "per_gemm:" in out
