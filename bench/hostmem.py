"""Host memory of one process under a limit that counts the page cache (for bench_disk_tier.py).

cgroup v1 (``/sys/fs/cgroup/memory``, as on the CPU and GPU machines here) or v2 (a child group
of the unified hierarchy with ``memory.max``): a fresh group limited to ``limit`` bytes; the
process joins it after its fixed start-up (interpreter, torch), so the group is charged with what
the run allocates and with every page it brings into the page cache from then on, and no more
than ``limit`` of both can be held. Where neither can be made (no permission, a container
without the memory controller) the fallback is RSS over the baseline plus the store files'
resident page-cache pages, counted with mincore(2).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from pathlib import Path

__all__ = ["MemGroup", "drop_file_cache", "peak_rss", "reset_peak_rss", "resident_file_bytes", "rss_now"]

_V1 = Path("/sys/fs/cgroup/memory")
_V2 = Path("/sys/fs/cgroup")


class MemGroup:
    """A memory cgroup with a hard limit; `open` returns None where none can be made."""

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    @classmethod
    def open(cls, name: str, limit: int) -> MemGroup | None:
        """Make group ``name`` limited to ``limit`` bytes (page cache included), or None."""
        for root, version, limit_file in ((_V1, 1, "memory.limit_in_bytes"), (_V2, 2, "memory.max")):
            if version == 2 and not (root / "cgroup.controllers").exists():
                continue
            if not (root / limit_file).exists() and version == 1:
                continue
            cg = root / name
            try:
                cg.mkdir(exist_ok=True)
                (cg / limit_file).write_text(str(limit))
                if int((cg / limit_file).read_text().split()[0]) > limit * 1.01:
                    raise OSError("the limit did not take")
                return cls(cg, version)
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    cg.rmdir()
        return None

    def join(self) -> bool:
        """Move this process into the group; whether it is there now."""
        try:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))
            return str(os.getpid()) in (self.path / "cgroup.procs").read_text().split()
        except OSError:
            return False

    def _read(self, v1: str, v2: str) -> int:
        return int((self.path / (v1 if self.version == 1 else v2)).read_text().split()[0])

    @property
    def limit(self) -> int:
        """The limit in bytes."""
        return self._read("memory.limit_in_bytes", "memory.max")

    @property
    def peak(self) -> int:
        """Peak usage (anonymous memory and page cache charged to the group) since it was made."""
        return self._read("memory.max_usage_in_bytes", "memory.peak")

    @property
    def hits(self) -> int:
        """How often usage reached the limit (v1 failcnt; v2 the 'max' events)."""
        if self.version == 1:
            return self._read("memory.failcnt", "")
        events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        return int(events.get("max", 0))

    def stat(self) -> dict[str, int]:
        """The group's current page cache and anonymous memory, in bytes."""
        raw = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        if self.version == 1:
            return {"cache": int(raw.get("cache", 0)), "anon": int(raw.get("rss", 0))}
        return {"cache": int(raw.get("file", 0)), "anon": int(raw.get("anon", 0))}

    def remove(self) -> None:
        """Remove the (empty) group."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


def rss_now() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset VmHWM (Linux: clear_refs 5) so `peak_rss` counts from now; whether it took."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak resident set (VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def drop_file_cache(root: Path) -> int:
    """Drop every file under ``root`` from the page cache (posix_fadvise DONTNEED); files done."""
    n = 0
    for p in root.rglob("*"):
        if p.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages cannot be dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
                finally:
                    os.close(fd)
    return n


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_file_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` resident in the page cache (mincore over a mapping of each)."""
    import numpy as np

    page = mmap.PAGESIZE
    total = 0
    for p in root.rglob("*"):
        if not p.is_file() or not p.stat().st_size:
            continue
        size = p.stat().st_size
        with open(p, "rb") as f:
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        try:
            arr = np.frombuffer(m, dtype=np.uint8)  # only for the mapping's address: no page is touched
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            ok = _libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec) == 0
            del arr
            if ok:
                total += sum(b & 1 for b in vec) * page
        finally:
            m.close()
    return total
