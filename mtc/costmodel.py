"""The planner's cost model: a model's shape and work per layer, and its predicted step time.

The model's shape comes from its traced Program: a plan directory's, or a one-block trace of the
preset on the meta device (blocks share one template, so one block is enough and big presets
trace in about a second). Per template the planner counts, per micro-batch, the matmul FLOPs
with their shapes, the attention FLOPs, the bytes touched by the other ops and the number of ops;
the machine profile (`mtc.calibrate`) turns those into seconds.

The step time comes from a small simulation of the engine's schedule (`mtc/runtime`), run for a
few steps until it repeats:

- forward visits embed, blocks; the head runs forward + backward at once; backward visits the
  blocks in reverse (recompute + backward), then the embed stage; each visit runs every
  micro-batch of the group. FLOPs: 2 x params x tokens forward, 6 x for the head, and 2 + 6 = 8 x
  for a block (recompute + backward), plus attention.
- a visit's weights cross PCIe on the host-to-device stream (FIFO) into a ring of two slots while
  the previous visit computes; a forward fetch first waits for the layer's update of the last step.
- a layer's fp32 gradient crosses back on the device-to-host stream after its backward visit.
- after the step's sync every layer's update starts, in forward order, on one CPU dispatcher
  (`ram` layers: AdamW on the pool; `disk` layers: read master/m/v, AdamW, write them back, all
  in the layer's turn); `gpu_update` layers on their own chain over PCIe (state in and out at
  once, each direction at half the two-way rate; the first ``prefetch`` of them load their state
  from the last step's head visit on, and after the sync only copy back); `gpu` layers on the
  device. So the optimizer of step k overlaps the forward of step k+1 in layer order, and disk
  I/O overlaps compute but not other layers' updates.
- on a commit step each `ram`/`gpu` layer's state is written behind after its update, and the
  layer's next update waits for that write.

One rank of a data-parallel run (`mtc.dist_plan`, ``step_time(..., dist=...)``) runs the same
schedule on its share of the host (the profile it is given) and its micro-batches, updates and
writes only its shard of each layer's state, and adds the collectives on their own link: the
gradient's reduction after the layer's backward visit (NCCL: before the shard's copy to the host;
gloo: after the whole gradient's), the updated compute copy's all-gather between the layer's
update and its next forward fetch.

Every task runs on a resource: the GPU, each copy direction, the disk (whose reads and writes
overlap up to the rate `mtc calibrate` measured for both at once), or (on a CPU machine, where
"GPU compute", the optimizer and the copies all run on the same cores) the CPU, whose cores are
shared among the tasks running at once in proportion to the threads each uses (processor
sharing). On CUDA the step is also at least the PCIe bytes over the both-ways copy rate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

import torch

from mtc.calibrate import MachineProfile
from mtc.config import TrainConfig
from mtc.errors import ConfigError
from mtc.graphs.lower import diff_inputs, grad_outputs
from mtc.graphs.program import Program, Template, aux_param_dependence, joint_keeps_outputs
from mtc.runtime.graph_replay import GraphBuffers, template_graph_buffers

if TYPE_CHECKING:
    from mtc.dist_plan import RankDist

__all__ = ["LayerCost", "ModelShape", "StepTime", "anchored_efficiency", "compute_seconds", "saved_bytes", "saved_seconds", "model_shape",
           "reference_scales", "shape_from_program", "step_time", "template_cost"]

GiB = 2**30

# ops that only change a tensor's view (no data moves)
_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze", "squeeze", "slice", "select",
    "alias", "detach", "chunk", "split", "split_with_sizes", "unbind", "as_strided", "lift_fresh_copy", "clone_view",
}
_MATMUL_OPS = {"linear", "mm", "addmm", "bmm", "matmul"}
# steps the step-time simulation averages over, after 4 to fill its pipeline (an even number: a
# disk-bound schedule alternates long and short steps)
MEAN_OVER = 2
_MMAP_MAX = 32 * 2**20  # glibc's largest mmap threshold: fresh tensors above it are mapped (and faulted) anew


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCost:
    """Forward cost of one layer template for one micro-batch (shapes from the trace)."""

    matmuls: tuple[tuple[int, int, int, int], ...]  # (batch, m, k, n): batch x (m x k) @ (k x n)
    attention: tuple[tuple[int, int, int, int, bool], ...]  # (batch x heads, q len, kv len, head size, causal)
    elementwise: tuple[tuple[int, int], ...]  # per other op: (bytes read + written, largest tensor's bytes)
    backward_extra: tuple[tuple[int, int], ...]  # backward-only traffic (an embedding's dense weight gradient)
    ops: int  # ATen ops
    big_outputs: int = 0  # bytes of forward outputs >= 32 MiB (fresh mappings: page faults on the CPU)
    big_weight_grads: int = 0  # bytes of weight gradients >= 32 MiB the backward allocates
    embeddings: tuple[tuple[str, int, int], ...] = ()  # (weight input, rows, row width) of embedding lookups
    # indices into `matmuls` of those only the layer's output needs (a block's last matmul): a
    # compiled plan's backward visit does not recompute them (graphs.program.joint_keeps_outputs)
    output_only: tuple[int, ...] = ()

    @property
    def matmul_flops(self) -> float:
        """2 m k n per matmul."""
        return float(sum(2 * b * m * k * n for b, m, k, n in self.matmuls))

    @property
    def attention_flops(self) -> float:
        """4 q kv d per head (QK^T and AV), halved when causal."""
        return float(sum(4 * bh * tq * tk * d * (0.5 if causal else 1.0) for bh, tq, tk, d, causal in self.attention))

    @property
    def elementwise_bytes(self) -> int:
        """Bytes touched by the forward's other ops."""
        return sum(b for b, _ in self.elementwise)


def _val(node: object) -> object:
    return getattr(node, "meta", {}).get("val")


def _nbytes(v: object) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    return 0


def _largest(vals: Iterable[object]) -> int:
    return max((_nbytes(v) for v in vals if isinstance(v, torch.Tensor)), default=0)


# ops through which a value reaches the output without its backward reading it
_PASS_THROUGH = _VIEW_OPS | {"add", "sub", "to", "_to_copy", "type_as", "contiguous", "clone"}


def _output_only(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value reaches nothing but the graph's output, through ops whose backward
    does not read it (views, casts, additions): the backward never needs it."""
    stack, seen = list(node.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "output":
            continue
        if u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload):
            return False
        if u.target._schema.name.split("::")[-1] not in _PASS_THROUGH:
            return False
        stack.extend(u.users)
    return True


def template_cost(tmpl: Template) -> LayerCost:
    """Count a template's matmuls, attention, element-wise traffic and ops."""
    matmuls: list[tuple[int, int, int, int]] = []
    output_only: list[int] = []
    attn: list[tuple[int, int, int, int, bool]] = []
    ew: list[tuple[int, int]] = []
    extra: list[tuple[int, int]] = []
    emb: list[tuple[str, int, int]] = []
    ops = big = big_w = 0
    for node in tmpl.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name.split("::")[-1]
        ins = [_val(a) for a in node.args if isinstance(a, torch.fx.Node)]
        out = _val(node)
        if name in _VIEW_OPS:
            continue
        if name in ("to", "_to_copy", "type_as") and ins and isinstance(out, torch.Tensor) and ins[0].dtype == out.dtype:
            continue  # a cast to the dtype it already has
        ops += 1
        if _nbytes(out) >= _MMAP_MAX:
            big += _nbytes(out)
        if name in _MATMUL_OPS and len(ins) >= 2:
            a, b = (ins[1], ins[2]) if name == "addmm" else (ins[0], ins[1])
            k = a.shape[-1]
            if name == "linear":
                n, batch, m = b.shape[0], 1, a.numel() // k
            else:
                n = b.shape[-1]
                batch = a.numel() // (a.shape[-2] * k) if a.dim() > 2 and b.dim() > 2 else 1
                m = a.numel() // k // batch
            if not joint_keeps_outputs(tmpl) and _output_only(node):
                output_only.append(len(matmuls))
            matmuls.append((batch, m, k, n))
            if _nbytes(b) >= _MMAP_MAX and b.dim() == 2:
                big_w += _nbytes(b)
            if (name == "addmm" or (name == "linear" and len(ins) > 2)) and isinstance(out, torch.Tensor):
                ew.append((2 * _nbytes(out), _nbytes(out)))  # the bias add
            continue
        if name == "scaled_dot_product_attention":
            q, k = ins[0], ins[1]
            causal = bool(node.kwargs.get("is_causal", len(node.args) > 5 and node.args[5]))
            attn.append((q.numel() // (q.shape[-2] * q.shape[-1]), q.shape[-2], k.shape[-2], q.shape[-1], causal))
            continue
        if name == "embedding":
            ew.append((2 * _nbytes(out), _nbytes(out)))  # rows gathered, output written
            extra.append((2 * _nbytes(ins[0]), _nbytes(ins[0])))  # backward: a dense weight gradient, zeroed then filled
            if _nbytes(ins[0]) >= _MMAP_MAX:
                big_w += _nbytes(ins[0])
            emb.append((node.args[0].name, ins[0].shape[0], ins[0].numel() // ins[0].shape[0]))
            continue
        ew.append((sum(_nbytes(x) for x in ins) + _nbytes(out), max(_largest(ins), _nbytes(out))))
    return LayerCost(tuple(matmuls), tuple(attn), tuple(ew), tuple(extra), ops, big, big_w, tuple(emb), tuple(output_only))


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What the planner needs of a model, per program layer (0 = embed stage, last = head)."""

    name: str
    numels: tuple[int, ...]  # each layer's own parameters (its flat state)
    fetch_numels: tuple[int, ...]  # what a visit copies to the device: own + tied weights it reads
    costs: tuple[LayerCost, ...]  # forward cost per micro-batch
    sparse_tables: tuple[tuple[tuple[int, int], ...], ...]  # per layer: (rows, width) of untied embedding tables it owns
    hidden: int  # width of the carried hidden state
    head_width: int  # widest dim 0 of the head's weights (the vocabulary)
    micro_batch_size: int
    seq_len: int
    compute_bytes: int
    graph_buffers: tuple[GraphBuffers, ...]  # per layer: its template's fixed buffers when replayed as CUDA graphs

    @property
    def n_layers(self) -> int:
        """Program layers (embed, blocks, head)."""
        return len(self.numels)

    @property
    def n_params(self) -> int:
        """Trainable parameters (tied ones once)."""
        return sum(self.numels)

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens in one micro-batch."""
        return self.micro_batch_size * self.seq_len


def _hidden(program: Program) -> int:
    for tmpl in program.templates.values():
        for inp in tmpl.inputs:
            if inp.kind == "carry":
                return inp.spec.shape[-1]
    return 1


def shape_from_program(program: Program, name: str, compute_bytes: int, *, n_blocks: int | None = None) -> ModelShape:
    """A `ModelShape` from a traced Program; ``n_blocks`` repeats a one-block program's block to that depth."""
    layers = list(range(program.n_layers))
    if n_blocks is not None:
        if program.n_layers != 3:
            raise ValueError("n_blocks expands a one-block program (embed, block, head)")
        layers = [0] + [1] * n_blocks + [2]
    tcost = {tid: template_cost(t) for tid, t in program.templates.items()}
    users: dict[str, int] = {}
    for call in program.layers:
        for k in dict.fromkeys(call.param_keys()):
            users[k] = users.get(k, 0) + 1
    aux = aux_param_dependence(program.template_of(0))
    gbuf = {tid: template_graph_buffers(t, diff_inputs(t, aux), grad_outputs(t, aux)) for tid, t in program.templates.items()}
    numels, fetch, costs, tables = [], [], [], []
    for src in layers:
        call = program.layers[src]
        # an embedding table only this lookup reads: rows the step does not touch get zero gradients
        tables.append(tuple((rows, width) for name, rows, width in tcost[call.template].embeddings
                            if call.bindings[name].kind == "param" and users[call.bindings[name].key] == 1))
        own = program.layer_numel(src)
        tied = sum(program.params[k].numel for k in dict.fromkeys(call.param_keys()) if program.params[k].layer != src)
        numels.append(own)
        fetch.append(own + tied)
        costs.append(tcost[call.template])
    # (a scalar the head reads, such as a learned logit scale, has no dim 0)
    width = max((program.params[k].spec.shape[0] for k in program.layers[-1].param_keys() if program.params[k].spec.shape),
                default=1)
    b, t = program.batch["ids"].shape
    return ModelShape(name=name, numels=tuple(numels), fetch_numels=tuple(fetch), costs=tuple(costs),
                      sparse_tables=tuple(tables), hidden=_hidden(program),
                      head_width=width, micro_batch_size=b, seq_len=t, compute_bytes=compute_bytes,
                      graph_buffers=tuple(gbuf[program.layers[src].template] for src in layers))


def model_shape(cfg: TrainConfig, compute_dtype: str, *, program: Program | None = None) -> ModelShape:
    """The shape of ``cfg``'s model at its micro-batch shape: from ``program`` if given, else a
    one-block trace of the preset on the meta device, in ``compute_dtype``."""
    from mtc.models import model_config
    from mtc.trace_cache import trace_preset

    cbytes = torch.empty((), dtype=getattr(torch, compute_dtype)).element_size()
    if program is not None:
        return shape_from_program(program, cfg.model, cbytes)
    mcfg = model_config(cfg.model, **cfg.model_overrides)
    one = dataclasses.replace(cfg, model_overrides={**cfg.model_overrides, "n_layers": 1}, compute_dtype=compute_dtype)
    prog = trace_preset(one, name=cfg.model)
    return shape_from_program(prog, cfg.model, cbytes, n_blocks=mcfg.n_layers)


# -- compute time ------------------------------------------------------------------------------

# Backward relative to forward, beyond the two matmuls per forward matmul (counted by shape):
# flash attention's backward recomputes the scores (2.5 x the forward FLOPs); an element-wise op's
# backward reads its saved inputs and the incoming gradient and writes one (2 x the bytes);
# autograd runs about 2 ops per forward op.
ATTN_BWD = 2.5
EW_BWD = 2.0
OPS_BWD = 2.0


def _intensity(m: float, k: float, n: float) -> float:
    return 2 * m * k * n / (4 * (m * k + k * n + m * n))


def _interp_log(x: float, pts: list[tuple[float, float]]) -> float:
    """Piecewise-linear in log-log over sorted (x, y) points, clamped at the ends."""
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return pts[-1][1]


def matmul_rate(profile: MachineProfile, m: int, k: int, n: int) -> float:
    """FLOP/s of an (m x k) @ (k x n) matmul inside a layer on this machine: the profile's points
    interpolated by arithmetic intensity (FLOPs per byte), times its layer efficiency. Below the
    thinnest measured shape the rate falls in proportion to the intensity (bandwidth-bound) on the
    CPU, and stays at that shape's rate on a GPU."""
    if not profile.matmul:
        raise ConfigError(f"machine profile {profile.name!r} has no matmul figures; re-run `mtc calibrate`")
    pts = sorted((_intensity(p["m"], p["k"], p["n"]), p["tflops"] * 1e12) for p in profile.matmul)
    x = _intensity(m, k, n)
    # the fall assumes the thinnest point sits at the memory roofline: the CPU's (16 rows) does. A
    # GPU's bf16 points are compute-bound well below its thinnest (4096^3 in profiles written before
    # 2026-11-28): the fall from there charged the H200's 4096-token K/V projections (4096 x 4096 x
    # 1024) 239 TFLOP/s and its P3 ones 128, and the GPU compute of its resident P1-16 and P3 steps
    # came out 27-40 % over the kernels' measured busy time (bench_train, 2026-11-27)
    fall = len(pts) > 1 and x < pts[0][0] and profile.accelerator != "cuda"
    rate = pts[0][1] * x / pts[0][0] if fall else _interp_log(x, pts)
    return rate * profile.layer_efficiency


def _attention_rate(profile: MachineProfile) -> float:
    """FLOP/s of a (flash) attention: the profile's measured rate, else the layer's matmul rate at
    its fastest measured shape. Not the rate of a (tq x d) @ (d x tk) matmul by its intensity: that
    counts the tq x tk scores as memory traffic, which a flash kernel keeps on chip, and put the
    H100's attention at 33 TFLOP/s, 40 % of a P1 step's modelled compute where the measured step
    had none of it (bench_train P1-16 auto: 1.78 s predicted, 1.25 s measured, 2026-11-26)."""
    if profile.attention_tflops:
        return profile.attention_tflops * 1e12
    if not profile.matmul:
        raise ConfigError(f"machine profile {profile.name!r} has no matmul figures; re-run `mtc calibrate`")
    return max(p["tflops"] for p in profile.matmul) * 1e12 * profile.layer_efficiency


def _matmul_seconds(profile: MachineProfile, m: int, k: int, n: int) -> float:
    """Roofline: the FLOPs at the interpolated rate, or the operands' bytes at the memory
    bandwidth for their size, whichever is longer (thin matmuls stream their weight)."""
    t = 2 * m * k * n / matmul_rate(profile, m, k, n)
    if profile.memory:
        nbytes = 4 * (m * k + k * n + m * n)
        pts = sorted((p["mib"] * 2**20, p["gbps"] * 1e9) for p in profile.memory)
        t = max(t, nbytes / _interp_log(nbytes, pts))
    return t


def elementwise_seconds(profile: MachineProfile, nbytes: float, largest: float) -> float:
    """Seconds for an unfused op touching ``nbytes`` whose largest tensor is ``largest`` bytes
    (0 where the profile folds element-wise work into its layer efficiency)."""
    if not profile.elementwise or nbytes <= 0:
        return 0.0
    pts = sorted((p["mib"] * 2**20, p["gbps"] * 1e9) for p in profile.elementwise)
    return nbytes / _interp_log(max(largest, 1.0), pts)


def _compute_parts(cost: LayerCost, profile: MachineProfile, *, backward: bool, lean: bool = False) -> tuple[float, float]:
    """(matmul seconds, other seconds) of one micro-batch through a layer, before the profile's
    reference-block scales: attention, element-wise traffic, op dispatch and page faults are "other"."""
    t_mm = sum(b * _matmul_seconds(profile, m, k, n) for b, m, k, n in cost.matmuls)
    t_at = sum(4 * bh * tq * tk * d * (0.5 if c else 1.0) for bh, tq, tk, d, c in cost.attention) / _attention_rate(profile) \
        if cost.attention else 0.0
    t_ew = sum(elementwise_seconds(profile, b, big) for b, big in cost.elementwise)
    t_op = cost.ops * profile.op_overhead_us * 1e-6
    ft = profile.first_touch_gbps * 1e9
    t_ft = cost.big_outputs / ft if ft else 0.0
    other = t_at + t_ew + t_op + t_ft
    if not backward:
        return t_mm, other
    if lean:  # a compiled joint graph does not recompute what only the output needs
        t_mm -= sum(b * _matmul_seconds(profile, m, k, n) for j, (b, m, k, n) in enumerate(cost.matmuls) if j in cost.output_only)
    # dX = dY @ W: (m x n) @ (n x k); dW = dY^T @ X: (n x m) @ (m x k)
    t_mm_b = sum(b * (_matmul_seconds(profile, m, n, k) + _matmul_seconds(profile, n, m, k)) for b, m, k, n in cost.matmuls)
    t_extra = sum(_memory_seconds(profile, b, big) for b, big in cost.backward_extra)
    t_ft_b = (2 * cost.big_outputs + cost.big_weight_grads) / ft if ft else 0.0  # activation and weight gradients
    return t_mm + t_mm_b, other + ATTN_BWD * t_at + EW_BWD * t_ew + t_extra + OPS_BWD * t_op + t_ft_b


def saved_bytes(cost: LayerCost, compute_bytes: int) -> int:
    """What a block keeps per micro-batch between its visits when it saves its activations
    (graphs/split.py): the outputs of its matmuls but those only its output needs, and of its
    attention calls (with their fp32 log-sum-exp), in the compute dtype. An estimate from the
    shapes; a compiled template knows its exact figure (`CompiledTemplate.saved_bytes`)."""
    mm = sum(b * m * n for j, (b, m, _, n) in enumerate(cost.matmuls) if j not in cost.output_only)
    at = sum(bh * tq * d for bh, tq, _, d, _ in cost.attention)
    lse = sum(bh * tq for bh, tq, _, _, _ in cost.attention)
    return (mm + at) * compute_bytes + 4 * lse


def saved_seconds(cost: LayerCost, profile: MachineProfile) -> float:
    """What a backward visit from saved values does not run, per micro-batch: the forward's
    matmuls the compiled joint graph recomputes and its attention forward (the cheap ops in
    between are computed again either way)."""
    t_mm = sum(b * _matmul_seconds(profile, m, k, n) for j, (b, m, k, n) in enumerate(cost.matmuls) if j not in cost.output_only)
    t_at = sum(4 * bh * tq * tk * d * (0.5 if c else 1.0) for bh, tq, tk, d, c in cost.attention) / _attention_rate(profile) \
        if cost.attention else 0.0
    return (t_mm + t_at) * profile.other_scale_bwd


def compute_seconds(cost: LayerCost, profile: MachineProfile, *, backward: bool, lean: bool = False) -> float:
    """Seconds of one micro-batch through a layer: its forward, or (``backward``) its joint:
    forward recomputed, then backward; ``lean``: as a compiled plan's joint graph runs it, without
    the matmuls only the layer's output needs (`LayerCost.output_only`)."""
    mm, other = _compute_parts(cost, profile, backward=backward, lean=lean)
    return (mm + other) * (profile.other_scale_bwd if backward else profile.other_scale_fwd)


def anchored_efficiency(profile: MachineProfile) -> float:
    """The layer efficiency of a GPU profile: the one at which this cost model, on the profile's
    matmul points, times the anchor block (`mtc.calibrate.ANCHOR_BLOCK`: a Llama 8B block's
    recompute + backward, measured) as the anchor machine ran it, scaled by this machine's
    largest matmul rate over the anchor's. So another GPU is assumed to reach the same fraction of
    its own peak on a layer, and the efficiency folds in only what the model leaves out (the
    element-wise kernels, launch gaps), not the thin matmuls it already rates by their shape: a
    fraction of the median matmul rate (0.697 before) counted those twice."""
    from mtc.calibrate import ANCHOR_BLOCK

    if not profile.matmul:
        raise ConfigError(f"machine profile {profile.name!r} has no matmul figures; re-run `mtc calibrate`")
    a = ANCHOR_BLOCK
    cfg = TrainConfig(model=a["preset"], micro_batch_size=a["micro_batch_size"], seq_len=a["seq_len"], compute_dtype="bfloat16")
    cost = model_shape(cfg, "bfloat16").costs[1]
    # on a GPU profile every modelled part of a layer scales with 1 / efficiency (no element-wise points)
    at_one = compute_seconds(cost, dataclasses.replace(profile, layer_efficiency=1.0, other_scale_bwd=1.0), backward=True)
    peak = max(p["tflops"] for p in profile.matmul)
    return at_one / (a["seconds"] * a["peak_tflops"] / peak)


def reference_scales(profile: MachineProfile) -> tuple[float, float]:
    """Fit the cost model to the profile's measured reference block: (forward scale, joint scale),
    the block's measured time over the modelled one. One factor for the whole layer, not for its
    non-matmul part alone: subtracting the modelled matmuls first amplified the noise of a shared
    machine tenfold (scales from 0.4 to 3.3 between calibrations minutes apart)."""
    from mtc.calibrate import REFERENCE_BLOCK
    from mtc.trace_cache import trace_preset

    r, ref = REFERENCE_BLOCK, profile.reference_block
    if not ref:
        return 1.0, 1.0
    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": 1, "dim": r["dim"], "ffn_dim": r["ffn_dim"], "n_heads": r["n_heads"],
                                                      "n_kv_heads": r["n_kv_heads"]},
                      micro_batch_size=r["micro_batch_size"], seq_len=r["seq_len"], compute_dtype="float32")
    prog = trace_preset(cfg)
    cost = template_cost(prog.template_of(1))
    scales = []
    for backward, measured in ((False, ref["fwd_s"]), (True, ref["joint_s"])):
        mm, other = _compute_parts(cost, profile, backward=backward)
        scales.append(measured / (mm + other) if mm + other > 0 else 1.0)
    return scales[0], scales[1]


# -- step time ---------------------------------------------------------------------------------


# a 1-D state array's chunk in the store (`mtc.store.tensor_store`): one file per chunk per commit
_STORE_CHUNK_BYTES = 16 * 2**20


class _FluidSim:
    """Tasks with dependencies on shared resources: a resource of capacity C shares itself among
    its running tasks, each getting min(1, C / total demand) of its speed (processor sharing)."""

    def __init__(self, capacity: dict[str, float]) -> None:
        self.capacity = capacity
        self.work: list[float] = []
        self.resource: list[str] = []
        self.demand: list[float] = []
        self.deps: list[list[int]] = []

    def add(self, work: float, resource: str = "", deps: Iterable[int | None] = (), demand: float = 1.0) -> int:
        """A task of ``work`` seconds (at full speed) on ``resource`` after ``deps``; "" is a marker."""
        self.work.append(max(0.0, work))
        self.resource.append(resource)
        self.demand.append(demand)
        self.deps.append([d for d in deps if d is not None])
        return len(self.work) - 1

    def run(self) -> list[float]:
        """End time of every task."""
        n = len(self.work)
        end = [math.inf] * n
        left = list(self.work)
        waiting = [len(d) for d in self.deps]
        children: list[list[int]] = [[] for _ in range(n)]
        for i, ds in enumerate(self.deps):
            for d in ds:
                children[d].append(i)
        t = 0.0
        running: set[int] = set()
        ready = [i for i in range(n) if not waiting[i]]
        while ready or running:
            while ready:  # start what is ready; markers and empty tasks end at once
                i = ready.pop()
                if left[i] <= 0 or not self.resource[i]:
                    end[i] = t
                    for ch in children[i]:
                        waiting[ch] -= 1
                        if not waiting[ch]:
                            ready.append(ch)
                else:
                    running.add(i)
            if not running:
                break
            load: dict[str, float] = {}
            for i in running:
                load[self.resource[i]] = load.get(self.resource[i], 0.0) + self.demand[i]
            rate = {i: min(1.0, self.capacity.get(self.resource[i], 1.0) / load[self.resource[i]]) for i in running}
            dt = min(left[i] / rate[i] for i in running)
            t += dt
            for i in list(running):
                left[i] -= rate[i] * dt
                if left[i] <= 1e-12 * max(1.0, self.work[i]):
                    running.discard(i)
                    end[i] = t
                    for ch in children[i]:
                        waiting[ch] -= 1
                        if not waiting[ch]:
                            ready.append(ch)
        return end


@dataclasses.dataclass(frozen=True, slots=True)
class Commits:
    """How commits write state behind: bytes per commit, how often, and what they cost per step."""

    bytes_per_commit: int  # ram/gpu layers' state the durability mode keeps (disk layers: written every step anyway)
    seconds: float  # one commit: its writes at the store's write rate, plus the profile's fixed commit latency
    every: int  # steps between commits (0: never)
    stall_s: float  # per step, amortised: the next updates waiting for the writes


@dataclasses.dataclass(frozen=True, slots=True)
class StepTime:
    """Predicted steady-state step, and each stage's busy time per step (seconds)."""

    step_s: float
    schedule_s: float  # the simulated schedule, before the PCIe both-ways bound and commit stalls
    fwd_s: float  # forward visits (embed, blocks) over the group
    bwd_s: float  # head (fwd + bwd) and backward visits (recompute + backward)
    hw_flops: float  # matmul + attention FLOPs executed (with recompute)
    h2d_weights_s: float
    d2h_grads_s: float
    streamed_s: float  # gpu_update layers' state over PCIe, both ways
    pcie_bound_s: float  # all PCIe bytes over the both-ways rate (0 on a CPU machine: copies are CPU work)
    optimizer_s: float  # CPU AdamW math (ram and disk layers)
    gpu_optimizer_s: float  # resident-state updates on the device
    disk_read_s: float  # disk layers' state, read (and, read per visit, their weights)
    disk_write_s: float  # disk layers' state written back, plus every-step commits' write-behind
    cpu_work_s: float  # CPU machines: thread-seconds of all work over the cores this process gets
    commits: Commits
    disk_bytes_written: int  # per step, commits averaged in
    bottleneck: str
    stage_s: dict[str, float] = dataclasses.field(default_factory=dict)  # busy seconds per stage, per step
    # disk layers' gradients spilled to the store's scratch arrays (rewritten every step; not
    # write-behind, so not in ``disk_bytes_written``, which the stage watch times as such)
    spill_bytes_written: int = 0

    @property
    def disk_wear_bytes(self) -> int:
        """Every byte the step writes to the disk: state, commits and spilled gradients."""
        return self.disk_bytes_written + self.spill_bytes_written

    def stages(self) -> dict[str, float]:
        """Each stage's busy time per step (the bottleneck is the largest)."""
        return dict(self.stage_s)

    @property
    def compute_s(self) -> float:
        """Forward + backward (with recompute) over the group."""
        return self.fwd_s + self.bwd_s


def adamw_rate(profile: MachineProfile, threads: int, *, zero_grad: bool = False, impl: str = "auto") -> float:
    """CPU AdamW params/s with ``threads`` pool threads (0: all cores); ``impl`` the run's
    `host_adamw` ('auto': the engine's default here; a named one at its measured rate, where the
    profile has it); ``zero_grad``: on all-zero gradients and moments."""
    cores = max(1, profile.cores)
    t = cores if threads <= 0 else min(threads, cores)
    full, one = profile.adamw_rate, profile.adamw_one_thread_gparams_s or profile.adamw_rate / cores
    if impl != "auto" and profile.adamw_gparams_s.get(impl):  # the one-thread figure is the default impl's: scale it
        full, one = profile.adamw_gparams_s[impl], one * profile.adamw_gparams_s[impl] / profile.adamw_rate
    if zero_grad:
        full, one = full * profile.adamw_zero_grad_factor, one * profile.adamw_zero_grad_factor_one_thread
    rate = full if t >= cores else one + (full - one) * (t - 1) / max(1, cores - 1)
    return rate * 1e9


def _memory_seconds(profile: MachineProfile, nbytes: float, largest: float) -> float:
    """Plain memory traffic (zeroing, adding, copying) at the profile's copy bandwidth for that size."""
    if profile.memory:
        pts = sorted((p["mib"] * 2**20, p["gbps"] * 1e9) for p in profile.memory)
        return nbytes / _interp_log(max(largest, 1.0), pts)
    return nbytes / (2 * profile.h2d_gbps * 1e9) if profile.pcie_is_memcpy else 0.0


def step_time(cfg: TrainConfig, shape: ModelShape, placement: list[str], gpu_update: set[int], profile: MachineProfile,
              *, dist: RankDist | None = None, grad_spill: bool = False, disk_compute: str = "ram",
              prefetch: int = 0, saves: Collection[int] = ()) -> StepTime:
    """Predict the steady-state step time of ``cfg`` on ``profile`` (see the module docstring).
    ``prefetch``: the first that many GPU-updated layers load master, m and v during the
    backward (from the head's visit on), so after the norm only their kernel and copy back remain.
    ``dist``: one rank of a data-parallel run (`mtc.dist_plan`): ``cfg`` and ``profile`` are then
    the rank's (its micro-batches, its share of the host), the rank updates only its shard of
    each layer's state, and the collectives run on their own link. ``disk_compute`` "store": disk
    layers' weights are read from the store at each visit (fp32), and cross PCIe as fp32.
    ``saves``: the blocks that keep their activations between visits (`saved_seconds` less in
    their backward visits)."""
    from mtc.runtime.placement import deferred_layers, handed_layers, streamed_grads_on_device
    from mtc.runtime.tiers import DISK_SLOTS, StateTiers, state_kinds

    L, n, c = shape.n_layers, list(shape.numels), shape.compute_bytes
    sn = list(dist.shard_numels) if dist else n  # the state this rank owns: master, m, v, its update and disk I/O
    cuda = profile.accelerator == "cuda"
    mb, gb = cfg.grad_accum, 1e9
    cores = float(profile.cores)
    # per-layer durations, alone
    resident = [placement[i] == "gpu" and shape.fetch_numels[i] == n[i] for i in range(L)]
    # a visit of a disk layer whose copy is not in RAM reads its fp32 master from the store first;
    # on CUDA that crosses PCIe as fp32; on the CPU in fp32 it is read straight into the weight slot
    per_visit = [placement[i] == "disk" and disk_compute == "store" for i in range(L)]
    own = [(0 if not cuda and c == 4 else 4) if per_visit[i] else c for i in range(L)]
    W = [0.0 if resident[i] else (n[i] * own[i] + (shape.fetch_numels[i] - n[i]) * c) / (profile.h2d_gbps * gb) for i in range(L)]
    # the gradient crosses to the host whole, or (reduce-scattered on the device first) as the rank's shard
    gn = sn if dist and dist.reduce_scatter else n
    # a GPU-updated ram layer's gradient waits on the device (not for one rank of many, nor with a
    # fixed activation budget: `placement.streamed_grads_on_device`)
    on_device = dist is None and streamed_grads_on_device(cfg.activation_budget_gb)
    dev_grad = [placement[i] == "gpu" or (i in gpu_update and on_device) for i in range(L)]
    streamed_in = 12 if on_device else 16  # master, m, v (and the gradient from the host) to the device per parameter
    ahead = set(sorted(gpu_update)[:prefetch]) if dist is None else set()
    # of those, the ones whose set no later layer reuses send their weights back first, the rest
    # of their state behind every layer's weights
    late = deferred_layers(gpu_update, prefetch) if dist is None else set()
    # and of those, with the handoff (`TrainConfig.update_handoff`, not in fp32), the visits copy
    # the new weights from the scratch set on the device: they wait for the kernel only, and the
    # weights cross neither back nor to the device at each visit (after the first step's)
    hand = handed_layers(gpu_update, prefetch, c, cfg.update_handoff) if dist is None else set()
    # with it the loads ahead start with the step, not its backward (`StreamingAdamW.begin_step`)
    early = bool(ahead) and cfg.update_handoff and c != 4
    # bytes per parameter back: the whole state (master, m, v and a separate compute copy), and of
    # it the weights a forward reads (the compute copy, or in fp32 the master itself)
    all_back, w_back = 12 + (c if c != 4 else 0), c
    # a streamed layer's copies in and out run at once: each direction then gets half the two-way
    # rate (the H100 runs measured ~41 GB/s each, not 55); a layer loaded ahead copies back alone
    both_each = min(profile.h2d_gbps, profile.d2h_gbps, profile.both_gbps / 2) * gb
    G = [0.0 if dev_grad[i] else gn[i] * 4 / (profile.d2h_gbps * gb) for i in range(L)]
    # the executor's own work per visit and micro-batch (CPU path, calibrated; 0 elsewhere)
    ov = profile.visit_overhead_us * 1e-6 if not cuda else 0.0
    F = [mb * (compute_seconds(shape.costs[i], profile, backward=False) + ov) for i in range(L)]
    # the executor's own work per layer: copy the first micro-batch's gradient into the fp32
    # accumulator (read, write), add the others' (read both, write), take the norms (read)
    lean = cfg.kernels == "fused" or (cfg.kernels == "auto" and cuda)  # compiled plans skip output-only matmuls
    B = [mb * (compute_seconds(shape.costs[i], profile, backward=True, lean=lean) + ov) + _memory_seconds(profile, 4 * n[i] * 3 * mb, 4 * n[i])
         - (mb * saved_seconds(shape.costs[i], profile) if i in saves else 0.0)
         for i in range(L)]
    opt_threads = cfg.optim_threads if cfg.optim_threads > 0 else profile.cores
    cpu_rate = adamw_rate(profile, cfg.optim_threads, impl=cfg.host_adamw) * (profile.adamw_with_copies if cuda else 1.0)
    gpu_rate = (profile.gpu_adamw_gparams_s or 1e3) * gb
    n_disk = sum(sn[i] for i in range(L) if placement[i] == "disk")
    # the store reads and writes around the page cache (store/fastio.py: O_DIRECT, or pages
    # dropped after): every read of the disk tier reaches the disk, however much RAM is free
    read_bw, write_bw = profile.store_read_gbps * gb, profile.store_write_gbps * gb
    V = [4 * n[i] / read_bw if per_visit[i] else 0.0 for i in range(L)]  # one visit's read of the weights
    # reads (the read-ahead) and writes (the write-behind) overlap: the disk serves both at once
    # up to the calibrated rate of the two together, each of them alone at its own rate. A task's
    # demand is the share of that joint rate it takes alone; unmeasured, they take turns (demand 1)
    # (the joint rate is clamped to the faster alone: below it a task alone would run slower than
    # measured alone; calibrations here read it a few % under the write alone, so that is optimistic
    # by as much). Two reads at once then get up to joint / read of the read rate (1.3x on the VM),
    # two writes about the write rate: measured there, two reads at once ran 1.15-1.25x one at a
    # time and two writes 0.9-1.1x (2026-11-27), and capping each direction at its own rate
    # predicted plan validation's disk case +12, +19 and +31 % over in 3 attempts, against +6, +11
    # and -7 % without it
    both_bw = max(profile.store_both_gbps * gb, read_bw, write_bw) if profile.store_both_gbps else 0.0
    dem_read, dem_write = (read_bw / both_bw, write_bw / both_bw) if both_bw else (1.0, 1.0)
    # rows of an embedding table the step's tokens do not touch have zero gradients and moments,
    # on which the host AdamW runs at another speed (measured)
    tokens = mb * shape.tokens_per_micro_batch
    idle = [sum((rows - min(rows, tokens)) * width for rows, width in shape.sparse_tables[i]) * sn[i] // max(1, n[i])
            for i in range(L)]
    zero_rate = adamw_rate(profile, cfg.optim_threads, zero_grad=True, impl=cfg.host_adamw) * (profile.adamw_with_copies if cuda else 1.0)
    adam = [0.0 if placement[i] == "gpu" or i in gpu_update else (sn[i] - idle[i]) / cpu_rate + idle[i] / zero_rate
            for i in range(L)]
    # a disk layer's master, m and v each step; a spilled gradient goes out and comes back too
    per_disk = 12 + (4 if grad_spill else 0)
    io_r = [per_disk * sn[i] / read_bw if placement[i] == "disk" else 0.0 for i in range(L)]
    io_w = [per_disk * sn[i] / write_bw if placement[i] == "disk" else 0.0 for i in range(L)]
    durable = cfg.durability != "none"
    behind = [4 * len(state_kinds(t, cfg.durability)) * sn[i] if durable and t != "disk" else 0 for i, t in enumerate(placement)]
    # collectives per layer (0 for one rank): the gradient's reduction after its backward visit,
    # the updated compute copy's all-gather before the next forward
    red = [dist.reduce_seconds(n[i]) if dist and n[i] else 0.0 for i in range(L)]
    gat = [dist.gather_seconds(n[i], c) if dist and n[i] else 0.0 for i in range(L)]
    every_step = durable and (n_disk > 0 or cfg.commit_every == 1)
    wb = [b / write_bw for b in behind] if every_step else [0.0] * L
    # committing every step, a step's commit record (and its fsyncs) follows the step's writes, and
    # the next step's writes wait for it (they may overwrite only what the last commit does not name)
    commit_fixed = profile.commit_latency_s if every_step else 0.0

    # demands: what a task would use alone (its figure was measured with that many threads)
    dem_compute = 1.0 if cuda else min(float(profile.compute_threads or 1), cores)
    dem_opt = min(float(opt_threads), cores)
    on = {"compute": "gpu" if cuda else "cpu", "h2d": "h2d" if cuda else "cpu", "d2h": "d2h" if cuda else "cpu"}
    sim = _FluidSim({"gpu": 1.0, "h2d": 1.0, "d2h": 1.0, "cpu": float(cores), "disk": 1.0, "net": 1.0, "commit": 1.0})
    visits = [("fwd", i) for i in range(L - 1)] + [("head", L - 1)] + [("bwd", i) for i in range(L - 2, -1, -1)]
    steps = 4 + MEAN_OVER
    syncs: list[int] = []
    grad: list[int | None] = [None] * L  # last step's gradient copy per layer
    write: list[int | None] = [None] * L  # last write-behind per layer
    disk_write: list[int | None] = [None] * L  # a disk layer's last write of its state
    # the disk tier reads a step's state ahead during its forward and backward (`begin_step`), in a
    # ring of DISK_SLOTS chunk sets, each back once its chunk is written: a layer's read starts
    # once a set is free for its first chunk (the write of the chunk DISK_SLOTS chunks earlier).
    # A layer of more chunks than sets streams through them: its sets come back as its update
    # moves on, its writes trailing by at most DISK_SLOTS chunks, so the next layer's read follows
    # its update rather than its last write
    chunks = [math.ceil(sn[i] / StateTiers.disk_chunk_numel) for i in range(L)]
    set_free: list[int] = []  # per chunk taken so far, the write that gives its set back
    h2d_last = d2h_last = net_last = None
    bwd_from: int | None = None  # last step's head visit could start: the state loads ahead from there
    back_prev: list[int | None] = [None] * L  # last step's GPU-side updates' state back on the host
    committed: int | None = None  # last step's commit (every-step commits)
    for s in range(steps):
        sync = syncs[-1] if syncs else None
        upd: list[int | None] = [None] * L
        pf_last: int | None = None  # the optimizer lane's copies in, in order
        back: list[int | None] = [None] * L
        gate: list[int | None] = [None] * L  # what a forward fetch waits for: the update (and its all-gather)
        kernel: list[int | None] = [None] * L  # a handed-over layer's update kernel
        dev = sync
        if s:
            cpu_chain = str_in = str_out = writer = sync
            read_from = syncs[-2] if len(syncs) > 1 else None  # the start of the step whose gradients these are
            for i in range(L):
                if not n[i]:
                    continue
                deps = (sync, grad[i], write[i])
                if placement[i] == "gpu":
                    dev = sim.add(sn[i] / gpu_rate, on["compute"], (dev, *deps))
                    upd[i] = sync
                elif i in ahead:  # loaded during the last backward (with the handoff from its start), after its state came back
                    pf_last = sim.add(12 * sn[i] / (profile.h2d_gbps * gb), on["h2d"],
                                      (read_from if early else bwd_from, pf_last, back_prev[i]))
                    out_b = w_back if i in late else all_back
                    if i in hand:  # the kernel (beside the compute); its weights stay on the device
                        kernel[i] = upd[i] = sim.add(sn[i] / gpu_rate, on["compute"], (pf_last, *deps))
                    else:
                        str_out = upd[i] = sim.add(out_b * sn[i] / (profile.d2h_gbps * gb) + sn[i] / gpu_rate, on["d2h"],
                                                   (pf_last, str_out, *deps))
                    back[i] = None if i in late else upd[i]
                elif i in gpu_update:
                    str_in = sim.add(streamed_in * sn[i] / both_each, on["h2d"], (str_in, *deps))
                    str_out = back[i] = upd[i] = sim.add(all_back * sn[i] / both_each + sn[i] / gpu_rate, on["d2h"], (str_in, str_out))
                elif placement[i] == "disk":
                    ring = set_free[-DISK_SLOTS] if len(set_free) >= DISK_SLOTS else None
                    # a spilled gradient is read back with the state: after the backward wrote it
                    rd = sim.add(io_r[i], "disk", (read_from, ring, disk_write[i], grad[i] if grad_spill else None), dem_read)
                    cpu_chain = ad = sim.add(adam[i], "cpu", (rd, cpu_chain, *deps), dem_opt)
                    disk_write[i] = wr = sim.add(io_w[i], "disk", (ad, committed), dem_write)
                    set_free.extend([wr if chunks[i] <= DISK_SLOTS else ad] * chunks[i])
                    # a forward fetch waits for the update; reading its weights from the store, for the write too
                    upd[i] = wr if per_visit[i] else ad
                else:
                    cpu_chain = upd[i] = sim.add(adam[i], "cpu", (cpu_chain, *deps), dem_opt)
                if wb[i] and i not in late:
                    writer = write[i] = sim.add(wb[i], "disk", (writer, upd[i] if placement[i] != "gpu" else dev, committed),
                                                dem_write)
                gate[i] = net_last = sim.add(gat[i], "net", (upd[i] if placement[i] != "gpu" else dev, net_last)) if gat[i] else upd[i]
                if kernel[i] is not None:  # handed over on the device: the visits wait for the kernel only
                    gate[i] = kernel[i]
            for i in sorted(late):  # behind every layer's weights on the copy stream
                str_out = back[i] = sim.add((all_back - w_back) * sn[i] / (profile.d2h_gbps * gb), on["d2h"], (str_out,))
                if wb[i]:  # a commit writes the state once it is back
                    writer = write[i] = sim.add(wb[i], "disk", (writer, back[i], committed), dem_write)
            if commit_fixed:
                committed = sim.add(commit_fixed, "commit", [disk_write[i] for i in range(L)] + [write[i] for i in range(L)])
        back_prev = back
        comp, issue, arrived = dev, sync, sync
        ends: list[int] = []
        for k, (phase, i) in enumerate(visits):
            if phase == "head":
                bwd_from = comp
            issue = sim.add(0.0, "", ((issue if cuda else arrived), gate[i] if phase != "bwd" else None))
            if resident[i] or (s and i in hand):  # (a handed-over layer: copied within the device, ~free)
                arrived = issue
            else:
                if V[i]:  # into the staging buffer (the slot on the CPU) at the store's highest priority
                    issue = sim.add(V[i], "disk", (issue,), dem_read)
                h2d_last = arrived = sim.add(W[i], on["h2d"], (issue, ends[k - 2] if k >= 2 else sync, h2d_last))
            comp = sim.add(F[i] if phase == "fwd" else B[i], on["compute"], (comp, arrived), dem_compute)
            ends.append(comp)
            if phase != "fwd" and red[i] and dist.reduce_scatter:  # on the device, then the shard crosses
                net_last = rs = sim.add(red[i], "net", (comp, net_last))
                d2h_last = grad[i] = sim.add(G[i], on["d2h"], (rs, d2h_last)) if G[i] else rs
            elif phase != "fwd":
                d2h_last = grad[i] = sim.add(G[i], on["d2h"], (comp, d2h_last)) if G[i] else comp
                if red[i]:  # gloo: all-reduced in host memory after the copy
                    net_last = grad[i] = sim.add(red[i], "net", (grad[i], net_last))
        syncs.append(comp)
    end = sim.run()
    # the mean of the last steps: a pipeline whose stages lag by a step (the disk tier's writes
    # behind the next step's reads) settles over a few steps, alternating long and short ones
    schedule = (end[syncs[-1]] - end[syncs[-1 - MEAN_OVER]]) / MEAN_OVER

    Wx = [0.0 if i in hand else W[i] for i in range(L)]  # what crosses PCIe per visit, steady state
    h2d_b = sum(Wx[i] * profile.h2d_gbps * gb for i in range(L - 1)) * 2 + Wx[L - 1] * profile.h2d_gbps * gb
    streamed = sum(sn[i] for i in gpu_update)
    h2d_b += streamed_in * streamed
    d2h_b = sum(gn[i] * 4 for i in range(L) if not dev_grad[i]) + 14 * streamed - c * sum(sn[i] for i in hand)
    if dist and cuda and dist.reduce_scatter and dist.world_size > 1:  # the all-gather runs on the device: the rank's updated shard goes up, the others' come down
        h2d_b += sum(c * sn[i] for i in range(L) if placement[i] != "gpu")
        d2h_b += sum(c * (n[i] - min(n[i], sn[i])) for i in range(L) if placement[i] != "gpu")
    pcie = (h2d_b + d2h_b) / (profile.both_gbps * gb) if cuda else 0.0
    host_mem = dist.host_memory_seconds(h2d_b + d2h_b, sum(sn[i] for i in range(L) if adam[i]), 24 * n_disk, c,
                                        n_total=sum(n)) if dist else 0.0
    visit_r = sum(V[: L - 1]) * 2 + V[L - 1]
    disk_r, disk_w = sum(io_r) + visit_r, sum(io_w) + sum(wb)
    # one disk: the schedule's last steps may not have settled to it yet
    disk_busy = max(disk_r, disk_w, (disk_r * read_bw + disk_w * write_bw) / both_bw) if both_bw else disk_r + disk_w
    base = max(schedule, pcie, host_mem, disk_busy)
    vol = sum(behind)
    # a commit's bytes at the store's rate, plus what it costs whatever its size (fsyncs, renames,
    # the record; three chunk files' worth) and each further chunk file's fsync, rename and
    # directory fsync: for a small model the fixed part is most of it, and the pacer paces by the whole
    files = sum(len(state_kinds(placement[i], cfg.durability)) * -(-4 * sn[i] // _STORE_CHUNK_BYTES) for i in range(L) if behind[i])
    commit_s = (vol / write_bw + profile.commit_latency_s + profile.commit_file_s * max(0, files - 3)
                if vol or every_step else 0.0)
    if not durable or not vol:
        commits = Commits(vol, commit_s, 1 if every_step else 0, 0.0)
    elif every_step:
        commits = Commits(vol, commit_s, 1, 0.0)  # in the schedule already (its writes, then its fixed cost)
    else:  # written behind; paced to <= 5 % of the time (commit_every 0), or every N steps
        every = cfg.commit_every if cfg.commit_every else max(1, math.ceil(20 * commit_s / base))
        commits = Commits(vol, commit_s, every, max(0.0, commit_s - base) / every)
    fwd_s, bwd_s = sum(F[: L - 1]), sum(B)
    cpu_work = 0.0
    if not cuda:
        copies = (h2d_b + d2h_b) / (profile.h2d_gbps * gb)
        cpu_work = ((fwd_s + bwd_s) * dem_compute + sum(adam) * dem_opt + copies) / cores
    hw = sum(mb * (x.matmul_flops + x.attention_flops) for x in shape.costs)
    hw = 4 * hw - mb * (shape.costs[-1].matmul_flops + shape.costs[-1].attention_flops)  # fwd + recompute + 2x bwd; head 3x
    hw -= sum(mb * (shape.costs[i].matmul_flops + shape.costs[i].attention_flops) for i in saves)  # no recompute (about)
    if lean:
        hw -= mb * sum(2 * b * m_ * k * n_ for x in shape.costs for j, (b, m_, k, n_) in enumerate(x.matmuls) if j in x.output_only)
    copies_s = (h2d_b + d2h_b) / (profile.both_gbps * gb)
    stages = {"GPU compute" if cuda else "compute (CPU)": fwd_s + bwd_s,
              "PCIe" if cuda else "host copies (memcpy)": copies_s,
              "CPU optimizer": sum(adam),
              "disk I/O": disk_busy}
    if cuda:
        stages["GPU optimizer"] = sum(sn[i] for i in range(L) if placement[i] == "gpu") / gpu_rate
    if dist:
        stages[dist.link_stage] = sum(red) + sum(gat)
        if host_mem:
            stages["host memory (shared)"] = host_mem
    if not cuda:
        stages["CPU cores, all work shared"] = cpu_work
    return StepTime(
        step_s=base + commits.stall_s, schedule_s=schedule, fwd_s=fwd_s, bwd_s=bwd_s, hw_flops=hw,
        h2d_weights_s=sum(Wx[: L - 1]) * 2 + Wx[L - 1], d2h_grads_s=sum(G),
        streamed_s=max(streamed_in * streamed / (profile.h2d_gbps * gb), 14 * streamed / (profile.d2h_gbps * gb)),
        pcie_bound_s=pcie, optimizer_s=sum(adam), gpu_optimizer_s=sum(sn[i] for i in range(L) if placement[i] == "gpu") / gpu_rate,
        disk_read_s=disk_r, disk_write_s=disk_w, cpu_work_s=cpu_work, commits=commits,
        disk_bytes_written=int(12 * n_disk + (vol // commits.every if commits.every else 0)),
        # the shared-cores total is a bound, not a stage: the bottleneck is the busiest stage
        bottleneck=max((k for k in stages if not k.startswith("CPU cores")), key=lambda k: stages[k]), stage_s=stages,
        spill_bytes_written=4 * n_disk if grad_spill else 0,
    )
