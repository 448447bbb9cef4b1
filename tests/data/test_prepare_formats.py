"""Real tokenizers (trained here with `tokenizers`) and the text / JSONL / parquet inputs of `prepare`."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from mtc.data import ByteTokenizer, HFTokenizer, TokenFile, get_tokenizer, ingest, prepare, sources
from mtc.errors import BadRecordError, DataError
from tests.data.tok_util import SENTENCES, bpe_dir, wordlevel_json

DOCS = ["The fox sat by the lantern.\nIt watched the sea.", "A small boat left the harbour.", "Caf\u00e9 letters \U0001f600 arrived."]


def _doc_ids(tf: TokenFile) -> list[np.ndarray]:
    b = tf.docs.tolist()
    return [np.asarray(tf.tokens[b[i]:b[i + 1]]) for i in range(len(b) - 1)]


def test_hf_tokenizer_directory(tmp_path):
    d = bpe_dir(tmp_path)
    tok = get_tokenizer(str(d))
    assert isinstance(tok, HFTokenizer)
    assert tok.name == "tok" and tok.spec == str(d.resolve()) and tok.vocab_size == 300
    assert tok.eos_id == 0 and tok.token(0) == "<|endoftext|>"  # named by tokenizer_config.json
    assert tok.sha256 == hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.chat_template is None
    text = "The fox watched the harbour. Caf\u00e9!"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text  # merges learned: fewer ids than bytes
    # a tokenizer.json given alone reads the same
    same = get_tokenizer(str(d / "tokenizer.json"))
    assert same.sha256 == tok.sha256 and np.array_equal(same.encode(text), ids)


def test_tokenizer_spec_errors(tmp_path):
    with pytest.raises(DataError, match=r"unknown tokenizer 'gpt2'.*not in the local Hugging Face cache.*known tokenizers: byte"):
        get_tokenizer("gpt2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no tokenizer.json"):
        get_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="not a tokenizer the `tokenizers` library can read"):
        get_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(DataError, match="has no EOS token"):
        get_tokenizer("byte", eos_token="</s>")


def test_hub_id_from_the_local_cache_only(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abc"
    snap.parent.mkdir(parents=True)
    bpe_dir(snap.parent, name=snap.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tok = get_tokenizer("acme/tiny")
    assert tok.spec == "acme/tiny" and tok.eos_id == 0


def test_text_round_trips_through_prepare_with_a_trained_tokenizer(tmp_path):
    d = bpe_dir(tmp_path)
    src = tmp_path / "texts"
    src.mkdir()
    for i, t in enumerate(DOCS):
        (src / f"{i}.txt").write_text(t + "\n", encoding="utf-8")
    tf = prepare(src, tmp_path / "out" / "c.bin", tokenizer=str(d))
    tok = get_tokenizer(str(d))
    h = tf.header
    assert (h.tokenizer, h.vocab_size, h.eos_id, h.tokenizer_sha256) == ("tok", 300, 0, tok.sha256)
    assert h.tokenizer_spec == str(d.resolve()) and h.docs["n_docs"] == 3 and h.mask is None
    docs = _doc_ids(tf)
    for ids, text in zip(docs, DOCS, strict=True):
        assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]  # one EOS, ending the document
        assert tok.decode(ids) == text + "\n"
    # the tokenizer's files travel with the token file, byte for byte
    assert tf.tokenizer_dir == tmp_path / "out" / "c.tokenizer"
    assert sorted(p.name for p in tf.tokenizer_dir.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    again = get_tokenizer(str(tf.tokenizer_dir))
    assert again.sha256 == h.tokenizer_sha256
    assert TokenFile.open(tmp_path / "out" / "c").header == h


def test_long_text_is_streamed_in_pieces_with_the_same_tokens(tmp_path, monkeypatch):
    d = bpe_dir(tmp_path)
    text = "\n".join(SENTENCES) + "\n\n" + " ".join(SENTENCES)
    (tmp_path / "a.txt").write_text(text)
    whole = prepare(tmp_path / "a.txt", tmp_path / "whole.bin", tokenizer=str(d))
    monkeypatch.setattr(sources, "_PIECE", 50)  # about 40 pieces, cut after newlines (or mid-line when none)
    pieces = list(sources._text_pieces(tmp_path / "a.txt"))
    assert len(pieces) > 20 and "".join(pieces) == text + "\n"
    part = prepare(tmp_path / "a.txt", tmp_path / "part.bin", tokenizer="byte")
    assert ByteTokenizer().decode(part.tokens) == text + "\n\n"
    monkeypatch.setattr(ingest, "_BATCH_CHARS", 300)  # tokenized in windows, joined where they agree
    monkeypatch.setattr(ingest, "_OVERLAP", 120)
    cut = prepare(tmp_path / "a.txt", tmp_path / "cut.bin", tokenizer=str(d))
    assert cut.header.docs["n_docs"] == 1
    # the same ids as the whole text's, wherever the pieces and windows were cut
    assert np.array_equal(cut.tokens, whole.tokens)


def test_jsonl_and_parquet_records_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d = bpe_dir(tmp_path)
    recs = [{"id": i, "body": t} for i, t in enumerate(DOCS)] + [{"id": 9, "body": ""}]  # empty: no document
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "a.parquet", row_group_size=2)
    j = prepare(tmp_path / "a.jsonl", tmp_path / "j.bin", tokenizer=str(d), field="body")
    p = prepare(tmp_path / "a.parquet", tmp_path / "p.bin", tokenizer=str(d), field="body")
    assert j.header.docs["n_docs"] == p.header.docs["n_docs"] == 3
    assert np.array_equal(j.tokens, p.tokens) and j.header.sha256 == p.header.sha256
    tok = get_tokenizer(str(d))
    assert [tok.decode(x) for x in _doc_ids(j)] == DOCS
    # both at once, in the order given; --format overrides the suffix
    both = prepare([tmp_path / "a.jsonl", tmp_path / "a.parquet"], tmp_path / "b.bin", tokenizer=str(d), field="body")
    assert both.header.docs["n_docs"] == 6 and np.array_equal(both.tokens[: len(j)], j.tokens)
    (tmp_path / "a.data").write_bytes((tmp_path / "a.jsonl").read_bytes())
    assert np.array_equal(prepare(tmp_path / "a.data", tmp_path / "f.bin", tokenizer=str(d), fmt="jsonl",
                                  field="body").tokens, j.tokens)


def test_record_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:2 has no field 'text' \(it has: body\); name the text field with --field"):
        prepare(tmp_path / "a.jsonl", tmp_path / "o.bin")
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"b.jsonl:2 is not a JSON object"):
        prepare(tmp_path / "b.jsonl", tmp_path / "o.bin")
    (tmp_path / "c.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(DataError, match=r"field 'text' is int, not text"):
        prepare(tmp_path / "c.jsonl", tmp_path / "o.bin")
    pytest.importorskip("pyarrow")
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a parquet file"):
        prepare(tmp_path / "d.parquet", tmp_path / "o.bin")
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".o.*"))  # nothing left behind


def test_bad_records_stop_by_default_and_are_skipped_and_counted_when_asked(tmp_path):
    lines = ['{"text": "first"}', '{"text": null}', '{"text": ""}', '{"body": "x"}', '{"text": "cut',
             '\xff{"text": 1}', '{"text": "last"}']
    (tmp_path / "a.jsonl").write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    with pytest.raises(BadRecordError, match=r"a.jsonl:2: field 'text' is null, not text; .*--skip-bad-records"):
        prepare(tmp_path / "a.jsonl", tmp_path / "o.bin")
    assert not list(tmp_path.glob("o.*"))
    tf = prepare(tmp_path / "a.jsonl", tmp_path / "o.bin", skip_bad_records=True)
    assert [ByteTokenizer().decode(x) for x in _doc_ids(tf)] == ["first\n", "last\n"]
    src = tf.header.source
    assert (src["read"], src["empty"], src["skipped"]) == (3, 1, 4)  # "" is read but has no tokens
    assert [e.split(" ", 1)[0].rsplit("/", 1)[1] for e in src["skipped_examples"]] == [
        "a.jsonl:2:", "a.jsonl:4", "a.jsonl:5", "a.jsonl:6"]
    assert "not valid UTF-8" in src["skipped_examples"][3]
    assert TokenFile.open(tmp_path / "o.bin").header.source == src  # through the header on disk
    # a skip that leaves nothing says why there is no text
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n{"text": ""}\n')
    with pytest.raises(DataError, match=r"contains no text \(1 empty documents\); nothing to tokenize; 1 records were "
                       r"skipped as bad, the first: .*b.jsonl:1 has no field 'text'"):
        prepare(tmp_path / "b.jsonl", tmp_path / "o2.bin", skip_bad_records=True)
    # only the first few examples are kept, every skip is counted
    (tmp_path / "c.jsonl").write_text("null\n" * 9 + '{"text": "t"}\n')
    c = prepare(tmp_path / "c.jsonl", tmp_path / "o3.bin", skip_bad_records=True).header.source
    assert c["skipped"] == 9 and len(c["skipped_examples"]) == sources.RecordFaults.KEPT


def test_a_tokenizer_without_a_named_eos_needs_one(tmp_path):
    p = wordlevel_json(tmp_path)
    (tmp_path / "a.txt").write_text("the fox sat by the sea\n")
    with pytest.raises(DataError, match="names no EOS token.*--eos TOKEN"):
        prepare(tmp_path / "a.txt", tmp_path / "o.bin", tokenizer=str(p))
    with pytest.raises(DataError, match="--eos '<nope>' is not a token"):
        prepare(tmp_path / "a.txt", tmp_path / "o.bin", tokenizer=str(p), eos_token="<nope>")
    tf = prepare(tmp_path / "a.txt", tmp_path / "o.bin", tokenizer=str(p), eos_token="[EOS]")
    tok = get_tokenizer(str(p), eos_token="[EOS]")
    assert tf.header.eos_id == tok.eos_id and tf.tokens[-1] == tok.eos_id
    assert tok.decode(tf.tokens) == "the fox sat by the sea"  # WordLevel joins words with spaces
    assert sorted(x.name for x in tf.tokenizer_dir.iterdir()) == ["tokenizer.json"]


@pytest.mark.slow
def test_prepare_streams_a_corpus_larger_than_its_memory_use(tmp_path):
    """64 MB of text (128 MB of uint16 tokens) prepared with peak RSS growing by far less than either."""
    import subprocess
    import sys

    line = ("The fox sat by the lantern and watched the sea; " * 20 + "\n").encode()
    with open(tmp_path / "big.txt", "wb") as f:
        f.writelines(line for _ in range(64 * 2**20 // len(line)))
    code = (
        "import resource, sys\n"
        "from mtc.data import prepare\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "tf = prepare(sys.argv[1], sys.argv[2])\n"
        "print(len(tf), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.txt"), str(tmp_path / "big.bin")],
                         capture_output=True, text=True, check=True).stdout.split()
    n, growth_mib = int(out[0]), int(out[1])
    assert n > 64 * 10**6 and growth_mib < 32, f"peak RSS grew by {growth_mib} MiB while preparing {n:,} tokens"


def test_text_pieces_name_the_files_bad_byte_and_cut_long_lines_before_a_space(tmp_path, monkeypatch):
    import mtc.data.sources as sources

    monkeypatch.setattr(sources, "_PIECE", 1000)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a" * 999 + "\u00e9".encode() + b"b" * 5 + b"\xff")  # past the first piece, after a 2-byte character
    with pytest.raises(DataError, match=r"bad.txt is not valid UTF-8 \(byte 1006: invalid start byte\)"):
        list(sources._text_pieces(bad))
    line = tmp_path / "line.txt"
    words = " ".join(f"word{i}" for i in range(600))  # one ~5,000-character line, no newline
    line.write_text(words)
    pieces = list(sources._text_pieces(line))
    assert "".join(pieces) == words + "\n" and len(pieces) > 2
    assert all(p.startswith(" ") for p in pieces[1:-1]), [p[:8] for p in pieces]  # each cut falls before a space


def test_a_jsonl_line_that_is_not_utf8_is_named_as_such(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(BadRecordError, match=r"d.jsonl:2 is not valid UTF-8 \(byte 13 of the line"):
        prepare(f, tmp_path / "o.bin")


def test_a_record_holding_half_a_surrogate_pair_is_a_bad_record(tmp_path):
    # valid JSON ("\\ud83d" alone: a character cut in two), text no tokenizer can take
    f = tmp_path / "s.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "cut \\ud83d here"}\n')
    with pytest.raises(BadRecordError, match=r"s.jsonl:2: field 'text' is not valid UTF-8 text \(an unpaired surrogate, "
                                             r"U\+D83D, at character 4\); .*--skip-bad-records"):
        prepare(f, tmp_path / "o.bin")
    tf = prepare(f, tmp_path / "o.bin", skip_bad_records=True)
    assert [ByteTokenizer().decode(x) for x in _doc_ids(tf)] == ["ok\n"] and tf.header.source["skipped"] == 1
    # a chat's message too
    c = tmp_path / "c.jsonl"
    c.write_text('{"m": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x \\udc00"}]}\n')
    with pytest.raises(BadRecordError, match=r"c.jsonl:1: message 1 of 'm' is not valid UTF-8 text"):
        prepare(c, tmp_path / "c.bin", messages_field="m")


def test_preparing_into_the_input_directory_again_reads_the_same_inputs(tmp_path):
    """The token file's own header (a .json) and other token files beside the inputs are not inputs."""
    d = bpe_dir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(DOCS[0])
    (data / "b.jsonl").write_text(json.dumps({"text": DOCS[1]}) + "\n")
    first = prepare(data, data / "corpus.bin", tokenizer=str(d))
    prepare(data / "b.jsonl", data / "other.bin", tokenizer=str(d))  # another token file in the directory
    again = prepare(data, data / "corpus.bin", tokenizer=str(d))
    assert again.header.docs["n_docs"] == 2 and again.header.source["read"] == 2
    assert again.header.sha256 == first.header.sha256
    with pytest.raises(DataError, match="corpus.json is part of the token file being written"):
        prepare([data / "b.jsonl", data / "corpus.json"], data / "corpus.bin", tokenizer=str(d))


def test_a_directory_is_read_at_every_depth(tmp_path):
    """Files in subdirectories are inputs (they were silently left out); hidden ones are not."""
    data = tmp_path / "data"
    for rel, text in (("b.txt", "top"), ("a/x.txt", "nested"), ("a/deeper/y.jsonl", '{"text": "deep"}\n'),
                      (".git/z.txt", "hidden")):
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text(text)
    (data / "a" / "loop").symlink_to(data, target_is_directory=True)  # a link back up is followed once
    tf = prepare(data, tmp_path / "o.bin")
    assert bytes(tf.tokens.astype(np.uint8)) == b"deep\nnested\n\ntop\n\n"
    assert tf.header.docs["n_docs"] == 3 and tf.header.source["read"] == 3


def test_a_long_record_is_tokenized_in_pieces_as_one_document(tmp_path, monkeypatch):
    # a tokenizer handed a 100 MB record whole holds ~20 GB for it: records are cut like text files
    d = bpe_dir(tmp_path)
    text = "\n".join(SENTENCES) + "\n\n" + " ".join(SENTENCES)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "short one"}) + "\n")
    whole = prepare(tmp_path / "a.jsonl", tmp_path / "whole.bin", tokenizer=str(d))
    monkeypatch.setattr(sources, "_PIECE", 50)
    monkeypatch.setattr(ingest, "_BATCH_CHARS", 300)
    monkeypatch.setattr(ingest, "_OVERLAP", 120)
    pieces = list(sources._record_pieces(text))
    assert len(pieces) > 10 and "".join(p for p, _ in pieces) == text
    assert [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(len(p) <= 50 for p, _ in pieces)
    cut = prepare(tmp_path / "a.jsonl", tmp_path / "cut.bin", tokenizer=str(d))
    assert cut.header.docs["n_docs"] == 2 and cut.header.source["read"] == 2
    assert np.array_equal(cut.tokens, whole.tokens)
    byte = prepare(tmp_path / "a.jsonl", tmp_path / "byte.bin")  # bytes: pieces change nothing
    assert ByteTokenizer().decode(byte.tokens) == text + "\n" + "short one" + "\n"


def test_a_killed_prepares_temporaries_are_removed_by_the_next_and_others_are_left(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a process id no longer running
    (tmp_path / "a.txt").write_text("some text\n")
    left = [tmp_path / f".out.bin.{dead}.k3j2.tmp", tmp_path / f".out.docs.{dead}.x9.tmp", tmp_path / f".out.json.{dead}.q.tmp"]
    for p in left:
        p.write_bytes(b"x" * 3000)
    live = tmp_path / f".out.bin.{os.getpid()}.other.tmp"  # a writer still running: not ours to remove
    old = tmp_path / ".out.bin.abcdef.tmp"  # no process id in its name: cannot tell
    for p in (live, old):
        p.write_bytes(b"y")
    said: list[str] = []
    tf = prepare(tmp_path / "a.txt", tmp_path / "out.bin", log=said.append)
    assert len(tf) > 0 and not any(p.exists() for p in left) and live.exists() and old.exists()
    assert said == [f"removed 3 temporary files (9,000 bytes) an interrupted prepare of {tmp_path / 'out.bin'} left in {tmp_path}"]
    said.clear()
    prepare(tmp_path / "a.txt", tmp_path / "out.bin", log=said.append)
    assert said == [] and sorted(p.name for p in tmp_path.glob(".out*")) == sorted([live.name, old.name])


def test_a_directorys_files_are_recognised_whatever_the_case_of_their_suffix(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "A.TXT").write_text("upper text\n")
    (d / "b.JSONL").write_text(json.dumps({"text": "upper jsonl"}) + "\n")
    assert [(p.name, f) for p, f in sources.input_files([d], None)] == [("A.TXT", "text"), ("b.JSONL", "jsonl")]
    tf = prepare(d, tmp_path / "o.bin")
    assert tf.header.docs["n_docs"] == 2 and ByteTokenizer().decode(tf.tokens) == "upper text\n\nupper jsonl\n"
