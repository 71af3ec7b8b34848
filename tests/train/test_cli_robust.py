"""``hybridfp train`` and ``python -m hybridfp.report`` on bad input: one clear line and exit
status 2 (argparse's convention for usage errors), never a traceback, never a silent default;
metrics.jsonl is rewritten atomically."""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import subprocess
import sys

import pytest

from hybridfp import report
from hybridfp.train import cli
from hybridfp.train.loop import MetricsLog
from hybridfp.train.recipes_by_name import parse_recipe

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


def _run(text, out, *extra):
    """``hybridfp train`` at the smallest size; returns its exit status."""
    return cli.main(["train", "--preset", "test", "--data", str(text), "--out", str(out), "--no-progress",
                     "--seq-len", "16", "--batch-size", "2", "--eval-iters", "1", "--eval-interval", "2",
                     *extra])


def _one_error_line(capsys) -> str:
    """The stderr of a failed command: exactly one ``hybridfp train: error:`` line."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridfp train: error: "), lines
    return lines[0]


# ---------------------------------------------------------------- metrics.jsonl, atomically
class _Crash(Exception):
    """Stands for the process being killed."""


def _crash_mid_write(monkeypatch, directory) -> None:
    """Every file under ``directory`` opened for writing (by name or by descriptor) takes half
    of its first write, and then the process "dies"."""
    real_open, real_fdopen = builtins.open, os.fdopen

    class HalfWriter:
        def __init__(self, f):
            self.f = f

        def write(self, s):
            self.f.write(s[: len(s) // 2])
            self.f.flush()
            raise _Crash

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    def writing(mode) -> bool:
        return any(c in mode for c in "wax+")

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        inside = isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(str(directory))
        return HalfWriter(f) if inside and writing(mode) else f

    def fake_fdopen(fd, mode="r", *args, **kwargs):
        f = real_fdopen(fd, mode, *args, **kwargs)
        return HalfWriter(f) if writing(mode) else f

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "fdopen", fake_fdopen)


def test_metrics_rewrite_killed_midway_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "recipe": r, "train_loss": 1.0 / (s + 1)} for r in ("bf16", "fp8") for s in range(50)]
    old = "".join(json.dumps(r) + "\n" for r in recs)
    path.write_text(old)
    _crash_mid_write(monkeypatch, tmp_path)
    with pytest.raises(_Crash):
        MetricsLog(path).truncate("fp8", 10)
    monkeypatch.undo()
    assert path.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary left


def test_metrics_rewrite_keeps_other_recipes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "recipe": r} for r in ("bf16", "fp8") for s in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    MetricsLog(path).truncate("fp8", 1)
    assert MetricsLog(path).read() == [r for r in recs if r["recipe"] == "bf16" or r["step"] <= 1]


# ---------------------------------------------------------------- damaged run files
@pytest.mark.parametrize("content", ["{not json", "{}", '{"config": {"preset": "test"}, "recipes": ["bf16"]}',
                                     '{"config": 3, "recipes": "bf16"}', "[]"])
def test_damaged_run_json(tmp_path, text, capsys, content):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    (out / "run.json").write_text(content)
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "2") == 2
    assert str(out / "run.json") in _one_error_line(capsys)


@pytest.mark.parametrize("bad", ["{\"step\": 1, \"recipe\": \"bf1", "[1, 2]", '{"step": "x", "recipe": "bf16"}',
                                 '{"train_loss": 3.0}'])
def test_damaged_metrics_line(tmp_path, text, capsys, bad):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "2") == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines[1] = bad
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "3") == 2
    line = _one_error_line(capsys)
    assert f"{out / 'metrics.jsonl'}:2" in line
    assert (out / "metrics.jsonl").read_text().splitlines()[1] == bad  # left for the user to fix


def test_unwritable_out(tmp_path, text, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert _run(text, blocker / "run", "--recipe", "bf16", "--steps", "1") == 2
    assert str(blocker / "run") in _one_error_line(capsys)
    assert _run(text, blocker, "--recipe", "bf16", "--steps", "1") == 2  # --out is a file
    assert "--out" in _one_error_line(capsys)


# ---------------------------------------------------------------- options
@pytest.mark.parametrize("flag,value", [("--recipe", ""), ("--recipe", " "), ("--compare", ""),
                                        ("--compare", " "), ("--compare", ",")])
def test_empty_recipe_is_an_error_not_the_default(tmp_path, text, capsys, flag, value):
    assert _run(text, tmp_path / "run", flag, value, "--steps", "1") == 2
    assert flag in _one_error_line(capsys)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_duplicated_per_gemm_key():
    with pytest.raises(ValueError, match="fprop.*twice"):
        parse_recipe("per_gemm:fprop=nvfp4,fprop=mxfp8,dgrad=mxfp8,wgrad=mxfp8")
    with pytest.raises(ValueError, match="wgrad.*twice"):
        parse_recipe("per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8,wgrad=mxfp8")


def test_duplicated_per_gemm_key_on_the_command_line(tmp_path, text, capsys):
    assert _run(text, tmp_path / "run", "--recipe", "per_gemm:fprop=nvfp4,fprop=mxfp8,dgrad=mxfp8,wgrad=mxfp8",
                "--steps", "1") == 2
    assert "fprop" in _one_error_line(capsys)


@pytest.mark.parametrize("value", ["-1", "-5"])
def test_negative_checkpoint_interval(tmp_path, text, capsys, value):
    assert _run(text, tmp_path / "run", "--recipe", "bf16", "--steps", "1", "--checkpoint-interval", value) == 2
    assert "--checkpoint-interval" in _one_error_line(capsys)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1e-3"])
def test_learning_rate_must_be_finite_and_positive(tmp_path, text, capsys, value):
    assert _run(text, tmp_path / "run", "--recipe", "bf16", "--steps", "1", f"--lr={value}") == 2
    assert "--lr" in _one_error_line(capsys)


def test_checkpoint_interval_negative_on_resume(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert _run(text, out, "--recipe", "bf16", "--steps", "1") == 0
    capsys.readouterr()
    assert _run(text, out, "--resume", "--steps", "2", "--checkpoint-interval", "-1") == 2
    assert "--checkpoint-interval" in _one_error_line(capsys)


def test_module_path_to_a_non_factory_is_never_called(tmp_path, text, capsys, monkeypatch):
    calls = []

    def spy(command):  # stands in for os.system: records, then fails as it would on a role
        calls.append(command)
        raise TypeError("expected str, bytes or os.PathLike object")

    monkeypatch.setattr(os, "system", spy)
    assert _run(text, tmp_path / "run", "--recipe", "os:system", "--steps", "1") == 2
    line = _one_error_line(capsys)
    assert "'os:system'" in line and "Quantizer" in line and "Recipe" in line
    assert calls == []


@pytest.mark.parametrize("attr", ["unannotated", "returns_int", "takes_two", "a_builtin", "a_class"])
def test_module_path_must_name_a_hybridfp_factory_or_recipe(tmp_path, monkeypatch, attr):
    (tmp_path / "user_recipes_bad.py").write_text(
        "import os\n"
        "CALLED = []\n"
        "def unannotated(role):\n    CALLED.append(role)\n"
        "def returns_int(role) -> int:\n    CALLED.append(role)\n"
        "from hybridfp.quantizers import Quantizer\n"
        "def takes_two(role, other) -> Quantizer:\n    CALLED.append(role)\n"
        "a_builtin = os.getcwd\n"
        "class a_class:\n    def __init__(self, *a):\n        CALLED.append(a)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=f"user_recipes_bad:{attr}"):
        parse_recipe(f"user_recipes_bad:{attr}")
    import user_recipes_bad
    assert user_recipes_bad.CALLED == []


def test_module_path_accepts_annotated_factories_and_recipe_makers(tmp_path, monkeypatch):
    (tmp_path / "user_recipes_good.py").write_text(
        "from __future__ import annotations\n"
        "from hybridfp.quantizers import IdentityQuantizer, Quantizer\n"
        "from hybridfp.recipes import Float8CurrentScaling, Recipe\n"
        "def factory(role) -> Quantizer:\n    return IdentityQuantizer()\n"
        "def make() -> Recipe:\n    return Float8CurrentScaling(use_power_2_scales=True)\n"
        "def make_wrong() -> Recipe:\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert parse_recipe("user_recipes_good:factory").recipe.qfactory.__name__ == "factory"
    assert parse_recipe("user_recipes_good:make").recipe.use_power_2_scales is True
    with pytest.raises(ValueError, match="returned a int"):
        parse_recipe("user_recipes_good:make_wrong")


def test_train_without_the_train_extra_is_one_line(tmp_path):
    """Without matplotlib or tqdm (the train extra) the library imports, --list-recipes works,
    and ``hybridfp train`` stops before anything is written, with one line that says what to
    install."""
    code = ("import sys; sys.modules['matplotlib'] = sys.modules['tqdm'] = None\n"
            "import hybridfp, hybridfp.report, hybridfp.train\n"
            "from hybridfp.train import cli\n"
            "assert cli.main(['train', '--list-recipes']) == 0\n"
            "sys.exit(cli.main(sys.argv[1:]))")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", code, "train", "--steps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["hybridfp train: error: matplotlib and tqdm are not installed; "
                                             "hybridfp train needs the train extra: pip install 'hybridfp[train]'"]
    assert not out.exists()


def test_console_logging_leaves_the_logger_as_it_found_it(tmp_path, text, capsys):
    """The command's handlers exist only while it runs: a library user's logging is untouched."""
    log = logging.getLogger("hybridfp.train")
    before = (list(log.handlers), log.level, log.propagate)
    assert _run(text, tmp_path / "r", "--recipe", "bf16", "--steps", "1") == 0
    assert (list(log.handlers), log.level, log.propagate) == before
    printed = capsys.readouterr().out
    assert printed.startswith("data: ") and f"summary: {tmp_path / 'r' / 'summary.md'}" in printed


# ---------------------------------------------------------------- python -m hybridfp.report
@pytest.mark.parametrize("argv", [["--rows", "0"], ["--cols", "0"], ["--rows", "-3"]])
def test_report_rejects_empty_shapes(capsys, argv):
    with pytest.raises(SystemExit) as e:
        report.main(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err
