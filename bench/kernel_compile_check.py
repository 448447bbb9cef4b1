"""Compile every generated Triton kernel of the bench models for a GPU, on a machine without one.

GPU sessions are short and rare; a generated kernel that the interpreter runs but Triton's GPU
compiler rejects (or that spills registers) would cost one. This script builds bench_fusion's
real-shaped blocks, heads and embeds (bf16, 8192 tokens) and one layer of each of bench_train's P1
and P3 shapes (4 and 16 x 1024 tokens), compiles their templates as `mtc train`
and bench_fusion do, and runs each compiled graph (forward, joint, save, backward) on the meta
device with Triton's launch replaced by a compile for the target (default sm_90, the H100/H200)
through a stand-in driver: every generated kernel at every launch configuration the GPU's tuner
would try, the column-combine kernel at the tiles its launches take, and the kernels that repeat
grouped KV heads for cuDNN attention and sum their gradients back (`kernels/kv_groups.py`). Per kernel and
configuration it prints registers, spilled bytes and shared memory (cuobjdump on the cubin), and
exits 1 if any failed to compile. Attention runs cuDNN or mtc's flash kernels on the GPU and its
meta implementation here: its Triton kernels are not compiled by this check.

Run it with the Triton the GPU machine has (3.6 there; a CPU wheel of torch beside it):

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install -q triton==3.6.0 torch==2.13.0 setuptools
    /tmp/t36/bin/pip install -q --no-build-isolation -e .   # mtc's other dependencies (triton stays 3.6)
    /tmp/t36/bin/python bench/kernel_compile_check.py            # every arch and shape, ~2 minutes

(2026-11-29, at 29a5fec: 165 configurations compiled, 0 failed, 0 spilled; 98 s with Triton's cache
empty, 38 s again; record `bench/results/kernel_compile_check-vm-20261129T170355.json`. With the
kv_groups kernels: 167, 0 failed, 0 spilled, 35 s, `...T172719.json`.)

A JSON record goes to bench/results/ (``--no-record``: none).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fusion import REAL, _inputs  # noqa: E402
from common import LLAMA, P1_SHAPE, P3_SHAPE, write_record  # noqa: E402

from mtc.compiler import compile_template  # noqa: E402
from mtc.kernels import codegen, column_reduce  # noqa: E402
from mtc.models import build, model_config  # noqa: E402
from mtc.tracer import trace  # noqa: E402

SM_COUNT = 132  # the H100 SXM's and the H200's: per-SM launch sizes (rowcol chunks, column splits)
# what is compiled: bench_fusion's layers (one sequence of --seq tokens), and one layer of
# bench_train's P1 and P3 shapes at their plans' micro-batches (4 and 16 sequences of 1024 tokens)
MODELS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    **{arch: (name, over, None) for arch, (name, over) in REAL.items()},
    "p1": (LLAMA, dict(P1_SHAPE, n_layers=1), 4),
    "p3": (LLAMA, dict(P3_SHAPE, n_layers=1), 16),
}


class _TargetDriver:
    """Triton's active driver as far as compiling goes: device 0 of the target, no stream."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def resources(cubin: bytes) -> dict[str, int]:
    """REG, LOCAL (spilled bytes per thread) and SHARED of a cubin's function (cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|SHARED|STACK):(\d+)", text)}


@contextmanager
def compiling_launches(arch: int, log: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Within: a Triton launch compiles for ``arch`` and reports to ``log`` instead of running;
    generated kernels plan their launches for a GPU of `SM_COUNT` SMs and launch every
    configuration their tuner would time; column combines take their GPU tiles."""
    active = driver._active  # no GPU: none yet (driver.reset_active would look for one and raise)
    saved = (JITFunction.__getitem__, codegen.launch_target, column_reduce._tiles, codegen.FusedKernel.__call__)
    tiles = column_reduce._tiles

    def launch(self: JITFunction, grid: Any) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            what = {"kernel": self.fn.__name__, "warps": kwargs.get("num_warps", 4),
                    "constexprs": {k: v for k, v in kwargs.items() if k.isupper()},
                    # the pointers' dtypes: one kernel compiles once per dtype signature (the combine's outputs)
                    "dtypes": [str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)]}
            t0 = time.perf_counter()
            try:
                k = self.run(*args, grid=grid, warmup=True, **kwargs)
                what.update(resources(k.asm["cubin"]), compile_s=round(time.perf_counter() - t0, 2))
            except Exception as e:  # noqa: BLE001  (the point: report every failure, carry on)
                what["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log(what)
        return run

    def every_candidate(self: codegen.FusedKernel, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cands = self.candidates(True) if self.mode in codegen.TUNED_MODES else [None]
        out: tuple[torch.Tensor, ...] = ()
        for cfg in cands:
            out = self._launch(inputs, self._plan(tuple(inputs), cfg))
        return out

    driver.set_active(_TargetDriver(arch))
    JITFunction.__getitem__ = launch
    codegen.launch_target = lambda dev: (True, SM_COUNT)
    column_reduce._tiles = lambda split, n, cuda: tiles(split, n, True)
    codegen.FusedKernel.__call__ = every_candidate
    try:
        yield
    finally:
        JITFunction.__getitem__, codegen.launch_target, column_reduce._tiles, codegen.FusedKernel.__call__ = saved
        driver._active = active


def check_arch(arch: str, seq: int, sm: int, cache: Path, log: Callable[[dict[str, Any]], None]) -> None:
    """Compile ``arch``'s embed, block and head as plans and bench_fusion do, and run each graph on
    the meta device, its Triton launches compiled for compute capability ``sm``."""
    name, over, batch = MODELS[arch]
    with torch.device("meta"):
        model = build(name, **over).to(torch.bfloat16)
    prog = trace(model, 1, seq) if batch is None else trace(model, batch, 1024)
    vocab = model_config(name, **over).vocab_size
    meta = torch.device("meta")
    for part, call in (("embed", prog.layers[0]), ("block", prog.layers[1]), ("head", prog.layers[-1])):
        t = prog.templates[call.template]
        args = _inputs(t, call, meta, vocab)
        outs = t.module(meta)(*args)
        gouts = [torch.empty_like(o) for o in outs[: 1 + t.n_aux_out] if isinstance(o, torch.Tensor) and o.is_floating_point()]
        for joint_outputs in ((None, True) if part == "block" else (None,)):
            ct = compile_template(t, cache, joint_outputs=joint_outputs)
            which = ["forward", "joint"] + (["save", "backward"] if ct.backward_graph is not None and joint_outputs is None else [])
            kept: list[torch.Tensor] = []  # what the save graph keeps for the backward graph
            for w in which:
                def tagged(rec: dict[str, Any], where: str = f"{arch}/{part}/{w}" + ("+outputs" if joint_outputs else "")) -> None:
                    log({"where": where, **rec})
                with compiling_launches(sm, tagged):
                    gm = ct.module(w, meta)
                    given = list(args) if w != "backward" else [*args, *kept]
                    # the graph's inputs beyond those: the gradients of the outputs (joint and backward)
                    res = gm(*given, *gouts[: len(ct.graph(w).find_nodes(op="placeholder")) - len(given)])
                    if w == "save":
                        kept = list(res[1 + t.n_aux_out:])


def check_kv_groups(sm: int, seq: int, log: Callable[[dict[str, Any]], None]) -> None:
    """Compile `kernels/kv_groups.py`'s kernels (what cuDNN attention's per-query-head candidate
    launches around it) for compute capability ``sm``, at the grouped blocks' heads (Llama-8B 32
    over 8, Qwen2 28 over 4, D 128), bf16, (B, T, H, D) layouts as the compiled graphs hand them."""
    from mtc.kernels import kv_groups

    meta = torch.device("meta")
    for arch, hq, hkv in (("llama", 32, 8), ("qwen2", 28, 4)):
        q, k = (torch.empty(1, seq, h, 128, dtype=torch.bfloat16, device=meta).transpose(1, 2) for h in (hq, hkv))
        with compiling_launches(sm, lambda rec, where=f"{arch}/attention/kv_groups": log({"where": where, **rec})):
            kv_groups._launch(kv_groups._expand_heads_kernel, k, torch.empty_like(q), hq, hq // hkv)
            kv_groups._launch(kv_groups._sum_groups_kernel, q, torch.empty_like(k), hkv, hq // hkv)


def main() -> None:
    """Compile, report, record; exit 1 on any failure."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(MODELS), choices=list(MODELS),
                    help="bench_fusion's layers, and bench_train's P1 and P3 shapes (default: all)")
    ap.add_argument("--sm", type=int, default=90, help="compute capability to compile for (90: H100, H200)")
    ap.add_argument("--seq", type=int, default=8192, help="bench_fusion's layers: tokens per call (its default)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    seen: dict[tuple, dict[str, Any]] = {}
    t0 = time.perf_counter()

    def log(rec: dict[str, Any]) -> None:
        key = (rec["kernel"], rec["warps"], json.dumps(rec["constexprs"], sort_keys=True), tuple(rec["dtypes"]))
        if key in seen:
            seen[key].setdefault("also", []).append(rec["where"])
            return
        seen[key] = rec
        res = rec.get("error") or (f"regs {rec.get('REG')}, spill {rec.get('LOCAL')} B, shared {rec.get('SHARED')} B, "
                                   f"{rec.get('compile_s')} s")
        print(f"{rec['where']:28s} {rec['kernel'][:22]:22s} w{rec['warps']:<2d} {json.dumps(rec['constexprs']):48s} {res}", flush=True)

    with tempfile.TemporaryDirectory(prefix="mtc-kernel-check-") as cache:
        for arch in a.arch:
            check_arch(arch, a.seq, a.sm, Path(cache), log)
        check_kv_groups(a.sm, a.seq, log)
    recs = list(seen.values())
    failed = [r for r in recs if "error" in r]
    spilled = [r for r in recs if r.get("LOCAL")]
    wall = time.perf_counter() - t0
    print(f"{len(recs)} kernel configurations compiled for sm_{a.sm} with triton {triton.__version__} in {wall:.0f} s: "
          f"{len(failed)} failed, {len(spilled)} spill registers; most registers {max((r.get('REG', 0) for r in recs), default=0)}")
    if not a.no_record:
        out = write_record("kernel_compile_check", {"target": f"sm_{a.sm}", "arch": a.arch, "seq": a.seq, "sm_count": SM_COUNT,
                                                    "wall_s": round(wall, 1), "failed": len(failed), "spilled": len(spilled),
                                                    "kernels": recs}, device=f"none: compiled for sm_{a.sm} on the CPU")
        print(f"record: {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
