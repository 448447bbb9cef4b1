"""SFT data: prompt/response and chat records get a loss mask over the assistant's replies only."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtc.data import BatchSampler, ByteTokenizer, get_tokenizer, prepare
from mtc.data.chat import encode_conversation
from mtc.errors import BadRecordError, DataError
from tests.data.tok_util import CHATML, bpe_dir

PAIRS = [("What is at the harbour?", "A small boat."), ("Name a season.", "Winter, with its long nights."),
         ("Who keeps the lantern?", "The old keeper.")]


def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_prompt_response_with_the_simple_template_byte(tmp_path):
    src = _jsonl(tmp_path / "sft.jsonl", [{"q": p, "a": r} for p, r in PAIRS])
    tf = prepare(src, tmp_path / "sft.bin", prompt_field="q", response_field="a")
    assert tf.header.mask["n_targets"] == int(tf.mask.sum()) and tf.header.docs["n_docs"] == len(PAIRS)
    tok = ByteTokenizer()
    b = tf.docs.tolist()
    for i, (p, r) in enumerate(PAIRS):
        ids, m = np.asarray(tf.tokens[b[i]:b[i + 1]]), np.asarray(tf.mask[b[i]:b[i + 1]])
        assert tok.decode(ids) == f"<|user|>\n{p}\n<|assistant|>\n{r}\n"  # the documented template
        assert tok.decode(ids[m == 1]) == r + "\n"  # the reply and its terminator, nothing else
        assert m[: len(ids) - len(r) - 1].sum() == 0


def test_chat_template_marks_every_assistant_turn(tmp_path):
    pytest.importorskip("jinja2")
    d = bpe_dir(tmp_path, config={"eos_token": "<|endoftext|>", "chat_template": CHATML})
    tok = get_tokenizer(str(d))
    assert tok.chat_template == CHATML
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the fox?"},
            {"role": "assistant", "content": "By the lantern."}, {"role": "user", "content": "And the boat?"},
            {"role": "assistant", "content": "In the harbour."}]
    ids, mask = encode_conversation(conv, tok)
    raw = tok._tok.decode(ids.tolist(), skip_special_tokens=False)
    assert raw == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)
    # the targets: each reply with its end-of-turn marker and newline (what the template adds for it)
    runs = np.split(np.flatnonzero(mask), np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    got = [tok._tok.decode(ids[r].tolist(), skip_special_tokens=False) for r in runs]
    assert got == ["By the lantern.<|im_end|>\n", "In the harbour.<|im_end|>\n"]


def test_chat_templates_get_what_transformers_gives_them(tmp_path):
    """strftime_now (Llama 3.x dates its system prompt) and a tojson that does not HTML-escape."""
    pytest.importorskip("jinja2")
    import datetime

    from mtc.data.chat import _Renderer

    tmpl = "{{ strftime_now('%Y') }}|{% for m in messages %}{{ m | tojson }}{% endfor %}"
    tok = get_tokenizer("byte")
    msgs = [{"role": "user", "content": "a <b> & 'c'"}]
    out = _Renderer(tmpl, tok)(msgs, False)
    assert out == f"{datetime.datetime.now().year}|" + json.dumps(msgs[0], ensure_ascii=False)


def test_chat_template_from_chat_template_jinja_and_parquet_messages(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("jinja2")
    import pyarrow.parquet as pq

    d = bpe_dir(tmp_path)
    (d / "chat_template.jinja").write_text(CHATML)  # where transformers 5 saves it
    recs = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]} for p, r in PAIRS]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "chat.parquet")
    tf = prepare(tmp_path / "chat.parquet", tmp_path / "chat.bin", tokenizer=str(d), messages_field="messages")
    assert "chat_template.jinja" in {p.name for p in tf.tokenizer_dir.iterdir()}
    tok = get_tokenizer(str(d))
    b = tf.docs.tolist()
    for i, (_, r) in enumerate(PAIRS):
        ids, m = np.asarray(tf.tokens[b[i]:b[i + 1]]), np.asarray(tf.mask[b[i]:b[i + 1]])
        assert tok._tok.decode(ids[m == 1].tolist(), skip_special_tokens=False) == r + "<|im_end|>\n"


def test_simple_template_with_a_real_tokenizer_ends_replies_with_eos(tmp_path):
    d = bpe_dir(tmp_path)
    src = _jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]}
                                        for p, r in PAIRS])
    tf = prepare(src, tmp_path / "c.bin", tokenizer=str(d), messages_field="messages")
    tok = get_tokenizer(str(d))
    ids, m = np.asarray(tf.tokens), np.asarray(tf.mask)
    ends = tf.docs[1:] - 1
    assert (ids[ends] == tok.eos_id).all() and (m[ends] == 1).all()  # the model learns to stop
    assert tok.decode(ids[: ends[0] + 1][m[: ends[0] + 1] == 1]) == PAIRS[0][1]


def test_batches_ignore_the_prompt(tmp_path):
    src = _jsonl(tmp_path / "sft.jsonl", [{"q": p * 3, "a": r} for p, r in PAIRS] * 5)
    tf = prepare(src, tmp_path / "sft.bin", prompt_field="q", response_field="a")
    s = BatchSampler(tf, batch_size=8, seq_len=32, seed=0)
    mask = np.asarray(tf.mask)
    for cursor in range(5):
        x, y = s.batch(cursor)
        for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
            assert (row_y != -100).any()  # windows of prompt only are redrawn
            # find the row in the file (a window starts k * seq_len into its document; byte padding is 0)
            k = int((row_x != 0).sum())
            starts = [b + j for b, e in zip(tf.docs[:-1], tf.docs[1:], strict=True) for j in range(0, e - b - 1, 32)]
            start = next(i for i in starts if np.array_equal(tf.tokens[i:i + k], row_x[:k]))
            n = min(32, int(tf.docs[np.searchsorted(tf.docs, start, side="right")]) - 1 - start)
            assert n == k
            want = np.where(mask[start + 1:start + 1 + n] == 1, tf.tokens[start + 1:start + 1 + n].astype(np.int64), -100)
            assert np.array_equal(row_y[:n], want) and (row_y[n:] == -100).all()


def test_sft_bad_records_are_skipped_when_asked(tmp_path):
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    src = _jsonl(tmp_path / "s.jsonl", [{"messages": good}, {"messages": [good[0]]}, {"messages": None},
                                        {"messages": good}])
    with pytest.raises(BadRecordError, match=r"s.jsonl:2: no 'assistant' message"):
        prepare(src, tmp_path / "o.bin", messages_field="messages")
    tf = prepare(src, tmp_path / "o.bin", messages_field="messages", skip_bad_records=True)
    assert tf.header.docs["n_docs"] == 2 and tf.header.source["skipped"] == 2
    assert "must be a non-empty list of {role, content} messages, not null" in tf.header.source["skipped_examples"][1]
    pr = _jsonl(tmp_path / "p.jsonl", [{"q": "a", "r": None}, {"q": "b", "r": "c"}, {"r": "d"}])
    tf = prepare(pr, tmp_path / "p.bin", prompt_field="q", response_field="r", skip_bad_records=True)
    assert tf.header.docs["n_docs"] == 1 and tf.header.source["skipped"] == 2
    assert "name the text field with --prompt-field" in str(
        pytest.raises(BadRecordError, prepare, _jsonl(tmp_path / "x.jsonl", [{"r": "d"}]), tmp_path / "x.bin",
                      prompt_field="q", response_field="r").value)


def test_sft_errors(tmp_path):
    src = _jsonl(tmp_path / "s.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match="no 'assistant' message"):
        prepare(src, tmp_path / "o.bin", messages_field="messages")
    src = _jsonl(tmp_path / "t.jsonl", [{"messages": "hello"}])
    with pytest.raises(DataError, match="must be a non-empty list"):
        prepare(src, tmp_path / "o.bin", messages_field="messages")
    with pytest.raises(DataError, match="needs --prompt-field and --response-field"):
        prepare(src, tmp_path / "o.bin", prompt_field="q")
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(DataError, match="must be JSONL or parquet"):
        prepare(tmp_path / "a.txt", tmp_path / "o.bin", prompt_field="q", response_field="a")
    pytest.importorskip("jinja2")
    d = bpe_dir(tmp_path, config={"eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}"})
    with pytest.raises(DataError, match="chat template .* does not compile"):
        prepare(_jsonl(tmp_path / "u.jsonl", [{"q": "a", "a": "b"}]), tmp_path / "o.bin", tokenizer=str(d),
                prompt_field="q", response_field="a")


def test_rewriting_a_token_file_drops_its_old_sidecars(tmp_path):
    src = _jsonl(tmp_path / "sft.jsonl", [{"q": p, "a": r} for p, r in PAIRS])
    prepare(src, tmp_path / "x.bin", prompt_field="q", response_field="a")
    assert (tmp_path / "x.mask").is_file()
    tf = prepare(src, tmp_path / "x.bin", field="a")  # the same path, now plain text: no mask
    assert tf.mask is None and not (tmp_path / "x.mask").exists()


def test_a_conversation_the_template_rewrites_is_named_and_can_be_skipped(tmp_path):
    """A template that rewrites earlier turns (drops their reasoning, as Qwen3's does) cannot have its
    replies located in a multi-turn chat: that record is named, and --skip-bad-records skips it."""
    pytest.importorskip("jinja2")
    t = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
         "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
         "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    d = bpe_dir(tmp_path, config={"eos_token": "<|im_end|>", "chat_template": t})
    one = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    two = [one[0], {"role": "assistant", "content": "<think>x</think>b"}, {"role": "user", "content": "c"},
           {"role": "assistant", "content": "d"}]
    src = _jsonl(tmp_path / "s.jsonl", [{"messages": one}, {"messages": two}])
    with pytest.raises(BadRecordError, match=r"s.jsonl:2: the chat template renders this conversation differently"):
        prepare(src, tmp_path / "o.bin", tokenizer=str(d), messages_field="messages")
    tf = prepare(src, tmp_path / "o.bin", tokenizer=str(d), messages_field="messages", skip_bad_records=True)
    assert tf.header.docs["n_docs"] == 1 and tf.header.source["skipped"] == 1


def test_the_simple_template_starts_with_the_tokenizers_bos_as_pretraining_documents_do(tmp_path):
    """A tokenizer whose post-processor puts BOS before a text (Llama's): an SFT conversation
    rendered by mtc's simple template starts with it (not a target), as every pretraining document does."""
    from tokenizers import Tokenizer, processors

    d = bpe_dir(tmp_path)
    t = Tokenizer.from_file(str(d / "tokenizer.json"))
    t.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    t.save(str(d / "tokenizer.json"))
    src = _jsonl(tmp_path / "sft.jsonl", [{"q": p, "a": r} for p, r in PAIRS])
    tf = prepare(src, tmp_path / "sft.bin", tokenizer=str(d), prompt_field="q", response_field="a")
    pre = prepare(_jsonl(tmp_path / "pt.jsonl", [{"text": p} for p, _ in PAIRS]), tmp_path / "pt.bin", tokenizer=str(d))
    tok = get_tokenizer(str(d))
    for i, (p, r) in enumerate(PAIRS):
        lo, hi = int(tf.docs[i]), int(tf.docs[i + 1])
        ids, m = np.asarray(tf.tokens[lo:hi]), np.asarray(tf.mask[lo:hi])
        assert ids[0] == 1 == pre.tokens[int(pre.docs[i])] and m[0] == 0
        assert np.array_equal(ids[1:], tok.encode(f"<|user|>\n{p}\n<|assistant|>\n{r}<|endoftext|>", special=False))
        assert tok.decode(ids[m == 1]) == r


def test_rewriting_a_token_file_with_the_byte_tokenizer_drops_its_old_tokenizer_copy(tmp_path):
    d = bpe_dir(tmp_path)
    src = _jsonl(tmp_path / "a.jsonl", [{"text": p} for p, _ in PAIRS])
    assert prepare(src, tmp_path / "x.bin", tokenizer=str(d)).tokenizer_dir == tmp_path / "x.tokenizer"
    tf = prepare(src, tmp_path / "x.bin")  # the same path, now byte-level: no tokenizer files beside it
    assert tf.tokenizer_dir is None and not (tmp_path / "x.tokenizer").exists()
    (tmp_path / "y.tokenizer").mkdir()  # a directory no header of ours named is left alone
    prepare(src, tmp_path / "y.bin")
    prepare(src, tmp_path / "y.bin")
    assert (tmp_path / "y.tokenizer").is_dir()
