"""The import rule: each part of ``hybridfp`` imports only the parts below it (and itself).

Layers, lowest first::

    config, utils -> formats -> kernels -> tensors -> quantizers -> gemm -> recipes -> nn
        -> moe -> integration -> train, analyze -> top (hybridfp/__init__.py, report.py, factories.py)

``analyze`` and ``train`` share a rank: the analysis builds the trainer's models, the trainer's
command line runs the analysis.

``config`` and ``utils`` form the bottom: neither imports anything else of ``hybridfp`` (nor each
other). Every ``import`` / ``from ... import`` (absolute or relative, at module level or inside a
function) and every ``importlib.import_module("hybridfp....")`` with a literal name (or an
f-string whose literal head names a part) is checked. Kernel modules share helpers through
``kernels/_common.py`` or through the public names of the module that owns them: no kernel module
imports a private (``_x``) name from another kernel module.

The check reads the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridfp"

#: Rank of each layer; a module may import a layer of lower or equal rank.
LAYERS = {
    "config": 0, "utils": 0,
    "formats": 1, "kernels": 2, "tensors": 3, "quantizers": 4, "gemm": 5, "recipes": 6, "nn": 7,
    "moe": 8, "integration": 9, "train": 10, "analyze": 10,
    "top": 11,
}
#: Layers that import nothing of hybridfp but themselves.
SELF_CONTAINED = {"config", "utils"}

#: Imports against the order that remain, (file, imported module) -> why. An entry whose import
#: is gone fails ``test_allowed_exceptions_still_exist``: delete it then.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def layer_of(module: str) -> Optional[str]:
    """Layer of ``hybridfp...`` module ``module``; None outside hybridfp."""
    parts = module.split(".")
    if parts[0] != "hybridfp":
        return None
    if len(parts) == 1:
        return "top"
    head = parts[1]
    return head if head in LAYERS else "top"


def resolve_from(path: Path, node: ast.ImportFrom) -> str:
    """Absolute module name of ``from <node.module> import ...`` in ``path``."""
    if node.level == 0:
        return node.module or ""
    base = module_name(path).split(".")
    if not is_package(path):
        base.pop()  # a module's package
    for _ in range(node.level - 1):
        base.pop()
    return ".".join(base + ([node.module] if node.module else []))


def submodule_exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel).is_dir()


def literal_head(node: ast.expr) -> Optional[str]:
    """The literal string, or the literal head of an f-string, of an import_module argument."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.rstrip(".")
    return None


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) of every import in ``path``. ``from pkg import
    sub`` where ``pkg.sub`` is a module counts as an import of ``pkg.sub``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in sorted((n for n in ast.walk(tree) if hasattr(n, "lineno")), key=lambda n: n.lineno):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = resolve_from(path, node)
            plain = []
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if module.startswith("hybridfp") and submodule_exists(sub):
                    yield node.lineno, sub, []
                else:
                    plain.append(alias.name)
            if plain:
                yield node.lineno, module, plain
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "import_module":
                head = literal_head(node.args[0])
                if head is not None and head.startswith("hybridfp"):
                    yield node.lineno, head, []


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_sources_found():
    names = {module_name(p) for p in sources()}
    assert {"hybridfp", "hybridfp.utils.device", "hybridfp.formats.nvfp4"} <= names
    assert all(layer_of(n) is not None for n in names)


def test_no_import_goes_up():
    bad = []
    for path in sources():
        own = layer_of(module_name(path))
        for line, module, _ in imports(path):
            target = layer_of(module)
            if target is None:
                continue
            if own in SELF_CONTAINED and target != own:
                bad.append(f"{where(path, line)}: {own} imports {module} ({target}); "
                           f"{own} imports nothing else of hybridfp")
            elif LAYERS[target] > LAYERS[own] and (str(path.relative_to(ROOT)), module) not in ALLOWED:
                bad.append(f"{where(path, line)}: {own} imports {module} ({target}, above it)")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_allowed_exceptions_still_exist():
    found = {(str(p.relative_to(ROOT)), module) for p in sources() for _, module, _ in imports(p)}
    stale = [f"{path}: {module}" for path, module in ALLOWED if (path, module) not in found]
    assert not stale, "ALLOWED entries whose import is gone (delete them):\n" + "\n".join(stale)


def test_formats_and_utils_import_nothing_above():
    bad = []
    for path in sources():
        own = layer_of(module_name(path))
        if own not in ("formats", "utils"):
            continue
        for line, module, _ in imports(path):
            target = layer_of(module)
            if target is not None and LAYERS[target] > LAYERS[own]:
                bad.append(f"{where(path, line)}: {own} imports {module} ({target})")
    assert not bad, "\n".join(bad)


def test_kernels_share_no_private_names():
    bad = []
    for path in sorted((PACKAGE / "kernels").rglob("*.py")):
        own = module_name(path)
        for line, module, names in imports(path):
            if layer_of(module) != "kernels" or module == own or module == "hybridfp.kernels._common":
                continue
            private = [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{where(path, line)}: {', '.join(private)} from {module}")
    assert not bad, "kernel modules importing another kernel module's private names:\n" + "\n".join(bad)


def test_dense_code_never_imports_the_moe_wing():
    """``hybridfp.moe`` and ``hybridfp.kernels.moe`` serve the MoE layer alone: no module outside
    them (and the parts above ``moe``) imports them, so dense code reads without the MoE."""
    bad = []
    for path in sources():
        own = module_name(path)
        if own.startswith(("hybridfp.moe", "hybridfp.kernels.moe")) or LAYERS[layer_of(own)] > LAYERS["moe"]:
            continue
        for line, module, _ in imports(path):
            if module.startswith(("hybridfp.moe", "hybridfp.kernels.moe")):
                bad.append(f"{where(path, line)}: {own} imports {module}")
    assert not bad, "dense modules importing the MoE wing:\n" + "\n".join(bad)


def test_layer_of():
    assert layer_of("hybridfp") == "top"
    assert layer_of("hybridfp.report") == "top"
    assert layer_of("hybridfp.kernels.triton_nvfp4") == "kernels"
    assert layer_of("hybridfp.config") == "config"
    assert layer_of("torch") is None
