"""Host collectives, measured: gloo's all-reduce over loopback between two local processes.

The data-parallel engine reduces gradients and gathers weights with gloo in host memory
(`mtc.runtime.collectives`), so `mtc plan --world-size` needs gloo's rate on this host
(`MachineProfile.gloo_gbps`). Two spawned processes join a gloo group on a free local port and
all-reduce one fp32 tensor a few times; the figure is the ring's bus bandwidth per rank,
2(N-1)/N x bytes over the best time, the same convention the planner divides by.
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import queue
import socket
import time
from typing import Any

__all__ = ["gloo_bus_gbps"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, nbytes: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t)  # the first call opens the ring's connections
        best = math.inf
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - t0)
        if rank == 0:
            out.put(best)
    finally:
        dist.destroy_process_group()


def gloo_bus_gbps(*, world: int = 2, mib: int = 32, repeats: int = 3, timeout_s: float = 120.0) -> float:
    """gloo all-reduce bus bandwidth per rank (GB/s) between ``world`` local processes over
    loopback, best of ``repeats`` on a ``mib`` MiB fp32 tensor. Raises RuntimeError when the
    processes do not finish within ``timeout_s``."""
    nbytes = max(4, mib * 2**20 // 4 * 4)
    ctx = mp.get_context("spawn")  # fresh interpreters: no forked torch state, no inherited threads
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, nbytes, repeats, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                best = out.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a gloo measurement process exited with code {dead[0]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gloo measurement did not finish within {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return 2 * (world - 1) / world * nbytes / best / 1e9
