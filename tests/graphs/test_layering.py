"""The compiler's dependency direction: mtc -> kernels -> graphs, never back. graphs/ imports no
kernel module (kernels register their ops and swap rules themselves) and nothing above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
# graphs/ may use mtc.errors (a leaf) and itself; never the kernels, the compiler, the runtime or above
FORBIDDEN = ("mtc.kernels", "kernels", "mtc.compiler", "mtc.runtime", "mtc.train", "mtc.plan", "mtc.cli", "mtc.store", "mtc.tracer")


def _imports(path: Path) -> list[str]:
    mods = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods.append("." * node.level + (node.module or ""))
    return mods


@pytest.mark.parametrize("path", sorted(GRAPHS.rglob("*.py")), ids=lambda p: p.name)
def test_graphs_imports_no_kernels(path):
    bad = [m for m in _imports(path) if m == "mtc" or m in FORBIDDEN or m.startswith((*(f + "." for f in FORBIDDEN), "."))]
    assert not bad, f"graphs/{path.name} imports {bad}: graphs/ sits below kernels/ and the compiler"


def test_the_lint_sees_a_kernel_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import torch\nfrom mtc.kernels.codegen import FUSIBLE\n")
    assert "mtc.kernels.codegen" in _imports(bad)
