"""Blocks that keep their activations between visits against blocks that recompute them: the A/B.

The same run twice per round, `--save-activations all` and `off`, in interleaved rounds (the order
alternates), everything else equal: step seconds after the warm-up steps, their median per
setting over all rounds, and the ratio recompute / save. Fused runs all open one plan compiled
first (as `mtc compile` writes it), so both settings launch the same kernels: runs that each
compiled for themselves would time the matmul-fusion and attention choices anew and might pick
others. On the CPU it runs unfused in fp32 (the
blocks keep their autograd graphs); on CUDA fused in bf16 (the blocks keep their matmul and
attention outputs: graphs/split.py), where bench_train's P3 (`auto` against `auto-recompute`) is
the A/B at the issue's shape.

    python bench/bench_saves.py                          # CPU: a 6-block Llama, dim 512, 2 x 4 x 256 tokens
    python bench/bench_saves.py --device cuda --dim 2048 --ffn 8192 --layers 8 --micro-batch 8 --seq 1024
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from common import write_record
from mtc.config import OptimConfig, TrainConfig
from mtc.data import write_token_file
from mtc.train import open_run, train


def _plan(cfg: TrainConfig, where: Path) -> Path:
    """A plan directory for fused ``cfg`` (the program and its compiled templates), compiled once."""
    from mtc.api import compile as compile_plan

    run = open_run(cfg, None)
    try:
        compile_plan(run.program, where, matmul_fusion=cfg.matmul_fusion)
    finally:
        run.store.close()
    return where


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds of both settings; the record."""
    cuda = args.device.startswith("cuda")
    rng = np.random.default_rng(0)
    tokens = args.micro_batch * args.seq * args.accum * (args.warmup + args.steps + 1) * 2
    data = write_token_file(Path(tempfile.mkdtemp()) / "t.bin", rng.integers(0, 256, tokens).astype(np.uint16),
                            vocab_size=256, tokenizer="byte")
    over = dict(dim=args.dim, ffn_dim=args.ffn, n_heads=args.heads, n_kv_heads=args.kv_heads, n_layers=args.layers, vocab_size=256)
    times: dict[str, list[float]] = {"all": [], "off": []}
    rounds = []
    plan = None
    for r in range(args.rounds):
        for save in ("off", "all") if r % 2 == 0 else ("all", "off"):
            cfg = TrainConfig(model="tiny", model_overrides=over, steps=args.warmup + args.steps, micro_batch_size=args.micro_batch,
                              seq_len=args.seq, grad_accum=args.accum, device=args.device, kernels="fused" if cuda else "unfused",
                              durability="none", save_activations=save, optim=OptimConfig(lr=1e-3))
            if cuda and plan is None:
                plan = _plan(cfg, Path(tempfile.mkdtemp(prefix="mtc-bench-saves-plan-")))
            res = train(cfg, None, data, run=open_run(cfg, None, plan=plan) if plan is not None else None)
            res.store.close()
            steps = [rec.seconds for rec in res.records][args.warmup:]
            times[save].extend(steps)
            rounds.append({"round": r, "save_activations": save, "saved_blocks": res.saves, "steps_s": steps,
                           "losses": res.losses})
            print(f"round {r} {save:3s}: median {statistics.median(steps):.3f} s ({len(res.saves)} blocks kept)", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"device_kind": args.device, "kernels": "fused" if cuda else "unfused", "model_overrides": over,
            "micro_batch": args.micro_batch, "seq_len": args.seq, "grad_accum": args.accum, "warmup_steps": args.warmup,
            "measured_steps": args.steps, "rounds": rounds, "median_step_s": med,
            "recompute_over_save": med["off"] / med["all"]}


def main() -> None:
    """Parse, run, write the record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rec = run(a)
    path = write_record("bench_saves", rec)
    print(f"recompute / save: {rec['recompute_over_save']:.3f}x (median step {rec['median_step_s']['off']:.3f} s "
          f"against {rec['median_step_s']['all']:.3f} s); record: {path}")


if __name__ == "__main__":
    main()
