"""Runs that change: which config fields a resumed run may change, why the others may not, and
the history of changes a store records.

A resumed run compares its config with the one its last commit recorded. Fields in
`CHANGEABLE` may differ when the user names them (``--allow-change steps,optim.lr``): each such
resume appends ``{"from_step", "fields", "values": {field: [old, new]}}`` to the commit's
``meta["changes"]``, carried by every later commit (and so in ``commits.jsonl``); `mtc inspect`
prints it. Changing ``steps`` re-plans the schedule: the learning rate of every later step is the
one the new schedule gives that step (so a run extended from 4 to 8 steps continues on the 8-step
cosine curve from step 4, not where the 4-step curve ended). The other fields would reinterpret
the stored state; `REFUSED` says why for each.
"""

from __future__ import annotations

import math
from typing import Any

from mtc.errors import ConfigError

__all__ = ["CHANGEABLE", "REFUSED", "change_values", "config_changes", "describe_history"]

# fields a resumed run may change when named in --allow-change
CHANGEABLE = ("data", "steps", "grad_accum", "seed", "optim.lr", "optim.min_lr", "optim.warmup_steps",
              "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.eps", "optim.clip_norm")

# why the others may not
REFUSED = {
    "model": "the stored arrays hold this model's parameters (their shapes and the plan's templates)",
    "model_overrides": "they change the model's shapes, which the stored arrays and the plan fix",
    "micro_batch_size": "the plan in the store was traced at this micro-batch shape (its templates have static shapes)",
    "seq_len": "the plan in the store was traced at this sequence length (its templates have static shapes)",
    "compute_dtype": "the plan in the store was traced in this dtype; the fp32 state is fine, the templates are not",
    "optim.no_decay": "the weight-decay groups decide the flat layout of every layer's stored state",
    "optim.decay_min_ndim": "the weight-decay groups decide the flat layout of every layer's stored state",
}


def config_changes(saved: dict[str, Any], now: dict[str, Any], allow: tuple[str, ...], store: str) -> list[str]:
    """The fields that differ between the flat configs ``saved`` and ``now`` (all allowed), sorted.

    ConfigError when a field differs that ``allow`` does not name: one line with the fields, the
    reason for any that can never change, and the --allow-change that would pass.
    """
    bad = [f for f in allow if f not in CHANGEABLE]
    if bad:
        why = "; ".join(f"{f}: {REFUSED[f]}" for f in bad if f in REFUSED)
        raise ConfigError(f"--allow-change {','.join(bad)}: only {', '.join(CHANGEABLE)} may change on resume"
                          + (f" ({why})" if why else "; the others would reinterpret the stored state")
                          + "; start a new run (new store) for them")
    changes = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    # a min_lr that kept its ratio to a changed lr (named without min_lr: mtc.config.min_lr_for)
    # changes with it: --allow-change optim.lr covers both
    rides = "optim.lr" in changes and "optim.min_lr" in changes and _same_ratio(saved, now)
    diff = [k for k in changes if k not in allow and not (rides and k == "optim.min_lr" and "optim.lr" in allow)]
    if diff:
        fix = [k for k in diff if k in CHANGEABLE and not (rides and k == "optim.min_lr")]
        never = [f"{k} ({REFUSED[k]})" for k in diff if k in REFUSED]
        shown = ", ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in diff)
        raise ConfigError(
            f"store {store} was created with a different config (differs in: {shown}); "
            + (f"cannot change {'; '.join(never)}; " if never else "")
            + "resume with the same config" + (f", or pass --allow-change {','.join(fix)}" if fix else "")
            + ", or use a new store directory"
        )
    return changes


def _same_ratio(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether min_lr / lr is the same (to float rounding) in the flat configs ``saved`` and ``now``."""
    try:
        a = saved["optim.min_lr"] / saved["optim.lr"]
        b = now["optim.min_lr"] / now["optim.lr"]
    except (KeyError, TypeError, ZeroDivisionError):
        return False
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def change_values(saved: dict[str, Any], now: dict[str, Any], fields: list[str]) -> dict[str, list[Any]]:
    """``{field: [old, new]}`` for the history record (data: the data's path)."""
    return {f: [saved.get(f), now.get(f)] for f in fields}


def describe_history(changes: list[dict[str, Any]]) -> list[str]:
    """One line per recorded change: 'step 4: steps 4 -> 8, optim.lr 0.003 -> 0.001'."""
    lines = []
    for c in changes:
        vals = c.get("values") or {}
        parts = [f"{f} {vals[f][0]} -> {vals[f][1]}" if f in vals else f for f in c.get("fields", [])]
        lines.append(f"from step {c.get('from_step')}: {', '.join(parts)}")
    return lines
