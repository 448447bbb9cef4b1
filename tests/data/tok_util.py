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


# Llama 3's pre-tokenizer pattern: digits in threes, a punctuation mark joined to the word after it.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
STYLES = ("gpt2", "llama3", "llama2", "t5")


def styled_dir(root: Path, style: str, texts: list[str], *, vocab_size: int = 600) -> Path:
    """A tokenizer made up as one of the common families is, trained on ``texts``, saved to
    root/style: "gpt2" (byte-level BPE, GPT-2's pre-tokenizer), "llama3" (byte-level BPE after
    Llama 3's split pattern, BOS first), "llama2" (sentencepiece BPE as converted to tokenizer.json:
    no pre-tokenizer, spaces as U+2581, byte fallback, BOS first) or "t5" (Unigram, Metaspace, a
    closing </s> from the post-processor)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    byte_level = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet(), "show_progress": False}
    if style == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                           **byte_level))
        cfg = {"eos_token": "<|endoftext|>"}
    elif style == "llama3":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], **byte_level))
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 0)])
        cfg = {"eos_token": "<|end_of_text|>", "bos_token": "<|begin_of_text|>"}
    elif style == "llama2":
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size + 256, special_tokens=special,
                                                           show_progress=False))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        cfg = {"eos_token": "</s>", "bos_token": "<s>"}
    elif style == "t5":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        tok.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=vocab_size, unk_token="<unk>",
                                                               special_tokens=["<pad>", "</s>", "<unk>"],
                                                               show_progress=False))
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        cfg = {"eos_token": "</s>"}
    else:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    d = root / style
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d
