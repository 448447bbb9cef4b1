"""kill -9 at random moments of set-up and training never strands a run (issue: hardening)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mtc.store import TensorStore

from mtc.plan import load_plan
from mtc.runtime.state import read_params
from tests.runtime.engine_util import skewed_tokens, small_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _cmd(cfg_file: Path, store: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "mtc", "train", "--config", str(cfg_file), "--store", str(store), "--data", str(data)]


def _weights(store: Path) -> dict[str, torch.Tensor]:
    with TensorStore.open(store, read_only=True) as st:
        last = st.last_commit()
        assert last.step == STEPS
        return read_params(load_plan(store / "plan"), st, last.generation)


@pytest.mark.slow
def test_kill_9_anywhere_then_the_same_command_finishes_bit_identically(tmp_path):
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(small_config(steps=STEPS, commit_every=2).to_dict()))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ref_store = tmp_path / "ref"
    t0 = time.time()
    proc = subprocess.Popen(_cmd(cfg_file, ref_store, tokens.path), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not (ref_store / "commit.json").exists():
        time.sleep(0.005)
    setup_s = time.time() - t0  # start-up, tracing, store creation, step 0's commit
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    ref = _weights(ref_store)
    rng = random.Random(1)
    phases = []
    for trial in range(4):  # (each trial is two runs of the CLI, ~5 s on the 2-core VM)
        store = tmp_path / f"s{trial}"
        proc = subprocess.Popen(_cmd(cfg_file, store, tokens.path), env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if trial < 2:  # somewhere in set-up
            time.sleep(rng.uniform(0.1, 0.95) * setup_s)
        else:  # somewhere in training, after the first commit
            while proc.poll() is None and not (store / "commit.json").exists():
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.wait()
        commit = store / "commit.json"
        phases.append("set-up" if not commit.exists() else
                      "training" if json.loads(commit.read_text())["step"] < STEPS else "finished")
        again = subprocess.run(_cmd(cfg_file, store, tokens.path), env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, f"trial {trial} (killed in {phases[-1]}): {again.stderr}"
        got = _weights(store)
        assert all(torch.equal(got[k], ref[k]) for k in ref), f"trial {trial} ({phases[-1]}): weights differ from the unbroken run"
    assert {"set-up", "training"} <= set(phases), f"the kills must land in both phases: {phases}"
