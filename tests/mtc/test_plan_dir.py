"""Plan directories as files: what `save_plan`, `mtc trace` and `mtc compile` leave in them, and
what a run from a plan says when the plan's compiled templates did not serve it."""

from __future__ import annotations

import json
import types

from mtc.cli import main
from mtc.config import TrainConfig
from mtc.plan import REPORT_FILE, compile_command, load_plan, save_plan
from mtc.tracer import trace
from mtc.train import build_model, plan_refresh_note
from mtc.user_model import program_fingerprint, read_model_record

TINY = {"n_layers": 1, "dim": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}


def _program(seq_len: int = 8):
    cfg = TrainConfig(model="tiny", model_overrides=TINY, micro_batch_size=1, seq_len=seq_len)
    return trace(build_model(cfg, device="meta"), 1, seq_len, name="tiny")


def test_a_new_program_in_a_plan_directory_drops_the_old_programs_report_and_constants(tmp_path):
    save_plan(_program(8), tmp_path)
    (tmp_path / REPORT_FILE).write_text("{}")
    save_plan(_program(8), tmp_path)  # the same program again: its report still describes it
    assert (tmp_path / REPORT_FILE).is_file()
    (tmp_path / "constants.safetensors").write_bytes(b"of another program")
    save_plan(_program(16), tmp_path)
    assert not (tmp_path / REPORT_FILE).exists()
    assert not (tmp_path / "constants.safetensors").exists()
    assert load_plan(tmp_path).batch["ids"].shape[1] == 16
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_mtc_trace_records_the_programs_fingerprint_and_a_retrace_drops_a_stale_report(tmp_path, capsys):
    plan = tmp_path / "plan"
    assert main(["trace", "tiny", "-o", str(plan), "--seq-len", "16", "--micro-batch-size", "1", "--meta"]) == 0
    (plan / REPORT_FILE).write_text(json.dumps({"plan": {"compiled": 3}}))  # as `mtc compile` of seq 16 left it
    assert main(["trace", "tiny", "-o", str(plan), "--seq-len", "32", "--micro-batch-size", "1", "--meta"]) == 0
    rec = read_model_record(plan)
    assert rec["seq_len"] == 32 and rec["program_sha256"] == program_fingerprint(load_plan(plan))
    assert not (plan / REPORT_FILE).exists()


def test_compile_command_names_the_model_as_each_kind_of_plan_is_compiled():
    fields = {"model": "8b", "micro_batch_size": 2, "seq_len": 4096, "compute_dtype": "bfloat16", "matmul_fusion": "auto"}
    assert compile_command("p", fields) == ("mtc compile 8b --micro-batch-size 2 --seq-len 4096 --dtype bfloat16 "
                                            "--matmul-fusion auto -o p")
    assert compile_command("p", fields | {"model": "pkg.mod:build"}, seq_len=8, compute_dtype="auto") == (
        "mtc compile --model pkg.mod:build --micro-batch-size 2 --seq-len 8 --dtype bfloat16 --matmul-fusion auto -o p")
    custom = compile_command("p", {"model": "custom", "micro_batch_size": 1, "seq_len": 64, "compute_dtype": "float32"})
    assert custom.startswith("mtc.compile(model, 'p', batch_size=1, seq_len=64, dtype='float32')"), custom


def _compiled(*loaded: bool) -> dict:
    return {f"t{i}": types.SimpleNamespace(loaded=x, seconds=1.5) for i, x in enumerate(loaded)}


def test_a_run_from_a_plan_that_compiled_templates_says_how_to_refresh_the_plan(tmp_path, capsys):
    plan = tmp_path / "plan"
    assert main(["trace", "tiny", "-o", str(plan), "--seq-len", "16", "--micro-batch-size", "1", "--meta",
                 "--dtype", "float32"]) == 0
    assert plan_refresh_note(plan, _compiled(True, True)) is None  # everything loaded: nothing to say
    note = plan_refresh_note(plan, _compiled(False, True, False))
    assert note.startswith(f"plan {plan}: 2 of 3 templates compiled for this run (it holds none: traced, not compiled; 3.0 s)")
    assert f"`mtc compile tiny --micro-batch-size 1 --seq-len 16 --dtype float32 --matmul-fusion auto -o {plan}` refreshes the plan" in note
    (plan / "kernels" / "compiled").mkdir(parents=True)
    assert "stale or missing: the lines above say which" in plan_refresh_note(plan, _compiled(False))
