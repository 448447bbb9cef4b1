"""CUDA-graph replay of compiled layer templates: one launch per layer call, not one per node.

A compiled template's forward and joint graphs run as FX GraphModules: every node is a Python
call that launches a kernel, and between launches the GPU idles (~2 ms of a 22 ms Llama layer on
the H100). `GraphRunner` wraps a template's runner and replays each graph as a CUDA graph instead:

- **Inputs.** Weights and constants that live in buffers the executor keeps for its whole life
  (its weight-ring slots, resident compute copies, constants: `bind_stable`) are read in place:
  a captured graph is keyed by their addresses, so each ring slot and each resident (`gpu`-tier)
  layer of the template gets its own graph, and no call copies weights. Everything else
  (activations, aux inputs, the batch, incoming gradients) is copied before each replay, on the
  compute stream, into fixed input buffers that all graphs of one callable share (replays are
  sequential on that stream, and each fills them right before it runs).
- **Outputs.** A replay overwrites the same output buffers, and all graphs share one memory pool
  (a later capture may place its buffers where an earlier graph keeps temporaries). So every
  output that outlives the next replay is cloned right after it: forward outputs, the joint's
  recomputed outputs and the gradients of activations (kept until the next layer's backward).
  Parameter gradients are returned as the graph's own buffers: the executor adds them into the
  layer's fp32 gradient slab before it issues anything else on the compute stream. No graph
  writes a slab, so a slab's device-to-host copy stays ordered by the executor's slab ring (the
  slab is not written again before that copy has finished), and gradients accumulate across
  micro-batches exactly as in eager execution.
- **One pool, any order.** torch documents a shared pool as safe for graphs "always replayed in
  the same order they were captured, and never concurrently" (CUDA semantics notes, "Sharing
  memory across captures"). Replays here run in layer order (forward ascending, backward
  descending, ring slots alternating between steps), not in capture order, and are still safe:
  they never run concurrently (one compute stream), and nothing a replay leaves in the pool is
  read after the next replay begins (the rule above), so a later capture that took an earlier
  graph's temporaries for its own buffers only ever overwrites values already consumed. The
  copied-in buffers are allocated outside the pool.
- **Memory.** Temporaries share the pool; each graph keeps its outputs, for a block one set of
  parameter gradients (compute dtype) and a few activations, per weight address: the ring's
  slots plus every resident layer of the template. `template_graph_buffers` and
  `graph_memory_bytes` count these fixed buffers exactly, for the planner; a run reports what
  its captures allocated.
- **Capture.** The first call of a key warms the graph up on a side stream (cuBLAS/cuDNN handles,
  Triton JIT compilation and kernel tuning happen here, never under capture), then captures on
  that same stream in ``thread_local`` mode (the fetch and optimizer threads keep issuing copies
  meanwhile). Capturing synchronises the device once per key, during the first step or two;
  replays never synchronise the host.
- **Measured, not assumed.** A runner whose backend compares (`CudaGraphCapture(compare=True)`,
  what `mtc train` uses) times the first captured graph of each callable against the eager call
  (the warm-up's eager calls against replays right after capture, each with its copies into the
  fixed input buffers: a backward from saved activations copies hundreds of MB of them); when
  replay is the slower by more than `REPLAY_MARGIN` (the H200 ran a Llama-8B block's replayed joint graph at 23.1 ms against 21.9
  eager, while GPT-2's replay was 1.3x faster than eager), that callable runs eagerly from then on,
  and the report says so with both times.
- **Fallback.** A graph that calls an op known to synchronise the host (``nonzero``, ``.item()``,
  boolean-mask indexing, ...) is never captured; a capture that fails anyway (an op that syncs,
  allocates host memory or reads a CPU tensor) runs that graph eagerly for the rest of the run.
  Either way the reason is logged once and kept in `report_lines`. Calls whose argument shapes
  differ from the captured ones (a plan is static, so only foreign callers), or whose weights are
  not in the executor's buffers (an evaluation's), run eagerly too. A runner given a cap on
  graphs per callable (``max_graphs``; none by default) runs the addresses beyond it through one
  graph that copies its weights in at every call (and keeps a copy of them): logged once, and
  counted in the report line. A runner that no executor bound (`bind_stable`) has no buffers to
  read in place: its one graph copies the weights in too.

The capture itself is a small `Capture` backend: `CudaGraphCapture` on CUDA; `EmulatedCapture`
reproduces a graph's buffer semantics on the CPU (fixed input buffers read at replay, fixed
output buffers overwritten at each replay) so the CPU tests exercise every rule above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import fx

from mtc.graphs.program import Template, joint_keeps_outputs
from mtc.runtime.runners import LayerRunner

__all__ = [
    "MIN_LAUNCHES_SAVED", "REPLAY_MARGIN", "SYNCING_OPS", "Capture", "CudaGraphCapture", "EmulatedCapture", "GraphBuffers", "GraphRunner", "ReplayStats",
    "capture_blocker", "graph_memory_bytes", "graph_report", "launches_per_replay", "mixed_saves_bytes", "replay_graphs",
    "resident_graph_bytes",
    "template_graph_buffers",
]

# ATen ops that make the host wait for the device (a data-dependent output size or a value read
# back): CUDA graphs cannot capture them
SYNCING_OPS = frozenset({
    "aten.nonzero", "aten._local_scalar_dense", "aten.item", "aten.masked_select", "aten.unique", "aten._unique",
    "aten._unique2", "aten.unique_consecutive", "aten.unique_dim", "aten.is_nonzero", "aten.equal", "aten.allclose",
    "aten.masked_scatter", "aten.bincount", "aten.histc", "aten.argwhere",
})


# Replay holds a graph's outputs (a layer's parameter gradients among them: 1 GiB for a Llama 3
# embedding table) for the whole run, where eager execution frees them after each call; a graph
# is replayed only when that saves at least this many launches per call (a block's joint: ~35 -> 6; an
# embed stage or a head: at most one or two, or none)
MIN_LAUNCHES_SAVED = 3


# replay must not be slower than eager by more than this fraction (timing noise of a few calls)
REPLAY_MARGIN = 0.02


def capture_blocker(graph: fx.Graph) -> str | None:
    """Why ``graph`` cannot be captured as a CUDA graph (the first op that syncs the host), or None."""
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = ".".join(str(n.target).split(".")[:2])
        if name in SYNCING_OPS:
            return f"{n.name} calls {name}, which synchronises the host"
        if name == "aten.repeat_interleave" and n.kwargs.get("output_size") is None and str(n.target).endswith(".Tensor"):
            return f"{n.name} calls aten.repeat_interleave without output_size, which synchronises the host"
        if name == "aten.index" and len(n.args) > 1:
            for idx in n.args[1] or ():
                val = idx.meta.get("val") if isinstance(idx, fx.Node) else None
                if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
                    return f"{n.name} indexes with a boolean mask, which synchronises the host"
    return None


class Capture(Protocol):
    """Records ``fn(*args)`` once and replays it on the same buffers."""

    def capture(self, fn: Callable[..., Any], args: Sequence[torch.Tensor],
                copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[Callable[[], None], Any, dict[str, float]]:
        """(replay, outputs, figures): ``replay()`` recomputes ``fn`` from the current contents of
        ``args`` into ``outputs``; figures: ``warmup_s``, ``capture_s``, ``pool_bytes``, and from a
        backend that compares, ``eager_ms`` and ``replay_ms`` (median time of one call each way;
        a replayed call includes ``copies``, the (fixed buffer, argument) copies made before it)."""


def _median(xs: Sequence[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def release_generator_after_failed_capture(index: int) -> None:
    """Take device ``index``'s default CUDA generator out of capture mode after a capture that failed.

    torch.cuda.graph registers that generator when a capture begins (its state enters capture
    mode) and releases it only when capture_end succeeds. An invalidated capture's capture_end
    raises first, so the state stays in capture mode and every later random op of the process
    (the attention tuner's random inputs, dropout) fails with "Offset increment outside graph
    capture encountered unexpectedly" (seen on the H200, 2026-11-27: two gpu tests that ran in the
    same worker after the failed-capture test). The generator gets a fresh state with the same seed
    and offset, so the random stream goes on where it was. (Graphs captured before keep the old
    state: one that draws random numbers could not replay; mtc's graphs draw none.)"""
    gen = torch.cuda.default_generators[index]
    fresh = torch.Generator(device=gen.device)
    fresh.set_state(gen.get_state())
    gen.graphsafe_set_state(fresh.graphsafe_get_state())


class CudaGraphCapture:
    """torch.cuda.CUDAGraph capture on one side stream, every graph in one shared memory pool;
    ``compare``: also time the replay against the eager call (the warm-up's eager calls after the
    first, at least two, against ``reps`` replays)."""

    def __init__(self, device: torch.device, *, warmup: int = 2, compare: bool = False, reps: int = 3) -> None:
        self.device, self.warmup, self.compare, self.reps = torch.device(device), warmup, compare, reps
        self.stream = torch.cuda.Stream(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.failed_captures = 0  # each one moves later captures to a fresh pool (see capture)

    def capture(self, fn: Callable[..., Any], args: Sequence[torch.Tensor],
                copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[Callable[[], None], Any, dict[str, float]]:
        """Warm up ``fn`` on the side stream, then capture it there (see the module docstring)."""
        cur = torch.cuda.current_stream(self.device)
        t0 = time.perf_counter()
        self.stream.wait_stream(cur)  # the static inputs were filled on the compute stream
        timed: list[tuple[Any, Any]] = []  # comparing: the eager warm-up calls after the first, timed
        try:
            with torch.cuda.stream(self.stream):
                for i in range(max(self.warmup, 3) if self.compare else self.warmup):
                    # JIT compilation, kernel tuning, library handles: not under capture
                    ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.compare and i else None
                    if ev:
                        ev[0].record(self.stream)
                    fn(*args)
                    if ev:
                        ev[1].record(self.stream)
                        timed.append(ev)
        finally:  # a failed warm-up's queued kernels still read the weight slot: order them before its reuse
            cur.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        eager_ms = [a.elapsed_time(b) for a, b in timed]
        t1 = time.perf_counter()
        torch.cuda.empty_cache()  # so the reserved-bytes difference is what the capture added to the pool
        before = torch.cuda.memory_reserved(self.device)
        g = torch.cuda.CUDAGraph()
        try:
            # the outer context puts the caller's stream back even when the capture fails: torch.cuda.graph
            # leaves its own stream context only after capture_end returns, and capture_end raises for an
            # invalidated capture, which would leave every later kernel of this thread on the side stream,
            # outside the copy engine's event ordering of the compute stream
            with torch.cuda.stream(self.stream), torch.cuda.graph(g, pool=self.pool, stream=self.stream,
                                                                  capture_error_mode="thread_local"):
                out = fn(*args)
        except BaseException:
            # leave the device usable for the eager fallback; a second error from the sync would only
            # hide the capture's own, which is what the fallback reports
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize(self.device)
            # capture_end raised before it ended the allocator's recording into the pool (and the
            # generator's capture mode): left so, every later capture into this pool would fail
            # ("already recording to mempool_id") and the allocator would stop reclaiming memory
            # freed across streams. Either cleanup failing must not replace the capture's own error.
            idx = self.stream.device_index
            with contextlib.suppress(Exception):
                torch._C._cuda_endAllocateToPool(idx, self.pool)
            with contextlib.suppress(Exception):
                release_generator_after_failed_capture(idx)
            # torch 2.11's capture_begin also has the pinned host allocator record into the pool, and
            # torch offers no call that ends that: a later capture into the same pool raised "already
            # recording to mempool_id" (H200, 2026-11-27, after the device allocator's end above). So
            # later captures share a fresh pool; the old entry's filter names the dead capture only,
            # so nothing more is routed into it. Graphs captured before keep theirs.
            self.pool = torch.cuda.graph_pool_handle()
            self.failed_captures += 1
            raise
        t2 = time.perf_counter()
        figures = {"warmup_s": t1 - t0, "capture_s": t2 - t1,
                   "pool_bytes": float(max(0, torch.cuda.memory_reserved(self.device) - before))}
        if self.compare:
            figures.update(eager_ms=_median(eager_ms), replay_ms=self._time_replay(g, cur, copies))
        return g.replay, out, figures

    def _time_replay(self, g: Any, stream: Any, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Median ms of one replayed call on ``stream``: its copies into the fixed input buffers (a
        block's saved activations are hundreds of MB), then the replay. (The eager side was timed
        in the warm-up: timing it after the capture would hold the graph's pool and an eager
        call's temporaries at once.)"""
        times = []
        with torch.cuda.stream(stream):
            for _ in range(self.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                for dst, src in copies:
                    dst.copy_(src)
                g.replay()
                b.record(stream)
                b.synchronize()
                times.append(a.elapsed_time(b))
        return _median(times)


class EmulatedCapture:
    """A CUDA graph's buffer semantics without CUDA, for the CPU tests: replay recomputes from the
    fixed input buffers captured with and overwrites the fixed output buffers in place, so a caller
    that keeps a replay's outputs past the next replay sees them change, as on the GPU.
    ``times``: (eager_ms, replay_ms) to report as a comparing backend would (None: no comparison)."""

    def __init__(self, times: tuple[float, float] | None = None) -> None:
        self.times = times

    def capture(self, fn: Callable[..., Any], args: Sequence[torch.Tensor],
                copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[Callable[[], None], Any, dict[str, float]]:
        """Run ``fn`` once; its outputs become the fixed output buffers (``copies``: unused here)."""
        t0 = time.perf_counter()
        out = fn(*args)
        static = list(out) if isinstance(out, (tuple, list)) else [out]

        def replay() -> None:
            new = fn(*args)
            for buf, val in zip(static, list(new) if isinstance(new, (tuple, list)) else [new], strict=True):
                if isinstance(buf, torch.Tensor):
                    buf.copy_(val)

        nbytes = sum(t.numel() * t.element_size() for t in static if isinstance(t, torch.Tensor))
        figures = {"warmup_s": 0.0, "capture_s": time.perf_counter() - t0, "pool_bytes": float(nbytes)}
        if self.times is not None:
            figures.update(eager_ms=self.times[0], replay_ms=self.times[1])
        return replay, out, figures


@dataclasses.dataclass(slots=True)
class ReplayStats:
    """What one graph (forward or joint) of a template did in this run."""

    captured: int = 0  # graphs captured (keys: one per weight address set, plus a copy-in graph)
    copy_in: int = 0  # of which copy their weights in at every call (0 or 1: beyond max_graphs, or no executor bound)
    replays: int = 0
    copy_in_replays: int = 0  # of which through the copy-in graph
    eager_calls: int = 0  # calls run as the plain GraphModule (fallback, skipped, foreign weights or shapes)
    warmup_s: float = 0.0
    capture_s: float = 0.0
    pool_bytes: int = 0  # GPU memory the captures added to the shared pool (reserved bytes)
    static_bytes: int = 0  # the fixed input buffers (shared by the callable's graphs)
    kept_bytes: int = 0  # the fixed output buffers the graphs keep (in the pool; parameter gradients included)
    launches_per_call: int = 0  # input copies + 1 graph launch + output clones, of a graph reading weights in place
    copy_in_launches_per_call: int = 0  # the same, of the copy-in graph
    fallback: str | None = None  # why this graph cannot be replayed, when it cannot
    skipped: str | None = None  # why replaying it would not pay (it runs eagerly by choice)
    eager_ms: float | None = None  # the first capture's comparison, when the backend compares
    replay_ms: float | None = None


@dataclasses.dataclass(slots=True)
class _Entry:
    replay: Callable[[], None]
    static_in: list[torch.Tensor | None]  # the fixed buffer of each copied input; None: read in place
    keep_alive: tuple[torch.Tensor, ...]  # the bound inputs: their memory must not be reused while the graph lives
    outputs: list[Any]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Replayer:
    """The callable the executor gets for one (template, forward|joint, device)."""

    def __init__(self, owner: GraphRunner, which: str, fn: Callable[..., Any], alias: frozenset[int], stats: ReplayStats) -> None:
        self.owner, self.which, self.fn, self.alias, self.stats = owner, which, fn, alias, stats
        # key: per argument, (address, strides) of a weight read in place, else None (copied in)
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self.shapes: tuple[Any, ...] | None = None  # the argument signature every graph was captured for
        self.buffers: dict[int, torch.Tensor] = {}  # argument index -> its fixed input buffer, shared by all graphs

    def __call__(self, *args: Any) -> Any:
        st = self.stats
        if st.fallback is not None or st.skipped is not None or not all(isinstance(a, torch.Tensor) for a in args):
            st.eager_calls += 1
            return self.fn(*args)
        bound = self.owner._bindable(self.which, args)
        if not bound and self.owner._stable is not None and self.owner._weights:
            # weights from outside the executor's buffers (an evaluation's): a graph for them would
            # hold a copy of the layer's weights all run long, for a call made now and then
            st.eager_calls += 1
            return self.fn(*args)
        shapes = tuple((a.shape, a.dtype, a.device) for a in args)
        if self.shapes is not None and shapes != self.shapes:
            st.eager_calls += 1  # a plan's shapes are static: only a foreign caller gets here
            return self.fn(*args)
        key = tuple((args[k].data_ptr(), args[k].stride()) if k in bound else None for k in range(len(args)))
        e = self.entries.get(key)
        cap = self.owner.max_graphs
        if e is None and bound and cap is not None and sum(1 for k in self.entries if any(k)) >= cap:
            if not any(not any(k) for k in self.entries) and self.owner.log is not None:
                self.owner.log(f"cuda graphs: template {self.owner.template.id} {self.which}: more than {cap} weight addresses; "
                               "the others replay one graph that copies the weights in at every call")
            bound, key = frozenset(), (None,) * len(args)  # one graph that copies all
            e = self.entries.get(key)
        if e is None:
            e = self._capture(key, args, bound)
            if e is None:
                st.eager_calls += 1
                return self.fn(*args)
            self.shapes = shapes
        for buf, a in zip(e.static_in, args, strict=True):
            if buf is not None and buf.data_ptr() != a.data_ptr():
                buf.copy_(a)
        e.replay()
        st.replays += 1
        if not any(key) and self.owner._weights:
            st.copy_in_replays += 1
        return tuple(o if (j in self.alias or not isinstance(o, torch.Tensor)) else o.clone() for j, o in enumerate(e.outputs))

    def _buffer(self, k: int, a: torch.Tensor) -> torch.Tensor:
        """Argument ``k``'s fixed input buffer, made on first use (graphs of one callable share it)."""
        buf = self.buffers.get(k)
        if buf is None:
            buf = self.buffers[k] = torch.empty_like(a)
            self.stats.static_bytes += _nbytes(buf)
        return buf.copy_(a)

    def _capture(self, key: tuple[Any, ...], args: Sequence[torch.Tensor], bound: frozenset[int]) -> _Entry | None:
        st = self.stats
        static_in = [None if k in bound else self._buffer(k, a) for k, a in enumerate(args)]
        call_args = [a if s is None else s for a, s in zip(args, static_in, strict=True)]
        try:
            copies = [(s, a) for a, s in zip(args, static_in, strict=True) if s is not None and s.data_ptr() != a.data_ptr()]
            replay, out, fig = self.owner.backend.capture(self.fn, call_args, copies)
        except Exception as e:  # noqa: BLE001  (whatever breaks capture: run this graph eagerly from now on)
            self.owner._fall_back(self.which, f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            return None
        if "replay_ms" in fig and st.replay_ms is None:
            st.eager_ms, st.replay_ms = fig["eager_ms"], fig["replay_ms"]
            if st.replay_ms > st.eager_ms * (1 + REPLAY_MARGIN):
                st.skipped = f"replay measured slower than eager: {st.replay_ms:.2f} vs {st.eager_ms:.2f} ms per call"
                if self.owner.log is not None:
                    self.owner.log(f"cuda graphs: template {self.owner.template.id} {self.which} runs eagerly ({st.skipped})")
                self.buffers.clear()  # nothing replays: the input buffers go too
                st.static_bytes = 0
                return None
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        e = _Entry(replay, static_in, tuple(args[k] for k in bound), outputs)
        self.entries[key] = e
        st.captured += 1
        st.warmup_s += fig["warmup_s"]
        st.capture_s += fig["capture_s"]
        st.pool_bytes += int(fig["pool_bytes"])
        st.kept_bytes += sum(_nbytes(o) for o in outputs if isinstance(o, torch.Tensor))
        copies = sum(1 for s in static_in if s is not None)
        clones = sum(1 for j, o in enumerate(outputs) if isinstance(o, torch.Tensor) and j not in self.alias)
        if not any(key) and self.owner._weights:  # weights copied in too
            st.copy_in += 1
            st.copy_in_launches_per_call = copies + 1 + clones
        else:
            st.launches_per_call = copies + 1 + clones
        return e


class GraphRunner:
    """A `LayerRunner` whose forward and joint callables replay CUDA graphs (see the module docstring).

    ``inner``: the runner whose callables are captured (a `CompiledRunner`); ``template``: its
    template (which inputs are weights, which outputs are parameter gradients); ``graphs``: the
    FX graphs behind ``inner``'s callables by name ('forward', 'joint'), checked for ops that
    cannot be captured; ``eager_launches``: their kernel launches per eager call (the compile
    report's count): a graph whose replay would save fewer than `MIN_LAUNCHES_SAVED` runs eagerly
    (a head: the fused linear + cross-entropy is already a few launches, and replay adds copies);
    ``backend``: how to capture; ``max_graphs``: at most this many graphs per callable read their
    weights in place (None, the default: one per weight address set the executor calls it with,
    i.e. per ring slot and per resident layer), the addresses beyond share one graph that copies
    its weights in; ``log``: receives one line per fallback.
    """

    def __init__(self, inner: LayerRunner, template: Template, backend: Capture, *,
                 graphs: dict[str, fx.Graph] | None = None, eager_launches: dict[str, int] | None = None,
                 max_graphs: int | None = None, log: Callable[[str], None] | None = None) -> None:
        self.inner, self.template, self.backend = inner, template, backend
        self.diff, self.n_out = list(inner.diff), inner.n_out
        self.max_graphs, self.log = max_graphs, log
        self.saves = bool(getattr(inner, "saves", False))
        self.stats = {w: ReplayStats() for w in (("forward", "joint", "save", "backward") if self.saves else ("forward", "joint"))}
        if self.saves:
            # a replayed graph keeps its outputs (per weight address: every resident layer), and
            # each replay's would be cloned: the saved values, the largest outputs a block has
            self.stats["save"].skipped = "its saved values would be held by the graph and cloned at every call"
        self._stable: Callable[[torch.Tensor], bool] | None = None
        self._replayers: dict[tuple[str, str], _Replayer] = {}
        # weights and constants may be read in place; activations, aux and batch inputs never
        self._weights = frozenset(k for k, i in enumerate(template.inputs) if i.kind in ("param", "const"))
        for which, g in (graphs or {}).items():
            if which not in self.stats:
                continue
            why = capture_blocker(g)
            if why is not None:
                self._fall_back(which, why)
            eager = (eager_launches or {}).get(which)
            per_call = launches_per_replay(g, template, which, self.diff, self.n_out)
            if eager is not None and eager - per_call < MIN_LAUNCHES_SAVED:
                self.stats[which].skipped = f"replay would launch {per_call} kernels per call, eager {eager}"

    def bind_stable(self, stable: Callable[[torch.Tensor], bool]) -> None:
        """``stable(t)``: whether ``t`` lives in a buffer that keeps its address for the caller's
        life (the executor's ring slots, resident copies, constants): graphs may read it in place."""
        self._stable = stable

    def forward(self, device: torch.device) -> Callable[..., Any]:
        """The forward, replayed."""
        return self._replayer("forward", device)

    def joint(self, device: torch.device) -> Callable[..., Any]:
        """Recompute + backward, replayed; parameter gradients are returned as graph buffers."""
        return self._replayer("joint", device)

    def save(self, device: torch.device) -> Callable[..., Any]:
        """The forward that saves (run eagerly: see ``stats['save'].skipped``)."""
        return self._replayer("save", device)

    def backward(self, device: torch.device) -> Callable[..., Any]:
        """The backward from saved values, replayed as the joint is."""
        return self._replayer("backward", device)

    def _replayer(self, which: str, device: torch.device) -> _Replayer:
        key = (which, str(device))
        r = self._replayers.get(key)
        if r is None:
            fn = getattr(self.inner, which)(device)
            # joint outputs: n_out recomputed outputs, then one gradient per diff input
            alias = frozenset(self.n_out + j for j, k in enumerate(self.diff)
                              if self.template.inputs[k].kind == "param") if which in ("joint", "backward") else frozenset()
            r = self._replayers[key] = _Replayer(self, which, fn, alias, self.stats[which])
        return r

    def _bindable(self, which: str, args: Sequence[torch.Tensor]) -> frozenset[int]:
        if self._stable is None:
            return frozenset()
        return frozenset(k for k in self._weights if k < len(args) and self._stable(args[k]))

    def _fall_back(self, which: str, why: str) -> None:
        st = self.stats[which]
        if st.fallback is None:
            st.fallback = why
            if self.log is not None:
                self.log(f"cuda graphs: template {self.template.id} {which} runs without graph replay ({why})")

    def report_lines(self) -> list[str]:
        """One line per graph: replayed (how many graphs, which copy their weights in, launches per
        call, time, memory) or why not."""
        lines = []
        for which, st in self.stats.items():
            if which in ("save", "backward") and not (st.eager_calls or st.replays or st.captured):
                continue  # no layer of the template kept its activations
            head = f"{self.template.id} {which}:"
            if st.fallback is not None:
                lines.append(f"{head} eager ({st.fallback}), {st.eager_calls} calls")
            elif st.skipped is not None:
                lines.append(f"{head} not replayed ({st.skipped})")
            elif st.captured:
                in_place = st.captured - st.copy_in
                graphs = f"{st.captured} graphs ({in_place} reading weights in place"
                if st.copy_in:
                    graphs += (f", 1 copying them in: {st.copy_in_replays} of the replays, "
                               f"{st.copy_in_launches_per_call} launches per call")
                launches = f", {st.launches_per_call} launches per call" if in_place else ""
                eager = f", {st.eager_calls} eager calls (weights outside the executor's buffers, or shapes not captured)" if st.eager_calls else ""
                if st.replay_ms is not None:
                    launches += f"; measured {st.replay_ms:.2f} ms per replay vs {st.eager_ms:.2f} eager"
                lines.append(f"{head} {graphs}), {st.replays} replays{launches}; "
                             f"warm-up {st.warmup_s:.2f} s, capture {st.capture_s:.2f} s; pool {st.pool_bytes / 2**20:.0f} MiB "
                             f"(outputs kept {st.kept_bytes / 2**20:.0f} MiB), input buffers {st.static_bytes / 2**20:.0f} MiB{eager}")
        return lines


def launches_per_replay(graph: fx.Graph, template: Template, which: str, diff: Sequence[int], n_out: int) -> int:
    """Kernel launches of one replayed call of a compiled ``graph`` (a CPU-countable proxy, like
    `mtc.compiler.launches` for eager calls), with its weights read in place: one copy per other
    input, the graph launch, one clone per output that is kept past the next replay."""
    placeholders = sum(1 for n in graph.nodes if n.op == "placeholder")
    weights = sum(1 for i in template.inputs if i.kind in ("param", "const"))
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    n_outputs = sum(1 for o in out if o is not None) if isinstance(out, (tuple, list)) else 1  # (a dropped output: None)
    aliased = sum(1 for k in diff if template.inputs[k].kind == "param") if which in ("joint", "backward") else 0
    return (placeholders - weights) + 1 + (n_outputs - aliased)


@dataclasses.dataclass(frozen=True, slots=True)
class GraphBuffers:
    """The fixed buffers of one template's replayed graphs, forward and joint together, as
    `GraphRunner` allocates them (the shared pool's temporaries aside)."""

    template: str  # the template's id
    copied: int  # one set of input buffers (activations, aux, batch, incoming gradients): all the template's graphs share it
    kept: int  # the outputs one weight address set's forward and joint graphs keep (parameter gradients included)
    grads: int = 0  # of ``kept``: the gradients the joint graph returns (a backward from saved values returns them too)
    backward_copied: int = 0  # a backward graph's own input buffers: the activations and incoming gradients it copies


def mixed_saves_bytes(b: GraphBuffers, *, slots: int = 2) -> int:
    """GPU memory a template's replayed graphs add when some of its streamed layers keep their
    activations and others recompute them: each of the ``slots`` weight-ring slots then has a
    backward graph (from saved values) beside its joint graph, keeping gradients of its own, and
    the backward copies its activations and incoming gradients into buffers of its own (its saved
    inputs' buffers are counted with the saved values: `mtc.runtime.placement.choose_saves`).
    Streamed layers that all save, or all recompute, replay one of the two graphs per slot."""
    return slots * b.grads + b.backward_copied


def _spec_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def template_graph_buffers(template: Template, diff: Sequence[int], grad_outs: Sequence[int]) -> GraphBuffers:
    """What replaying ``template`` allocates, from its specs: ``diff``, the inputs the joint returns
    gradients for, and ``grad_outs``, the outputs it takes incoming gradients for (the runner's
    joint signature: `mtc.graphs.lower.diff_inputs` and `grad_outputs`). Weights and constants
    are read in place; an input the graph never reads gets no gradient buffer."""
    placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
    vals = [o.meta["val"] for o in next(n for n in template.graph.nodes if n.op == "output").args[0]]
    outs = [_spec_bytes(v.shape, v.dtype) for v in vals]
    inputs = [_spec_bytes(i.spec.shape, i.spec.torch_dtype) for i in template.inputs]
    copied = sum(b for b, i in zip(inputs, template.inputs, strict=True) if i.kind not in ("param", "const"))
    grads = sum(inputs[k] for k in diff if placeholders[k].users)
    # forward: copies the inputs, keeps the outputs; joint: copies them and the incoming
    # gradients, keeps the gradients and, where it returns them (a head), the recomputed outputs
    joint_outs = sum(outs) if joint_keeps_outputs(template) else 0
    incoming = sum(outs[j] for j in grad_outs)
    return GraphBuffers(template.id, copied=2 * copied + incoming, kept=sum(outs) + joint_outs + grads, grads=grads,
                        backward_copied=copied + incoming)


def graph_memory_bytes(layers: Sequence[GraphBuffers | None], placement: Sequence[str] | None = None, *, slots: int = 2) -> int:
    """GPU memory in the fixed buffers of replayed graphs (beyond the shared pool's temporaries,
    which hold one layer's work at a time, as eager execution needs anyway). ``layers``: per
    program layer, its template's buffers (None: not replayed). Each template keeps one set of
    copied-input buffers and, per weight address set, ``kept``: the ``slots`` weight-ring slots
    (when any of its layers streams) plus each of its layers placed on the GPU. ``placement``
    None: the part no placement changes (as if every layer streamed; `resident_graph_bytes` is
    what each layer adds when placed on the GPU), for the budget an automatic placement fills."""
    seen: dict[str, GraphBuffers] = {}
    resident: dict[str, int] = {}
    streamed: set[str] = set()
    for i, b in enumerate(layers):
        if b is None:
            continue
        seen[b.template] = b
        if placement is not None and placement[i] == "gpu":
            resident[b.template] = resident.get(b.template, 0) + 1
        else:
            streamed.add(b.template)
    return sum(b.copied + b.kept * (resident.get(t, 0) + (slots if t in streamed else 0)) for t, b in seen.items())


def resident_graph_bytes(layers: Sequence[GraphBuffers | None]) -> list[int]:
    """Per layer, the GPU memory its own graphs add when it is placed on the GPU (its weights are
    then read in place from its resident copy, through a graph of its own)."""
    return [0 if b is None else b.kept for b in layers]


def replay_graphs(runners: dict[str, LayerRunner], templates: dict[str, Template], compiled: dict[str, Any],
                  device: torch.device, *, mode: str = "auto", backend: Capture | None = None,
                  log: Callable[[str], None] | None = None) -> dict[str, LayerRunner]:
    """``runners`` with each compiled template's runner wrapped in a `GraphRunner`, where graph
    replay applies: ``mode`` 'auto' on a CUDA device (or with an explicit ``backend``); 'off' or
    another device returns ``runners`` unchanged. ``compiled``: template id -> compiled template
    (its ``forward_graph``, ``joint_graph`` and ``backward_graph`` are checked for ops that
    cannot be captured)."""
    if mode == "off" or (backend is None and torch.device(device).type != "cuda"):
        return runners
    if backend is None:
        backend = CudaGraphCapture(torch.device(device), compare=True)
    out: dict[str, LayerRunner] = {}
    for tid, r in runners.items():
        ct = compiled.get(tid)
        graphs = eager = None
        if ct is not None:
            graphs = {"forward": ct.forward_graph, "joint": ct.joint_graph}
            eager = {"forward": ct.forward_report.kernels, "joint": ct.backward_report.kernels}
            if getattr(ct, "backward_graph", None) is not None:
                graphs["backward"] = ct.backward_graph
                eager["backward"] = ct.split_reports["backward_saved"].kernels
        out[tid] = GraphRunner(r, templates[tid], backend, graphs=graphs, eager_launches=eager, log=log) if ct is not None else r
    return out


def graph_report(runners: dict[str, LayerRunner]) -> list[str]:
    """The report lines of every `GraphRunner` among ``runners`` (empty when none replays graphs)."""
    lines: list[str] = []
    for r in runners.values():
        if isinstance(r, GraphRunner):
            lines.extend(r.report_lines())
    if lines:
        stats = [st for r in runners.values() if isinstance(r, GraphRunner) for st in r.stats.values()]
        total = sum(st.pool_bytes + st.static_bytes for st in stats)
        lines.insert(0, f"cuda graphs: {sum(st.captured for st in stats)} captured in {sum(st.capture_s for st in stats):.2f} s "
                        f"(after {sum(st.warmup_s for st in stats):.2f} s of warm-up: JIT compilation and kernel tuning), "
                        f"{total / 2**20:.0f} MiB of GPU memory in graph pools and input buffers")
    return lines
