"""Compiled (fused) plans on several ranks: one rank compiles, the others load what it wrote.

A fused run keeps its compiled templates in the run's plan directory (``RUN/plan/kernels``: one
record per template and the generated kernel sources; `mtc compile` or an earlier run may have
filled it). With N ranks, N compilers writing the same files at once could leave one rank loading
another's half-written kernel, and N compilations of the same templates on one host's cores would
take N times the CPU for nothing. So rank 0 loads or compiles into the run's cache first, the
other ranks wait for it at a barrier (on the startup group, whose timeout allows a long compile),
then each loads from a private copy of that cache: normally every record is fresh and nothing is
compiled again; a rank on a different machine (another torch, another GPU capability) recompiles
only what is stale for it, into its own copy, never into the shared directory. The copies are
removed when the run ends. If rank 0 fails to compile, every rank stops with one line.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from mtc.errors import MTCError

__all__ = ["PrivateCache", "compile_on_ranks"]


class PrivateCache:
    """A rank's private copy of the run's kernel cache (removed by `close`)."""

    def __init__(self, shared: Path) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="mtc-kernels-rank-"))
        if shared.is_dir():
            shutil.copytree(shared, self.path, dirs_exist_ok=True)

    def close(self) -> None:
        """Remove the copy (the run's compiled templates are loaded; their kernels live in memory)."""
        shutil.rmtree(self.path, ignore_errors=True)


def compile_on_ranks(program: object, root: Path, is_root: bool, compile_fn: Callable[[object, Path], dict],
                     keep: list) -> dict:
    """The compiled templates of a data-parallel rank: rank 0 (``is_root``) compiles into
    ``root/plan/kernels``; the others load a private copy once it is done. ``compile_fn(program,
    cache_dir)`` is `mtc.compiler.compile_program`; ``keep`` receives what must be closed after the run."""
    import torch.distributed as dist

    from mtc.dist import groups
    from mtc.runtime.collectives import collective

    shared = Path(root) / "plan" / "kernels"
    done = torch.zeros(1, dtype=torch.int64)
    compiled: dict | None = None
    if is_root:
        try:
            compiled = compile_fn(program, shared)
            done.fill_(1)
        finally:  # the others learn of a failure at once instead of at the timeout
            collective("the compiled plan's barrier", dist.broadcast, done, src=0, group=groups().startup)
        return compiled
    collective("the compiled plan's barrier", dist.broadcast, done, src=0, group=groups().startup)
    if not int(done):
        raise MTCError("rank 0 could not compile the plan (see its error); this rank stops too")
    own = PrivateCache(shared)
    keep.append(own)
    return compile_fn(program, own.path)
