"""Shared bits of the benchmarks: the JSON record (device, versions, git sha, date) and medians."""

from __future__ import annotations

import datetime
import json
import platform
import socket
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    """Device, library versions and git sha for a benchmark record."""
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
    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_v,
        "zarr": zarr_v,
        "git_sha": sha,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def median(xs: list[float]) -> float:
    """Median of a non-empty list."""
    return statistics.median(xs)


def write_record(name: str, record: dict[str, Any]) -> Path:
    """Write ``record`` (plus the environment) as JSON under bench/results/ and return the path."""
    RESULTS.mkdir(exist_ok=True)
    env = environment()
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    path = RESULTS / f"{name}-{env['host']}-{stamp}.json"
    path.write_text(json.dumps({"benchmark": name, **env, **record}, indent=1))
    return path
