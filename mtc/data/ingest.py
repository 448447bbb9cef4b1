"""`prepare`: a corpus (text, JSONL, parquet) or SFT records to a token file, streamed.

Pretraining text: each document (a text file, a JSONL line, a parquet row) is tokenized with the
tokenizer's special tokens around it (e.g. Llama's BOS) and followed by the EOS token; the byte
tokenizer has no EOS, so its documents end with a newline (each text file is also made to end
with one: a blank line between documents). Document boundaries go to the ``.docs`` sidecar, so
batches can keep to one document (see `mtc.data.batches`). SFT records become conversations
(`mtc.data.chat`) whose loss mask goes to the ``.mask`` sidecar. The tokenizer's files are copied
to ``<stem>.tokenizer/`` beside the token file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from mtc.data.chat import encode_conversation
from mtc.data.sources import RecordFaults, input_files, iter_conversations, iter_texts
from mtc.data.tokenizer import Tokenizer, get_tokenizer, special_affixes
from mtc.data.tokens import TokenFile, TokenWriter, token_file_paths
from mtc.errors import BadRecordError, DataError

__all__ = ["prepare"]

# records are tokenized in batches of about 256 Ki characters (encode_batch): the library holds
# about 90 bytes per character of a batch while it works (offsets, token strings), 4 Mi cost 370 MB
_BATCH_CHARS = 1 << 18


def _encode_many(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    batch = getattr(tok, "encode_batch", None)
    return batch(texts, special=False) if batch is not None else [tok.encode(t, special=False) for t in texts]


class _Counts:
    """Documents read, and those of them that came out empty (no tokens: dropped)."""

    __slots__ = ("empty", "read")

    def __init__(self) -> None:
        self.read = self.empty = 0


def _documents(tok: Tokenizer, pieces: Iterator[tuple[str, bool]],
               counts: _Counts | None = None) -> Iterator[tuple[np.ndarray, bool]]:
    """(ids, ends_document) of every text piece, with the document's affixes and separator; empty
    documents are dropped (and counted in ``counts``). Short records are tokenized in batches."""
    counts = counts if counts is not None else _Counts()
    pre, post = special_affixes(tok)
    sep = np.asarray([tok.eos_id]) if tok.eos_id is not None else tok.encode("\n", special=False)
    if len(post) and tok.eos_id is not None and post[-1] == tok.eos_id:
        sep = sep[:0]  # the post-processor already ends a text with EOS
    tail = np.concatenate([post, sep]).astype(np.int64)
    pending: list[tuple[str, bool]] = []
    size = 0
    started = False  # the current document has tokens already

    def flush() -> Iterator[tuple[np.ndarray, bool]]:
        nonlocal started
        texts = [t for t, _ in pending]
        for ids, (text, end) in zip(_encode_many(tok, texts), pending, strict=True):
            out = [pre] if not started and len(ids) else []
            out.append(ids)
            started = started or bool(len(ids))
            if end:
                counts.read += 1
                if started:
                    out.append(tail)
                else:
                    counts.empty += 1
                started = False
            yield np.concatenate(out).astype(np.int64) if out else ids, end
        pending.clear()

    for text, end in pieces:
        pending.append((text, end))
        size += len(text)
        if size >= _BATCH_CHARS:
            yield from flush()
            size = 0
    yield from flush()


def _copy_tokenizer(tok: Tokenizer, dest: Path) -> None:
    """Copy the tokenizer's files to ``dest`` through a temporary directory renamed into place."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
    try:
        for f in tok.files:
            shutil.copy2(f, tmp / ("tokenizer.json" if f.suffix == ".json" and len(tok.files) == 1 else f.name))
        os.chmod(tmp, 0o777 & ~_umask())
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def prepare(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str], *,
    tokenizer: str | Tokenizer = "byte", fmt: str | None = None, field: str = "text",
    prompt_field: str | None = None, response_field: str | None = None, messages_field: str | None = None,
    eos_token: str | None = None, skip_bad_records: bool = False, log: Callable[[str], None] | None = None,
) -> TokenFile:
    """Tokenize ``inputs`` (files or directories; text, JSONL or parquet, by suffix or ``fmt``) into
    a token file with document boundaries, streamed. JSONL / parquet records give their ``field``.
    With ``prompt_field`` + ``response_field`` or ``messages_field`` the records are SFT
    conversations and the file gets a loss mask (targets only in the assistant's replies).

    A bad record (see `mtc.data.sources`) raises `BadRecordError` naming it, or with
    ``skip_bad_records`` is skipped. The header's ``source`` counts the documents read, the empty
    ones (no tokens, so no document) and the skipped ones with the first few reasons. ``log`` hears
    of temporary files an earlier, killed prepare of the same output left and this one removed."""
    tok = get_tokenizer(tokenizer, eos_token=eos_token) if isinstance(tokenizer, str) else tokenizer
    paths = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    bin_path, json_path = token_file_paths(out_path)
    stem = bin_path.with_suffix("")
    ours = [bin_path, json_path] + [stem.with_name(stem.name + s) for s in (".docs", ".mask", ".tokenizer")]
    files = input_files(paths, fmt, skip=ours)
    sft = prompt_field is not None or response_field is not None or messages_field is not None
    if not sft and tok.eos_id is None and tok.name != "byte":
        raise DataError(f"tokenizer {tok.name!r} names no EOS token to separate documents; pass --eos TOKEN "
                        "(one of its special tokens), or add eos_token to its tokenizer_config.json")
    tok_dir = stem.with_name(stem.name + ".tokenizer") if tok.files else None
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    with TokenWriter(bin_path, vocab_size=tok.vocab_size, tokenizer=tok.name, with_docs=True, with_mask=sft,
                     tokenizer_spec=tok.spec, tokenizer_sha256=tok.sha256, eos_id=tok.eos_id,
                     tokenizer_dir=tok_dir.name if tok_dir is not None else None) as w:
        if w.removed_leftovers and log is not None:
            size = sum(n for _, n in w.removed_leftovers)
            log(f"removed {len(w.removed_leftovers)} temporary files ({size:,} bytes) an interrupted prepare of "
                f"{bin_path} left in {bin_path.parent}")
        faults, counts = RecordFaults(skip_bad_records), _Counts()
        if sft:
            for where, conv in iter_conversations(files, prompt_field=prompt_field, response_field=response_field,
                                                  messages_field=messages_field, faults=faults):
                try:
                    ids, mask = encode_conversation(conv, tok)
                except BadRecordError as e:
                    faults.bad(f"{where}: ", e.problem, e.fix)
                    continue
                counts.read += 1
                w.add(ids, mask, end_doc=True)
        else:
            for ids, end in _documents(tok, iter_texts(files, field, faults), counts):
                w.add(ids, end_doc=end)
        if w.n_tokens == 0:
            empty = f" ({counts.empty:,} empty documents)" if counts.empty else ""
            skipped = f"; {faults.count:,} records were skipped as bad, the first: {faults.examples[0]}" if faults.count else ""
            raise DataError(f"{', '.join(map(str, paths))} contains no text{empty}; nothing to tokenize{skipped}")
        if tok_dir is not None:
            _copy_tokenizer(tok, tok_dir)
        return w.finish(source={"read": counts.read, "empty": counts.empty, "skipped": faults.count,
                                "skipped_examples": faults.examples})
