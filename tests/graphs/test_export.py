"""export_model's failures: one TraceError whose hint fits the kind of failure, and nothing of
torch's own on stderr (its meta kernel's logged traceback, the partial FX graph it prints)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from mtc.errors import TraceError
from mtc.tracer import trace
from tests.mtc.custom_models import Block, TinyLM


class _ItemBlock(Block):
    """A block that branches on a tensor's value in Python: not traceable by torch.export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:
            return super().forward(x)
        return x


class _ChattyLM(TinyLM):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        print("a user's own notice", file=sys.stderr)  # as warnings.warn writes, through sys.stderr
        return super().forward(ids)


def _torch_noise(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> list[str]:
    """torch's own failure output since the last call: lines of logged tracebacks and FX graph dumps
    on stdout/stderr, and records of its loggers. Both are needed: torch's log handlers hold the
    stderr of the time torch was imported (under pytest, its capture of the whole session, which
    capfd does not see), while the graph dump is a print to the current sys.stderr."""
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines()
             if "fake_tensor.py" in line or "Traceback" in line or "def forward(" in line or "torch.ops.aten" in line]
    records = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.name.startswith("torch") and r.levelno >= logging.WARNING]
    caplog.clear()
    return lines + records


def test_a_seq_len_past_the_position_table_says_the_shapes_do_not_fit(capfd, caplog):
    model = TinyLM(max_len=128)  # a learned position table of 128 rows, traced at 256 tokens
    _torch_noise(capfd, caplog)
    with pytest.raises(TraceError) as e:
        trace(model, 2, 256)
    assert _torch_noise(capfd, caplog) == []
    msg = str(e.value)
    assert "'<root>' (TinyLM)" in msg and "custom_models.py" in msg and "self.pos[" in msg  # the user's line
    assert "Attempting to broadcast a dimension of length 128" in msg
    assert "shapes do not fit at micro-batch shape 2 x 256" in msg and "position table" in msg
    assert "data-dependent" not in msg and ".item()" not in msg  # not the control-flow advice


def test_data_dependent_control_flow_keeps_the_export_advice_without_graph_dumps(capfd, caplog):
    model = TinyLM(max_len=64)
    model.blocks[0].__class__ = _ItemBlock
    _torch_noise(capfd, caplog)
    with pytest.raises(TraceError) as e:
        trace(model, 1, 16)
    assert _torch_noise(capfd, caplog) == []
    msg = str(e.value)
    assert "'blocks.0' (_ItemBlock)" in msg and "x.sum().item() > 0" in msg
    assert "torch.where" in msg and "torch.cond" in msg


def test_logger_levels_are_restored_and_a_successful_trace_keeps_what_the_user_printed(capfd):
    watched = [logging.getLogger(n) for n in ("torch", "torch._subclasses.fake_tensor", "torch.fx.passes.infra.pass_manager")]
    before = [lg.level for lg in watched]
    with pytest.raises(TraceError):
        trace(TinyLM(max_len=8), 1, 16)
    assert [lg.level for lg in watched] == before
    capfd.readouterr()
    trace(_ChattyLM(), 1, 8)
    assert "a user's own notice" in capfd.readouterr().err
    assert [lg.level for lg in watched] == before


def test_overlapping_traces_on_two_threads_leave_stderr_and_torchs_logging_as_they_were():
    import logging
    import sys
    import threading
    import time

    from mtc.graphs.export import _quiet_torch

    before_err, before_level = sys.stderr, logging.getLogger("torch").level
    entered, left = threading.Event(), threading.Event()

    def first():
        with _quiet_torch():
            entered.set()
            time.sleep(0.1)  # the second thread tries to enter meanwhile
        left.set()

    def second():  # inside until the first has left: unserialised, it would then put back the first's capture
        entered.wait()
        with _quiet_torch():
            left.wait(timeout=5)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sys.stderr is before_err and logging.getLogger("torch").level == before_level
