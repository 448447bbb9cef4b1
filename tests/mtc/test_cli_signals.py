"""Ctrl-C and SIGTERM stop `mtc train` with the right exit code and a true word about the last commit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.engine_util import skewed_tokens, small_config

ROOT = Path(__file__).resolve().parents[2]


def _popen(*args: object, **kw: object) -> subprocess.Popen:
    """`subprocess.Popen` whose child gets SIGINT as an interactive shell leaves it. A test runner
    started in the background by a non-interactive shell ignores SIGINT, an ignored signal stays
    ignored across exec, and Python then installs no KeyboardInterrupt handler: Ctrl-C would do
    nothing. Pytest runs tests on the main thread, where the handler may be set for the launch."""
    old = signal.getsignal(signal.SIGINT)
    if old == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a Python handler: the child starts with the default
    try:
        return subprocess.Popen(*args, **kw)
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize(("sig", "code", "word", "placement"),
                         [(signal.SIGTERM, 143, "terminated", "ram"), (signal.SIGINT, 130, "interrupted", "disk")])
def test_signal_stops_with_exit_code_and_names_the_last_commit(tmp_path, sig, code, word, placement):
    """Also promptly with state on disk: the interrupted step's update held a set of the disk
    ring, whose read-ahead then kept the process 31 s in the ring's close (2026-11-29)."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=400, commit_every=2, placement=placement).to_dict()))
    store = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = _popen([sys.executable, "-m", "mtc", "train", "--config", str(cfg), "--store", str(store),
                             "--data", str(tokens.path)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((store / "commit.json").exists() and
                                          json.loads((store / "commit.json").read_text())["step"] >= 2):
        time.sleep(0.02)
    proc.send_signal(sig)
    t0 = time.time()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert time.time() - t0 < 15, f"{time.time() - t0:.1f} s from the signal to the exit"
    last = json.loads((store / "commit.json").read_text())["step"]
    assert 2 <= last < 400
    lines = [ln for ln in err.splitlines() if ln.startswith("mtc:")]
    # optionally one line saying a commit in flight is being finished, then the verdict
    assert len(lines) in (1, 2) and all("finishing the commit in flight" in ln for ln in lines[:-1]), err
    assert word in lines[-1] and f"step {last}:" in lines[-1], err
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["parser", "exec"])
def test_ctrl_c_during_set_up_exits_130_after_its_message(tmp_path, where):
    """A Ctrl-C during set-up (``python -m mtc``, as torchrun launches it) ends with "mtc:
    interrupted" and exit code 130. It once ended killed by SIGINT (-2): while the parser imported
    torch, uncaught, with a traceback; and, after the message, where the interrupt had left code
    run by a string ``exec`` (CPython then records it as unhandled and re-sends SIGINT at exit)."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=4).to_dict()))
    marker = tmp_path / "waiting"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = _popen([sys.executable, "-m", "tests.mtc.slow_setup", where, str(marker), "train", "--config", str(cfg),
                   "--store", str(tmp_path / "s"), "--data", str(tokens.path)], env=env, cwd=ROOT,
                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not marker.exists() and proc.poll() is None:
        time.sleep(0.02)
    assert marker.exists(), proc.communicate(timeout=10)[1]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "mtc: interrupted" and "Traceback" not in err, err


def test_ctrl_c_during_a_slow_commit_says_it_finishes_it(tmp_path):
    # a store whose commits are slow (a sleep in the commit, as a slow disk would be): the first
    # Ctrl-C waits for the commit in flight and says so; the verdict names the commit it landed
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=400, commit_every=1).to_dict()))
    store = tmp_path / "s"
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import sys, time, runpy\n"
        "from mtc.store import TensorStore\n"
        "real = TensorStore.commit\n"
        "def commit(self, record):\n"
        "    time.sleep(1.0 if record.step > 0 else 0)\n"
        "    real(self, record)\n"
        "TensorStore.commit = commit\n"
        "sys.argv = ['mtc'] + sys.argv[1:]\n"
        "runpy.run_module('mtc', run_name='__main__')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = _popen([sys.executable, str(slow), "train", "--config", str(cfg), "--store", str(store),
                             "--data", str(tokens.path)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((store / "commit.json").exists() and
                                          json.loads((store / "commit.json").read_text())["step"] >= 1):
        time.sleep(0.02)
    time.sleep(0.3)  # inside the next commit's 1 s
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = [ln for ln in err.splitlines() if ln.startswith("mtc:")]
    assert len(lines) == 2 and "finishing the commit in flight" in lines[0], err
    last = json.loads((store / "commit.json").read_text())["step"]
    assert last >= 2 and f"step {last}:" in lines[1], err


def test_a_reader_that_goes_away_does_not_stop_training(tmp_path):
    """`mtc train ... 2>&1 | head -2`: once the pipe closes, the run goes on to its last step."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=40, commit_every=5).to_dict()))
    store = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "mtc", "train", "--config", str(cfg), "--store", str(store),
                             "--data", str(tokens.path)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    assert proc.stdout.readline().startswith(b"mtc train: ")
    proc.stdout.close()  # the reader is gone: the next progress line meets a broken pipe
    assert proc.wait(timeout=180) == 0
    assert json.loads((store / "commit.json").read_text())["step"] == 40


_TERM_WHILE_REPORTING = """
import builtins, os, signal, sys
from mtc.cli import main

real = builtins.print

def print(*a, **kw):  # torchrun's SIGTERM to a surviving rank, arriving as it reports its lost peer
    if a and str(a[0]).startswith("mtc: error:"):
        os.kill(os.getpid(), signal.SIGTERM)
    real(*a, **kw)

builtins.print = print
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_while_the_error_is_printed_leaves_the_one_line_error(tmp_path):
    # a SIGTERM raised inside the handler that printed an MTCError escaped it: ~90 lines of
    # traceback ending in _Terminated, and the error itself never printed
    proc = subprocess.run([sys.executable, "-c", _TERM_WHILE_REPORTING, "inspect", str(tmp_path / "nothing")], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("mtc: error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
