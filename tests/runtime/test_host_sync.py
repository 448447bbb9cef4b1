"""Nothing on the training thread waits for the device inside a step's layer loop (issue 8, must 5).

On CUDA a host synchronisation inside `StreamingExecutor.run_step` (reading a tensor's value, or
blocking on a copy's event) stops the host from queueing the next layers' kernels and copies while
the GPU works. The CPU path runs the same code, so these tests spy, on the thread that runs
`run_step` and only while it does, on every way the engine could read a device value
(`Tensor.item`, `bool`, `float`, `int`, `tolist`, `cpu`, `numpy`), on host waits for copies
(`Transfer.wait` outside `Transfer.wait_stream`, which is the CPU's stand-in for a stream waiting
on an event), and on the explicit device waits (`torch.cuda.synchronize`, `Event.synchronize`,
`Stream.synchronize`), which no CPU path may reach there.
The loss and the global norm are read once per step, after `run_step`, by the optimizer.
The gpu-marked twin (tests/runtime/test_engine_gpu.py) checks the CUDA path with torch's sync debug mode.
"""

from __future__ import annotations

import threading
import traceback
from pathlib import Path

import pytest
import torch

from mtc.runtime import transfer
from mtc.runtime.executor import StreamingExecutor
from mtc.train import train
from tests.runtime.engine_util import skewed_tokens, small_config

READS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")
# functions whose value reads run only for CPU tensors (they return first on CUDA), so they cost no
# device synchronisation there: the fused head's target check (on CUDA a bad target gives a NaN
# loss instead; kernels/linear_cross_entropy.py)
CPU_ONLY = {"_check_targets"}


class _Spy:
    """Records where the step thread reads device values or blocks on copies during `run_step`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hits: list[str] = []
        self._local = threading.local()
        self.steps = 0
        run_step = StreamingExecutor.run_step

        def spied_run_step(ex: StreamingExecutor, *a: object, **k: object) -> object:
            self._local.inside = True
            self.steps += 1
            try:
                return run_step(ex, *a, **k)
            finally:
                self._local.inside = False

        monkeypatch.setattr(StreamingExecutor, "run_step", spied_run_step)
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        wait, wait_stream = transfer.Transfer.wait, transfer.Transfer.wait_stream

        def spied_wait_stream(tr: transfer.Transfer, stream: object) -> None:
            self._local.stream_wait = True
            try:
                wait_stream(tr, stream)
            finally:
                self._local.stream_wait = False

        def spied_wait(tr: transfer.Transfer) -> None:
            if not getattr(self._local, "stream_wait", False):
                self._record("Transfer.wait")
            wait(tr)

        monkeypatch.setattr(transfer.Transfer, "wait_stream", spied_wait_stream)
        monkeypatch.setattr(transfer.Transfer, "wait", spied_wait)
        # explicit device waits: on the CPU they must not be reached at all inside the loop (a CUDA
        # branch calling one would stall there); torch's sync debug mode does not see event waits
        monkeypatch.setattr(torch.cuda, "synchronize", self._wrap_fn(torch.cuda.synchronize, "torch.cuda.synchronize"))
        for cls in (torch.cuda.Event, torch.cuda.Stream):
            monkeypatch.setattr(cls, "synchronize", self._wrap_fn(cls.synchronize, f"{cls.__name__}.synchronize"))

    def _record(self, what: str) -> None:
        if getattr(self._local, "inside", False):
            frames = [f for f in traceback.extract_stack()[:-2] if "test_host_sync" not in f.filename]
            if frames and frames[-1].name in CPU_ONLY:
                return
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.hits.append(f"{what} at {where}")

    def _wrap_fn(self, orig: object, what: str) -> object:
        spy = self

        def spied(*a: object, **k: object) -> object:
            spy._record(what)
            return orig(*a, **k)  # type: ignore[operator]

        return spied

    def _wrap(self, orig: object, name: str) -> object:
        spy = self

        def spied(t: torch.Tensor, *a: object, **k: object) -> object:
            spy._record(f"Tensor.{name}")
            return orig(t, *a, **k)  # type: ignore[operator]

        return spied


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory):
    return skewed_tokens(tmp_path_factory.mktemp("sync") / "tokens.bin")


@pytest.mark.parametrize(
    "mode",
    [
        dict(placement="ram"),
        dict(placement="ram", activation_budget_gb=1e-9),  # every boundary activation offloaded and brought back
        dict(placement="gpu:0,ram:1-2,disk:3", gpu_update="2"),  # resident, streamed, GPU-updated and disk layers
        dict(placement="ram", kernels="fused", model_overrides={"n_layers": 1}),  # compiled templates (fused CE head)
    ],
    ids=["ram", "offloaded", "mixed", "fused"],
)
def test_no_host_sync_inside_the_layer_loop(mode, tokens, monkeypatch):
    spy = _Spy(monkeypatch)
    cfg = small_config(steps=2, durability="none", **mode)
    res = train(cfg, None, tokens)
    res.store.close()
    assert spy.steps == 2  # the spy saw the steps
    assert all(r.loss == r.loss for r in res.records)  # finite: the steps really ran
    assert spy.hits == [], "host synchronisation inside run_step:\n" + "\n".join(sorted(set(spy.hits)))


def test_the_spy_sees_a_host_sync(tokens, monkeypatch):
    """The spy itself works: a `.item()` slipped into the layer loop is reported."""
    spy = _Spy(monkeypatch)
    forward = StreamingExecutor._forward

    def forward_with_sync(ex: StreamingExecutor, layer: int, w: object, g: object) -> None:
        forward(ex, layer, w, g)
        g.carry[0].sum().item()  # type: ignore[attr-defined]

    monkeypatch.setattr(StreamingExecutor, "_forward", forward_with_sync)
    res = train(small_config(steps=1, durability="none", placement="ram"), None, tokens)
    res.store.close()
    assert any(h.startswith("Tensor.item") for h in spy.hits)


@pytest.mark.parametrize("sync", ["cpu", "event"])
def test_the_spy_sees_a_copy_to_the_host_and_a_device_wait(sync, tokens, monkeypatch):
    spy = _Spy(monkeypatch)
    forward = StreamingExecutor._forward

    def forward_with_sync(ex: StreamingExecutor, layer: int, w: object, g: object) -> None:
        forward(ex, layer, w, g)
        if sync == "cpu":
            g.carry[0].sum().cpu()  # type: ignore[attr-defined]
        else:
            torch.cuda.Event.synchronize(None)  # type: ignore[arg-type]  (the spy records before calling)

    monkeypatch.setattr(StreamingExecutor, "_forward", forward_with_sync)
    cfg = small_config(steps=1, durability="none", placement="ram")
    if sync == "cpu":
        train(cfg, None, tokens).store.close()
    else:
        with pytest.raises(Exception):  # noqa: B017, PT011  (the real Event.synchronize(None) fails after the spy saw it)
            train(cfg, None, tokens)
    assert any(h.startswith("Tensor.cpu" if sync == "cpu" else "Event.synchronize") for h in spy.hits), spy.hits
