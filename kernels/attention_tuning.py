"""Decide a compiled graph's attention kernels ahead of the run, so a plan carries its tuning.

The flash-attention ops pick their tiles, and between cuDNN and Triton, by timing on the first
launch for each shape (kernels/flash_attention.py, kernels/tuning.py). `tune_attention` makes
those first launches at compile time: every ``mtc::flash_attention_fwd`` / ``_bwd`` call of a
lowered graph runs once on random inputs laid out as the graph's values are (the backward after
a forward on the same inputs: its logsumexp must be the real one for cuDNN's results to be
compared with the Triton kernels'), inside a recording of the tuner, and the decisions come back
as `Decisions` for the compiler to store with the template. A process that loads the plan seeds
the tuner with them (`flash_attention.seed_tuning`) and launches without timing.

Nothing runs where there is nothing to choose: in Triton's interpreter every kernel has one tile
candidate and cuDNN takes no part, so on the CPU this costs nothing unless a test gives the
interpreter several candidates.
"""

from __future__ import annotations

import torch
from torch import fx

from mtc.kernels import flash_attention as fa
from mtc.kernels.tuning import Decisions, tuning_input

__all__ = ["tune_attention"]


def _meta(a: object) -> torch.Tensor:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    assert isinstance(v, torch.Tensor), f"flash-attention argument {a} of a lowered graph has no tensor value"
    return v


def tune_attention(graphs: list[fx.Graph], device: torch.device) -> Decisions:
    """Launch each distinct flash-attention call of ``graphs`` once on ``device`` where there is
    something to choose; returns the decisions those shapes use (timed now, or already known)."""
    fwd_op = torch.ops.mtc.flash_attention_fwd.default
    bwd_op = torch.ops.mtc.flash_attention_bwd.default
    problems: dict[tuple, tuple[tuple[torch.Tensor, ...], bool, float, torch.Tensor | None]] = {}
    for g in graphs:
        for n in g.nodes:
            if n.op != "call_function" or n.target not in (fwd_op, bwd_op):
                continue
            if n.target is fwd_op:
                q, k, v, causal, scale = n.args
                grad = None
            else:
                grad, q, k, v, _, _, causal, scale = n.args
            qkv = tuple(_meta(a) for a in (q, k, v))
            gv = _meta(grad) if grad is not None else None
            key = (*((tuple(t.shape), t.stride(), t.dtype) for t in qkv), bool(causal), float(scale))
            if key not in problems or problems[key][3] is None:  # a backward covers its forward too
                problems[key] = (qkv, bool(causal), float(scale), gv)
    ran = False
    with fa.recording() as decisions:
        for qkv, causal, scale, gv in problems.values():
            qm = qkv[0]
            if not fa.has_choices(torch.empty((0, qm.shape[-1]), dtype=qm.dtype, device=device)):
                continue
            q, k, v = (tuning_input(t, device) for t in qkv)
            out, lse = fwd_op(q, k, v, causal, scale)
            if gv is not None:
                bwd_op(tuning_input(gv, device), q, k, v, out, lse, causal, scale)
            del q, k, v, out, lse
            ran = True
    if ran and device.type == "cuda":
        torch.cuda.empty_cache()  # the random inputs must not stay reserved for the run that follows
    return decisions
