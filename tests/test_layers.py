"""The layering of ``docs/architecture.md``: every import inside autopar points down a layer.

Walks every import statement of every module (at module level and inside functions alike) and checks
that its target is the module's own layer or one the layer may use. A new layer, or a new edge
between layers, is a change to the architecture: make it in ``LAYERS`` and in the document together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = {"autopar": "autopar", "cost_models": "autopar.cost_models", "passes": "autopar.passes"}

LAYERS: dict[str, set[str]] = {
    # layer: the layers its modules may import (its own is always allowed)
    "core": set(),
    "models": {"core"},
    "cost_models": set(),  # a standalone cost library (test_cost_models checks it imports nothing of autopar)
    "ir": {"core"},
    "planning": {"core", "ir", "cost_models"},
    "passes": {"core", "ir"},
    "runtime": {"core", "ir", "passes"},
    "inspect": {"core", "ir", "cost_models", "planning", "passes"},
    "api": {"core", "models", "ir", "cost_models", "planning", "passes", "runtime", "inspect"},
    "testing": {"core", "models", "api"},
    "entry": {"core", "models", "cost_models", "ir", "planning", "runtime", "inspect", "api", "testing"},
}
ENTRY_MODULES = {"autopar", "autopar.__main__", "autopar.cli", "autopar.demo"}


def layer_of(module: str) -> str:
    """``autopar.planning.solver`` -> ``planning``; the package and its entry points -> ``entry``."""
    if module in ENTRY_MODULES:
        return "entry"
    if module == "autopar.api":
        return "api"
    return module.split(".")[1]


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in SOURCE_FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported_modules(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every autopar import in ``path``, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names] if node.module is None or target == "autopar" else []
            found += [(node.lineno, n) for n in names] or [(node.lineno, target)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(line, name) for line, name in found if name == "autopar" or name.startswith("autopar.")]


def _known(name: str, known: set[str]) -> str:
    """The module ``name`` refers to: ``from autopar import plan`` names a function of ``autopar``."""
    while name not in known:
        name = name.rsplit(".", 1)[0]
    return name


def test_every_module_belongs_to_a_layer():
    assert {layer_of(m) for m in modules()} <= set(LAYERS)


def test_imports_point_down_the_layers():
    found = modules()
    wrong = []
    for module, path in found.items():
        layer = layer_of(module)
        for line, name in imported_modules(module, path):
            target = layer_of(_known(name, set(found)))
            if target != layer and target not in LAYERS[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {name} ({target})")
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(wrong)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_the_layers_form_no_cycle(layer):
    seen, todo = set(), [layer]
    while todo:
        for used in LAYERS[todo.pop()]:
            assert used != layer, f"layer {layer} can reach itself through {used}"
            if used not in seen:
                seen.add(used)
                todo.append(used)
