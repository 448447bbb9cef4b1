"""`mtc plan`: where a run's state goes, what it needs of each memory, whether it fits, how fast.

A plan is made for one machine profile (`mtc.calibrate`: measured here, loaded from a file, or
built in) and one run config. It takes the engine's own placement functions
(`mtc.runtime.placement`), its bytes-per-tier table and its fit rules, so what `mtc plan` prints is
what `mtc train` would do and check; the step time comes from `mtc.costmodel`. `mtc train` runs the
same fit checks (`check_fit`) on the live machine before it creates anything.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

import mtc.calibrate as _calibrate
from mtc.calibrate import MachineProfile, builtin
from mtc.config import TrainConfig
from mtc.costmodel import ModelShape, StepTime, adamw_rate, model_shape, saved_bytes, shape_from_program, step_time
from mtc.errors import ConfigError
from mtc.graphs.program import Program
from mtc.runtime import placement as pl
from mtc.runtime.graph_replay import GraphBuffers, graph_memory_bytes, mixed_saves_bytes, resident_graph_bytes
from mtc.store.tensor_store import io_bounce_bytes

__all__ = ["Check", "Memory", "Plan", "UpdateRates", "check_fit", "saved_gpu_bytes", "saves_for", "extrapolations", "fit_checks", "gpu_workspace", "graph_gpu_extra",
           "largest_fit", "local_profile", "local_update_rates", "make_plan", "memory", "placement_for", "prefetch_for",
           "stateless_alternative", "update_rates"]

GiB = 2**30
MODES = ("full", "weights", "none")
# test hook (fault injection): pretend the store's file system has this many bytes free
DISK_FREE_ENV = "MTC_TEST_DISK_FREE_BYTES"


def _size(b: float) -> str:
    """MiB below 1 GiB, GiB below 1 TB, decimal TB (as disks are sold) from there."""
    if b < GiB:
        return f"{b / 2**20:,.1f} MiB"
    return f"{b / GiB:,.1f} GiB" if b < 1e12 else f"{b / 1e12:,.2f} TB"


def _count(n: float) -> str:
    """A parameter count as a plan prints it: 1.234B, 45.9M, 45,888 (0.000B said nothing of a small model)."""
    if n >= 1e9:
        return f"{n / 1e9:.3f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{int(n):,}"


def compute_bytes(cfg: TrainConfig, profile: MachineProfile) -> int:
    """Bytes per element of the compute dtype the run would use on ``profile``'s machine."""
    dtype = cfg.compute_dtype if cfg.compute_dtype != "auto" else ("bfloat16" if profile.accelerator == "cuda" else "float32")
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _graph_layers(cfg: TrainConfig, shape: ModelShape) -> list[GraphBuffers | None]:
    """Per layer, its template's CUDA-graph buffers when the run replays it (fused plans with graphs
    on): the blocks'; embed stages and heads save too few launches to be replayed."""
    if cfg.kernels == "unfused" or cfg.cuda_graphs == "off":
        return [None] * shape.n_layers
    return [b if 0 < i < shape.n_layers - 1 else None for i, b in enumerate(shape.graph_buffers)]


def graph_gpu_extra(cfg: TrainConfig, shape: ModelShape) -> list[int]:
    """Per layer, the GPU bytes its own replayed graphs add when it is placed on the GPU
    (`mtc.runtime.graph_replay.resident_graph_bytes`): what `auto_placement` charges besides its state."""
    return resident_graph_bytes(_graph_layers(cfg, shape))


def gpu_workspace(cfg: TrainConfig, shape: ModelShape, placement: list[str] | None = None) -> int:
    """GPU memory besides resident state: weight ring, gradient slabs, boundary activations, the
    head's logits, one layer's work, the fixed buffers of replayed CUDA graphs (fused plans) and 2 GiB of
    slack (`mtc.train`'s estimate). The graphs' buffers depend on ``placement`` (a graph per resident
    layer): None counts the part no placement changes (`graph_gpu_extra` is the rest, per layer)."""
    c = shape.compute_bytes
    largest = max(shape.numels)
    graphs = graph_memory_bytes(_graph_layers(cfg, shape), placement)
    return int(2 * largest * c + 3 * largest * 4 + _step_compute_bytes(cfg, shape, offload=True) + 2 * GiB + graphs)


def _step_compute_bytes(cfg: TrainConfig, shape: ModelShape, *, offload: bool) -> int:
    """What a step's compute holds at its peak besides weights and gradient slabs: the layers'
    boundary activations (at most ``--activation-budget-gb`` when ``offload``: the rest goes to host
    memory), the micro-batches' carries, one layer's work (~40 hidden-sized tensors) and the head's
    fp32 logits."""
    hidden = cfg.micro_batch_size * cfg.seq_len * shape.hidden * shape.compute_bytes
    acts = (cfg.activation_budget_gb * GiB if offload and cfg.activation_budget_gb is not None
            else cfg.grad_accum * shape.n_layers * hidden)
    head = cfg.micro_batch_size * cfg.seq_len * shape.head_width * 4
    return int(acts + 2 * cfg.grad_accum * hidden + 40 * hidden + head)


def cpu_compute_bytes(cfg: TrainConfig, shape: ModelShape) -> int:
    """Host RAM the compute of a run on the CPU device holds at its peak: the GPU's workspace less
    what the pipeline counts on the CPU (weight ring, gradient slabs), the CUDA graphs and the
    allocator's slack; boundary activations are all kept (on the CPU an offload has nowhere else to
    go). Measured on the 2-core VM (2026-11-29; 4 blocks of width 512, 1024 tokens per sequence,
    fp32): peak RSS grew 98 MB per sequence from 1 to 16 per micro-batch, where this counts 103;
    the plan put the run at 0.72 and 2.26 GB, peak RSS read 0.93 and 2.40 (RSS also counts ~0.16 GB of
    shared libraries' file pages, which the plan leaves to the page cache)."""
    return _step_compute_bytes(cfg, shape, offload=False)


def ram_budget_for_state(cfg: TrainConfig, shape: ModelShape, available: int | None, *, cuda: bool) -> int:
    """Host RAM for the state tiers and the pipeline: ``--ram-budget-gb``, else available memory
    less a margin (`default_ram_budget`) and, on the CPU device, less the step's compute
    (`cpu_compute_bytes`), which takes host RAM there."""
    if cfg.ram_budget_gb is not None:
        return int(cfg.ram_budget_gb * GiB)
    return max(0, pl.default_ram_budget(available) - (0 if cuda else cpu_compute_bytes(cfg, shape)))


def disk_compute_for(cfg: TrainConfig, shape: ModelShape, ram_bytes: int, cuda: bool) -> str:
    """Where disk layers' compute copy lives, as `mtc.train.run_disk_compute` resolves it, for the
    planned compute dtype and a RAM budget of ``ram_bytes``."""
    explicit = None if cfg.placement.strip() == "auto" else pl.resolve_placement(cfg.placement, shape.n_layers)
    return pl.resolve_disk_compute(cfg.disk_compute, explicit, list(shape.numels), shape.compute_bytes, ram_bytes=ram_bytes,
                                   device_is_cuda=cuda, tied_weights=_ties_weights(shape))


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateRates:
    """What the GPU-update cost model (`mtc.runtime.placement.choose_gpu_update`) balances, and
    where the figures come from."""

    cpu_params_per_s: float  # CPU AdamW while PCIe copies run
    pcie_bytes_per_s: float  # each direction while both run
    source: str
    pcie_one_way_bytes_per_s: float = pl.DEFAULT_PCIE_ONE_WAY_BYTES_S  # one direction alone (the slower of the two)

    def line(self) -> str:
        """One line for the run's log."""
        return (f"CPU AdamW {self.cpu_params_per_s / 1e9:.2f} G params/s, PCIe {self.pcie_bytes_per_s / 1e9:.1f} GB/s "
                f"per direction ({self.source})")


def update_rates(cfg: TrainConfig, profile: MachineProfile | None, why: str = "no machine profile") -> UpdateRates:
    """``profile``'s rates as the cost model takes them (as `mtc.dist_plan` reads them: AdamW on
    ``cfg.optim_threads`` threads slowed by concurrent copies, half the two-way PCIe rate), or
    the defaults when there is no profile (``why``)."""
    if profile is None:
        return UpdateRates(pl.DEFAULT_CPU_ADAMW_PARAMS_S, pl.DEFAULT_PCIE_BYTES_S, f"defaults: {why}")
    created = f", {profile.created}" if profile.created else ""
    return UpdateRates(adamw_rate(profile, cfg.optim_threads) * profile.adamw_with_copies, profile.both_gbps * 1e9 / 2,
                       f"machine profile {profile.name!r}{created}: {profile.source.split(' (')[0] or 'no source recorded'}",
                       min(profile.h2d_gbps, profile.d2h_gbps) * 1e9)


def local_profile(device: str, path: str | Path | None = None) -> tuple[MachineProfile | None, str]:
    """The last `mtc calibrate` profile (``path``, default ``~/.cache/mtc/machine.json``) when it
    was measured on this host and, for a CUDA ``device``, on its GPU model; else None and why not."""
    import socket

    p = Path(path) if path is not None else _calibrate.DEFAULT_PROFILE_PATH
    if not p.is_file():
        return None, f"no calibrated profile at {p} (`mtc calibrate` writes one)"
    try:
        prof = MachineProfile.load(p)
    except ConfigError as e:
        return None, f"profile {p} unreadable: {e}"
    cuda = torch.device(device).type == "cuda"
    host, gpu = prof.identity.get("host"), prof.identity.get("gpu")
    if host != socket.gethostname():
        return None, f"profile {p} was measured on host {host!r}, this is {socket.gethostname()!r}"
    if prof.accelerator != ("cuda" if cuda else "cpu"):
        return None, f"profile {p} was measured for accelerator {prof.accelerator!r}, the run uses {device!r}"
    here = torch.cuda.get_device_name(torch.device(device)) if cuda and torch.cuda.is_available() else "none"
    if gpu != here:
        return None, f"profile {p} was measured on GPU {gpu!r}, the run's is {here!r}"
    return prof, ""


def local_update_rates(cfg: TrainConfig, path: str | Path | None = None) -> UpdateRates:
    """The cost model's rates for a run on this machine: measured when this host's calibrated
    profile matches ``cfg.device`` (`local_profile`), else the defaults."""
    return update_rates(cfg, *local_profile(cfg.device, path))


def placement_for(cfg: TrainConfig, shape: ModelShape, profile: MachineProfile, *, disk_tier: bool = False) -> tuple[list[str], set[int]]:
    """Each layer's tier and the GPU-updated `ram` layers, as `mtc.train.plan_placement` chooses
    them, on ``profile``'s memory: the GPU first, then RAM up to the budget (with the
    pipeline's buffers of that placement), the rest on disk. ``disk_tier`` is kept for callers; the engine
    uses the RAM budget on every device now."""
    del disk_tier
    numels = list(shape.numels)
    cuda = profile.accelerator == "cuda"
    auto = None
    if cfg.placement.strip() == "auto":
        gpu = 0 if not cuda else cfg.gpu_budget_gb * GiB if cfg.gpu_budget_gb is not None else max(
            0, profile.gpu_memory_bytes - gpu_workspace(cfg, shape))
        ram = ram_budget_for_state(cfg, shape, profile.host_available_bytes, cuda=cuda)
        dc = disk_compute_for(cfg, shape, int(ram), cuda)
        auto = pl.auto_placement(numels, shape.compute_bytes, gpu_bytes=int(gpu), ram_bytes=int(ram), disk_compute=dc,
                                 grads_on_device=cuda,
                                 pipeline=lambda p: pl.pipeline_host_bytes(p, numels, disk_compute=dc, device_is_cuda=cuda,
                                                                           tied_weights=_ties_weights(shape)),
                                 # a --gpu-budget-gb is for state: resident layers' graphs are workspace beyond it
                                 gpu_extra=graph_gpu_extra(cfg, shape) if cuda and cfg.gpu_budget_gb is None else None)
    # (on a machine without a GPU, `gpu` layers are resident on the CPU device, as `mtc train`
    # --device cpu runs them: their state is host RAM, `memory` counts it there)
    placement = pl.resolve_placement(cfg.placement, shape.n_layers, auto=auto)
    rates = update_rates(cfg, profile)  # the planned machine's figures
    gpu_left = _gpu_left(cfg, shape, profile, placement) if cuda else None
    gpu_update = pl.resolve_gpu_update(cfg.gpu_update, placement, numels, device_is_cuda=cuda, cpu_params_per_s=rates.cpu_params_per_s,
                                       pcie_bytes_per_s=rates.pcie_bytes_per_s, compute_bytes=shape.compute_bytes, gpu_bytes=gpu_left,
                                       grads_on_device=pl.streamed_grads_on_device(cfg.activation_budget_gb),
                                       prefetch=cfg.update_prefetch, one_way_bytes_per_s=rates.pcie_one_way_bytes_per_s)
    return placement, gpu_update


def _gpu_left(cfg: TrainConfig, shape: ModelShape, profile: MachineProfile, placement: list[str]) -> int:
    """The GPU memory left for GPU-side updates' buffers once the placement's state and the
    workspace (with resident layers' CUDA graphs) are in."""
    budget = cfg.gpu_budget_gb * GiB if cfg.gpu_budget_gb is not None else profile.gpu_memory_bytes - gpu_workspace(cfg, shape, placement)
    return int(budget - pl.gpu_state_bytes(placement, list(shape.numels), shape.compute_bytes))


def prefetch_for(cfg: TrainConfig, shape: ModelShape, profile: MachineProfile, placement: list[str], gpu_update: set[int]) -> int:
    """The GPU-updated layers whose state loads during the backward, as `mtc.train.plan_prefetch`
    chooses them, on ``profile``'s GPU memory."""
    cuda = profile.accelerator == "cuda"
    left = _gpu_left(cfg, shape, profile, placement) if cuda else None
    return pl.choose_prefetch(cfg.update_prefetch, gpu_update, list(shape.numels), shape.compute_bytes, gpu_bytes=left,
                              grads_on_device=pl.streamed_grads_on_device(cfg.activation_budget_gb))


@dataclasses.dataclass(frozen=True, slots=True)
class Memory:
    """Bytes per tier."""

    gpu_state: int
    gpu_workspace: int
    host: int  # state tiers' host RAM (the fit check's figure), pinned part included
    pinned: int  # the part of it in pinned memory (CUDA machines; nothing is pinned on the CPU)
    disk: dict[str, int]  # store bytes (both generations) by durability mode
    grad_spill: bool = False  # disk layers' gradients wait in the store (the budget cannot hold them)
    disk_compute: str = "ram"  # where disk layers' compute copy lives: pinned RAM, or read from the store per visit
    gpu_saved: int = 0  # blocks' activations kept between their visits (`saves_for`)
    # the store's I/O threads' bounce buffers, at most (`mtc.store.tensor_store.io_bounce_bytes`):
    # host RAM beside ``host``, which is exactly what the engine holds and what --ram-budget-gb bounds
    store_io: int = 0
    process: int = 0  # the process itself: imports, the traced program (`pl.PROCESS_HOST_BYTES`), also beside ``host``
    compute: int = 0  # on the CPU device, the step's compute (`cpu_compute_bytes`): host RAM beside ``host`` too
    host_saved: int = 0  # on the CPU device, the blocks' activations kept between visits (``gpu_saved``'s bytes there)

    @property
    def gpu_peak(self) -> int:
        """Resident state plus workspace plus saved activations."""
        return self.gpu_state + self.gpu_workspace + self.gpu_saved

    @property
    def host_total(self) -> int:
        """Host RAM of the run: the engine's (``host``), the store's bounce buffers, the process and,
        on the CPU device, the step's compute and the activations blocks keep between visits."""
        return self.host + self.store_io + self.process + self.compute + self.host_saved

    def with_saved(self, nbytes: int, *, cuda: bool) -> Memory:
        """This with ``nbytes`` of blocks' saved activations where the device keeps them: GPU
        memory on CUDA, host RAM on the CPU device."""
        return dataclasses.replace(self, gpu_saved=nbytes) if cuda else dataclasses.replace(self, host_saved=nbytes)


def memory(cfg: TrainConfig, shape: ModelShape, placement: list[str], gpu_update: set[int], *, cuda: bool,
           host_available: int | None = None, gpu_memory: int | None = None, prefetch: int = 0,
           store_on_disk: bool = True) -> Memory:
    """Memory per tier of this placement (the table in `mtc.runtime.placement`) on a machine with
    ``host_available`` bytes of RAM (None: this one's) and ``gpu_memory`` bytes of GPU memory the
    run can use (None: unknown, and disk layers' gradients are planned on the GPU); ``prefetch``:
    the GPU-updated layers whose state loads ahead (a scratch set each). ``store_on_disk``: the
    run's store is a directory (an in-memory store has no I/O threads' bounce buffers)."""
    n, c = list(shape.numels), shape.compute_bytes
    # as `mtc.train` decides it: disk layers' gradients go to the store when the budget cannot hold
    # them (host RAM on the CPU; on CUDA the GPU memory left beside the workspace)
    budget = ram_budget_for_state(cfg, shape, host_available, cuda=cuda)
    dc = disk_compute_for(cfg, shape, budget, cuda)
    gpu_budget = None
    if cuda:
        gpu_budget = int(cfg.gpu_budget_gb * GiB) if cfg.gpu_budget_gb is not None else (
            None if gpu_memory is None else max(0, gpu_memory - gpu_workspace(cfg, shape, placement)))
    spill = pl.choose_grad_spill(placement, n, c, ram_bytes=budget, disk_compute=dc, device_is_cuda=cuda, gpu_bytes=gpu_budget,
                                 tied_weights=_ties_weights(shape))
    pipeline = pl.pipeline_host_bytes(placement, n, disk_compute=dc, device_is_cuda=cuda, grad_spill=spill,
                                      tied_weights=_ties_weights(shape))
    dev_grads = cuda and pl.streamed_grads_on_device(cfg.activation_budget_gb)
    pinned = 0
    for i, t in enumerate(placement if cuda else []):
        if t == "ram":  # compute copy (the master itself in fp32) and gradient; streamed layers pin m and v too
            # (and, most often, keep their gradient on the GPU instead)
            pinned += n[i] * (4 + c + (8 - (4 if dev_grads else 0) if i in gpu_update else 0) + (4 if i in gpu_update and c != 4 else 0))
        elif t == "disk":  # the compute copy when it stays in RAM (gradients wait on the GPU)
            pinned += n[i] * pl.host_bytes_per_param("disk", c, disk_compute=dc, grads_on_device=True)
    if cuda:
        pinned += pipeline  # read-ahead ring and visit staging are pinned on CUDA
    host = pl.host_bytes_needed(placement, n, c, disk_compute=dc, grads_on_device=cuda, grad_spill=spill) + pipeline
    if not cuda:  # `gpu` layers on the CPU device: resident state, in host RAM
        host += pl.gpu_state_bytes(placement, n, c, disk_grads_on_gpu=False)
    streamed = gpu_update if cuda else set()
    if dev_grads:
        host -= 4 * sum(n[i] for i in streamed)  # their gradients wait on the GPU
    return Memory(gpu_state=0 if not cuda else pl.gpu_state_bytes(placement, n, c, disk_grads_on_gpu=not spill)
                  + pl.streamed_gpu_bytes(streamed, n, c, grads_on_device=dev_grads, prefetch=prefetch),
                  gpu_workspace=gpu_workspace(cfg, shape, placement) if cuda else 0,
                  host=host, pinned=pinned, disk={m: pl.disk_bytes_needed(placement, n, m, grad_spill=spill) for m in MODES},
                  grad_spill=spill, disk_compute=dc,
                  store_io=io_bounce_bytes(max(n, default=0), cfg.io_threads) if store_on_disk else 0,
                  process=pl.PROCESS_HOST_BYTES, compute=0 if cuda else cpu_compute_bytes(cfg, shape))


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """One fit check: what is needed of a resource, what there is, and what to change if short."""

    what: str  # "disk", "host RAM", "GPU memory"
    need: int
    have: int
    fix: str

    @property
    def ok(self) -> bool:
        """Whether it fits."""
        return self.need <= self.have

    def line(self) -> str:
        """One line with the numbers (and, when it does not fit, what to change)."""
        if self.ok:
            return f"{self.what}: fits: needs {_size(self.need)}, has {_size(self.have)}"
        return f"{self.what}: DOES NOT FIT: needs {_size(self.need)}, has {_size(self.have)}; {self.fix}"


def fit_checks(cfg: TrainConfig, shape: ModelShape, placement: list[str], mem: Memory, *, disk_free: int | None,
               host_available: int, gpu_total: int | None, where: str = "the store's disk") -> list[Check]:
    """The checks `mtc train` runs before it creates anything: disk for both state generations of
    the durability mode, host RAM for the pinned buffers and resident layers, GPU memory for the
    resident layers plus one layer's workspace. ``disk_free`` None: no store on disk (skipped);
    ``gpu_total`` None: no GPU (skipped)."""
    desc = pl.describe(placement)
    checks = []
    if disk_free is not None:
        fits = [m for m in MODES if mem.disk[m] <= disk_free]
        alts = ", ".join(f"{m} {_size(mem.disk[m])}" for m in MODES)
        kept = {"full": "two generations of master, m and v", "weights": "two generations of the weights",
                "none": "one generation of the disk layers only"}[cfg.durability]
        fix = (f"durability {cfg.durability!r} keeps {kept}"
               f" (needs by mode: {alts}); " + (f"choose --durability {fits[0]}, " if fits else "no durability mode fits: ")
               + "free disk space, or put the store on a larger disk")
        checks.append(Check(f"disk ({where})", mem.disk[cfg.durability], disk_free, fix))
    budgeted = cfg.ram_budget_gb is not None
    have = int(cfg.ram_budget_gb * GiB) if budgeted else host_available
    # --ram-budget-gb bounds what the engine holds (``mem.host``); the machine's memory must also
    # hold what comes beside it: the store's bounce buffers and the process itself
    beside = 0 if budgeted else mem.store_io + mem.process + mem.compute + mem.host_saved
    dc, cuda = mem.disk_compute, gpu_total is not None
    # every layer on disk, its gradients kept or (on the CPU) spilled to the store, whichever needs
    # less (`pl.choose_grad_spill` spills only where that saves RAM: with few layers it costs more)
    all_disk, spills = ["disk"] * shape.n_layers, ((False,) if cuda else (False, True))
    least, spill_least = min((_host_need(shape, all_disk, dc, cuda, spill=s) + beside, s) for s in spills)
    store_least = min(_host_need(shape, all_disk, "store", cuda, spill=s) + beside for s in spills)
    per_disk = pl.host_bytes_per_param("disk", shape.compute_bytes, disk_compute=dc, grads_on_device=cuda, grad_spill=spill_least)
    if least > have and dc == "ram" and store_least <= have:
        fix = (f"disk layers keep their {shape.compute_bytes}-byte compute copy in RAM ({_size(least)} with every layer on "
               f"disk); --disk-compute store reads it from the store at each visit instead ({_size(store_least)}, "
               "4 B/param more disk reads per visit)")
    elif least > have:
        # `cpu_compute_bytes`: a micro-batch's tensors, times --grad-accum for the boundary
        # activations and carries, which every micro-batch of the step keeps until its backward
        compute = mem.compute and not budgeted
        fix = (f"even with every layer on disk the run needs {_size(least)} ({per_disk} B/param plus the fixed pipeline "
               "buffers, which grow with the largest layer" + (f", and the step's compute on the CPU, {_size(mem.compute)}, which "
                                                              "grows with --micro-batch-size, --seq-len and --grad-accum"
                                                              if compute else "") + "): "
               + ("raise --ram-budget-gb, " if cfg.ram_budget_gb is not None else "")
               + ("lower --micro-batch-size, --seq-len or --grad-accum, " if compute else "")
               + ("keep fewer blocks' activations (--save-activations), " if mem.host_saved and not budgeted else "")
               + "use a machine with more RAM or a smaller model")
    else:
        fix = f"put more layers on disk (--placement {_split_for(shape, have - beside, dc, cuda)})" + (
            " or raise --ram-budget-gb" if cfg.ram_budget_gb is not None else "") + (
            ", or keep fewer blocks' activations (--save-activations)" if mem.host_saved and not budgeted else "")
    budget = "the --ram-budget-gb" if budgeted else "available"
    io = (f" + store I/O bounce buffers up to {_size(mem.store_io)}" if mem.store_io else "") + (
        f" + process overhead {_size(mem.process)}" if mem.process else "") + (
        f" + compute on the CPU {_size(mem.compute)}" if mem.compute else "") + (
        f" + saved activations {_size(mem.host_saved)}" if mem.host_saved else "")
    parts = (f"; the engine {_size(mem.host)}{io}" if beside else f"; beside it: {io[3:]}" if io else "")
    checks.append(Check(f"host RAM ({budget}; placement {desc}{parts})", mem.host + beside, have, fix))
    if gpu_total is not None:
        saved = f" + saved activations {_size(mem.gpu_saved)}" if mem.gpu_saved else ""
        checks.append(Check(f"GPU memory (state and GPU-side update buffers {_size(mem.gpu_state)} + workspace {_size(mem.gpu_workspace)}{saved})",
                            mem.gpu_peak, gpu_total,
                            "place fewer layers on the GPU (--placement), lower --micro-batch-size, or set --activation-budget-gb"
                            + (", or keep fewer blocks' activations (--save-activations)" if mem.gpu_saved else "")))
    return checks


def _ties_weights(shape: ModelShape) -> bool:
    """Whether a layer of ``shape`` reads a weight another layer owns (tied embeddings): only then
    does a weight slot (and its visit staging) hold two layers' weights and one more gradient slab
    stay open (the executor sizes its ring by the largest visit). Assuming it for every model
    doubled the staging of a 70B model's all-disk run on CUDA (7.8 GiB counted twice)."""
    return shape.fetch_numels != shape.numels


def _host_need(shape: ModelShape, placement: list[str], disk_compute: str, cuda: bool, *, spill: bool = False) -> int:
    """Host RAM of ``placement``: the state tiers plus the bounded pipeline (as `memory` counts it)."""
    numels, c = list(shape.numels), shape.compute_bytes
    return (pl.host_bytes_needed(placement, numels, c, disk_compute=disk_compute, grads_on_device=cuda, grad_spill=spill)
            + pl.pipeline_host_bytes(placement, numels, disk_compute=disk_compute, device_is_cuda=cuda, grad_spill=spill,
                                     tied_weights=_ties_weights(shape)))


def _split_for(shape: ModelShape, host_bytes: int, disk_compute: str, cuda: bool) -> str:
    """A placement that keeps the first layers in RAM and the rest on disk, within ``host_bytes``."""
    n = shape.n_layers
    k = 0
    while k < n and _host_need(shape, ["ram"] * (k + 1) + ["disk"] * (n - k - 1), disk_compute, cuda) <= host_bytes:
        k += 1
    return pl.describe(["ram"] * k + ["disk"] * (n - k))


def check_fit(cfg: TrainConfig, program: Program, placement: list[str], gpu_update: set[int], store_dir: Path | None, *,
              new_run: bool, seeded_written: int | None = None, resumed_held: int | None = None) -> None:
    """`mtc train`'s refusal, before anything is written: every check that fails, one line each.
    ``seeded_written``: the store holds a seeded generation (`mtc import`, --init-from) the run
    starts from, and this many bytes an earlier attempt wrote beyond it: the disk check counts
    what the run adds to the seed. ``resumed_held``: a resumed run's store holds this many bytes
    of state, which the run writes over: they count as free."""
    cbytes = torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
    shape = shape_from_program(program, cfg.model, cbytes)
    cuda = cfg.device.startswith("cuda") and torch.cuda.is_available()
    # as mtc.train decides the gradient spill: from the GPU memory free now
    # an update_prefetch the user named (auto takes only what fits)
    prefetch = pl.choose_prefetch(cfg.update_prefetch, gpu_update, list(shape.numels), cbytes, gpu_bytes=None, grads_on_device=False)
    mem = memory(cfg, shape, placement, gpu_update, cuda=cuda,
                 gpu_memory=torch.cuda.mem_get_info(torch.device(cfg.device))[0] if cuda else None, prefetch=prefetch,
                 store_on_disk=store_dir is not None)
    if cfg.save_activations.strip() not in ("auto", "off"):  # blocks told to keep their activations (on the CPU: in host RAM)
        blocks = list(range(1, shape.n_layers - 1))
        try:
            kept = pl.choose_saves(cfg.save_activations, blocks, [0] * len(blocks), ["block"] * len(blocks),
                                   micro_batches=cfg.grad_accum, gpu_bytes=None, replay_copy=False)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        mem = mem.with_saved(saved_gpu_bytes(cfg, shape, kept, placement, cuda=cuda), cuda=cuda)
    disk_free, where = None, ""
    if store_dir is not None and (new_run or seeded_written is not None or resumed_held is not None):
        probe = store_dir if store_dir.exists() else next(p for p in store_dir.absolute().parents if p.exists())
        disk_free = int(os.environ[DISK_FREE_ENV]) if os.environ.get(DISK_FREE_ENV) else shutil.disk_usage(probe).free
        where = f"free at {probe}"
    if seeded_written is not None and not new_run:
        n = list(shape.numels)
        mem = dataclasses.replace(mem, disk={m: pl.disk_bytes_beyond_seed(placement, n, m, grad_spill=mem.grad_spill) for m in MODES})
        if disk_free is not None:  # an earlier attempt of the same run wrote some of it already
            disk_free += seeded_written
        where += ", beyond the seeded generation the run starts from"
    if resumed_held is not None and disk_free is not None:
        disk_free += resumed_held
        where += f" and {resumed_held / 1e9:.3g} GB of state the store holds already"
    gpu_total = torch.cuda.mem_get_info(torch.device(cfg.device))[1] if cuda else None
    from mtc.dist_plan import check_fit_ranks, world_from_env

    world, local = world_from_env()
    if world > 1:  # one rank of a data-parallel run: its shards, and the host its ranks share
        # each of the host's ranks has imported and traced by now: MemAvailable has left out their
        # resident overhead, which the check counts; credit it back (this process's, for each)
        here = local * min(pl.process_anon_bytes(), pl.PROCESS_HOST_BYTES)
        checks = check_fit_ranks(cfg, shape, placement, world, local, disk_free=disk_free, host_available=pl.available_host_bytes() + here,
                                 gpu_total=gpu_total, where=where)
    else:
        # the process overhead the check counts is resident by now, which MemAvailable has left out:
        # that part is credited back (no more: a caller's own model, say, stays where it is)
        here = min(pl.process_anon_bytes(), mem.process)
        checks = fit_checks(cfg, shape, placement, mem, disk_free=disk_free, host_available=pl.available_host_bytes() + here,
                            gpu_total=gpu_total, where=where)
    bad = [c.line().replace(": DOES NOT FIT:", ":", 1) for c in checks if not c.ok]
    if bad:
        raise ConfigError("\n".join(f"this run does not fit: {b}" for b in bad))


# -- the plan ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A run's plan on one machine."""

    cfg: TrainConfig
    profile: MachineProfile
    shape: ModelShape
    placement: list[str]
    gpu_update: set[int]
    memory: Memory
    checks: list[Check]
    step: StepTime
    prefetch: int = 0  # GPU-updated layers whose state loads during the backward
    saves: list[int] = dataclasses.field(default_factory=list)  # blocks that keep their activations (`saves_for`)
    choice: str = ""  # why the plan took another candidate than the first (`make_plan`)

    @property
    def fits(self) -> bool:
        """Whether every fit check passes."""
        return all(c.ok for c in self.checks)

    def _fused(self) -> bool:
        """Whether the run's blocks are compiled (`saves_for`'s rule): saved bytes are then its
        estimate of what they keep, where an unfused block keeps its whole autograd graph."""
        return self.cfg.kernels == "fused" or (self.cfg.kernels == "auto" and self.profile.accelerator == "cuda")

    def _handoff_text(self) -> str:
        """Of the layers loaded ahead, those whose new weights stay on the device (`update_handoff`)."""
        handed = pl.handed_layers(self.gpu_update, self.prefetch, self.shape.compute_bytes, self.cfg.update_handoff)
        return f", {len(handed)} handing their new weights to the next visits on the device" if handed else ""

    def lines(self) -> list[str]:
        """The report `mtc plan` prints."""
        cfg, sh, m, st, pr = self.cfg, self.shape, self.memory, self.step, self.profile
        tokens = cfg.grad_accum * cfg.micro_batch_size * cfg.seq_len
        dtype = {2: "bfloat16", 4: "float32"}.get(sh.compute_bytes, f"{sh.compute_bytes} B")
        per_tier = {t: sum(n for n, p in zip(sh.numels, self.placement, strict=True) if p == t) for t in ("gpu", "ram", "disk")}
        out = [
            (f"model {sh.name}: {_count(sh.n_params)} parameters, {sh.n_layers} layers (embed, {sh.n_layers - 2} blocks, head); "
             f"{cfg.micro_batch_size} x {cfg.seq_len} tokens x grad_accum {cfg.grad_accum} = {tokens:,} tokens/step; compute {dtype}, state fp32"),
            f"machine {pr.name}: {pr.device}",
        ]
        out += [f"  assumed: {a}" for a in pr.assumed]
        out += [f"  warning: {pr.busy}"] if pr.busy else []
        out.append(f"placement {pl.describe(self.placement)}: gpu {_count(per_tier['gpu'])}, ram {_count(per_tier['ram'])}, "
                   f"disk {_count(per_tier['disk'])} params" + (f"; GPU updates ram layers {sorted(self.gpu_update)}" if self.gpu_update else "")
                   + (f" ({self.prefetch} loading their state during the backward{self._handoff_text()})" if self.prefetch else "")
                   + (f"; {len(self.saves)} of {sh.n_layers - 2} blocks keep their activations between visits "
                      + (f"({_size(m.gpu_saved)} on the GPU" if m.gpu_saved else f"({_size(m.host_saved)} in host RAM")
                      + ("" if self._fused() else ", as compiled blocks keep them: an unfused block's autograd graph keeps more")
                      + ")" if self.saves else "")
                   + ("" if not per_tier["disk"] else "; disk layers' weights read from the store at each visit"
                      if m.disk_compute == "store" else "; disk layers' compute copy in pinned RAM"))
        if self.choice:
            out.append(self.choice)
        saved = f" + saved activations {_size(m.gpu_saved)}" if m.gpu_saved else ""
        gpu = f"GPU peak {_size(m.gpu_peak)} (state {_size(m.gpu_state)} + workspace {_size(m.gpu_workspace)}{saved}), " if pr.accelerator == "cuda" else ""
        io = (f" + store I/O bounce buffers up to {_size(m.store_io)}" if m.store_io else "") + (
            f" + process overhead {_size(m.process)} (imports, the traced program)" if m.process else "") + (
            f" + compute {_size(m.compute)} (the step's activations, one layer's work and the logits, on the CPU)"
            if m.compute else "") + (f" + saved activations {_size(m.host_saved)}" if m.host_saved else "")
        out.append(f"memory: {gpu}host RAM {_size(m.host)} (pinned {_size(m.pinned)}){io}, disk {_size(m.disk[cfg.durability])} "
                   f"(durability {cfg.durability})")
        # disk layers keep all their state in the store, m and v too, so only the other layers' moments can be left out
        weights = ("two generations of the weights, and of the disk layers' m and v, which live there"
                   if per_tier["disk"] else "two generations of the weights")
        for mode in MODES:
            what = {"full": "two generations of master, m, v: exact crash-safe resume",
                    # a weights resume zeroes every layer's moments, the disk layers' kept ones too
                    "weights": f"{weights}: resume restarts Adam's moments (the disk layers' too)" if per_tier["disk"]
                    else f"{weights}: resume restarts Adam's moments",
                    "none": "nothing kept (disk layers hold one generation, updated in place): no resume"}[mode]
            fit = "fits" if m.disk[mode] <= pr.disk_free_bytes else "DOES NOT FIT"
            out.append(f"  durability {mode:7s} needs {_size(m.disk[mode]):>11s} of disk ({what}): {fit} in {_size(pr.disk_free_bytes)} free"
                       + ("  <- chosen" if mode == cfg.durability else ""))
        out += [f"fit: {c.line()}" for c in self.checks]
        stages = st.stages()
        out.append(f"step time (predicted): {st.step_s * 1e3:,.1f} ms = {tokens / st.step_s:,.0f} tokens/s; bottleneck: {st.bottleneck}")
        for k, v in stages.items():
            out.append(f"  {k:28s} {v * 1e3:10,.1f} ms busy per step")
        if pr.accelerator == "cuda" and st.step_s > 0:
            out.append(f"  model TFLOP/s {6 * sh.n_params * tokens / st.step_s / 1e12:,.0f} (6 x params x tokens / step)")
        per_day = st.disk_wear_bytes * 86400 / st.step_s if st.step_s > 0 else 0.0
        commits = ("" if not st.commits.every else
                   f" (commits of {_size(st.commits.bytes_per_commit)} every {st.commits.every} steps included)" if st.commits.bytes_per_commit
                   # all state on disk: each step writes it, and a commit only records which generation is whole
                   else f" (a commit every {st.commits.every} steps adds no state writes: the disk layers' state is written every step)")
        spill = f"; the disk layers' gradients waiting in the store add {_size(st.spill_bytes_written)}" if st.spill_bytes_written else ""
        out.append(f"disk writes: {_size(st.disk_wear_bytes)} per step, {_size(per_day)} per day of training{commits}{spill}")
        return out


# keeping activations instead of loading GPU-updated layers' state during the backward must
# predict at least this much faster (the cost model's noise between two close candidates)
TRADE_MARGIN = 0.02


def trades_prefetch_for_saves(cfg: TrainConfig, profile: MachineProfile) -> bool:
    """Whether the plan weighs GPU memory for saved activations against the update prefetch's
    buffer sets: both chosen automatically, on CUDA, for a fused plan, no fixed activation budget."""
    return (cfg.update_prefetch is None and cfg.save_activations.strip() == "auto" and profile.accelerator == "cuda"
            and cfg.kernels in ("auto", "fused") and cfg.activation_budget_gb is None)


def make_plan(cfg: TrainConfig, profile: MachineProfile, *, program: Program | None = None, shape: ModelShape | None = None,
              disk_tier: bool = False) -> Plan:
    """Plan ``cfg`` on ``profile``'s machine (the model from ``program``, else a trace of its preset).

    GPU memory beside the state goes to the update prefetch's buffer sets first and what is left
    to blocks' saved activations; where both are automatic (`trades_prefetch_for_saves`), the plan
    without prefetch (all of that memory for saved activations) is taken instead when the cost
    model predicts it faster by `TRADE_MARGIN`: a step bound by GPU compute gains more from not
    recomputing blocks (P1 at 48 sequences) than from updates that start earlier, one bound by the
    optimizer the reverse (P1 at 16). The plan's ``choice`` says which and why."""
    plan = _make_plan(cfg, profile, program=program, shape=shape, disk_tier=disk_tier)
    if not trades_prefetch_for_saves(cfg, profile) or not plan.prefetch:
        return plan
    alt = _make_plan(dataclasses.replace(cfg, update_prefetch=0), profile, shape=plan.shape, disk_tier=disk_tier)
    if not (alt.fits and len(alt.saves) > len(plan.saves) and alt.step.step_s < plan.step.step_s * (1 - TRADE_MARGIN)):
        return plan
    why = (f"update prefetch off: its GPU memory keeps {len(alt.saves)} blocks' activations instead of {len(plan.saves)}, "
           f"predicted {alt.step.step_s * 1e3:,.0f} ms per step against {plan.step.step_s * 1e3:,.0f} ms with "
           f"{plan.prefetch} layers prefetched")
    return dataclasses.replace(alt, choice=why)


def stateless_alternative(plan: Plan, program: Program | None = None) -> tuple[Plan | None, str]:
    """For an automatic placement that keeps state on the GPU: the plan with all state in host
    RAM instead (``--placement stateless``: that GPU memory goes to GPU-side updates' buffers and
    blocks' saved activations), and a line comparing their predicted steps; (None, "") otherwise.
    The planner does not choose between them: on the H100's records of 2026-11-26 the model's
    stateless steps came out 12-17 % short of the measured ones, more than the two differ by at
    the P1 shapes, so `mtc plan` shows both and the user (or bench_train, which runs both) decides."""
    cfg = plan.cfg
    if cfg.placement.strip() != "auto" or plan.profile.accelerator != "cuda" or "gpu" not in plan.placement:
        return None, ""
    alt = make_plan(dataclasses.replace(cfg, placement="stateless"), plan.profile, program=program, shape=plan.shape)
    if not alt.fits:
        return alt, "all state in host RAM (--placement stateless) would not fit this machine"
    rel = alt.step.step_s / plan.step.step_s
    return alt, (f"all state in host RAM instead (--placement stateless: the GPU updating {len(alt.gpu_update)} of the layers, "
                 f"{len(alt.saves)} blocks keeping their activations): predicted {alt.step.step_s * 1e3:,.0f} ms per step against "
                 f"{plan.step.step_s * 1e3:,.0f} ms with this placement ({rel:.2f}x); not chosen automatically, as the model's "
                 "streamed steps are the less certain (measure both)")


def _make_plan(cfg: TrainConfig, profile: MachineProfile, *, program: Program | None = None, shape: ModelShape | None = None,
               disk_tier: bool = False) -> Plan:
    cfg.validate()
    cbytes = compute_bytes(cfg, profile)
    if shape is None:
        shape = model_shape(cfg, {2: "bfloat16", 4: "float32"}[cbytes], program=program)
    placement, gpu_update = placement_for(cfg, shape, profile, disk_tier=disk_tier)
    prefetch = prefetch_for(cfg, shape, profile, placement, gpu_update)
    cuda = profile.accelerator == "cuda"
    mem = memory(cfg, shape, placement, gpu_update, cuda=cuda, host_available=profile.host_available_bytes,
                 gpu_memory=profile.gpu_memory_bytes if cuda else None, prefetch=prefetch)
    saves = saves_for(cfg, shape, profile, mem, placement, prefetch)
    if saves:
        mem = mem.with_saved(saved_gpu_bytes(cfg, shape, saves, placement, cuda=cuda), cuda=cuda)
    checks = fit_checks(cfg, shape, placement, mem, disk_free=profile.disk_free_bytes, host_available=profile.host_available_bytes,
                        gpu_total=profile.gpu_memory_bytes if cuda else None, where=f"{profile.disk_dir} on {profile.name}")
    st = step_time(cfg, shape, placement, gpu_update, profile, grad_spill=mem.grad_spill,
                   disk_compute=mem.disk_compute, prefetch=prefetch, saves=saves)
    return Plan(cfg, profile, shape, placement, gpu_update, mem, checks, st, prefetch, saves)


def saved_gpu_bytes(cfg: TrainConfig, shape: ModelShape, saves: list[int], placement: list[str], *, cuda: bool = True) -> int:
    """Memory the blocks ``saves`` keep between their visits, every micro-batch of the step (the
    estimate from the shapes: `mtc.costmodel.saved_bytes`; GPU memory on CUDA, host RAM on the
    CPU device), and, where compiled blocks replay as CUDA graphs, the second graph per ring slot
    when some streamed blocks save and others recompute (`_mixed_saves`)."""
    kept = cfg.grad_accum * sum(saved_bytes(shape.costs[i], shape.compute_bytes) for i in saves)
    streamed = [i for i in range(1, shape.n_layers - 1) if placement[i] != "gpu"]
    replayed = cuda and cfg.cuda_graphs != "off" and cfg.kernels != "unfused"
    if replayed and set(saves) & set(streamed) and set(streamed) - set(saves):
        kept += sum(_mixed_saves(cfg, shape, placement).values())
    return kept


def _mixed_saves(cfg: TrainConfig, shape: ModelShape, placement: list[str]) -> dict[str, int]:
    """`mtc.runtime.placement.choose_saves`'s ``mixed``: what the blocks' template adds when some
    of its streamed blocks save and others recompute (`mixed_saves_bytes`; replayed plans only)."""
    layers = _graph_layers(cfg, shape)
    streamed = [i for i in range(1, shape.n_layers - 1) if layers[i] is not None and placement[i] != "gpu"]
    return {"block": mixed_saves_bytes(layers[streamed[0]])} if streamed else {}


def saves_for(cfg: TrainConfig, shape: ModelShape, profile: MachineProfile, mem: Memory, placement: list[str],
              prefetch: int = 0) -> list[int]:
    """The blocks that keep their activations between visits, as `mtc.train.plan_saves` chooses
    them (`mtc.runtime.placement.choose_saves`), from the shapes' estimate of what each keeps
    (`mtc.costmodel.saved_bytes`: a compiled block's; an unfused block keeps more, its autograd
    graph) and the GPU memory ``mem`` leaves (less the margin an automatic update prefetch of
    ``prefetch`` layers keeps: `mtc.runtime.placement.prefetch_margin`); auto keeps none unfused,
    on the CPU, or with a fixed activation budget. Blocks: the layers between the embed stage and the head."""
    cuda = profile.accelerator == "cuda"
    if not (cfg.kernels == "fused" or (cfg.kernels == "auto" and cuda)) and cfg.save_activations.strip() == "auto":
        return []  # (unfused blocks keep their autograd graphs only when told: their size is not estimated)
    blocks = list(range(1, shape.n_layers - 1))
    left = None  # no GPU, or a fixed activation budget: auto keeps nothing
    if cuda and cfg.activation_budget_gb is None and cfg.gpu_budget_gb is not None:
        left = int(cfg.gpu_budget_gb * GiB) - mem.gpu_state
    elif cuda and cfg.activation_budget_gb is None:
        left = profile.gpu_memory_bytes - mem.gpu_peak - pl.prefetch_margin(cfg.update_prefetch, prefetch)
    try:
        return pl.choose_saves(cfg.save_activations, blocks, [saved_bytes(shape.costs[i], shape.compute_bytes) for i in blocks],
                               ["block"] * len(blocks), micro_batches=cfg.grad_accum, gpu_bytes=left,
                               replay_copy=cfg.cuda_graphs != "off", mixed=_mixed_saves(cfg, shape, placement))
    except ValueError as e:
        raise ConfigError(str(e)) from None


# -- extrapolations and the largest model ------------------------------------------------------

# Llama-shaped stand-ins (the 70b preset's vocabulary, heads of 128 and 8 KV heads); parameter
# counts are printed as traced
EXTRAPOLATION_MODELS = {
    "70b": {},
    "120b": {"dim": 10240, "n_heads": 80, "n_kv_heads": 8, "ffn_dim": 28672, "n_layers": 105},
    "175b": {"dim": 12288, "n_heads": 96, "n_kv_heads": 8, "ffn_dim": 32768, "n_layers": 112},
}
# a run such machines would make: 4k sequences, 256K tokens per step, activations offloaded beyond 16 GB
EXTRAPOLATION_RUN = {"seq_len": 4096, "micro_batch_size": 2, "grad_accum": 32, "activation_budget_gb": 16.0}
EXTRAPOLATIONS = (("70b", "h200-1.5tb"), ("120b", "h200-1.5tb"), ("175b", "256gb-4tb-nvme"))


def _extrapolation_cfg(model: str, durability: str) -> TrainConfig:
    return TrainConfig(model="70b", model_overrides=dict(EXTRAPOLATION_MODELS[model]), durability=durability, **EXTRAPOLATION_RUN)


def extrapolations() -> list[str]:
    """70B and 120B on an H200 with 1.5 TB of RAM, 175B on 256 GB of RAM + a 4 TB NVMe: one
    paragraph each, every durability mode said to fit or not."""
    out: list[str] = []
    for model, machine in EXTRAPOLATIONS:
        prof = builtin(machine)
        cfg = _extrapolation_cfg(model, "full")
        shape = model_shape(cfg, "bfloat16")
        shape = dataclasses.replace(shape, name=model)
        plans = {mode: make_plan(_extrapolation_cfg(model, mode), prof, shape=shape) for mode in MODES}
        p = plans["full"]
        out.append(f"{model} ({shape.n_params / 1e9:.1f}B params) on {prof.name}: {prof.device}")
        out.append(f"  placement {pl.describe(p.placement)}; GPU peak {_size(p.memory.gpu_peak)} of {_size(prof.gpu_memory_bytes)}, "
                   f"host RAM {_size(p.memory.host)} of {_size(prof.host_available_bytes)}")
        for mode, q in plans.items():
            bad = [c for c in q.checks if not c.ok]
            verdict = "fits" if not bad else "does NOT fit: " + "; ".join(
                f"{c.what.split(' (')[0]} needs {_size(c.need)}, has {_size(c.have)}" for c in bad)
            out.append(f"  durability {mode:7s} disk {_size(q.memory.disk[mode]):>10s}: {verdict}")
        st = p.step
        tokens = cfg.grad_accum * cfg.micro_batch_size * cfg.seq_len
        out.append(f"  step {st.step_s:,.1f} s for {tokens:,} tokens ({6 * shape.n_params * tokens / st.step_s / 1e12:,.0f} model TFLOP/s), "
                   f"bottleneck {st.bottleneck}")
    return out


def largest_fit(profile: MachineProfile, *, family: str = "8b") -> dict[str, int]:
    """The most parameters of a ``family``-shaped model (its blocks, more or fewer) whose fp32
    master, m and v fit this machine across GPU, RAM and disk, per durability mode (0: none fits)."""
    cfg = TrainConfig(model=family, seq_len=1024, micro_batch_size=1)
    dtype = "bfloat16" if profile.accelerator == "cuda" else "float32"
    one = model_shape(dataclasses.replace(cfg, model_overrides={"n_layers": 1}), dtype)
    out: dict[str, int] = {}
    for mode in MODES:
        c = dataclasses.replace(cfg, durability=mode)

        def fits(blocks: int, c: TrainConfig = c) -> tuple[bool, int]:
            sh = _with_blocks(one, blocks)
            placement, gu = placement_for(c, sh, profile, disk_tier=True)
            cuda = profile.accelerator == "cuda"
            mem = memory(c, sh, placement, gu, cuda=cuda, host_available=profile.host_available_bytes,
                         gpu_memory=profile.gpu_memory_bytes if cuda else None)
            checks = fit_checks(c, sh, placement, mem, disk_free=profile.disk_free_bytes, host_available=profile.host_available_bytes,
                                gpu_total=profile.gpu_memory_bytes if profile.accelerator == "cuda" else None)
            return all(x.ok for x in checks), sh.n_params

        lo, hi = 0, 1
        while fits(hi)[0] and hi < 1 << 16:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid)[0] else (lo, mid)
        ok, n = fits(lo)
        out[mode] = n if ok and lo > 0 else 0
    return out


def _with_blocks(one: ModelShape, blocks: int) -> ModelShape:
    """A one-block shape (embed, block, head) repeated to ``blocks`` blocks."""
    def rep(t: tuple) -> tuple:
        return (t[0],) + (t[1],) * blocks + (t[2],)

    return dataclasses.replace(one, numels=rep(one.numels), fetch_numels=rep(one.fetch_numels), costs=rep(one.costs),
                               sparse_tables=rep(one.sparse_tables), graph_buffers=rep(one.graph_buffers))
