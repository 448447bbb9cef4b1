"""`mtc plan --world-size N`: one data-parallel rank's plan, the host it shares, and the scaling.

The sharding rule (issue 13, `mtc.dist`, `mtc.runtime.collectives`): each layer's flat fp32
state is split into N contiguous shards of ``ceil(numel / N)`` parameters (the last ones padded),
and each rank owns one shard's master, m and v and runs its AdamW update. Every rank computes the
whole layer on its own micro-batches: the run's global batch (micro_batch_size x grad_accum) is
split by rank, grad_accum / N micro-batches each. The layer's gradient is reduced so that each
rank has its shard, and after the update the compute-dtype shards are all-gathered into every
rank's compute copy before the layer's next visit.

Three ways of doing that are modelled (`ENGINES`): ``engine``, what `torchrun ... mtc train` does
today (`mtc.runtime.collectives`, `mtc.runtime.device_comm`): on CUDA NCCL reduce-scatters each
layer's gradient on the GPUs (only the rank's shard crosses PCIe) and all-gathers the updated
shards there (the shard goes up, the gathered layer comes down into the host compute copy), the
gpu, ram and disk tiers are sharded (auto: the GPU first, from the rank's budget, then RAM, the
rest on disk; a disk shard is read from and written to the rank's store each step, its compute
copy whole in RAM), each rank writes its shard into its own store; on CPU machines gloo
reduce-scatters and all-gathers in host memory. ``host`` models ``dp_collectives = "host"`` on
CUDA: the whole gradient crosses to the host and gloo reduces and gathers in host memory; ram and
disk tiers. Both refuse durability 'none' (the other ranks start from rank 0's step-0 commit).
``design`` is issue 13's whole target, not built: NCCL on the GPUs, every tier, a disk layer's
gradient kept on the GPU.

What a rank needs, per layer of n parameters and shard s (c: compute-dtype bytes):

| tier | GPU | host RAM | disk (both generations, by durability) |
|---|---|---|---|
| gpu  | 16 s (+ c s, bf16) + 4 n (gradient) + c n (gathered copy) | 0 | full 24 s, weights 8 s, none 0 |
| ram  | 0 | 12 s + 4 n (4 s: NCCL reduce-scatter) + c n | full 24 s, weights 8 s, none 0 |
| disk | 0 (design: 4 n, the gradient, CUDA) | c n + 4 n (4 s: NCCL reduce-scatter; design: c n, + 4 n on the CPU device) | 24 s |

plus the disk tier's read-ahead ring of the largest shard and, on the CPU device, the executor's
buffers of the largest layer (as `mtc.runtime.placement.pipeline_host_bytes`). The compute copy is
whole in every rank's RAM (in fp32 too, where one process reads its master in place). With the
store per rank, each rank's disk holds its shards' generations.

Ranks on one host share it; the plan divides, not multiplies (`rank_profile`):
- CPU cores: each rank gets cores / R (R ranks per host); CPU compute slows when a rank has
  fewer threads than the profile's compute figures were measured with.
- host AdamW: the host-wide rate (all cores) is split between the ranks: it is bound by DRAM
  bandwidth, so R ranks update R shards no faster than one process updates one.
- PCIe: GPUs behind one host uplink share its rate (``pcie_uplinks``).
- disk: one store file system per host; its rates are split between the ranks that write it.
- host RAM: the available memory is split for the placement; the fit checks add the ranks up.
- host DRAM bandwidth (``host_memory_gbps``, where the profile has it): every rank's PCIe copies,
  AdamW traffic and disk reads go through it; the step is at least their sum over it.

Collectives use the ring algorithm: a reduce-scatter or all-gather of S bytes sends (N-1)/N x S per
rank in N-1 steps, an all-reduce 2(N-1)/N x S in 2(N-1) steps, at the slowest hop's bus bandwidth:
within a host the profile's ``peer_gbps`` for NCCL on the GPUs (NVLink, PCIe peer) and gloo's
loopback rate for host memory (a CPU profile's ``peer_gbps``), between hosts ``network_gbps`` (a
flat ring crosses each host boundary once, over all its NICs), plus ``collective_latency_us`` per
step. Figures a profile lacks are assumed and listed.
"""

from __future__ import annotations

import dataclasses
import os

from mtc.calibrate import MachineProfile
from mtc.config import TrainConfig
from mtc.costmodel import ModelShape, StepTime, adamw_rate, model_shape, step_time
from mtc.errors import ConfigError
from mtc.graphs.program import Program
from mtc.planner import MODES, Check, Memory, Plan, _count, _size, _ties_weights, compute_bytes, cpu_compute_bytes, gpu_workspace, make_plan, saved_gpu_bytes, saves_for
from mtc.runtime import placement as pl
from mtc.runtime.dp_placement import dp_auto_placement, rank_ram_budget
from mtc.store.tensor_store import io_bounce_bytes

__all__ = ["ENGINES", "DistPlan", "Engine", "Layout", "Link", "RankDist", "check_fit_ranks", "make_dist_plan", "rank_memory",
           "rank_profile", "ring_bytes", "scaling", "shard_numels", "world_from_env"]

GiB = 2**30
SCALING_WORLDS = (1, 2, 4, 8)
# figures assumed when a profile does not have them (listed in the plan's output when used)
PCIE_PEER_FRACTION = 0.5  # GPU-to-GPU through the host's PCIe: half the one-way host copy rate
GLOO_GBPS = 2.0  # gloo over loopback TCP on one host
NETWORK_GBPS = 12.5  # one 100 Gb/s NIC per host
LATENCY_US = {"nccl": 20.0, "gloo": 50.0}


@dataclasses.dataclass(frozen=True, slots=True)
class Engine:
    """How a data-parallel engine moves and keeps the sharded state (what the plan models)."""

    name: str
    device_collectives: bool  # CUDA: NCCL reduce-scatter / all-gather on the GPUs; else gloo in host memory
    tiers: tuple[str, ...]  # the tiers it shards
    summary: str
    durability_none: bool = True  # can run with durability 'none' (the engine's ranks start from the step-0 commit)
    host_reduce_scatter: bool = False  # gloo reduce-scatters the host gradient (torch 2.13's gloo has it), not all-reduce
    built: bool = True  # places layers as `mtc.dist.data_parallel_placement` does (a disk shard's compute copy whole in RAM)


ENGINES = {
    "engine": Engine("engine", True, ("gpu", "ram", "disk"),
                     "the engine as built (mtc.runtime.collectives, dp_collectives auto): on CUDA NCCL reduce-scatters the gradient "
                     "and all-gathers the updated shards on the GPUs, only the shard crosses PCIe down; gloo in host memory on CPU "
                     "machines; a store per rank; gpu, ram and disk tiers (a disk shard is read from and written to the rank's "
                     "store each step, its compute copy whole in RAM)",
                     durability_none=False, host_reduce_scatter=True),
    "host": Engine("host", False, ("ram", "disk"),
                   "the engine with dp_collectives host: the whole gradient crosses to the host, gloo reduce-scatters it and "
                   "all-gathers weights in host memory, also on CUDA; a store per rank; ram and disk tiers",
                   durability_none=False, host_reduce_scatter=True),
    "design": Engine("design", True, ("gpu", "ram", "disk"),
                     "issue 13's design, not built: NCCL reduce-scatter and all-gather on the GPUs, a store per rank, every tier",
                     built=False),
}


def shard_numels(numels: tuple[int, ...] | list[int], world: int) -> tuple[int, ...]:
    """Each layer's shard at ``world`` ranks: ceil(numel / world) parameters (the last rank's padded)."""
    return tuple(-(-n // world) for n in numels)


def ring_bytes(kind: str, nbytes: float, world: int) -> float:
    """Bytes each rank sends in a ring collective over ``nbytes`` (the whole tensor): (N-1)/N for a
    reduce-scatter or all-gather, 2(N-1)/N for an all-reduce (a reduce-scatter, then an all-gather)."""
    factor = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}[kind]
    return factor * (world - 1) / world * nbytes


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """How the ranks sit on hosts."""

    world_size: int
    nodes: int
    backend: str  # "nccl" (CUDA) or "gloo" (CPU)

    @property
    def ranks_per_host(self) -> int:
        """Ranks sharing one host (its cores, RAM, disk, PCIe uplinks)."""
        return self.world_size // self.nodes

    @staticmethod
    def of(world_size: int, nodes: int, profile: MachineProfile) -> Layout:
        """Validate ``world_size`` ranks over ``nodes`` hosts of ``profile``'s kind."""
        if world_size < 1 or nodes < 1:
            raise ConfigError(f"--world-size and --nodes must be at least 1, got {world_size} and {nodes}")
        if world_size % nodes:
            raise ConfigError(f"--world-size {world_size} does not split evenly over --nodes {nodes}; "
                              f"give a world size that is a multiple of the node count, e.g. --world-size {nodes * max(1, world_size // nodes)}")
        cuda = profile.accelerator == "cuda"
        per_host = world_size // nodes
        if cuda and per_host > max(1, profile.gpus_per_host):
            need = -(-world_size // max(1, profile.gpus_per_host))
            raise ConfigError(f"{per_host} ranks per host need {per_host} GPUs, machine {profile.name!r} has "
                              f"{profile.gpus_per_host} per host; give --nodes {need}, or a machine with more GPUs "
                              "(e.g. --machine 8x-h100)")
        return Layout(world_size, nodes, "nccl" if cuda else "gloo")


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """The link the collectives run over: per-rank bus bandwidth and per-step latency."""

    name: str
    gbps: float
    latency_us: float

    def seconds(self, kind: str, nbytes: float, world: int) -> float:
        """One ring collective of ``kind`` over ``nbytes`` at ``world`` ranks."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        steps = (2 if kind == "all_reduce" else 1) * (world - 1)
        return ring_bytes(kind, nbytes, world) / (self.gbps * 1e9) + steps * self.latency_us * 1e-6


def link_for(profile: MachineProfile, lay: Layout, engine: Engine) -> tuple[Link, list[str]]:
    """The collectives' link for ``lay`` on ``profile``'s hosts, and what had to be assumed."""
    assumed: list[str] = []
    nccl = engine.device_collectives and lay.backend == "nccl"
    transport = "nccl" if nccl else "gloo"
    intra = profile.peer_gbps if nccl else profile.gloo_gbps or (profile.peer_gbps if profile.accelerator == "cpu" else 0.0)
    if not intra:
        intra = PCIE_PEER_FRACTION * profile.h2d_gbps if nccl else GLOO_GBPS
        if lay.ranks_per_host > 1:
            assumed.append(f"collectives within a host at {intra:g} GB/s per rank ("
                           + (f"PCIe peer: {PCIE_PEER_FRACTION:g} x the {profile.h2d_gbps:g} GB/s host copy rate" if nccl
                              else "gloo over loopback TCP in host memory") + ")")
    net = profile.network_gbps
    if lay.nodes > 1 and not net:
        net = NETWORK_GBPS
        assumed.append(f"network {net:g} GB/s per host (one 100 Gb/s NIC; the profile has no network_gbps)")
    lat = profile.collective_latency_us if nccl or profile.accelerator == "cpu" else 0.0
    if not lat:
        lat = LATENCY_US[transport]
        if lay.world_size > 1:
            assumed.append(f"{lat:g} us per ring step ({transport})")
    if lay.nodes > 1 and lay.ranks_per_host > 1:
        return Link(f"collectives ({transport}: ring over hosts, slowest hop)", min(intra, net), lat), assumed
    if lay.nodes > 1:
        return Link(f"collectives ({transport}: network)", net, lat), assumed
    return Link(f"collectives ({transport}: within the host)", intra, lat), assumed


@dataclasses.dataclass(frozen=True, slots=True)
class RankDist:
    """What `mtc.costmodel.step_time` needs to time one rank of a data-parallel run."""

    world_size: int
    ranks_per_host: int
    shard_numels: tuple[int, ...]
    reduce_scatter: bool  # NCCL: gradient reduce-scattered on the device; gloo: all-reduced in host memory
    link: Link
    host_memory_gbps: float  # the host's DRAM, shared by its ranks (0: not modelled)

    @property
    def link_stage(self) -> str:
        """The stage name of the collectives' busy time (the link is named in the plan)."""
        return "collectives"

    def reduce_seconds(self, numel: int) -> float:
        """The reduction of one layer's fp32 gradient (padded to N shards)."""
        kind = "reduce_scatter" if self.reduce_scatter else "all_reduce"
        return self.link.seconds(kind, 4 * self.world_size * -(-numel // self.world_size), self.world_size)

    def gather_seconds(self, numel: int, compute_bytes: int) -> float:
        """The all-gather of one layer's updated compute-dtype copy."""
        return self.link.seconds("all_gather", compute_bytes * self.world_size * -(-numel // self.world_size), self.world_size)

    def host_memory_seconds(self, pcie_bytes: float, updated: int, disk_bytes: float, compute_bytes: int, *,
                            n_total: int = 0) -> float:
        """The host's DRAM time per step for all its ranks: their copies, their CPU AdamW (read
        master, m, v, gradient; write master, m, v and the compute copy), disk traffic and, for
        collectives in host memory (gloo), each byte sent read once and each byte received written
        and, for the reduction, read again (3 x the ring bytes)."""
        if not self.host_memory_gbps:
            return 0.0
        per_rank = pcie_bytes + (28 + compute_bytes) * updated + disk_bytes
        if not self.reduce_scatter and n_total:
            padded = self.world_size * -(-n_total // self.world_size)
            per_rank += 3 * (ring_bytes("all_reduce", 4 * padded, self.world_size)
                             + ring_bytes("all_gather", compute_bytes * padded, self.world_size))
        return self.ranks_per_host * per_rank / (self.host_memory_gbps * 1e9)


def rank_profile(profile: MachineProfile, lay: Layout) -> MachineProfile:
    """One rank's share of a host of ``profile``'s kind (see the module docstring); with a store
    per rank, the host's ranks share its disk."""
    r = lay.ranks_per_host
    if r == 1:
        return profile
    cores = max(1, profile.cores // r)
    share = -(-r // profile.pcie_uplinks) if profile.pcie_uplinks else 1
    adamw = {k: v / r for k, v in profile.adamw_gparams_s.items()}
    threads = profile.compute_threads
    slow = threads / min(threads, cores) if profile.accelerator == "cpu" and threads else 1.0
    pcie = {} if profile.accelerator == "cpu" else {
        "h2d_gbps": profile.h2d_gbps / share, "d2h_gbps": profile.d2h_gbps / share, "both_gbps": profile.both_gbps / share}
    d = r  # a store per rank: the host's ranks share its disk
    return dataclasses.replace(
        profile, cores=cores, host_available_bytes=profile.host_available_bytes // r, **pcie,
        store_write_gbps=profile.store_write_gbps / d, store_read_gbps=profile.store_read_gbps / d,
        store_read_warm_gbps=profile.store_read_warm_gbps / d, store_write_busy_gbps=profile.store_write_busy_gbps / d,
        store_both_gbps=profile.store_both_gbps / d,
        disk_write_gbps=profile.disk_write_gbps / d, disk_read_gbps=profile.disk_read_gbps / d,
        adamw_gparams_s=adamw, adamw_one_thread_gparams_s=min(profile.adamw_one_thread_gparams_s, adamw[profile.adamw_impl]),
        compute_threads=min(threads, cores) if threads else 0,
        other_scale_fwd=profile.other_scale_fwd * slow, other_scale_bwd=profile.other_scale_bwd * slow)


def _rank_cfg(cfg: TrainConfig, world: int) -> TrainConfig:
    """The config one rank runs: its share of the global batch's micro-batches."""
    if cfg.grad_accum % world:
        raise ConfigError(f"the global batch ({cfg.grad_accum} micro-batches of {cfg.micro_batch_size}) does not split over "
                          f"{world} ranks; give --grad-accum a multiple of {world}, e.g. {world * max(1, cfg.grad_accum // world)}")
    return dataclasses.replace(cfg, grad_accum=cfg.grad_accum // world)


# -- memory per rank ---------------------------------------------------------------------------


def _tier_bytes(tier: str, n: int, s: int, c: int, cuda: bool, grad_shard: bool = False, host_grad: bool = False) -> tuple[int, int]:
    """(GPU, host RAM) bytes of one layer of ``n`` parameters, shard ``s``, in ``tier`` (the table
    above); ``grad_shard``: only the gradient's shard comes to the host (reduce-scattered on the GPU);
    ``host_grad``: a disk layer's gradient goes to the host (reduced there or its shard, as a ram
    layer's) and its compute copy is whole in RAM (the engine as built, `mtc.runtime.dp_disk`)."""
    if tier == "disk" and host_grad:
        return 0, c * n + (4 * s if grad_shard else 4 * n)
    if tier == "gpu":  # what `mtc.dist.gpu_shard_bytes` counts
        return 16 * s + (c * s if c != 4 else 0) + 4 * n + c * n, 0
    if tier == "ram":
        return 0, 12 * s + (4 * s if grad_shard else 4 * n) + c * n
    if tier == "disk":
        return (4 * n if cuda else 0), c * n + (0 if cuda else 4 * n)
    raise ValueError(f"unknown tier {tier!r}")


def _pipeline(placement: list[str], numels: list[int], shards: tuple[int, ...], cuda: bool, tied: bool = True) -> int:
    """The disk tier's read-ahead ring (of the largest disk shard) and, on the CPU, the executor's
    buffers: two weight slots and two gradient slabs of the largest layer, each slot two layers and
    one slab more when a layer reads another's weight (``tied``: `mtc.planner._ties_weights`)."""
    disk = [shards[i] for i, t in enumerate(placement) if t == "disk" and numels[i]]
    device = 0 if cuda else ((2 * 2 + 3) if tied else (2 + 2)) * 4 * max(numels, default=0)
    return device + (3 * (16 if cuda else 12) * max(disk) if disk else 0)


def rank_memory(cfg: TrainConfig, shape: ModelShape, placement: list[str], world: int, *, cuda: bool,
                engine: Engine = ENGINES["engine"]) -> Memory:
    """One rank's memory per tier (``cfg``: the rank's config); disk: this rank's own store."""
    n, c = list(shape.numels), shape.compute_bytes
    s = shard_numels(n, world)
    gpu = host = pinned = 0
    for i, t in enumerate(placement):
        g, h = _tier_bytes(t, n[i], s[i], c, cuda, grad_shard=cuda and engine.device_collectives,
                           host_grad=engine.built)
        gpu, host = gpu + g, host + h
        if cuda and t != "gpu":  # the gradient shard and the gathered compute copy are pinned
            pinned += h
    pipe = _pipeline(placement, n, s, cuda, _ties_weights(shape))
    disk = {m: sum((24 if t == "disk" else {"full": 24, "weights": 8, "none": 0}[m]) * s[i] for i, t in enumerate(placement))
            for m in MODES}
    # each rank is a process of its own with its own shard store on disk (several ranks need a
    # durable step-0 commit): its I/O threads' bounce buffers and the process overhead, beside ``host``
    return Memory(gpu_state=gpu, gpu_workspace=gpu_workspace(cfg, shape) if cuda else 0, host=host + pipe,
                  pinned=pinned + (pipe if cuda else 0), disk=disk,
                  store_io=io_bounce_bytes(max(s, default=0), cfg.io_threads), process=pl.PROCESS_HOST_BYTES,
                  compute=0 if cuda else cpu_compute_bytes(cfg, shape))  # a rank's own micro-batches, on the CPU


def _rank_budget(cfg: TrainConfig, shape: ModelShape, cuda: bool, local: int, host_available: int) -> int:
    """A rank's RAM for state, as the run takes it (`rank_ram_budget`): --ram-budget-gb, else its
    share of the host's default budget (one margin per host, not per rank) less, on the CPU, its
    step's compute (``cfg``: the rank's; `cpu_compute_bytes`)."""
    return rank_ram_budget(cfg, local, 0 if cuda else cpu_compute_bytes(cfg, shape), available=host_available)


def rank_placement(cfg: TrainConfig, shape: ModelShape, rprof: MachineProfile, world: int,
                   engine: Engine = ENGINES["design"], *, local: int = 1,
                   host_available: int | None = None) -> tuple[list[str], set[int]]:
    """Each layer's tier for one rank (auto: the GPU first, then the rank's share of RAM, the rest
    on disk, with the per-rank bytes above; the built engines as `mtc.dist.data_parallel_placement`
    places them) and the ram layers the GPU updates (auto: none under the built engines).
    ``local``: the ranks per host, which share ``host_available`` (the host's; default: the
    rank profile's share times ``local``)."""
    n, c, cuda = list(shape.numels), shape.compute_bytes, rprof.accelerator == "cuda"
    avail = rprof.host_available_bytes * local if host_available is None else host_available
    s = shard_numels(n, world)
    if engine.built:  # as `mtc.dist.data_parallel_placement`: the GPU first (per-rank bytes), then RAM, the rest on disk
        auto = None
        if cfg.placement.strip() == "auto":
            on_gpu = [False] * len(n)
            if cuda and engine.device_collectives:
                g_left = (cfg.gpu_budget_gb * GiB if cfg.gpu_budget_gb is not None
                          else max(0, rprof.gpu_memory_bytes - gpu_workspace(cfg, shape)))
                for i in range(len(n)):
                    need = _tier_bytes("gpu", n[i], s[i], c, cuda)[0]
                    if need <= g_left:
                        on_gpu[i], g_left = True, g_left - need
            budget = _rank_budget(cfg, shape, cuda, local, avail)
            host = dp_auto_placement([0 if g else k for g, k in zip(on_gpu, n, strict=True)], world, c, int(budget))
            auto = ["gpu" if g else t for g, t in zip(on_gpu, host, strict=True)]
        placement = pl.resolve_placement(cfg.placement, len(n), auto=auto)
        allowed = engine.tiers if cuda and engine.device_collectives else tuple(t for t in engine.tiers if t != "gpu")
        other = sorted({t for i, t in enumerate(placement) if t not in allowed and n[i]})
        named = cfg.gpu_update.strip() not in ("auto", "none", "")
        streams = cuda and engine.device_collectives  # the GPU may update ram layers' shards (named ones; auto: none)
        if other or (named and not streams):
            what = f"placement puts layers in {', '.join(other)}" if other else f"gpu_update {cfg.gpu_update!r} names layers"
            raise ConfigError(f"the data-parallel engine shards the {', '.join(allowed)} tiers, but the {what}; pass "
                              "--placement ram and --gpu-update none (the placement may also be disk or a ram/disk split; or "
                              "plan issue 13's design with --dp-model design)")
        if not named:
            return placement, set()
        return placement, pl.resolve_gpu_update(cfg.gpu_update, placement, list(s), device_is_cuda=True)
    auto = None
    if cfg.placement.strip() == "auto":
        g_left = (0 if not cuda else cfg.gpu_budget_gb * GiB if cfg.gpu_budget_gb is not None
                  else max(0, rprof.gpu_memory_bytes - gpu_workspace(cfg, shape)))
        r_left = _rank_budget(cfg, shape, cuda, local, avail)
        r_left -= _pipeline(["disk"] * len(n), n, s, cuda, _ties_weights(shape))
        auto = ["disk"] * len(n)
        for i in range(len(n)):
            g_left -= _tier_bytes("disk", n[i], s[i], c, cuda)[0]
            r_left -= _tier_bytes("disk", n[i], s[i], c, cuda)[1]
        for i in range(len(n)):  # as `placement.auto_placement`: up to the GPU, else to RAM, in forward order
            dg, dh = _tier_bytes("disk", n[i], s[i], c, cuda)
            gg, _ = _tier_bytes("gpu", n[i], s[i], c, cuda)
            _, rh = _tier_bytes("ram", n[i], s[i], c, cuda, grad_shard=cuda)
            if cuda and g_left >= 0 and gg - dg <= g_left:
                auto[i], g_left, r_left = "gpu", g_left - (gg - dg), r_left + dh
            elif r_left >= 0 and rh - dh <= r_left:
                auto[i], r_left = "ram", r_left - (rh - dh)
    placement = pl.resolve_placement(cfg.placement, len(n), auto=auto)
    if not cuda and "gpu" in placement:
        raise ConfigError(f"placement {pl.describe(placement)} puts layers on the GPU, machine {rprof.name!r} has none; use ram or disk")
    rate = adamw_rate(rprof, cfg.optim_threads) * rprof.adamw_with_copies
    # a rank's shard of the gradient is reduced into host memory: it streams in with the state
    gpu_update = pl.resolve_gpu_update(cfg.gpu_update, placement, list(s), device_is_cuda=cuda, cpu_params_per_s=rate,
                                       pcie_bytes_per_s=rprof.both_gbps * 1e9 / 2, grads_on_device=False, compute_bytes=c)
    return placement, gpu_update


def rank_checks(cfg: TrainConfig, mem: Memory, placement: list[str], lay: Layout, *, disk_free: int | None, host_available: int,
                gpu_total: int | None, where: str, engine: Engine = ENGINES["engine"]) -> list[Check]:
    """Fit checks for one rank and for the R ranks sharing its host: GPU memory per rank, host
    RAM and the stores' disk for the host's ranks together (``None``: skipped)."""
    r, desc = lay.ranks_per_host, pl.describe(placement)
    more_hosts = f"spread the ranks over more hosts (--nodes {lay.nodes * 2})" if r > 1 else "use hosts with more"
    checks = []
    if disk_free is not None:
        modes = [m for m in MODES if m != "none" or engine.durability_none]
        fits = [m for m in modes if r * mem.disk[m] <= disk_free]
        alts = ", ".join(f"{m} {_size(r * mem.disk[m])}" for m in modes)
        fix = (f"{r} rank(s) of this host keep their shards' generations on it (needs by mode: {alts}); "
               + (f"choose --durability {fits[0]}, " if fits else "no durability mode fits: ") + f"free disk space, or {more_hosts}"
               + (" disk" if r == 1 else ""))
        checks.append(Check(f"disk ({where}; {r} rank(s) x {_size(mem.disk[cfg.durability])})", r * mem.disk[cfg.durability],
                            disk_free, fix))
    if cfg.ram_budget_gb is not None:
        checks.append(Check(f"host RAM per rank (the --ram-budget-gb; placement {desc})", mem.host, int(cfg.ram_budget_gb * GiB),
                            "raise --ram-budget-gb or put more layers on disk (--placement)"))
    fewer = ("more ranks hold smaller shards of master, m and v (the gradient and the compute copy stay whole), or "
             + more_hosts + (" RAM" if r == 1 else "")) if "disk" not in engine.tiers else (
        f"put more layers on disk (--placement), or {more_hosts}" + (" RAM" if r == 1 else ""))
    # the machine holds each rank's engine, its store's bounce buffers and the process itself
    # (--ram-budget-gb, checked above, bounds the engine's bytes only, as with one process)
    beside = mem.store_io + mem.process + mem.compute
    parts = (f" (engine {_size(mem.host)} + store I/O bounce buffers up to {_size(mem.store_io)} + process overhead "
             f"{_size(mem.process)}" + (f" + compute on the CPU {_size(mem.compute)}" if mem.compute else "") + ")") if beside else ""
    checks.append(Check(f"host RAM ({r} rank(s) x {_size(mem.host + beside)}{parts}; placement {desc})", r * (mem.host + beside),
                        host_available, fewer))
    if gpu_total is not None:
        checks.append(Check(f"GPU memory per rank (resident state {_size(mem.gpu_state)} + workspace {_size(mem.gpu_workspace)})",
                            mem.gpu_peak, gpu_total,
                            "place fewer layers on the GPU (--placement), lower --micro-batch-size, or set --activation-budget-gb"))
    return checks


# -- the plan ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DistPlan:
    """One rank's plan in a data-parallel run of ``layout.world_size`` ranks."""

    cfg: TrainConfig  # the run's (global batch)
    rank_cfg: TrainConfig  # one rank's (its micro-batches)
    profile: MachineProfile  # one host
    rank: MachineProfile  # one rank's share of it
    layout: Layout
    dist: RankDist
    shape: ModelShape
    placement: list[str]
    gpu_update: set[int]
    memory: Memory  # per rank
    checks: list[Check]
    step: StepTime
    assumed: list[str]
    engine: Engine = ENGINES["engine"]

    @property
    def fits(self) -> bool:
        """Whether every fit check passes."""
        return all(c.ok for c in self.checks)

    @property
    def tokens_per_step(self) -> int:
        """The global batch's tokens."""
        return self.cfg.grad_accum * self.cfg.micro_batch_size * self.cfg.seq_len

    def collective_bytes(self) -> dict[str, float]:
        """Bytes each rank sends per step, by collective (ring algorithm, padded shards)."""
        w, c = self.layout.world_size, self.shape.compute_bytes
        padded = sum(w * s for s in self.dist.shard_numels)
        red = "reduce_scatter" if self.dist.reduce_scatter else "all_reduce"
        return {f"gradient {red.replace('_', '-')} (fp32)": ring_bytes(red, 4 * padded, w),
                f"weights all-gather ({ {2: 'bf16', 4: 'fp32'}.get(c, f'{c} B')})": ring_bytes("all_gather", c * padded, w)}

    def lines(self) -> list[str]:
        """The report `mtc plan --world-size N` prints."""
        cfg, sh, m, st, lay, pr, rp = self.cfg, self.shape, self.memory, self.step, self.layout, self.profile, self.rank
        w, r = lay.world_size, lay.ranks_per_host
        tokens = self.tokens_per_step
        dtype = {2: "bfloat16", 4: "float32"}.get(sh.compute_bytes, f"{sh.compute_bytes} B")
        pad = sum(w * s - n for s, n in zip(self.dist.shard_numels, sh.numels, strict=True))
        out = [
            (f"model {sh.name}: {_count(sh.n_params)} parameters, {sh.n_layers} layers (embed, {sh.n_layers - 2} blocks, head); "
             f"global batch {cfg.micro_batch_size} x {cfg.seq_len} tokens x grad_accum {cfg.grad_accum} = {tokens:,} tokens/step, "
             f"{self.rank_cfg.grad_accum} micro-batch(es) per rank; compute {dtype}, state fp32"),
            f"machine {pr.name} (one host): {pr.device}",
        ]
        out += [f"  assumed: {a}" for a in pr.assumed + self.assumed]
        out += [f"  warning: {pr.busy}"] if pr.busy else []
        out.append(f"world: {w} ranks = {lay.nodes} host(s) x {r} rank(s); each rank owns 1/{w} of every layer's "
                   f"fp32 master, m, v and its update ({pad:,} padding parameters over all layers)")
        out.append(f"  modelled: {self.engine.summary} (--dp-model {self.engine.name})")
        share = (f"  shared by the {r} ranks of a host (per rank): CPU cores {pr.cores} -> {rp.cores}, host AdamW "
                 f"{pr.adamw_rate:g} -> {rp.adamw_rate:.3g} G params/s, store write/read {pr.store_write_gbps:g}/{pr.store_read_gbps:g} "
                 f"-> {rp.store_write_gbps:.3g}/{rp.store_read_gbps:.3g} GB/s, RAM {_size(pr.host_available_bytes)} -> "
                 f"{_size(rp.host_available_bytes)}")
        if pr.accelerator == "cuda":
            share += f", PCIe both ways {pr.both_gbps:g} -> {rp.both_gbps:.3g} GB/s ({pr.pcie_uplinks or 'one per GPU'} uplink(s))"
        out.append(share)
        if self.dist.host_memory_gbps:
            out.append(f"  host DRAM {self.dist.host_memory_gbps:g} GB/s shared by the host's copies, AdamW and disk traffic")
        link = self.dist.link
        out.append(f"  {link.name}: {link.gbps:g} GB/s bus bandwidth per rank, {link.latency_us:g} us per ring step")
        per_tier = {t: sum(n for n, p in zip(sh.numels, self.placement, strict=True) if p == t) for t in ("gpu", "ram", "disk")}
        out.append(f"placement per rank {pl.describe(self.placement)}: gpu {_count(per_tier['gpu'])}, ram {_count(per_tier['ram'])}, "
                   f"disk {_count(per_tier['disk'])} params (each rank holds 1/{w} of their state)"
                   + (f"; GPU updates ram layers {sorted(self.gpu_update)}" if self.gpu_update else ""))
        gpu = f"GPU peak {_size(m.gpu_peak)} (state {_size(m.gpu_state)} + workspace {_size(m.gpu_workspace)}), " if pr.accelerator == "cuda" else ""
        disk_host = r * m.disk[cfg.durability]
        beside = (f" + store I/O bounce buffers up to {_size(m.store_io)}" if m.store_io else "") + (
            f" + process overhead {_size(m.process)}" if m.process else "") + (
            f" + compute {_size(m.compute)} (on the CPU)" if m.compute else "")
        out.append(f"memory per rank: {gpu}host RAM {_size(m.host)} (pinned {_size(m.pinned)}){beside}; per host ({r} ranks): "
                   f"host RAM {_size(r * m.host_total)}; disk {_size(disk_host)} " + "(per host, "
                   + f"durability {cfg.durability})")
        for mode in MODES:
            need = r * m.disk[mode]
            fit = "fits" if need <= pr.disk_free_bytes else "DOES NOT FIT"
            if mode == "none" and not self.engine.durability_none:
                fit = "not possible on several ranks (they start from the step-0 commit)"
            what = f"per host ({_size(m.disk[mode])} per rank)"
            out.append(f"  durability {mode:7s} needs {_size(need):>11s} {what}: {fit} in {_size(pr.disk_free_bytes)} free"
                       + ("  <- chosen" if mode == cfg.durability else ""))
        out += [f"fit: {c.line()}" for c in self.checks]
        coll = self.collective_bytes()
        out.append("collectives per step, sent by each rank (ring: (N-1)/N of the tensor per reduce-scatter or all-gather, "
                   "2(N-1)/N per all-reduce): " + ", ".join(f"{k} {_size(v)}" for k, v in coll.items()))
        per_gpu = tokens / w / st.step_s if st.step_s > 0 else 0.0
        out.append(f"step time (predicted, per rank): {st.step_s * 1e3:,.1f} ms = {per_gpu:,.0f} tokens/s per "
                   f"{'GPU' if pr.accelerator == 'cuda' else 'rank'}, {tokens / st.step_s:,.0f} tokens/s in all; bottleneck: {st.bottleneck}")
        for k, v in st.stages().items():
            out.append(f"  {k:40s} {v * 1e3:10,.1f} ms busy per step")
        per_day = st.disk_wear_bytes * 86400 / st.step_s if st.step_s > 0 else 0.0
        who = f"each rank (x {r} per host)"
        out.append(f"disk writes by {who}: {_size(st.disk_wear_bytes)} per step, {_size(per_day)} per day")
        return out


def _dist_for(shape: ModelShape, lay: Layout, prof: MachineProfile, engine: Engine) -> tuple[RankDist, list[str]]:
    link, assumed = link_for(prof, lay, engine)
    shards = shard_numels(shape.numels, lay.world_size)
    reduce_scatter = engine.host_reduce_scatter or (engine.device_collectives and lay.backend == "nccl")
    return RankDist(lay.world_size, lay.ranks_per_host, shards, reduce_scatter, link,
                    prof.host_memory_gbps), assumed


def make_dist_plan(cfg: TrainConfig, profile: MachineProfile, world_size: int, *, nodes: int = 1, program: Program | None = None,
                   shape: ModelShape | None = None, engine: str = "engine") -> Plan | DistPlan:
    """Plan ``cfg`` at ``world_size`` ranks over ``nodes`` hosts of ``profile``'s kind, as
    ``engine`` (a key of `ENGINES`) would run it; at one rank exactly `mtc.planner.make_plan`."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown data-parallel model {engine!r}; choose {' or '.join(ENGINES)}")
    eng = ENGINES[engine]
    lay = Layout.of(world_size, nodes, profile)
    if world_size == 1:
        return make_plan(cfg, profile, program=program, shape=shape)
    cfg.validate()
    if not eng.durability_none and cfg.durability == "none":
        raise ConfigError("durability 'none' cannot run on several ranks: the other ranks start from rank 0's step-0 commit; "
                          "use --durability weights or full")
    if shape is None:
        shape = model_shape(cfg, {2: "bfloat16", 4: "float32"}[compute_bytes(cfg, profile)], program=program)
    rcfg = _rank_cfg(cfg, world_size)
    rprof = rank_profile(profile, lay)
    placement, gpu_update = rank_placement(rcfg, shape, rprof, world_size, eng, local=lay.ranks_per_host,
                                           host_available=profile.host_available_bytes)
    cuda = profile.accelerator == "cuda"
    mem = rank_memory(rcfg, shape, placement, world_size, cuda=cuda, engine=eng)
    saves = saves_for(rcfg, shape, rprof, mem, placement) if engine == "engine" else []  # (mtc's own: blocks keep their activations)
    if saves:
        mem = mem.with_saved(saved_gpu_bytes(rcfg, shape, saves, placement, cuda=cuda), cuda=cuda)
    checks = rank_checks(rcfg, mem, placement, lay, disk_free=profile.disk_free_bytes, host_available=profile.host_available_bytes,
                         gpu_total=profile.gpu_memory_bytes if cuda else None, where=f"{profile.disk_dir} on {profile.name}", engine=eng)
    dist, assumed = _dist_for(shape, lay, profile, eng)
    st = step_time(rcfg, shape, placement, gpu_update, rprof, dist=dist, saves=saves)
    return DistPlan(cfg, rcfg, profile, rprof, lay, dist, shape, placement, gpu_update, mem, checks, st, assumed, eng)


# -- scaling -----------------------------------------------------------------------------------

_WHY = {
    "CPU optimizer": "a host's cores and DRAM update every parameter of its ranks' shards: R ranks on one host share one "
                     "host-wide AdamW rate, so adding GPUs to a host does not shorten it; more hosts do",
    "PCIe": "every rank streams the whole model's weights on every visit, and GPUs behind one uplink share it",
    "disk I/O": "the ranks of a host share its disk",
    "host memory (shared)": "a host's DRAM carries all its ranks' copies, AdamW and disk traffic",
    "GPU compute": "each rank computes its share of the global batch; fewer micro-batches per rank amortise the weight "
                   "streaming less",
    "compute (CPU)": "the ranks of a host share its cores",
}


STUCK_EFFICIENCY = 0.75  # a stage whose busy time per rank falls to less than 3/4 of the way to 1/N does not scale
SIGNIFICANT = 0.10  # ... and limits the run once it is at least this share of the step


def stuck_stages(steps: dict[int, StepTime]) -> list[str]:
    """Stages whose busy time per rank does not shrink in proportion to 1/N from the smallest to
    the largest N (shared host resources, the collectives) and that take at least a tenth of the
    step at the largest N; the busiest first."""
    lo, hi = min(steps), max(steps)
    first, last, step = steps[lo].stages(), steps[hi].stages(), steps[hi].step_s

    def scales(k: str) -> bool:
        return first.get(k, 0.0) > 0 and first[k] * lo / (last[k] * hi) >= STUCK_EFFICIENCY

    stuck = [k for k in last if last[k] >= SIGNIFICANT * step and not scales(k) and not k.startswith("CPU cores")]
    return sorted(stuck, key=lambda k: -last[k])


def limiting_stage(steps: dict[int, StepTime]) -> str:
    """The stage that limits scaling: the bottleneck at the largest N if it does not shrink with N,
    else the busiest stage that does not, else the bottleneck (the run scales until another binds)."""
    bottleneck, stuck = steps[max(steps)].bottleneck, stuck_stages(steps)
    return bottleneck if bottleneck in stuck or not stuck else stuck[0]


def scaling(cfg: TrainConfig, profile: MachineProfile, shape: ModelShape, ranks_per_host: int,
            worlds: tuple[int, ...] = SCALING_WORLDS, *, engine: str = "engine") -> list[str]:
    """The same run (same global batch) at each world size, ``ranks_per_host`` ranks per host at
    most: step time, tokens/s per GPU and in all, each stage's busy time, and which stage limits it."""
    unit = "GPU" if profile.accelerator == "cuda" else "rank"
    out = [(f"scaling (predicted; the global batch of {cfg.grad_accum} x {cfg.micro_batch_size} sequences split by rank, "
            f"up to {ranks_per_host} rank(s) per host):"),
           f"  {'N':>3s} {'hosts x ranks':>13s} {'step ms':>10s} {'tok/s/' + unit:>12s} {'tok/s all':>12s} {'vs linear':>9s}  fits  bottleneck"]
    tokens = cfg.grad_accum * cfg.micro_batch_size * cfg.seq_len
    steps: dict[int, StepTime] = {}
    for w in worlds:
        r = min(w, ranks_per_host)
        nodes = -(-w // r)
        try:
            p = make_dist_plan(cfg, profile, w, nodes=nodes, shape=shape, engine=engine)
        except ConfigError as e:
            out.append(f"  {w:3d} {'':>13s} skipped: {e}")
            continue
        st = steps[w] = p.step
        total = tokens / st.step_s
        base = tokens / steps[1].step_s if 1 in steps else None
        eff = f"{total / (w * base):9.0%}" if base else f"{'-':>9s}"
        out.append(f"  {w:3d} {f'{nodes} x {r}':>13s} {st.step_s * 1e3:10,.1f} {total / w:12,.0f} {total:12,.0f} {eff}  "
                   f"{'yes ' if p.fits else 'NO  '}  {st.bottleneck}")
    if len(steps) < 2:
        return out
    names = list(dict.fromkeys(k for st in steps.values() for k in st.stages()))
    out.append(f"  {'busy ms per step, per rank':40s}" + "".join(f"{f'N={w}':>10s}" for w in steps))
    for k in names:
        out.append(f"  {k:40s}" + "".join(f"{st.stages().get(k, 0.0) * 1e3:10,.1f}" for st in steps.values()))
    lo, hi = min(steps), max(steps)
    name = limiting_stage(steps)
    key = next((k for k in _WHY if name.startswith(k)), None)
    why = _WHY.get(key, "the collectives' link: their bytes per rank do not shrink with N" if name.startswith("collectives") else "")
    eff = f" ({tokens / steps[hi].step_s / (hi * tokens / steps[1].step_s):.0%} of linear)" if 1 in steps else ""
    out.append(f"  limits scaling at N={hi}{eff}: {name}" + (f": {why}" if why else ""))
    stuck = stuck_stages(steps)
    if stuck:
        out.append(f"  busy time that does not shrink with N and takes >= {SIGNIFICANT:.0%} of the step (N={lo} -> N={hi}): " + ", ".join(
            f"{k} {steps[lo].stages().get(k, 0.0) * 1e3:,.0f} -> {steps[hi].stages()[k] * 1e3:,.0f} ms" for k in stuck))
    return out


# -- `mtc train`'s fit check under torchrun ------------------------------------------------------


def world_from_env() -> tuple[int, int]:
    """(world size, ranks on this host) of this process: `mtc.dist.current_world` where it exists,
    else torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE (1, 1 when not launched by torchrun)."""
    try:
        from mtc.dist import current_world  # type: ignore[import-not-found]
    except ImportError:
        current_world = None
    if current_world is not None:
        w = current_world()
        return int(w.world_size), int(w.local_world_size)
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} / LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')!r} "
                          "are not integers; launch with torchrun, which sets them") from None
    return max(1, world), max(1, min(local, world))


def check_fit_ranks(cfg: TrainConfig, shape: ModelShape, placement: list[str], world: int, local: int, *, disk_free: int | None,
                    host_available: int, gpu_total: int | None, where: str) -> list[Check]:
    """The fit checks of one rank of ``world`` with ``local`` ranks on this host (``cfg``: the run's)."""
    rcfg = dataclasses.replace(cfg, grad_accum=max(1, cfg.grad_accum // world))
    if cfg.placement.strip() == "auto":  # the placement the ranks will take (`mtc.dist.data_parallel_placement`)
        compute = 0 if gpu_total is not None else cpu_compute_bytes(rcfg, shape)  # a rank's step, in host RAM on the CPU
        placement = dp_auto_placement(list(shape.numels), world, shape.compute_bytes, rank_ram_budget(cfg, local, compute))
    lay = Layout(world, max(1, world // local), "nccl" if gpu_total is not None else "gloo")
    mem = rank_memory(rcfg, shape, placement, world, cuda=gpu_total is not None, engine=ENGINES["engine"])
    return rank_checks(rcfg, mem, placement, lay, disk_free=disk_free, host_available=host_available, gpu_total=gpu_total,
                       where=where, engine=ENGINES["engine"])
