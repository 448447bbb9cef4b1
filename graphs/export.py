"""Steps 1-2 of tracing: export the model with its loss to one ATen graph, and flatten that graph.

`export_model` runs ``torch.export`` (non-strict) on `LossModel` at a fixed micro-batch shape,
turning failures into one TraceError that names the module whose forward was running, the
user's source line and what to change. `flatten_graph` then inlines the regions export keeps
as higher-order ops with a subgraph because they run under another grad mode (a rotary
embedding's ``@torch.no_grad()`` forward, as in Hugging Face's Llama, Mistral, Qwen2, Gemma and
Phi), and drops export's metadata assertions, so every later step sees plain ATen calls.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export.graph_signature import InputKind

from mtc.errors import TraceError

__all__ = ["LossModel", "export_model", "flatten_graph"]

aten = torch.ops.aten


class LossModel(nn.Module):
    """``forward(ids, targets) -> mean cross-entropy`` around a model returning logits.

    Accepts a model whose forward returns logits, a tuple whose first item is logits, or an
    object with a ``.logits`` attribute (Hugging Face style). The loss is computed in fp32.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.model(ids)
        logits = getattr(out, "logits", out)
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@contextlib.contextmanager
def _module_tracker(model: nn.Module) -> Iterator[list[str]]:
    """Keep the stack of modules whose forward is running, to name the culprit of a trace error."""
    stack: list[str] = []
    handles = []

    def pop(_m: nn.Module, _a: Any, _o: Any) -> None:  # must return None: a value replaces the output
        if stack:
            stack.pop()

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, _n=name: stack.append(_n)))
        handles.append(mod.register_forward_hook(pop))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face models build a KV cache in forward unless told not to; training never uses one,
    and the cache object would be an extra output threaded through every block."""
    cfg = getattr(model, "config", None)
    old = getattr(cfg, "use_cache", None)
    if old:
        cfg.use_cache = False
    try:
        yield
    finally:
        if old:
            cfg.use_cache = old


def export_model(wrapped: LossModel, ids: torch.Tensor, targets: torch.Tensor) -> torch.export.ExportedProgram:
    """``torch.export`` of the model and its loss; TraceError naming the module on failure."""
    with _module_tracker(wrapped.model) as stack, _no_kv_cache(wrapped.model):
        # torch.export logs the partial graph at WARNING level on failure; the error we raise
        # carries what a user needs, so keep the log quiet.
        log = logging.getLogger("torch")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            return torch.export.export(wrapped, (ids, targets), strict=False)
        except Exception as e:  # torch raises many types here; we re-raise one with context
            culprit = stack[-1] if stack else ""
            mod = wrapped.model.get_submodule(culprit) if culprit else wrapped.model
            where = _user_frame(str(e))
            detail = str(e).strip().splitlines()[0][:300]
            hint = (
                "replace Python control flow on tensor values with tensor ops (torch.where, masking) "
                "or torch.cond, and keep shapes static"
                if "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__
                else "make its forward traceable by torch.export (no data-dependent Python, no I/O, no .item())"
            )
            raise TraceError(
                f"cannot trace module {culprit or '<root>'!r} ({type(mod).__name__}){where}: {detail}. "
                f"To fix: {hint}."
            ) from e
        finally:
            log.setLevel(level)


def _user_frame(msg: str) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)', msg)
    frames = [f for f in frames if "site-packages/torch" not in f[0]]
    if not frames:
        return ""
    path, line, _fn, code = frames[-1]
    return f" at {path}:{line} (`{code.strip()}`)"


def flatten_graph(ep: torch.export.ExportedProgram) -> fx.Graph:
    """Inline grad-mode regions and drop metadata assertions in ``ep``'s graph (in place); return it.

    A region that ran with grad disabled yields values no gradient flows through: where such a
    value depends on a parameter it is detached, so training keeps the model's semantics; values
    computed from buffers and the batch alone (RoPE tables) need nothing.
    """
    graph = ep.graph
    params = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    _inline_grad_regions(graph, ep.graph_module, params)
    for node in list(graph.nodes):
        # metadata asserts (dtype checks export inserts) have no users and no effect on values
        if node.op == "call_function" and "_assert" in str(node.target) and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    return graph


def _inline_grad_regions(graph: fx.Graph, owner: nn.Module, params: set[str]) -> None:
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        enabled, sub_attr, *operands = node.args
        sub = getattr(owner, sub_attr.target)
        _inline_grad_regions(sub.graph, sub, params)  # nested regions first
        env: dict[fx.Node, Any] = {}
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        env.update(zip(phs, operands, strict=True))
        result: Any = None
        with graph.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    result = fx.map_arg(n.args[0], env.__getitem__)
                    continue
                if n.op != "call_function":
                    raise TraceError(f"cannot inline a {n.op} node ({n.target}) of a no_grad region; use plain tensor ops there")
                env[n] = graph.node_copy(n, env.__getitem__)
        if not enabled:
            result = fx.map_arg(result, lambda r, at=node: _detached(graph, r, at, params))
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        for user in list(node.users):
            if user.op == "call_function" and user.target.__name__ == "getitem":
                user.replace_all_uses_with(outs[user.args[1]])
                graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(result)
        graph.erase_node(node)
        if not sub_attr.users:
            graph.erase_node(sub_attr)


def _detached(graph: fx.Graph, value: fx.Node, before: fx.Node, params: set[str]) -> fx.Node:
    """``value`` detached if it depends on a parameter placeholder (else unchanged)."""
    todo, seen = [value], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in params:
            with graph.inserting_before(before):
                d = graph.call_function(aten.detach.default, (value,))
            d.meta = dict(value.meta)
            return d
        todo.extend(n.all_input_nodes)
    return value
