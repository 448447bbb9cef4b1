"""The benchmarks' smoke modes on the CPU, so a broken record field shows here and not first on
the GPU box: bench_train (issue 8's record fields; a shape's compiled plan compiled by its first
setting and loaded by the next) and bench_fusion's whole-model line (variants agree on loss and
gradient norms), each run as a user runs it, records written under a temporary directory."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, args: list[str], out: Path, timeout: int = 180, home: Path | None = None) -> list[dict]:
    """Run ``bench/script`` with ``args``, records redirected to ``out`` (and ``HOME`` to ``home``,
    where `mtc calibrate` keeps its profile); the records it wrote."""
    env = dict(os.environ, BENCH_RESULTS_DIR=str(out), TRITON_INTERPRET="1", **({"HOME": str(home)} if home else {}))
    before = set((BENCH / "results").iterdir())
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, env=env,
                          cwd=BENCH.parent, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set((BENCH / "results").iterdir()) == before, "a test's record went to bench/results/"
    paths = sorted(out.glob("*.json"))
    assert paths, f"{script} wrote no record under {out}:\n{proc.stdout[-2000:]}"
    return [json.loads(p.read_text()) for p in paths]


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_mtc_setting(r: dict) -> None:
    """Issue 8's figures of one mtc setting are present and sane."""
    assert "error" not in r, r.get("traceback", r.get("error"))
    assert r["durability"] == "none" and r["config"]["durability"] == "none"
    steps = r["steps_s"]
    assert steps and all(finite(s) and s > 0 for s in steps)
    assert r["median_step_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["median_step_s"])
    assert r["model_tflops"] == pytest.approx(6 * r["n_params"] * r["tokens_per_step"] / r["median_step_s"] / 1e12)
    timed = steps[r["warmup_steps"]:r["warmup_steps"] + r["measured_steps"]]
    assert r["mean_step_s"] == pytest.approx(sum(timed) / len(timed)) and r["step_spread"] == pytest.approx(max(timed) / min(timed))
    setup = r["setup_s"]  # filling the state is part of what train() did before its first step
    assert finite(setup["state_fill"]) and 0 < setup["state_fill"] <= setup["train_until_first_step"]
    prof = r["gpu_profile"]  # CUDA only: the profiled step's busy %; None on the CPU, never missing
    assert prof is None and r["gpu_peak_allocated_bytes"] is None
    tr = r["transfer_per_step"]
    assert finite(tr["h2d_gbps_avg"]) and finite(tr["d2h_gbps_avg"]) and tr["h2d_gbps_avg"] >= 0
    assert tr["planned"]["grads_d2h"] > 0  # stateless / ram layers send their gradients to the host
    # on the CPU device the copy engine's counts are exact: the plan's bytes, byte for byte (when
    # steps were measured apart from the first)
    if tr["counted"] is not None:
        assert (tr["counted"]["h2d_bytes"], tr["counted"]["d2h_bytes"]) == (tr["planned"]["h2d_bytes"], tr["planned"]["d2h_bytes"])
    win = r["update_window"]  # None with no step timed after another (--warmup 0 --steps 1)
    if win is not None:
        assert 0 < win["forward_done_s"] < win["step_s"] and win["head_and_backward_s"] > 0
        # every layer's fetch waited for its update, the head's last: the forward ends after the last update
        assert 0 < win["cpu_updates_done_s"] <= win["forward_done_s"]
    opt = r["optimizer"]
    assert opt["update_s"] > 0 and 0 <= opt["hidden_s"] <= opt["update_s"] and opt["exposed_upper_s"] >= 0
    host = r["host"]
    # (VmHWM and VmRSS are sampled apart: the peak may read a little below the steady figure)
    assert host["steady_rss_per_param"] > 0 and host["peak_rss_per_param"] > 0 and host["state_bytes"] > 0
    assert r["clip_norm"] == 1.0 and 0 <= r["clipped_steps"] <= len(steps)
    assert r["clipped_steps"] == sum(1 for g in r["grad_norms"] if g > r["clip_norm"])
    assert all(finite(x) for x in r["losses"])


@pytest.mark.slow  # three fused settings under the Triton interpreter (~25 s)
def test_bench_train_compiles_a_shape_once_and_records_issue_8s_fields(tmp_path):
    args = ["--smoke", "--only", "P3", "--kernels", "fused", "--warmup", "0", "--steps", "1", "--quiet",
            "--plans", str(tmp_path / "plans")]
    (rec,) = run_bench("bench_train.py", args, tmp_path / "a")
    assert rec["benchmark"] == "bench_train-smoke-P3" and rec["part"] == "P3"
    # one file per part: rewritten after each setting (a killed run keeps them), then whole
    assert "partial" not in rec and "settings_done" not in rec
    first, second = rec["settings"]
    assert (first["setting"], second["setting"]) == ("stateless", "auto")
    for r in (first, second):
        check_mtc_setting(r)
        plan = r["plan"]
        assert plan["kernels"] == "fused" and finite(plan["compile_or_load_s"]) and plan["compile_or_load_s"] > 0
        assert plan["train_templates"]["compiled"] == 0  # train() loads what the plan directory holds
    # the first setting of the shape compiles the plan, the second loads it: the same directory,
    # nothing traced or compiled again
    p1, p2 = first["plan"], second["plan"]
    assert p1["dir"] == p2["dir"]
    assert p1["prepared_here"] and p1["how"] == "compiled" and p1["prepare_templates"]["compiled"] == 3
    assert not p2["prepared_here"] and p2["how"] == "loaded" and p2["prepare_s"] is None
    assert p2["train_templates"] == {"compiled": 0, "loaded": 3}
    assert p2["compile_or_load_s"] == pytest.approx(p2["train_s"]) and p2["compile_or_load_s"] < p1["compile_or_load_s"]
    # both settings trained the same model from the same weights and data
    assert first["losses"][0] == pytest.approx(second["losses"][0], rel=1e-5)
    # the resident baseline runs without mtc's compiler and says so
    base = rec["baselines"][0]
    assert base["setting"] == "torch_eager" and base["plan"]["kernels"] == "torch eager"
    assert base["plan"]["compile_or_load_s"] is None and base["tokens_per_s"] > 0
    assert rec["ratio_mtc_over_baseline"] == pytest.approx(rec["mtc_best_tokens_per_s"] / rec["baseline_best_tokens_per_s"])
    # a later invocation over the same --plans (gpu_session.sh's next train part) loads the plan
    (again,) = run_bench("bench_train.py", [*args, "--settings", "stateless"], tmp_path / "b")
    p3 = again["settings"][0]["plan"]
    assert p3["dir"] == p1["dir"] and not p3["prepared_here"] and p3["how"] == "loaded"
    assert p3["train_templates"] == {"compiled": 0, "loaded": 3}


def test_bench_train_unfused_smoke_records_p1_16_and_p1_48_with_three_times_its_sequences(tmp_path):
    from tests.mtc.test_planner import _this_host_profile

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_train

    home = tmp_path / "home"
    _this_host_profile(home / ".cache" / "mtc" / "machine.json")
    p16, p48 = run_bench("bench_train.py", ["--smoke", "--only", "P1-16,P1-48", "--quiet"], tmp_path / "out", home=home)
    assert (p16["part"], p48["part"]) == ("P1-16", "P1-48") and p48["benchmark"] == "bench_train-smoke-P1-48"
    assert p16["goal_stateless_tflops"] == 230.0
    assert p48["goal_stateless_tflops"] == 300.0 and p48["megatrain_tflops"] == 181.0
    for rec in (p16, p48):
        assert "partial" not in rec and [r["setting"] for r in rec["settings"]] == ["stateless", "auto"]
        for r in rec["settings"]:
            check_mtc_setting(r)
            assert r["plan"]["kernels"] == "unfused" and r["plan"]["compile_or_load_s"] is None
            # mtc plan's prediction beside the measurement, on the calibrated profile of this host
            pred = r["predicted_by_mtc_plan"]
            assert pred["profile"] == "this-host" and pred["step_s"] > 0 and pred["placement"] == r["placement"]
            assert pred["measured_over_predicted"] == pytest.approx(r["median_step_s"] / pred["step_s"])
        assert rec["settings"][0]["placement_spec"] == "stateless"
    # the same model and micro-batch as P1-16, more micro-batches per step: the smoke mode runs
    # 2 x 2 and 2 x 3 sequences (Env.split), so the smoke ratio is 1.5 ...
    for a, b in zip(p16["settings"], p48["settings"], strict=True):
        ca, cb = a["config"], b["config"]
        assert a["n_params"] == b["n_params"] and ca["model_overrides"] == cb["model_overrides"]
        assert (ca["micro_batch_size"], ca["seq_len"]) == (cb["micro_batch_size"], cb["seq_len"])
        assert (ca["grad_accum"], cb["grad_accum"]) == (2, 3)
        assert b["tokens_per_step"] == cb["micro_batch_size"] * cb["seq_len"] * 3 == 1.5 * a["tokens_per_step"]
    # ... and the real parts' split 16 and 48 sequences per step, 3x, at every micro-batch
    for mb in (4, 8, 16):
        env = bench_train.Env(smoke=False, device="cuda", data="", warmup=1, measure=1, profile=False, isolate=False,
                              verbose=False, deadline=0.0, min_job_s=0.0, micro_batch=mb)
        (m16, a16), (m48, a48) = env.split(16), env.split(48)
        assert m16 == m48 == mb and m48 * a48 == 48 == 3 * m16 * a16


def _p5(tmp_path: Path, name: str, *budget: str) -> dict:
    (rec,) = run_bench("bench_train.py", ["--smoke", "--only", "P5", "--quiet", *budget], tmp_path / name)
    assert rec["part"] == "P5" and rec["benchmark"] == "bench_train-smoke-P5" and "partial" not in rec
    assert rec["depths"] == [2, 4] and rec["goal_ratio_at_most"] == 1.1
    assert [r["setting"] for r in rec["settings"]] == ["stateless-2-blocks", "stateless-4-blocks"]
    assert rec["gpu_peak_ratio_deep_over_shallow"] is None  # no GPU peak on the CPU
    for r, blocks in zip(rec["settings"], rec["depths"], strict=True):
        check_mtc_setting(r)
        cfg = r["config"]
        assert r["placement_spec"] == "stateless" and cfg["model_overrides"]["n_layers"] == blocks
        assert cfg["activation_budget_gb"] == rec["activation_budget_gb"]
        assert (cfg["micro_batch_size"], cfg["grad_accum"], cfg["seq_len"], cfg["model_overrides"]["dim"]) == (2, 2, 32, 64)
        assert cfg["compute_dtype"] == "float32" and r["saved_activation_layers"] == []
    return rec


def test_bench_train_smoke_p5_offloads_the_activations_beyond_its_budget(tmp_path):
    # one block input per block and micro-batch, all put during the forward (2 x 32 tokens x 64 x
    # fp32): the smoke default budget, 2^-15 GB, is two of them (the engine's budget is
    # int(gb * 2**30)): it keeps two on the device and offloads the rest, both ways, so a plain
    # `--smoke` run exercises the offload path
    carry = 2 * 32 * 64 * 4
    small = _p5(tmp_path, "small")
    assert small["activation_budget_gb"] == 2 * carry / 2**30
    # 0.5 GB (the default on a GPU) holds every block input at the smoke shape: none offloaded
    large = _p5(tmp_path, "large", "--p5-budget-gb", "0.5")
    assert large["activation_budget_gb"] == 0.5
    for s, g, blocks in zip(small["settings"], large["settings"], small["depths"], strict=True):
        off, kept = s["transfer_per_step"], g["transfer_per_step"]
        assert off["planned"]["activation_bytes_each_way"] == (blocks * 2 - 2) * carry > 0
        assert kept["planned"]["activation_bytes_each_way"] == 0
        # what the engine's activation store counted, per step: the planned bytes; its device peak within the budget
        assert s["offloaded_activation_bytes_per_step"] == (blocks * 2 - 2) * carry and g["offloaded_activation_bytes_per_step"] == 0
        assert s["peak_device_activation_bytes"] == 2 * carry and g["peak_device_activation_bytes"] == blocks * 2 * carry
        assert {"act_out", "act_in"} <= set(s["timeline_s_per_step"]) and "act_out" not in g["timeline_s_per_step"]
        # the copy engine's own counts (exact on the CPU) differ by just the offloaded activations
        moved = {d: off["counted"][f"{d}_bytes"] - kept["counted"][f"{d}_bytes"] for d in ("h2d", "d2h")}
        assert moved == {"h2d": (blocks * 2 - 2) * carry, "d2h": (blocks * 2 - 2) * carry}
        # the same training either way: the offloaded inputs come back bit for bit
        assert s["losses"] == g["losses"] and s["grad_norms"] == g["grad_norms"]


@pytest.mark.slow  # the whole-model line under the Triton interpreter (~10 s)
def test_bench_fusion_model_line_smoke_agrees_with_unfused(tmp_path):
    (rec,) = run_bench("bench_fusion.py", ["--smoke", "--part", "model", "--no-torch-compile", "--model-seqs", "4",
                                           "--model-micro-batch", "2", "--model-seq-len", "8", "--warmup", "0", "--reps", "1"],
                       tmp_path)
    assert rec["benchmark"] == "bench_fusion-model-smoke" and rec["micro_batches"] == 2 and rec["tokens_per_step"] == 32
    assert rec["reference_variant"] == "unfused" and rec["variant_order"] == ["unfused", "mtc_fused", "mtc_fused_saved"]
    fused, saved = rec["results"]["mtc_fused"], rec["results"]["mtc_fused_saved"]
    for r in (fused, saved):  # the blocks that keep their activations compute the same step
        assert r["loss_rel_diff_vs_reference"] < 1e-5 and r["max_rel_grad_norm_diff_vs_reference"] < 1e-5
    assert rec["saved_speedup_vs_fused"] == pytest.approx(fused["median_ms"] / saved["median_ms"])
    assert fused["plan_compile_s"] > 0 and finite(rec["fused_speedup_vs_unfused"])
    assert rec["fused_speedup_vs_unfused"] == pytest.approx(rec["results"]["unfused"]["median_ms"] / fused["median_ms"])
    assert "graph_speedup_vs_unfused" not in rec  # CUDA graphs: CUDA only
    assert rec["goal"].startswith("none")


def test_model_line_traces_in_the_compute_dtype():
    """The H200 run's crash: the stack was traced from an fp32 model, so a bf16 step met fp32
    constants in a matmul. The unfused bf16 step now runs on the CPU."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import model_stack

    kw = dict(seqs=4, micro_batch=2, seq_len=8, warmup=0, reps=1, variants=["unfused"], log=lambda _: None)
    bf16 = model_stack.run_model("smoke", torch.device("cpu"), dtype=torch.bfloat16, **kw)
    fp32 = model_stack.run_model("smoke", torch.device("cpu"), **kw)
    assert bf16["dtype"] == "torch.bfloat16" and fp32["dtype"] == "torch.float32"
    assert bf16["results"]["unfused"]["median_ms"] > 0


def test_bench_train_moves_the_initial_model_into_host_buffers_keeping_values_and_ties():
    """On CUDA the initial model is built on the GPU and moved into the engine's host buffers
    (page-aligned mappings asking for huge pages) instead of torch's allocator; a tied weight stays tied."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import mmap

    import bench_train
    from mtc.models import build

    torch.manual_seed(0)
    model = build("gpt2-tiny", n_layers=1, dim=64, n_heads=4)
    model.lm_head.weight = model.wte.weight  # tie, as GPT-2 checkpoints do
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    got = bench_train.to_host(model)
    assert got is model
    assert model.lm_head.weight is model.wte.weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]) and v.device.type == "cpu"
        assert v.data_ptr() != ptrs[k] and v.data_ptr() % mmap.PAGESIZE == 0, k
    assert all(p.requires_grad for p in model.parameters())


def test_fusion_goal_verdict_takes_the_faster_fused_variant_and_says_which():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_fusion

    cuda = torch.device("cuda")  # the verdict is judged on CUDA runs only; no device is touched
    res = {"unfused": {"median_ms": 26.0}, "mtc_fused": {"median_ms": 22.0}, "mtc_fused_graph": {"median_ms": 20.0},
           "torch_compile": {"median_ms": 21.5}}
    v = bench_fusion.goal_verdict("llama", "block", res, cuda)
    assert v["judged_on"] == "mtc_fused_graph" and v["speedup"]["vs_unfused"] == pytest.approx(1.3)
    assert v["checks"] == {"vs_unfused": True, "vs_torch_compile": True} and v["met"] and v["verdict"] == "met on mtc_fused_graph"
    # GPT-2's block goal is 1.2x unfused: 24 / 20 meets it, Llama's 1.25x would not
    res["unfused"]["median_ms"] = 24.0
    assert bench_fusion.goal_verdict("gpt2", "block", res, cuda)["met"]
    assert bench_fusion.goal_verdict("llama", "block", res, cuda)["checks"]["vs_unfused"] is False
    # eager fused faster than the replay: judged on it; heads have only the torch.compile goal
    res["mtc_fused"]["median_ms"] = 19.0
    head = bench_fusion.goal_verdict("qwen2", "head", res, cuda)
    assert head["judged_on"] == "mtc_fused" and set(head["checks"]) == {"vs_torch_compile"} and head["met"]
    # without torch.compile the verdict is not judged; on the CPU never
    del res["torch_compile"]
    assert bench_fusion.goal_verdict("llama", "block", res, cuda)["met"] is None
    assert bench_fusion.goal_verdict("llama", "block", res, torch.device("cpu"))["verdict"].startswith("not judged")


def test_fusion_verdict_carries_the_per_round_ratios_and_says_when_the_goal_is_within_their_spread():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_fusion

    cuda = torch.device("cuda")  # judged as on CUDA; no device is touched
    # four rounds; round 2 ran everything slower (a power-limited GPU's state): per round the
    # replay is 1.30, 1.30, 1.30, 1.28 x unfused and 1.05, 1.10, 1.00, 1.06 x torch.compile
    graph = [0.020, 0.030, 0.020, 0.020]
    res = {"unfused": {"median_ms": 25.0, "times_s": [0.026, 0.039, 0.026, 0.0256]},
           "mtc_fused": {"median_ms": 22.0, "times_s": [0.022] * 4},
           "mtc_fused_graph": {"median_ms": 20.0, "times_s": graph},
           "torch_compile": {"median_ms": 21.0, "times_s": [0.021, 0.033, 0.020, 0.0212]}}
    p = bench_fusion.paired_speedups(res, "mtc_fused_graph")
    assert p["vs_unfused"]["median"] == pytest.approx(1.30) and p["vs_unfused"]["rounds"] == 4
    assert p["vs_torch_compile"]["median"] == pytest.approx(1.055)
    assert p["vs_torch_compile"]["q1"] < 1.05 < p["vs_torch_compile"]["q3"]
    v = bench_fusion.goal_verdict("llama", "block", res, cuda)
    assert v["judged_on"] == "mtc_fused_graph" and v["paired"]["vs_unfused"] == p["vs_unfused"]
    # 25 / 20 and 21 / 20 meet 1.25x and 1.05x, but 1.05 lies inside the rounds' quartiles
    assert v["met"] and v["within_noise"] == ["vs_torch_compile"] and "within the rounds' spread: torch_compile" in v["verdict"]
    # rounds that agree: nothing within the noise; a variant without times has no paired ratio
    res["torch_compile"]["times_s"] = [0.0222, 0.0333, 0.0222, 0.0222]  # 1.11x in every round
    assert bench_fusion.goal_verdict("llama", "block", res, cuda)["within_noise"] == []
    del res["unfused"]["times_s"]
    assert bench_fusion.paired_speedups(res, "mtc_fused_graph")["vs_unfused"] is None


def test_fusion_attention_choices_pick_the_sequence_length_out_of_the_tuners_keys():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_fusion

    from mtc.kernels import flash_attention as fa
    from mtc.kernels.tuning import key_name

    # keys as the tuner stores them: T (8192) and D (128) differ, so the position is checked
    q, k = torch.empty(2, 32, 8192, 128, device="meta"), torch.empty(2, 8, 8192, 128, device="meta")
    key = fa._tuning_key(q, k, True)
    choices = {key_name(("fwd", "cuda_half", *key)): {"BACKEND": "cudnn"},
               key_name(("dq", "cuda_half", *key)): {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
               key_name(("fwd", "cuda_half", *fa._tuning_key(q[:, :, :512], k[:, :, :512], True))): "other"}
    assert bench_fusion.attention_choices(choices, 8192) == {"fwd": "cudnn", "dq": "64x64 w4 s2"}


def test_kernel_diff_names_the_kernels_that_changed():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from launch_count import kernel_diff

    eager = {"gpu_ms_total": 3.0, "top": [{"kernel": "gemm", "calls": 4, "ms": 2.0}, {"kernel": "k_a", "calls": 1, "ms": 1.0}]}
    replay = {"gpu_ms_total": 3.6, "top": [{"kernel": "gemm", "calls": 4, "ms": 2.5}, {"kernel": "k_a", "calls": 1, "ms": 0.9},
                                          {"kernel": "memcpy", "calls": 2, "ms": 0.2}]}
    d = kernel_diff(eager, replay)
    assert math.isclose(d["gpu_ms_diff"], 0.6)
    assert [r["kernel"] for r in d["top"]] == ["gemm", "memcpy", "k_a"]
    assert math.isclose(d["top"][0]["diff_ms"], 0.5) and d["top"][1]["base_calls"] == 0


def test_records_say_the_hosts_huge_page_mode():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import common

    mode = common.environment()["thp"]
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert mode in ("always", "madvise", "never")
    else:
        assert mode is None


def test_compute_floor_takes_the_least_matmul_and_attention_time_of_any_variant():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from launch_count import compute_floor, kernel_class

    assert kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_class("void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn_align1>") == "matmul"
    assert kernel_class("_fused_mm_kernel") == "matmul"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert kernel_class("_attn_bwd_dkdv_kernel") == "attention"
    assert kernel_class("k_c152951b99bf8632") == kernel_class("triton_poi_fused_mul_silu_0") == "other"

    def table(*rows: tuple[str, float]) -> dict:
        return {"gpu_ms_total": sum(ms for _, ms in rows), "top": [{"kernel": k, "calls": 1, "ms": ms} for k, ms in rows]}

    tables = {"unfused": table(("nvjet_a", 10.0), ("cudnn_sdpa_fprop", 3.0), ("elementwise", 5.0)),
              "mtc_fused": table(("nvjet_a", 10.5), ("_attn_fwd_kernel", 2.0), ("k_1", 1.5)),
              "torch_compile": table(("nvjet_a", 10.2), ("cudnn_sdpa_fprop", 3.0), ("triton_poi_x", 1.0))}
    f = compute_floor(tables, {"unfused": 20.0, "mtc_fused": 15.0, "torch_compile": 15.6})
    assert f["floor_variant"] == "mtc_fused" and math.isclose(f["floor_ms"], 12.5)
    assert f["split_ms"]["unfused"] == {"matmul": 10.0, "attention": 3.0, "other": 5.0}
    assert math.isclose(f["best_possible_vs_unfused"], 20.0 / 12.5)
    assert math.isclose(f["best_possible_vs_torch_compile"], 15.6 / 12.5)
    assert compute_floor({}, {}) is None


def test_generated_bytes_counts_each_kernels_inputs_and_outputs(tmp_path):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from launch_count import generated_bytes

    from mtc.compiler import compile_template
    from mtc.models import build
    from mtc.tracer import trace

    prog = trace(build("tiny", n_layers=1), 1, 8)
    t = prog.templates[prog.layers[1].template]
    full = compile_template(t, tmp_path, matmul_fusion="off", joint_outputs=True)
    lean = compile_template(t, tmp_path, matmul_fusion="off")
    want = 0
    for n in full.forward_graph.nodes:
        if n.op == "call_function" and hasattr(n.target, "out_specs"):
            want += sum(a.meta["val"].numel() * 4 for a in n.args if isinstance(a, torch.fx.Node))
            want += sum(math.prod(s) * 4 for s, _ in n.target.out_specs)  # fp32 model: 4 bytes everywhere
    assert generated_bytes(full.forward_graph) == want > 0
    # the backward visit's joint graph does not recompute the block's output (its residual add's kernel goes)
    assert 0 < generated_bytes(lean.joint_graph) < generated_bytes(full.joint_graph)


def test_fusion_timing_interleaves_variants_and_shuffles_their_order():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_fusion

    calls: list[str] = []
    names = ("a", "b", "c", "d")
    variants = {n: (lambda n=n: calls.append(n)) for n in names}
    reps = 24
    timed = bench_fusion._time_all(variants, torch.device("cpu"), warmup=1, reps=reps)
    # warm-up of each in order, then rounds that call each variant once
    assert calls[:4] == list(names)
    rounds = [calls[4 + 4 * r : 8 + 4 * r] for r in range(reps)]
    assert all(sorted(r) == list(names) for r in rounds) and len(calls) == 4 + 4 * reps
    # in an order that changes: every variant follows several others (a rotation gave each the same one)
    before = {n: {r[i - 1] for r in rounds for i in range(1, 4) if r[i] == n} for n in names}
    assert all(len(p) >= 2 for p in before.values()), before
    # and is the same run to run (seeded): two benchmarks of one machine compare alike
    again: list[str] = []
    bench_fusion._time_all({n: (lambda n=n: again.append(n)) for n in names}, torch.device("cpu"), warmup=1, reps=reps)
    assert again == calls
    for n in variants:
        assert len(timed[n]["times_s"]) == reps and timed[n]["gpu_span_ms"] == []
        assert all(a <= b for a, b in timed[n]["intervals"])
    # a variant's intervals are its own calls: they do not overlap another variant's
    spans = sorted((a, b, n) for n in variants for a, b in timed[n]["intervals"])
    assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))


def test_clock_samples_are_attributed_to_the_calls_they_fall_in(monkeypatch):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from gpu_clocks import POWER_BITS, Sample, attribute, nvml_index, parse_smi_line

    samples = [Sample(0.5, 1980, 500, 0), Sample(1.5, 1700, 690, 0x4), Sample(1.7, 1650, 700, 0x4 | 0x20),
               Sample(2.5, 1900, 300, None), Sample(9.0, 1000, 100, 0)]
    got = attribute(samples, {"eager": [(0.0, 1.0), (2.0, 3.0)], "replay": [(1.0, 2.0)], "none": [(5.0, 6.0)]})
    assert got["eager"]["samples"] == 2 and got["eager"]["sm_mhz_median"] == 1940 and got["eager"]["sm_mhz_min"] == 1900
    assert got["eager"]["power_limited_frac"] == 0.0  # the sample without reason bits is not counted in fractions
    assert got["replay"]["power_limited_frac"] == 1.0 and got["replay"]["thermal_limited_frac"] == 0.5
    assert got["none"] == {"samples": 0}
    s = parse_smi_line("1980, 612.34, 0x0000000000000004\n", 3, 7.0)
    assert s == Sample(7.0, 1980.0, 612.34, 4) and s.reasons & POWER_BITS
    assert parse_smi_line("1980, 612.34\n", 2, 1.0).reasons is None
    assert parse_smi_line("[N/A], 612.34, 0x0\n", 3, 1.0) is None and parse_smi_line("clocks.sm, power.draw", 3, 1.0) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")  # torch's device 0 is NVML's 3
    assert (nvml_index(0), nvml_index(1), nvml_index(2)) == (3, 1, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3a")  # a UUID: no index to map to
    assert nvml_index(0) == 0


def test_clock_sampler_streams_nvidia_smi_and_falls_back_to_older_field_names(tmp_path, monkeypatch):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import gpu_clocks

    # a stand-in nvidia-smi that knows only the older reasons field and streams with --loop-ms
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *clocks_event_reasons*) echo 'Field is not a valid field' >&2; exit 2;; esac\n"
                    "case \"$*\" in *--loop-ms*) while true; do echo '1755, 650.5, 0x0000000000000004'; sleep 0.01; done;; esac\n"
                    "echo '1980, 120.0, 0x0000000000000000'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(gpu_clocks, "_nvml_reader", lambda index: None)  # as on a box without pynvml
    with gpu_clocks.ClockSampler(0, period_s=0.01) as s:
        deadline = time.monotonic() + 10
        while len(s.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "clocks_throttle_reasons.active" in s.source
    assert len(s.samples) >= 3 and all(x.sm_mhz == 1755 and x.reasons == 4 for x in s.samples)
    assert s._proc is not None and s._proc.poll() is not None  # the stream was ended


def test_clock_sampler_without_a_source_records_nothing(monkeypatch):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import gpu_clocks

    monkeypatch.setattr(gpu_clocks, "_nvml_reader", lambda index: None)
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    s = gpu_clocks.ClockSampler(0).start()
    assert s.stop() == [] and s.source.startswith("unavailable")


def test_layernorm_gradients_cast_and_combine_in_one_second_stage(tmp_path):
    # GPT-2's LayerNorm weight and bias gradients: summed in fp32, cast to bf16; the casts fold
    # into the column kernel, whose outputs combine in one launch (they were 4 casts + 4 combines)
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from launch_count import second_stage_launches

    from mtc.compiler import compile_template
    from mtc.models import build
    from mtc.tracer import trace

    with torch.device("meta"):
        model = build("gpt2-tiny", n_layers=1, vocab_size=512, dim=256, n_heads=4).to(torch.bfloat16)
    prog = trace(model, 1, 64)
    ct = compile_template(prog.templates[prog.layers[1].template], tmp_path, matmul_fusion="off")
    cols = [n.target for n in ct.joint_graph.nodes if getattr(n.target, "mode", None) in ("column", "rowcol")]
    # each LayerNorm's weight and bias gradients: in the kernel of its input gradient (rowcol),
    # both bf16, combined by one second-stage launch
    ln = [k for k in cols if k.mode == "rowcol"]
    assert len(ln) == 2
    for k in ln:
        combined = [dt for (_, dt), c in zip(k.out_specs, k.combine, strict=True) if c is not None]
        assert len(combined) >= 2 and set(combined) == {torch.bfloat16} and k.second_stage_launches == 1
    assert second_stage_launches(ct.joint_graph) == sum(k.second_stage_launches for k in cols) == len(cols)
    # no kernel of the graph only casts a (N,) vector any more
    assert not any(getattr(n.target, "mode", None) == "pointwise" and len(n.target.shape) == 1 for n in ct.joint_graph.nodes)


def test_bench_saves_smoke(tmp_path):
    # the A/B of saved activations: both settings in every round, the same losses (the unfused
    # blocks' kept graphs compute the recomputing step bit for bit), the ratio from the medians
    (rec,) = run_bench("bench_saves.py", ["--dim", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--layers", "2",
                                          "--micro-batch", "2", "--seq", "16", "--warmup", "1", "--steps", "2", "--rounds", "2"],
                       tmp_path)
    assert rec["benchmark"] == "bench_saves" and rec["kernels"] == "unfused" and len(rec["rounds"]) == 4
    by = {(r["round"], r["save_activations"]): r for r in rec["rounds"]}
    for r in range(2):
        assert by[(r, "all")]["saved_blocks"] == [1, 2] and by[(r, "off")]["saved_blocks"] == []
        assert by[(r, "all")]["losses"] == by[(r, "off")]["losses"]
    med = rec["median_step_s"]
    assert rec["recompute_over_save"] == pytest.approx(med["off"] / med["all"])


def test_bench_fusion_block_smoke_times_the_backward_from_saved_values(tmp_path):
    # GPT-2's block on the CPU (interpreter): beside the backward visit's joint graph
    # (mtc_fused_backward), the backward of a block that kept its activations, checked on the
    # same gradients, with its launches and what it keeps
    (rec,) = run_bench("bench_fusion.py", ["--smoke", "--arch", "gpt2", "--part", "block", "--no-torch-compile",
                                           "--warmup", "0", "--reps", "1"], tmp_path)
    assert {"mtc_fused_backward", "mtc_fused_saved_backward"} <= set(rec["results"])
    assert rec["max_rel_grad_diff_vs_unfused"]["mtc_fused_saved_backward"] < 1e-5
    info = rec["saved_activations"]
    assert info["saved_bytes_per_call"] > 0 and info["launches"]["backward"] < info["launches"]["joint_without_output"]
    # the compile's candidate timing and the launches it chose: none on the CPU, which times nothing
    assert 0 <= rec["tuning_s"] <= rec["compile_s"] and rec["generated_launches"] == {}
    # each configuration's own launch choices (none on the CPU), and every variant's enqueue time,
    # at most its wall time (on the CPU they are the same call, without a device to wait for)
    assert all(m["generated_launches"] == {} for m in rec["matmul_fusion"].values())
    assert all(0 < r["enqueue_median_ms"] <= r["median_ms"] for r in rec["results"].values())


def test_generated_kernel_bandwidth_joins_cpu_bytes_and_profiled_time(tmp_path):
    # bench_fusion's per-kernel GB/s: each generated kernel of the graph (by name, mode, calls and
    # bytes, counted on the CPU) beside its profiled time; kernels the profile lacks are left out
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from launch_count import generated_bytes, generated_kernels, kernel_bandwidth

    from mtc.compiler import compile_template
    from mtc.models import build
    from mtc.tracer import trace

    with torch.device("meta"):
        model = build("tiny", n_layers=1, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512).to(torch.bfloat16)
    prog = trace(model, 1, 64)
    ct = compile_template(prog.templates[prog.layers[1].template], tmp_path, matmul_fusion="off")
    ks = generated_kernels(ct.joint_graph)
    assert sum(k["bytes"] for k in ks.values()) == generated_bytes(ct.joint_graph)
    assert "rowcol" in {k["mode"] for k in ks.values()}  # the RMSNorm backwards, one kernel each
    name, k = next(iter(ks.items()))
    table = {"top": [{"kernel": name, "calls": k["calls"], "ms": 0.5}, {"kernel": "nvjet_gemm", "calls": 1, "ms": 2.0}]}
    bw = kernel_bandwidth(ks, table)
    assert list(bw) == [name] and bw[name]["gb_per_s"] == pytest.approx(k["bytes"] / 0.5e-3 / 1e9)


def test_bench_fusion_keeps_going_when_a_side_configuration_fails(monkeypatch, capsys):
    # a GPU session is short: a configuration beside the judged one that fails (here the rowcol
    # A/B) is recorded, and the block's record still has every other variant
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_fusion

    real = bench_fusion.compile_template

    def failing(t, cache, **kw):
        if not kw.get("row_and_column", True):
            raise RuntimeError("no rowcol today")
        return real(t, cache, **kw)

    monkeypatch.setattr(bench_fusion, "compile_template", failing)
    rec = bench_fusion.run("gpt2", "block", True, torch.device("cpu"), 16, 1, 1, False)
    assert "no rowcol today" in rec["variant_errors"][str(("flash", "auto", True, False))]
    assert "mtc_fused_no_rowcol" not in rec["results"]
    assert {"unfused", "mtc_fused", "mtc_fused_backward", "mtc_fused_saved_backward"} <= set(rec["results"])


def test_idle_gaps_merge_overlaps_and_name_the_neighbours():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from launch_count import idle_gaps

    # a copy, a kernel overlapping it, a 30 us gap, a long kernel that a short one runs inside, a 5 us gap
    tl = idle_gaps([("k2", 15.0, 40.0), ("copy", 0.0, 20.0), ("k3", 70.0, 200.0), ("k4", 80.0, 90.0), ("k5", 205.0, 210.0)])
    assert tl["span_ms"] == pytest.approx(0.21)
    assert tl["idle_ms"] == pytest.approx(0.035)
    assert tl["gaps"][0] == {"ms": pytest.approx(0.03), "after": "k2", "before": "k3"}
    assert tl["gaps"][1]["after"] == "k3" and tl["gaps"][1]["ms"] == pytest.approx(0.005)
    assert idle_gaps([]) == {"span_ms": 0.0, "idle_ms": 0.0, "gaps": []}


def test_p3_judges_its_goal_on_the_checkpointed_baselines_and_reports_the_others_beside(monkeypatch):
    """Issue 8's P3 baselines checkpoint their blocks; torch.compile without checkpointing runs too
    and has its own ratio, which the goal does not take."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_train

    tps = {"auto": 100.0, "stateless": 60.0, "torch_compile_no_ckpt": 125.0, "torch_compile": 80.0, "torch_eager": 50.0}

    def fake_run(env, part, setting, kind, cfg, **extra):
        rec = {"setting": setting, "tokens_per_s": tps[setting]}
        if kind == "resident":
            rec["activation_checkpointing"] = extra["checkpoint"]
        return rec

    monkeypatch.setattr(bench_train, "_run", fake_run)
    env = bench_train.Env(smoke=False, device="cuda", data="", warmup=1, measure=1, profile=False, isolate=False,
                          verbose=False, deadline=0.0, min_job_s=0.0, micro_batch=4)
    rec = bench_train.part_p3(env, ["auto", "stateless"], 16, True)
    assert [b["setting"] for b in rec["baselines"]] == ["torch_compile_no_ckpt", "torch_compile", "torch_eager"]
    assert rec["baseline_best_tokens_per_s"] == 80.0 and rec["ratio_mtc_over_baseline"] == pytest.approx(1.25)
    assert rec["baseline_best_any_tokens_per_s"] == 125.0 and rec["ratio_mtc_over_any_baseline"] == pytest.approx(0.8)


def test_sibling_matmuls_smoke_records_each_groups_ways_and_checks_merged_results(tmp_path):
    (rec,) = run_bench("bench_sibling_matmuls.py", ["--smoke"], tmp_path, timeout=120)
    assert rec["benchmark"] == "bench_sibling_matmuls-smoke" and rec["smoke"]
    groups = rec["results"]["smoke"]
    # SMOKE: dim 64, head dim 16, 4 heads, 2 KV heads, ffn 160
    assert groups["qkv"]["widths"] == [64, 32, 32] and groups["gate_up"]["widths"] == [160, 160]
    for g in groups.values():
        assert g["ok"] and max(g["max_rel_err"].values()) < 1e-4
        assert set(g["ms"]) == {"fwd_separate", "fwd_merged", "dx_separate", "dx_merged", "dw_separate", "dw_merged",
                                "cat", "add"}
        assert all(finite(v) and v > 0 for v in g["ms"].values())
        # the saving with the cat is the saving without it less the cat's time
        assert math.isclose(g["saved_ms_per_joint"] - g["saved_ms_per_joint_with_cat"], g["ms"]["cat"], rel_tol=1e-9)


def test_sibling_matmuls_refuses_real_shapes_without_a_gpu():
    proc = subprocess.run([sys.executable, str(BENCH / "bench_sibling_matmuls.py"), "--no-record"], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode != 0 and "--smoke checks the script" in proc.stderr


def test_merged_group_results_match_separate_ones_and_a_wrong_layout_would_show():
    sys.path.insert(0, str(BENCH))
    import bench_sibling_matmuls as sib

    r = sib.measure_group(32, 48, [48, 16, 16], torch.device("cpu"), torch.float32, rounds=1)
    assert r["ok"] and max(r["max_rel_err"].values()) < 1e-5
    # the check compares merged against separate products: a merged weight that is not the
    # weights side by side (k's and v's rows swapped) shows in both products that read it (the
    # weight gradient reads no weight)
    g = torch.Generator().manual_seed(1)
    widths = [48, 16, 16]
    ws = [torch.randn(w, 48, generator=g) for w in widths]
    x, dys = torch.randn(32, 48, generator=g), [torch.randn(32, w, generator=g) for w in widths]
    assert max(sib.merged_errors(x, ws, torch.cat(ws), dys, widths).values()) < 1e-5
    swapped = sib.merged_errors(x, ws, torch.cat([ws[0], ws[2], ws[1]]), dys, widths)
    assert swapped["fwd"] > 0.1 and swapped["dx"] > 0.1 and swapped["dw"] < 1e-6


def test_a_setting_records_and_prints_its_modelled_gpu_work_over_the_kernels_busy_time(capsys):
    """The cost model's GPU side beside the profiled step (what tests/mtc/test_costmodel_h100.py
    checks on the records): modelled compute + GPU optimizer over the kernel busy time."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_train

    rec = json.loads((BENCH / "results" / "bench_train-P3-vm-20261127T220307.json").read_text())
    s = next(x for x in rec["settings"] if x["setting"] == "auto")
    s["predicted_by_mtc_plan"].pop("gpu_work_modelled_s", None)
    bench_train._compute_check(s)
    pred, busy = s["predicted_by_mtc_plan"], s["gpu_profile"]["kernel_busy_s"]
    assert pred["gpu_work_modelled_s"] == pytest.approx(pred["stages_s"]["GPU compute"] + pred["stages_s"]["GPU optimizer"])
    assert pred["gpu_work_modelled_over_kernel_busy"] == pytest.approx(pred["gpu_work_modelled_s"] / busy)
    bench_train.print_table({"P3": {"settings": [s], "baselines": []}})
    assert f"the profiled step's kernels {busy:.3f} s ({pred['gpu_work_modelled_over_kernel_busy']:.2f}x)" in capsys.readouterr().out
    no_profile = {"predicted_by_mtc_plan": dict(pred, gpu_work_modelled_s=None), "gpu_profile": {"error": "CUPTI"}}
    no_profile["predicted_by_mtc_plan"].pop("gpu_work_modelled_over_kernel_busy")
    bench_train._compute_check(no_profile)
    assert "gpu_work_modelled_over_kernel_busy" not in no_profile["predicted_by_mtc_plan"]
