"""Where a data-parallel rank keeps each layer's state when the placement is ``auto``: RAM, else disk.

Per rank, a ``ram`` layer holds its state shard (master, m, v: 12 B per shard parameter), the
whole gradient (4 B per parameter, reduced over the ranks) and the whole compute copy (all-gathered);
a ``disk`` layer (`mtc.runtime.dp_disk`) only the gradient and the compute copy, its state costing
the disk ring's few chunk-sized sets. The ranks of one host share its RAM. Pure arithmetic: no I/O.
"""

from __future__ import annotations

from mtc.runtime.placement import default_ram_budget
from mtc.runtime.tiers import DISK_CHUNK_NUMEL

__all__ = ["dp_auto_placement", "rank_host_bytes", "rank_ram_budget"]


def rank_host_bytes(tier: str, numel: int, world_size: int, compute_bytes: int) -> int:
    """Host RAM of one layer on one rank: a ram layer holds its state shard (12 B x shard), the
    whole gradient (4 B) and the whole compute copy; a disk layer only the gradient and the copy."""
    per = -(-numel // world_size)
    return (12 * per if tier == "ram" else 0) + (4 + compute_bytes) * per * world_size


def dp_auto_placement(numels: list[int], world_size: int, compute_bytes: int, ram_bytes: int, *, slots: int = 3,
                      chunk: int = DISK_CHUNK_NUMEL) -> list[str]:
    """``placement = auto`` on ``world_size`` ranks: every layer in RAM when the rank's budget
    ``ram_bytes`` holds them all; else every layer starts on disk (the disk ring's ``slots`` sets
    of one chunk off the budget first) and, in forward order, a layer moves up to RAM while the
    budget holds the difference (as the single-process `auto_placement`, without the GPU tier).
    When even all-disk does not fit, the result is all-disk (the launch fit check says so)."""
    if sum(rank_host_bytes("ram", n, world_size, compute_bytes) for n in numels) <= ram_bytes:
        return ["ram"] * len(numels)
    shards = [-(-n // world_size) for n in numels]
    left = ram_bytes - slots * 12 * min(max(shards, default=0), chunk)
    left -= sum(rank_host_bytes("disk", n, world_size, compute_bytes) for n in numels)
    placement = ["disk"] * len(numels)
    for i, n in enumerate(numels):
        up = rank_host_bytes("ram", n, world_size, compute_bytes) - rank_host_bytes("disk", n, world_size, compute_bytes)
        if left >= 0 and up <= left:
            placement[i], left = "ram", left - up
    return placement


def rank_ram_budget(cfg: object, local_world_size: int, compute_bytes: int = 0, available: int | None = None) -> int:
    """One rank's host RAM for state: ``ram_budget_gb`` (per rank), else its share of the host's
    default budget (``available``, this host's available memory when None, less one margin for the
    host: `default_ram_budget`; the ranks of a host split the rest evenly), less ``compute_bytes``:
    a rank's step compute where it takes host RAM (the CPU device; `mtc.planner.cpu_compute_bytes`).
    The run (`mtc.dist`), its fit check and `mtc plan --world-size` all take it from here."""
    if cfg.ram_budget_gb is not None:
        return int(cfg.ram_budget_gb * 2**30)
    local = max(1, local_world_size)
    return max(0, default_ram_budget(available) - local * compute_bytes) // local
