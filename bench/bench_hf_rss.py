"""Peak host memory of `mtc import` and `mtc export` on a generated checkpoint of >= 1 GB.

Writes a random Llama-shaped checkpoint (fp32 safetensors shards with an index, no transformers
needed) of at least --gb gigabytes, then imports it into a store and exports it back, each in a
fresh Python process that first imports everything it will use (and traces a tiny model, which
imports the rest of torch's tracing machinery on first use), records its resident set size,
resets the kernel's high-water mark (/proc/self/clear_refs) and reports VmHWM afterwards. The
increase is what the import or export itself held, file-backed pages included (shards are read
with explicit reads, never mapped). The bound checked is the issue's: peak increase < 2x the
largest layer's (block's) fp32 size + 200 MB.

    python bench/bench_hf_rss.py --dir /tmp/hfrss --gb 1.0
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mtc, whatever the installed one is
MB = 10**6

_CHILD = r"""
import json, sys, time
import mtc.hf, mtc.hf.importer, mtc.hf.exporter, mtc.train, mtc.tracer, mtc.warmstart, mtc.store, mtc.plan  # noqa: F401

# trace a small model first: tracing imports more of torch (fx, fake tensors, sympy) on first use,
# and those imports are the process's, not the import's or export's
from mtc.config import TrainConfig
from mtc.train import build_model
mtc.tracer.trace(build_model(TrainConfig(model="tiny", micro_batch_size=1, seq_len=8), device="meta"), 1, 8)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

what, src, dst = sys.argv[1:4]
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
t0 = time.perf_counter()
if what == "import":
    mtc.hf.import_hf(src, dst)
else:
    mtc.hf.export_hf(src, dst)
print(json.dumps({"base": base, "peak": status("VmHWM"), "seconds": time.perf_counter() - t0}))
"""


def write_checkpoint(out: Path, gb: float, *, dim: int = 1024, ffn: int = 2816, vocab: int = 32000) -> dict:
    """A random fp32 Llama checkpoint of >= ``gb`` GB in ``out``, written tensor by tensor."""
    from mtc.hf.safetensors_io import ShardWriter

    heads, kv = 16, 4
    hs = dim // heads
    block = [("input_layernorm.weight", (dim,)), ("self_attn.q_proj.weight", (dim, dim)),
             ("self_attn.k_proj.weight", (kv * hs, dim)), ("self_attn.v_proj.weight", (kv * hs, dim)),
             ("self_attn.o_proj.weight", (dim, dim)), ("post_attention_layernorm.weight", (dim,)),
             ("mlp.gate_proj.weight", (ffn, dim)), ("mlp.up_proj.weight", (ffn, dim)), ("mlp.down_proj.weight", (dim, ffn))]
    per_block = sum(math.prod(s) for _n, s in block)
    fixed = 2 * vocab * dim + dim
    layers = max(1, math.ceil((gb * 1e9 / 4 - fixed) / per_block))
    tensors = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        tensors += [(f"model.layers.{i}.{n}", s) for n, s in block]
    tensors += [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]
    out.mkdir(parents=True, exist_ok=True)
    shards, size, limit = [[]], 0, 400 * MB
    for name, shape in tensors:
        n = math.prod(shape) * 4
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    g = torch.Generator().manual_seed(0)
    wmap, total = {}, 0
    for i, group in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = ShardWriter(out / file, [(n, torch.float32, s) for n, s in group])
        for name, shape in group:
            t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
            w.write(name, t)
            wmap[name] = file
            total += t.numel() * 4
            del t
        w.close()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": dim,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(cfg))
    return {"bytes": total, "layers": layers}


def _child(what: str, src: Path, dst: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, what, str(src), str(dst)], check=False, cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(work: Path, gb: float) -> dict:
    """Generate, import, export; the figures (bytes) and whether each is within the bound."""
    from mtc.plan import load_plan

    shutil.rmtree(work, ignore_errors=True)
    ck = write_checkpoint(work / "hf", gb)
    imp = _child("import", work / "hf", work / "run")
    program = load_plan(work / "run" / "plan")
    largest = max(program.layer_numel(i) for i in range(program.n_layers)) * 4
    exp = _child("export", work / "run", work / "out")
    bound = 2 * largest + 200 * MB
    res = {"checkpoint_bytes": ck["bytes"], "layers": ck["layers"], "largest_layer_fp32_bytes": largest, "bound_bytes": bound}
    for name, r in (("import", imp), ("export", exp)):
        res[name] = {"peak_increase_bytes": r["peak"] - r["base"], "base_rss_bytes": r["base"], "seconds": round(r["seconds"], 1),
                     "within_bound": r["peak"] - r["base"] < bound}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/mtc-hf-rss", help="work directory (emptied first)")
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (fp32)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    res = run(Path(a.dir), a.gb)
    print(json.dumps(res, indent=1))
    for name in ("import", "export"):
        r = res[name]
        print(f"{name}: peak RSS +{r['peak_increase_bytes'] / MB:.0f} MB (bound {res['bound_bytes'] / MB:.0f} MB = 2 x "
              f"{res['largest_layer_fp32_bytes'] / MB:.0f} MB + 200 MB) in {r['seconds']} s; checkpoint "
              f"{res['checkpoint_bytes'] / MB:.0f} MB")
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)
    return 0 if all(res[n]["within_bound"] for n in ("import", "export")) else 1


if __name__ == "__main__":
    sys.exit(main())
