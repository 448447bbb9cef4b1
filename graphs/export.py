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
import io
import logging
import os
import re
import sys
import sysconfig
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export.graph_signature import InputKind

from mtc.errors import TraceError

__all__ = ["LossModel", "export_model", "flatten_graph"]

aten = torch.ops.aten
_log = logging.getLogger(__name__)


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
        if isinstance(logits, dict) and "logits" in logits:
            logits = logits["logits"]
        if isinstance(logits, (tuple, list)) and logits:
            aux = [i for i, t in enumerate(logits[1:], 1)
                   if isinstance(t, torch.Tensor) and t.ndim == 0 and t.is_floating_point() and t.requires_grad]
            if aux:  # an auxiliary loss (a mixture of experts' balancing loss) would silently not be trained
                warnings.warn(f"{type(self.model).__name__}.forward returns a scalar that depends on the parameters at "
                              f"position {', '.join(map(str, aux))} of its output (an auxiliary loss?): mtc trains the "
                              "cross-entropy of the logits (position 0) only, and ignores it; add it to what the model "
                              "computes if it must be trained", stacklevel=2)
            logits = logits[0]
        if not isinstance(logits, torch.Tensor):
            keys = f" with keys {', '.join(map(repr, logits))}" if isinstance(logits, dict) else ""
            raise TraceError(
                f"{type(self.model).__name__}.forward returns a {type(out).__name__}{keys}, and mtc found no logits "
                "in it; return the logits (batch, seq, vocab), a tuple with them first, or an object or dict with "
                "'logits'")
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
        try:
            with _quiet_torch():
                return torch.export.export(wrapped, (ids, targets), strict=False)
        except TraceError:  # already says what is wrong (LossModel's own checks)
            raise
        except Exception as e:  # torch raises many types here; we re-raise one with context
            culprit = stack[-1] if stack else ""
            mod = wrapped.model.get_submodule(culprit) if culprit else wrapped.model
            detail = str(e).strip().splitlines()[0][:300]
            raise TraceError(
                f"cannot trace module {culprit or '<root>'!r} ({type(mod).__name__}){_user_frame(e)}: {detail}. "
                f"To fix: {_hint(e, tuple(ids.shape))}."
            ) from e


# Above CRITICAL: torch logs a failed meta kernel with log.exception (ERROR), so a level of ERROR
# would still let its traceback through.
_SILENT = logging.CRITICAL + 1


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """Keep torch's own reports of a failed export off the terminal; mtc's TraceError says it once.

    On failure torch logs the failing meta kernel's traceback (``torch._subclasses.fake_tensor``, at
    ERROR) and prints the partial FX graph to stderr from each of two nested export wrappers. Every
    ``torch.*`` logger that torch configured has its own handler and does not propagate, so each one
    with a level of its own is raised above CRITICAL, and the ``torch`` parent for those that
    inherit; the levels are restored afterwards. stderr is captured meanwhile: after a successful
    export it is written out unchanged (a user's own warnings are not lost); after a failure it goes
    to this module's debug log, since the TraceError chains torch's exception. With ``TORCH_LOGS``
    set the user asked torch to talk, so nothing is silenced.
    """
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    with _QUIET:  # one at a time: an overlapping pair would restore each other's levels and stderr wrongly
        yield from _quiet_torch_locked()


_QUIET = threading.RLock()  # (re-entrant: a trace inside a trace nests its levels properly)


def _quiet_torch_locked() -> Iterator[None]:
    """`_quiet_torch`'s work, under its lock."""
    loggers = [logging.getLogger("torch")] + [
        lg for name, lg in list(logging.root.manager.loggerDict.items())
        # torch.__trace is TORCH_TRACE's structured log, written to a file only when asked for
        if name.startswith("torch.") and name != "torch.__trace" and isinstance(lg, logging.Logger) and lg.level
    ]
    levels = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(_SILENT)
    # sys.stderr is process-wide: another thread's writes in this window are held back too
    # (and written out after a successful export)
    err = io.StringIO()
    ok = False
    try:
        with contextlib.redirect_stderr(err):
            yield
        ok = True
    finally:
        for lg, level in levels:
            lg.setLevel(level)
        if ok and sys.stderr is not None:
            sys.stderr.write(err.getvalue())
        elif err.getvalue():
            _log.debug("torch.export's output before it failed:\n%s", err.getvalue())


# Messages of torch's shape checks (under export they run on fake tensors, in the refs and meta
# kernels): a broadcast, a matmul, a view/reshape, a cat, a narrow or slice past a table's end.
_SHAPE_ERRORS = re.compile(
    r"Attempting to broadcast a dimension|must match the size of tensor|shapes cannot be multiplied"
    r"|is invalid for input of size|Sizes of tensors must match|exceeds dimension size|out of bounds for dimension"
    r"|size mismatch"
)


def _hint(e: BaseException, shape: tuple[int, ...]) -> str:
    """What to change, by the kind of failure: data-dependent Python, shapes that do not fit, other."""
    chain = _chain(e)
    text = "\n".join(str(x) for x in chain)
    kinds = " ".join(type(x).__name__ for x in chain)
    if "data-dependent" in text or "DataDependent" in kinds:
        return ("replace Python control flow on tensor values with tensor ops (torch.where, masking) "
                "or torch.cond, and keep shapes static")
    if _SHAPE_ERRORS.search(text):
        dims = " x ".join(map(str, shape))
        return (f"the model's tensor shapes do not fit at micro-batch shape {dims} (micro-batch size x seq_len); "
                "check both against the model's limits (the rows of a position table, a max_seq_len or block_size "
                "in its config) and use a seq_len / micro-batch size it supports")
    return ("make its forward traceable by torch.export (no I/O, no Python that depends on tensor values); "
            "torch.export.export(model, (ids,), strict=False) on a batch of this shape shows torch's full report")


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or while handling (torch wraps some)."""
    out: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in out:
        out.append(x)
        x = x.__cause__ or x.__context__
    return out


_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]


def _user_frame(e: BaseException) -> str:
    """`` at file:line (`code`)`` of the user's line that failed, or "" when it cannot be told.

    torch puts the user's stack in the message of some errors (data-dependent guards); for the
    others (a meta kernel's shape check) the traceback still runs through the user's forward.
    """
    msg = str(e)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)', msg)
    frames = [f for f in frames if "site-packages/torch" not in f[0]]
    if frames:
        path, line, _fn, code = frames[-1]
        return f" at {path}:{line} (`{code.strip()}`)"
    tb = [f for f in traceback.extract_tb(e.__traceback__)
          if not f.filename.startswith((_TORCH_DIR, _STDLIB_DIR)) and f.filename != __file__ and f.line]
    if not tb:
        return ""
    return f" at {tb[-1].filename}:{tb[-1].lineno} (`{tb[-1].line.strip()}`)"


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
