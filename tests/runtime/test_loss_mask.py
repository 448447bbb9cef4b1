"""The loss honours the mask: a step's loss is the sum over its unmasked targets / their count in the step."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mtc.data import BatchSampler, write_token_file
from mtc.data.batches import IGNORE_INDEX
from mtc.runtime.state import read_params
from mtc.train import build_model, train
from tests.reference import reference_train
from tests.runtime.engine_util import small_config
from tests.runtime.test_parity import assert_losses_close, assert_weights_close


def _sft_like(path, n: int = 6000, seed: int = 0):
    """Skewed bytes in documents of 20-200 tokens; a random third of each document's targets kept,
    so micro-batches hold different numbers of targets (a mean of means would differ)."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(256, 0.1))
    toks = rng.choice(256, size=n, p=probs)
    ends = np.unique(np.concatenate([np.cumsum(rng.integers(20, 200, size=n // 20)), [n]]))
    ends = ends[ends <= n]
    mask = (rng.random(n) < 0.33).astype(np.uint8)
    return write_token_file(path, toks, vocab_size=256, tokenizer="byte", doc_ends=ends, mask=mask)


def test_masked_loss_is_the_mean_over_response_tokens_of_the_whole_step_and_matches_torch(tmp_path):
    tf = _sft_like(tmp_path / "sft.bin", n=20_000)
    cfg = small_config(steps=3, micro_batch_size=2, seq_len=32, grad_accum=3)
    res = train(cfg, None, tf)
    try:
        got_weights = read_params(res.program, res.store, res.generation)
    finally:
        res.store.close()
    # step 1 by hand: the same initial model, the same batches, cross-entropy of each kept target
    model = build_model(cfg)
    sampler = BatchSampler(tf, batch_size=2, seq_len=32, seed=cfg.seed)
    per_mb_sum, per_mb_n = [], []
    with torch.no_grad():
        for cursor in range(3):
            ids, tg = sampler.batch(cursor)
            logits = model(ids).float().reshape(-1, 256)
            flat = tg.reshape(-1)
            keep = flat != IGNORE_INDEX
            per_mb_sum.append(F.cross_entropy(logits[keep], flat[keep], reduction="sum").item())
            per_mb_n.append(int(keep.sum()))
    want = sum(per_mb_sum) / sum(per_mb_n)
    assert abs(res.losses[0] - want) <= 1e-5 * want, (res.losses[0], want)
    mean_of_means = float(np.mean([s / n for s, n in zip(per_mb_sum, per_mb_n, strict=True)]))
    # the test tells the two apart: they differ by ten times the tolerance or more
    assert len(set(per_mb_n)) > 1 and abs(mean_of_means - want) > 1e-4 * want
    assert sum(per_mb_n) < 0.5 * 3 * 2 * 32  # the mask removed about two thirds of the targets
    # the fp32 contract on masked data: plain PyTorch with the same normalisation, step for step
    ref_losses, ref_weights = reference_train(cfg, tf)
    assert_losses_close(res.losses, ref_losses)
    assert_weights_close(got_weights, ref_weights)


class _DictWeights:
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def prefetch(self, keys: list[str]) -> None:
        pass

    def get(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: self.params[k] for k in keys}


def test_eval_loss_on_masked_data_is_the_sum_over_targets_over_their_count(tmp_path):
    from mtc.evaluate import eval_batches, forward_loss, unfused_runners

    tf = _sft_like(tmp_path / "sft.bin", n=20_000)
    cfg = small_config(steps=1, micro_batch_size=2, seq_len=32)
    res = train(cfg, None, tf)
    try:
        weights = read_params(res.program, res.store, res.generation)
    finally:
        res.store.close()
    batches = eval_batches(tf, res.program, n=4, seed=3)
    got = forward_loss(res.program, unfused_runners(res.program), _DictWeights(weights), batches, "cpu")
    model = build_model(cfg)
    model.load_state_dict(weights)
    s, n, means = 0.0, 0, []
    with torch.no_grad():
        for ids, tg in batches:
            flat = tg.reshape(-1)
            keep = flat != IGNORE_INDEX
            loss = F.cross_entropy(model(ids).float().reshape(-1, 256)[keep], flat[keep], reduction="sum").item()
            s, n = s + loss, n + int(keep.sum())
            means.append(loss / int(keep.sum()))
    assert abs(got - s / n) <= 1e-5 * (s / n), (got, s / n)
    assert abs(float(np.mean(means)) - s / n) > 1e-4 * (s / n)  # a mean of batch means would fail


def test_eval_reports_the_targets_it_counted_beside_the_positions(tmp_path):
    from mtc.evaluate import eval_batches, evaluate_store
    from mtc.plan import load_plan

    tf = _sft_like(tmp_path / "sft.bin", n=20_000)
    cfg = small_config(steps=1, micro_batch_size=2, seq_len=32)
    train(cfg, tmp_path / "s", tf).close()
    r = evaluate_store(tmp_path / "s", tf, batches=4, seed=3)
    batches = eval_batches(tf, load_plan(tmp_path / "s" / "plan"), n=4, seed=3)
    assert r.tokens == 4 * 2 * 32 and r.targets == sum(int((t != IGNORE_INDEX).sum()) for _, t in batches) < r.tokens
