"""`mtc import`: a Hugging Face checkpoint into a new seeded store, one tensor at a time.

Everything is checked before the store is created: the architecture and config (`mtc.hf.arch`),
the shard files' headers, and that every tensor the model needs is there with the right shape and
a floating dtype. Then each layer's flat fp32 master state is filled tensor by tensor (read with
explicit reads, converted into place) and written, with zero Adam moments, as a fresh run lays
out its step 0 (`mtc.warmstart.create_seeded_store`). Host memory holds one layer's fp32 state
plus the one tensor being converted.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from mtc.errors import CheckpointError
from mtc.hf.arch import from_hf_config, ignorable, tensor_map
from mtc.hf.safetensors_io import ShardReader

__all__ = ["TOKENIZER_FILES", "ImportResult", "copy_tokenizer", "import_hf", "read_hf_config"]

# the files a Hugging Face tokenizer directory may hold (copied into RUN/tokenizer/ and exported back)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_FLOAT = ("F32", "F16", "BF16", "F64")


@dataclasses.dataclass(frozen=True, slots=True)
class ImportResult:
    """What `import_hf` wrote."""

    store: Path
    architecture: str
    model: str
    model_overrides: dict[str, Any]
    n_params: int
    tensors: int
    tokenizer_files: list[str]
    seconds: float


def read_hf_config(hf_dir: str | Path) -> tuple[str, str, dict[str, Any]]:
    """(architecture, mtc family, model_overrides) of the checkpoint in ``hf_dir``."""
    f = Path(hf_dir) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face checkpoint directory: it has no config.json")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} does not parse: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f} is not a JSON object")
    return from_hf_config(cfg)


def _open_shards(src: Path) -> dict[str, ShardReader]:
    """Tensor name -> the reader of the shard holding it."""
    index = src / _INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed ({e})") from None
        files = sorted(set(wmap.values()))
    elif (src / _SINGLE).is_file():
        wmap, files = None, [_SINGLE]
    else:
        bins = sorted(p.name for p in src.glob("*.bin"))
        hint = f" (it has {', '.join(bins[:3])}: re-save it with save_pretrained(..., safe_serialization=True))" if bins else ""
        raise CheckpointError(f"{src} holds no safetensors weights ({_SINGLE} or {_INDEX}){hint}")
    readers: dict[str, ShardReader] = {}
    for name in files:
        if not (src / name).is_file():
            raise CheckpointError(f"{src}: shard {name} named by {_INDEX} is missing")
        r = ShardReader(src / name)
        for t in r.entries:
            if t in readers:
                raise CheckpointError(f"{src}: tensor {t} is in both {readers[t].path.name} and {name}")
            readers[t] = r
    if wmap is not None:
        for t, file in wmap.items():
            if t not in readers or readers[t].path.name != file:
                raise CheckpointError(f"{src}: {_INDEX} puts tensor {t} in {file}, which does not hold it")
    return readers


def import_hf(hf_dir: str | Path, store_dir: str | Path, *, overwrite: bool = False, io_threads: int = 4) -> ImportResult:
    """Import the Llama / Mistral / Qwen2 / GPT-2 checkpoint in ``hf_dir`` into a new store at ``store_dir``.

    The store holds fp32 master weights and zero Adam state, committed as step 0; `mtc train
    --store STORE --data ...` fine-tunes it (the model comes from the store). Tokenizer files are
    copied into ``STORE/tokenizer/`` and config.json (with generation_config.json) into
    ``STORE/hf/``, which `export_hf` writes back. CheckpointError, before anything is written, for an
    unsupported architecture or a missing, mis-shaped or non-float tensor.
    """
    from mtc.trace_cache import trace_preset
    from mtc.warmstart import create_seeded_store, seed_config

    t0 = time.perf_counter()
    src = Path(hf_dir)
    arch, family, over = read_hf_config(src)
    cfg = seed_config(family, over)
    readers = _open_shards(src)
    prefix = "transformer." if family == "gpt2" and any(n.startswith("transformer.") for n in readers) else ""
    names = tensor_map(family, over, prefix=prefix)
    program = trace_preset(cfg)
    by_key = {n.mtc: n for n in names}
    if set(by_key) != set(program.params):  # the name map and mtc's model must agree on every parameter
        raise CheckpointError(f"internal: mtc's {family} model has parameters {sorted(set(program.params) ^ set(by_key))[:3]} "
                              "the name map does not cover")
    for n in names:
        if n.hf not in readers:
            raise CheckpointError(f"{src}: tensor {n.hf} is missing (a {arch} with this config.json has it)")
        e = readers[n.hf].entries[n.hf]
        want = program.params[n.mtc].spec.shape
        want = tuple(reversed(want)) if n.transposed else want
        if e.shape != want:
            raise CheckpointError(f"{src}: tensor {n.hf} has shape {list(e.shape)}, config.json implies {list(want)}")
        if e.dtype not in _FLOAT:
            raise CheckpointError(f"{src}: tensor {n.hf} has dtype {e.dtype}; weights must be F32, F16 or BF16")
    wanted = {n.hf for n in names}
    tied_head = over["tie_embeddings"]
    for t in readers:
        if t in wanted or ignorable(t) or (tied_head and t == "lm_head.weight"):
            continue  # a tied checkpoint may store its head too: the embedding is the one mtc keeps
        raise CheckpointError(f"{src}: tensor {t} is not part of a {arch} as mtc maps it (quantized or adapter weights?); "
                              "import a plain checkpoint")

    def fill(layer: int, flat: torch.Tensor) -> None:
        for p in program.layer_params(layer):
            n = by_key[p.key]
            readers[n.hf].read_into(n.hf, flat[p.offset : p.offset + p.numel].view(p.spec.shape), transposed=n.transposed)

    dst = Path(store_dir)
    source = {"kind": "hf", "source": str(src.resolve()), "architecture": arch}
    create_seeded_store(dst, cfg, program, fill, source, overwrite=overwrite, io_threads=io_threads)
    copied = copy_tokenizer(src, dst / "tokenizer")
    (dst / "hf").mkdir(exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / "hf" / f)
    return ImportResult(dst, arch, family, over, program.n_params(), len(names), copied, time.perf_counter() - t0)


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of directory ``src`` into ``dst`` (created if any); their names."""
    found = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if found:
        dst.mkdir(parents=True, exist_ok=True)
        for f in found:
            shutil.copyfile(src / f, dst / f)
    return found
