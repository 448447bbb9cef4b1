"""AdamW on the host over each layer's flat fp32 master weights and moments, in the store.

Gradients arrive per parameter while backward runs (`add_grad`) and are summed into one fp32
accumulator per owner layer. When a layer's gradient is final (`grads_final`) its norm is taken at
once; without clipping its update is handed to a worker thread right away, so the update of layer
i overlaps the backward of layer i-1. With global-norm clipping the update must wait for the last
layer's norm, so updates run in `finish_step` (a later engine moves them to just before the
layer's next fetch). The math is torch.optim.AdamW's single-tensor path op for op, so an fp32 run
matches it to rounding.

Each step reads generation ``g`` of master/m/v and writes generation ``1 - g``: the state committed
at the previous step is never overwritten, which is what makes a commit crash-safe.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mtc.config import OptimConfig
from mtc.graphs.program import Program
from mtc.store import TensorStore, state_array_name

__all__ = ["HostAdamW", "StepStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    """What one optimizer step did."""

    lr: float
    grad_norm: float
    clip_coef: float


class HostAdamW:
    """AdamW over the flat per-layer state of ``program`` held in ``store``."""

    def __init__(
        self,
        program: Program,
        store: TensorStore,
        cfg: OptimConfig,
        *,
        compute_dtype: torch.dtype | None = None,
        workers: int = 1,
        kernel_device: torch.device | None = None,
    ) -> None:
        self.program, self.store, self.cfg = program, store, cfg
        self.compute_dtype = compute_dtype if compute_dtype not in (None, torch.float32) else None
        self._numel = {i: program.layer_numel(i) for i in range(program.n_layers)}
        self._decay = {i: program.layer_decay_numel(i) for i in range(program.n_layers)}
        self._acc: dict[int, torch.Tensor] = {}
        self._sq: dict[int, bool] = {}
        self._norms: dict[str, torch.Tensor] = {}
        self._pending: list[int] = []
        self._futures: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mtc-adamw")
        self._lock = threading.Lock()
        self._step: int | None = None
        # Where the fused AdamW kernel runs (None: torch ops on the host). On CUDA this is the
        # GPU-side update option: the layer's state crosses PCIe, the update is one kernel pass.
        self.kernel_device = kernel_device

    def begin_step(self, step: int, lr: float, read_gen: int, write_gen: int) -> None:
        """Start optimizer step ``step`` (0-based): reads generation read_gen, writes write_gen."""
        if self._step is not None:
            raise RuntimeError("begin_step called twice without finish_step")
        self._step, self._lr, self._rgen, self._wgen = step, lr, read_gen, write_gen
        self._acc.clear()
        self._sq.clear()
        self._norms.clear()
        self._pending.clear()
        self._futures.clear()

    def add_grad(self, key: str, grad: torch.Tensor) -> None:
        """Add one parameter's gradient (any device) into its owner layer's accumulator."""
        p = self.program.params[key]
        acc = self._acc.get(p.layer)
        if acc is None:
            acc = self._acc[p.layer] = torch.zeros(self._numel[p.layer], dtype=torch.float32)
        acc[p.offset : p.offset + p.numel].add_(grad.detach().reshape(-1).to("cpu", torch.float32))

    def grads_final(self, layer: int) -> None:
        """Layer ``layer``'s gradient is complete for this step: take its norm, maybe update now."""
        if self._numel[layer] == 0:
            return
        acc = self._acc.get(layer)
        if acc is None:
            raise RuntimeError(f"layer {layer} declared final but received no gradient")
        # Per-parameter norms, as clip_grad_norm_ takes them, so the global norm rounds the same.
        for p in self.program.layer_params(layer):
            self._norms[p.key] = torch.linalg.vector_norm(acc[p.offset : p.offset + p.numel])
        self._sq[layer] = True
        if self.cfg.clip_norm is None:
            self._futures.append(self._pool.submit(self._update, layer, None))
        else:
            self._pending.append(layer)

    def finish_step(self) -> StepStats:
        """Finish the step: clip, run the remaining updates, wait until all are written."""
        owners = [i for i in range(self.program.n_layers) if self._numel[i]]
        missing = [i for i in owners if i not in self._sq]
        if missing:
            raise RuntimeError(f"layers {missing} never received final gradients this step")
        # torch.nn.utils.clip_grad_norm_: the norm of the per-tensor norms, coef clamped at 1.
        total = torch.linalg.vector_norm(torch.stack([self._norms[k] for k in self.program.params]))
        coef = torch.tensor(1.0)
        if self.cfg.clip_norm is not None:
            coef = torch.clamp(self.cfg.clip_norm / (total + 1e-6), max=1.0)
            for layer in self._pending:
                self._futures.append(self._pool.submit(self._update, layer, coef))
        for f in self._futures:
            f.result()
        stats = StepStats(lr=self._lr, grad_norm=float(total), clip_coef=float(coef))
        self._step = None
        self._acc.clear()
        return stats

    def _update(self, layer: int, coef: torch.Tensor | None) -> None:
        cfg, step = self.cfg, self._step + 1  # bias correction counts from 1
        names = {k: state_array_name(layer, k, self._rgen) for k in ("master", "m", "v")}
        param, exp_avg, exp_avg_sq = (self.store.read(names[k]) for k in ("master", "m", "v"))
        grad = self._acc[layer]
        if self.kernel_device is not None:
            self._update_with_kernel(layer, param, exp_avg, exp_avg_sq, grad, coef, step)
            return
        if coef is not None:
            grad.mul_(coef)
        lr = self._lr
        nd = self._decay[layer]
        if nd:
            param[:nd].mul_(1 - lr * cfg.weight_decay)
        exp_avg.lerp_(grad, 1 - cfg.beta1)
        exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        bias_correction1 = 1 - cfg.beta1**step
        bias_correction2 = 1 - cfg.beta2**step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(cfg.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        # Plain writes: each already fans out over the store's I/O threads chunk by chunk.
        w = self._wgen
        self.store.write(state_array_name(layer, "master", w), param)
        self.store.write(state_array_name(layer, "m", w), exp_avg)
        self.store.write(state_array_name(layer, "v", w), exp_avg_sq)
        if self.compute_dtype is not None:
            self.store.write(state_array_name(layer, "compute", w), param.to(self.compute_dtype))

    def _update_with_kernel(self, layer: int, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                            grad: torch.Tensor, coef: torch.Tensor | None, step: int) -> None:
        from mtc.kernels.adamw import adamw_step_  # Triton: only imported when this option is used

        cfg, dev = self.cfg, self.kernel_device
        p, m, v, g = (t.to(dev) for t in (param, exp_avg, exp_avg_sq, grad))
        copy = torch.empty(p.shape, dtype=self.compute_dtype, device=dev) if self.compute_dtype is not None else None
        adamw_step_(p, g, m, v, lr=self._lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    step=step, decay_numel=self._decay[layer], grad_scale=float(coef) if coef is not None else 1.0,
                    compute_copy=copy)
        w = self._wgen
        for kind, t in (("master", p), ("m", m), ("v", v)) + ((("compute", copy),) if copy is not None else ()):
            self.store.write(state_array_name(layer, kind, w), t.cpu())

    def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=True)
