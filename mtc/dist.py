"""The distributed world: which rank this process is, its process groups, and its share of the host.

``torchrun --nproc-per-node N -m mtc train ...`` starts N copies of the trainer with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set.
`init_world` reads them, creates the process group (gloo for host tensors; NCCL as well for CUDA
tensors on a CUDA run) with a timeout, so that when one rank dies the others fail their next
collective and exit non-zero instead of hanging, and splits the host's CPU cores between the ranks
of one host (affinity and torch's thread count), so the host-side AdamW of N ranks does not
oversubscribe the cores.

Without torchrun (no ``WORLD_SIZE``, or 1) the world has one rank, no process group is created and
nothing here costs anything: the trainer runs today's single-process path. ``MTC_DP_ONE_RANK=1``
with one rank under torchrun runs the data-parallel engine anyway (a process group of one, shard
stores, the collectives): to measure its overhead over the plain path, and to check the NCCL
device path on a machine with one GPU.

Process groups. Collectives are issued from two threads, each with a fixed order that is the same
on every rank: the training thread (the step's target count, loss and squared norms: ``sync``)
and the data-parallel comm thread (gradient reductions, all-gathers, state gathers: ``comm``,
see `mtc.runtime.collectives`). One group per thread: two threads must never interleave
collectives on one group, or ranks could pair different operations. The comm thread uses
``comm`` (gloo, host tensors) on the host path and ``device`` on the device path
(`device_collectives`): NCCL on CUDA, gloo on the CPU device, so that the CPU tests run the very
code path a GPU run takes.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping

import torch

from mtc.errors import ConfigError

__all__ = ["PER_HOST_FIELDS", "World", "agree", "attach", "check_launch", "check_placement", "check_same_config",
           "check_same_placement", "check_same_start", "cpu_share", "current_world", "data_parallel_placement", "device_collectives",
           "gpu_shard_bytes", "groups", "init_world", "open_follower", "root_failed", "root_ready", "shutdown_world",
           "sum_over_ranks", "world_from_env"]


@dataclasses.dataclass(frozen=True, slots=True)
class World:
    """This process's place among the ranks of a run (one rank, world size 1, without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    force: bool = False  # one rank that runs the data-parallel engine anyway (MTC_DP_ONE_RANK=1)

    @property
    def distributed(self) -> bool:
        """Whether the data-parallel engine runs: more than one rank, or one forced to (a process
        group exists once `init_world` ran)."""
        return self.world_size > 1 or self.force

    @property
    def is_root(self) -> bool:
        """Rank 0: the one that writes the store, its commit records and the run's logs."""
        return self.rank == 0


@dataclasses.dataclass(slots=True)
class _Groups:
    sync: object  # the training thread's collectives
    comm: object  # the comm thread's collectives
    startup: object  # the wait for rank 0's store (long timeout: it may write step 0 of a large model)
    commit: object = None  # the writer thread's global commit protocol (mtc.shards.committer)
    device: object = None  # the comm thread's collectives on device tensors (NCCL on CUDA, gloo on the CPU device)


_GROUPS: _Groups | None = None


_ANNOUNCED = False  # rank 0 has told the others how its setup went (once per run)


def _startup_errors() -> dict[str, type]:
    """rank 0's setup errors a follower raises as they are (each takes one message)"""
    from mtc import errors

    return {c.__name__: c for c in (errors.ConfigError, errors.DataError, errors.PlanError, errors.StoreError,
                                    errors.StoreLockedError, errors.StoreCorruptionError, errors.CheckpointError,
                                    errors.TraceError)}


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {key}={raw!r} is not an integer; launch with torchrun, which sets it") from None


def world_from_env(env: Mapping[str, str] | None = None) -> World:
    """The `World` torchrun's environment variables describe (world size 1 when they are absent)."""
    env = os.environ if env is None else env
    size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", rank if size > 1 else 0)
    local_size = _env_int(env, "LOCAL_WORLD_SIZE", size)
    if size < 1 or not 0 <= rank < size or not 0 <= local_rank < local_size or local_size > size:
        raise ConfigError(f"inconsistent launch environment: RANK={rank} WORLD_SIZE={size} LOCAL_RANK={local_rank} "
                          f"LOCAL_WORLD_SIZE={local_size}; launch with `torchrun --nproc-per-node N -m mtc train ...`")
    force = size == 1 and env.get("MTC_DP_ONE_RANK", "") == "1" and "MASTER_ADDR" in env
    return World(rank, size, local_rank, local_size, force)


def current_world() -> World:
    """This process's `World`, from the environment (one rank when not launched by torchrun)."""
    return world_from_env()


def cpu_share(cpus: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores of ``cpus`` that rank ``local_rank`` of ``local_world_size`` ranks on a host gets:
    contiguous equal blocks (neighbouring cores share caches); with more ranks than cores each rank
    gets one core, shared round-robin."""
    cpus = sorted(cpus)
    if not cpus:
        return []
    if local_world_size >= len(cpus):
        return [cpus[local_rank % len(cpus)]]
    per, extra = divmod(len(cpus), local_world_size)
    lo = local_rank * per + min(local_rank, extra)
    return cpus[lo : lo + per + (1 if local_rank < extra else 0)]


def _pin_cpus(world: World) -> None:
    """Restrict this rank to its share of the host's cores and size torch's thread pool to it."""
    if world.local_world_size <= 1 or not hasattr(os, "sched_getaffinity"):
        return
    share = cpu_share(list(os.sched_getaffinity(0)), world.local_rank, world.local_world_size)
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


def init_world(device: str = "cpu", timeout_s: float = 60.0) -> World:
    """Join the process group torchrun described (idempotent) and take this rank's share of the host.

    World size 1 returns at once: no process group, no affinity change. ``timeout_s`` bounds every
    collective, so a rank whose peer died raises within it (gloo usually notices the closed
    connection at once). On CUDA each rank computes on GPU ``LOCAL_RANK``.
    """
    global _GROUPS
    world = current_world()
    if not world.distributed or _GROUPS is not None:
        return world
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        if torch.cuda.device_count() <= world.local_rank:
            raise ConfigError(f"rank {world.rank} has local rank {world.local_rank} but this host shows "
                              f"{torch.cuda.device_count()} GPUs; start at most that many ranks per host (--nproc-per-node)")
        torch.cuda.set_device(world.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # host tensors (ram-tier gradients and state) go over gloo; device tensors over NCCL
        try:
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timeout)
        except RuntimeError as e:  # DistStoreError (a rank never came), DistNetworkError (the port): both RuntimeErrors
            raise _join_failed(world, timeout_s, e) from e
    _GROUPS = _Groups(
        sync=dist.new_group(backend="gloo", timeout=timeout),
        comm=dist.new_group(backend="gloo", timeout=timeout),
        startup=dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=2)),
        commit=dist.new_group(backend="gloo", timeout=timeout),
        # NCCL creates its communicator at the first collective: nothing is paid on the host path
        device=dist.new_group(backend="nccl" if cuda else "gloo", timeout=timeout),
    )
    _pin_cpus(world)
    return world


def _join_failed(world: World, timeout_s: float, e: BaseException) -> Exception:
    """The one-line error of a rank that could not form the process group (``e``: torch's)."""
    import os

    from mtc.runtime.collectives import PeerLostError

    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return PeerLostError(
        f"rank {world.rank} of {world.world_size}: the ranks did not all meet at {where} within dist_timeout_s "
        f"({timeout_s:g} s): {first}; start the same command on every rank (every host's torchrun with the same "
        "--nnodes, --nproc-per-node and rendezvous address, reachable from each host), or raise --dist-timeout-s "
        "when hosts start far apart")


# Fields a rank may set for its own host; every other config field must be rank 0's
# (`check_same_config`): the model, data order, schedule, durability and the collectives'
# pattern are one run's. The device's index may differ, its kind may not.
PER_HOST_FIELDS = frozenset({
    "device", "io_threads", "optim_threads", "ram_budget_gb", "gpu_budget_gb", "activation_budget_gb", "rank_dir",
    "dist_timeout_s", "update_prefetch", "cuda_graphs", "save_activations",
})


def _shared_fields(cfg: object) -> dict[str, object]:
    """``cfg``'s fields that every rank must agree on, flat (``optim.lr``), the device as its kind."""
    d = cfg.to_dict()
    flat = {f"optim.{k}": v for k, v in d.pop("optim").items()}
    flat.update({k: v for k, v in d.items() if k not in PER_HOST_FIELDS})
    flat["device"] = cfg.device.partition(":")[0]
    flat["compute_dtype"] = cfg.resolved_compute_dtype
    return flat


def check_same_config(world: World, cfg: object) -> None:
    """Every rank must train rank 0's run: a rank launched with other flags (another lr, seed,
    grad_accum or durability) trained a different run beside it, unnoticed, and could leave shards
    a resume cannot read. Before any state is written, all ranks exchange their shared fields
    (all but `PER_HOST_FIELDS`); a difference stops every rank with the same one-line error."""
    if not world.distributed:
        return
    from mtc.runtime.collectives import collective

    mine = _shared_fields(cfg)
    every: list[object] = [None] * world.world_size
    collective("the config check", torch.distributed.all_gather_object, every, mine, group=groups().sync)
    root = every[0]
    for rank, theirs in enumerate(every):
        diff = sorted(k for k in set(root) | set(theirs) if root.get(k) != theirs.get(k))
        if diff:
            shown = ", ".join(f"{k} {root.get(k)!r} (rank 0) vs {theirs.get(k)!r}" for k in diff)
            raise ConfigError(
                f"rank {rank}'s config differs from rank 0's: {shown}; every rank must run the same command (only "
                f"{', '.join(sorted(PER_HOST_FIELDS - {'device'}))} and the device's index may differ per host): fix "
                f"rank {rank}'s flags or config file and relaunch every rank")


def groups() -> _Groups:
    """The process groups `init_world` made (raises when it has not run)."""
    if _GROUPS is None:
        raise RuntimeError("init_world() has not created the process groups")
    return _GROUPS


def shutdown_world() -> None:
    """Leave the process group (at the end of a distributed run; nothing for one rank)."""
    global _GROUPS, _ANNOUNCED
    if _GROUPS is None:
        return
    import torch.distributed as dist

    _GROUPS, _ANNOUNCED = None, False
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the trainer's data-parallel set-up (called by mtc.train) ---------------------------------


def check_launch(cfg: object, world: World, store_dir: object) -> None:
    """Refuse, before anything is written, a configuration a data-parallel run cannot take."""
    if not world.distributed:
        return
    if cfg.grad_accum % world.world_size:
        ok = max(world.world_size, cfg.grad_accum // world.world_size * world.world_size)
        raise ConfigError(f"config field grad_accum: the step's micro-batches are split evenly over the {world.world_size} "
                          f"ranks, so it must be a multiple of the world size, got {cfg.grad_accum}; use e.g. grad_accum = {ok} "
                          f"(the global batch is grad_accum x micro_batch_size sequences)")
    if store_dir is None:
        raise ConfigError("a data-parallel run needs a store directory (rank 0 writes it, the others read their start state from it)")
    if cfg.durability == "none":
        raise ConfigError("durability 'none' cannot run on several ranks: the other ranks read the start state from rank 0's "
                          "step-0 commit; use durability 'weights' or 'full'")


def device_collectives(cfg: object) -> bool:
    """Whether a data-parallel run reduces and gathers on the device (`mtc.runtime.device_comm`):
    config field ``dp_collectives``: ``device`` always (gloo on the CPU device), ``host`` never,
    ``auto`` on CUDA when this torch has NCCL."""
    mode, cuda = cfg.dp_collectives, str(cfg.device).startswith("cuda")
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    if mode == "device" and cuda and not nccl:
        raise ConfigError("config field dp_collectives is 'device' but this torch build has no NCCL for CUDA tensors; "
                          "install a CUDA build of torch, or pass --dp-collectives host")
    return mode == "device" or (mode == "auto" and cuda and nccl)


def gpu_shard_bytes(numel: int, world_size: int, compute_bytes: int) -> int:
    """GPU bytes a gpu-tier layer of ``numel`` parameters takes on each of ``world_size`` ranks
    (`StateTiers` and `DataParallel` allocate them): the shard's master, m, v and reduced gradient
    (16 B per shard element, and its compute-dtype copy when that is not fp32), the whole gradient
    and compute copy (padded to ``world_size`` shards)."""
    per = -(-numel // world_size)
    return 16 * per + (compute_bytes * per if compute_bytes != 4 else 0) + (4 + compute_bytes) * per * world_size


def _rank_cpu_compute(cfg: object, program: object, world: World, compute_bytes: int) -> int:
    """Host RAM one rank's step computes in on the CPU device (its share of the micro-batches), as
    `mtc.dist_plan.check_fit_ranks` counts it; 0 on CUDA."""
    if cfg.device.startswith("cuda"):
        return 0
    from mtc.costmodel import shape_from_program
    from mtc.planner import cpu_compute_bytes

    rcfg = dataclasses.replace(cfg, grad_accum=max(1, cfg.grad_accum // world.world_size))
    return cpu_compute_bytes(rcfg, shape_from_program(program, cfg.model, compute_bytes))


def data_parallel_placement(world: World, cfg: object, placement: list[str], gpu_update: set[int],
                            program: object, *, gpu_bytes: int | None = None) -> tuple[list[str], set[int]]:
    """The placement of a data-parallel run (one rank: unchanged). ``auto``: with device
    collectives on CUDA, in forward order, a layer goes to the gpu tier while its per-rank bytes
    (`gpu_shard_bytes`: the state is sharded, the gradient and compute copy are whole) fit in
    what is left of this rank's GPU budget ``gpu_bytes``; the other layers' shards stay in host
    RAM while the rank's RAM budget holds them, the rest on disk
    (`mtc.runtime.dp_placement.dp_auto_placement`). No GPU updates of ram layers. An explicit
    placement is checked (`check_placement`)."""
    if not world.distributed:
        return placement, gpu_update
    device = device_collectives(cfg)
    numels = [program.layer_numel(i) for i in range(len(placement))]
    if cfg.placement.strip() == "auto":
        from mtc.runtime.dp_placement import dp_auto_placement, rank_ram_budget

        left, cbytes = gpu_bytes or 0, torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
        on_gpu = []
        for n in numels:
            need = gpu_shard_bytes(n, world.world_size, cbytes)
            fits = device and gpu_bytes is not None and need <= left
            left -= need if fits else 0
            on_gpu.append(fits)
        host = dp_auto_placement([0 if g else n for g, n in zip(on_gpu, numels, strict=True)], world.world_size, cbytes,
                                 rank_ram_budget(cfg, world.local_world_size, _rank_cpu_compute(cfg, program, world, cbytes)))
        placement = ["gpu" if g else t for g, t in zip(on_gpu, host, strict=True)]
    if cfg.gpu_update.strip() == "auto":  # the host's cores update the shards: 1/N of the work each
        gpu_update = set()
    check_placement(world, placement, gpu_update, program, device=device)
    if cfg.disk_compute == "store" and any(t == "disk" and n for t, n in zip(placement, numels, strict=True)):
        raise ConfigError("config field disk_compute: 'store' reads a disk layer's weights from the store at each visit, but a "
                          "data-parallel rank's store holds only its shard; use disk_compute 'ram' or 'auto' (the ranks "
                          "all-gather each disk layer's compute copy into RAM)")
    return placement, gpu_update


def check_placement(world: World, placement: list[str], gpu_update: set[int], program: object, *,
                    device: bool = False) -> None:
    """Data-parallel runs shard ram- and disk-tier state, and with device collectives (``device``)
    gpu-tier state and GPU updates of ram layers (``gpu_update``): refuse the rest."""
    if not world.distributed:
        return
    allowed = {"ram", "disk", "gpu"} if device else {"ram", "disk"}
    other = sorted({t for i, t in enumerate(placement) if t not in allowed and program.layer_numel(i)})
    if other == ["gpu"]:
        raise ConfigError("placement puts layers in gpu, which a data-parallel run shards only with device collectives "
                          "(dp_collectives device, or auto on CUDA with NCCL); pass --dp-collectives device or --placement ram")
    if other or (gpu_update and not device):
        what = f"placement puts layers in {', '.join(other)}" if other else f"gpu_update names layers {sorted(gpu_update)}"
        tiers = "ram, disk and gpu" if device else "ram and disk"
        fix = ("" if other else " (GPU updates of ram layers need device collectives: --dp-collectives device, or auto on "
               "CUDA with NCCL)")
        raise ConfigError(f"a data-parallel run shards the {tiers} tiers only, but the {what}; pass --placement ram "
                          f"(or disk, or a split such as ram:0-3,disk:4-9) and --gpu-update none{fix}")


def open_follower(cfg: object, store_dir: object) -> object:
    """A rank other than 0: wait until rank 0's store holds the start state, then open it read-only."""
    from pathlib import Path

    from mtc.errors import StoreError
    from mtc.plan import load_plan
    from mtc.runtime.collectives import collective
    from mtc.store import TensorStore
    from mtc.train import Run

    from mtc.runtime.collectives import PeerLostError

    said: list[object] = [None]
    try:  # matched by root_ready or root_failed: None, or rank 0's error
        collective("waiting for rank 0's store", torch.distributed.broadcast_object_list, said, src=0,
                   group=groups().startup)
    except PeerLostError as e:  # rank 0 ended without a word (a crash, a signal): its log says why
        raise PeerLostError(f"rank {current_world().rank}: rank 0 stopped before the run started, without saying why "
                            "(see its log); fix what it reports and relaunch every rank") from e
    if said[0] is not None:
        kind, msg = said[0]  # type: ignore[misc]
        raise _startup_errors().get(kind, StoreError)(f"rank 0 could not start the run: {msg}")
    path = Path(store_dir)
    if not (path / "commit.json").exists():  # a new run: every rank commits step 0 together (mtc.shards)
        return Run(TensorStore.create(None, io_threads=cfg.io_threads), load_plan(path / "plan"), None, None)
    store = TensorStore.open(path, io_threads=cfg.io_threads, read_only=True)
    last = store.last_commit()
    if last is None:
        store.close()
        raise StoreError(f"store {path} has no commit after rank 0 set it up; see rank 0's error")
    return Run(store, load_plan(path / "plan"), last, None)


def _announce(said: object) -> None:
    global _ANNOUNCED
    from mtc.runtime.collectives import collective

    if _ANNOUNCED:
        return
    _ANNOUNCED = True
    collective("the start barrier", torch.distributed.broadcast_object_list, [said], src=0, group=groups().startup)


def root_ready(world: World) -> None:
    """Rank 0: the store directory and its plan exist (a new run), or the commit resumed from does."""
    if world.distributed:
        _announce(None)


def root_failed(world: World, error: BaseException) -> None:
    """Rank 0 could not set the run up (``error``, about to be raised): tell the other ranks,
    waiting in `open_follower`, so each stops with rank 0's reason, not with a lost peer."""
    if world.distributed and world.is_root and _GROUPS is not None:
        from mtc.errors import MTCError

        known = isinstance(error, MTCError) and type(error).__name__ in _startup_errors()
        try:
            _announce((type(error).__name__ if known else "StoreError",
                       str(error) if isinstance(error, MTCError) else f"{type(error).__name__}: {error}"))
        except MTCError:
            pass  # the others are gone already: rank 0's own error is what matters


def attach(engine: object, tiers: object, world: World, shard_store: object = None, *, device: bool = False) -> None:
    """Wire the data-parallel collectives into a built engine (optimizer and executor hooks);
    ``shard_store``: this rank's store of its state shard (`mtc.shards`); ``device``: reduce and
    gather on the device (`device_collectives`)."""
    from mtc.runtime.collectives import DataParallel
    from mtc.runtime.dp_disk import DiskShards, disk_shard_layers

    g = groups()
    dp = DataParallel(tiers, rank=world.rank, world_size=world.world_size, sync_group=g.sync, comm_group=g.comm,
                      device_group=g.device if device else None, copies=engine.copies)
    dp.shard_store = shard_store
    if disk_shard_layers(tiers):  # disk layers: their shards are read from and written to this rank's store
        dp.disk = DiskShards(tiers, shard_store, rank=world.rank, world_size=world.world_size)
        engine.optimizer.disk = dp.disk.ring  # the optimizer posts its read-ahead each step and closes it
    engine.optimizer.dp = dp
    engine.executor.reduce_count = dp.reduce_count
    if device:  # the executor hands each final gradient slab to the device reduce-scatter
        engine.executor.reduce_grad = dp.reduce_on_device


def agree(flag: bool) -> bool:
    """Rank 0's ``flag``, on every rank (a decision taken from rank 0's timing)."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    from mtc.runtime.collectives import collective

    collective("the commit decision", torch.distributed.broadcast, t, src=0, group=groups().sync)
    return bool(t.item())


def sum_over_ranks(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` (a CPU tensor) summed over every rank, in place, on the training thread's group;
    ``what`` names it in the error when a peer is lost."""
    from mtc.runtime.collectives import collective

    collective(what, torch.distributed.all_reduce, t, group=groups().sync)
    return t


def check_same_placement(world: World, placement: str, gpu_update: list[int]) -> None:
    """Every rank must hold the same tiers (``placement``, `mtc.runtime.placement.describe`) and
    GPU-update the same layers: the ranks' collectives follow them, and auto placement follows each
    host's own RAM and GPU budgets. Compared before any state is written; a difference stops
    every rank with the same one-line error."""
    if not world.distributed:
        return
    from mtc.runtime.collectives import collective

    every: list[object] = [None] * world.world_size
    collective("the placement check", torch.distributed.all_gather_object, every, (placement, gpu_update),
               group=groups().sync)
    other = [r for r, p in enumerate(every) if p != every[0]]
    if other:
        (mine, upd), (root, rupd) = every[other[0]], every[0]
        what = f"places the layers as {mine}" if mine != root else f"GPU-updates layers {upd}"
        theirs = root if mine != root else rupd
        raise ConfigError(
            f"rank {other[0]} {what}, rank 0 {'as ' if mine != root else ''}{theirs}: every rank must hold the same tiers "
            "(auto placement follows each host's RAM and GPU budgets); pass rank 0's placement as "
            f"--placement {root} on every rank, or the same --ram-budget-gb/--gpu-budget-gb, and relaunch")


def check_same_start(world: World, step: int, generation: int, data: dict | None = None) -> None:
    """Every rank must start from rank 0's commit (a shared filesystem may show a node a stale
    ``commit.json``) and read the same data (each host opens its own copy of the token file):
    compare each rank's (step, generation, data digest) with rank 0's; a mismatch is a one-line error."""
    if not world.distributed:
        return
    import hashlib
    import json

    from mtc.errors import DataError, StoreError
    from mtc.runtime.collectives import collective

    same = {k: v for k, v in (data or {}).items() if k != "path"}  # the path may differ between hosts
    digest = int.from_bytes(hashlib.sha256(json.dumps(same, sort_keys=True).encode()).digest()[:7], "little")
    t = torch.tensor([step, generation, digest], dtype=torch.int64)
    collective("the start check", torch.distributed.broadcast, t, src=0, group=groups().sync)
    if int(t[2]) != digest:
        raise DataError(f"rank {world.rank} reads other data than rank 0 ({(data or {}).get('path')}: size or content "
                        "differ): every host must have the same token file; copy rank 0's and relaunch")
    if (int(t[0]), int(t[1])) != (step, generation):
        raise StoreError(f"rank {world.rank} sees the store's last commit at step {step} (generation {generation}) but rank 0 "
                         f"starts from step {int(t[0])} (generation {int(t[1])}): the store directory must be the same "
                         "shared directory, fully visible on every node; check the mount and relaunch")
