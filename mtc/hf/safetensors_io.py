"""safetensors files read and written one tensor at a time, never mapped or loaded whole.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte range; plus ``__metadata__``) and the tensors' bytes. Reading parses the header and reads
one tensor's byte range with an explicit read into a fresh buffer, then tells the kernel to drop
those pages from its cache, so host memory holds the one tensor being converted. Writing lays out
the whole header first (every name, dtype and shape is known up front), then streams each
tensor's bytes in order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import torch

from mtc.errors import CheckpointError

__all__ = ["DTYPES", "ShardReader", "ShardWriter", "TensorEntry", "dtype_code"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("F32", "BF16", ...)."""
    return _CODES[dtype]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor's place in a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


class ShardReader:
    """The header of one safetensors file, and reads of single tensors from it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path} is not a safetensors file (shorter than its 8-byte header length)")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER:
                    raise CheckpointError(f"{self.path} is not a safetensors file (header length {n} is implausible)")
                doc = json.loads(f.read(n))
            size = self.path.stat().st_size
        except OSError as e:
            raise CheckpointError(f"cannot read {self.path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path} is not a safetensors file (its header does not parse: {e})") from None
        self.metadata = doc.pop("__metadata__", None) or {}
        self.entries: dict[str, TensorEntry] = {}
        base = 8 + n
        for name, info in doc.items():
            try:
                lo, hi = (int(x) for x in info["data_offsets"])
                entry = TensorEntry(name, str(info["dtype"]), tuple(int(s) for s in info["shape"]), base + lo, hi - lo)
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: header entry {name!r} is malformed") from None
            if entry.start + entry.nbytes > size:
                raise CheckpointError(f"{self.path} is truncated: tensor {name} ends at byte {entry.start + entry.nbytes}, "
                                      f"the file has {size}")
            self.entries[name] = entry

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in its stored dtype and shape (a fresh CPU tensor)."""
        e = self.entries[name]
        if e.dtype not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {e.dtype}, which mtc does not read")
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        self._pread(e, buf)
        return buf.view(DTYPES[e.dtype]).reshape(e.shape)

    def read_into(self, name: str, out: torch.Tensor, *, transposed: bool = False) -> None:
        """Tensor ``name`` (transposed, for a 2-D one, if asked) converted into ``out``.

        Read straight into ``out``'s memory when it has the stored dtype and layout (no
        temporary), else through one buffer of the stored size.
        """
        e = self.entries[name]
        if not transposed and DTYPES.get(e.dtype) == out.dtype and out.is_contiguous() and tuple(out.shape) == e.shape:
            self._pread(e, out.view(-1).view(torch.uint8))
            return
        t = self.read(name)
        out.copy_(t.t() if transposed else t)

    def _pread(self, e: TensorEntry, buf: torch.Tensor) -> None:
        name = e.name
        view = memoryview(buf.numpy())
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < e.nbytes:  # pread may return short counts
                got = os.preadv(fd, [view[done:]], e.start + done)
                if got <= 0:
                    raise CheckpointError(f"{self.path}: unexpected end of file reading {name}")
                done += got
            if hasattr(os, "posix_fadvise"):  # the bytes are ours now: let the page cache forget them
                os.posix_fadvise(fd, e.start, e.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as err:
            raise CheckpointError(f"cannot read tensor {name} from {self.path}: {err.strerror or err}") from None
        finally:
            os.close(fd)


class ShardWriter:
    """A safetensors file written tensor by tensor, in the order of ``specs`` given up front."""

    def __init__(self, path: str | Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        off = 0
        self._order: list[tuple[str, int]] = []
        for name, dtype, shape in specs:
            n = dtype.itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [off, off + n]}
            self._order.append((name, n))
            off += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # pad so the data starts 8-byte aligned (the format allows trailing spaces)
        self.nbytes = 8 + len(text) + off
        self._f = open(self.path, "wb")  # noqa: SIM115 -- held across write() calls, closed by close()/abort()
        self._f.write(struct.pack("<Q", len(text)) + text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append tensor ``name``; it must be the next in the declared order, with its declared size."""
        want, n = self._order[self._next]
        t = tensor.detach().contiguous()
        if name != want or t.numel() * t.element_size() != n:
            raise RuntimeError(f"internal: shard {self.path} expects {want} ({n} bytes) next, got {name}")
        self._f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
        self._next += 1

    def close(self) -> None:
        """Finish the file (every declared tensor must have been written) and make it durable."""
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if self._next != len(self._order):
            raise RuntimeError(f"internal: shard {self.path} closed after {self._next} of {len(self._order)} tensors")

    def abort(self) -> None:
        """Close without the completeness check (after an error)."""
        if not self._f.closed:
            self._f.close()
