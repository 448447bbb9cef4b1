"""Traced programs of presets kept between processes (`mtc.trace_cache`)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtc import trace_cache as tc
from mtc.config import TrainConfig
from mtc.errors import ConfigError
from mtc.graphs.serialize import program_to_dict
from mtc.tracer import trace
from mtc.train import build_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "programs"
    monkeypatch.setenv(tc.CACHE_ENV, str(d))
    return d


@pytest.fixture
def traces(monkeypatch):
    """The traces `trace_preset` runs (it reads the cache otherwise)."""
    calls = []
    fresh = tc._fresh

    def counting(cfg, name):
        calls.append((cfg.model, name))
        return fresh(cfg, name)

    monkeypatch.setattr(tc, "_fresh", counting)
    return calls


def _cfg(model: str = "tiny", **kw: object) -> TrainConfig:
    return TrainConfig(model=model, micro_batch_size=kw.pop("micro_batch_size", 2), seq_len=kw.pop("seq_len", 16), **kw)


@pytest.mark.parametrize("model", ["tiny", "gpt2-tiny", "qwen2-tiny"])
def test_a_cached_program_is_the_program_a_fresh_trace_gives(cache, traces, model):
    cfg = _cfg(model)
    first, again = tc.trace_preset(cfg), tc.trace_preset(cfg)
    assert len(traces) == 1 and len(list(cache.glob("*.json"))) == 1
    fresh = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    assert program_to_dict(again) == program_to_dict(first) == program_to_dict(fresh)


def test_everything_the_trace_depends_on_is_in_the_key(cache, traces, monkeypatch):
    base = _cfg()
    variants = [_cfg(micro_batch_size=3), _cfg(seq_len=8), _cfg(compute_dtype="bfloat16"),
                _cfg(model_overrides={"n_layers": 3}), _cfg(model_overrides={"rope_theta": 500000.0}), _cfg("qwen2-tiny")]
    keys = {tc.trace_key(c) for c in [base, *variants]} | {tc.trace_key(base, name="tiny")}
    assert len(keys) == len(variants) + 2
    assert tc.trace_key(dataclasses.replace(base, steps=7, seed=9, placement="disk")) == tc.trace_key(base)  # not the run's fields
    before = tc.trace_key(base)
    monkeypatch.setattr(tc.torch, "__version__", "0.0.0-other")
    assert tc.trace_key(base) != before
    monkeypatch.undo()
    monkeypatch.setenv(tc.CACHE_ENV, str(cache))
    tc._source_hash.cache_clear()
    monkeypatch.setattr(tc, "_source_roots", lambda: (ROOT / "mtc" / "models",))  # other code, other key
    try:
        assert tc.trace_key(base) != before
    finally:
        tc._source_hash.cache_clear()


def test_a_damaged_entry_is_traced_again_and_replaced(cache, traces):
    cfg = _cfg()
    tc.trace_preset(cfg)
    (entry,) = cache.glob("*.json")
    for junk in ("{", json.dumps({"format": "something else"}), ""):
        entry.write_text(junk)
        program = tc.trace_preset(cfg)
        assert json.loads(entry.read_text()) == program_to_dict(program)
    assert len(traces) == 4


def test_a_patched_model_method_bypasses_the_cache(cache, traces, monkeypatch):
    from mtc.models import llama

    cfg = _cfg()
    kept = tc.trace_preset(cfg)
    original = llama.Llama.forward

    def forward(self, ids):  # the same model, by code outside mtc's files
        return original(self, ids)

    monkeypatch.setattr(llama.Llama, "forward", forward)
    assert tc._patched()
    tc.trace_preset(cfg)
    assert len(traces) == 2 and len(list(cache.glob("*.json"))) == 1
    monkeypatch.undo()
    assert not tc._patched()
    assert program_to_dict(tc.trace_preset(cfg)) == program_to_dict(kept) and len(traces) == 2


def test_off_unwritable_and_factories_trace_every_time(tmp_path, traces, monkeypatch):
    monkeypatch.setenv(tc.CACHE_ENV, "off")
    assert tc.cache_dir() is None
    tc.trace_preset(_cfg())
    tc.trace_preset(_cfg())
    assert len(traces) == 2
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(tc.CACHE_ENV, str(blocker / "programs"))  # cannot be created: the run goes on
    assert tc.trace_preset(_cfg()).n_layers == 6 and len(traces) == 3  # embed, 4 blocks, head
    monkeypatch.setenv(tc.CACHE_ENV, str(tmp_path / "c"))
    factory = _cfg("tests.mtc.custom_models:build")
    tc.trace_preset(factory)
    assert len(traces) == 4 and not (tmp_path / "c").exists()


def test_a_hit_still_refuses_a_sequence_longer_than_the_model_takes(cache):
    cfg = _cfg(model_overrides={"max_seq_len": 16})
    tc.trace_preset(cfg)
    with pytest.raises(ConfigError, match="exceeds the model's max_seq_len 16"):
        tc.trace_preset(dataclasses.replace(cfg, seq_len=32))


def test_the_oldest_entries_go_beyond_the_limit(cache, monkeypatch):
    monkeypatch.setattr(tc, "MAX_ENTRIES", 2)
    for i, s in enumerate((4, 8, 16)):
        tc.trace_preset(_cfg(seq_len=s))
        for f in cache.glob("*.json"):  # the newest is the last written
            if f.name == f"{tc.trace_key(_cfg(seq_len=s))}.json":
                os.utime(f, (1000 + i, 1000 + i))
    assert sorted(f.stem for f in cache.glob("*.json")) == sorted(tc.trace_key(_cfg(seq_len=s)) for s in (8, 16))


def test_a_new_run_in_a_fresh_process_reads_the_trace_and_skips_torchs_tracer(cache, tmp_path):
    """`mtc train` of a new run whose preset and shape were traced before: no trace, and torch's
    dynamo (2.1 s to import in a fresh process) is never imported."""
    import numpy as np

    from mtc.data import write_token_file

    tok = write_token_file(tmp_path / "t.bin", np.arange(3000, dtype=np.uint16) % 256, vocab_size=256, tokenizer="byte")
    probe = ("import runpy, sys; sys.argv = ['mtc'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('mtc', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
             "print('DYNAMO', 'torch._dynamo' in sys.modules); sys.exit(code)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{tc.CACHE_ENV: str(cache)})
    args = ["train", "--preset", "tiny", "--data", str(tok.path), "--micro-batch-size", "2", "--seq-len", "16", "--steps", "1"]
    seen = []
    for store in ("a", "b"):
        out = subprocess.run([sys.executable, "-c", probe, *args, "--store", str(tmp_path / store)], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.append(out.stdout.strip().splitlines()[-1])
    assert seen == ["DYNAMO True", "DYNAMO False"]
    assert len(list(cache.glob("*.json"))) == 1


def test_mtc_compile_and_trace_meta_read_the_cache_and_write_the_plan_a_trace_gives(cache, traces, tmp_path):
    """`mtc compile PRESET` and `mtc trace --meta` trace a preset once per machine; the plans they
    write are the ones a fresh trace gives."""
    from mtc.cli import main
    from mtc.plan import load_plan

    common = ["--seq-len", "16", "--micro-batch-size", "2", "--dtype", "float32"]
    assert main(["trace", "tiny", "--meta", *common, "-o", str(tmp_path / "t1")]) == 0
    assert main(["compile", "tiny", *common, "-o", str(tmp_path / "c1")]) == 0
    assert main(["trace", "tiny", "--meta", *common, "-o", str(tmp_path / "t2")]) == 0
    assert traces == [("tiny", "tiny")]
    fresh = program_to_dict(trace(build_model(_cfg(), device="meta"), 2, 16, name="tiny"))
    for d in ("t1", "c1", "t2"):
        assert program_to_dict(load_plan(tmp_path / d)) == fresh, d
