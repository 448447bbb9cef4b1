"""For the layering lints (tests/*/test_layering.py): what a source file imports, as installed
module names, whatever the form: ``import a.b``, ``from a import b`` (``a.b`` where ``b`` is one
of mtc's modules, else ``a``: ``from mtc import trace`` is the public API, ``mtc``), relative
imports resolved against the file's package, and ``importlib.import_module`` / ``__import__``
of a constant name. Imports inside functions and under ``if TYPE_CHECKING`` count too."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed package -> source folder (pyproject's package-dir)
PACKAGES = {"mtc": ROOT / "mtc", "mtc.kernels": ROOT / "kernels", "mtc.graphs": ROOT / "graphs", "mtc.store": ROOT / "store"}


def _source(name: str) -> Path | None:
    """The file or folder of mtc's module ``name``; None when it is not one of mtc's."""
    for pkg in sorted(PACKAGES, key=len, reverse=True):
        if name == pkg or name.startswith(pkg + "."):
            base = PACKAGES[pkg].joinpath(*name[len(pkg):].split(".")[1:])
            for p in (base.with_suffix(".py"), base / "__init__.py"):
                if p.is_file():
                    return p
            return None
    return None


def package_of(path: Path) -> str:
    """The installed package a source file of this repository belongs to (``kernels/x.py``: mtc.kernels)."""
    path = path.resolve()
    for pkg, folder in sorted(PACKAGES.items(), key=lambda kv: len(kv[1].parts), reverse=True):
        if path.is_relative_to(folder):
            return ".".join([pkg, *path.parent.relative_to(folder).parts])
    raise ValueError(f"{path} is not in one of mtc's packages")


def _walk(tree: ast.AST, at_import: bool) -> Iterable[ast.AST]:
    """``ast.walk``; with ``at_import``, not into function bodies (what runs when the module is imported)."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        yield node
        if at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports(path: Path, package: str | None = None, *, at_import: bool = False) -> list[str]:
    """Every module ``path`` imports, as an absolute name; ``package``: the package relative
    imports resolve against (default: the one ``path`` is in); ``at_import``: only those made
    when the module is imported (not inside functions)."""
    mods: list[str] = []
    pkg = None
    for node in _walk(ast.parse(path.read_text()), at_import):
        if isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = pkg or package or package_of(path)
                parts = pkg.split(".")
                if node.level - 1 >= len(parts):
                    mods.append("." * node.level + base)  # beyond the top: unresolvable, reported as written
                    continue
                base = ".".join([*parts[:len(parts) - node.level + 1], *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                mods.append(sub if _source(sub) is not None else base)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__"):
                target = node.args[0].value
                if target.startswith(".") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    anchor = str(node.args[1].value).split(".")
                    level = len(target) - len(target.lstrip("."))
                    target = ".".join([*anchor[:len(anchor) - level + 1], target.lstrip(".")])
                mods.append(target)
    return mods


def mtc_modules() -> list[str]:
    """The top-level modules and packages in mtc/ (mtc.api, mtc.runtime, ...), not mtc.kernels,
    mtc.graphs or mtc.store, whose sources live in their own folders."""
    folder = PACKAGES["mtc"]
    return sorted(f"mtc.{p.stem}" for p in folder.iterdir()
                  if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file()))


def offending(mods: Iterable[str], forbidden: Iterable[str]) -> list[str]:
    """The names in ``mods`` that are a forbidden module or inside one; ``mtc`` itself (``import
    mtc``, ``from mtc import trace``: the public API, which imports everything) is always one."""
    forbidden = tuple(forbidden)
    return [m for m in mods if m == "mtc" or m.startswith(".") or m in forbidden or m.startswith(tuple(f + "." for f in forbidden))]
