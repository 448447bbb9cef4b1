"""kernels/ sits between the compiler and graphs/ (DESIGN.md: mtc/ -> mtc/runtime/ -> kernels/ ->
graphs/): it imports graphs/, store/ and itself, and from mtc/ only the shared errors; never the
compiler, the runtime, the training loop, the CLI or anything else in mtc/, in any form
(tests/layering.py: ``from mtc import X``, relative imports, importlib with a constant name)."""

from __future__ import annotations

import pytest

from tests.layering import PACKAGES, imports, mtc_modules, offending

KERNELS = PACKAGES["mtc.kernels"]
BASE = ("mtc.errors",)
FORBIDDEN = tuple(m for m in mtc_modules() if m not in BASE)  # mtc.compiler, mtc.runtime, mtc.train, mtc.cli, ...


@pytest.mark.parametrize("path", sorted(KERNELS.rglob("*.py")), ids=lambda p: p.name)
def test_kernels_import_nothing_above_them(path):
    bad = offending(imports(path), FORBIDDEN)
    assert not bad, f"kernels/{path.name} imports {bad}: kernels/ sits below the compiler and the runtime"


def test_the_forbidden_list_names_the_modules_above_the_kernels():
    assert {"mtc.compiler", "mtc.runtime", "mtc.train", "mtc.cli", "mtc.tracer", "mtc.api"} <= set(FORBIDDEN)


@pytest.mark.parametrize("line", [
    "import mtc.compiler",
    "from mtc.runtime.executor import Executor",
    "from mtc import train",
    "from mtc import cli, errors",
    "from mtc import compile",  # the public API: mtc itself
    "import mtc",
    "from .. import compiler",
    "from ..runtime import executor",
    "import importlib\nimportlib.import_module('mtc.cli')",
    "def f():\n    from mtc.compiler import launches\n",
])
def test_the_lint_sees_an_upward_import(tmp_path, line):
    bad = tmp_path / "x.py"
    bad.write_text(f"import torch\nfrom mtc.errors import KernelInputError\nfrom mtc.graphs.partition import classify\n{line}\n")
    got = offending(imports(bad, "mtc.kernels"), FORBIDDEN)
    assert len(got) == 1, (line, got, imports(bad, "mtc.kernels"))


@pytest.mark.parametrize("line", ["from . import tuning", "from .codegen import FUSIBLE", "from mtc.kernels import tuning",
                                  "from ..graphs import views", "from mtc.store import TensorStore", "from .. import errors"])
def test_the_lint_lets_kernels_import_what_is_below_them(tmp_path, line):
    ok = tmp_path / "x.py"
    ok.write_text(line + "\n")
    assert offending(imports(ok, "mtc.kernels"), FORBIDDEN) == [], imports(ok, "mtc.kernels")
