"""The runtime does not reach back up (DESIGN.md: mtc/ -> mtc/runtime/ -> kernels/ -> graphs/):
no tracer, compiler, models, data, training loop, CLI or public API imports, in any form
(tests/layering.py: ``from mtc import X``, relative imports, importlib with a constant name)."""

from __future__ import annotations

import pytest

from tests.layering import PACKAGES, imports, mtc_modules, offending

RUNTIME = PACKAGES["mtc"] / "runtime"
# what the runtime uses from mtc/ outside itself: the shared errors and the config dataclasses
# (with the two leaves mtc.config reads); graphs/ (the Program IR), kernels/ and store/ sit below it
BASE = ("mtc.errors", "mtc.config", "mtc.schema", "mtc.rank_dirs", "mtc.runtime")
# everything else in mtc/ is above the runtime (mtc.tracer, mtc.compiler, mtc.train, mtc.models,
# mtc.data, mtc.cli, mtc.api, mtc.plan, ...), and so is the tracer's home in graphs/
FORBIDDEN = (*(m for m in mtc_modules() if m not in BASE), "mtc.graphs.trace", "mtc.graphs.export")


@pytest.mark.parametrize("path", sorted(RUNTIME.rglob("*.py")), ids=lambda p: p.name)
def test_runtime_module_imports_nothing_above_it(path):
    bad = offending(imports(path), FORBIDDEN)
    assert not bad, f"{path.name} imports {bad}: the runtime sees compiled templates through runners.LayerRunner"


@pytest.mark.parametrize("name", [m for m in BASE if m != "mtc.runtime"])
def test_what_the_runtime_uses_from_mtc_imports_nothing_above_the_runtime_when_imported(name):
    # else importing the runtime would import the compiler (say) through mtc.config. Only what a
    # module imports at import time: mtc.config's validation imports mtc.models and mtc.user_model
    # inside functions, to check a model preset's name
    path = PACKAGES["mtc"] / f"{name.removeprefix('mtc.')}.py"
    bad = offending(imports(path, at_import=True), FORBIDDEN)
    assert not bad, f"{path.name} imports {bad} when imported, and the runtime imports {name}"


def test_the_forbidden_list_names_the_modules_above_the_runtime():
    assert {"mtc.tracer", "mtc.compiler", "mtc.train", "mtc.models", "mtc.data", "mtc.cli", "mtc.api"} <= set(FORBIDDEN)
    assert not {"mtc.errors", "mtc.config", "mtc.runtime"} & set(FORBIDDEN)


@pytest.mark.parametrize("line", [
    "import mtc.compiler",
    "import mtc.tracer as tr",
    "from mtc.train import train",
    "from mtc import compiler",
    "from mtc import errors, models",
    "from mtc import trace",  # the public API: mtc itself
    "import mtc",
    "from .. import compiler",
    "from ..data.tokens import TokenFile",
    "from ...graphs.trace import trace",  # mtc/runtime/sub/x.py
    "from mtc.graphs.export import LossModel",
    "from mtc.graphs import trace",
    "import importlib\nimportlib.import_module('mtc.cli')",
    "def f():\n    from mtc.plan import load_plan\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mtc.models import build\n",
])
def test_the_lint_sees_an_upward_import(tmp_path, line):
    bad = tmp_path / "x.py"
    bad.write_text(f"import torch\nfrom mtc.errors import MTCError\nfrom mtc.graphs.program import Program\n{line}\n")
    package = "mtc.runtime.sub" if line.startswith("from ...") else "mtc.runtime"
    got = offending(imports(bad, package), FORBIDDEN)
    assert len(got) == 1, (line, got, imports(bad, package))


@pytest.mark.parametrize("line", ["from . import tiers", "from .transfer import CopyEngine", "from mtc.kernels import adamw",
                                  "from mtc.store import TensorStore", "from mtc import errors", "from .. import config"])
def test_the_lint_lets_the_runtime_import_what_is_below_it(tmp_path, line):
    ok = tmp_path / "x.py"
    ok.write_text(line + "\n")
    assert offending(imports(ok, "mtc.runtime"), FORBIDDEN) == [], imports(ok, "mtc.runtime")


def test_the_import_time_lint_sees_module_level_imports_only(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("from mtc.errors import ConfigError\ntry:\n    import mtc.compiler\nexcept ImportError:\n    pass\n"
                   "class C:\n    import mtc.train\n\ndef f():\n    from mtc.models import build\n")
    assert offending(imports(src, "mtc", at_import=True), FORBIDDEN) == ["mtc.compiler", "mtc.train"]
    assert sorted(offending(imports(src, "mtc"), FORBIDDEN)) == ["mtc.compiler", "mtc.models", "mtc.train"]
