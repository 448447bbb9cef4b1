"""Tokenizers trained locally with the `tokenizers` library (no downloads), saved as HF directories."""

from __future__ import annotations

import json
from pathlib import Path

SENTENCES = [
    "The fox sat by the lantern and watched the sea.",
    "A small boat left the harbour before the storm.",
    "The kitchen smelled of bread, salt and smoke.",
    "Letters from the village arrived every second week.",
    "Machines in the old mill turned slowly in the wind.",
    "She asked the keeper where the road to the cities began.",
] * 4

# A chat template in the style of ChatML: each turn ends with <|im_end|>, which the model learns.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_dir(root: Path, *, vocab_size: int = 300, config: dict | None = None, name: str = "tok") -> Path:
    """A byte-level BPE tokenizer with <|endoftext|> (EOS) and ChatML tokens, saved to root/name."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>"} if config is None else config
    if cfg:
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def wordlevel_json(root: Path) -> Path:
    """A WordLevel tokenizer.json alone (no directory config), with [EOS] and [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"], show_progress=False))
    p = root / "words.json"
    tok.save(str(p))
    return p
