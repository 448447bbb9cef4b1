"""Sampling text from a trained run: committed weights streamed one unit at a time, with a KV cache.

`generate_from_store` reads the run's plan and a committed step (`mtc.weight_sources`), builds the
model on the meta device (`mtc.decoders.Decoder`) and decodes: each token runs embed, every block
and the head, each unit's weights fetched from the store (kept resident on the device while they
fit its budget, as a small model's all do; beyond it they are read again for every token, the next
unit's read overlapping the current unit's compute). With the KV cache (`mtc.kv_cache`) the prompt
is run once and each new token costs one position per layer; the window holds the prompt and the
continuation (at least the run's training ``seq_len``, at most the model's ``max_seq_len``) unless
``context`` says otherwise; when it fills, the cache restarts from the last half of it. `generate` is the plain version over a resident `nn.Module` (no cache, the reference).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtc.decoders import Decoder
from mtc.errors import ConfigError, DataError
from mtc.kv_cache import KVCache

__all__ = ["END_OF_TURN", "GenerationResult", "check_sampling", "generate", "generate_from_store", "resolve_tokenizer", "sample_next", "stop_ids",
           "stream_generate"]


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    """One token from 1-D ``logits``: argmax when ``temperature <= 0``, else top-k sampling at that temperature."""
    logits = logits.float().cpu()
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    context: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> list[int]:
    """Continue ``prompt`` by ``max_new_tokens`` tokens with a resident model, re-running the window
    each token (the windows of `stream_generate`: a full one restarts from its last half)."""
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = [int(t) for t in prompt]
    was_training = model.training
    model.eval()
    start = max(0, len(ids) - context)
    for _ in range(max_new_tokens):
        if len(ids) - start > context:
            start = len(ids) - max(1, context // 2)
        x = torch.tensor([ids[start:]], dtype=torch.long, device=device)
        out = model(x)
        ids.append(sample_next(getattr(out, "logits", out)[0, -1], temperature=temperature, top_k=top_k, gen=gen))
    model.train(was_training)
    return ids[len(prompt):]


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationResult:
    """New tokens and how fast they came."""

    tokens: list[int]
    prompt_tokens: int
    prefill_s: float  # the prompt's forward and the first token
    decode_s: float  # every later token
    kv_cache: bool
    step: int = -1  # the committed step sampled from (-1: not from a store)
    text: str = ""
    stopped_at_eos: bool = False
    resident_layers: int = 0  # state layers kept on the device
    streamed_layers: int = 0  # state layers read again for every token
    prompt_dropped: int = 0  # the prompt's first tokens that did not fit the context
    context: int = 0  # the window attended to (a longer generation slides it: see `stream_generate`)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second, prompt included in the time."""
        return len(self.tokens) / max(self.prefill_s + self.decode_s, 1e-12)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first (the steady decoding rate)."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else float("nan")


def _forward(dec: Decoder, weights: Any, ids: list[int], pos: int, cache: KVCache | None, device: torch.device) -> torch.Tensor:
    """Logits of the last of ``ids`` (at positions pos ..), every unit's weights fetched as it runs."""
    units: list[tuple[str, int, list[str]]] = [("embed", -1, dec.embed_keys())]
    units += [("block", j, dec.block_keys(j)) for j in range(dec.n_blocks)] + [("head", -1, dec.head_keys())]
    x = torch.tensor([ids], dtype=torch.long, device=device)
    for k, (kind, j, keys) in enumerate(units):
        w = weights.get(keys)
        weights.prefetch(units[(k + 1) % len(units)][2])  # the head's successor: the next token's embed
        if kind == "embed":
            x = dec.embed(w, x, pos)
        elif kind == "block":
            if cache is None:
                x = dec.block(j, w, x, pos)
            else:
                with cache.attending(j, pos):
                    x = dec.block(j, w, x, pos)
        else:
            return dec.head(w, x[:, -1:])[0, -1]
    raise AssertionError("the head is the last unit")


# end-of-turn markers of common chat templates (ChatML, Llama 3, Gemma, Phi-3): a model fine-tuned on
# conversations ends its reply with one, which need not be its tokenizer's EOS
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def stop_ids(tok: Any, stop: Sequence[str] = ()) -> frozenset[int]:
    """Token ids at which sampling stops: the tokenizer's EOS, the end-of-turn markers it has as
    single tokens, and ``stop`` (each must be one token of ``tok``; ConfigError otherwise)."""
    out = {int(tok.eos_id)} if getattr(tok, "eos_id", None) is not None else set()
    for m in END_OF_TURN:
        ids = tok.encode(m, special=False)
        if len(ids) == 1:
            out.add(int(ids[0]))
    for text in stop:
        ids = tok.encode(text, special=False)
        if len(ids) != 1:
            raise ConfigError(f"--stop {text!r} is {len(ids)} tokens of the run's tokenizer, not one; name a single "
                              "token (e.g. a special token such as <|im_end|>)")
        out.add(int(ids[0]))
    return frozenset(out)


@torch.no_grad()
def stream_generate(dec: Decoder, weights: Any, prompt: list[int], *, max_new_tokens: int, context: int,
                    device: torch.device | str = "cpu", temperature: float = 0.8, top_k: int | None = 40, seed: int = 0,
                    kv_cache: bool = True, eos_id: int | None = None, stop: frozenset[int] = frozenset()) -> GenerationResult:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (fewer if ``eos_id`` or a token of
    ``stop`` comes; it is not kept), weights from ``weights``.

    The model attends to a window of at most ``context`` tokens, at positions from 0. When the
    window is full it restarts from its last ``context // 2`` tokens (the KV cache is refilled
    from them), with and without the cache alike, so the uncached path checks the cached one."""
    stop = stop | ({eos_id} if eos_id is not None else set())
    if not prompt:
        raise ConfigError("the prompt encodes to no tokens; give some text")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not 1 <= context <= dec.cfg.max_seq_len:
        raise ConfigError(f"--context must be in 1..{dec.cfg.max_seq_len} (the model's max_seq_len), got {context}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    ids = [int(t) for t in prompt]
    new: list[int] = []
    cache = KVCache(dec.n_blocks, context) if kv_cache else None
    start = max(0, len(ids) - context)  # the window is ids[start:]
    dropped = start
    t0 = time.perf_counter()
    t_first = t0
    eos = False
    for n in range(max_new_tokens):
        refill = len(ids) - start > context
        if refill:  # the window is full: restart it from its last half
            start = len(ids) - max(1, context // 2)
        if cache is None:
            logits = _forward(dec, weights, ids[start:], 0, None, device)
        elif n == 0 or refill:  # (re)fill the cache from the window
            cache = KVCache(dec.n_blocks, context)
            logits = _forward(dec, weights, ids[start:], 0, cache, device)
        else:
            logits = _forward(dec, weights, ids[-1:], len(ids) - 1 - start, cache, device)
        tok = sample_next(logits, temperature=temperature, top_k=top_k, gen=gen)
        if n == 0:
            t_first = time.perf_counter()
        if tok in stop:
            eos = True
            break
        ids.append(tok)
        new.append(tok)
    t1 = time.perf_counter()
    return GenerationResult(tokens=new, prompt_tokens=len(prompt), prefill_s=t_first - t0, decode_s=t1 - t_first,
                            kv_cache=kv_cache, stopped_at_eos=eos, prompt_dropped=dropped, context=context)


def check_sampling(*, temperature: float, top_k: int | None, context: int | None = None,
                   device_budget_bytes: int | None = None) -> None:
    """ConfigError for sampling settings that mean nothing (a NaN temperature made torch's
    multinomial raise mid-run; a context of 0 was taken as the default)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"--top-k must be >= 1, or 0 for the whole vocabulary; got {top_k}")
    if context is not None and context < 1:
        raise ConfigError(f"--context must be >= 1 token (omit it for the prompt and the continuation), got {context}")
    if device_budget_bytes is not None and device_budget_bytes < 0:
        raise ConfigError(f"--weights-budget-gb must be >= 0 (0: stream every layer), got {device_budget_bytes / 2**30:g}")


def _checkpoint_eos(store_dir: str | Path, vocab: int) -> frozenset[int]:
    """The EOS ids an imported checkpoint names (``RUN/hf/generation_config.json``, else its
    config.json): instruction-tuned models list several (Llama 3's <|eot_id|> and <|end_of_text|>),
    and transformers stops at any of them."""
    for name in ("generation_config.json", "config.json"):
        f = Path(store_dir) / "hf" / name
        if not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            return frozenset()
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(i) for i in ids if isinstance(i, int) and 0 <= i < vocab)
    return frozenset()


def resolve_tokenizer(store_dir: str | Path, data_identity: dict | None, flag: str | None, vocab_size: int) -> Any:
    """The run's tokenizer: ``--tokenizer`` when given, else ``RUN/tokenizer/``, else the one recorded
    with the run's data (its ``<stem>.tokenizer/`` directory or its name), else bytes for a 256-token vocabulary."""
    from mtc.data import get_tokenizer
    from mtc.data.tokens import check_tokenizer_beside

    spec: str | None = flag
    if spec is None and (Path(store_dir) / "tokenizer").is_dir():
        spec = str(Path(store_dir) / "tokenizer")
    if spec is None and data_identity:
        beside = Path(data_identity.get("path", "")).with_suffix(".tokenizer")
        name = (data_identity.get("header") or {}).get("tokenizer")
        if data_identity.get("path") and beside.is_dir():
            check_tokenizer_beside(beside, data_identity)  # not one the data was prepared again with since
            spec = str(beside)
        else:
            spec = name
    if spec is None and vocab_size == 256:
        spec = "byte"
    if spec is None:
        raise DataError(f"run {store_dir} records no tokenizer and its vocabulary ({vocab_size}) is not bytes; "
                        "pass --tokenizer (a tokenizer.json or a Hugging Face tokenizer directory)")
    tok = get_tokenizer(spec)
    if tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer {spec} has {tok.vocab_size} tokens, the model's vocabulary {vocab_size}; "
                        "pass the tokenizer the run was prepared with (--tokenizer)")
    return tok


def generate_from_store(store_dir: str | Path, prompt: str, *, step: int | None = None, max_new_tokens: int = 200,
                        temperature: float = 0.8, top_k: int | None = 40, seed: int = 0, context: int | None = None,
                        kv_cache: bool = True, tokenizer: str | None = None, device: str | None = None,
                        device_budget_bytes: int | None = None, stop: Sequence[str] = ()) -> GenerationResult:
    """Sample a continuation of ``prompt`` from committed step ``step`` (default: the last) of a run,
    until ``max_new_tokens``, or a token of `stop_ids` (EOS, an end-of-turn marker, ``stop``)."""
    from mtc.config import check_device_name
    from mtc.evaluate import _compute_dtype, _default_device

    check_sampling(temperature=temperature, top_k=top_k, context=context, device_budget_bytes=device_budget_bytes)
    if device is not None:
        check_device_name(device)
    from mtc.models import build, model_names
    from mtc.plan import load_plan
    from mtc.weight_sources import StoreWeights, check_untouched, default_budgets, open_run_store, pick_step

    with open_run_store(store_dir) as st:
        at = pick_step(st, step)
        cfg = at.record.config
        if cfg["model"] not in model_names():
            # a user's module (traced from Python, or a factory): the decoder rebuilds the built-in
            # families only, and only the user's code knows what the module computes
            raise ConfigError(
                f"run {store_dir} was trained from a user's model ({cfg['model']!r}), which `mtc generate` cannot rebuild "
                "(it builds the built-in model families only); load the weights into your module with "
                f"`model.load_state_dict(mtc.load_state_dict({str(store_dir)!r}))` and sample with it, e.g. "
                "`mtc.generate.generate(model, prompt_ids, max_new_tokens=..., context=...)`"
            )
        program = load_plan(Path(store_dir) / "plan")
        with torch.device("meta"):
            model = build(cfg["model"], **(cfg.get("model_overrides") or {}))
        dec = Decoder(model)
        missing = [k for j in range(dec.n_blocks) for k in dec.block_keys(j) if k not in program.params]
        missing += [k for k in dec.embed_keys() + dec.head_keys() if k not in program.params]
        if missing:
            raise ConfigError(f"the plan of run {store_dir} has no parameter {missing[0]} of preset {cfg['model']!r}; "
                              "generation needs a run of a built-in model family")
        vocab = dec.cfg.vocab_size
        tok = resolve_tokenizer(store_dir, at.record.meta.get("data"), tokenizer, vocab)
        ids = [int(i) for i in tok.encode(prompt)]
        stops = stop_ids(tok, stop) | _checkpoint_eos(store_dir, vocab)  # (a bad --stop is refused before any weight is read)
        dev = torch.device(device if device is not None else _default_device(cfg.get("device", "cpu")))
        dtype = getattr(torch, _compute_dtype(cfg, dev))
        # the whole prompt and continuation when the model takes them (no window to slide), else its longest
        ctx = context if context is not None else min(dec.cfg.max_seq_len, max(cfg.get("seq_len", 1), len(ids) + max_new_tokens))
        dev_budget, host_budget = default_budgets(dev)
        if dev.type == "cuda":
            # beside the resident weights: the KV cache (every block's keys and values for the whole
            # context, query heads wide: the block repeats grouped KV heads before attention) and the
            # two streamed layers a decoding step can hold at once
            kv = dec.n_blocks * 2 * dec.cfg.dim * ctx * dtype.itemsize if kv_cache else 0
            largest = max(program.layer_numel(i) for i in range(program.n_layers)) * dtype.itemsize
            dev_budget = max(0, dev_budget - kv - 2 * largest)
        src = StoreWeights(program, st, at.generation, device=dev, dtype=dtype,
                           device_budget_bytes=dev_budget if device_budget_bytes is None else device_budget_bytes,
                           host_budget_bytes=host_budget, record=at.record)
        try:
            res = stream_generate(dec, src, ids, max_new_tokens=max_new_tokens, context=ctx,
                                  device=dev, temperature=temperature, top_k=top_k, seed=seed, kv_cache=kv_cache,
                                  stop=stops)
        finally:
            src.close()
        streamed = sum(1 for i in range(program.n_layers) if program.layer_numel(i)) - len(src.resident_layers)
    # (streamed layers are read again for every token: a trainer overwriting the step meanwhile is caught here)
    check_untouched(store_dir, at.step, at.generation, what=f"sampling from step {at.step} of run {store_dir}")
    # a vocabulary padded beyond the tokenizer's (Qwen2.5 ships so): ids without a token decode to
    # nothing, as the tokenizers library's own decode skips them
    text = tok.decode([t for t in res.tokens if t < tok.vocab_size])
    return dataclasses.replace(res, step=at.step, text=text, resident_layers=len(src.resident_layers),
                               streamed_layers=streamed)

