"""Disk layers' gradients spilled to the store between backward and the update.

Exact AdamW with global-norm clipping cannot update a layer before the whole step's gradient norm
is known, so every layer's final gradient must be kept until backward ends. For `disk` layers on
the CPU device (where the "device" is host memory) that is 4 bytes per parameter of host RAM for
the whole model: as much as the <= 4 B/param goal allows for everything. When the RAM budget cannot
hold them, each disk layer's gradient is written, exact fp32, to a scratch array of the store as
soon as it is final (its per-parameter norms are taken first, from the same values), its slab goes
back to the executor's ring, and the update reads it back with the layer's master, m and v
(`mtc.runtime.disk_tier`): host RAM for gradients is then a few slabs, whatever the depth.

Scratch arrays are named ``scratch/grad/LLLL``; they carry no state a commit needs (`mtc verify`
checks only the ``layers/`` arrays) and are rewritten every step. One array per layer suffices: the
update of step t reads layer i's gradient before the next forward fetches layer i, which is before
the backward of step t + 1 writes it again.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from mtc.errors import StoreError
from mtc.store import STATE_DTYPE, TensorStore
from mtc.store.fastio import PRIORITY_READ_AHEAD

__all__ = ["GradSpill", "grad_scratch_name"]


def grad_scratch_name(layer: int) -> str:
    """The scratch array holding disk layer ``layer``'s gradient between backward and its update."""
    return f"scratch/grad/{layer:04d}"


class GradSpill:
    """Scratch arrays for the gradients of ``numels``' layers in ``store``, and the per-step
    futures that order each read after the write of the same step."""

    def __init__(self, store: TensorStore, numels: dict[int, int], *, chunk_rows: int | None = None) -> None:
        self.store = store
        self.numels = {i: n for i, n in numels.items() if n}
        for i, n in self.numels.items():
            name = grad_scratch_name(i)
            if store.has_array(name):
                info = store.array_info(name)
                if info.shape == (n,) and info.dtype == STATE_DTYPE:
                    continue
                raise StoreError(f"scratch array {name} holds {info.shape} {info.dtype}, this run needs ({n},) float32; "
                                 "it is scratch space: delete the store's scratch/ folder and start again")
            store.create_array(name, (n,), STATE_DTYPE, chunk_rows=chunk_rows)
        self._lock = threading.Lock()
        # (layer, n) -> the n-th write of the layer's gradient: created by whichever of the write and
        # the read for it comes first, taken out of the table by the second
        self._pending: dict[tuple[int, int], Future[None]] = {}
        self._writes = dict.fromkeys(self.numels, 0)

    def _meet(self, key: tuple[int, int]) -> Future[None]:
        with self._lock:
            f = self._pending.pop(key, None)
            if f is None:
                f = self._pending[key] = Future()
            return f

    def write(self, layer: int, grad: torch.Tensor) -> Future[None]:
        """Start writing ``layer``'s final gradient of the next step (a contiguous fp32 CPU tensor,
        left unchanged until the returned Future is done): the read of the same step waits for it."""
        if layer not in self.numels:
            raise ValueError(f"layer {layer} has no gradient scratch array")
        with self._lock:
            n = self._writes[layer]
            self._writes[layer] = n + 1
        done = self._meet((layer, n))
        # ahead of write-behind: the update waits for this gradient, the next commit for the state
        fut = self.store.write_async(grad_scratch_name(layer), grad, priority=PRIORITY_READ_AHEAD)
        fut.add_done_callback(lambda f: _copy_outcome(f, done))
        return fut

    def landed(self, layer: int, n: int) -> Future[None]:
        """Completes once the ``n``-th gradient written for ``layer`` (counting from 0: the step's
        index since this object was made) is in its scratch array. Ask once per layer and step."""
        return self._meet((layer, n))

    def read_rows_async(self, layer: int, start: int, out: torch.Tensor, after: Future[None]) -> Future[None]:
        """Read rows [start, start + len(out)) of ``layer``'s gradient into ``out`` once ``after``
        (its `landed` future) is done; the call does not block."""
        result: Future[None] = Future()

        def start_read(w: Future[None]) -> None:
            if w.exception() is not None:
                result.set_exception(w.exception())
                return
            try:
                r = self.store.read_rows_into_async(grad_scratch_name(layer), start, out, priority=PRIORITY_READ_AHEAD)
            except BaseException as e:  # noqa: BLE001 -- handed to the update through the Future
                result.set_exception(e)
                return
            r.add_done_callback(lambda f: _copy_outcome(f, result))

        after.add_done_callback(start_read)
        return result


def _copy_outcome(src: Future[None], dst: Future[None]) -> None:
    if dst.done():
        return
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(None)
