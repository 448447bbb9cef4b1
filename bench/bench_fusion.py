"""One transformer layer (and the LM head), forward + backward: unfused ATen vs mtc fused vs torch.compile.

Side by side, same inputs: a traced template run eagerly under autograd (what `--unfused` plans
do), mtc's compiled joint graph (generated kernels, flash attention, fused linear + cross-entropy;
recompute + backward in one call), on CUDA also mtc fused with torch's SDPA kernels instead of
mtc's flash attention, mtc fused replayed as a CUDA graph (one launch per call), mtc fused with
matmul prologue/epilogue fusion forced on and off (the plain fused variant takes it per shape where
it timed faster), and torch.compile of the same template. A block is also timed with each norm's
backward as a row and a column kernel (`mtc_fused_no_rowcol`, not judged) beside the one
``rowcol`` kernel plans run. Every mtc variant's joint graph returns
the block's output, as forward + backward does; a block also gets `mtc_fused_backward`, the joint
graph a training step's backward visit runs (the output, already held as the next layer's input,
is not recomputed: no last matmul), and `mtc_fused_saved_backward`, the backward visit of a block
that kept its activations (the backward graph from the saving forward's values: graphs/split.py),
both timed beside them and not judged. Reports median ms, TFLOP/s (matmul +
attention FLOPs, x3 for forward + backward), kernel counts, launches per block (the CPU proxy
everywhere, profiled kernels on CUDA), CUDA-graph capture time and pool, peak memory; one JSON
record per architecture and part. Variants are timed in interleaved rounds (each round calls every
variant once), and on CUDA each call's GPU span (events) and the SM clock and power its calls ran at
(bench/gpu_clocks.py) are recorded beside the wall time. Each record has the speed-ups of eager fused (`fused_speedup_*`)
and, on CUDA, of the replayed variant (`graph_speedup_*`: what `mtc train` runs there) over
unfused and torch.compile, and issue 9's goal for the part with a verdict judged on the faster of
the two (`goal`); a table of them ends the run.

    python bench/bench_fusion.py                 # GPU: Llama h=4096 / MLP 14336 / 32q 8kv heads, 8192 tokens, bf16
    python bench/bench_fusion.py --arch qwen2 gpt2 --part block
    python bench/bench_fusion.py --smoke         # CPU: tiny shapes, fp32, Triton interpreter (correctness, not speed)
    python bench/bench_fusion.py --part model --shape 4.6b   # the whole-model line (bench/model_stack.py)

The model part is the whole-model line: a Llama preset's full layer stack (bench_train's 1.5B P3
and 4.6B P1 shapes, 16 x 1024 tokens per step), one training step's compute through the engine's
own executor with all weights resident (no streaming, no optimizer): unfused vs mtc fused vs mtc
fused replayed as CUDA graphs vs torch.compile of the same templates, ms per step and model
TFLOP/s, every variant checked against the first on loss and per-layer gradient norms.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel import: the CPU smoke run needs the interpreter

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_stack
from common import write_record
from gpu_clocks import ClockSampler, attribute, nvml_index
from launch_count import compute_floor, generated_bytes, kernel_diff, print_kernel_table, second_stage_launches

from mtc.compiler import compile_template, launches
from mtc.models import build, model_config
from mtc.tracer import trace

REAL = {
    "llama": ("8b", dict(n_layers=1)),
    "qwen2": ("qwen2-tiny", dict(n_layers=1, vocab_size=32000, dim=3584, n_heads=28, n_kv_heads=4, ffn_dim=18944, max_seq_len=8192)),
    "gpt2": ("gpt2-tiny", dict(n_layers=1, vocab_size=50257, dim=1600, n_heads=25, max_seq_len=8192)),
}
# issue 9's goals (its Benchmark section; H100, one layer, forward + backward): speed-ups of mtc's fused layer, at least
GOALS = {
    ("llama", "block"): {"vs_unfused": 1.25, "vs_torch_compile": 1.05},
    ("qwen2", "block"): {"vs_unfused": 1.25, "vs_torch_compile": 1.05},
    ("gpt2", "block"): {"vs_unfused": 1.2, "vs_torch_compile": 1.05},
    **{(arch, "head"): {"vs_torch_compile": 1.05} for arch in ("llama", "qwen2", "gpt2")},
}
FUSED = ("mtc_fused", "mtc_fused_graph")  # eager fused, and replayed as a CUDA graph (what `mtc train` runs on CUDA)
SMOKE = {
    "llama": ("tiny", dict(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=160)),
    "qwen2": ("qwen2-tiny", dict(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=160)),
    "gpt2": ("gpt2-tiny", dict(n_layers=1, dim=64, n_heads=4)),
}


def _time_all(variants: dict[str, Any], device: torch.device, warmup: int, reps: int) -> dict[str, dict[str, list]]:
    """Time every variant in interleaved rounds: after ``warmup`` calls of each, ``reps`` rounds
    call each variant once, in an order shuffled every round (seeded), so drift in the GPU's clock
    or temperature over the run falls on all variants alike, and so does what the call before
    leaves behind (the power state of a power-limited GPU, the allocator's cache): a rotated order
    gave every variant the same predecessor in every round. Per variant: wall seconds per call
    (host, synchronised before and after: what the speed-ups use), on CUDA the GPU span of the
    call (ms between events recorded on the stream before and after it: wall minus span is host
    time before the first kernel and after the last), the host's time until the call returned
    (unsynchronised: how long it took to enqueue), and the calls' (start, end) perf_counter
    intervals, to attribute clock samples to them (`gpu_clocks.attribute`)."""
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    out: dict[str, dict[str, list]] = {n: {"times_s": [], "gpu_span_ms": [], "enqueue_s": [], "intervals": []} for n in names}
    cuda = device.type == "cuda"
    rng = random.Random(0)
    for _ in range(reps):
        order = list(names)
        rng.shuffle(order)
        for name in order:
            fn, rec = variants[name], out[name]
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            if cuda:
                a.record()
            fn()
            te = time.perf_counter()  # the host is back: a call whose enqueue time is its wall time is host-bound
            if cuda:
                b.record()
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            rec["times_s"].append(t1 - t)
            rec["enqueue_s"].append(te - t)
            rec["intervals"].append((t, t1))
            if cuda:
                rec["gpu_span_ms"].append(a.elapsed_time(b))
    return out


def attention_choices(choices: dict[str, Any], seq: int) -> dict[str, str]:
    """What each attention launch ran (Triton tiles or cuDNN) for sequences of ``seq`` tokens,
    from the tuner's choices (`mtc.kernels.flash_attention.tuning_choices`); a key ends with T, D,
    causal, dtype (`flash_attention._tuning_key`)."""
    def short(v: Any) -> str:
        if isinstance(v, str):
            return v
        if v.get("BACKEND"):
            return "cudnn (grouped KV heads)" if v.get("GQA") else "cudnn"
        return f"{v['BLOCK_M']}x{v['BLOCK_N']} w{v['num_warps']} s{v['num_stages']}"

    return {k.split("/")[0]: short(v) for k, v in choices.items() if k.split("/")[-4] == str(seq)}


def _peak(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def layer_flops(t, tokens: int, attention: bool) -> float:
    """Matmul (+ causal attention) FLOPs of one template, forward + backward (3x forward)."""
    mats = sum(math.prod(i.spec.shape) for i in t.inputs if i.kind == "param" and len(i.spec.shape) == 2)
    dim = t.inputs[0].spec.shape[-1]
    attn = 2 * tokens * tokens * dim if attention else 0  # QK^T and PV, causal half each
    return 3 * (2 * tokens * mats + attn)


def _inputs(t, call, device: torch.device, vocab: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    args = []
    for inp in t.inputs:
        src = call.bindings[inp.name]
        shape, dt = inp.spec.shape, inp.spec.torch_dtype
        if src.kind == "batch":
            args.append(torch.randint(0, vocab, shape, device=device))
        elif src.kind == "param":
            args.append(torch.randn(shape, device=device, dtype=dt) * (0.02 if len(shape) == 2 else 1.0))
        else:
            args.append(torch.randn(shape, device=device, dtype=dt))
    return args


def speedups(results: dict, variant: str) -> dict[str, float | None]:
    """``variant``'s speed-up (median ms ratio) over unfused and over torch.compile (None: not run)."""
    ms = results[variant]["median_ms"]
    return {"vs_unfused": results["unfused"]["median_ms"] / ms if "unfused" in results else None,
            "vs_torch_compile": results["torch_compile"]["median_ms"] / ms if "torch_compile" in results else None}


def paired_speedups(results: dict, variant: str) -> dict[str, dict[str, float] | None]:
    """Per interleaved round (`_time_all` calls every variant once in each, so the k-th time of
    every variant is round k's), the baseline's time over ``variant``'s: the median of those
    ratios and their quartiles. A power-limited GPU's state drifts between rounds (the H200's
    Llama block, 2026-11-27: quartiles 5-7 % apart over 10 rounds for every variant), and a ratio
    within one round has both sides under the same state: the quartiles say how sure a ratio of
    medians (`speedups`, what the goal is judged on) is. None: no baseline, or no times."""
    mine = results[variant].get("times_s") or []
    out: dict[str, dict[str, float] | None] = {}
    for key, base in (("vs_unfused", "unfused"), ("vs_torch_compile", "torch_compile")):
        theirs = (results.get(base) or {}).get("times_s") or []
        if not mine or len(theirs) != len(mine):
            out[key] = None
            continue
        ratios = [b / m for b, m in zip(theirs, mine, strict=True)]
        q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        out[key] = {"median": statistics.median(ratios), "q1": q[0], "q3": q[2], "rounds": len(ratios)}
    return out


def goal_verdict(arch: str, part: str, results: dict, device: torch.device) -> dict:
    """Issue 9's goal for this part, judged on the faster of eager fused and replayed (named), with
    the per-round ratios beside it (`paired_speedups`); ``noise``: the goals whose threshold lies
    between the paired ratio's quartiles (the verdict could go either way on another run)."""
    goal = GOALS[(arch, part)]
    best = min((v for v in FUSED if v in results), key=lambda v: results[v]["median_ms"])
    got = speedups(results, best)
    checks = {k: got[k] >= want for k, want in goal.items() if got[k] is not None}
    paired = paired_speedups(results, best)
    noise = [k for k, want in goal.items() if paired.get(k) and paired[k]["q1"] < want <= paired[k]["q3"]]
    out = {"goal_at_least": goal, "judged_on": best, "speedup": {k: got[k] for k in goal}, "checks": checks,
           "paired": {k: paired.get(k) for k in goal}, "within_noise": noise}
    if device.type != "cuda":
        out.update(met=None, verdict="not judged: the goals are H100 figures, this run is on the CPU")
    elif len(checks) < len(goal):
        out.update(met=None, verdict=f"not judged: {', '.join(k for k in goal if k not in checks)} not measured "
                                     "(torch.compile left out)")
    else:
        out.update(met=all(checks.values()), verdict=("met" if all(checks.values()) else "missed") + f" on {best}"
                   + (f" (within the rounds' spread: {', '.join(k.removeprefix('vs_') for k in noise)})" if noise else ""))
    return out


def run(arch: str, part: str, smoke: bool, device: torch.device, seq: int, warmup: int, reps: int, use_compile: bool,
        profile: bool = False, trace_dir: str | None = None) -> dict:
    """Benchmark one architecture's block (or head: norm + LM head + loss); returns the record."""
    name, over = (SMOKE if smoke else REAL)[arch]
    dtype = torch.float32 if smoke else torch.bfloat16
    with torch.device("meta"):
        model = build(name, **over).to(dtype)
    prog = trace(model, 1, seq)
    call = prog.layers[1] if part == "block" else prog.layers[-1]
    t = prog.templates[call.template]
    vocab = model_config(name, **over).vocab_size
    args = _inputs(t, call, device, vocab)
    diff = [k for k, i in enumerate(t.inputs) if i.kind in ("carry", "param")]
    gm = t.module(device)
    with torch.no_grad():
        gout = torch.randn_like(gm(*args)[0])

    def unfused():
        xs = [a.detach().requires_grad_(k in diff) for k, a in enumerate(args)]
        out = gm(*xs)[0]
        return torch.autograd.grad(out, [xs[k] for k in diff], gout)

    variants = {"unfused": unfused}
    compiled_t = {}
    # mtc fused with its flash-attention kernels, and (blocks on CUDA) with torch's SDPA kernels
    attn_modes = ["flash", "aten"] if part == "block" and device.type == "cuda" else ["flash"]
    # matmul prologue/epilogue fusion (kernels/matmul_fusion.py): 'auto' (mtc_fused) takes it where
    # it timed faster per shape; forced on and off beside it show what each side costs
    configs = [(mode, "auto", True, True) for mode in attn_modes] + [("flash", "on", True, True), ("flash", "off", True, True)]
    if part == "block":  # the joint graph a training step's backward visit runs: the block's output is not recomputed
        configs.append(("flash", "auto", False, True))
        # a norm's backward in one rowcol kernel (plans always) against a row and a column kernel
        configs.append(("flash", "auto", True, False))
    want = unfused()
    rels = {}
    mm_fused = {}
    saved_info = None  # a block's backward from saved values: its launches and what it keeps

    def add(mode: str, mm: str, outputs: bool, rowcol: bool) -> None:
        """Compile one configuration, check its gradients against unfused, add its variant(s)."""
        nonlocal saved_info
        t0 = time.perf_counter()
        cache = Path(tempfile.mkdtemp(prefix="mtc-bench-kernels-"))
        # forward + backward, as the other variants compute: the joint graph returns the output too
        # (a training step's backward visit does not recompute it: `mtc_fused_backward`, not judged)
        ct = compile_template(t, cache, attention=mode, matmul_fusion=mm, joint_outputs=outputs, row_and_column=rowcol)
        if mm == "auto" and outputs and rowcol:
            compiled_t[mode] = (ct, time.perf_counter() - t0)
        joint = ct.module("joint", device)

        def fused(joint=joint):
            with torch.no_grad():
                return joint(*args, gout)

        # correctness before speed: the fused gradients must match the unfused ones
        got = fused()[1:]
        vname = ("mtc_fused" if mode == "flash" else "mtc_fused_sdpa") + ("" if mm == "auto" else f"_mm_{mm}")
        vname = vname if outputs else "mtc_fused_backward"
        vname = vname if rowcol else "mtc_fused_no_rowcol"
        mm_fused[vname] = {"forward": ct.forward_report.hand_tuned.get("fused_mm", 0),
                           "joint": ct.backward_report.hand_tuned.get("fused_mm", 0),
                           "joint_pre": ct.backward_report.hand_tuned.get("fused_mm_pre", 0),
                           "launches": {"forward": launches(ct.forward_graph), "joint": launches(ct.joint_graph)},
                           # column kernels' second-stage combines, launched beside the proxy's count
                           "combine_launches": {"forward": second_stage_launches(ct.forward_graph),
                                                "joint": second_stage_launches(ct.joint_graph)},
                           # what the generated kernels read and write per call (a CPU count)
                           "generated_bytes": {"forward": generated_bytes(ct.forward_graph), "joint": generated_bytes(ct.joint_graph)}}
        if mm == "auto":  # the template's own share of the timed sites (the compiled record's choices)
            mm_fused[vname]["timed"] = ct.tuning["matmul_fusion"]
        # each configuration times its generated kernels' launches on its own: the H200 timed
        # mtc_fused_mm_off, the same kernels as mtc_fused there, 1.3-1.8 ms faster (2026-11-27)
        mm_fused[vname]["generated_launches"] = ct.tuning.get("generated", {}).get("choices")
        rels[vname] = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
                          for a, b in zip(got, want, strict=True))
        variants[vname] = fused
        if not outputs and ct.backward_graph is not None:
            # the backward visit of a block that kept its activations (graphs/split.py): the backward
            # from the saving forward's values, against mtc_fused_backward's recompute + backward
            with torch.no_grad():
                kept = ct.module("save", device)(*args)[1 + t.n_aux_out:]
            backward = ct.module("backward", device)

            def saved(backward=backward, kept=kept):
                with torch.no_grad():
                    return backward(*args, *kept, gout)

            got = saved()[1 + t.n_aux_out:]
            rels["mtc_fused_saved_backward"] = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
                                                   for a, b in zip(got, want, strict=True))
            variants["mtc_fused_saved_backward"] = saved
            saved_info = {"launches": {"save": launches(ct.save_graph), "backward": launches(ct.backward_graph),
                                       "joint_without_output": launches(ct.joint_graph)},
                          "saved_bytes_per_call": ct.saved_bytes()}

    variant_errors: dict[str, str] = {}  # a configuration beside the judged one that failed: the rest still run
    for cfg in configs:
        try:
            add(*cfg)
        except Exception as e:  # noqa: BLE001
            if cfg == ("flash", "auto", True, True):
                raise  # mtc_fused itself: the record has nothing to judge without it
            variant_errors[str(cfg)] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{arch}/{part}: configuration {cfg} failed ({variant_errors[str(cfg)]}); the others go on", flush=True)
    graph_runner = None
    if device.type == "cuda":  # the same joint graph replayed as a CUDA graph (mtc.runtime.graph_replay)
        from launch_count import graph_variant

        variants["mtc_fused_graph"], graph_runner = graph_variant(compiled_t["flash"][0], t, args, gout, device)
        got = variants["mtc_fused_graph"]()[1:]  # the first call captures
        rels["mtc_fused_graph"] = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
                                      for a, b in zip(got, want, strict=True))
    if use_compile:
        cgm = torch.compile(gm)

        def compiled():
            xs = [a.detach().requires_grad_(k in diff) for k, a in enumerate(args)]
            return torch.autograd.grad(cgm(*xs)[0], [xs[k] for k in diff], gout)

        variants["torch_compile"] = compiled
        from torch._inductor import metrics as inductor_metrics

        inductor_metrics.reset()
        got = compiled()  # compile now: count the kernels Inductor generates (cuBLAS / extern calls not included)
        compile_kernels = inductor_metrics.generated_kernel_count
        # checked like mtc's variants: cuDNN attention, which both may call in this one process, caches
        # its graphs per thread, and a cache that mixed the two sides' layouts would show here
        rels["torch_compile"] = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
                                    for a, b in zip(got, want, strict=True))
    want = got = None  # (frees the reference gradients before the timing)
    flops = layer_flops(t, seq, attention=part == "block")
    ct, compile_s = compiled_t["flash"]
    rec: dict = {"arch": arch, "part": part, "smoke": smoke, "tokens": seq, "dtype": str(dtype), "compile_s": compile_s,
                 # of which timing candidates (attention, matmul fusion, generated kernels' launches), and
                 # the launch configuration each column and rowcol kernel took (CUDA only)
                 "tuning_s": ct.tuning_s, "generated_launches": ct.tuning["generated"]["choices"],
                 "max_rel_grad_diff_vs_unfused": rels, "flops_fwd_bwd": flops,
                 # launches for forward + backward: the joint graph holds both (ATen ops unfused, kernels fused)
                 "kernels": {"unfused": ct.backward_report.aten_ops, "mtc_fused": ct.backward_report.kernels,
                             "torch_compile_generated": compile_kernels if use_compile else None},
                 "hand_tuned": ct.backward_report.hand_tuned,
                 # per variant: fused matmuls and kernel launches (forward graph, joint graph) and, for
                 # 'auto', each site's check and timing
                 "matmul_fusion": mm_fused,
                 "saved_activations": saved_info,
                 "variant_errors": variant_errors,
                 "results": {}}
    sampler = ClockSampler(nvml_index(device.index or 0)).start() if device.type == "cuda" else None
    try:
        timed = _time_all(variants, device, warmup, reps)
    finally:
        samples = sampler.stop() if sampler is not None else []
    for vname, fn in variants.items():
        ts = timed[vname]["times_s"]
        med = statistics.median(ts)
        rec["results"][vname] = {"median_ms": med * 1e3, "tflops": flops / med / 1e12, "peak_bytes": _peak(fn, device), "times_s": ts}
        if timed[vname]["gpu_span_ms"]:
            rec["results"][vname]["gpu_span_median_ms"] = statistics.median(timed[vname]["gpu_span_ms"])
        # host time until the call returned, unsynchronised: near median_ms, the GPU waited on the host
        rec["results"][vname]["enqueue_median_ms"] = statistics.median(timed[vname]["enqueue_s"]) * 1e3
    rec["timing"] = {"method": "interleaved rounds (bench_fusion._time_all): each round calls every variant once, the order "
                               "shuffled (seeded); median_ms: host wall per call, synchronised; gpu_span_median_ms: CUDA events around the call"}
    if sampler is not None:  # at what SM clock and power each variant's calls ran (bench/gpu_clocks.py)
        rec["timing"]["clock_source"] = sampler.source
        rec["timing"]["clocks"] = attribute(samples, {v: timed[v]["intervals"] for v in variants})
    from launch_count import kernel_table, profiled_kernels, proxy_launches

    # launches per block (forward + backward): the CPU proxy, and on CUDA the kernels the profiler sees
    rec["launches_per_block"] = {"unfused_aten_ops": ct.backward_report.aten_ops, **proxy_launches(ct, t)}
    if device.type == "cuda":
        rec["launches_per_block"].update({f"{v}_profiled_kernels": profiled_kernels(variants[v])
                                          for v in ("unfused", "mtc_fused", "torch_compile") if v in variants})
    if graph_runner is not None:
        st = graph_runner.stats["joint"]
        rec["cuda_graph"] = {"warmup_s": st.warmup_s, "capture_s": st.capture_s, "pool_bytes": st.pool_bytes,
                             "input_buffer_bytes": st.static_bytes, "fallback": st.fallback,
                             "speedup_vs_fused_eager": rec["results"]["mtc_fused"]["median_ms"]
                             / rec["results"]["mtc_fused_graph"]["median_ms"]}
        # the graph's pool was filled at capture, before `_peak` took its base: without it the
        # replayed variant's peak counts only its outputs' clones, not comparable with the others
        g = rec["results"]["mtc_fused_graph"]
        if g["peak_bytes"] is not None:
            g["peak_bytes_without_pool"], g["peak_bytes"] = g["peak_bytes"], g["peak_bytes"] + st.pool_bytes
    if profile and device.type == "cuda":
        # torch.compile beside them: the goal is measured against it, so its kernels say where the gap is;
        # and the replayed graph: on the H100 and H200 it ran 0.95-1.01x of the eager fused call for
        # Llama and Qwen2 blocks, where replay should only remove idle time (are its kernels slower?)
        rec["profile"] = {v: kernel_table(variants[v]) for v in ("unfused", "mtc_fused", "mtc_fused_mm_off", "mtc_fused_graph", "torch_compile")
                          if v in variants}
        if "mtc_fused_graph" in rec["profile"]:  # the kernels that run slower (or faster) replayed than eager
            rec["profile_graph_vs_eager"] = kernel_diff(rec["profile"]["mtc_fused"], rec["profile"]["mtc_fused_graph"])
        if "mtc_fused_mm_off" in rec["profile"]:  # with no matmul fused in either, any difference is launches or gaps
            rec["profile_mm_off_vs_eager"] = kernel_diff(rec["profile"]["mtc_fused"], rec["profile"]["mtc_fused_mm_off"])
        # the matmuls and attention every variant must run: the speed-up a goal can ask of fusion at most
        rec["compute_floor"] = compute_floor(rec["profile"], {v: x["median_ms"] for v, x in rec["results"].items()})
        # each generated kernel's GB/s (CPU byte count over profiled time): row, column and rowcol
        # kernels against the memory bandwidth pointwise ones reach
        from launch_count import generated_kernels, kernel_bandwidth

        rec["generated_kernel_bandwidth"] = kernel_bandwidth(generated_kernels(ct.joint_graph), rec["profile"]["mtc_fused"])
    if trace_dir and device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            variants["mtc_fused"]()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(Path(trace_dir) / f"trace-{arch}-{part}.json"))
    from mtc.kernels.flash_attention import tuning_choices

    rec["attention_choices"] = attention_choices(tuning_choices(), seq) if part == "block" else {}
    r = rec["results"]
    rec["fused_speedup_vs_unfused"] = r["unfused"]["median_ms"] / r["mtc_fused"]["median_ms"]
    if "torch_compile" in r:
        rec["fused_speedup_vs_torch_compile"] = r["torch_compile"]["median_ms"] / r["mtc_fused"]["median_ms"]
    if "mtc_fused_graph" in r:  # what `mtc train` runs on CUDA (--cuda-graphs auto)
        g = speedups(r, "mtc_fused_graph")
        rec["graph_speedup_vs_unfused"] = g["vs_unfused"]
        if g["vs_torch_compile"] is not None:
            rec["graph_speedup_vs_torch_compile"] = g["vs_torch_compile"]
    rec["goal"] = goal_verdict(arch, part, r, device)
    return rec


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _floor_text(f: dict) -> str:
    """`compute_floor`'s record as a line."""
    return (f"compute floor: matmuls + attention {f['floor_ms']:.2f} ms ({f['floor_variant']}); a variant running only "
            f"those would be {_x(f.get('best_possible_vs_unfused'))} unfused, {_x(f.get('best_possible_vs_torch_compile'))} torch.compile")


def _goal_text(goal: dict[str, float]) -> str:
    return ", ".join(f">= {v}x {k.removeprefix('vs_').replace('_', '.')}" for k, v in goal.items())


def print_goals(recs: list[dict]) -> None:
    """One row per part: eager fused and replayed against unfused and torch.compile, the goal, the verdict."""
    print(f"\n{'part':12s} {'fused/unf':>9s} {'fused/tc':>9s} {'graph/unf':>9s} {'graph/tc':>9s}  {'goal':40s} verdict")
    for rec in recs:
        want = _goal_text(rec["goal"]["goal_at_least"])
        print(f"{rec['arch'] + '/' + rec['part']:12s} {_x(rec['fused_speedup_vs_unfused']):>9s} "
              f"{_x(rec.get('fused_speedup_vs_torch_compile')):>9s} {_x(rec.get('graph_speedup_vs_unfused')):>9s} "
              f"{_x(rec.get('graph_speedup_vs_torch_compile')):>9s}  {want:40s} {rec['goal']['verdict']}")
    for rec in recs:  # the same ratios taken round by round: their spread says how firm the verdict is
        paired = rec["goal"].get("paired") or {}
        parts = [f"{k.removeprefix('vs_').replace('_', '.')} {_x(p['median'])} ({p['q1']:.2f}-{p['q3']:.2f})"
                 for k, p in paired.items() if p]
        if parts:
            print(f"{rec['arch'] + '/' + rec['part']:12s} per round, {rec['goal']['judged_on']} (median, quartiles of "
                  f"{next(p['rounds'] for p in paired.values() if p)} rounds): {', '.join(parts)}")
    print("fused: mtc_fused (eager); graph: mtc_fused_graph (replayed as a CUDA graph, CUDA only); unf: unfused; "
          "tc: torch.compile; the verdict takes the faster of the two")


def model_text(rec: dict) -> str:
    """A whole-model record's size and speed-ups in one line."""
    line = f"model/{rec['shape']:5s} {rec['n_params'] / 1e9:.2f}B, {rec['tokens_per_step']} tokens per step"
    if "fused_speedup_vs_unfused" in rec:
        line += f": fused vs unfused {rec['fused_speedup_vs_unfused']:.2f}x"
    if "fused_speedup_vs_torch_compile" in rec:
        line += f", vs torch.compile {rec['fused_speedup_vs_torch_compile']:.2f}x"
    if "graph_speedup_vs_unfused" in rec:
        line += f"; replayed vs unfused {rec['graph_speedup_vs_unfused']:.2f}x"
    if "graph_speedup_vs_torch_compile" in rec:
        line += f", vs torch.compile {rec['graph_speedup_vs_torch_compile']:.2f}x"
    return line + " (issue 9 states no goal for the whole-model line)"


def model_line(a: argparse.Namespace, device: torch.device, warmup: int, reps: int) -> None:
    """The whole-model line: each stack's step, every variant, one record per stack."""
    shapes = ["smoke"] if a.smoke else (a.shape or ["1.5b", "4.6b"])
    variants = [v for v in model_stack.VARIANTS if v != "torch_compile" or not a.no_torch_compile]
    deadline = time.monotonic() + a.time_limit_s if a.time_limit_s else None
    name = "bench_fusion-model" + ("-smoke" if a.smoke else "")
    for shape in shapes:
        written: list[Path] = []

        def write(rec: dict, written: list[Path] = written) -> None:  # after each variant: a killed run keeps its record
            written[:] = [write_record(name, rec, written[0] if written else None)]

        try:
            rec = model_stack.run_model(shape, device, seqs=a.model_seqs or (4 if a.smoke else 16),
                                        micro_batch=a.model_micro_batch or (2 if a.smoke else 8),
                                        seq_len=a.model_seq_len or (16 if a.smoke else 1024),
                                        warmup=warmup, reps=reps, variants=variants, deadline=deadline, on_variant=write,
                                        profile=a.profile)
        except Exception:  # noqa: BLE001  (the variants that finished are in the record `write` keeps)
            traceback.print_exc()
            print(f"model/{shape}: FAILED; finished variants: {written[0] if written else 'none'}", flush=True)
            continue
        r = rec["results"]
        print(model_text(rec))
        profs = {v: x["profile"] for v, x in r.items() if "profile" in x}
        if profs:  # as for a block: the matmuls and attention no variant can skip
            # (variants a time limit skipped have no time)
            rec["compute_floor"] = compute_floor(profs, {v: x["median_ms"] for v, x in r.items() if "median_ms" in x})
            print(f"model/{shape:5s} {_floor_text(rec['compute_floor'])}")
        for v, x in r.items():
            extra = [f"plan compile {x['plan_compile_s']:.1f} s"] if "plan_compile_s" in x else []
            if "loss_rel_diff_vs_reference" in x:
                extra.append(f"vs {rec['reference_variant']}: loss {x['loss_rel_diff_vs_reference']:.1e}, "
                             f"grad norms {x['max_rel_grad_norm_diff_vs_reference']:.1e}")
            if "cuda_graph" in x:
                cg = x["cuda_graph"]
                extra.append(f"{cg['captured']} graphs, capture {cg['capture_s']:.2f} s, pool {cg['pool_bytes'] / 2**20:.0f} MiB"
                             + (f", FELL BACK: {cg['fallbacks']}" if cg["fallbacks"] else ""))
            if extra:
                print(f"model/{shape:5s} {v:16s} " + "; ".join(extra))
            if "profile" in x:
                print_kernel_table(v, x["profile"], x["median_ms"], top=12)
        print(f"record: {write_record(name, rec, written[0] if written else None)}")


def main() -> None:
    """Parse, run each architecture, print a table, write JSON records."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=["llama", "qwen2", "gpt2"], choices=list(REAL))
    ap.add_argument("--part", nargs="+", default=["block", "head"], choices=["block", "head", "model"],
                    help="block: one decoder layer; head: final norm + LM head + cross-entropy; model: the whole-model "
                         "line, a Llama preset's full layer stack through the engine's executor (bench/model_stack.py)")
    ap.add_argument("--shape", nargs="+", choices=[s for s in model_stack.SHAPES if s != "smoke"],
                    help="model part: the stacks to run (default 1.5b 4.6b: bench_train's P3 and P1 shapes)")
    ap.add_argument("--model-seqs", type=int, help="model part: sequences per step (default 16; 4 with --smoke)")
    ap.add_argument("--model-micro-batch", type=int, help="model part: sequences per micro-batch (default 8; 2 with --smoke)")
    ap.add_argument("--model-seq-len", type=int, help="model part: tokens per sequence (default 1024; 16 with --smoke)")
    ap.add_argument("--time-limit-s", type=float, help="model part: start no variant after this many seconds (the "
                                                          "record, written after each variant, says which were skipped)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter): checks, not speed")
    ap.add_argument("--seq", type=int, help="tokens (default 8192; 16 with --smoke)")
    ap.add_argument("--warmup", type=int, help="untimed calls (steps) first (default 3, model part 2; 1 with --smoke)")
    ap.add_argument("--reps", type=int, help="timed calls (steps), median taken (default 30, model part 5; 3 / 2 with --smoke)")
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--profile", action="store_true", help="CUDA: print and record the top kernels of unfused, mtc fused (eager and replayed) and torch.compile (and of every "
                         "variant of the whole-model line, one step each)")
    ap.add_argument("--trace", metavar="DIR", help="CUDA: write a chrome trace (CPU + GPU) of one mtc fused call to DIR")
    a = ap.parse_args()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if not a.smoke and device.type != "cuda":
        ap.error("the real benchmark needs a CUDA device; use --smoke on the CPU")
    seq = a.seq or (16 if a.smoke else 8192)
    warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 3)
    # 30 rounds: a Llama block's ten variants take ~0.25 s a round on the H200, and over 10 rounds
    # the quartiles of every variant lay 5-7 % apart (2026-11-27), as wide as the goals' margins
    reps = a.reps or (3 if a.smoke else 30)
    if "model" in a.part:
        if "llama" not in a.arch:
            ap.error("the model part runs Llama stacks (bench_train's shapes): add llama to --arch")
        # a whole step takes ~1 s at 4.6B on the H100: fewer repetitions than a single layer's
        model_line(a, device, a.warmup if a.warmup is not None else (1 if a.smoke else 2), a.reps or (2 if a.smoke else 5))
    jobs = [(arch, part) for part in a.part if part != "model" for arch in a.arch]
    recs = []
    if jobs:
        print(f"{'arch':12s} {'variant':15s} {'median ms':>10s} {'TFLOP/s':>8s} {'peak MiB':>9s}")
    for arch, part in jobs:
        try:
            rec = run(arch, part, a.smoke, device, seq, warmup, reps, not a.no_torch_compile, a.profile, a.trace)
        except Exception as e:  # noqa: BLE001  (one part's failure is recorded; the other parts still run)
            traceback.print_exc()
            err = {"arch": arch, "part": part, "smoke": a.smoke, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(f"{arch}/{part}: FAILED ({err['error']}); record: "
                  f"{write_record('bench_fusion' + ('-smoke' if a.smoke else ''), err)}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        arch = f"{arch}/{part}"
        for v, r in rec["results"].items():
            peak = f"{r['peak_bytes'] / 2**20:9.0f}" if r["peak_bytes"] is not None else "      n/a"
            print(f"{arch:12s} {v:15s} {r['median_ms']:10.2f} {r['tflops']:8.2f} {peak}")
        extra = f", vs torch.compile {rec['fused_speedup_vs_torch_compile']:.2f}x" if "fused_speedup_vs_torch_compile" in rec else ""
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in rec["max_rel_grad_diff_vs_unfused"].items())
        if rec["attention_choices"]:
            print(f"{arch:12s} attention launches chosen: {rec['attention_choices']}")
        print(f"{arch:12s} fused matmuls and launches: "
              + "; ".join(f"{v} {m['forward']}/{m['joint']} of {m['launches']['forward']}/{m['launches']['joint']}"
                          f" (+{m['combine_launches']['forward']}/{m['combine_launches']['joint']} combines)"
                          for v, m in rec["matmul_fusion"].items()))
        print(f"{arch:12s} generated kernels' bytes per call (forward / joint, MiB): "
              + "; ".join(f"{v} {m['generated_bytes']['forward'] / 2**20:.0f} / {m['generated_bytes']['joint'] / 2**20:.0f}"
                          for v, m in rec["matmul_fusion"].items()))
        print(f"{arch:12s} fused vs unfused {rec['fused_speedup_vs_unfused']:.2f}x{extra}; kernels {rec['kernels']}; "
              f"hand-tuned {rec['hand_tuned']}; max rel grad diff vs unfused: {diffs}")
        if "graph_speedup_vs_unfused" in rec:
            print(f"{arch:12s} replayed (CUDA graph) vs unfused {_x(rec['graph_speedup_vs_unfused'])}, "
                  f"vs torch.compile {_x(rec.get('graph_speedup_vs_torch_compile'))}")
        print(f"{arch:12s} goal {_goal_text(rec['goal']['goal_at_least'])}: {rec['goal']['verdict']} "
              f"(on {rec['goal']['judged_on']}: {', '.join(f'{k} {_x(v)}' for k, v in rec['goal']['speedup'].items())})")
        print(f"{arch:12s} launches per block: {rec['launches_per_block']}")
        print(f"{arch:12s} compile {rec['compile_s']:.1f} s (timing candidates {rec['tuning_s']:.1f} s); generated kernels' "
              f"launches chosen: {rec['generated_launches'] or 'none timed'}")
        if "cuda_graph" in rec:
            cg = rec["cuda_graph"]
            print(f"{arch:12s} CUDA-graph replay vs eager fused {cg['speedup_vs_fused_eager']:.2f}x; warm-up {cg['warmup_s']:.2f} s, "
                  f"capture {cg['capture_s']:.2f} s, pool {cg['pool_bytes'] / 2**20:.0f} MiB"
                  + (f"; FELL BACK: {cg['fallback']}" if cg["fallback"] else ""))
        if "clock_source" in rec.get("timing", {}):
            print(f"{arch:12s} timing: interleaved rounds; SM clock and power from {rec['timing']['clock_source']}")
        for v, c in rec.get("timing", {}).get("clocks", {}).items():
            span = rec["results"][v].get("gpu_span_median_ms")
            enq = rec["results"][v].get("enqueue_median_ms")
            line = (f"{arch:12s} {v:22s} wall {rec['results'][v]['median_ms']:.2f} ms" + (f", GPU span {span:.2f} ms" if span is not None else "")
                    + (f", enqueued in {enq:.2f} ms" if enq is not None else ""))
            if c.get("samples"):
                line += f"; SM {c['sm_mhz_median']:.0f} MHz (min {c['sm_mhz_min']:.0f}), {c['power_w_median']:.0f} W"
                if "power_limited_frac" in c:
                    line += f", power-limited {c['power_limited_frac']:.0%}, thermal {c['thermal_limited_frac']:.0%}"
            print(line)
        for v, prof in rec.get("profile", {}).items():
            print_kernel_table(v, prof, rec["results"][v]["median_ms"], top=25)
        if rec.get("compute_floor"):
            print(f"{arch:12s} {_floor_text(rec['compute_floor'])}")
        if rec.get("generated_kernel_bandwidth"):
            print("  generated kernels (mode, MiB per call, ms, GB/s):")
            for name, k in sorted(rec["generated_kernel_bandwidth"].items(), key=lambda x: -x[1]["ms"]):
                print(f"    {name:20s} {k['mode']:9s} {k['bytes'] / 2**20:8.1f} {k['ms']:7.3f} {k['gb_per_s']:7.0f}")
        for key, what in (("profile_graph_vs_eager", "replayed vs eager"), ("profile_mm_off_vs_eager", "mm_off vs eager")):
            if key in rec:
                d = rec[key]
                print(f"  {what}: GPU busy {d['gpu_ms_diff']:+.3f} ms; kernels that differ most:")
                for r in d["top"]:
                    print(f"    {r['diff_ms']:+8.3f} ms  ({r['base_ms']:.3f} x{r['base_calls']} -> {r['other_ms']:.3f} x{r['other_calls']}) "
                          f"{r['kernel'][:90]}")
        print(f"record: {write_record('bench_fusion' + ('-smoke' if a.smoke else ''), rec)}")
        recs.append(rec)
    if recs:
        print_goals(recs)


if __name__ == "__main__":
    main()
