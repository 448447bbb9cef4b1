"""bench_fusion's whole-model line: one training step's compute over a preset's full layer stack.

The engine's own executor (`mtc.runtime.executor.StreamingExecutor`) runs the embed stage, every
block and the head, forward and then recompute + backward, layer-major over the step's
micro-batches, with every layer's weights resident on the device and each layer's gradient summed
in fp32 into its own buffer, as a training step does. Nothing streams and no optimizer runs (the
`gpu` tier without master, m and v: 6 bytes per parameter in bf16), so the figure is the step's
compute alone, and the variants differ only in how each template runs:

    unfused          the traced ATen templates under autograd (`mtc train --unfused`)
    mtc_fused        the compiled plan: generated kernels, flash attention, fused cross-entropy;
                     its blocks' backward visits do not recompute the block's output (the next
                     layer's saved input), so they skip the last matmul the others recompute
    mtc_fused_graph  the compiled plan replayed as CUDA graphs (CUDA only; `--cuda-graphs auto`)
    mtc_fused_saved  the compiled plan with every block keeping its matmul and attention outputs
                     from the forward to the backward visit (`--save-activations all`): its
                     backward visits run the backward from them, no recompute (eager, as mtc_fused)
    mtc_fused_saved_graph  the same replayed as `mtc train` runs it on CUDA (the backward from
                     saved values as CUDA graphs where they time faster, the saving forward eagerly)
    torch_compile    torch.compile of the same templates, run by the same executor

Shapes are bench_train's: P3 (1.5B, h 2048, 23 blocks) and P1 (4.6B, h 4096, 20 blocks), sequences
of 1024 tokens, 16 per step in micro-batches of 8. Model TFLOP/s: `model_tflops` uses mtc's own
formula (`mtc.metrics.model_flops`: 6 x matmul parameters per token plus attention, as the engine's
step records), `model_tflops_6n` the issue's and bench_train's (6 x all parameters x tokens / step
time: 0.8 % lower at P1, 2 % at P3), which reads against bench_train's goals: the engine streaming
P1 can at best run at this line's `mtc_fused` rate.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common import LLAMA, P1_SHAPE, P3_SHAPE, SMOKE_SHAPE
from mtc.compiler import compile_program
from mtc.graphs.program import Program, aux_param_dependence
from mtc.metrics import FlopCounter
from mtc.models import build
from mtc.runtime.executor import StreamingExecutor
from mtc.runtime.graph_replay import GraphRunner, replay_graphs
from mtc.runtime.runners import AutogradRunner, CompiledRunner, LayerRunner
from mtc.runtime.tiers import LayerState, StateTiers
from mtc.runtime.timeline import Timeline
from mtc.runtime.transfer import CopyEngine
from mtc.tracer import trace

__all__ = ["SHAPES", "VARIANTS", "run_model"]

SHAPES = {"1.5b": P3_SHAPE, "4.6b": P1_SHAPE, "smoke": SMOKE_SHAPE}
# in the order they run: a time limit skips the last (the comparison with torch.compile before the saved variants)
VARIANTS = ("unfused", "mtc_fused", "mtc_fused_graph", "torch_compile", "mtc_fused_saved", "mtc_fused_saved_graph")
GRAPH_VARIANTS = ("mtc_fused_graph", "mtc_fused_saved_graph")  # CUDA only
SAVING_VARIANTS = ("mtc_fused_saved", "mtc_fused_saved_graph")


class ComputeOnlyTiers(StateTiers):
    """Every layer resident on the device with just what a step's compute touches: the compute
    copy and the fp32 gradient buffer (the optimizer's master, m and v are left out)."""

    def _allocate(self, i: int, tier: str, n: int, nd: int) -> LayerState:
        compute = torch.zeros(n, dtype=self.compute_dtype, device=self.device)
        return LayerState(i, "gpu", n, nd, None, None, None, compute, torch.zeros(n, dtype=torch.float32, device=self.device))


class TorchCompileRunner(AutogradRunner):
    """The unfused runner with each template's module compiled by torch.compile (forward under
    no_grad and the recompute + backward under autograd, as the executor calls them)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._compiled: dict[str, Callable[..., Any]] = {}

    def module(self, device: torch.device) -> Callable[..., Any]:
        """torch.compile of the traced template (compiled on first call)."""
        key = str(device)
        if key not in self._compiled:
            self._compiled[key] = torch.compile(super().module(device))
        return self._compiled[key]


class _Norms:
    """The executor's gradient sink: keeps each layer's per-parameter gradient norms (device)."""

    def __init__(self) -> None:
        self.norms: dict[int, torch.Tensor] = {}

    def grad_final(self, layer: int, norms: torch.Tensor) -> None:
        """Layer ``layer``'s gradient is complete."""
        self.norms[layer] = norms


def _fill_weights(program: Program, tiers: StateTiers, seed: int) -> None:
    """Random weights in place on the device: matrices N(0, 0.02), vectors (norm scales) 1."""
    torch.manual_seed(seed)
    for s in tiers.layers:
        for p in program.layer_params(s.layer):
            view = s.compute[p.offset : p.offset + p.numel]
            if len(p.spec.shape) >= 2:
                view.normal_(0.0, 0.02)
            else:
                view.fill_(1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(ex: StreamingExecutor, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                warmup: int, reps: int) -> dict[str, Any]:
    """Warm-up then timed steps: their seconds, the first step's loss and per-layer gradient norms
    (on the CPU), and the peak device memory of the timed steps above what was allocated before."""
    sink = _Norms()
    out: dict[str, Any] = {"warmup_s": [], "times_s": [], "peak_bytes": None}
    base = 0
    for k in range(warmup + reps):
        if k == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        ex.timeline.begin_step(k)
        _sync(device)
        t0 = time.perf_counter()
        step = ex.run_step(batches, sink)
        _sync(device)
        out["warmup_s" if k < warmup else "times_s"].append(time.perf_counter() - t0)
        if k == 0:
            out["loss"] = step.loss.detach().float().cpu()
            out["norms"] = {i: n.detach().float().cpu() for i, n in sink.norms.items()}
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return out


def _runners(variant: str, program: Program, device: torch.device, cache: Path) -> tuple[dict[str, LayerRunner] | None, dict]:
    """The executor's runners for ``variant`` (None: its default, unfused) and what building them cost."""
    if variant == "unfused":
        return None, {}
    if variant == "torch_compile":
        aux = aux_param_dependence(program.template_of(0))
        runners: dict[str, LayerRunner] = {}
        for call in program.layers:
            if call.template not in runners:
                runners[call.template] = TorchCompileRunner(program.templates[call.template], call, aux)
        return runners, {}
    fresh = not any(cache.iterdir())
    t0 = time.perf_counter()
    compiled = compile_program(program, cache, log=None)  # fresh cache: compiled (and tuned); else loaded
    info = {"plan_compile_s" if fresh else "plan_load_s": time.perf_counter() - t0}
    runners = {tid: CompiledRunner(ct, program.templates[tid]) for tid, ct in compiled.items()}
    if variant in GRAPH_VARIANTS:
        runners = replay_graphs(runners, program.templates, compiled, device)
    return runners, info


def _graph_stats(runners: dict[str, LayerRunner] | None) -> dict | None:
    """Capture figures summed over the replayed templates (None when nothing is replayed)."""
    graphs = [st for r in (runners or {}).values() if isinstance(r, GraphRunner) for st in r.stats.values()]
    if not graphs:
        return None
    return {"captured": sum(st.captured for st in graphs), "warmup_s": sum(st.warmup_s for st in graphs),
            "capture_s": sum(st.capture_s for st in graphs), "pool_bytes": sum(st.pool_bytes for st in graphs),
            "input_buffer_bytes": sum(st.static_bytes for st in graphs),
            "fallbacks": [st.fallback for st in graphs if st.fallback]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _ratios(rec: dict) -> None:
    """The speed-ups between the variants measured so far, into ``rec``."""
    res = {k: x for k, x in rec["results"].items() if "median_ms" in x}
    if "unfused" in res and "mtc_fused" in res:
        rec["fused_speedup_vs_unfused"] = res["unfused"]["median_ms"] / res["mtc_fused"]["median_ms"]
    if "torch_compile" in res and "mtc_fused" in res:
        rec["fused_speedup_vs_torch_compile"] = res["torch_compile"]["median_ms"] / res["mtc_fused"]["median_ms"]
    if "mtc_fused_graph" in res and "unfused" in res:
        rec["graph_speedup_vs_unfused"] = res["unfused"]["median_ms"] / res["mtc_fused_graph"]["median_ms"]
    if "mtc_fused_graph" in res and "torch_compile" in res:
        rec["graph_speedup_vs_torch_compile"] = res["torch_compile"]["median_ms"] / res["mtc_fused_graph"]["median_ms"]
    if "mtc_fused_saved" in res and "mtc_fused" in res:  # what keeping the activations saves (both eager)
        rec["saved_speedup_vs_fused"] = res["mtc_fused"]["median_ms"] / res["mtc_fused_saved"]["median_ms"]
    if "mtc_fused_saved_graph" in res and "mtc_fused_graph" in res:  # the same, both as `mtc train` runs them on CUDA
        rec["saved_graph_speedup_vs_graph"] = res["mtc_fused_graph"]["median_ms"] / res["mtc_fused_saved_graph"]["median_ms"]
    if "mtc_fused_saved_graph" in res and "torch_compile" in res:
        rec["saved_graph_speedup_vs_torch_compile"] = res["torch_compile"]["median_ms"] / res["mtc_fused_saved_graph"]["median_ms"]


def run_model(shape: str, device: torch.device, *, seqs: int, micro_batch: int, seq_len: int, warmup: int, reps: int,
              variants: list[str], log: Callable[[str], None] = print, deadline: float | None = None,
              on_variant: Callable[[dict], None] | None = None, profile: bool = False,
              dtype: torch.dtype | None = None) -> dict:
    """One step's compute over shape ``shape``'s full stack for each variant; returns the record.
    ``deadline`` (a `time.monotonic` value): variants not started by then are recorded as skipped,
    so a device call's time limit still leaves a record of those that ran; ``on_variant`` gets the
    record so far after each variant (to write it as it grows). ``profile`` (CUDA): each variant's
    kernels over one more step (`launch_count.kernel_table`), where the time between variants goes.
    ``dtype``: the compute dtype (default bf16 on CUDA, fp32 elsewhere)."""
    if seqs % micro_batch:
        raise SystemExit(f"--model-seqs {seqs} is not a multiple of --model-micro-batch {micro_batch}")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    overrides = dict(SHAPES[shape])
    with torch.device("meta"):
        model = build("tiny" if shape == "smoke" else LLAMA, **overrides).to(dtype)
    program = trace(model, micro_batch, seq_len)  # traced in the compute dtype, as `mtc train` traces (constants too)
    del model
    tiers = ComputeOnlyTiers(program, ["gpu"] * program.n_layers, device, dtype)
    _fill_weights(program, tiers, seed=0)
    gen = torch.Generator().manual_seed(1)
    vocab = overrides["vocab_size"]
    batches = [(torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(device),
                torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(device)) for _ in range(seqs // micro_batch)]
    tokens = seqs * seq_len
    flops = FlopCounter.of(program, seq_len).flops(tokens)
    rec: dict[str, Any] = {"part": "model", "shape": shape, "model_overrides": overrides, "n_params": program.n_params(),
                           "n_blocks": program.n_layers - 2, "seq_len": seq_len, "micro_batch": micro_batch,
                           "micro_batches": len(batches), "tokens_per_step": tokens, "dtype": str(dtype),
                           "model_flops_per_step": flops,
                           "what": "one step's compute (forward, recompute + backward, fp32 gradient sums) through "
                                   "the engine's executor, all weights resident, no streaming, no optimizer",
                           "results": {}}
    if reps < 1:
        raise SystemExit("--reps must be at least 1")
    ref: dict[str, Any] | None = None
    cache = Path(tempfile.mkdtemp(prefix="mtc-bench-model-"))  # the plan: compiled once, loaded by the graph variant
    for v in variants:
        if v in GRAPH_VARIANTS and device.type != "cuda":
            continue
        if deadline is not None and time.monotonic() > deadline:
            rec["results"][v] = {"skipped": "time limit (--time-limit-s) reached before it started"}
            log(f"model/{shape:5s} {v:16s} skipped: time limit")
            continue
        try:
            runners, info = _runners(v, program, device, cache)
            timeline = Timeline(keep_steps=2)
            engine = CopyEngine(device, timeline)
            saves = [c.index for c in program.iter_blocks()] if v in SAVING_VARIANTS else ()
            try:
                ex = StreamingExecutor(program, tiers, device=device, engine=engine, timeline=timeline, runners=runners,
                                       saves=saves)
            except Exception:
                engine.close()
                raise
            try:
                got = _time_steps(ex, batches, device, warmup, reps)
                if profile and device.type == "cuda":
                    from launch_count import kernel_table

                    more = iter(range(warmup + reps, warmup + reps + 2))  # the steps kernel_table runs: warm, then profiled

                    def step(ex: StreamingExecutor = ex) -> None:  # bound now: the loop deletes `ex` after the variant
                        ex.timeline.begin_step(next(more))
                        ex.run_step(batches, _Norms())

                    got["profile"] = kernel_table(step)
                    del step  # it holds the executor (and its graphs' pool) past this variant otherwise
            finally:
                ex.close()
                engine.close()
        except Exception as e:  # noqa: BLE001  (this variant's failure is recorded; the others still run)
            rec["results"][v] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"model/{shape:5s} {v:16s} FAILED: {rec['results'][v]['error']}")
            if on_variant is not None:
                on_variant(rec)
            runners = ex = got = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        med = statistics.median(got["times_s"])
        r: dict[str, Any] = {"median_ms": med * 1e3, "model_tflops": flops / med / 1e12,
                             "model_tflops_6n": 6 * program.n_params() * tokens / med / 1e12, "tokens_per_s": tokens / med,
                             "times_s": got["times_s"], "warmup_s": got["warmup_s"], "peak_bytes": got["peak_bytes"], **info}
        if "profile" in got:
            r["profile"] = got["profile"]
        if ref is None:
            ref = got
            rec["reference_variant"] = v
        else:  # the same weights and batches: every variant computes the same step
            r["loss_rel_diff_vs_reference"] = _rel(got["loss"], ref["loss"])
            r["max_rel_grad_norm_diff_vs_reference"] = max(_rel(got["norms"][i], ref["norms"][i]) for i in ref["norms"])
        stats = _graph_stats(runners)
        if stats is not None:
            r["cuda_graph"] = stats
        rec["results"][v] = r
        _ratios(rec)
        if on_variant is not None:
            on_variant(rec)
        log(f"model/{shape:5s} {v:16s} {r['median_ms']:10.1f} ms  {r['model_tflops']:7.2f} model-TFLOP/s "
            f"({r['model_tflops_6n']:.2f} at 6 x params x tokens, bench_train's basis)")
        del runners, ex, got
        gc.collect()  # replayed graphs and the executor hold each other: free the graphs' pool before the next variant
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _ratios(rec)
    rec["variant_order"] = [v for v in variants if v in rec["results"]]
    rec["goal"] = "none: issue 9 states goals for single blocks and heads, not for the whole-model line (ratios only)"
    return rec
