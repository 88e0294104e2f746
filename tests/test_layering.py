"""Imports run one way: each layer of the package imports only from layers below it, so there is no
cycle between packages (type-only imports under ``TYPE_CHECKING`` included: a cycle in types is a
cycle in the design)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdec"

# Lowest first; a module may import its own layer and any layer listed before it.
LAYERS = [
    {"validation", "registry", "outputs", "spec_stats", "tokenizer", "text"},
    {"cache", "backends", "sampling", "output_processor", "distributed"},
    {"models"},
    {"runtime"},
    {"proposers", "verifiers", "train", "zoo"},
    {"engine", "engine_args"},
    {"llm", "bench", "server", "cli"},
]


def _layer(part: str) -> int:
    for index, names in enumerate(LAYERS):
        if part in names:
            return index
    raise AssertionError(f"specdec.{part} is in no layer of the test; add it to LAYERS")


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec."):
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("specdec."))


def test_every_module_imports_only_from_its_layer_or_below():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",) or rel.parts[0] == "__main__.py":
            continue
        own = _layer(rel.parts[0].removesuffix(".py"))
        for module in _imports(path):
            other = module.split(".")[1]
            if _layer(other) > own:
                wrong.append(f"{rel} imports {module}")
    assert wrong == []
