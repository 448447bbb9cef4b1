"""Plain PyTorch training of the same model, data and AdamW: the other side of the parity contract."""

from __future__ import annotations

import torch

from mtc.config import TrainConfig
from mtc.data import BatchSampler, TokenFile
from mtc.runtime.schedule import lr_at
from mtc.tracer import LossModel
from mtc.train import build_model


def reference_train(cfg: TrainConfig, tokens: TokenFile, model: torch.nn.Module | None = None, *,
                    start_step: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train cfg's model (or ``model``, in place) with torch.optim.AdamW + clip_grad_norm_; return
    per-step losses and weights. ``start_step``: steps from there on, with a new AdamW (a run
    resumed from weights alone: ``model`` holds that step's weights)."""
    model = build_model(cfg) if model is None else model
    lm = LossModel(model)
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    o = cfg.optim
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
    )
    sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    losses, cursor = [], start_step * cfg.grad_accum
    for step in range(start_step, cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, o)
        # the step's loss: sum over its targets that are not ignored / their count in the whole step
        batches = [sampler.batch(cursor + j) for j in range(cfg.grad_accum)]
        cursor += cfg.grad_accum
        counts = [int((tg != -100).sum()) for _, tg in batches]
        total = 0.0
        for (ids, tg), c in zip(batches, counts):
            if c == 0:
                continue
            loss = lm(ids, tg)  # the mean over this micro-batch's c targets
            (loss * (c / sum(counts))).backward()
            total += loss.item() * c
        if o.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / sum(counts))
    return losses, {k: v.detach().clone() for k, v in params.items()}
