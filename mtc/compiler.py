"""Compile a Program's templates: one flat pipeline of named passes, and plans that load.

For every template two graphs are built: the forward, used in forward visits, and the joint
forward+backward, used in backward visits (it recomputes the layer and returns its gradients in
one go); a block gets two more, for the layers that keep their activations between the visits
(the saving forward and the backward from saved values). `PASSES` below is the whole pipeline, in order; each pass is a named function of the
template's `Work` (graphs/ does the graph work, kernels/ owns the kernels and their swaps):

    count ATen ops      lower without hand-tuned swaps: the op count unfused execution runs
    lower               forward and joint graphs in core ATen, template-level swaps applied
                        (grouped KV heads, linear + cross-entropy: kernels/swaps.py)
    mark devices        device arguments become a marker bound when the graph is instantiated
    flash attention     mtc::attention -> the Triton flash-attention kernels (optional)
    attention layouts   RoPE's q and k computed in the projections' (B, T, H, D) layout, so
                        attention's output comes out in it and needs no copy before the output
                        projection (graphs/views.py compute_in_source_layout)
    split saves         a block's joint graph traced with its outputs, cut into a forward that
                        also returns its matmul and attention outputs and a backward that reads
                        them (graphs/split.py): run where the GPU has room to keep them between
                        a layer's forward and backward visits, instead of recomputing the layer
    tune attention      each attention shape's tiles and cuDNN-or-Triton choice, timed now on
                        CUDA (kernels/attention_tuning.py) and stored with the template
    fold CE grad scale  the backward's gradient scale goes into the fused cross-entropy
    fuse matmul edges   norm prologues / activation + residual epilogues into a Triton matmul,
                        where it times faster than cuBLAS + a separate kernel (kernels/matmul_fusion.py)
    move views          aliases read through, broadcasts sunk below pointwise ops, slices and
                        transposes hoisted above them, a column sum read through the reshape above it
                        (graphs/views.py): no view splits two fusible ops into two kernels
    recompute joint     cheap values a forward group stores only for backward groups are
                        recomputed there instead (half-precision ones rounded as the store
                        rounded them: graphs/recompute.py)
    copy broadcast      a value smaller than its group's iteration shape (a norm's weight in
      outputs           fp32) that other kernels read is copied into them: a generated kernel
                        writes only full-shape outputs, and the group stayed on ATen
    fuse forward        partition (with codegen's FUSIBLE list), generate a kernel per group,
    fuse joint          splice the kernels into the graph (forward: the forward and the saving
                        forward; joint: the joint and the backward from saved values)
    tune generated      each column and rowcol kernel's launch configuration (tile, warps,
      kernels           programs per SM), timed now on CUDA and stored with the template

Each fusion group the generator can express becomes one generated Triton kernel called from the
graph; anchors (matmuls, attention) and the ops no kernel covers stay ATen calls, and the report
says which. `compile_program` stores each compiled template (graphs with kernels spliced in, the
report, the key it was compiled under) beside the kernel sources, and a later call loads it
instead of compiling; a template whose key no longer matches (mtc version, compiler and kernel
sources, torch, triton, device capability, input shapes and dtypes, options) is recompiled, and
says why, one line per template. The record also holds the template's tuning choices (attention
tiles and backends, matmul-fusion timings, generated kernels' launches) under the same key:
loading it seeds the tuners, so a run of a stored plan times nothing for the plan's shapes. Each
compiled template carries its compile (or load) seconds and the part spent timing candidates
(`plan_times`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import heapq
import json
import math
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from mtc.graphs.lower import Rewrite, forward_graph, joint_graph
from mtc.graphs.partition import VIEWS, FusibleOps, FusionGroup, Partition, classify, partition
from mtc.graphs.program import Program, Template, devices_to_marker, instantiate, joint_keeps_outputs
from mtc.graphs.program import aux_param_dependence as graphs_aux_param_dependence
from mtc.graphs.recompute import copy_broadcast_outputs, recompute_cheap
from mtc.graphs.serialize import SerializeError, graph_from_dict, graph_to_dict
from mtc.graphs.split import SplitError, split_joint
from mtc.graphs.views import compute_in_source_layout, drop_contiguous_clones, move_views, refresh_view_meta
from mtc.kernels.attention_tuning import tune_attention
from mtc.kernels.codegen import (
    FUSIBLE,
    TUNED_MODES,
    CodegenError,
    FusedKernel,
    compile_group,
    generated_tuning,
    load_kernel,
    seed_generated_tuning,
)
from mtc.kernels.flash_attention import seed_tuning
from mtc.kernels.matmul_fusion import Choices, fuse_matmuls
from mtc.kernels.swaps import (
    attention_output_layout_known,
    fold_ce_grad_scale,
    reads_any_layout,
    refresh_attention_meta,
    use_flash_attention,
    use_grouped_kv,
    use_linear_cross_entropy,
)
from mtc.kernels.tuning import Decisions, tuning_input
from mtc.plan import REPORT_FILE, write_atomic

__all__ = [
    "PASSES", "CompiledTemplate", "GraphReport", "Pass", "PlanTimes", "Work", "cache_key", "compile_program",
    "compile_template", "format_plan_times", "format_report", "launches", "log_stderr", "plan_times", "second_stage_launches",
    "staleness_key", "toolchain_key",
    "write_report",
]


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
    loaded: bool = False  # read back from a stored record (`compile_program`), not compiled in this process
    # {"attention": Decisions JSON, "matmul_fusion": {site key: timing}}: the choices its shapes use
    tuning: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0  # compiling it (or loading it) in this process
    tuning_s: float = 0.0  # of which timing kernel candidates (0 when loaded)
    # a block's split joint graph (graphs/split.py), when it has one: the forward that also returns
    # the values its backward reads, the backward from them, and their shapes and dtypes
    save_graph: fx.Graph | None = None
    backward_graph: fx.Graph | None = None
    saved: list[tuple[tuple[int, ...], torch.dtype]] = dataclasses.field(default_factory=list)
    split_reports: dict[str, GraphReport] = dataclasses.field(default_factory=dict)  # 'save', 'backward_saved'
    split_note: str = ""  # why a block has no split graphs, when it has none
    _modules: dict[tuple[str, str], fx.GraphModule] = dataclasses.field(default_factory=dict, repr=False)

    def graph(self, which: str) -> fx.Graph:
        """The compiled graph 'forward', 'joint', 'save' or 'backward'."""
        g = {"forward": self.forward_graph, "joint": self.joint_graph, "save": self.save_graph,
             "backward": self.backward_graph}[which]
        if g is None:
            raise KeyError(f"template {self.template_id} has no {which!r} graph ({self.split_note or 'not split'})")
        return g

    def module(self, which: str, device: torch.device | str) -> fx.GraphModule:
        """The runnable graph ``which`` (see `graph`) with device arguments bound to ``device``."""
        key = (which, str(torch.device(device)))
        gm = self._modules.get(key)
        if gm is None:
            gm = self._modules[key] = instantiate(self.graph(which), device)
        return gm

    def saved_bytes(self) -> int:
        """Bytes one call of the saving forward keeps for the backward (0: not split)."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.saved)


def _capability() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm{major}{minor}"
    return "cpu-interpreter"


def cache_key() -> str:
    """What generated kernels depend on besides their source: torch, triton, device capability."""
    import triton

    return f"torch{torch.__version__}-triton{triton.__version__}-{_capability()}".replace("+", "_")


def _fuse(graph: fx.Graph, cache_dir: Path, unfused_ops: int | None = None, fusible: FusibleOps = FUSIBLE,
          ) -> tuple[fx.Graph, GraphReport]:
    """Generate and splice a kernel per fusion group; ``unfused_ops``: the ATen op count of the
    graph without hand-tuned swaps (the report compares against what unfused execution runs)."""
    p: Partition = partition(graph, fusible)
    kernels: dict[int, FusedKernel] = {}
    skipped: Counter[str] = Counter()
    for i, group in enumerate(p.groups):
        try:
            kernels[i] = compile_group(group, cache_dir)
        except CodegenError as e:
            skipped[str(e).split(":")[0][:60]] += 1
    spliced = _splice(graph, [(p.groups[i], k) for i, k in kernels.items()])
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
    return spliced, report


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


TEMPLATE_SWAPS: tuple[Rewrite, ...] = (use_grouped_kv, use_linear_cross_entropy)


@dataclasses.dataclass(slots=True)
class Work:
    """One template on its way through `PASSES`."""

    template: Template
    cache: Path
    attention: str
    grad_aux: tuple[bool, ...]
    forward: fx.Graph | None = None
    joint: fx.Graph | None = None
    diff: list[int] = dataclasses.field(default_factory=list)
    unfused_ops: tuple[int, int] = (0, 0)
    reports: dict[str, GraphReport] = dataclasses.field(default_factory=dict)
    matmul_fusion: str = "auto"  # kernels/matmul_fusion.MODES: 'auto' times on CUDA; 'on' forces (CPU tests)
    joint_outputs: bool = True  # the joint graph returns the template's outputs (else None: graphs.lower)
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # where tuning runs
    choices: Choices | None = None  # matmul-fusion timings (kernel cache, stamped with `toolchain_key`)
    attention_choices: Decisions = dataclasses.field(default_factory=Decisions)
    generated_choices: Decisions = dataclasses.field(default_factory=Decisions)  # column/rowcol launch configurations
    tuning_s: float = 0.0
    split: bool = True  # a block also gets the split graphs (graphs/split.py)
    joint_full: fx.Graph | None = None  # a block's joint traced with its outputs, until it is split
    save: fx.Graph | None = None
    backward: fx.Graph | None = None
    saved: list[tuple[tuple[int, ...], torch.dtype]] = dataclasses.field(default_factory=list)
    split_note: str = ""
    fusible: FusibleOps = FUSIBLE  # what partitioning may put in one kernel (codegen's list)

    def graphs(self) -> list[fx.Graph]:
        """Every graph this template has at this point of the pipeline."""
        return [g for g in (self.forward, self.joint, self.joint_full, self.save, self.backward) if g is not None]

    def joints(self) -> list[fx.Graph]:
        """The graphs that run a backward: the joint and the backward from saved values."""
        return [g for g in (self.joint, self.backward) if g is not None]


@dataclasses.dataclass(frozen=True, slots=True)
class Pass:
    """A named step of the compiler."""

    name: str
    run: Callable[[Work], None]


def _count_aten_ops(w: Work) -> None:
    """What unfused execution launches: the lowering without hand-tuned swaps, partitioned."""
    fwd = forward_graph(w.template).graph
    joint = joint_graph(w.template, grad_aux=w.grad_aux)[0].graph
    w.unfused_ops = (partition(fwd, FUSIBLE).aten_ops(), partition(joint, FUSIBLE).aten_ops())


def _lower(w: Work) -> None:
    w.forward = forward_graph(w.template, TEMPLATE_SWAPS).graph
    jg, w.diff = joint_graph(w.template, TEMPLATE_SWAPS, w.grad_aux, outputs=w.joint_outputs)
    w.joint = jg.graph
    if w.split and w.template.kind == "block":  # (the embed stage and the head gain nothing: see `_split_saves`)
        w.joint_full = _copy_graph(jg.graph) if w.joint_outputs else joint_graph(w.template, TEMPLATE_SWAPS, w.grad_aux)[0].graph


def _mark_devices(w: Work) -> None:
    for g in w.graphs():
        for n in g.nodes:
            n.args = devices_to_marker(n.args)
            n.kwargs = devices_to_marker(n.kwargs)


def _flash_attention(w: Work) -> None:
    if w.attention == "flash":
        for g in w.graphs():
            use_flash_attention(g)


def _attention_layouts(w: Work) -> None:
    # RoPE's q and k computed in the projections' (B, T, H, D) layout: attention's output follows
    # q's, and the transpose back to (B, T, H * D) before the output projection is a view, not a
    # copy (graphs/views.py compute_in_source_layout); a model whose views then no longer apply
    # keeps its graph as it was
    if w.attention != "flash":
        return
    for field in ("forward", "joint", "joint_full"):
        g = getattr(w, field)
        if g is None:
            continue
        trial = copy.deepcopy(g)
        try:
            moved = compute_in_source_layout(trial, w.fusible, reads_any_layout)
            refresh_view_meta(trial)
            refresh_attention_meta(trial)
            refresh_view_meta(trial)  # the attention outputs' items and views
            dropped = drop_contiguous_clones(trial, attention_output_layout_known)
            trial.lint()
        except (RuntimeError, ValueError):
            continue
        if moved or dropped:
            setattr(w, field, trial)


def _split_saves(w: Work) -> None:
    # Only blocks: the head's forward and backward run in one visit already, and the embed
    # stage's forward is a lookup. A graph that cannot be cut keeps recomputing, and says why.
    if w.joint_full is None:
        return
    full, w.joint_full = w.joint_full, None
    try:
        sp = split_joint(full, len(w.template.inputs), 1 + w.template.n_aux_out,
                         lambda n: classify(n, w.fusible) in ("view", "fusible"))
    except SplitError as e:
        w.split_note = f"not split: {e}"
        return
    w.save, w.backward, w.saved = sp.save, sp.backward, sp.saved


def _copy_graph(g: fx.Graph) -> fx.Graph:
    """A copy of ``g`` that later passes can rewrite on their own."""
    new = fx.Graph()
    out = new.graph_copy(g, {})
    new.output(out)
    return new


def _tune_attention(w: Work) -> None:
    t0 = time.perf_counter()
    w.attention_choices = tune_attention(w.graphs(), w.device)
    w.tuning_s += time.perf_counter() - t0


def _fold_ce_grad_scale(w: Work) -> None:
    fold_ce_grad_scale(w.joint)


def _fuse_matmul_edges(w: Work) -> None:
    # the timings exist on CUDA only ('auto' fuses nothing on the CPU; 'on' asks no timing)
    choices = w.choices if w.device.type == "cuda" else None
    t0 = choices.seconds if choices is not None else 0.0
    for g in w.graphs():
        fuse_matmuls(g, w.matmul_fusion, w.cache, device=w.device, choices=choices)
    if choices is not None:
        w.tuning_s += choices.seconds - t0


def _move_views(w: Work) -> None:
    for g in w.graphs():
        move_views(g, w.fusible)


def _recompute_joint(w: Work) -> None:
    # copying a broadcast value into its readers re-forms groups, which can make more values
    # cheap to recompute (GPT-2's LayerNorm backward), and recomputing can leave a broadcast
    # value behind: alternate until neither finds anything
    for g in w.joints():
        for _ in range(4):
            if not recompute_cheap(g, w.fusible) + copy_broadcast_outputs(g, w.fusible):
                break


def _copy_broadcast_outputs(w: Work) -> None:
    for g in w.graphs():
        copy_broadcast_outputs(g, w.fusible)


def _fuse_forward(w: Work) -> None:
    w.forward, w.reports["forward"] = _fuse(w.forward, w.cache, w.unfused_ops[0], w.fusible)
    if w.save is not None:
        w.save, w.reports["save"] = _fuse(w.save, w.cache, fusible=w.fusible)


def _fuse_joint(w: Work) -> None:
    w.joint, w.reports["backward"] = _fuse(w.joint, w.cache, w.unfused_ops[1], w.fusible)
    if w.backward is not None:
        w.backward, w.reports["backward_saved"] = _fuse(w.backward, w.cache, fusible=w.fusible)


def _tune_generated(w: Work) -> None:
    # after fusion, on CUDA: each column and rowcol kernel times its launch configurations once per
    # shape on inputs laid out as the graph's values (kernels/codegen.py, `FusedKernel.tune`)
    if w.device.type != "cuda":
        return
    t0 = time.perf_counter()
    untuned: list[str] = []
    with generated_tuning() as rec:
        for g in w.graphs():
            for n in g.nodes:
                k = n.target
                if n.op != "call_function" or not isinstance(k, FusedKernel) or k.mode not in TUNED_MODES:
                    continue
                vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in n.args]
                if not all(isinstance(v, torch.Tensor) for v in vals):
                    continue
                try:
                    ins = [tuning_input(v, w.device) for v in vals]
                except torch.OutOfMemoryError:  # a GPU already holding a run's state: the default launch
                    untuned.append(k.__name__)
                    continue
                k.tune(ins)
                del ins
    torch.cuda.empty_cache()  # the tuning inputs must not stay reserved for the run that follows
    if untuned:
        warnings.warn(f"{len(untuned)} generated kernels of template {w.template.id} keep their default launch configuration: "
                      f"no GPU memory for their tuning inputs ({', '.join(untuned[:4])}); compile the plan before a run "
                      "takes the GPU (`mtc compile`) to time them", stacklevel=2)
    w.generated_choices = rec
    w.tuning_s += time.perf_counter() - t0


PASSES: list[Pass] = [
    Pass("count ATen ops", _count_aten_ops),
    Pass("lower", _lower),
    Pass("mark devices", _mark_devices),
    Pass("flash attention", _flash_attention),
    Pass("attention layouts", _attention_layouts),
    Pass("split saves", _split_saves),
    Pass("tune attention", _tune_attention),
    Pass("fold CE grad scale", _fold_ce_grad_scale),
    Pass("fuse matmul edges", _fuse_matmul_edges),
    Pass("move views", _move_views),
    Pass("recompute joint", _recompute_joint),
    Pass("copy broadcast outputs", _copy_broadcast_outputs),
    Pass("fuse forward", _fuse_forward),
    Pass("fuse joint", _fuse_joint),
    Pass("tune generated kernels", _tune_generated),
]


def compile_template(
    t: Template, cache_dir: str | Path, *, attention: str = "flash", grad_aux: tuple[bool, ...] | list[bool] = (),
    matmul_fusion: str = "auto", joint_outputs: bool | None = None, split: bool = True, row_and_column: bool = True,
) -> CompiledTemplate:
    """Run `PASSES` over one template (kernels cached under ``cache_dir``).

    ``attention``: "flash" runs mtc's Triton flash-attention kernels; "aten" keeps torch's SDPA
    kernels (``mtc::attention``), for comparison. ``grad_aux``: for each aux output of the embed
    stage, whether it depends on a parameter (its gradient then flows back through the blocks).
    ``matmul_fusion``: 'auto' fuses matmul prologues/epilogues where they time faster on CUDA
    (never on the CPU), 'on' wherever they match, 'off' nowhere. ``joint_outputs``: whether the
    joint graph also returns the template's outputs; None (the default): as a training step needs
    them (`graphs.program.joint_keeps_outputs`: the head's loss, nothing of a block, whose backward
    then skips its last matmul); True for a forward + backward comparison with other backends.
    ``split``: a block also gets the graphs that keep values between its visits (``save`` and
    ``backward``: graphs/split.py), which the executor runs where `mtc.train` plans to.
    ``row_and_column``: False keeps row and column reductions in kernels of their own (no
    ``rowcol`` kernels: bench_fusion's A/B; plans always take them).
    """
    if attention not in ("flash", "aten"):
        raise ValueError(f"attention must be 'flash' or 'aten', got {attention!r}")
    t0 = time.perf_counter()
    cache = Path(cache_dir) / cache_key()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    w = Work(t, cache, attention, tuple(grad_aux), matmul_fusion=matmul_fusion, device=device,
             choices=Choices(cache, stamp=toolchain_key()),
             joint_outputs=joint_keeps_outputs(t) if joint_outputs is None else joint_outputs, split=split,
             fusible=FUSIBLE if row_and_column else dataclasses.replace(FUSIBLE, row_and_column=0))
    for p in PASSES:
        p.run(w)
    tuning = {"attention": w.attention_choices.to_json(), "generated": w.generated_choices.to_json(),
              "matmul_fusion": {k: w.choices.known[k] for k in sorted(w.choices.asked) if k in w.choices.known}}
    return CompiledTemplate(t.id, w.forward, w.joint, w.diff, w.reports["forward"], w.reports["backward"],
                            tuning=tuning, seconds=time.perf_counter() - t0, tuning_s=w.tuning_s,
                            save_graph=w.save, backward_graph=w.backward, saved=w.saved,
                            split_reports={k: w.reports[k] for k in ("save", "backward_saved") if k in w.reports},
                            split_note=w.split_note)


def launches(graph: fx.Graph) -> int:
    """Kernel-invoking nodes of a compiled graph (a CPU-countable proxy for GPU launches): every
    call but views and the picking of a fused kernel's outputs."""
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target not in VIEWS and n.target is not _item)


# -- plans that load ---------------------------------------------------------------------------

RECORDS = "compiled"  # sub-directory of the kernel cache holding one JSON record per template
RECORD_VERSION = 3  # 2: tuning choices and compile seconds in the record; 3: a block's split graphs
GRAPHS = ("forward", "joint", "save", "backward")  # a record's graphs (the last two: split blocks only)


@functools.cache
def _source_hash() -> str:
    """Hash of the code that decides what a compiled template is: graphs/, kernels/ and this file."""
    import mtc.graphs
    import mtc.kernels

    h = hashlib.sha256()
    files = [Path(__file__)] + [f for pkg in (mtc.graphs, mtc.kernels) for d in pkg.__path__ for f in sorted(Path(d).rglob("*.py"))]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _mtc_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtc")
    except PackageNotFoundError:
        return "unknown"


def toolchain_key() -> dict[str, str]:
    """What compiled kernels and their timings depend on besides shapes and options: mtc version,
    the compiler and kernel sources' hash, torch, triton, device capability, the GPU's model (an
    H100 and an H200 share sm90, not their timings) and whether fp32 matmuls run as TF32 (cuBLAS's
    speed, against which a fused matmul was chosen, depends on it; train sets it from the config
    before it loads a plan)."""
    import triton

    cuda = torch.cuda.is_available()
    return {
        "mtc": _mtc_version(),
        "kernel sources": _source_hash(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": _capability(),
        "gpu": torch.cuda.get_device_name() if cuda else "none",
        "tf32": str(bool(torch.backends.cuda.matmul.allow_tf32)) if cuda else "n/a",
    }


def staleness_key(t: Template, *, attention: str = "flash", grad_aux: tuple[bool, ...] | list[bool] = (),
                  matmul_fusion: str = "auto") -> dict[str, str]:
    """What a compiled template (and its tuning choices) depends on; a stored one whose key differs
    is recompiled."""
    return {
        **toolchain_key(),
        "shapes": " ".join("x".join(map(str, i.spec.shape)) or "scalar" for i in t.inputs),
        "dtypes": " ".join(i.spec.dtype for i in t.inputs),
        "options": f"attention={attention} grad_aux={''.join('1' if g else '0' for g in grad_aux)} matmul_fusion={matmul_fusion}",
    }


def _name_target(target: Any, kernels: list[dict[str, Any]]) -> str | None:
    if target is _item:
        return "mtc:item"
    if isinstance(target, FusedKernel):
        kernels.append(target.spec())
        return f"mtc:kernel:{len(kernels) - 1}"
    return None


def _record(ct: CompiledTemplate, key: dict[str, str]) -> dict[str, Any]:
    graphs = {}
    for which in GRAPHS:
        g = getattr(ct, f"{which}_graph")
        if g is None:
            continue
        kernels: list[dict[str, Any]] = []
        graphs[which] = {"nodes": graph_to_dict(g, lambda t, k=kernels: _name_target(t, k)), "kernels": kernels}
    return {"format": "mtc-compiled-template", "version": RECORD_VERSION, "template": ct.template_id, "key": key,
            "diff": ct.diff, "forward_report": dataclasses.asdict(ct.forward_report),
            "backward_report": dataclasses.asdict(ct.backward_report), "graphs": graphs,
            "tuning": ct.tuning, "compile_s": ct.seconds, "tuning_s": ct.tuning_s,
            "saved": [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in ct.saved],
            "split_reports": {k: dataclasses.asdict(r) for k, r in ct.split_reports.items()}, "split_note": ct.split_note}


def _load_record(doc: dict[str, Any], cache: Path) -> CompiledTemplate:
    """A compiled template from its record; raises (any error) when it cannot be rebuilt."""
    # the mtc ops compiled graphs call must be registered before their names resolve
    import mtc.kernels.flash_attention
    import mtc.kernels.fused_matmul
    import mtc.kernels.linear_cross_entropy  # noqa: F401

    graphs = {}
    for which in GRAPHS:
        if which not in doc["graphs"] and which not in ("forward", "joint"):
            continue  # not split
        rec = doc["graphs"][which]
        kernels = [load_kernel(spec, cache) for spec in rec["kernels"]]

        def resolve(name: str, kernels: list[FusedKernel] = kernels) -> Any:
            if name == "mtc:item":
                return _item
            if name.startswith("mtc:kernel:"):
                return kernels[int(name.rsplit(":", 1)[1])]
            return None

        graphs[which] = graph_from_dict(rec["nodes"], resolve)
    tuning = doc["tuning"]
    for which in ("attention", "generated"):  # malformed or missing: the template is recompiled
        Decisions.from_json(tuning[which])
    if not isinstance(tuning["matmul_fusion"], dict):
        raise TypeError(f"matmul_fusion choices must be a dict, got {type(tuning['matmul_fusion']).__name__}")
    saved = [(tuple(int(x) for x in shape), getattr(torch, dtype)) for shape, dtype in doc["saved"]]
    if ("save" in graphs) != ("backward" in graphs) or ("save" in graphs) != bool(saved):
        raise KeyError("the record's split graphs are incomplete")
    return CompiledTemplate(doc["template"], graphs["forward"], graphs["joint"], list(doc["diff"]),
                            GraphReport(**doc["forward_report"]), GraphReport(**doc["backward_report"]), loaded=True,
                            tuning=tuning, save_graph=graphs.get("save"), backward_graph=graphs.get("backward"), saved=saved,
                            split_reports={k: GraphReport(**r) for k, r in doc["split_reports"].items()},
                            split_note=doc["split_note"])


def _stale_fields(old: dict[str, str], new: dict[str, str]) -> str:
    diffs = []
    for k, v in new.items():
        if old.get(k) != v:
            diffs.append(f"{k} changed" if k == "kernel sources" else f"{k} {old.get(k, '?')} -> {v}")
    return "; ".join(diffs)


def log_stderr(msg: str) -> None:
    """Print ``mtc: msg`` on stderr (the compiler's log when none is given)."""
    print(f"mtc: {msg}", file=sys.stderr, flush=True)


def aux_param_dependence(program: Program) -> tuple[bool, ...]:
    """For each aux output of the program's embed stage: does it depend on a parameter?"""
    return graphs_aux_param_dependence(program.template_of(0))


def compile_program(
    program: Program, cache_dir: str | Path, *, attention: str = "flash", log: Callable[[str], None] | None = log_stderr,
    matmul_fusion: str = "auto", allow_tf32: bool | None = None,
) -> dict[str, CompiledTemplate]:
    """Every template of ``program`` compiled: loaded from ``cache_dir`` where a stored record's
    key matches (its attention choices then seed the tuner: nothing is timed again for its shapes),
    compiled, tuned and stored otherwise. A stored template that is stale gets one line through
    ``log`` saying which and why. ``attention`` and ``matmul_fusion``: see `compile_template`.
    ``allow_tf32``: the TF32 setting the plan runs under (`TrainConfig.allow_tf32`), in force while
    compiling and part of the staleness key; None keeps torch's current one. A plan compiled under
    torch's default (off) and trained with the config's default (on) would compile again."""
    if allow_tf32 is not None and torch.cuda.is_available():
        before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allow_tf32
        try:
            return compile_program(program, cache_dir, attention=attention, log=log, matmul_fusion=matmul_fusion)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    cache_dir = Path(cache_dir)
    grad_aux = aux_param_dependence(program)
    records = cache_dir / RECORDS
    out: dict[str, CompiledTemplate] = {}
    for tid, t in program.templates.items():
        key = staleness_key(t, attention=attention, grad_aux=grad_aux, matmul_fusion=matmul_fusion)
        path = records / f"{tid}.json"
        why = None
        t0 = time.perf_counter()
        if path.is_file():
            try:
                doc = json.loads(path.read_text())
                if doc.get("version") != RECORD_VERSION:
                    why = f"record version {doc.get('version')} -> {RECORD_VERSION}"
                elif doc.get("key") != key:
                    why = _stale_fields(doc.get("key", {}), key)
                else:
                    ct = _load_record(doc, cache_dir / cache_key())
                    seed_tuning(Decisions.from_json(ct.tuning["attention"]))
                    seed_generated_tuning(Decisions.from_json(ct.tuning["generated"]))
                    ct.seconds = time.perf_counter() - t0
                    out[tid] = ct
                    continue
            except (OSError, ValueError, KeyError, TypeError, SerializeError) as e:
                why = f"its stored record cannot be loaded ({type(e).__name__}: {str(e)[:120]})"
            if log is not None:
                log(f"recompiling template {tid}: stale ({why})")
        ct = compile_template(t, cache_dir, attention=attention, grad_aux=grad_aux, matmul_fusion=matmul_fusion)
        ct.seconds = time.perf_counter() - t0  # the stale record's reading included
        records.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # (own name: writers may race)
        tmp.write_text(json.dumps(_record(ct, key)))
        os.replace(tmp, path)
        out[tid] = ct
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class PlanTimes:
    """What getting a plan's compiled templates cost: seconds compiling or loading them, of which
    timing kernel candidates, and how many were compiled and how many loaded."""

    compile_s: float
    tuning_s: float
    compiled: int
    loaded: int


def plan_times(compiled: dict[str, CompiledTemplate]) -> PlanTimes:
    """The totals of `compile_program`'s templates (each carries its own seconds)."""
    cts = list(compiled.values())
    return PlanTimes(sum(ct.seconds for ct in cts), sum(ct.tuning_s for ct in cts),
                     sum(1 for ct in cts if not ct.loaded), sum(1 for ct in cts if ct.loaded))


def format_plan_times(t: PlanTimes) -> str:
    """One line: ``compiled plan: N templates (C compiled, L loaded) in X s, tuning Y s``."""
    return (f"compiled plan: {t.compiled + t.loaded} templates ({t.compiled} compiled, {t.loaded} loaded) "
            f"in {t.compile_s:.2f} s, tuning {t.tuning_s:.2f} s")


def second_stage_launches(graph: fx.Graph | None) -> int:
    """Launches a compiled graph's column kernels add after their own (their combines), beyond one
    per kernel-invoking node (on the GPU, where their rows split into chunks)."""
    return 0 if graph is None else sum(n.target.second_stage_launches for n in graph.nodes
                                       if n.op == "call_function" and hasattr(n.target, "second_stage_launches"))


def format_report(program: Program, compiled: dict[str, CompiledTemplate]) -> str:
    """Per template: core ATen ops vs kernel launches, forward and backward (and the graphs a block
    keeping its activations runs), and what stays on ATen."""
    lines = [f"{'template':26s} {'calls':>5s} {'fwd core ATen':>13s} {'fwd kernels':>11s} {'bwd core ATen':>13s} "
             f"{'bwd kernels':>11s}"]
    for tid, ct in compiled.items():
        calls = sum(1 for c in program.layers if c.template == tid)
        f, b = ct.forward_report, ct.backward_report
        lines.append(f"{tid:26s} {calls:5d} {f.aten_ops:13d} {f.kernels:11d} {b.aten_ops:13d} {b.kernels:11d}")
        extra = second_stage_launches(ct.forward_graph) + second_stage_launches(ct.joint_graph)
        if extra:
            lines.append(f"    + {second_stage_launches(ct.forward_graph)} / {second_stage_launches(ct.joint_graph)} "
                         "second-stage combines of column kernels (fwd / bwd, on the GPU)")
        if ct.split_reports:
            sv, bk = ct.split_reports.get("save"), ct.split_reports.get("backward_saved")
            lines.append(f"    keeping its activations: forward-and-save {sv.kernels if sv else '-'} kernels, backward "
                         f"from the saved values {bk.kernels if bk else '-'} kernels")
        ht = Counter(f.hand_tuned) + Counter(b.hand_tuned)
        if ht:
            lines.append("    hand-tuned kernels: " + ", ".join(f"{k} x{v}" for k, v in sorted(ht.items())))
        fb = Counter(f.fallbacks) + Counter(b.fallbacks)
        if fb:
            lines.append("    on ATen (no generated kernel): " + ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(fb.items())))
        ng = Counter(f.not_generated) + Counter(b.not_generated)
        if ng:
            lines.append("    groups left unfused: " + "; ".join(f"{k} x{v}" for k, v in sorted(ng.items())))
    lines.append("(core ATen: the decomposed ops the generated kernels replace; a composite op such as layer_norm, "
                 "gelu or cross_entropy counts as its parts, so unfused execution dispatches fewer, larger ops)")
    return "\n".join(lines)


def write_report(program: Program, compiled: dict[str, CompiledTemplate], plan_dir: str | Path) -> str:
    """Write ``compile_report.json`` into the plan directory and return the printable report (its
    last line: `format_plan_times`)."""
    doc: dict[str, Any] = {
        tid: {"calls": sum(1 for c in program.layers if c.template == tid),
              "forward": dataclasses.asdict(ct.forward_report), "backward": dataclasses.asdict(ct.backward_report),
              "split": {k: dataclasses.asdict(r) for k, r in ct.split_reports.items()},
              "second_stage_launches": {"forward": second_stage_launches(ct.forward_graph),
                                        "backward": second_stage_launches(ct.joint_graph)},
              "loaded": ct.loaded, "compile_s": ct.seconds, "tuning_s": ct.tuning_s, "tuning": ct.tuning}
        for tid, ct in compiled.items()
    }
    doc["cache_key"] = cache_key()
    times = plan_times(compiled)
    doc["plan"] = dataclasses.asdict(times)
    write_atomic(Path(plan_dir, REPORT_FILE), json.dumps(doc, indent=1))
    return format_report(program, compiled) + "\n" + format_plan_times(times)
