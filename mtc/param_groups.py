"""Weight-decay groups: which parameters AdamW decays, from ``optim.no_decay`` and ``optim.decay_min_ndim``.

A parameter decays when it has at least ``decay_min_ndim`` dimensions (default 2: matrices and
embeddings decay; biases and norm gains do not, as in nanoGPT and minGPT) and its name matches none
of the ``no_decay`` glob patterns (``fnmatch`` on the names ``model.named_parameters()`` gives,
e.g. ``"*.bias,*norm*,tok_emb.*"``). ``decay_min_ndim = 0`` with a pattern list gives the
transformers Trainer's rule (everything decays except what the patterns name).

The engine applies decay to one prefix of each layer's flat fp32 state, so the groups are part of
the state's layout: `apply_decay_groups` re-lays each layer out with the decayed parameters first.
That is why ``optim.no_decay`` and ``optim.decay_min_ndim`` cannot change on resume (the stored
arrays would be read with other offsets), while ``optim.weight_decay`` can.
"""

from __future__ import annotations

import dataclasses
import fnmatch

from mtc.config import OptimConfig
from mtc.errors import ConfigError
from mtc.graphs.program import ParamSpec, Program

__all__ = ["apply_decay_groups", "apply_frozen", "decay_names", "no_decay_patterns"]


def no_decay_patterns(optim: OptimConfig) -> list[str]:
    """The glob patterns of ``optim.no_decay`` (comma-separated; empty: none)."""
    return [p.strip() for p in optim.no_decay.split(",") if p.strip()]


def _decays(name: str, ndim: int, min_ndim: int, patterns: list[str]) -> bool:
    return ndim >= min_ndim and not any(fnmatch.fnmatchcase(name, p) for p in patterns)


def decay_names(shapes: dict[str, tuple[int, ...]], optim: OptimConfig) -> set[str]:
    """The names (of ``{name: shape}``) that decay under ``optim``; ConfigError for a pattern that matches nothing."""
    patterns = no_decay_patterns(optim)
    for p in patterns:  # a pattern that names no parameter is almost always a typo
        if not any(fnmatch.fnmatchcase(n, p) for n in shapes):
            sample = ", ".join(list(shapes)[:4])
            raise ConfigError(
                f"config field optim.no_decay: pattern {p!r} matches no parameter name (names look like {sample}); "
                "fix the pattern (fnmatch syntax, e.g. '*.bias,*norm*') or remove it"
            )
    return {n for n, s in shapes.items() if _decays(n, len(s), optim.decay_min_ndim, patterns)}


def apply_frozen(program: Program, model: object) -> Program:
    """``program`` with its parameters frozen as ``model``'s are (``requires_grad=False``): the
    model the run starts from decides, whatever model the plan was traced from. A frozen
    parameter never decays, so run `apply_decay_groups` after this to lay the groups out again."""
    frozen = {k for k, p in model.named_parameters() if not p.requires_grad}  # type: ignore[attr-defined]
    if all((k in frozen) == p.frozen for k, p in program.params.items()):
        return program
    params = {k: dataclasses.replace(p, frozen=k in frozen) for k, p in program.params.items()}  # (decay: below)
    return dataclasses.replace(program, params=params)


def apply_decay_groups(program: Program, optim: OptimConfig) -> Program:
    """``program`` with its flat layout re-laid for ``optim``'s decay groups (decayed parameters
    first in each layer, first-use order kept within each group); the program itself is returned
    when nothing changes, so a preset with the default rule keeps the tracer's layout exactly."""
    shapes = {k: p.spec.shape for k, p in program.params.items()}
    decayed = decay_names(shapes, optim) - {k for k, p in program.params.items() if p.frozen}  # frozen: never
    if all((k in decayed) == p.decay for k, p in program.params.items()):
        return program
    laid: dict[str, ParamSpec] = {}
    for layer in range(program.n_layers):
        specs = program.layer_params(layer)  # current flat order = first-use order within groups
        specs.sort(key=lambda p: p.key not in decayed)  # stable
        off = 0
        for p in specs:
            laid[p.key] = dataclasses.replace(p, offset=off, decay=p.key in decayed)
            off += p.numel
    # keep the dict in the module's parameter order: the clipping norm sums over it in that order
    return dataclasses.replace(program, params={k: laid[k] for k in program.params})
