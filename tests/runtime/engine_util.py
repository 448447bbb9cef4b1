"""Shared set-up of the engine tests: token data, a small parity config, an engine built by hand."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mtc.compiler import compile_program
from mtc.config import OptimConfig, TrainConfig
from mtc.data import BatchSampler, TokenFile, write_token_file
from mtc.plan import save_plan
from mtc.runtime.placement import streamed_grads_on_device
from mtc.runtime.runners import LayerRunner
from mtc.runtime.tiers import StateTiers
from mtc.runtime.timeline import Timeline
from mtc.train import Engine, Run, build_engine, init_state, open_run, plan_placement


def skewed_tokens(path: Path, n: int = 40_000) -> TokenFile:
    """Text-like bytes (skewed frequencies) so the loss moves within a few steps."""
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(256, 0.1))
    return write_token_file(path, rng.choice(256, size=n, p=probs).astype(np.uint16), vocab_size=256, tokenizer="byte")


def small_config(**kw: object) -> TrainConfig:
    """`tiny` with two blocks (program layers: embed, 2 blocks, head), clipping and grad_accum 2."""
    base = dict(
        model="tiny", model_overrides={"n_layers": 2}, steps=6, micro_batch_size=2, seq_len=16, grad_accum=2, seed=5,
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1, clip_norm=0.5),
    )
    base.update(kw)
    return TrainConfig(**base)


def plan_for(cfg: TrainConfig, where: Path) -> Path:
    """A plan directory for fused ``cfg`` in ``where``, as `mtc compile` writes one: the program and
    its compiled templates, with the attention tuning and the matmul fusion choices they carry.

    Runs opened from it (``open_run(cfg, None, plan=...)``) launch the same kernels. Two runs that
    each compile for themselves time those choices anew, and where two candidates time alike each
    may pick another (another summation order): a bit-for-bit comparison of two schedules must
    run both from one plan.
    """
    run = open_run(cfg, None)
    try:
        compile_program(run.program, where / "kernels", matmul_fusion=cfg.matmul_fusion, allow_tf32=cfg.allow_tf32)
        save_plan(run.program, where)
    finally:
        run.store.close()
    return where


@dataclasses.dataclass
class HandBuilt:
    """An engine built outside `mtc.train`, and what it runs over."""

    run: Run
    placement: list[str]
    tiers: StateTiers
    gpu_update: set[int]
    runners: dict[str, LayerRunner] | None
    compiled: dict | None  # template id -> compiled template (fused configs)
    engine: Engine

    def close(self) -> None:
        """Stop the engine's threads and close the run's store."""
        self.engine.close()
        self.run.store.close()


def hand_built_engine(cfg: TrainConfig, kernels_dir: Path | None = None, *,
                      log: Callable[[str], None] | None = None, saves: tuple[int, ...] = (),
                      wrap: Callable[[dict[str, LayerRunner]], dict[str, LayerRunner]] | None = None) -> HandBuilt:
    """The engine `mtc.train` builds for a new run of ``cfg``, for tests that drive `run_step`
    themselves: the plan's placement, the state arrays created and filled (`init_state`: a disk
    layer's ring reads its first generation when the optimizer is built), and for a fused config
    the compiled templates in ``kernels_dir``, replayed as CUDA graphs on CUDA (``wrap``: what
    the executor gets instead of those runners; ``saves``: the blocks that keep their activations)."""
    run = open_run(cfg, None)
    prog, device = run.program, torch.device(cfg.device)
    placement, gpu_update = plan_placement(cfg, prog)
    tiers = StateTiers(prog, placement, device, getattr(torch, cfg.resolved_compute_dtype), streamed=gpu_update,
                       streamed_grads_on_device=streamed_grads_on_device(cfg.activation_budget_gb))
    init_state(run.store, tiers, prog, run.params, cfg.durability)
    run.params = None
    runners = compiled = None
    if cfg.fused:
        from mtc.compiler import compile_program
        from mtc.runtime.graph_replay import replay_graphs
        from mtc.runtime.runners import CompiledRunner

        assert kernels_dir is not None, "a fused config compiles its templates into kernels_dir"
        compiled = compile_program(prog, kernels_dir, log=None)
        runners = {tid: CompiledRunner(ct, prog.templates[tid]) for tid, ct in compiled.items()}
        runners = replay_graphs(runners, prog.templates, compiled, device, log=log)
    if wrap is not None:
        if runners is None:  # unfused: the runners the executor would make
            from mtc.graphs.program import aux_param_dependence
            from mtc.runtime.runners import AutogradRunner

            aux = aux_param_dependence(prog.template_of(0))
            runners = {}
            for c in prog.layers:  # each template's first call, as the executor takes it
                if c.template not in runners:
                    runners[c.template] = AutogradRunner(prog.templates[c.template], c, aux)
        runners = wrap(runners)
    eng = build_engine(cfg, prog, tiers, gpu_update, run.store, Timeline(), runners=runners, saves=saves)
    return HandBuilt(run, placement, tiers, gpu_update, runners, compiled, eng)


def steps_without_host_sync(hb: HandBuilt, cfg: TrainConfig, tokens: TokenFile, steps: int, strict_from: int) -> None:
    """Run ``steps`` steps of the hand-built CUDA engine of ``cfg`` on the same pinned micro-batches; from
    step ``strict_from`` on (warm: allocations, lazy set-up and graph captures done) any host
    synchronisation inside a step raises (torch's sync debug mode 'error')."""
    eng = hb.engine
    sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=0)
    mbs = [tuple(t.pin_memory() for t in sampler.batch(j)) for j in range(cfg.grad_accum)]
    for step in range(steps):
        eng.optimizer.begin_step(step, 1e-3)
        if step >= strict_from:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = eng.executor.run_step(mbs, eng.optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eng.optimizer.finish_step(out.loss)
    eng.optimizer.wait()
