"""The runtime does not reach back up: no tracer, compiler, models, data or training loop imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "mtc" / "runtime"
FORBIDDEN = ("mtc.tracer", "mtc.compiler", "mtc.models", "mtc.data", "mtc.train", "mtc.cli", "mtc.demo", "mtc.plan")


def _imports(path: Path) -> list[str]:
    mods = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.append(node.module)
    return mods


@pytest.mark.parametrize("path", sorted(RUNTIME.glob("*.py")), ids=lambda p: p.name)
def test_runtime_module_imports_nothing_above_it(path):
    bad = [m for m in _imports(path) if m.startswith(FORBIDDEN)]
    assert not bad, f"{path.name} imports {bad}: the runtime sees compiled templates through runners.LayerRunner"
