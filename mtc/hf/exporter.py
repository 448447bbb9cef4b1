"""`mtc export`: a run's committed weights as a Hugging Face checkpoint directory, streamed.

The output is what ``save_pretrained`` writes: size-limited safetensors shards with
``model.safetensors.index.json``, ``config.json``, ``generation_config.json`` and the tokenizer
files. Each shard's header is laid out first (all shapes are known from the plan), then its
tensors are written in order, reading one layer's fp32 master state from the store at a time, so
host memory holds one layer plus one converted tensor. The directory is written under a temporary
name and renamed into place at the end: a failed export leaves no half checkpoint behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mtc.data.tokens import check_tokenizer_beside
from mtc.errors import CheckpointError, DataError, write_failure
from mtc.hf.arch import tensor_map, to_hf_config
from mtc.hf.importer import TOKENIZER_FILES, copy_tokenizer
from mtc.hf.safetensors_io import ShardWriter

__all__ = ["ExportResult", "export_hf", "parse_size"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, slots=True)
class ExportResult:
    """What `export_hf` wrote."""

    directory: Path
    step: int
    dtype: str
    shards: list[str]
    total_bytes: int
    tokenizer_files: list[str]
    tokenizer_source: str | None
    seconds: float


def parse_size(text: str) -> int:
    """Bytes of a size such as "5GB", "500MB", "2GiB" or "1000000"."""
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 2GiB")
    unit = m[2].upper().rstrip("B").rstrip("I")
    base = 1024 if "I" in m[2].upper() else 1000
    n = float(m[1]) * base ** ("KMGT".index(unit) + 1 if unit else 0)
    if n < 1:
        raise CheckpointError(f"--max-shard-size {text!r} must be at least one byte")
    return int(n)


def _tokenizer_source(run: Path, last_meta: dict[str, Any], flag: str | Path | None) -> Path | None:
    """Where the run's tokenizer files are: RUN/tokenizer/, then the one beside its data (when it
    is still the one the data was made by), then ``flag``."""
    if any((run / "tokenizer" / f).is_file() for f in TOKENIZER_FILES):
        return run / "tokenizer"
    data = last_meta.get("data") or {}
    path = data.get("path") if isinstance(data, dict) else None
    if path:
        beside = Path(path).with_name(Path(path).stem + ".tokenizer")
        if any((beside / f).is_file() for f in TOKENIZER_FILES):
            try:  # not one the data was prepared again with since, with another tokenizer
                check_tokenizer_beside(beside, data)
                return beside
            except DataError:
                if flag is None:
                    raise
    if flag is not None:
        p = Path(flag)
        if p.is_file() and p.name == "tokenizer.json":
            return p.parent
        if p.is_dir() and any((p / f).is_file() for f in TOKENIZER_FILES):
            return p
        raise CheckpointError(f"--tokenizer {p}: expected a tokenizer.json or a directory holding one")
    return None


def export_hf(run: str | Path, out_dir: str | Path, *, dtype: str = "float32", step: int | None = None,
              max_shard_bytes: int = 5 * 10**9, tokenizer: str | Path | None = None) -> ExportResult:
    """Write the weights of ``run`` at ``step`` (default: its last commit) as a Hugging Face checkpoint in ``out_dir``.

    ``dtype``: float32 (the master weights exactly) or bfloat16. ``tokenizer``: where to take
    tokenizer files from when the run has none of its own (see `_tokenizer_source`).
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads the result.
    """
    from mtc.models import family_of, model_config
    from mtc.plan import load_plan
    from mtc.shards import read_layer
    from mtc.warmstart import resolve_step
    from mtc.weight_sources import check_untouched, open_run_store

    t0 = time.perf_counter()
    if dtype not in _DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: export writes one of {', '.join(_DTYPES)}")
    tdtype = _DTYPES[dtype]
    run, out = Path(run), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"output {out} exists and is not an empty directory; pick a new directory or remove it")
    with open_run_store(run) as st:
        step, gen = resolve_step(st, step)
        last = st.last_commit(rng=False)
        config = next((r.config for r in reversed(st.commit_history()) if r.step == step), last.config)
        # the record of that step: a data-parallel run's names the shard stores that hold it (mtc.shards)
        rec = next((r for r in reversed(st.commit_history()) if r.step == step and r.generation == gen), last)
        family = family_of(config["model"])
        fields = dataclasses.asdict(model_config(config["model"], **(config.get("model_overrides") or {})))
        program = load_plan(run / "plan")
        base = json.loads((run / "hf" / "config.json").read_text()) if (run / "hf" / "config.json").is_file() else None
        hf_cfg = to_hf_config(family, fields, base, dtype)
        prefix = "transformer." if family == "gpt2" else ""
        names = tensor_map(family, fields, prefix=prefix)
        if {n.mtc for n in names} != set(program.params):
            raise CheckpointError(f"run {run}'s plan does not hold a plain {family} model's parameters; it cannot be exported "
                                  "as a Hugging Face checkpoint")
        tok_src = _tokenizer_source(run, last.meta, tokenizer)
        # one layer's tensors stay together, layers in order: each layer is read from the store once
        names.sort(key=lambda n: program.params[n.mtc].layer)
        shards: list[list] = [[]]
        size = 0
        for n in names:
            p = program.params[n.mtc]
            nbytes = p.numel * tdtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(n)
            size += nbytes
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        except OSError as e:
            raise CheckpointError(f"cannot write the checkpoint at {out}: {write_failure(e, out)}; "
                                  "choose another -o directory") from None
        try:
            total = 0
            cached: tuple[int, torch.Tensor | None] = (-1, None)
            for file, group in zip(files, shards, strict=True):
                specs = []
                for n in group:
                    shape = program.params[n.mtc].spec.shape
                    specs.append((n.hf, tdtype, tuple(reversed(shape)) if n.transposed else shape))
                w = ShardWriter(tmp / file, specs)
                try:
                    for n in group:
                        p = program.params[n.mtc]
                        if cached[0] != p.layer:
                            cached = (-1, None)  # drop the last layer before reading the next
                            cached = (p.layer, read_layer(run, rec, p.layer, "master", program.layer_numel(p.layer), root_store=st))
                        t = cached[1][p.offset : p.offset + p.numel].view(p.spec.shape)
                        t = t.t() if n.transposed else t
                        w.write(n.hf, t.to(tdtype).contiguous())
                        del t  # a view of the cached layer: it must not outlive it
                        total += p.numel * tdtype.itemsize
                    w.close()
                except BaseException:
                    w.abort()
                    raise
            cached = (-1, None)
            # (before the checkpoint appears: one read while training overwrote the step is not published)
            check_untouched(run, step, gen, what=f"exporting step {step} of run {run}")
            index = {"metadata": {"total_size": total}, "weight_map": {n.hf: f for f, g in zip(files, shards, strict=True) for n in g}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
            (tmp / "generation_config.json").write_text(json.dumps(_generation_config(run, hf_cfg), indent=2) + "\n")
            copied = copy_tokenizer(tok_src, tmp) if tok_src is not None else []
            if out.exists():
                out.rmdir()  # empty, checked above
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ExportResult(out, step, dtype, files, total, copied, str(tok_src) if tok_src is not None else None,
                        time.perf_counter() - t0)


def _generation_config(run: Path, hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """The imported checkpoint's generation_config.json, else one with the config's token ids."""
    f = run / "hf" / "generation_config.json"
    if f.is_file():
        return json.loads(f.read_text())
    out: dict[str, Any] = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hf_cfg.get(k) is not None:
            out[k] = hf_cfg[k]
    return out
