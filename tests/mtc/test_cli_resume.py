"""Resuming: other data is refused unless allowed; allowed changes are recorded; shape changes never pass."""

from __future__ import annotations

import json

import numpy as np
from mtc.store import TensorStore

from mtc.cli import main
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
        assert last.meta["changes"] == [{"from_step": 2, "fields": ["data"]}]


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
