"""Disk layers' gradients spilled to the store between backward and the update.

Exact AdamW with global-norm clipping cannot update a layer before the whole step's gradient norm
is known, so every layer's final gradient must be kept until backward ends. For `disk` layers on
the CPU device (where the "device" is host memory) that is 4 bytes per parameter of host RAM for
the whole model: as much as the <= 4 B/param goal allows for everything; on CUDA it is 4 bytes per
parameter of GPU memory, which a large model's disk layers may not have. When the budget cannot
hold them, each disk layer's gradient is copied out of its slab, one store chunk at a time through
two staging buffers (pinned on CUDA, page-aligned for direct I/O on the CPU), and written, exact
fp32, to a scratch array of the store as soon as it is final (its per-parameter norms are taken
first, from the same values); the slab goes back to the executor's ring once copied, and the update
reads the gradient back with the layer's master, m and v (`mtc.runtime.disk_tier`). Memory for
gradients is then a few slabs and two chunks, whatever the depth.

Scratch arrays are named ``scratch/grad/LLLL``; they carry no state a commit needs (`mtc verify`
checks only the ``layers/`` arrays) and are rewritten every step. One array per layer suffices: the
update of step t reads layer i's gradient before the next forward fetches layer i, which is before
the backward of step t + 1 writes it again.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mtc.errors import StoreError
from mtc.runtime.transfer import CopyEngine, Marker
from mtc.runtime.pinned import host_buffer
from mtc.store import STATE_DTYPE, TensorStore
from mtc.store.fastio import PRIORITY_READ_AHEAD

__all__ = ["GradSpill", "grad_scratch_name"]


def grad_scratch_name(layer: int) -> str:
    """The scratch array holding disk layer ``layer``'s gradient between backward and its update."""
    return f"scratch/grad/{layer:04d}"


class GradSpill:
    """Scratch arrays for the gradients of ``numels``' layers in ``store``, and the per-step
    futures that order each read after the write of the same step."""

    def __init__(self, store: TensorStore, numels: dict[int, int], *, chunk_numel: int, pinned: bool = False,
                 chunk_rows: int | None = None) -> None:
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
        # per layer, its copy-out chunk: a whole number of the scratch array's chunks (direct I/O)
        self.chunk = {}
        for i, n in self.numels.items():
            rows = store.array_info(grad_scratch_name(i)).chunk_rows
            self.chunk[i] = min(n, max(1, chunk_numel // rows) * rows)
        size = max(self.chunk.values(), default=0)
        self._staging = [host_buffer(size, STATE_DTYPE, pinned=pinned) for _ in range(2 if self.numels else 0)]
        self.staging_bytes = sum(b.numel() * 4 for b in self._staging)
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for b in self._staging:
            self._free.put(b)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-grad-spill")
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

    def write(self, layer: int, grad: torch.Tensor, engine: CopyEngine, after: Marker | None = None) -> Future[None]:
        """Start spilling ``layer``'s final gradient of the next step from ``grad`` (its slab, on
        the compute device; complete once ``after`` is reached). Returns a Future done once the
        slab has been copied out (it may be reused then); the read of the same step waits for the
        writes to land (`landed`)."""
        if layer not in self.numels:
            raise ValueError(f"layer {layer} has no gradient scratch array")
        with self._lock:
            n = self._writes[layer]
            self._writes[layer] = n + 1
        landed = self._meet((layer, n))
        copied: Future[None] = Future()
        self._worker.submit(self._spill, layer, grad, engine, after, copied, landed)
        return copied

    def _spill(self, layer: int, grad: torch.Tensor, engine: CopyEngine, after: Marker | None, copied: Future[None],
               landed: Future[None]) -> None:
        name = grad_scratch_name(layer)
        writes: list[Future[None]] = []
        try:
            for lo in range(0, self.numels[layer], self.chunk[layer]):
                hi = min(lo + self.chunk[layer], self.numels[layer])
                full = self._free.get()  # once its last write has landed
                buf = full[: hi - lo]
                engine.d2h([(buf, grad[lo:hi])], after=after, layer=layer, stage="grad_spill").wait()
                # ahead of write-behind: the update waits for this gradient, the next commit for the state
                w = self.store.write_rows_async(name, lo, buf, priority=PRIORITY_READ_AHEAD)
                w.add_done_callback(lambda _f, b=full: self._free.put(b))
                writes.append(w)
        except BaseException as e:  # noqa: BLE001 -- handed to the executor and the update through the futures
            for f in (copied, landed):
                if not f.done():
                    f.set_exception(e)
            return
        copied.set_result(None)
        left = [len(writes)]
        lock = threading.Lock()

        def one(f: Future[None]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if f.exception() is not None or last:  # the first error, or the last write: the outcome
                _copy_outcome(f, landed)

        for w in writes:
            w.add_done_callback(one)

    def close(self) -> None:
        """Stop the spill thread (after the spills already started)."""
        self._worker.shutdown(wait=True)

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
