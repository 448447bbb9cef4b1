"""SFT conversations to tokens and a loss mask: only the assistant's replies are trained on.

With a tokenizer that has a chat template (tokenizer_config.json's ``chat_template`` or
``chat_template.jinja``), the conversation is rendered by it (Jinja, sandboxed, as transformers
renders it) and tokenized once; a token is a target when its first character lies in an assistant
reply. A reply's span is found by rendering the conversation up to the message before it with
``add_generation_prompt=True`` (the prefix) and up to the reply itself: the reply is what the
second adds, including the template's end-of-turn marker, which the model must learn to emit.

Without a chat template, mtc's simple template (documented in the README) is used::

    <|user|>\\n{content}\\n<|assistant|>\\n{content}<EOS>

one ``<|role|>`` line before each message's content; an assistant reply ends with the EOS token
(byte tokenizer: a newline) and is a target, everything else is not.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import numpy as np

from mtc.data.sources import Message
from mtc.data.tokenizer import Tokenizer, special_affixes
from mtc.errors import BadRecordError, DataError

__all__ = ["encode_conversation", "simple_template"]


def simple_template(messages: list[Message], eos: str) -> tuple[str, list[tuple[int, int]]]:
    """mtc's template: (text, character spans of the assistant replies with their terminator)."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    n = 0
    for m in messages:
        head = f"<|{m['role']}|>\n"
        parts.append(head)
        n += len(head)
        if m["role"] == "assistant":
            body = m["content"] + eos
            spans.append((n, n + len(body)))
        else:
            body = m["content"] + "\n"
        parts.append(body)
        n += len(body)
    return "".join(parts), spans


class _Renderer:
    """A compiled chat template (jinja2 is imported only when a tokenizer has one)."""

    def __init__(self, template: str, tok: Any) -> None:
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise DataError("this tokenizer's chat template needs jinja2 to render: pip install jinja2") from None

        def raise_exception(msg: str) -> None:
            raise TemplateError(msg)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            # plain JSON, as the templates expect (jinja2's own filter HTML-escapes <, >, & and ')
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        # what transformers' apply_chat_template gives templates besides (Llama 3.x dates its system prompt)
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        self._error = TemplateError
        try:
            self._t = env.from_string(template)
        except TemplateError as e:
            raise DataError(f"the chat template of tokenizer {tok.name!r} does not compile ({e})") from None
        self._vars = {"bos_token": getattr(tok, "bos_token", None) or "", "eos_token": getattr(tok, "eos_token", None) or ""}

    def __call__(self, messages: list[Message], gen_prompt: bool) -> str:
        try:
            return self._t.render(messages=messages, add_generation_prompt=gen_prompt, **self._vars)
        except self._error as e:
            raise BadRecordError(f"the chat template refused the conversation ({e})", "fix the record") from None


def _template_spans(messages: list[Message], render: _Renderer) -> tuple[str, list[tuple[int, int]]]:
    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], True), render(messages[: i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            # a conversation's fault as much as the template's (one that drops earlier turns'
            # reasoning renders single-turn chats fine): name the record, and let it be skipped
            raise BadRecordError(f"the chat template renders this conversation differently from its prefixes "
                                 f"(e.g. it rewrites earlier turns), so assistant message {i} cannot be located",
                                 "keep such conversations to one assistant turn, or fix the template")
        spans.append((len(before), len(upto)))
    return text, spans


def encode_conversation(messages: list[Message], tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation: mask[j] is 1 where token j is a training target."""
    template = tok.chat_template
    if template is not None:
        r = getattr(tok, "_chat_renderer", None)
        if r is None:  # compiled once per tokenizer object
            r = _Renderer(template, tok)
            tok._chat_renderer = r  # type: ignore[attr-defined]
        text, spans = _template_spans(messages, r)
    else:
        eos = "\n" if tok.eos_id is None else (tok.token(tok.eos_id) or "")
        text, spans = simple_template(messages, eos)
    if hasattr(tok, "encode_offsets"):
        ids, starts = tok.encode_offsets(text)  # type: ignore[attr-defined]
    else:  # byte tokenizer: token j is byte j; map bytes to the character each belongs to
        ids = tok.encode(text)
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        starts = np.cumsum((raw & 0xC0) != 0x80) - 1  # continuation bytes belong to the previous character
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    if not mask.any():
        raise BadRecordError("the conversation has no assistant tokens after tokenization",
                             "check the record and the template")
    ids = np.asarray(ids, dtype=np.int64)
    if template is None:
        # a chat template writes the BOS token itself; mtc's simple template starts the way every
        # pretraining document does, with the tokenizer's leading special tokens (Llama's BOS)
        pre, _ = special_affixes(tok)
        ids, mask = np.concatenate([pre.astype(np.int64), ids]), np.concatenate([np.zeros(len(pre), np.uint8), mask])
    return ids, mask
