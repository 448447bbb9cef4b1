"""Resuming: other data is refused unless allowed; allowed changes are recorded; shape changes never pass."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mtc.store import TensorStore

from mtc.cli import main
from mtc.config import OptimConfig
from mtc.data import write_token_file
from tests.runtime.engine_util import skewed_tokens, small_config


def _train(capsys, cfg_file, store, data, *extra):
    code = main(["train", "--config", str(cfg_file), "--store", str(store), "--data", str(data), *extra])
    return code, capsys.readouterr().err


def test_resume_refuses_other_data_then_allows_it_and_records_the_change(tmp_path, capsys):
    a = skewed_tokens(tmp_path / "a.bin")
    b = write_token_file(tmp_path / "b.bin", np.random.default_rng(1).integers(0, 256, 30_000).astype(np.uint16),
                         vocab_size=256, tokenizer="byte")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(small_config(steps=4).to_dict()))
    store = tmp_path / "s"
    assert _train(capsys, cfg_file, store, a.path, "--stop-after", "2")[0] == 0
    code, err = _train(capsys, cfg_file, store, b.path)
    assert code == 2 and "--allow-change data" in err and len(err.strip().splitlines()) == 1, err
    code, err = _train(capsys, cfg_file, store, b.path, "--allow-change", "data")
    assert code == 0, err
    with TensorStore.open(store, read_only=True) as st:
        last = st.last_commit()
        assert last.step == 4 and last.durability == "full"
        assert last.meta["data"]["path"].endswith("b.bin")
        assert last.meta["changes"] == [{"from_step": 2, "fields": ["data"], "values": {"data": [str(a.path.resolve()), str(b.path.resolve())]}}]


def test_extend_steps_needs_allow_change_and_shape_changes_are_refused(tmp_path, capsys):
    a = skewed_tokens(tmp_path / "a.bin")
    store = tmp_path / "s"
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(small_config(steps=2).to_dict()))
    assert _train(capsys, cfg_file, store, a.path)[0] == 0
    cfg_file.write_text(json.dumps(small_config(steps=4).to_dict()))
    code, err = _train(capsys, cfg_file, store, a.path)
    assert code == 2 and "differs in: steps" in err and "--allow-change steps" in err, err
    assert _train(capsys, cfg_file, store, a.path, "--allow-change", "steps")[0] == 0
    code, err = _train(capsys, cfg_file, store, a.path, "--allow-change", "seq_len")
    assert code == 2 and "only data, steps" in err, err


def test_an_unnamed_min_lr_keeps_the_runs_ratio_to_lr_and_rides_with_its_change(tmp_path, capsys):
    a = skewed_tokens(tmp_path / "a.bin")
    store = tmp_path / "s"
    cfg_file = tmp_path / "run.json"
    d = small_config(steps=3).to_dict()
    del d["optim"]["min_lr"]
    cfg_file.write_text(json.dumps(d))
    # a run with a min_lr of its own (as stores written before the lr / 10 default may hold)
    assert _train(capsys, cfg_file, store, a.path, "--lr", "1e-3", "--min-lr", "3e-4", "--stop-after", "1")[0] == 0
    code, err = _train(capsys, cfg_file, store, a.path, "--lr", "1e-3", "--stop-after", "2")
    assert code == 0, err  # the same command without --min-lr resumes: the run's min_lr, not lr / 10
    code, err = _train(capsys, cfg_file, store, a.path, "--lr", "5e-4")
    assert code == 2 and err.rstrip().endswith("or pass --allow-change optim.lr, or use a new store directory"), err
    code, err = _train(capsys, cfg_file, store, a.path, "--lr", "5e-4", "--allow-change", "optim.lr")
    assert code == 0, err
    with TensorStore.open(store, read_only=True) as st:
        last = st.last_commit()
        assert last.step == 3 and last.config["optim"]["min_lr"] == pytest.approx(1.5e-4, rel=1e-12)
        (change,) = last.meta["changes"]
        assert change["from_step"] == 2 and change["fields"] == ["optim.lr", "optim.min_lr"], change


def test_fused_kernels_on_the_cpu_without_the_interpreter_are_refused_before_the_store(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = skewed_tokens(tmp_path / "a.bin")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(small_config(steps=1).to_dict()))
    code, err = _train(capsys, cfg_file, tmp_path / "s", a.path, "--kernels", "fused")
    assert code == 2 and "TRITON_INTERPRET=1" in err and "--unfused" in err
    assert not (tmp_path / "s").exists()


def test_token_files_are_readable_like_other_files(tmp_path):
    import os
    import stat

    t = skewed_tokens(tmp_path / "a.bin")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(t.path).st_mode) == 0o666 & ~umask


def _lines(err: str) -> list[str]:
    return [ln for ln in err.strip().splitlines() if ln]


def test_bad_data_is_refused_before_anything_is_written(tmp_path, capsys):
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(small_config(steps=1).to_dict()))
    short = write_token_file(tmp_path / "short.bin", np.arange(10, dtype=np.uint16), vocab_size=256, tokenizer="byte")
    code, err = _train(capsys, cfg_file, tmp_path / "s1", short.path)
    assert code == 2 and len(_lines(err)) == 1 and "tokens" in err, err
    wide = write_token_file(tmp_path / "wide.bin", np.arange(20_000, dtype=np.uint16) % 1000, vocab_size=1000, tokenizer="byte")
    code, err = _train(capsys, cfg_file, tmp_path / "s2", wide.path)
    assert code == 2 and len(_lines(err)) == 1, err
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s2").exists()


def test_device_cuda_without_cuda_is_refused_before_the_store(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    a = skewed_tokens(tmp_path / "a.bin")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(small_config(steps=1).to_dict()))
    code, err = _train(capsys, cfg_file, tmp_path / "s", a.path, "--device", "cuda")
    assert code == 2 and len(_lines(err)) == 1 and "no CUDA device" in err
    assert not (tmp_path / "s").exists()


def test_no_space_for_the_plan_is_one_line_and_the_same_command_starts_over(tmp_path, capsys, monkeypatch):
    import errno
    import importlib

    train_module = importlib.import_module("mtc.train")  # `mtc.train` is the API function

    a = skewed_tokens(tmp_path / "a.bin")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(small_config(steps=2).to_dict()))
    real = train_module.save_plan

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_module, "save_plan", full)
    code, err = _train(capsys, cfg_file, tmp_path / "s", a.path)
    assert code == 2 and len(_lines(err)) == 1 and "No space left" in err and "starts the run over" in err, err
    monkeypatch.setattr(train_module, "save_plan", real)
    code, err = _train(capsys, cfg_file, tmp_path / "s", a.path)
    assert code == 0, err


def test_a_skipped_step_is_reported_on_the_console(tmp_path, capsys):
    a = skewed_tokens(tmp_path / "a.bin")
    cfg_file = tmp_path / "run.json"
    cfg = small_config(steps=3, optim=OptimConfig(lr=1e18, min_lr=1e18, warmup_steps=0, clip_norm=None))
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    code, err = _train(capsys, cfg_file, tmp_path / "s", a.path)
    assert code == 0 and "step 2 skipped" in err and "not finite" in err, err
