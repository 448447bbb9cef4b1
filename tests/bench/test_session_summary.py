"""bench/session_summary.py: the last screen of a GPU session, rebuilt from the records it wrote
(real records of earlier GPU sessions stand in for a call's), and nothing from before the call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"


def _summary(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / "session_summary.py"), *args], capture_output=True, text=True,
                          cwd=BENCH.parent, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_summary_prints_this_calls_tables_and_verdicts_and_skips_older_records(tmp_path):
    marker = tmp_path / "since"
    marker.write_text("")
    old = tmp_path / "bench_train-P1-48-vm-old.json"  # written before the call started: not this call's
    shutil.copy(RESULTS / "bench_train-P1-48-vm-20261126T151951.json", old)
    os.utime(old, (1, 1))
    os.utime(marker, (100, 100))
    for name in ("bench_train-P3-vm-20261126T152231.json", "bench_fusion-vm-20261126T194042.json",
                 "kernel_compile_check-vm-20261127T163409.json"):
        shutil.copy(RESULTS / name, tmp_path / name)
    # a P1-16 part the time limit cut after its first setting: the record keeps what finished
    full = json.loads((RESULTS / "bench_train-P1-16-vm-20261126T170606.json").read_text())
    first = full["settings"][0]
    partial = {"benchmark": "bench_train", "part": "P1-16", "smoke": False, "partial": "the part did not finish",
               "settings_done": {first["setting"]: first}, "device": full["device"], "git_sha": full["git_sha"]}
    (tmp_path / "bench_train-P1-16-vm-cut.json").write_text(json.dumps(partial))
    (tmp_path / "bench_sibling_matmuls-vm-x.json").write_text(json.dumps(
        {"benchmark": "bench_sibling_matmuls", "results": {"P3": {"qkv": {"saved_ms_per_joint": 0.125,
                                                                          "saved_ms_per_joint_with_cat": -0.25}}}}))
    log = tmp_path / "gpu_tests.log"
    log.write_text("tests/a.py::test_x PASSED\nFAILED tests/b.py::test_y - RuntimeError: boom\n"
                   "============ 1 failed, 1 passed in 3.00s ============\n")

    out = _summary(["--newer", str(marker), "--dir", str(tmp_path), "--tests-log", str(log)])

    assert "1 failed, 1 passed" in out and "FAILED tests/b.py::test_y" in out
    assert "P1-48" not in out, "a record older than the call was summarised"
    # P1-16's finished setting and its goal line, though the part was cut off
    assert f"P1-16  {first['setting']}" in out and f"{first['model_tflops']:.1f}" in out
    assert "P1-16  goal: stateless >= 230" in out
    p3 = json.loads((RESULTS / "bench_train-P3-vm-20261126T152231.json").read_text())
    assert f"mtc best / baseline best tokens/s: {p3['ratio_mtc_over_baseline']:.2f}" in out
    # the block: every variant's median and the goal table's verdict
    block = json.loads((RESULTS / "bench_fusion-vm-20261126T194042.json").read_text())
    for v, r in block["results"].items():
        assert f"llama/block  {v:22s} {r['median_ms']:8.2f} ms" in out
    assert "llama/block" in out and block["goal"]["verdict"] in out
    assert "kernel_compile_check: kernel_compile_check-vm-20261127T163409.json" in out
    assert "siblings P3: merged matmuls save per joint call qkv 0.125 ms (-0.250 with the cat)" in out
    assert "records: 5;" in out


def test_summary_reports_an_unreadable_record_a_missing_tests_log_and_parts_cut_before_their_ratio(tmp_path):
    bad = tmp_path / "bench_train-P3-vm-torn.json"
    bad.write_text('{"benchmark": "bench_tr')
    cut = []
    for part, name in (("P3", "bench_train-P3-vm-20261126T152231.json"), ("P5", "bench_train-P5-vm-20261126T170750.json")):
        first = json.loads((RESULTS / name).read_text())["settings"][0]
        cut.append(tmp_path / f"{part}-cut.json")
        cut[-1].write_text(json.dumps({"benchmark": "bench_train", "part": part, "partial": "cut",
                                       "settings_done": {first["setting"]: first}}))
    out = _summary([str(bad), *map(str, cut), "--tests-log", str(tmp_path / "nope.log")])
    assert f"cannot read {bad}" in out
    assert "gpu tests: no log" in out
    assert "P3     mtc best / baseline best tokens/s: - (goal" in out  # no ratio yet: said, not a crash
    assert "P5     stateless-10-blocks" in out and "GPU peak 40 / 10" not in out
    assert "records: 2;" in out


def test_a_profiled_part_says_where_each_variants_time_goes():
    name = "bench_fusion-vm-20261127T114300.json"  # the H200's Llama head, profiled
    rec = json.loads((RESULTS / name).read_text())
    out = _summary([str(RESULTS / name)])
    for v, sp in rec["compute_floor"]["split_ms"].items():
        busy, med = rec["profile"][v]["gpu_ms_total"], rec["results"][v]["median_ms"]
        assert (f"llama/head     {v:20s} matmul {sp['matmul']:.2f}, attention {sp['attention']:.2f}, other kernels "
                f"{sp['other']:.2f} ms, GPU busy {busy:.2f} of {med:.2f} ms") in out


def test_one_unreadable_section_does_not_hide_the_others(tmp_path):
    p3 = tmp_path / "p3.json"
    shutil.copy(RESULTS / "bench_train-P3-vm-20261126T152231.json", p3)
    odd = tmp_path / "p5.json"  # a bench_train record whose settings are not what the table reads
    odd.write_text(json.dumps({"benchmark": "bench_train", "part": "P5", "settings": [{"setting": "x", "median_step_s": "?"}]}))
    block = tmp_path / "block.json"
    rec = json.loads((RESULTS / "bench_fusion-vm-20261126T194132.json").read_text())
    del rec["fused_speedup_vs_unfused"]  # the goal table reads it
    block.write_text(json.dumps(rec))
    out = _summary([str(p3), str(odd), str(block)])
    assert "session summary: bench_train's P5 could not be printed" in out
    assert "P3     mtc best / baseline best tokens/s" in out  # P3's rows still there
    assert "session summary: bench_fusion's goal table could not be printed (KeyError" in out
    assert "qwen2/block  unfused" in out  # the block's medians still there
    assert "records: 3;" in out


def test_the_whole_model_line_is_printed_as_bench_fusion_prints_it_with_each_variants_step(tmp_path):
    rec = {"benchmark": "bench_fusion-model", "part": "model", "shape": "1.5b", "n_params": 1.53e9, "tokens_per_step": 16384,
           "results": {"unfused": {"median_ms": 500.0}, "mtc_fused": {"median_ms": 400.0}, "torch_compile": {"error": "x"}},
           "fused_speedup_vs_unfused": 1.25}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(rec))
    out = _summary([str(path)])
    assert "model/1.5b  1.53B, 16384 tokens per step: fused vs unfused 1.25x (issue 9 states no goal" in out
    assert "model/1.5b  ms per step: unfused 500.0, mtc_fused 400.0\n" in out


def test_a_tests_log_whose_closing_line_counts_no_pass_or_failure_is_reported_as_it_ended(tmp_path):
    """Every gpu test skipped (a box whose torch does not see its GPU) or none selected: the run
    ended and its closing line says how, not that the log was cut off."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from session_summary import tests_outcome

    for closing in ("============================= 75 skipped in 45.88s =============================",
                    "=================== 1269 deselected in 10.14s ===================",
                    "============================ no tests ran in 0.01s ============================"):
        log = tmp_path / "gpu_tests.log"
        log.write_text("============================= slowest 8 durations ==============================\n"
                       "0.01s teardown tests/a.py::test_x\n" + closing + "\n")
        assert tests_outcome(log) == [closing]
    # the slowest-durations header alone is no closing line: a run cut off before pytest finished
    log.write_text("============================= slowest 8 durations ==============================\n")
    assert tests_outcome(log) == ["gpu tests: no closing line in the log (cut off?)"]


def test_a_tests_log_of_two_runs_reports_both_closing_lines_and_every_failure(tmp_path):
    """gpu_session.sh runs the gpu tests that time the GPU after the others, into the same log: both
    runs' outcomes are reported, a failure in either included."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from session_summary import tests_outcome

    first = "================== 1 failed, 55 passed, 1300 deselected in 57.10s =================="
    second = "======================= 1 passed, 1355 deselected in 21.30s ======================="
    log = tmp_path / "gpu_tests.log"
    log.write_text("FAILED tests/a.py::test_x - AssertionError\n" + first + "\n"
                   "tests/mtc/test_planner.py::test_gpu_calibrate PASSED\n" + second + "\n")
    assert tests_outcome(log) == [first, second, "FAILED tests/a.py::test_x - AssertionError"]
