"""One training step: mtc's streaming executor (weights from the store) vs plain PyTorch, same model.

Side by side on the same model, batch and AdamW settings:
  * torch  - the whole model resident on the device, eager forward/backward, torch.optim.AdamW;
  * mtc    - the traced program streamed layer by layer from a local zarr store, recompute in
             backward, host AdamW writing the next state generation, one commit per step.
Reports the median step time, tokens/s and the mtc/torch ratio, and writes a JSON record.

    python bench/bench_step.py --preset tiny --steps 12              # CPU smoke run
    python bench/bench_step.py --preset 125m --seq-len 1024 --micro-batch-size 8 --device cuda
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, write_record

from mtc.config import OptimConfig, TrainConfig
from mtc.data import BatchSampler, write_token_file
from mtc.runtime.schedule import lr_at
from mtc.train import build_model, train
from mtc.tracer import LossModel


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def torch_steps(cfg: TrainConfig, tokens: np.ndarray) -> list[float]:
    """Seconds per step of plain PyTorch training with the model resident on cfg.device."""
    model = build_model(cfg).to(cfg.device)
    lm = LossModel(model)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    times, cursor = [], 0
    for step in range(cfg.steps):
        _sync(cfg.device)
        t = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, o)
        for _ in range(cfg.grad_accum):
            ids, tg = (x.to(cfg.device) for x in sampler.batch(cursor))
            cursor += 1
            (lm(ids, tg) / cfg.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(cfg.device)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    """Run both sides and write the record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, help="override the preset's n_layers")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--store-dir", help="where the mtc store goes (default: a temp dir)")
    a = ap.parse_args()

    overrides = {"n_layers": a.layers} if a.layers else {}
    cfg = TrainConfig(model=a.preset, model_overrides=overrides, steps=a.steps, micro_batch_size=a.micro_batch_size,
                      seq_len=a.seq_len, grad_accum=a.grad_accum, device=a.device, optim=OptimConfig(warmup_steps=2))
    vocab = build_model(cfg, device="meta").cfg.vocab_size
    tokens = np.random.default_rng(0).integers(0, min(vocab, 65535), 2_000_000).astype(np.uint16)
    work = Path(a.store_dir or tempfile.mkdtemp(prefix="mtc-bench-"))
    tok_file = write_token_file(work / "tokens.bin", tokens, vocab_size=vocab, tokenizer="synthetic")

    t_torch = torch_steps(cfg, tokens)[a.warmup:]
    times: list[float] = []
    res = train(cfg, work / "store", tok_file, overwrite=True, on_step=lambda r: times.append(r.seconds))
    n_params = res.program.n_params()
    res.store.close()
    t_mtc = times[a.warmup:]
    shutil.rmtree(work / "store", ignore_errors=True)

    tok_step = cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum
    mt, tt = median(t_mtc), median(t_torch)
    record = {
        "config": cfg.to_dict(),
        "n_params": n_params,
        "tokens_per_step": tok_step,
        "torch_resident": {"median_step_s": tt, "tokens_per_s": tok_step / tt, "steps_s": t_torch},
        "mtc_streamed": {"median_step_s": mt, "tokens_per_s": tok_step / mt, "steps_s": t_mtc},
        "mtc_over_torch_time": mt / tt,
    }
    path = write_record("bench_step", record)
    print(f"{a.preset} ({n_params / 1e6:.1f}M params) on {a.device}, {tok_step} tokens/step, median of {len(t_mtc)} steps")
    print(f"  torch, resident : {tt * 1e3:9.1f} ms/step  {tok_step / tt:10.0f} tok/s")
    print(f"  mtc, streamed   : {mt * 1e3:9.1f} ms/step  {tok_step / mt:10.0f} tok/s   ({mt / tt:.2f}x torch's time)")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
