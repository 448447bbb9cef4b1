"""Compile a Program's templates: lower, partition, generate kernels, splice them into graphs.

For every template two graphs are built (see `mtc.graphs.partition`): the forward, used in
forward visits, and the joint forward+backward, used in backward visits (it recomputes the layer
and returns its gradients in one go). Each fusion group that the generator can express becomes
one generated Triton kernel called from the graph; anchors (matmuls, attention) and the ops no
kernel covers stay ATen calls, and the report says which. Kernels are cached in the plan
directory by source hash, so recompiling an unchanged plan generates nothing.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import fx

from mtc.graphs.partition import FusionGroup, Partition, forward_graph, joint_graph, partition
from mtc.graphs.program import Program, Template, devices_to_marker, instantiate
from mtc.graphs.rewrite import fold_ce_grad_scale, use_flash_attention
from mtc.kernels.codegen import CodegenError, FusedKernel, compile_group

__all__ = ["CompiledTemplate", "GraphReport", "cache_key", "compile_program", "compile_template", "format_report", "write_report"]


@dataclasses.dataclass(frozen=True, slots=True)
class GraphReport:
    """Op and kernel counts of one lowered graph before and after fusion."""

    aten_ops: int
    kernels: int
    groups: int
    generated: int
    fallbacks: dict[str, int]
    not_generated: dict[str, int]
    hand_tuned: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class CompiledTemplate:
    """A template's fused forward and joint graphs (device-independent until `module`)."""

    template_id: str
    forward_graph: fx.Graph
    joint_graph: fx.Graph
    diff: list[int]
    forward_report: GraphReport
    backward_report: GraphReport
    _modules: dict[tuple[str, str], fx.GraphModule] = dataclasses.field(default_factory=dict, repr=False)

    def module(self, which: str, device: torch.device | str) -> fx.GraphModule:
        """The runnable 'forward' or 'joint' GraphModule with device arguments bound to ``device``."""
        key = (which, str(torch.device(device)))
        gm = self._modules.get(key)
        if gm is None:
            gm = self._modules[key] = instantiate(self.forward_graph if which == "forward" else self.joint_graph, device)
        return gm


def cache_key() -> str:
    """What generated kernels depend on besides their source: torch, triton, device capability."""
    import triton

    cap = "cpu-interpreter"
    if torch.cuda.is_available():
        cap = "sm%d%d" % torch.cuda.get_device_capability()
    return f"torch{torch.__version__}-triton{triton.__version__}-{cap}".replace("+", "_")


def _fuse(gm: fx.GraphModule, cache_dir: Path, unfused_ops: int | None = None) -> tuple[fx.Graph, GraphReport]:
    """Generate and splice a kernel per fusion group; ``unfused_ops``: the ATen op count of the
    graph without hand-tuned swaps (the report compares against what unfused execution runs)."""
    p: Partition = partition(gm.graph)
    kernels: dict[int, FusedKernel] = {}
    skipped: Counter[str] = Counter()
    for i, group in enumerate(p.groups):
        try:
            kernels[i] = compile_group(group, cache_dir)
        except CodegenError as e:
            skipped[str(e).split(":")[0][:60]] += 1
    graph = _splice(gm.graph, [(p.groups[i], k) for i, k in kernels.items()])
    report = GraphReport(
        aten_ops=p.aten_ops() if unfused_ops is None else unfused_ops,
        kernels=p.kernels() + sum(len(p.groups[i].nodes) - 1 for i in range(len(p.groups)) if i not in kernels),
        groups=len(p.groups),
        generated=len(kernels),
        fallbacks=dict(p.fallback_ops()),
        not_generated=dict(skipped),
        hand_tuned=dict(Counter(str(n.target).removeprefix("mtc.").removesuffix(".default")
                                for n in p.anchors if str(n.target).startswith("mtc."))),
    )
    return graph, report


def _splice(graph: fx.Graph, fused: list[tuple[FusionGroup, FusedKernel]]) -> fx.Graph:
    """A new graph where each fused group is one kernel call, in a topological order."""
    unit_of: dict[fx.Node, int] = {}
    units: list[tuple[str, Any]] = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for group, kern in fused:
        uid = len(units)
        units.append(("group", (group, kern)))
        for n in group.nodes:
            unit_of[n] = uid
    for n in graph.nodes:
        if n not in unit_of:
            unit_of[n] = len(units)
            units.append(("node", n))

    def members(u: int) -> list[fx.Node]:
        kind, val = units[u]
        return val[0].nodes if kind == "group" else [val]

    deps: dict[int, set[int]] = {u: set() for u in range(len(units))}
    for u in range(len(units)):
        for m in members(u):
            for a in m.all_input_nodes:
                if unit_of[a] != u:
                    deps[u].add(unit_of[a])
    users: dict[int, set[int]] = {u: set() for u in deps}
    for u, ds in deps.items():
        for d in ds:
            users[d].add(u)
    first = {u: min(order[m] for m in members(u)) for u in deps}
    ready = [(first[u], u) for u, ds in deps.items() if not ds]
    heapq.heapify(ready)
    pending = {u: len(ds) for u, ds in deps.items()}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    while ready:
        _, u = heapq.heappop(ready)
        kind, val = units[u]
        if kind == "node":
            env[val] = new.node_copy(val, lambda x: env[x])
        else:
            group, kern = val
            call = new.call_function(kern, tuple(env[i] for i in group.inputs))
            call.meta["mtc_group"] = [n.name for n in group.nodes]
            for j, o in enumerate(group.outputs):
                env[o] = new.call_function(_item, (call, j))
                env[o].meta["val"] = o.meta.get("val")
        for w in users[u]:
            pending[w] -= 1
            if pending[w] == 0:
                heapq.heappush(ready, (first[w], w))
    if any(pending[u] for u in pending) or any(o not in env for g, _ in fused for o in g.outputs):
        raise RuntimeError("splicing fused kernels left nodes unplaced (a dependency cycle through a group)")
    new.lint()
    return new


def _item(t: tuple[torch.Tensor, ...], j: int) -> torch.Tensor:
    """The j-th output of a fused kernel call (a named function keeps generated graphs readable)."""
    return t[j]


def _devices_to_marker(graph: fx.Graph) -> None:
    for n in graph.nodes:
        n.args = devices_to_marker(n.args)
        n.kwargs = devices_to_marker(n.kwargs)


def compile_template(t: Template, cache_dir: str | Path, *, attention: str = "flash") -> CompiledTemplate:
    """Lower, partition and fuse one template (kernels cached under ``cache_dir``).

    ``attention``: "flash" runs mtc's Triton flash-attention kernels; "aten" keeps torch's SDPA
    kernels (``mtc::attention``), for comparison.
    """
    if attention not in ("flash", "aten"):
        raise ValueError(f"attention must be 'flash' or 'aten', got {attention!r}")
    cache = Path(cache_dir) / cache_key()
    fwd = forward_graph(t)
    joint, diff = joint_graph(t)
    for g in (fwd.graph, joint.graph):
        _devices_to_marker(g)
        if attention == "flash":
            use_flash_attention(g)
    fold_ce_grad_scale(joint.graph)
    # ATen ops are counted on the lowering without hand-tuned rewrites: what unfused execution runs
    unfused_f = partition(forward_graph(t, hand_tuned=False).graph).aten_ops()
    unfused_j = partition(joint_graph(t, hand_tuned=False)[0].graph).aten_ops()
    fg, frep = _fuse(fwd, cache, unfused_f)
    jg, jrep = _fuse(joint, cache, unfused_j)
    return CompiledTemplate(t.id, fg, jg, diff, frep, jrep)


def compile_program(program: Program, cache_dir: str | Path) -> dict[str, CompiledTemplate]:
    """Compile every template of ``program``."""
    return {tid: compile_template(t, cache_dir) for tid, t in program.templates.items()}



def format_report(program: Program, compiled: dict[str, CompiledTemplate]) -> str:
    """Per template: ATen ops vs kernel launches, forward and backward, and what stays on ATen."""
    lines = [f"{'template':26s} {'calls':>5s} {'fwd ATen ops':>12s} {'fwd kernels':>11s} {'bwd ATen ops':>12s} {'bwd kernels':>11s}"]
    for tid, ct in compiled.items():
        calls = sum(1 for c in program.layers if c.template == tid)
        f, b = ct.forward_report, ct.backward_report
        lines.append(f"{tid:26s} {calls:5d} {f.aten_ops:12d} {f.kernels:11d} {b.aten_ops:12d} {b.kernels:11d}")
        ht = Counter(f.hand_tuned) + Counter(b.hand_tuned)
        if ht:
            lines.append("    hand-tuned kernels: " + ", ".join(f"{k} x{v}" for k, v in sorted(ht.items())))
        fb = Counter(f.fallbacks) + Counter(b.fallbacks)
        if fb:
            lines.append("    on ATen (no generated kernel): " + ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(fb.items())))
        ng = Counter(f.not_generated) + Counter(b.not_generated)
        if ng:
            lines.append("    groups left unfused: " + "; ".join(f"{k} x{v}" for k, v in sorted(ng.items())))
    return "\n".join(lines)


def write_report(program: Program, compiled: dict[str, CompiledTemplate], plan_dir: str | Path) -> str:
    """Write ``compile_report.json`` into the plan directory and return the printable report."""
    import json

    doc = {
        tid: {"calls": sum(1 for c in program.layers if c.template == tid),
              "forward": dataclasses.asdict(ct.forward_report), "backward": dataclasses.asdict(ct.backward_report)}
        for tid, ct in compiled.items()
    }
    doc["cache_key"] = cache_key()
    Path(plan_dir, "compile_report.json").write_text(json.dumps(doc, indent=1))
    return format_report(program, compiled)
