"""Placement: which tier holds each layer's state, which `ram` layers the GPU updates, and what
the run needs of each memory (checked before anything is written).

Bytes per parameter of a layer, by tier (c = compute-dtype bytes: 2 for bf16; in fp32 the master
is the compute copy):

| tier | GPU (persistent) | host RAM | disk (two generations, by durability) |
|---|---|---|---|
| gpu  | 16 + (c if c != 4) | 0 (+12 pinned staging at commits) | full 24, weights 8, none 0 |
| ram  | 0 | 12 + 4 (pinned gradient) + (c if c != 4) | full 24, weights 8, none 0 |
| disk | 4 (gradient, CUDA) | c (compute copy in RAM) or 0 (read per visit); + 4 on the CPU device (gradient) unless spilled | 24 (it is the tier; none: 12, one generation updated in place); + 4 of gradient scratch when spilled |

Disk layers also need a bounded pipeline in host RAM, independent of depth (`pipeline_host_bytes`):
a ring of read-ahead sets (master, m, v and on CUDA or when spilled the gradient's host copy) of
one update chunk (the smaller of the largest disk layer and `DISK_CHUNK_NUMEL`: at h=4096 a whole
layer would be 3.5 GB per set), and, when the compute copy is read per visit, one fp32 staging
buffer per weight slot. So with every layer on disk and the compute copy read per visit, host RAM
per parameter is 0 on CUDA (on the CPU too when the gradients are spilled to the store, which
`choose_grad_spill` picks when the budget cannot hold them) plus that fixed pipeline.

A RAM budget (`default_ram_budget`: available memory minus a margin, or the user's) drives
`auto_placement`: every layer starts on disk, then layers move up to the GPU and to RAM in
forward order while the budgets hold them.

The GPU besides: a ring of weight slots (2 x the largest streamed layer, compute dtype), gradient
slabs (2-3 x the largest layer, fp32), the boundary activations within their budget and the
working memory of one layer's recompute. A `ram` layer the GPU updates (`gpu_update`) keeps its
4 B/param gradient on the GPU until its update (`streamed_grads_on_device`: not in data-parallel
runs, nor with a fixed activation budget), beside two scratch sets of master, m, v and the compute
copy (`streamed_gpu_bytes`); its host gradient buffer is not needed then.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence

from mtc.config import parse_layer_set, parse_placement
from mtc.errors import ConfigError
from mtc.runtime.tiers import DISK_SLOTS, StateTiers

__all__ = [
    "DEFAULT_CPU_ADAMW_PARAMS_S",
    "DEFAULT_PCIE_BYTES_S",
    "PROCESS_HOST_BYTES",
    "auto_placement",
    "available_host_bytes",
    "choose_gpu_update",
    "choose_grad_spill",
    "choose_saves",
    "default_ram_budget",
    "disk_bytes_beyond_seed",
    "disk_bytes_needed",
    "handed_layers",
    "host_bytes_needed",
    "host_bytes_per_param",
    "pipeline_host_bytes",
    "prefetch_margin",
    "process_anon_bytes",
    "resolve_disk_compute",
    "resolve_gpu_update",
    "resolve_placement",
    "scratch_set",
    "streamed_gpu_bytes",
    "streamed_grads_on_device",
]

_FP32 = 4
# what `choose_gpu_update` balances when no measured figures are given: CPU AdamW params/s while
# PCIe copies run, and PCIe bytes/s per direction while both run (the H100 box's DESIGN.md table)
DEFAULT_CPU_ADAMW_PARAMS_S = 2.7e9
DEFAULT_PCIE_BYTES_S = 50e9
DEFAULT_PCIE_ONE_WAY_BYTES_S = 55e9  # one direction alone (DESIGN.md: 55 GB/s each way)
# GPU memory `choose_prefetch` leaves unused beyond the plan's estimate (whose workspace has its
# own 2 GiB of slack): the sets only speed a step up, a step that runs out of memory is lost, and
# the fullest run measured (P1-16 auto on the H100) peaked 2.4 GiB under what its plan allowed
PREFETCH_MARGIN_BYTES = 4 * 2**30
# GPU memory `choose_saves` leaves free beside its estimate: allocator rounding and fragmentation
# (a streamed template's second set of replayed graphs is counted, not left to it: ``mixed``)
SAVE_MARGIN_BYTES = 2 * 2**30


def resolve_placement(spec: str, n_layers: int, *, auto: list[str] | None = None) -> list[str]:
    """One tier per layer from a placement string ("ram", "stateless", "gpu:0-3,ram:4-9", ...)."""
    tiers = parse_placement(spec, n_layers)
    if tiers and tiers[0] == "auto":
        if auto is None:
            raise ConfigError("placement 'auto' needs the machine's budgets")
        return auto
    return ["ram" if t == "stateless" else t for t in tiers]


def resolve_gpu_update(spec: str, placement: list[str], numels: list[int], *, device_is_cuda: bool,
                       cpu_params_per_s: float = DEFAULT_CPU_ADAMW_PARAMS_S, pcie_bytes_per_s: float = DEFAULT_PCIE_BYTES_S,
                       grads_on_device: bool = True, compute_bytes: int = 2, gpu_bytes: int | None = None,
                       prefetch: int | None = 0, one_way_bytes_per_s: float = DEFAULT_PCIE_ONE_WAY_BYTES_S) -> set[int]:
    """The `ram` layers the GPU updates: named ranges, "all" (every ram layer), "none", or "auto"
    (cost model, within ``gpu_bytes`` of GPU memory for their buffers when given, with the run's
    ``prefetch`` setting: see `choose_gpu_update`)."""
    chosen = parse_layer_set(spec, len(placement))
    if chosen is None:
        return choose_gpu_update(placement, numels, cpu_params_per_s, pcie_bytes_per_s, grads_on_device=grads_on_device,
                                 compute_bytes=compute_bytes, gpu_bytes=gpu_bytes, prefetch=prefetch,
                                 one_way_bytes_per_s=one_way_bytes_per_s) if device_is_cuda else set()
    if spec.strip() == "all":
        return {i for i in chosen if placement[i] == "ram"}
    not_ram = sorted(i for i in chosen if placement[i] != "ram")
    if not_ram:
        raise ConfigError(f"gpu_update names layers {not_ram}, which are not placed in ram ({[placement[i] for i in not_ram]}); "
                          "only ram layers stream their state to the GPU for the update")
    return chosen


def choose_gpu_update(placement: list[str], numels: list[int], cpu_params_per_s: float, pcie_bytes_per_s: float, *,
                      grads_on_device: bool = True, compute_bytes: int = 2, gpu_bytes: int | None = None,
                      prefetch: int | None = 0, one_way_bytes_per_s: float = DEFAULT_PCIE_ONE_WAY_BYTES_S) -> set[int]:
    """Balance CPU and GPU update time: the GPU takes a fraction f of the ram parameters.

    The CPU needs 1/r_cpu s per parameter; the GPU path moves p, m, v in (12 B; 16 with the
    gradient when it waits on the host: ``grads_on_device`` False, data parallel) and p, m, v and
    the compute copy out (12 B + c) per parameter over the copy streams, t = max(in, out)/bw s when
    both directions overlap. Both finish together when f = (1/r_cpu) / (1/r_cpu + t). Layers are
    taken interleaved over the depth so both engines move along the next forward's order together,
    while their GPU buffers (`streamed_gpu_bytes`) fit in ``gpu_bytes`` (None: not limited).

    ``prefetch`` (the run's `update_prefetch`; None: auto, `choose_prefetch`): a share phi of the
    GPU path's parameters loads its state during the backward, so only in = 12 (1 - phi) B per
    parameter cross in after the norm; of those, the share psi whose sets no later layer reuses
    (`deferred_layers`) sends only its weights (w = c, or 4 in fp32) back before the next
    forward, the rest of its state after: out = (12 + c)(1 - psi) + w psi. While the copies in
    run, each direction runs at ``bw``, the rest of the copy back at ``one_way_bytes_per_s``:
    t = in/bw + max(0, out - in)/one_way. The shares depend on the layers chosen, so the balance
    is taken again with the shares it gives.
    """
    ram = [i for i, t in enumerate(placement) if t == "ram" and numels[i]]
    total = sum(numels[i] for i in ram)
    if not total:
        return set()
    t_cpu = 1 / cpu_params_per_s
    out = 12 + _c(compute_bytes)
    chosen = _balanced(ram, numels, total, t_cpu, max(12 if grads_on_device else 16, out) / pcie_bytes_per_s, compute_bytes,
                       grads_on_device, gpu_bytes)
    for _ in range(2 if grads_on_device and prefetch != 0 else 0):
        ahead = choose_prefetch(prefetch, chosen, numels, compute_bytes, gpu_bytes=gpu_bytes, grads_on_device=True)
        total_gpu = max(1, sum(numels[i] for i in chosen))
        phi = sum(numels[i] for i in sorted(chosen)[:ahead]) / total_gpu
        if not phi:
            break
        psi = sum(numels[i] for i in deferred_layers(chosen, ahead)) / total_gpu
        # the weights go back first: the compute copy (``compute_bytes`` per parameter; in fp32 the master itself)
        t_in, t_out = 12 * (1 - phi), out * (1 - psi) + compute_bytes * psi
        t_gpu = t_in / pcie_bytes_per_s + max(0.0, t_out - t_in) / one_way_bytes_per_s
        chosen = _balanced(ram, numels, total, t_cpu, t_gpu, compute_bytes, grads_on_device, gpu_bytes)
    return chosen


def _balanced(ram: list[int], numels: list[int], total: int, t_cpu: float, t_gpu: float, compute_bytes: int,
              grads_on_device: bool, gpu_bytes: int | None) -> set[int]:
    """The ram layers (interleaved over the depth) that give the GPU its balanced share."""
    target = total * t_cpu / (t_cpu + t_gpu)
    chosen: set[int] = set()
    got = 0.0
    for i in ram:  # take a layer whenever the running share would fall behind the target fraction
        if got + numels[i] / 2 <= target * (sum(numels[j] for j in ram if j <= i) / total):
            if gpu_bytes is not None and streamed_gpu_bytes(chosen | {i}, numels, compute_bytes,
                                                            grads_on_device=grads_on_device) > gpu_bytes:
                continue
            chosen.add(i)
            got += numels[i]
    return chosen


def streamed_grads_on_device(activation_budget_gb: float | None, *, distributed: bool = False) -> bool:
    """Whether GPU-updated ram layers keep their gradient on the GPU until the update. Not in a
    data-parallel run (each rank's shard is reduced into host memory), and not with a fixed
    activation budget: that asks for a GPU footprint independent of depth, and these gradients
    grow with it (4 B per GPU-updated parameter), so they cross to the host like the other ram
    layers' and back with the state."""
    return activation_budget_gb is None and not distributed


def streamed_gpu_bytes(gpu_update: set[int] | frozenset[int], numels: list[int], compute_bytes: int, *,
                       grads_on_device: bool = True, prefetch: int = 0) -> int:
    """GPU memory of the GPU-side updates of ``gpu_update``'s ram layers: their gradients, which
    wait on the device (``grads_on_device``), and the scratch sets (`scratch_sets`: two, or one per
    layer loaded ahead, ``prefetch``) of master, m, v and the compute copy (none in fp32; and the
    gradient when it comes from the host) of the largest of them."""
    if not gpu_update:
        return 0
    largest = max(numels[i] for i in gpu_update)
    grads = _FP32 * sum(numels[i] for i in gpu_update) if grads_on_device else 0
    return grads + scratch_sets(prefetch) * largest * (3 * _FP32 + _c(compute_bytes) + (0 if grads_on_device else _FP32))


def scratch_sets(prefetch: int) -> int:
    """Device buffer sets of the GPU-side updates of ram layers: one per layer whose state loads
    ahead (`StreamingAdamW`'s ``prefetch``), and at least two (one layer's state in flight while
    the previous one's kernel runs and copies back)."""
    return max(2, prefetch)


def scratch_set(j: int, jobs: int, sets: int) -> int:
    """The scratch set the ``j``-th of a step's ``jobs`` GPU-side updates (forward order) runs in:
    the first ``sets`` take one each; the rest cycle through the last ``r`` of them (r: as many as
    there are more jobs than sets, at most all). With many jobs that is the plain cycle (double
    buffering); with a few more jobs than sets (a prefetch nearly as long as the GPU-updated
    layers), the sets of the first layers in forward order stay untouched, so those layers, which
    the next forward fetches first, send their weights back ahead of the rest of their state
    (`deferred_layers`), and the layer whose set is reused is one the next forward reaches late."""
    if j < sets:
        return j
    r = min(sets, jobs - sets)
    return sets - r + (j - sets) % r


def deferred_layers(gpu_update: set[int] | frozenset[int], prefetch: int) -> set[int]:
    """The GPU-updated layers that send their new weights back before the rest of their state:
    loaded ahead (the first ``prefetch`` in forward order) into a set no later layer of the step
    reuses (`scratch_set`; `StreamingAdamW._update_streamed`)."""
    order = sorted(gpu_update)
    sets = scratch_sets(prefetch)
    reused = {scratch_set(j, len(order), sets) for j in range(sets, len(order))}
    return {i for j, i in enumerate(order) if j < prefetch and j not in reused}


def handed_layers(gpu_update: set[int] | frozenset[int], prefetch: int, compute_bytes: int, handoff: bool) -> set[int]:
    """The GPU-updated layers whose new weights stay in their scratch sets for the next visits
    (`TrainConfig.update_handoff`; `StreamingAdamW._update_streamed`): the deferred ones, in a
    compute dtype other than fp32, where the weights are the master that the next load overwrites."""
    return deferred_layers(gpu_update, prefetch) if handoff and compute_bytes != 4 else set()


def choose_saves(spec: str, blocks: Sequence[int], saved_bytes: Sequence[int], templates: Sequence[str], *,
                 micro_batches: int, gpu_bytes: int | None, replay_copy: bool,
                 mixed: Mapping[str, int] | None = None) -> list[int]:
    """The blocks that keep their activations between visits (`TrainConfig.save_activations`):
    ``spec`` 'off' none, 'all' every one of ``blocks``, N the last N; 'auto' (``gpu_bytes`` None:
    no GPU, or a fixed activation budget: none) the last blocks whose values fit in ``gpu_bytes``
    less `SAVE_MARGIN_BYTES`: ``saved_bytes[i]`` per micro-batch of block ``blocks[i]`` for every
    one of the step's ``micro_batches``, plus (``replay_copy``: the backward replays as a CUDA
    graph) one set per template (``templates[i]``), its input buffers. Later blocks first: their
    values are held the shortest. When not every block fits, ``mixed[t]`` more is charged with
    template t's first chosen block: its streamed layers then replay both a joint graph and a
    backward graph per ring slot (`mtc.runtime.graph_replay.mixed_saves_bytes`). An N beyond the
    blocks raises ValueError."""
    spec = spec.strip()
    if spec == "off":
        return []
    if spec == "all":
        return list(blocks)
    if spec != "auto":
        n = int(spec)
        if n > len(blocks):
            raise ValueError(f"--save-activations {n}: the model has {len(blocks)} blocks; use at most {len(blocks)}, or all")
        return list(blocks[len(blocks) - n:])
    if gpu_bytes is None:
        return []

    def fill(once: Mapping[str, int]) -> list[int]:
        left = gpu_bytes - SAVE_MARGIN_BYTES
        chosen: list[int] = []
        copies: set[str] = set()  # a replayed backward copies its saved inputs into one buffer set per template
        for b, nbytes, tid in reversed(list(zip(blocks, saved_bytes, templates, strict=True))):
            need = micro_batches * nbytes + ((nbytes if replay_copy else 0) + once.get(tid, 0) if tid not in copies else 0)
            if need > left:
                break
            left -= need
            copies.add(tid)
            chosen.append(b)
        return sorted(chosen)

    every = fill({})
    return every if len(every) == len(blocks) or not mixed else fill(mixed)


def prefetch_margin(spec: int | None, prefetch: int) -> int:
    """GPU memory an automatic update prefetch (``spec`` None) of ``prefetch`` layers meant to leave
    free beside its estimate (`PREFETCH_MARGIN_BYTES`): what the saved activations chosen after it
    leave free too, beyond their own margin (none when the prefetch was named or took no layer)."""
    return PREFETCH_MARGIN_BYTES if spec is None and prefetch > 0 else 0


def choose_prefetch(spec: int | None, gpu_update: set[int] | frozenset[int], numels: list[int], compute_bytes: int, *,
                    gpu_bytes: int | None, grads_on_device: bool) -> int:
    """How many GPU-updated ram layers (the first in forward order) load their state during the
    backward: ``spec`` when given (`TrainConfig.update_prefetch`, at most all of them), else (None)
    as many as their extra scratch sets fit in ``gpu_bytes`` (less `PREFETCH_MARGIN_BYTES`)
    beside `streamed_gpu_bytes`'s two;
    none when the GPU memory is not known, or the gradients do not wait on the device (data
    parallel, a fixed activation budget: its footprint must not grow with the model)."""
    if not gpu_update:
        return 0
    if spec is not None:
        return min(spec, len(gpu_update))
    if gpu_bytes is None or not grads_on_device:
        return 0
    ahead = 0
    room = gpu_bytes - PREFETCH_MARGIN_BYTES
    while ahead < len(gpu_update) and streamed_gpu_bytes(gpu_update, numels, compute_bytes, prefetch=ahead + 1) <= room:
        ahead += 1
    return ahead


def _c(compute_bytes: int) -> int:
    return 0 if compute_bytes == _FP32 else compute_bytes


def host_bytes_per_param(tier: str, compute_bytes: int, *, disk_compute: str = "ram", grads_on_device: bool = False,
                         grad_spill: bool = False) -> int:
    """Host RAM per parameter of a layer in ``tier`` (the table above). ``grads_on_device``: disk
    layers' gradients wait in GPU memory (CUDA) rather than host memory (the CPU device);
    ``grad_spill``: they wait in the store's scratch arrays."""
    if tier == "gpu":
        return 0
    if tier == "ram":
        return 16 + _c(compute_bytes)
    if tier == "disk":
        return (compute_bytes if disk_compute == "ram" else 0) + (0 if grads_on_device or grad_spill else 4)
    raise ValueError(f"unknown tier {tier!r}")


def host_bytes_needed(placement: list[str], numels: list[int], compute_bytes: int, *, disk_compute: str = "ram",
                      grads_on_device: bool = False, grad_spill: bool = False) -> int:
    """Host RAM for the state tiers (see the table in this module's docstring), without the
    fixed pipeline (`pipeline_host_bytes`)."""
    return sum(host_bytes_per_param(t, compute_bytes, disk_compute=disk_compute, grads_on_device=grads_on_device,
                                    grad_spill=grad_spill) * n
               for t, n in zip(placement, numels, strict=True))


def pipeline_host_bytes(placement: list[str], numels: list[int], *, disk_compute: str = "ram", device_is_cuda: bool = False,
                        disk_slots: int = DISK_SLOTS, weight_slots: int = 2, grad_spill: bool = False,
                        disk_chunk_numel: int | None = None, tied_weights: bool = True) -> int:
    """Host RAM of the bounded pipeline: the disk tier's read-ahead ring and visit staging (and on
    the CPU device the executor's device buffers, which are host memory there). Independent of the
    depth; the ring is independent of the layer size too, beyond one update chunk
    (``disk_chunk_numel``, default the engine's `StateTiers.disk_chunk_numel`). ``tied_weights``
    (the safe default): a layer also reads a weight another layer owns (tied embeddings), so a
    weight slot and its staging hold up to two layers and one more gradient slab stays open."""
    disk = [n for t, n in zip(placement, numels, strict=True) if t == "disk" and n]
    # on the CPU device the executor's weight ring and gradient slabs are host memory too (slabs
    # serve ram layers and spilled disk layers: two open, plus one for a tied owner)
    slot = (2 if tied_weights else 1) * max(numels, default=0)
    slab_layers = [n for t, n in zip(placement, numels, strict=True) if t == "ram" or (t == "disk" and grad_spill)]
    slabs = (3 if tied_weights else 2) * _FP32 * max(slab_layers, default=1)
    device = 0 if device_is_cuda else weight_slots * _FP32 * slot + slabs
    if not disk:
        return device
    chunk = StateTiers.disk_chunk_numel if disk_chunk_numel is None else disk_chunk_numel
    ring = disk_slots * (16 if device_is_cuda or grad_spill else 12) * min(max(disk), chunk)
    ring += 2 * _FP32 * min(max(disk), chunk) if grad_spill else 0  # the spill's two staging chunks
    # on the CPU (fp32) a visit reads straight into its weight slot: no staging
    staging = weight_slots * _FP32 * slot if disk_compute == "store" and device_is_cuda else 0
    return ring + staging + device


def resolve_disk_compute(setting: str, placement: list[str] | None, numels: list[int], compute_bytes: int, *, ram_bytes: int,
                         device_is_cuda: bool, tied_weights: bool = True) -> str:
    """Where disk layers' compute copy lives for the ``disk_compute`` setting: ``auto`` reads fp32
    weights from the store at each visit (a RAM copy would cost 4 B/param), and keeps a bf16 copy
    pinned in RAM while ``ram_bytes`` holds it beside the rest of ``placement`` (None: auto
    placement, which starts from every layer on disk); when it cannot (a 70B model's bf16 copy
    is 140 GB) it reads them from the store too: slower visits, 4 B/param from the store each,
    rather than a run that does not fit. ``tied_weights``: as `pipeline_host_bytes` takes it."""
    if setting != "auto":
        return setting
    if compute_bytes == _FP32:
        return "store"
    placement = ["disk"] * len(numels) if placement is None else placement
    # gradients of disk layers wait on the GPU (or, on the CPU, in the store when RAM is short)
    need = (host_bytes_needed(placement, numels, compute_bytes, disk_compute="ram", grads_on_device=device_is_cuda,
                              grad_spill=not device_is_cuda)
            + pipeline_host_bytes(placement, numels, disk_compute="ram", device_is_cuda=device_is_cuda, grad_spill=not device_is_cuda,
                                  tied_weights=tied_weights))
    return "ram" if need <= ram_bytes else "store"


def choose_grad_spill(placement: list[str], numels: list[int], compute_bytes: int, *, ram_bytes: int, disk_compute: str = "ram",
                      device_is_cuda: bool = False, gpu_bytes: int | None = None, tied_weights: bool = True) -> bool:
    """Whether disk layers' gradients wait in the store's scratch arrays (`mtc.runtime.grad_spill`)
    rather than where they were accumulated: on the CPU device when the RAM budget cannot hold
    them beside the state tiers and the pipeline; on CUDA when ``gpu_bytes`` cannot hold them
    beside the resident layers. Spilling costs 8 bytes per disk parameter of disk traffic per
    step (a write and a read) and saves 4 of host (CPU) or GPU memory. ``tied_weights``: as
    `pipeline_host_bytes` takes it."""
    if not any(t == "disk" and n for t, n in zip(placement, numels, strict=True)):
        return False
    if device_is_cuda:
        return gpu_bytes is not None and gpu_state_bytes(placement, numels, compute_bytes) > gpu_bytes
    keep = (host_bytes_needed(placement, numels, compute_bytes, disk_compute=disk_compute)
            + pipeline_host_bytes(placement, numels, disk_compute=disk_compute, tied_weights=tied_weights))
    if keep <= ram_bytes:
        return False
    # spilling frees the disk layers' 4 B/param but opens gradient slabs of the largest layer, a
    # gradient buffer in each ring set and two staging chunks: with few disk layers that is more
    # than it frees (the tiny model all on disk: about 2 MiB more), and a refusal then named the
    # larger figure as what the run needs
    spilled = (host_bytes_needed(placement, numels, compute_bytes, disk_compute=disk_compute, grad_spill=True)
               + pipeline_host_bytes(placement, numels, disk_compute=disk_compute, grad_spill=True, tied_weights=tied_weights))
    return spilled < keep


def gpu_state_bytes(placement: list[str], numels: list[int], compute_bytes: int, *, disk_grads_on_gpu: bool = True) -> int:
    """GPU memory held by `gpu`-tier layers (and by disk layers' gradients, which wait there for the update)."""
    per_disk = _FP32 if disk_grads_on_gpu else 0
    return sum((16 + _c(compute_bytes)) * n if t == "gpu" else (per_disk * n if t == "disk" else 0)
               for t, n in zip(placement, numels, strict=True))


def disk_bytes_needed(placement: list[str], numels: list[int], durability: str, *, grad_spill: bool = False) -> int:
    """Store bytes for both generations of the state the durability mode keeps (and the gradient
    scratch of disk layers when their gradients are spilled). Disk layers keep master, m and v in
    two generations, or in one, updated in place, when nothing is durable (`none`; a run resumed
    from a durable commit leaves that commit's generation whole, so it keeps both)."""
    per_mode = {"full": 24, "weights": 8, "none": 0}[durability]
    per_disk = (12 if durability == "none" else 24) + (4 if grad_spill else 0)
    return sum((per_disk if t == "disk" else per_mode) * n for t, n in zip(placement, numels, strict=True))


def disk_bytes_beyond_seed(placement: list[str], numels: list[int], durability: str, *, grad_spill: bool = False) -> int:
    """Store bytes a run started from a seeded store (generation 0 written by `mtc import` or
    --init-from and named by its step-0 commit) adds to it: the other generation of what the
    durability mode keeps, of disk layers' state even without durability (the seed's generation
    stays whole: its commit names it), and the disk layers' gradient scratch when spilled."""
    per_mode = {"full": 12, "weights": 4, "none": 0}[durability]
    per_disk = 12 + (4 if grad_spill else 0)
    return sum((per_disk if t == "disk" else per_mode) * n for t, n in zip(placement, numels, strict=True))


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    with contextlib.suppress(OSError):  # not Linux: fall back to physical memory
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_placement(numels: list[int], compute_bytes: int, *, gpu_bytes: int, ram_bytes: int, disk_compute: str = "ram",
                   grads_on_device: bool = False, gpu_extra: list[int] | None = None,
                   pipeline: Callable[[list[str]], int] | None = None) -> list[str]:
    """Fill the GPU first (fastest: no PCIe for state, updates in HBM), then RAM, then disk.

    Every layer starts on disk, with its disk cost charged to the budgets; then, in forward order,
    a layer moves to the GPU if the GPU budget holds it, else to RAM if the RAM budget holds the
    placement with it there. Layers go up from the last backward-visited end (the embed stage and
    the first blocks are updated first in the next forward, so resident updates there shorten the
    critical path). When even all-disk does not fit ``ram_bytes`` the result is all-disk (the fit
    check says so). ``gpu_extra``: per layer, GPU bytes it costs on the GPU besides its state (the
    CUDA graphs that read its resident weights: `mtc.planner.graph_gpu_extra`). ``pipeline``: the
    host bytes of the bounded pipeline for a placement (`pipeline_host_bytes`), charged to
    ``ram_bytes`` for each candidate: it changes with the placement (on the CPU device the first
    `ram` layer opens gradient slabs of the largest one: 3 x 4 B/param, which a budget less the
    all-disk pipeline missed, and `mtc train` then refused the placement it had chosen). Where the
    budget holds every layer the GPU did not take in RAM, that is the result, whatever the fill met
    on its way.
    """
    def disk_host(n: int) -> int:
        return host_bytes_per_param("disk", compute_bytes, disk_compute=disk_compute, grads_on_device=grads_on_device) * n

    ram_host = host_bytes_per_param("ram", compute_bytes)

    def host(p: list[str]) -> int:
        state = sum(ram_host * n if t == "ram" else disk_host(n) if t == "disk" else 0 for t, n in zip(p, numels, strict=True))
        return state + (pipeline(p) if pipeline is not None else 0)

    disk_gpu = _FP32 if grads_on_device else 0
    placement = ["disk"] * len(numels)
    g_left = gpu_bytes - sum(disk_gpu * n for n in numels)
    for i, n in enumerate(numels):
        up_gpu = (16 + _c(compute_bytes) - disk_gpu) * n + (gpu_extra[i] if gpu_extra is not None else 0)
        if g_left >= 0 and up_gpu <= g_left:
            placement[i], g_left = "gpu", g_left - up_gpu
            continue
        placement[i] = "ram"
        if host(placement) <= ram_bytes:
            # a ram layer's gradient goes to the host through the shared slab ring: the GPU gets
            # back the 4 B/param its disk placement had reserved there
            g_left += disk_gpu * n
        else:
            placement[i] = "disk"
    # the fill's candidates still hold disk layers and are charged the disk ring's buffers, which
    # a placement without disk layers does not have: at a budget that holds all of it in RAM (the
    # ring costing more than the last layers' RAM state) the fill ended with disk layers
    if "disk" in placement:
        up = ["ram" if t == "disk" else t for t in placement]
        if host(up) <= ram_bytes:
            return up
    return placement


# Anonymous memory an `mtc train` process holds before any state (the CPU, torch 2.13, Python 3.11,
# measured from /proc/self/status RssAnon: 257 MiB): the interpreter 5 MiB, torch 138, sympy 34
# (torch's autograd.grad imports it at the first backward), torch.export and dynamo 50 (a new run's
# trace), triton 6 (dynamo imports it), zarr 7, mtc 6, the traced program 12. Shared libraries'
# file pages (another ~155 MiB of RSS) are page cache, which MemAvailable already counts. A CUDA
# process holds more (the driver's context): not measured here.
PROCESS_HOST_BYTES = 260 * 2**20


def process_anon_bytes() -> int:
    """This process's anonymous resident memory now (Linux /proc; 0 where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    return 0


def default_ram_budget(available: int | None = None) -> int:
    """Host RAM for state when the user sets no budget: available memory minus a margin of 15 %
    (at least 2 GiB) for the process itself, the data loader and the OS."""
    avail = available_host_bytes() if available is None else available
    return max(0, avail - max(2 * 2**30, int(avail * 0.15)))


def describe(placement: list[str]) -> str:
    """A short text such as 'gpu:0-3,ram:4-19' for logs and records."""
    parts, start = [], 0
    for i in range(1, len(placement) + 1):
        if i == len(placement) or placement[i] != placement[start]:
            rng = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{placement[start]}:{rng}")
            start = i
    return ",".join(parts)
