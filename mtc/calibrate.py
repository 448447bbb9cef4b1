"""Machine profiles: what `mtc plan` knows about a machine, measured (`calibrate`) or built in.

A `MachineProfile` holds the ceilings the planner's cost model needs: host<->device copy rates,
disk rates (raw, and through the store the engine uses), CPU AdamW throughput, matmul throughput
at a few shapes, element-wise throughput and per-op dispatch cost (the CPU compute path), memory
sizes and core count. `calibrate()` measures them on this machine in a bounded time (sizes are
arguments); `builtin()` returns named profiles: ``h100-box`` (the lent GPU machine, from the
measured table in DESIGN.md) and two extrapolation machines whose assumed figures are listed in
their ``assumed`` field.

Units: rates in GB/s (1e9 bytes), memory and disk in bytes, matmul in TFLOP/s.
On a CPU-only machine the "PCIe" figures are the host memcpy rate (``pcie_is_memcpy``): that is
what the engine's CPU copy threads do in place of host<->device copies.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mtc.errors import ConfigError

__all__ = ["DEFAULT_PROFILE_PATH", "MachineProfile", "builtin", "builtin_names", "calibrate", "check_profile_path", "cpu_model",
           "load_machine"]

T = TypeVar("T")

DEFAULT_PROFILE_PATH = Path.home() / ".cache" / "mtc" / "machine.json"
GiB = 2**30


# A commit's fixed cost where it was not measured (built-in profiles, profiles saved before
# calibrate measured it): the most the tiny model's commits took on the 2-core VM beyond their
# bytes (0.1-0.2 s: fsyncs, renames, the record), so a plan paces commits no more often than the
# run will (more often would under-count their cost)
COMMIT_LATENCY_S = 0.2
COMMIT_LATENCY_ASSUMED = (f"a commit's fixed cost {COMMIT_LATENCY_S:.1f} s beyond its bytes (fsyncs, renames, the record; "
                          "not measured: `mtc calibrate --dir` on the store's disk measures it)")
# Each chunk file a commit writes beyond the three of `_commit_latency_s` where that was not
# measured: its own fsync, rename and directory fsync, 0.9 ms on the 2-core VM's ext4 with 4 I/O
# threads (18 -> 60 files: 20-28 -> 68-72 ms, 2026-11-29); a large model's commit writes thousands
COMMIT_FILE_S = 0.001
COMMIT_FILE_ASSUMED = (f"{COMMIT_FILE_S * 1e3:.0f} ms per chunk file a commit writes (fsync, rename, directory fsync; "
                       "not measured: `mtc calibrate --dir` on the store's disk measures it)")


@dataclasses.dataclass(kw_only=True, slots=True)
class MachineProfile:
    """One machine's measured (or assumed) ceilings; see the module docstring for units."""

    name: str
    device: str  # e.g. "NVIDIA H100 80GB HBM3" or "cpu (AMD EPYC ..., 2 cores)"
    accelerator: str  # "cuda" or "cpu": where the layers compute
    cores: int
    gpu_memory_bytes: int  # 0 on a CPU machine
    host_memory_bytes: int
    host_available_bytes: int
    disk_free_bytes: int
    disk_dir: str
    # host <-> device, pinned (CPU machine: host memcpy on one / two threads)
    h2d_gbps: float
    d2h_gbps: float
    both_gbps: float  # both directions at once, total
    pcie_is_memcpy: bool
    # disk: raw sequential (write + fsync; read after posix_fadvise DONTNEED), and through the store
    disk_write_gbps: float
    disk_read_gbps: float
    disk_read_warm_gbps: float  # from the page cache
    store_write_gbps: float
    store_read_gbps: float
    store_read_warm_gbps: float  # read again at once (the store reads with O_DIRECT: about the cold rate; not in the cost model)
    # CPU AdamW (mtc.runtime.host_adamw.adamw_flat_ on a pool of `cores` threads), G params/s
    adamw_gparams_s: dict[str, float]  # by impl: "exact", "fused"
    adamw_impl: str  # the one the engine runs on this machine: fused on CUDA, exact on the CPU
    adamw_one_thread_gparams_s: float  # the engine's impl on a single thread (the CPU path with optim_threads=1)
    adamw_with_copies: float  # factor on the rate while PCIe copies run (host memory is shared)
    # matmuls (x @ W^T, as a linear layer runs them) in the compute dtype: points {"m", "k", "n", "tflops"};
    # the headline is their median
    matmul_dtype: str
    matmul: list[dict[str, float]]
    # fraction of the matmul rate a whole layer (fwd, recompute + bwd) reaches; < 1 folds the
    # element-wise ops and launch gaps in where they are not modelled apart (GPU profiles)
    layer_efficiency: float = 1.0
    # bytes touched per second by unfused element-wise ops, by tensor size (CPU path: caches make
    # small tensors several times faster): points {"mib", "gbps"}
    elementwise: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # bytes touched per second by a plain copy, by buffer size (CPU path: the caches' and DRAM's
    # bandwidth; bounds thin matmuls and the executor's gradient adds): points {"mib", "gbps"}
    memory: list[dict[str, float]] = dataclasses.field(default_factory=list)
    op_overhead_us: float = 0.0  # dispatch cost per ATen op (CPU path)
    attention_tflops: float = 0.0  # causal SDPA, counting half the square's FLOPs (0: at the matmul rate)
    first_touch_gbps: float = 0.0  # writing a fresh >= 32 MiB tensor (page faults: the allocator maps it anew)
    # AdamW speed on all-zero gradients and moments (embedding rows a step does not touch) over its
    # speed on dense ones: on the pool of `cores` threads, and on one thread
    adamw_zero_grad_factor: float = 1.0
    adamw_zero_grad_factor_one_thread: float = 1.0
    compute_threads: int = 0  # intra-op threads the CPU compute figures were measured with (0: GPU profile)
    gpu_adamw_gparams_s: float = 0.0  # AdamW on the GPU over resident (or streamed) state
    # CPU path: a reference Llama block (traced, run as the engine's unfused runner) measured
    # forward and joint (recompute + backward); its measured over its modelled time scales every
    # layer's modelled compute (1.0: not measured)
    reference_block: dict[str, float] = dataclasses.field(default_factory=dict)
    other_scale_fwd: float = 1.0
    other_scale_bwd: float = 1.0
    # CPU path: what a layer visit costs per micro-batch beyond its modelled compute (the
    # executor's own work: arguments, views, accumulation, hand-offs between its threads), fitted
    # to a tiny model trained through the engine (0: not measured)
    visit_overhead_us: float = 0.0
    # writing through the store while reads of other arrays run beside it, as the disk tier's
    # write-behind has the read-ahead beside it (about half the rate alone on the 2-core VM); the
    # stage watch's threshold for disk layers' writes (the cost model uses store_both_gbps);
    # 0: not measured (store_write_gbps)
    store_write_busy_gbps: float = 0.0
    # the store's reads and writes at once (the bytes of both over the time), as the disk tier's
    # read-ahead and write-behind overlap: the cost model shares the disk at this rate; 0: not
    # measured (reads and writes take turns). On the 2-core VM 1.02-1.08 GB/s where a write alone
    # ran ~1.05 and a read ~0.8 (2026-11-27)
    store_both_gbps: float = 0.0
    # seconds a commit costs beyond its bytes at the store's write rate: each array's temp file,
    # fsync, rename and directory fsync, then the resume file, the record, the history line, a
    # rename and the directory's fsync (`_commit_latency_s`). On the 2-core VM 32 ms (2026-11-29,
    # under load), where the tiny model's commits took 0.02-0.2 s in a run and its bytes over the
    # store's rate said 13-21 ms: most of a small model's commit is this
    commit_latency_s: float = COMMIT_LATENCY_S
    # seconds each further chunk file adds to a commit (beyond the three the fixed cost includes):
    # the slope of the same commit's time over more arrays (`_commit_latency_s`)
    commit_file_s: float = COMMIT_FILE_S
    # why the compute figures are suspect: the machine was busy while they were measured (`busy_reason`);
    # "": the probes read steady, or a built-in profile
    busy: str = ""
    identity: dict[str, str] = dataclasses.field(default_factory=dict)  # host, CPU, versions: which machine this is
    calibrate_s: float = 0.0  # how long `calibrate` took
    assumed: list[str] = dataclasses.field(default_factory=list)  # figures that were not measured, and why
    source: str = ""
    created: str = ""
    # several ranks on one host (`mtc plan --world-size`, mtc.dist_plan): the host's layout and
    # links; 0 where not known (the planner then assumes a figure and lists it)
    gpus_per_host: int = 1  # GPUs in one host: at most this many CUDA ranks per host
    pcie_uplinks: int = 0  # host PCIe uplinks (switch to CPU) the GPUs share; 0: one per GPU
    peer_gbps: float = 0.0  # collective bus bandwidth per rank within a host (NVLink, PCIe peer; gloo: host memory)
    network_gbps: float = 0.0  # one host's network to the others, all its NICs together
    collective_latency_us: float = 0.0  # per ring step of a collective
    host_memory_gbps: float = 0.0  # host DRAM bandwidth, all channels, shared by the ranks' copies and AdamW (0: not modelled)
    gloo_gbps: float = 0.0  # gloo all-reduce bus bandwidth per rank over loopback, 2 local processes (0: not measured)

    @property
    def store_write_busy(self) -> float:
        """GB/s through the store with the read-ahead beside it (the plain write rate where not measured)."""
        return self.store_write_busy_gbps or self.store_write_gbps

    @property
    def matmul_tflops(self) -> float:
        """Median matmul TFLOP/s over the measured shapes."""
        return statistics.median(p["tflops"] for p in self.matmul) if self.matmul else 0.0

    @property
    def elementwise_gbps(self) -> float | None:
        """Median element-wise GB/s over the measured tensor sizes (None: folded into layer_efficiency)."""
        return statistics.median(p["gbps"] for p in self.elementwise) if self.elementwise else None

    @property
    def adamw_rate(self) -> float:
        """G params/s of the AdamW the engine runs here."""
        return self.adamw_gparams_s[self.adamw_impl]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MachineProfile:
        """Build from `to_dict`'s output; unknown or missing fields raise ConfigError."""
        if not isinstance(d, dict):
            raise ConfigError(f"machine profile must be a JSON object of measured figures, got a {type(d).__name__}; "
                              "re-run `mtc calibrate`")
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ConfigError(f"machine profile has unknown field(s) {', '.join(bad)}; re-run `mtc calibrate`")
        if "store_both_gbps" not in d:  # written before the joint rate was measured
            d = {**d, "assumed": [*d.get("assumed", []), TAKE_TURNS]}
        if "commit_latency_s" not in d:  # written before a commit's fixed cost was measured
            d = {**d, "assumed": [*d.get("assumed", []), COMMIT_LATENCY_ASSUMED]}
        if "commit_file_s" not in d:  # written before the cost per chunk file was measured
            d = {**d, "assumed": [*d.get("assumed", []), COMMIT_FILE_ASSUMED]}
        if d.get("accelerator") == "cuda" and d.get("matmul") and _thin_points_missing(d["matmul"]) \
                and str(d.get("source", "")).startswith("mtc calibrate") and STALE_GPU_POINTS not in d.get("assumed", []):
            d = {**d, "assumed": [*d.get("assumed", []), STALE_GPU_POINTS]}
        try:
            prof = cls(**d)
        except TypeError as e:
            raise ConfigError(f"machine profile is incomplete ({e}); re-run `mtc calibrate`") from None
        prof.check()
        return prof

    # rates and counts the cost model divides by: a zero is no measurement (a hand-edited profile)
    _POSITIVE = ("cores", "host_memory_bytes", "h2d_gbps", "d2h_gbps", "both_gbps", "disk_write_gbps", "disk_read_gbps",
                 "disk_read_warm_gbps", "store_write_gbps", "store_read_gbps", "store_read_warm_gbps",
                 "adamw_one_thread_gparams_s", "adamw_with_copies", "layer_efficiency", "other_scale_fwd", "other_scale_bwd")

    def check(self) -> None:
        """Raise ConfigError naming the first figure that cannot be one: not a number of its field's
        kind, not finite, negative, or zero where the cost model divides by it (the planner failed
        with ZeroDivisionError or TypeError on such a hand-edited profile)."""
        def bad(name: str, v: object, want: str) -> ConfigError:
            return ConfigError(f"machine profile {self.name!r}: {name} is {v!r}, expected {want}; re-run `mtc calibrate` "
                               "or fix the file")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type not in ("int", "float"):
                continue
            ok = isinstance(v, int) if f.type == "int" else isinstance(v, (int, float))
            if not ok or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise bad(f.name, v, f"a finite {'integer' if f.type == 'int' else 'number'} >= 0")
            if f.name in self._POSITIVE and v <= 0:
                raise bad(f.name, v, "a measured figure > 0")
        rates = self.adamw_gparams_s
        if not isinstance(rates, dict) or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in rates.values()):
            raise bad("adamw_gparams_s", rates, "G params/s > 0 by implementation")
        if self.adamw_impl not in rates:
            raise bad("adamw_impl", self.adamw_impl, f"one of the measured implementations ({', '.join(rates)})")

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (atomically) and return the path."""
        p = Path(path)
        check_profile_path(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> MachineProfile:
        """Read a profile written by `save`."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"machine profile {p} does not exist; write one with `mtc calibrate -o {p}`")
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"machine profile {p} is not valid JSON ({e}); re-run `mtc calibrate -o {p}`") from None


def check_profile_path(path: str | Path) -> None:
    """Raise ConfigError unless `MachineProfile.save` can write a profile file at ``path``: it is a
    directory, or a folder above it is a file. `mtc calibrate` asks before it measures (~30 s)."""
    from mtc.store.directory import file_in_the_way

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"profile path {p} is a directory; give a file path such as {p / 'machine.json'}")
    f = file_in_the_way(p.parent)
    if f is not None:
        raise ConfigError(f"profile path {p}: {f}, a parent of it, is a file, not a directory; give another path")
    if p.with_name(p.name + ".tmp").is_dir():  # save writes there first, then renames it over the profile
        raise ConfigError(f"profile path {p}: {p.name}.tmp beside it, where the profile is written first, is a directory; "
                          "remove it or give another path")


# a profile without the store's joint read-and-write rate (built in, or written before calibrate
# measured it): the cost model lets the disk tier's reads and writes take turns, a bound from above
TAKE_TURNS = "the store's reads and writes take turns on the disk (their joint rate not measured: `mtc calibrate --dir` on it measures it)"


# a GPU profile calibrated before the thin matmul shapes were measured (its thinnest point 4096^3)
STALE_GPU_POINTS = ("GPU matmul points from before 2026-11-28 (none thinner than 4096^3, each timed over one launch): "
                    "thinner matmuls take the 4096^3 rate, which read up to 18 % low; re-run `mtc calibrate`")


def _thin_points_missing(points: list[dict[str, float]]) -> bool:
    """Whether a GPU profile's matmul points lack the K/V-projection shapes calibrate measures now."""
    return all(min(p["m"], p["k"], p["n"]) >= 4096 for p in points)


# -- what calibrate assumes on CUDA (measured on the lent H100 box, not by calibrate itself) ------

# The host AdamW's rate inside a training run over calibrate's AdamW alone (the field's name says
# "with copies": the host memory bus is shared with the copy engines). bench_train on the H100,
# 2026-11-26 (gpu_session.sh, records bench_train-P1-16/P1-48/P3-vm-20261126*): the CPU update spans
# of the three stateless settings, where the copies run both ways through the update, ran at 2.59,
# 2.90 and 2.59 G params/s against calibrate's 5.30; the median, 2.59, is 0.49 of it. The planned
# settings, with little copying, ran at 2.94 and 3.46: so the copies are not the whole cause (the
# run's other threads and its GB-sized per-layer state are others), and the stateless figure is the
# one taken, as the GPU-update split matters where state streams. (Was 2.7 / 4.0 = 0.675,
# DESIGN.md's table: the cost model then gave the CPU half of a stateless P1 step's layers, 0.65 s of
# work predicted, 0.89 s measured, most of it exposed.)
CUDA_ADAMW_WITH_COPIES = 0.49


# One Llama 8B block (h 4096, 8192 tokens) forward + backward: its matmul and causal-attention FLOPs,
# 3 x (2 x 218.1M x 8192 + 0.5 x 4 x 8 x 32 x 1024^2 x 128) = 10.9 TFLOP (the h100-box profile's
# layer efficiency)
_LLAMA8B_BLOCK_FLOPS = 3 * (2 * 218_112_000 * 8192 + 0.5 * 4 * 8 * 32 * 1024**2 * 128)

# The anchor of a calibrated GPU profile's layer efficiency (`mtc.costmodel.anchored_efficiency`):
# one Llama 8B block (the 8b preset's: h 4096, MLP 14336, 32 q / 8 kv heads), 8 x 1024 tokens,
# bf16, its joint graph (recompute + backward, returning the output) replayed as a CUDA graph, as
# `mtc train` runs it: 19.92 ms on the H200 (bench_fusion-vm-20261127T215805, mtc_fused_graph,
# median of 10 interleaved rounds, git 1b43958), where the same session's calibrate timed its
# fastest matmul at 776.4 TFLOP/s (machine-vm-20261127T2154: 8192 x 4096 x 14336). Before, the
# efficiency was this block's FLOPs over the median matmul rate (the H100's, older kernels: 0.697),
# on top of the thin matmuls' lower rates the cost model already charges.
ANCHOR_BLOCK = {"preset": "8b", "micro_batch_size": 8, "seq_len": 1024, "seconds": 19.92e-3, "peak_tflops": 776.4}


# -- built-in profiles -------------------------------------------------------------------------


def _h100_box() -> MachineProfile:
    # DESIGN.md, "Measured ceilings on the lent GPU machine". One Llama 8B block (h 4096, 8k
    # tokens, bf16) runs its recompute + backward in 22.5 ms fused (README, bench_fusion): its
    # 10.9 TFLOP (_LLAMA8B_BLOCK_FLOPS) take 13.9 ms at 789 TFLOP/s, so the layer reaches 0.62 of
    # the matmul rate.
    eff = _LLAMA8B_BLOCK_FLOPS / 789e12 / 22.48e-3
    return MachineProfile(
        name="h100-box", device="NVIDIA H100 80GB, PCIe Gen5, 16 cores, 128 GiB RAM (the lent GPU machine)",
        accelerator="cuda", cores=16, gpu_memory_bytes=81_559 * 2**20, host_memory_bytes=128 * GiB,
        host_available_bytes=int(122 * GiB), disk_free_bytes=int(60 * GiB), disk_dir="/",
        h2d_gbps=55.0, d2h_gbps=55.0, both_gbps=94.0, pcie_is_memcpy=False,
        disk_write_gbps=1.9, disk_read_gbps=1.3, disk_read_warm_gbps=3.5,
        # the store reads with O_DIRECT (store/fastio.py): the page cache never serves it, so a
        # "warm" read (state that would fit the cache) runs at the cold rate
        store_write_gbps=1.6, store_read_gbps=1.7, store_read_warm_gbps=1.7,
        adamw_gparams_s={"fused": 5.1, "exact": 2.5}, adamw_impl="fused", adamw_one_thread_gparams_s=0.6,
        adamw_with_copies=CUDA_ADAMW_WITH_COPIES,
        matmul_dtype="bfloat16", matmul=[{"m": 8192, "k": 8192, "n": 8192, "tflops": 789.0}],
        layer_efficiency=round(eff, 3), gpu_adamw_gparams_s=90.0,
        assumed=[
            TAKE_TURNS,
            COMMIT_LATENCY_ASSUMED,
            COMMIT_FILE_ASSUMED,
            "disk free 60 GiB (the box has a 64 GiB disk; not measured)",
            "host RAM available 122 GiB of 128 (not measured)",
            "exact AdamW 2.5 G params/s, one thread 0.6 (not measured there: fused is what CUDA runs use)",
            "GPU AdamW 90 G params/s (HBM-bound, 28 B/param at ~2.5 TB/s; not measured)",
        ],
        source="DESIGN.md measured table (H2D/D2H 55/55/94 GB/s, bf16 789 TFLOP/s, fused CPU AdamW 5.1 G params/s "
               "alone, x 0.49 while copies run (bench_train, 2026-11-26), zarr write 1.6 / cold read 1.7 GB/s, raw 1.9 / 1.3) and the "
               "22.5 ms fused Llama 8B block (layer efficiency)",
        created="2026-11",
    )


def _h200_1p5tb() -> MachineProfile:
    base = _h100_box()
    return dataclasses.replace(
        base, name="h200-1.5tb", device="NVIDIA H200 141 GB, PCIe Gen5, 32 cores, 1.5 TiB RAM, 8 TB NVMe (extrapolated)",
        cores=32, gpu_memory_bytes=143_771 * 2**20, host_memory_bytes=1536 * GiB, host_available_bytes=1500 * GiB,
        disk_free_bytes=int(8e12), disk_dir="/",
        disk_write_gbps=3.0, disk_read_gbps=3.5, store_write_gbps=2.5, store_read_gbps=3.0, store_read_warm_gbps=3.0,
        adamw_gparams_s={"fused": 10.2, "exact": 5.0}, adamw_one_thread_gparams_s=0.6,
        assumed=[
            TAKE_TURNS,
            COMMIT_LATENCY_ASSUMED,
            COMMIT_FILE_ASSUMED,
            "everything but the GPU memory (141 GB, nvidia-smi's 143,771 MiB) and the 1.5 TiB of RAM is assumed",
            "matmul 789 TFLOP/s and layer efficiency as the H100 box (same compute die; HBM3e only helps)",
            "PCIe Gen5 as the H100 box: 55 / 55 / 94 GB/s",
            "32 cores: CPU AdamW 10.2 G params/s (2x the box's 16-core 5.1), x 0.49 while copies run (as the box)",
            "8 TB NVMe: raw write 3.0, read 3.5 GB/s; through the store 2.5 / 3.0 GB/s",
        ],
        source="extrapolated from h100-box", created="2026-11",
    )


def _256gb_4tb() -> MachineProfile:
    base = _h100_box()
    return dataclasses.replace(
        base, name="256gb-4tb-nvme", device="NVIDIA H100 80GB, PCIe Gen5, 16 cores, 256 GiB RAM, 4 TB NVMe (extrapolated)",
        host_memory_bytes=256 * GiB, host_available_bytes=248 * GiB, disk_free_bytes=int(4e12), disk_dir="/",
        disk_write_gbps=3.0, disk_read_gbps=3.5, store_write_gbps=2.5, store_read_gbps=3.0, store_read_warm_gbps=3.0,
        assumed=[
            TAKE_TURNS,
            COMMIT_LATENCY_ASSUMED,
            COMMIT_FILE_ASSUMED,
            "GPU, PCIe, cores, matmul and CPU AdamW as the H100 box (measured there)",
            "the whole 4 TB (4.0e12 bytes) NVMe free for the store",
            "NVMe raw write 3.0, read 3.5 GB/s; through the store 2.5 / 3.0 GB/s",
        ],
        source="extrapolated from h100-box", created="2026-11",
    )


def _8x_h100() -> MachineProfile:
    # one 8-GPU host for `mtc plan --world-size 8` (issue 13): the lent box measured one GPU, so
    # the host-wide figures (cores, RAM, AdamW, DRAM, uplinks, links) are all assumed
    base = _h100_box()
    return dataclasses.replace(
        base, name="8x-h100", device="8 x NVIDIA H100 80GB SXM (NVLink), 112 cores, 2 TiB RAM, 8 NVMe (extrapolated)",
        cores=112, host_memory_bytes=2048 * GiB, host_available_bytes=2000 * GiB, disk_free_bytes=int(30e12), disk_dir="/",
        disk_write_gbps=10.0, disk_read_gbps=12.0, store_write_gbps=8.0, store_read_gbps=10.0, store_read_warm_gbps=10.0,
        adamw_gparams_s={"fused": 12.0, "exact": 6.0}, adamw_one_thread_gparams_s=0.6,
        gpus_per_host=8, pcie_uplinks=4, peer_gbps=360.0, network_gbps=400.0, collective_latency_us=10.0,
        host_memory_gbps=450.0,
        assumed=[
            TAKE_TURNS,
            COMMIT_LATENCY_ASSUMED,
            COMMIT_FILE_ASSUMED,
            "everything but one GPU's figures (the H100 box's: 789 TFLOP/s bf16, 55 / 55 / 94 GB/s PCIe per GPU) is assumed",
            ("112 cores, 2 TiB RAM (2,000 GiB available); host-wide CPU AdamW 12 G params/s (DRAM-bound: ~30 B/param "
             "at ~360 GB/s), x 0.49 while copies run, as the box"),
            "host DRAM 450 GB/s usable (2 sockets x 8 channels DDR5-4800 = 614 GB/s peak)",
            "4 PCIe Gen5 x16 uplinks to the CPUs, 2 GPUs behind each (55 / 55 / 94 GB/s per uplink)",
            "NVLink collectives 360 GB/s bus bandwidth per GPU; network 400 GB/s per host (8 x 400 Gb/s); 10 us per ring step",
            "8 NVMe in RAID 0: raw write 10, read 12 GB/s; through the store 8 / 10 GB/s; 30 TB free",
        ],
        source="extrapolated from h100-box", created="2026-11",
    )


_BUILTIN: dict[str, Callable[[], MachineProfile]] = {"h100-box": _h100_box, "h200-1.5tb": _h200_1p5tb, "256gb-4tb-nvme": _256gb_4tb,
                                                     "8x-h100": _8x_h100}


def builtin_names() -> list[str]:
    """Names of the built-in profiles."""
    return list(_BUILTIN)


def builtin(name: str) -> MachineProfile:
    """A built-in profile by name."""
    if name not in _BUILTIN:
        raise ConfigError(f"unknown machine {name!r}; built-in machines: {', '.join(_BUILTIN)}, or a profile .json "
                          "from `mtc calibrate -o FILE`")
    return _BUILTIN[name]()


def load_machine(spec: str | None, *, quick: Callable[[], MachineProfile] | None = None) -> MachineProfile:
    """A built-in name, a profile .json, or (None) the last saved profile, else ``quick()``."""
    if spec is None:
        if DEFAULT_PROFILE_PATH.is_file():
            return MachineProfile.load(DEFAULT_PROFILE_PATH)
        if quick is None:
            raise ConfigError(f"no machine given and no saved profile at {DEFAULT_PROFILE_PATH}; run `mtc calibrate`")
        return quick()
    if spec in _BUILTIN:
        return builtin(spec)
    if spec.endswith(".json") or Path(spec).is_file():
        return MachineProfile.load(spec)
    raise ConfigError(f"--machine {spec!r} is neither a built-in machine ({', '.join(_BUILTIN)}) nor a profile .json file")


# -- measuring ---------------------------------------------------------------------------------


def _best_time(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None,
                 sync: Callable[[], None] | None = None) -> float:
    """Fastest seconds of ``fn`` over ``repeats`` calls after one warm-up (``before`` runs untimed).

    The fastest, not the median: on a shared machine other jobs only ever add time, so the best
    of a few runs is the machine's own speed (what a quiet run gets), and one burst of another
    job's work does not skew the profile."""
    out = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        if sync is not None:
            sync()
        t = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        if i:
            out.append(time.perf_counter() - t)
    return min(out)


def _meminfo() -> tuple[int, int]:
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, avail or total


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _copy_rates(torch: Any, cuda: bool, mb: int, repeats: int) -> tuple[float, float, float]:
    """(H2D, D2H, both) GB/s: pinned copies on CUDA; on the CPU, memcpy on one and on two threads."""
    n = mb * 2**20
    if cuda:
        host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev_a, dev_b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        sync = torch.cuda.synchronize

        def both() -> None:
            with torch.cuda.stream(s1):
                dev_a.copy_(host_a, non_blocking=True)
            with torch.cuda.stream(s2):
                host_b.copy_(dev_b, non_blocking=True)

        h2d = _best_time(lambda: dev_a.copy_(host_a, non_blocking=True), repeats, sync=sync)
        d2h = _best_time(lambda: host_b.copy_(dev_b, non_blocking=True), repeats, sync=sync)
        bo = _best_time(both, repeats, sync=sync)
        return n / h2d / 1e9, n / d2h / 1e9, 2 * n / bo / 1e9
    a, b, c, d = (torch.empty(n // 4, dtype=torch.float32).fill_(1.0) for _ in range(4))
    one = _best_time(lambda: b.copy_(a), repeats)

    def two() -> None:  # the engine's h2d and d2h copy threads, at once
        t = threading.Thread(target=lambda: d.copy_(c))
        t.start()
        b.copy_(a)
        t.join()

    bo = _best_time(two, repeats)
    return n / one / 1e9, n / one / 1e9, 2 * n / bo / 1e9


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _disk_rates(root: Path, mb: int, repeats: int) -> tuple[float, float, float]:
    """Raw sequential GB/s in ``root``: write and cold read from `mtc.store.diskbench.raw_throughput`
    (the same measurement the disk-tier benchmark compares the store against: direct I/O, 1 MiB
    blocks, 16 in flight; the best of ``repeats``), and a warm (page-cache) read of a buffered file."""
    from mtc.store.diskbench import raw_throughput

    size = max(32, mb) * 2**20
    raws = [raw_throughput(root, size) for _ in range(max(1, repeats))]
    block = 4 * 2**20
    n_blocks = max(1, mb * 2**20 // block)
    buf = os.urandom(block)
    path = root / "mtc-calibrate.bin"
    out = bytearray(block)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(out):
                pass

    try:
        with open(path, "wb", buffering=0) as f:
            f.writelines(buf for _ in range(n_blocks))
        warm = _best_time(read, repeats)  # the warm-up read fills the page cache
    finally:
        path.unlink(missing_ok=True)
    return max(r["write_GBps"] for r in raws), max(r["read_GBps"] for r in raws), n_blocks * block / warm / 1e9


def _store_rates(torch: Any, root: Path, mb: int, repeats: int, io_threads: int) -> tuple[float, float, float, float, float]:
    """The engine's disk path, as a disk layer's update uses it: master, m and v (three arrays of
    ``mb`` / 3 MiB) written at once (CRC32C, fsync), and read one after the other into buffers,
    cold and warm, GB/s; the write again while reads of other arrays run beside it (the disk
    tier's read-ahead beside its write-behind), and the bytes of both together over that time."""
    from mtc.store import TensorStore

    n = mb * 2**20 // 4 // 3
    names = ("master", "m", "v")
    data = [torch.randn(n) for _ in names]
    out = [torch.empty(n) for _ in names]
    path = root / "mtc-calibrate-store"
    shutil.rmtree(path, ignore_errors=True)
    try:
        with TensorStore.create(path, io_threads=io_threads) as st:
            for name in names:
                st.create_array(name, (n,), torch.float32)
                st.create_array(f"{name}-other", (n,), torch.float32)  # what the busy write's reads read
                st.write_async(f"{name}-other", data[0]).result()

            def write() -> None:  # in place after the warm-up, as the disk tier's steady-state write-behind
                for f in [st.write_async(name, t, in_place=True) for name, t in zip(names, data, strict=True)]:
                    f.result()

            def read() -> None:  # one array after the other, as a disk layer's update reads them
                for name, t in zip(names, out, strict=True):
                    st.read_into(name, t)

            w = _best_time(write, repeats)
            files = [st.chunk_path(name, c) for name in names for c in range(st.array_info(name).n_chunks)]

            def evict() -> None:
                for f in files:
                    _evict(f)

            cold = _best_time(read, repeats, before=evict)
            warm = _best_time(read, repeats)
            reads = [0]  # arrays the reader finished: one array (mb / 3 MiB) is the count's grain

            def read_others() -> None:
                for name, t in zip(names, out, strict=True):
                    st.read_into(f"{name}-other", t)
                    reads[0] += 1

            def busy_writes() -> tuple[float, int]:  # the writes' mean, and the reads done meanwhile
                write()  # the warm-up, with the reader already running
                r0 = reads[0]
                return _mean_time(write, BUSY_WRITES, warm_up=False), reads[0] - r0

            busy, read_during = _while_running(busy_writes, read_others)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    nbytes = 3 * 4 * n
    both = (BUSY_WRITES * nbytes + read_during * 4 * n) / (BUSY_WRITES * busy)
    return nbytes / w / 1e9, nbytes / cold / 1e9, nbytes / warm / 1e9, nbytes / busy / 1e9, both / 1e9


def _commit_latency_s(torch: Any, root: Path, repeats: int, io_threads: int, extra: int = 0) -> float:
    """Seconds of a real commit whose bytes are negligible: a small layer's master, m and v written
    into the other generation as a commit writes them behind, then the commit record (with the
    RNG state a run records). The median of ``2 * repeats + 1`` after a warm-up (the first commit
    into each generation creates its files): an fsync's latency varies from call to call with the
    file system's journal, not only with a neighbour's load, and the run's pacer meets the usual
    commit, not the quickest. ``extra`` more arrays make as many more chunk files: the slope over
    them is what each file of a larger commit adds."""
    import base64

    from mtc.store import CommitRecord, TensorStore

    n = 1024
    kinds = ("master", "m", "v", *(f"x{k}" for k in range(extra)))  # ``extra`` more arrays: the cost per file
    rng = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    data = torch.randn(n)
    path = root / "mtc-calibrate-commit"
    shutil.rmtree(path, ignore_errors=True)
    try:
        with TensorStore.create(path, io_threads=io_threads) as st:
            for k in kinds:
                for g in (0, 1):
                    st.create_array(f"{k}/g{g}", (n,), torch.float32)
            step = [0]

            def commit() -> None:
                step[0] += 1
                g = step[0] % 2
                for f in [st.write_async(f"{k}/g{g}", data) for k in kinds]:
                    f.result()
                st.commit(CommitRecord(step=step[0], generation=g, data_cursor=step[0], rng_state=rng, config={},
                                       time_unix=time.time()))

            commit()
            commit()
            times = []
            for _ in range(2 * repeats + 1):
                t = time.perf_counter()
                commit()
                times.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return statistics.median(times)


BUSY_WRITES = 8  # writes averaged under load: the best of 3 read 0.62-0.83 GB/s in 5 calibrations on the VM, the mean of 8 0.79-0.86


def _mean_time(fn: Callable[[], object], n: int, *, warm_up: bool = True) -> float:
    """Mean seconds of ``fn`` over ``n`` back-to-back calls, after one warm-up call unless the
    caller made its own.

    The mean, not the best, where the load is part of what is measured (a write beside reads):
    the best of a few catches the gaps in the other thread's work, and which gaps it catches
    varies from one calibration to the next."""
    if warm_up:
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def _while_running(measure: Callable[[], T], load: Callable[[], object]) -> T:
    """``measure()`` while another thread runs ``load`` over and over."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            load()

    th = threading.Thread(target=loop, name="mtc-calibrate-load", daemon=True)
    th.start()
    try:
        return measure()
    finally:
        stop.set()
        th.join()


def _adamw_rates(torch: Any, numel: int, cores: int, cuda: bool, repeats: int) -> tuple[dict[str, float], float, tuple[float, float]]:
    """G params/s of adamw_flat_ (exact and fused) on a pool of ``cores`` threads, of the engine's
    impl on one thread, and the engine's impl's speed on zero gradients and moments relative to
    dense ones; with the bf16 compute copy on CUDA machines, as the engine runs it."""
    from mtc.runtime.host_adamw import HostStrategy, host_pool, tune_strategy

    g = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=g) * 0.02
    grad = torch.randn(numel, generator=g) * 1e-3
    m, v = torch.zeros(numel), torch.zeros(numel)
    copy = torch.empty(numel, dtype=torch.bfloat16) if cuda else None
    coef = torch.tensor(0.9999)  # clipping fires (at exactly 1.0 the gradient's multiply is skipped)
    hp = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "decay_numel": numel * 9 // 10}
    out: dict[str, float] = {}
    step = [1]

    def run(impl: str, pool: Any, way: Any = None) -> Callable[[], None]:
        way = way or HostStrategy()

        def f() -> None:
            way.run(p, grad, m, v, pool=pool, threads=cores, step=step[0], grad_scale=coef, compute_out=copy, impl=impl, **hp)
            step[0] += 1
        return f

    caller = torch.get_num_threads()
    engine = "fused" if cuda else "exact"
    with host_pool(cores) as pool:
        # exact: pooled chunks, the default (the engine may time a faster way for large layers: a
        # conservative figure; timing exact's whole-tensor candidates here changed what later
        # measurements saw of fresh allocations, first-touch 2.7 -> 19 GB/s on the 2-core VM)
        out["exact"] = numel / _best_time(run("exact", pool), repeats) / 1e9
        # fused: the fastest way over the cores, timed and picked as the engine does at start
        fused = tune_strategy("fused", pool, cores, numel, compute_dtype=copy.dtype if copy is not None else None, repeats=repeats)
        out["fused"] = dict(fused.rates)[fused.name]
        grad.zero_()
        m.zero_()
        v.zero_()
        zero = numel / _best_time(run(engine, pool, fused if engine == "fused" else None), repeats) / 1e9
    # one thread: as many samples as the pool's figures (a single sample made the planner's CPU
    # optimizer time swing by 25 % between calibrations on the shared 2-core box)
    with host_pool(1) as pool:
        zero_one = numel / _best_time(run(engine, pool), repeats) / 1e9
        grad.normal_(0, 1e-3)
        one = numel / _best_time(run(engine, pool), repeats) / 1e9
    torch.set_num_threads(caller)
    return out, one, (zero / out[engine], zero_one / one)


def gpu_layer_efficiency(prof: MachineProfile) -> tuple[float, str]:
    """A GPU profile's layer efficiency (`mtc.costmodel.anchored_efficiency` on its matmul points)
    and the line its ``assumed`` list gets. Where the cost model cannot time the anchor block (its
    trace failed), the block's FLOPs at the anchor's fraction of the fastest matmul, as a model with
    one flat rate would, and why: the measured figures are kept either way."""
    from mtc.costmodel import anchored_efficiency

    try:
        eff, how = round(anchored_efficiency(prof), 3), "the cost model's time of"
    except Exception as e:  # noqa: BLE001
        eff = round(_LLAMA8B_BLOCK_FLOPS / (ANCHOR_BLOCK["seconds"] * ANCHOR_BLOCK["peak_tflops"] * 1e12), 3)
        how = f"the FLOPs of (the cost model could not time it: {type(e).__name__}: {str(e)[:200]})"
    return eff, (f"layer efficiency {eff}: {how} a Llama 8B block at the fraction of this GPU's fastest matmul that the "
                 "H200's reached (ANCHOR_BLOCK; not measured here)")


# seconds of back-to-back launches per timed GPU matmul point
CUDA_MATMUL_TIMING_S = 0.02


def cuda_matmul_shapes(s: int = 1024) -> list[tuple[int, int, int]]:
    """(m, k, n) of calibrate's GPU matmul points: the largest first, then a layer's thinner ones
    down to about 100 FLOP per 4-byte element (what the cost model extrapolates flat below): an
    8B block's MLP, 4096^3, its K/V projections at 8192 tokens, a 1.5B block's at 16384, and a
    small model's (hidden 1024) at 65536. Each takes 17 GFLOP or more, so that back-to-back
    launches from Python keep the GPU fed (a 4 GFLOP matmul runs about as long as its launch)."""
    return [(8 * s, 8 * s, 8 * s), (8 * s, 4 * s, 14 * s), (4 * s, 4 * s, 4 * s), (8 * s, 4 * s, s),
            (16 * s, 2 * s, s // 2), (64 * s, s, s // 4)]


def _matmul_points(torch: Any, cuda: bool, shapes: list[tuple[int, int, int]], repeats: int) -> list[dict[str, float]]:
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else None
    pts = []
    for m, k, n in shapes:
        # x @ W^T with W stored (n, k), as nn.Linear and the traced layers run it: on the CPU a thin
        # x @ W^T ran at half the rate of x @ W (16 x 1024 x 2816, one thread, the 2-core box)
        a = torch.randn(m, k, dtype=dtype, device=dev)
        # a thin matmul streams its weight, which a layer reads once per visit (not from cache):
        # cycle through enough weights to overflow the CPU's caches (64 MiB)
        n_w = max(1, min(32, 64 * 2**20 // (n * k * a.element_size()))) if not cuda and m <= 128 else 1
        ws = [torch.randn(n, k, dtype=dtype, device=dev) for _ in range(n_w)]

        def run(a: Any = a, ws: list = ws) -> None:
            for w in ws:
                torch.nn.functional.linear(a, w)

        if cuda:
            # one launch per timing counted its launch and sync (tens of microseconds) against a
            # matmul of 0.2 ms: 4096^3 read 629-692 TFLOP/s where 8192^3 read 710-770 (2026-11-26/27)
            one = _best_time(run, 1, sync=sync)
            reps = max(1, min(1000, round(CUDA_MATMUL_TIMING_S / max(one, 1e-6))))
            t = _best_time(lambda run=run, reps=reps: [run() for _ in range(reps)], repeats, sync=sync) / reps
        else:
            t = _best_time(run, repeats, sync=sync) / n_w
        pts.append({"m": m, "k": k, "n": n, "tflops": 2 * m * k * n / t / 1e12})
    return pts


def _memory_points(torch: Any, sizes_mib: list[float], repeats: int) -> list[dict[str, float]]:
    out = []
    for mb in sizes_mib:
        n = max(1, int(mb * 2**20) // 4)
        a, b = torch.ones(n), torch.empty(n)
        reps = max(1, int(64 / max(mb, 0.01)) // 8)  # small buffers: several copies per timing

        def f(a: Any = a, b: Any = b, reps: int = reps) -> None:
            for _ in range(reps):
                b.copy_(a)

        out.append({"mib": mb, "gbps": 8 * n * reps / _best_time(f, repeats) / 1e9})
    return out


def _elementwise_points(torch: Any, sizes_mib: list[float], repeats: int) -> list[dict[str, float]]:
    return [{"mib": mb, "gbps": _elementwise_gbps(torch, False, mb, repeats)} for mb in sizes_mib]


def _elementwise_gbps(torch: Any, cuda: bool, mb: float, repeats: int) -> float:
    """Bytes touched per second by a norm + gated-activation sequence of unfused ops (fp32) on
    tensors of ``mb`` MiB."""
    dev = "cuda" if cuda else "cpu"
    rows = max(1, int(mb * 2**20) // 4 // 1024)
    x, y, w = torch.randn(rows, 1024, device=dev), torch.randn(rows, 1024, device=dev), torch.randn(1024, device=dev)

    def seq() -> None:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)  # pow: r+w, mean: r
        h = x * r * w  # two muls: r+w each
        torch.nn.functional.silu(h) * y  # silu: r+w, mul: 2r+w

    touched = 4 * rows * 1024 * (2 + 1 + 2 + 2 + 2 + 3)
    return touched / _best_time(seq, repeats, sync=torch.cuda.synchronize if cuda else None) / 1e9


def _attention_tflops(torch: Any, repeats: int) -> float:
    """Causal SDPA forward (16 heads x 256 tokens x 64), FLOPs counted as 4 T^2 d / 2 per head."""
    q, k, v = (torch.randn(4, 4, 256, 64) for _ in range(3))
    t = _best_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)
    return 16 * 4 * 256 * 256 * 64 * 0.5 / t / 1e12


def _first_touch_gbps(torch: Any, repeats: int) -> float:
    """Filling a freshly allocated 64 MiB tensor: above glibc's largest mmap threshold (32 MiB)
    every such allocation is mapped anew, and its first touch page-faults."""
    n = 64 * 2**20 // 4
    return 4 * n / _best_time(lambda: torch.empty(n).fill_(1.0), repeats) / 1e9


def _op_overhead_us(torch: Any, repeats: int) -> float:
    s = torch.ones(8)

    def many() -> None:
        for _ in range(500):
            torch.add(s, s)

    return _best_time(many, repeats) / 500 * 1e6


# A quiet machine times the same matmul within a few per cent call after call. On a busy one
# the intra-op threads' barriers stall whenever another job has one of them descheduled (a
# scheduler tick, ~24 ms on the 2-core VM, against the 512^3 matmul's 1.2 ms), and the figures
# calibrate takes there are off by up to 100x, and not alike from one calibration to the next:
# at load average 8-10 on the 2-core VM a 256^3 matmul read 0.002-0.24 TFLOP/s in four
# calibrations minutes apart, and `mtc plan` put the tiny preset's step at 2.76 s where it
# trained at 0.30 s (2026-11-29). On one intra-op thread nothing stalls, but the best of a few
# samples is then the quiet machine's speed, which a run beside the same load does not reach
# (planned 0.30 s, trained at 0.98 s). The probe is timed before and after the compute figures.
STEADY_PROBE_N = 512
STEADY_PROBE_SAMPLES = 30
# a probe is unsteady when its median time is over this many times its best, or (several intra-op
# threads) its best over this many times its best on one thread, which a quiet machine beats:
# under load 8 the 512^3 probe read 2.0-13.8x and 0.5-3.9x, one thread alone 1.05x
BUSY_SPREAD = 2.0
BUSY_THREADS = 1.5


def _steady_probe(torch: Any) -> tuple[float, float, float]:
    """(median, best) seconds of a `STEADY_PROBE_N`^3 fp32 matmul on the current intra-op threads,
    and its best on one thread."""
    a, b = torch.randn(STEADY_PROBE_N, STEADY_PROBE_N), torch.randn(STEADY_PROBE_N, STEADY_PROBE_N)

    def times() -> list[float]:
        torch.mm(a, b)
        out = []
        for _ in range(STEADY_PROBE_SAMPLES):
            t = time.perf_counter()
            torch.mm(a, b)
            out.append(time.perf_counter() - t)
        return out

    ts = times()
    caller = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = min(times())
    finally:
        torch.set_num_threads(caller)
    return statistics.median(ts), min(ts), one


def busy_reason(probes: list[tuple[float, float, float]], threads: int, load: float, cores: int) -> str:
    """Why compute figures measured between ``probes`` (`_steady_probe` results) are suspect, in
    words with what to do; "" when the machine was quiet. ``threads``: the intra-op threads the
    probes ran on; ``load``: the 1-minute load average before calibrating began (more runnable
    threads than ``cores`` is busy, whatever the probes read)."""
    spread = max(med / best for med, best, _one in probes)
    slower = max(best / one for _med, best, one in probes) if threads > 1 else 0.0
    why = []
    if load > cores:
        why.append(f"load average {load:.1f} on {cores} cores")
    if spread > BUSY_SPREAD:
        why.append(f"a {STEADY_PROBE_N}^3 matmul timed around the compute figures took {spread:.1f}x its best time at the median")
    if slower > BUSY_THREADS:
        why.append(f"a {STEADY_PROBE_N}^3 matmul took {slower:.1f}x as long at best on {threads} threads as on one")
    if not why:
        return ""
    return (f"the machine was busy while calibrating ({'; '.join(why)}): the compute figures, and so the planned step, "
            "may be off several-fold; re-run `mtc calibrate` when the machine is idle (`uptime` shows its load)")


def _identity(torch: Any, cuda: bool) -> dict[str, str]:
    """Which machine and software a profile describes (a profile from another machine is a guess)."""
    import platform
    import socket

    return {"host": socket.gethostname(), "cpu": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if cuda else "none"}


# the reference block calibrate runs (CPU path): Llama-shaped, small enough for a few seconds
REFERENCE_BLOCK = {"dim": 256, "ffn_dim": 704, "n_heads": 4, "n_kv_heads": 2, "micro_batch_size": 4, "seq_len": 128}


def _reference_block(torch: Any, repeats: int) -> dict[str, float]:
    """Forward and joint seconds of one traced Llama block, run as the engine's unfused runner."""
    from mtc.config import TrainConfig
    from mtc.runtime.executor import aux_param_dependence
    from mtc.runtime.runners import AutogradRunner
    from mtc.tracer import trace
    from mtc.train import build_model

    r = REFERENCE_BLOCK
    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": 1, "dim": r["dim"], "ffn_dim": r["ffn_dim"], "n_heads": r["n_heads"],
                                                      "n_kv_heads": r["n_kv_heads"]},
                      micro_batch_size=r["micro_batch_size"], seq_len=r["seq_len"], compute_dtype="float32")
    model = build_model(cfg)
    program = trace(model, cfg.micro_batch_size, cfg.seq_len)
    params = {k: v.detach() for k, v in model.named_parameters()}
    call = program.layers[1]
    tmpl = program.templates[call.template]
    runner = AutogradRunner(tmpl, call, aux_param_dependence(program.template_of(0)))
    # the embed stage's outputs are the block's carry and aux inputs
    embed = program.layers[0]
    ids = torch.randint(0, 256, (cfg.micro_batch_size, cfg.seq_len))
    e_tmpl = program.templates[embed.template]
    e_args = [params[embed.bindings[i.name].key] if embed.bindings[i.name].kind == "param" else ids for i in e_tmpl.inputs]
    with torch.no_grad():
        out = e_tmpl.module("cpu")(*e_args)
    carry, aux = out[0], list(out[1:])
    args = []
    for inp in tmpl.inputs:
        b = call.bindings[inp.name]
        args.append(params[b.key] if b.kind == "param" else carry if b.kind == "carry" else aux[b.index])
    fwd, joint = runner.forward(torch.device("cpu")), runner.joint(torch.device("cpu"))
    gout = torch.randn_like(carry)

    def forward() -> None:
        with torch.no_grad():
            fwd(*args)

    # interleaved, so that a busy spell of another job (which can stall intra-op threads' barriers
    # for 20x a block's time on the 2-core VM) lands on both alike rather than on one of them
    times: dict[str, list[float]] = {"fwd_s": [], "joint_s": []}
    for i in range(repeats + 5):
        for name, f in (("fwd_s", forward), ("joint_s", lambda: joint(*args, gout))):
            t = time.perf_counter()
            f()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t)
    return {name: min(ts) for name, ts in times.items()}


# a model so small that a step is almost only the engine's own work per layer visit
OVERHEAD_MODEL = {"n_layers": 2, "dim": 64, "ffn_dim": 128, "n_heads": 4, "n_kv_heads": 2}


def _visit_overhead_us(prof: MachineProfile, steps: int = 8, warmup: int = 3) -> float:
    """Microseconds a layer visit costs per micro-batch beyond what the cost model charges for it:
    `OVERHEAD_MODEL` trained through the engine (in memory, ram placement, no commits), its
    median step time less the modelled one, over its visits. On the 2-core VM the model missed
    about 4 ms per small block's forward and backward (the runner alone matched it)."""
    import numpy as np

    from mtc.config import OptimConfig, TrainConfig
    from mtc.costmodel import model_shape, step_time
    from mtc.data import write_token_file
    from mtc.train import train

    cfg = TrainConfig(model="tiny", model_overrides=dict(OVERHEAD_MODEL), steps=warmup + steps, micro_batch_size=1, seq_len=8,
                      placement="ram", durability="none", kernels="unfused", compute_dtype="float32", optim_threads=1,
                      optim=OptimConfig(warmup_steps=1))
    with tempfile.TemporaryDirectory() as d:
        tokens = write_token_file(Path(d) / "tokens.bin", np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint16),
                                  vocab_size=256, tokenizer="byte")
        res = train(cfg, None, tokens)
        res.store.close()
    measured = sorted(r.seconds for r in res.records[warmup:])[steps // 2]
    shape = model_shape(cfg, "float32")
    modelled = step_time(cfg, shape, list(res.placement), set(), dataclasses.replace(prof, visit_overhead_us=0.0)).step_s
    visits = 2 * shape.n_layers - 1  # forward and backward of every layer but the head, which has one
    return max(0.0, measured - modelled) / (visits * cfg.grad_accum) * 1e6


def calibrate(*, directory: str | Path | None = None, copy_mb: int = 64, disk_mb: int = 64, adamw_numel: int = 16_000_000,
              matmul_size: int = 1024, elementwise_mib: tuple[float, ...] = (0.5, 4, 32, 128), repeats: int = 3, io_threads: int = 4,
              threads: int | None = None, name: str = "calibrated") -> MachineProfile:
    """Measure this machine (about 10-20 s on a 2-core CPU box at the defaults) and return its profile.

    ``elementwise_mib``: sizes of the element-wise and memory-copy points; the largest stands for
    big layers' buffers (gradient slabs, embedding tables): at 32 MiB the copies still partly hit
    the cache and read 16-26 GB/s between calibrations on the 2-core VM, at 128 MiB 13.2-13.3.
    ``adamw_numel``: the AdamW figures' size, 64 MB per fp32 tensor by default, past the caches as
    the layers that dominate a large model's update are: at 4M parameters the 2-core VM's one-thread
    rate read 0.44 G params/s where the engine updated a 12.7M-parameter layer at 0.18-0.24 (plan
    validation's CPU-optimizer case then predicted 16-19 % short); at 16M it reads 0.29.

    Disk figures are measured in ``directory`` (default: the system temp dir), where the store
    would live; files written there are removed afterwards. CPU compute figures are measured with
    ``threads`` intra-op threads (default: torch's current setting, what a run here would use).
    """
    import torch

    caller = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        prof = _calibrate(torch, directory, copy_mb, disk_mb, adamw_numel, matmul_size, elementwise_mib, repeats,
                          io_threads, name)
        prof.calibrate_s = time.perf_counter() - t0
        return prof
    finally:
        torch.set_num_threads(caller)


def _calibrate(torch: Any, directory: str | Path | None, copy_mb: int, disk_mb: int, adamw_numel: int, matmul_size: int,
               elementwise_mib: tuple[float, ...], repeats: int, io_threads: int, name: str) -> MachineProfile:
    threads = torch.get_num_threads()
    root = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"calibrate: cannot use directory {root} for the disk test ({e}); pass --dir with a writable "
                          "directory on the disk the store will use") from None
    load = os.getloadavg()[0]  # (the minute before calibrating: its own threads do not count)
    cuda = torch.cuda.is_available()
    cores = _cores()
    total, avail = _meminfo()
    h2d, d2h, both = _copy_rates(torch, cuda, copy_mb, repeats)
    dw, dr, drw = _disk_rates(root, disk_mb, repeats)
    sw, sr, srw, swb, sboth = _store_rates(torch, root, disk_mb, repeats, io_threads)
    commit_latency = _commit_latency_s(torch, root, repeats, io_threads)
    more = 45  # files beyond the three: enough that the slope stands above an fsync's jitter (~5 ms)
    commit_file = max(0.0, (_commit_latency_s(torch, root, repeats, io_threads, more) - commit_latency) / more)
    probes = [_steady_probe(torch)]
    adam, adam_one, (zero_factor, zero_one) = _adamw_rates(torch, adamw_numel, cores, cuda, repeats)
    s = matmul_size
    # CPU: square, tall and thin (a layer's matmuls at few tokens stream their weight); x @ W^T as nn.Linear runs it
    shapes = [(s, s, s), (2 * s, s, s), (s // 2, s // 2, s // 2), (s // 4, s // 4, s // 4), (s // 8, s, s), (16, s, s)]
    if cuda:
        shapes = cuda_matmul_shapes(s)
    mm = _matmul_points(torch, cuda, shapes, repeats)
    gpu_mem = torch.cuda.mem_get_info()[1] if cuda else 0
    device = torch.cuda.get_device_name() if cuda else f"cpu ({cpu_model()}, {cores} cores)"
    assumed = []
    if cuda:
        assumed.append(f"CPU AdamW x {CUDA_ADAMW_WITH_COPIES} while the engine's copies run (the H100 box's stateless "
                       "bench_train runs; not measured here)")
        assumed.append("GPU AdamW 90 G params/s (HBM-bound estimate; not measured here)")
    else:
        assumed.append("no GPU: 'PCIe' is the host memcpy rate the engine's CPU copy threads reach, not a PCIe link")
    prof = MachineProfile(
        name=name, device=device, accelerator="cuda" if cuda else "cpu", cores=cores, gpu_memory_bytes=int(gpu_mem),
        host_memory_bytes=total, host_available_bytes=avail, disk_free_bytes=shutil.disk_usage(root).free,
        disk_dir=str(root.absolute()), h2d_gbps=h2d, d2h_gbps=d2h, both_gbps=both, pcie_is_memcpy=not cuda,
        disk_write_gbps=dw, disk_read_gbps=dr, disk_read_warm_gbps=drw,
        store_write_gbps=sw, store_read_gbps=sr, store_read_warm_gbps=srw, store_write_busy_gbps=swb, store_both_gbps=sboth,
        commit_latency_s=commit_latency,
        commit_file_s=commit_file,
        adamw_gparams_s=adam, adamw_impl="fused" if cuda else "exact", adamw_one_thread_gparams_s=adam_one,
        adamw_with_copies=CUDA_ADAMW_WITH_COPIES if cuda else 1.0,
        matmul_dtype="bfloat16" if cuda else "float32", matmul=mm,
        layer_efficiency=1.0,
        elementwise=[] if cuda else _elementwise_points(torch, list(elementwise_mib), repeats),
        memory=[] if cuda else _memory_points(torch, list(elementwise_mib), repeats),
        op_overhead_us=0.0 if cuda else _op_overhead_us(torch, repeats),
        attention_tflops=0.0 if cuda else _attention_tflops(torch, repeats),
        first_touch_gbps=0.0 if cuda else _first_touch_gbps(torch, repeats), adamw_zero_grad_factor=zero_factor,
        adamw_zero_grad_factor_one_thread=zero_one,
        compute_threads=0 if cuda else threads,
        gpu_adamw_gparams_s=90.0 if cuda else 0.0,
        assumed=assumed, source=f"mtc calibrate (copies {copy_mb} MiB, disk {disk_mb} MiB, AdamW {adamw_numel:,} params, "
                               f"matmul {s}, best of {repeats})",
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        identity=_identity(torch, cuda),
    )
    try:  # the data-parallel engine's collectives run on gloo in host memory (mtc plan --world-size)
        from mtc.collbench import gloo_bus_gbps

        prof.gloo_gbps = gloo_bus_gbps(mib=min(copy_mb, 32), repeats=repeats)
    except (OSError, RuntimeError) as e:
        prof.assumed.append(f"gloo collectives not measured ({e}); mtc plan --world-size assumes a rate and says so")
    if cuda:
        prof.layer_efficiency, why = gpu_layer_efficiency(prof)
        prof.assumed.insert(0, why)
    else:
        from mtc.costmodel import reference_scales  # the planner's own cost model, fitted to the measured block

        prof.reference_block = _reference_block(torch, repeats)
        prof.other_scale_fwd, prof.other_scale_bwd = reference_scales(prof)
        prof.visit_overhead_us = _visit_overhead_us(prof)
    probes.append(_steady_probe(torch))
    prof.busy = busy_reason(probes, threads, load, cores)
    return prof
