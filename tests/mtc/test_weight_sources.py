"""Reading a running step's weights waits for every layer's update, the all-gather included."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

from mtc.runtime.transfer import Transfer
from mtc.weight_sources import wait_for_updates


def _waits_for(last: Future, **layer: object) -> None:
    """`wait_for_updates` over one layer (its update already done) returns only once ``last`` is."""
    update = Future()
    update.set_result(None)
    done = threading.Event()
    state = SimpleNamespace(layers=[SimpleNamespace(update=update, **layer)])
    t = threading.Thread(target=lambda: (wait_for_updates(state), done.set()))
    t.start()
    assert not done.wait(0.2), "returned before the last piece finished"
    last.set_result(None)
    assert done.wait(5)
    t.join()


def test_waits_for_a_data_parallel_all_gather_after_the_update():
    """A gpu-tier layer's update future completes once its all-gather is enqueued; the reader must
    also wait for the all-gather itself (`LayerState.gathered`)."""
    gather = Future()
    _waits_for(gather, state_back=None, gathered=Transfer(future=gather))


def test_waits_for_a_gpu_side_updates_state_after_its_weights():
    """A GPU-updated layer loaded ahead completes `update` once its new weights are back; master,
    m and v follow (`LayerState.state_back`): a reader of the step's state waits for them too."""
    back = Future()
    _waits_for(back, state_back=back, gathered=None)
