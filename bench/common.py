"""Shared bits of the benchmarks: the JSON record (device, versions, git sha, date) and medians."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
RESULTS_ENV = "BENCH_RESULTS_DIR"  # records go there instead when set (tests: a temporary directory)

# the engine's benchmark shapes (bench_train's parts, bench_fusion's whole-model line): Llama
# overrides of the base preset LLAMA (untied embeddings, RoPE theta 5e5)
LLAMA = "8b"
P1_SHAPE = dict(dim=4096, ffn_dim=14336, n_heads=32, n_kv_heads=8, n_layers=20, vocab_size=32000)  # 4.6B
P3_SHAPE = dict(dim=2048, ffn_dim=8192, n_heads=32, n_kv_heads=8, n_layers=23, vocab_size=32000)  # 1.53B
SMOKE_SHAPE = dict(dim=64, ffn_dim=160, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=256, max_seq_len=256)


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi, without a CUDA context in this process (a context
    holds GPU memory that the benchmark's own processes would then lack); None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else None


def environment(device: str | None = None) -> dict[str, Any]:
    """Device, library versions and git sha for a benchmark record; ``device``: its name, given
    (`gpu_name`), instead of asking CUDA."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    try:
        import zarr

        zarr_v = zarr.__version__
    except ImportError:
        zarr_v = None
    cuda = device is None and torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "device": device or (torch.cuda.get_device_name() if cuda else
                             f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_v,
        "zarr": zarr_v,
        "git_sha": sha,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # the host's transparent-huge-page mode: whether the engine's host buffers can get huge pages
        # ('madvise' or 'always'), which their first touch and pinning time depend on
        "thp": _thp_mode(),
    }


def _thp_mode() -> str | None:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled, or None where it is absent."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def median(xs: list[float]) -> float:
    """Median of a non-empty list."""
    return statistics.median(xs)


def write_record(name: str, record: dict[str, Any], path: Path | None = None, *, device: str | None = None) -> Path:
    """Write ``record`` (plus the environment) as JSON under bench/results/ (or $BENCH_RESULTS_DIR)
    and return the path; ``path``: rewrite that record instead (a run that updates its record as
    its parts finish, so a killed run still leaves what it measured); ``device``: see `environment`."""
    env = environment(device)
    if path is None:
        out = Path(os.environ.get(RESULTS_ENV) or RESULTS)
        out.mkdir(parents=True, exist_ok=True)
        stamp = env["date"].replace(":", "").replace("-", "")[:15]
        path = out / f"{name}-{env['host']}-{stamp}.json"
    tmp = path.with_name(path.name + ".tmp")  # whole or not at all: a run killed mid-write keeps the last one
    tmp.write_text(json.dumps({"benchmark": name, **env, **record}, indent=1))
    os.replace(tmp, path)
    return path
