"""Reading a running step's weights waits for every layer's update, the all-gather included."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

from mtc.runtime.transfer import Transfer
from mtc.weight_sources import wait_for_updates


def test_waits_for_a_data_parallel_all_gather_after_the_update():
    """A gpu-tier layer's update future completes once its all-gather is enqueued; the reader must
    also wait for the all-gather itself (`LayerState.gathered`)."""
    update, gather = Future(), Future()
    update.set_result(None)
    layer = SimpleNamespace(update=update, state_back=None, gathered=Transfer(future=gather))
    done = threading.Event()
    t = threading.Thread(target=lambda: (wait_for_updates(SimpleNamespace(layers=[layer])), done.set()))
    t.start()
    assert not done.wait(0.2), "returned before the all-gather finished"
    gather.set_result(None)
    assert done.wait(5)
    t.join()


def test_waits_for_a_gpu_side_updates_state_after_its_weights():
    """A GPU-updated layer loaded ahead completes `update` once its new weights are back; master,
    m and v follow (`LayerState.state_back`): a reader of the step's state waits for them too."""
    update, back = Future(), Future()
    update.set_result(None)
    layer = SimpleNamespace(update=update, state_back=back, gathered=None)
    done = threading.Event()
    t = threading.Thread(target=lambda: (wait_for_updates(SimpleNamespace(layers=[layer])), done.set()))
    t.start()
    assert not done.wait(0.2), "returned before the state was back"
    back.set_result(None)
    assert done.wait(5)
    t.join()
