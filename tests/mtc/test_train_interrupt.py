"""Ctrl-C inside `mtc.train` from Python (a notebook): the store's lock is released, and the next
call on the same store resumes it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

import mtc
from mtc.store import TensorStore
from tests.runtime.engine_util import skewed_tokens, small_config


def test_second_ctrl_c_during_a_slow_commit_releases_the_store_once_it_lands(tmp_path, monkeypatch):
    # The first Ctrl-C waits for the commit in flight; a second one stops that wait. The commit's
    # threads still run, so the store must be released once they are done: not never (the lock
    # stayed held by the process, and the next call on the store was refused), and not before
    # (a join that Ctrl-C interrupted returns at once from then on, so waiting on the threads
    # released the store under the landing commit, and the next call resumed from the one before)
    tokens = skewed_tokens(tmp_path / "tok.bin")
    store = tmp_path / "s"
    kw = dict(small_config(steps=8, commit_every=2).to_dict(), device="cpu")
    real_commit = TensorStore.commit
    slow_step: list[int] = []

    def slow_commit(self: TensorStore, record: object) -> None:
        if record.step >= 4 and not slow_step:
            slow_step.append(record.step)
            time.sleep(3.0)  # a slow disk: it lands after the next call would have opened the store
        real_commit(self, record)

    monkeypatch.setattr(TensorStore, "commit", slow_commit)
    second = threading.Event()

    def second_ctrl_c() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # (a real signal: it also wakes a blocked wait, as Ctrl-C does)
        second.set()

    def first_ctrl_c(rec: object) -> None:
        if slow_step:
            threading.Timer(0.3, second_ctrl_c).start()  # while the first one waits for the commit
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a runner in the background ignores SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            mtc.train(data=tokens.path, store=store, config=kw, on_step=first_ctrl_c)
        try:
            second.wait(10)
            time.sleep(0.1)
        except KeyboardInterrupt:
            pytest.fail("the second Ctrl-C came after mtc.train had returned: the commit was not slow enough")
    finally:
        signal.signal(signal.SIGINT, old)
    for t in threading.enumerate():  # the store is released in the background once the commit has landed
        if t.name == "mtc-close-after-interrupt":
            t.join(timeout=60)
    landed = json.loads((store / "commit.json").read_text())["step"]
    assert landed >= slow_step[0]
    monkeypatch.setattr(TensorStore, "commit", real_commit)
    with mtc.train(data=tokens.path, store=store, config=kw) as res:
        assert res.start_step == landed and res.end_step == 8
    assert not [t.name for t in threading.enumerate() if t.name.startswith("mtc-store-io")]


_KILL_IN_EVAL = """
import os, signal, sys, time
from mtc import watch
from mtc.cli import main

real = watch.RunWatcher.validate
calls = []

def validate(self):
    calls.append(1)
    if len(calls) == int(os.environ["KILL_AT_EVAL"]):
        time.sleep(1.0)  # a slow eval: the step's commit, in flight, lands meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self)

watch.RunWatcher.validate = validate
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_killed_in_an_eval_at_a_commit_step_redoes_that_step_and_logs_it(tmp_path):
    # The commit landed in the background while the training thread ran the step's eval, before
    # its metrics record: a kill there resumed after that step, and its record (with val_loss) was
    # never written. Now a commit waits for its step's record: the step is redone and logged.
    import subprocess
    import sys

    from tests.mtc.test_data_parallel import ROOT, _env

    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=6, commit_every=2, eval_every=2, eval_batches=2).to_dict()))
    store = tmp_path / "s"
    args = ["train", "--config", str(cfg), "--store", str(store), "--data", str(tokens.path), "--device", "cpu"]
    killed = subprocess.run([sys.executable, "-c", _KILL_IN_EVAL, *args], env=dict(_env(), KILL_AT_EVAL="2"), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (store / "logs" / "metrics.jsonl").read_text().splitlines()]
    with TensorStore.open(store, read_only=True) as st:
        assert st.last_commit().step == 2 and steps == [1, 2, 3], steps  # killed in step 4's eval: 4 not committed
    done = subprocess.run([sys.executable, "-m", "mtc", *args], env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    recs = [json.loads(line) for line in (store / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 3, 4, 5, 6]  # step 3 ran again after the resume from 2
    assert [r["step"] for r in recs if r.get("val_loss") is not None] == [2, 4, 6]


def test_an_interrupt_while_the_gates_open_leaves_the_rest_for_the_stopped_runs_own_call():
    # the gates were popped before they were set: a Ctrl-C in between lost one, and the stopped
    # run's close waited for its commit for good
    import threading

    from mtc.train import _open_gates

    interrupts = [KeyboardInterrupt()]

    class Gate(threading.Event):
        def set(self) -> None:
            if interrupts:  # the first set of any gate is interrupted
                raise interrupts.pop()
            super().set()

    gates = [Gate(), Gate()]
    everyone = list(gates)
    with pytest.raises(KeyboardInterrupt):
        _open_gates(gates)
    _open_gates(gates)  # the stopped run's own call (train's except path)
    assert all(g.is_set() for g in everyone) and gates == []


_SERIALIZED = """
import sys
from mtc.train import train
from tests.runtime.engine_util import skewed_tokens, small_config

res = train(small_config(steps=2, commit_every=1), sys.argv[1], skewed_tokens(sys.argv[2]), serialize=True)
res.store.close()
print(res.end_step)
"""


def test_a_serialized_run_with_a_store_commits_without_waiting_for_itself(tmp_path):
    # serialize waits for the commit inside finish_step, before the step's record is written: the
    # commit gated on that record never came (a deadlock at the first commit)
    import subprocess
    import sys

    from tests.mtc.test_data_parallel import ROOT, _env

    proc = subprocess.run([sys.executable, "-c", _SERIALIZED, str(tmp_path / "s"), str(tmp_path / "tok.bin")], env=_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "2", proc.stderr[-2000:]
