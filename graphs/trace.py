"""Trace an `nn.Module` decoder language model into a Program of per-layer templates.

The whole model (plus mtc's cross-entropy loss) is exported once with `torch.export` at a fixed
micro-batch shape, giving one ATen graph whose parameters are explicit inputs. `trace` runs these
named steps over it:

1. ``export_model`` (graphs/export.py): the model and its loss as one exported program;
2. ``flatten_graph`` (graphs/export.py): grad-mode regions inlined, metadata asserts dropped;
   ``check_replayable``: no buffer updates, random draws or data-dependent sizes, no position
   table shorter than the sequence;
3. ``input_sources``: each graph input becomes a parameter, constant or batch field;
4. ``assign_stages``: nodes inside ``<blocks>.<i>`` belong to block i, nodes before the first
   block form the embed stage, nodes after the last block the head + loss stage;
5. ``block_outputs`` and ``hidden_state``: the one tensor each stage hands on, and which of the
   embed stage's outputs enters block 0 (the others are aux values: RoPE tables, masks);
6. ``extract_layers``: each stage becomes a stateless template; structurally identical blocks
   share one template;
7. ``lay_out_params``: the flat per-layer parameter layout.

Works on the meta device: `trace` of a 70B preset built under ``torch.device("meta")`` takes
seconds and allocates no weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
from mtc.graphs.export import LossModel, export_model, flatten_graph
from mtc.graphs.program import (
    LayerCall,
    ParamSpec,
    Program,
    Source,
    Template,
    TemplateInput,
    TensorSpec,
    devices_to_marker,
    dtype_name,
    external_inputs,
)
from torch import fx, nn
from torch.export.graph_signature import InputKind

from mtc.errors import TraceError

__all__ = ["LossModel", "find_blocks", "trace"]

_WRAP = "model"  # attribute name of the user's model inside LossModel; stripped from keys


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, int]:
    """The path of the repeated-block ModuleList and its length.

    Without ``blocks``, the largest ``nn.ModuleList`` that no other ``nn.ModuleList`` holds is
    taken (so a mixture of experts' list inside each block is not mistaken for the blocks).
    """
    if blocks is not None:
        try:
            ml = model.get_submodule(blocks)
        except AttributeError:
            raise TraceError(f"blocks={blocks!r} names no submodule of {type(model).__name__}") from None
        if not isinstance(ml, (nn.ModuleList, nn.Sequential)) or len(ml) == 0:
            raise TraceError(f"blocks={blocks!r} is a {type(ml).__name__}; it must be a non-empty nn.ModuleList")
        return blocks, len(ml)
    best: tuple[str, int] | None = None
    lists = [name for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod) > 0]
    for name in lists:
        if any(name.startswith(outer + ".") for outer in lists):
            continue  # inside an element of another list (experts inside a block)
        mod = model.get_submodule(name)
        if best is None or len(mod) > best[1]:
            best = (name, len(mod))
    if best is None:
        raise TraceError(
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks; keep the decoder layers in "
            "an nn.ModuleList (e.g. self.layers) or pass blocks='path.to.layers'"
        )
    return best


_PATH_FIXES = [(re.compile(r"^L\['self'\]\.?"), ""), (re.compile(r"\[(\d+)\]"), r".\1"), (re.compile(r"\._modules\['([^']+)'\]"), r".\1")]


def _norm_path(path: str) -> str:
    for pat, rep in _PATH_FIXES:
        path = pat.sub(rep, path)
    return path


def _block_index(node: fx.Node, prefix: str) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in stack.values():
        p = _norm_path(path)
        if p.startswith(prefix):
            head = p[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<root>"
    path = _norm_path(list(stack.values())[-1][0])
    return path.removeprefix(_WRAP + ".") or "<root>"


def _spec(node: fx.Node) -> TensorSpec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise TraceError(
            f"value {node.name} ({node.target}) that crosses a layer boundary is a {type(val).__name__}, not a "
            "tensor; mtc passes only tensors between layers, so compute it inside the layer that uses it"
        )
    return TensorSpec.of(val)


def _extract(
    kind: str,
    nodes: list[fx.Node],
    outputs: list[fx.Node],
    classify: Callable[[fx.Node], tuple[str, str]],
) -> tuple[Template, list[fx.Node], list[tuple[str, str]]]:
    """Copy ``nodes`` into a fresh graph whose external inputs become placeholders.

    Returns the template, the external input nodes (first-use order) and their (kind, role).
    """
    ext = external_inputs(nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[TemplateInput] = []
    kinds: list[tuple[str, str]] = []
    used_names: set[str] = set()
    for a in ext:
        ikind, role = classify(a)
        base = re.sub(r"\W", "_", f"{ikind}_{role}" if role else ikind)
        name, k = base, 1
        while name in used_names:
            name, k = f"{base}_{k}", k + 1
        used_names.add(name)
        ph = g.placeholder(name)
        ph.meta["val"] = a.meta.get("val")
        env[a] = ph
        inputs.append(TemplateInput(name=name, kind=ikind, spec=_spec(a), role=role))  # type: ignore[arg-type]
        kinds.append((ikind, role))
    for n in nodes:
        new = g.node_copy(n, lambda x: env[x])
        new.args = devices_to_marker(new.args)
        new.kwargs = devices_to_marker(new.kwargs)
        env[n] = new
    g.output(tuple(env[o] for o in outputs))
    g.lint()
    return Template(kind=kind, graph=g, inputs=inputs, n_aux_out=max(0, len(outputs) - 1) if kind == "embed" else 0), ext, kinds  # type: ignore[arg-type]


def _random_draw(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (dropout with p > 0 while training, rand, bernoulli...)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    # ops that draw only for a dropout argument (dropout, SDPA): random when it is nonzero (and training)
    names = [a.name for a in target._schema.arguments]
    given = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    p = next((given.get(k, 0.0) for k in ("p", "dropout_p") if k in names), None)
    if p is None:
        return True
    return p != 0 and bool(given.get("train", True))


def _draw_text(node: fx.Node) -> str:
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    given = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    p = next((given[k] for k in ("p", "dropout_p") if k in given), None)
    return f"{node.target}" + (f" with dropout p={p}" if p is not None else "")


def _written_buffers(ep: torch.export.ExportedProgram, graph: fx.Graph, kind: InputKind = InputKind.BUFFER) -> list[str]:
    """Buffers (or the inputs of another ``kind``: parameters) an in-place op of ``graph`` writes
    (through views too): export's training IR keeps in-place ops as they are, so
    `buffers_to_mutate` names none of them."""
    buffers = {s.arg.name: s.target for s in ep.graph_signature.input_specs
               if s.kind == kind and hasattr(s.arg, "name")}
    out: list[str] = []
    for _, v in _written_inputs(graph):
        if v.name in buffers and buffers[v.name] not in out:
            out.append(buffers[v.name])
    return out


def _written_inputs(graph: fx.Graph) -> Iterator[tuple[fx.Node, fx.Node]]:
    """(in-place op, placeholder it writes) for each write of ``graph`` into one of its inputs,
    through views too."""
    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for i, a in enumerate(n.target._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            while isinstance(v, fx.Node) and v.op == "call_function" and v.args and isinstance(v.args[0], fx.Node) \
                    and isinstance(v.target, torch._ops.OpOverload) and v.target.is_view:
                v = v.args[0]  # a view's base
            if isinstance(v, fx.Node) and v.op == "placeholder":
                yield n, v


def _check_inputs_kept(t: Template) -> None:
    """Refuse a layer that writes into the hidden state or an aux value it receives: the executor
    keeps a layer's inputs to recompute it in the backward (and feeds one aux value to every block)."""
    kinds = {i.name: i.kind for i in t.inputs}
    for n, v in _written_inputs(t.graph):
        what = {"carry": "the hidden state", "aux": "a value computed before the blocks"}.get(kinds.get(v.name, ""))
        if what is not None:
            raise TraceError(
                f"module {_module_of(n)!r} writes in place into {what} it receives ({n.target}, e.g. `x += ...` or "
                "`x[:, 0] = ...` on its input): mtc keeps each layer's inputs to recompute the layer in the backward, "
                "so the write would corrupt them. Write it out of place (`x = x + ...`, or `x = x.clone()` first), "
                "then trace again")


def _arange_top(node: object) -> int | None:
    """The largest value of an ``arange`` with constant bounds that ``node`` is (or views), else None."""
    while isinstance(node, fx.Node) and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and isinstance(node.target, torch._ops.OpOverload)
            and node.target.overloadpacket is torch.ops.aten.arange):
        return None
    bounds = [a for a in node.args if isinstance(a, (int, float))]
    if not bounds or not all(isinstance(a, int) for a in bounds):
        return None
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (bounds + [1])[:3]
    return None if step <= 0 or end <= start else start + (end - 1 - start) // step * step


def _check_position_lookup(n: fx.Node) -> None:
    """A table looked up at positions 0..T-1 (learned position embeddings) must have T rows: on the
    device a lookup past its end is an assert deep inside a kernel, at the first step."""
    if n.op != "call_function" or n.target is not torch.ops.aten.embedding.default:
        return
    top = _arange_top(n.args[1])
    rows = n.args[0].meta.get("val").shape[0] if isinstance(n.args[0], fx.Node) and "val" in n.args[0].meta else None
    if top is not None and rows is not None and top >= rows:
        raise TraceError(
            f"module {_module_of(n)!r} looks up rows 0..{top} of a table of {rows} rows (positions of the traced "
            f"sequence length): the table is too short for this seq_len; make it at least {top + 1} rows, or trace "
            f"and train at seq_len <= {rows}")


def check_replayable(ep: torch.export.ExportedProgram, graph: fx.Graph) -> None:
    """Step 2b: refuse what running each layer as a pure function of fixed-shape inputs, and
    recomputing its forward in the backward, would silently get wrong: a forward that updates a
    buffer or a parameter (the update would be dropped every step), one that draws random numbers (the backward's
    recompute would draw other ones, so the gradient would not be the reported loss's), and values
    whose size depends on the data (every layer is compiled for one shape); also a sparse
    embedding, whose sparse gradient the executor and AdamW cannot take."""
    mutated = list(ep.graph_signature.buffers_to_mutate.values()) + _written_buffers(ep, graph)
    if mutated:
        names = ", ".join(repr(m.removeprefix(_WRAP + ".")) for m in mutated[:3])
        raise TraceError(
            f"the forward updates buffer{'s' if len(mutated) > 1 else ''} {names} in place (running statistics, a step counter): mtc runs each layer "
            "as a pure function of its parameters and inputs, so the update would be lost every step. Keep such "
            "state outside the model's forward (or make it a parameter), then trace again")
    written = _written_buffers(ep, graph, InputKind.PARAMETER)
    if written:  # nn.Embedding(max_norm=...) renormalises the rows it looks up, inside the forward
        names = ", ".join(repr(m.removeprefix(_WRAP + ".")) for m in written[:3])
        raise TraceError(
            f"the forward writes parameter{'s' if len(written) > 1 else ''} {names} in place (e.g. nn.Embedding with "
            "max_norm renormalising the rows it looks up): mtc runs each layer as a pure function of its parameters, so "
            "the write would be lost every step and training would differ from torch's. Drop max_norm (or clamp the "
            "looked-up vectors' norms out of place), then trace again")
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in graph.nodes:
        _check_position_lookup(n)
        if n.op == "call_function" and n.target is torch.ops.aten.embedding.default \
                and (n.args[4] if len(n.args) > 4 else n.kwargs.get("sparse", False)):
            raise TraceError(
                f"module {_module_of(n)!r} is an nn.Embedding with sparse=True: its gradient is a sparse tensor, "
                "which mtc's AdamW (like torch.optim.AdamW) cannot take; drop sparse=True, then trace again")
        if _random_draw(n):
            what = _draw_text(n)
            raise TraceError(
                f"module {_module_of(n)!r} draws random numbers in the forward ({what}): mtc recomputes each layer's "
                "forward during the backward, and a second draw would make the gradient disagree with the loss. Set "
                "dropout probabilities to 0 (as LLM pre-training and most fine-tuning do), or trace the model in "
                "eval mode (model.eval(); a functional F.dropout(x, p) drops in eval mode too: give it "
                "training=self.training)")
        if free_unbacked_symbols(_shaped(n.meta.get("val"))):
            raise TraceError(
                f"module {_module_of(n)!r} makes a value whose size depends on the data ({n.target}, e.g. "
                "torch.nonzero, torch.where with one argument, boolean-mask indexing or top-k routing that gathers "
                "tokens): mtc compiles every layer for fixed shapes. Compute it with fixed shapes, e.g. route a "
                "mixture of experts densely (each expert over every token, weighted by its gate, zero where not routed)")


def _shaped(val: object) -> object:
    """The tensors and symbolic sizes of a node's value, the rest left out (some torch versions'
    `free_unbacked_symbols` assert on a str or dict value rather than skip it)."""
    if isinstance(val, (list, tuple)):
        return [x for v in val if (x := _shaped(v)) is not None]
    return val if isinstance(val, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) else None


def input_sources(ep: torch.export.ExportedProgram, model: nn.Module) -> tuple[dict[fx.Node, Source], dict[str, torch.Tensor]]:
    """Step 3: the source of each graph input (tied parameters get one canonical key), and the
    values of the constants (buffers)."""
    canon: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
    ph_source: dict[fx.Node, Source] = {}
    const_values: dict[str, torch.Tensor] = {}
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user_inputs = ["ids", "targets"]
    n_user = 0
    for spec in ep.graph_signature.input_specs:
        node = by_name[spec.arg.name]
        if spec.kind == InputKind.PARAMETER:
            fqn = spec.target.removeprefix(_WRAP + ".")
            ph_source[node] = Source("param", canon[id(model.get_parameter(fqn))])
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            key = spec.target.removeprefix(_WRAP + ".")
            val = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            if val is None:
                raise TraceError(f"constant {spec.target!r} of the traced model has no value")
            const_values[key] = val.detach()
            ph_source[node] = Source("const", key)
        elif spec.kind == InputKind.USER_INPUT:
            ph_source[node] = Source("batch", user_inputs[n_user])
            n_user += 1
        else:
            raise TraceError(f"unsupported graph input kind {spec.kind} for {spec.target!r}")
    return ph_source, const_values


def assign_stages(graph: fx.Graph, blocks_path: str, n_blocks: int) -> dict[fx.Node, int]:
    """Step 4: the stage of every op node: -1 embed, 0..N-1 blocks, N head."""
    prefix = f"{_WRAP}.{blocks_path}."
    stage: dict[fx.Node, int] = {}
    last_block = -1
    after: list[fx.Node] = []  # non-block nodes seen after a block node
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        b = _block_index(node, prefix)
        if b is None:
            if last_block < 0:
                stage[node] = -1
            else:
                stage[node] = n_blocks
                after.append(node)
            continue
        if after:
            bad = after[0]
            raise TraceError(
                f"top-level code runs between blocks ({bad.target} in {_module_of(bad)} after block {last_block}); "
                f"mtc streams blocks back to back: move that code into the blocks or before/after the {blocks_path} loop"
            )
        if b < last_block:
            raise TraceError(f"block {b} runs after block {last_block}; {blocks_path} must run in order, each once")
        stage[node] = b
        last_block = b
    if last_block != n_blocks - 1:
        raise TraceError(f"only blocks up to {last_block} of {n_blocks} in {blocks_path} ran in forward; every block must run once")
    for s in range(n_blocks):
        if s not in stage.values():
            raise TraceError(f"block {s} of {blocks_path} computes nothing")
    return stage


def _nodes_of(stage: dict[fx.Node, int], n_blocks: int) -> dict[int, list[fx.Node]]:
    nodes_of: dict[int, list[fx.Node]] = {s: [] for s in range(-1, n_blocks + 1)}
    for node, s in stage.items():
        nodes_of[s].append(node)
    return nodes_of


def _used_outside(nodes: list[fx.Node], s: int, stage: dict[fx.Node, int], n_blocks: int) -> list[fx.Node]:
    return [n for n in nodes if any(stage.get(u, n_blocks + 1) != s for u in n.users)]


def block_outputs(stage: dict[fx.Node, int], blocks_path: str, n_blocks: int) -> list[fx.Node]:
    """Step 5a: the one tensor (the hidden state) each block hands to the next stage."""
    nodes_of = _nodes_of(stage, n_blocks)
    block_out: list[fx.Node] = []
    for s in range(n_blocks):
        outs = _used_outside(nodes_of[s], s, stage, n_blocks)
        if len(outs) != 1:
            raise TraceError(
                f"block {s} of {blocks_path} passes {len(outs)} values ({', '.join(o.name for o in outs)}) to later stages; "
                "mtc streams one hidden-state tensor from block to block: return a single tensor from each block"
            )
        later = sorted({_stage_name(stage.get(u), n_blocks, blocks_path) for u in outs[0].users
                        if stage.get(u) not in (s + 1,) and u.op != "output"})
        if later:
            raise TraceError(
                f"the output of block {s} of {blocks_path} ({outs[0].name}) is used beyond the next block, by "
                f"{', '.join(later)}; mtc streams each block's output to the next stage only: a skip connection past "
                "a block must go through it (take it in, hand it on as part of the one tensor)"
            )
        block_out.append(outs[0])
    return block_out


def hidden_state(stage: dict[fx.Node, int], block_out: list[fx.Node], ph_source: dict[fx.Node, Source], n_blocks: int) -> fx.Node:
    """Step 5b: which embed output is the hidden state entering block 0: the one block 0 consumes
    at the place where block 1 consumes block 0's output (same template), else the one shaped
    like the block output that depends on a parameter."""
    nodes_of = _nodes_of(stage, n_blocks)
    embed_out = _used_outside(nodes_of[-1], -1, stage, n_blocks)
    carry0: fx.Node | None = None
    ext0 = external_inputs(nodes_of[0])
    if n_blocks >= 2:
        ext1 = external_inputs(nodes_of[1])
        if len(ext0) == len(ext1) and block_out[0] in ext1:
            carry0 = ext0[ext1.index(block_out[0])]
    if carry0 is None:
        out_spec = _spec(block_out[0])
        cands = [n for n in ext0 if n in embed_out and _spec(n) == out_spec and _depends_on_param(n, ph_source)]
        if len(cands) != 1:
            names = ", ".join(f"{n.name} ({_module_of(n)})" for n in cands) or "none"
            why = ("with one block there is no next block whose inputs would tell them apart (argument order is "
                   "not kept in the trace): compute the others inside the block, or give the model a second block"
                   if len(cands) > 1 else "the hidden state must come from the embedding stage, shaped like the block's output")
            raise TraceError(
                f"cannot tell which value entering block 0 is the hidden state ({len(cands)} candidates shaped like its "
                f"output and computed from parameters: {names}); {why}"
            )
        carry0 = cands[0]
    if stage.get(carry0) != -1:
        raise TraceError(f"the hidden state entering block 0 ({carry0.name}) is not computed by the embedding stage")
    return carry0


def _stage_name(s: int | None, n_blocks: int, blocks_path: str) -> str:
    if s is None:
        return "no stage"
    return "the embedding stage" if s < 0 else "the head" if s >= n_blocks else f"block {s} ({blocks_path}.{s})"


def extract_layers(
    graph: fx.Graph,
    stage: dict[fx.Node, int],
    ph_source: dict[fx.Node, Source],
    carry0: fx.Node,
    block_out: list[fx.Node],
    blocks_path: str,
    n_blocks: int,
) -> tuple[dict[str, Template], list[LayerCall], list[fx.Node]]:
    """Step 6: a template and a layer call per stage (blocks with one structure share a template);
    also the embed stage's aux outputs."""
    nodes_of = _nodes_of(stage, n_blocks)
    # the hidden state leaves the embed stage as the carry; when a later block or the head reads it
    # too (modded-nanogpt's `x = x0 = embed(ids)`, then `block(x, x0)`), it is an aux value as well
    beyond = any(stage.get(u, -1) > 0 for u in carry0.users)
    aux_nodes = [n for n in _used_outside(nodes_of[-1], -1, stage, n_blocks) if n is not carry0 or beyond]
    aux_index = {n: k for k, n in enumerate(aux_nodes)}
    templates: dict[str, Template] = {}
    calls: list[LayerCall] = []

    def add_call(idx: int, call_name: str, kind: str, nodes: list[fx.Node], outputs: list[fx.Node], carry_in: fx.Node | None) -> None:
        def classify(a: fx.Node) -> tuple[str, str]:
            if a in ph_source:
                src = ph_source[a]
                role = src.key
                if src.kind == "param" and kind == "block":
                    role = src.key.split(f"{blocks_path}.", 1)[-1].split(".", 1)[-1]
                return src.kind, role
            if a is carry_in:
                return "carry", ""
            if a in aux_index:
                return "aux", str(aux_index[a])
            if a.op != "call_function":
                raise TraceError(
                    f"{call_name} reads {a.name} ({a.op} {a.target}) in {_module_of(a)}: a value torch.export left as a "
                    "subgraph or attribute, which mtc cannot place in a layer; compute it with plain tensor ops"
                )
            raise TraceError(
                f"{call_name} uses {a.name} ({a.target}) computed in {_stage_name(stage.get(a), n_blocks, blocks_path)} "
                f"({_module_of(a)}); only the hidden state and values computed before the first block may cross layer boundaries"
            )

        tmpl, ext, kinds = _extract(kind, nodes, outputs, classify)
        _check_inputs_kept(tmpl)
        tmpl = templates.setdefault(tmpl.id, tmpl)
        bindings: dict[str, Source] = {}
        for inp, a, (ikind, _role) in zip(tmpl.inputs, ext, kinds):
            if ikind == "carry":
                bindings[inp.name] = Source("carry")
            elif ikind == "aux":
                bindings[inp.name] = Source("aux", index=aux_index[a])
            else:
                bindings[inp.name] = ph_source[a]
        calls.append(LayerCall(index=idx, name=call_name, template=tmpl.id, bindings=bindings))

    loss_node = next(iter(n for n in graph.nodes if n.op == "output")).args[0]
    loss_node = loss_node[0] if isinstance(loss_node, (tuple, list)) else loss_node
    add_call(0, "embed", "embed", nodes_of[-1], [carry0, *aux_nodes], None)
    for s in range(n_blocks):
        add_call(s + 1, f"{blocks_path}.{s}", "block", nodes_of[s], [block_out[s]], carry0 if s == 0 else block_out[s - 1])
    add_call(n_blocks + 1, "head", "head", nodes_of[n_blocks], [loss_node], block_out[-1])
    return templates, calls, aux_nodes


def lay_out_params(model: nn.Module, calls: list[LayerCall]) -> dict[str, ParamSpec]:
    """Step 7: each parameter lives in the first layer that reads it; inside a layer the
    weight-decayed (ndim >= 2, not frozen) parameters come first so decay is one slice. A
    parameter with ``requires_grad=False`` is laid out frozen (see `ParamSpec`)."""
    owner: dict[str, int] = {}
    order: list[str] = []
    for call in calls:
        for key in call.param_keys():
            if key not in owner:
                owner[key] = call.index
                order.append(key)
    pspec = {n: TensorSpec.of(p) for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    unused = [n for n in pspec if n not in owner]
    if unused:
        raise TraceError(f"parameters never used in forward: {', '.join(unused[:5])}; remove them from the model "
                         "(mtc keeps state for every parameter it is given)")
    decays = {k: len(pspec[k].shape) >= 2 and k not in frozen for k in pspec}
    laid: dict[str, ParamSpec] = {}
    for layer in range(len(calls)):
        keys = [k for k in order if owner[k] == layer]
        keys.sort(key=lambda k: not decays[k])  # stable: decayed first, first-use order kept
        off = 0
        for k in keys:
            laid[k] = ParamSpec(key=k, spec=pspec[k], layer=layer, offset=off, decay=decays[k], frozen=k in frozen)
            off += pspec[k].numel
    # The dict itself follows the module's parameter order: global reductions over parameters
    # (the clipping norm) then round exactly as they do over model.parameters().
    return {k: laid[k] for k in pspec}


def state_dict_names(model: nn.Module, const_values: dict[str, torch.Tensor]) -> dict[str, object]:
    """What the module's own ``state_dict`` holds beyond the program's parameters, so a run's
    weights load back into it strictly: ``tied`` (another name of a shared parameter: its
    canonical one; also another name of a persistent buffer) and ``buffers`` (persistent buffers,
    which the program keeps as constants)."""
    canon: dict[int, str] = {}
    tied: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in canon:
            tied[n] = canon[id(p)]
        else:
            canon[id(p)] = n
    keys = set(model.state_dict(keep_vars=True))
    named = [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in keys]
    buffers = [n for n, _ in named if n in const_values]
    # one buffer under several names (a block module repeated in the list, or one table
    # registered in every block): the names the trace kept no constant for are its aliases
    kept = {id(b): n for n, b in reversed(named) if n in const_values}
    tied.update({n: kept[id(b)] for n, b in named if n not in const_values and id(b) in kept})
    return {k: v for k, v in (("tied", tied), ("buffers", buffers)) if v}


def trace(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    *,
    blocks: str | None = None,
    name: str | None = None,
) -> Program:
    """Trace ``model`` (``forward(ids) -> logits``) at micro-batch shape (batch_size, seq_len).

    The model may live on the meta device (structure only) or hold real weights on the CPU.
    Raises TraceError naming the module and what to change when the model cannot be traced.
    """
    if batch_size < 1 or seq_len < 1:
        raise TraceError(f"batch_size and seq_len must be positive, got {batch_size} x {seq_len}")
    blocks_path, n_blocks = find_blocks(model, blocks)
    first = next(model.parameters(), None)
    if first is None:
        raise TraceError(f"{type(model).__name__} has no parameters; there is nothing to train")
    ids = torch.zeros((batch_size, seq_len), dtype=torch.long, device=first.device)
    ep = export_model(LossModel(model), ids, ids.clone())
    graph = flatten_graph(ep)
    check_replayable(ep, graph)
    ph_source, const_values = input_sources(ep, model)
    try:
        stage = assign_stages(graph, blocks_path, n_blocks)
    except TraceError as e:
        if blocks is not None:
            raise
        # the list was a guess (the longest top-level nn.ModuleList): another may hold the blocks
        others = [n for n, m in model.named_children() if isinstance(m, nn.ModuleList) and n != blocks_path]
        raise TraceError(f"{e} (mtc took {blocks_path!r}, the longest nn.ModuleList, for the blocks"
                         + (f"; if they are in {' or '.join(repr(o) for o in others)}, trace with "
                            f"mtc.trace(model, batch_size, seq_len, blocks={others[0]!r}) and train with plan= that program)"
                            if others else ")")) from None
    block_out = block_outputs(stage, blocks_path, n_blocks)
    carry0 = hidden_state(stage, block_out, ph_source, n_blocks)
    templates, calls, aux_nodes = extract_layers(graph, stage, ph_source, carry0, block_out, blocks_path, n_blocks)
    return Program(
        templates=templates,
        layers=calls,
        params=lay_out_params(model, calls),
        constants={k: TensorSpec.of(v) for k, v in const_values.items()},
        batch={"ids": TensorSpec.of(ids), "targets": TensorSpec.of(ids)},
        carry=_spec(carry0),
        aux=[_spec(n) for n in aux_nodes],
        model_name=name or type(model).__name__,
        meta={"blocks": blocks_path, "param_dtype": dtype_name(first.dtype), **state_dict_names(model, const_values)},
        constant_values=const_values,
    )


def _depends_on_param(node: fx.Node, ph_source: dict[fx.Node, Source]) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in ph_source and ph_source[n].kind == "param":
            return True
        todo.extend(n.all_input_nodes)
    return False
