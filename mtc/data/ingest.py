"""`prepare`: a corpus (text, JSONL, parquet) or SFT records to a token file, streamed.

Pretraining text: each document (a text file, a JSONL line, a parquet row) is tokenized with the
tokenizer's special tokens around it (e.g. Llama's BOS) and followed by the EOS token; its ids are
the tokenizer's for its whole text, though a long one is tokenized in windows (`_stitched`); the byte
tokenizer has no EOS, so its documents end with a newline (each text file is also made to end
with one: a blank line between documents). Document boundaries go to the ``.docs`` sidecar, so
batches can keep to one document (see `mtc.data.batches`). SFT records become conversations
(`mtc.data.chat`) whose loss mask goes to the ``.mask`` sidecar. The tokenizer's files are copied
to ``<stem>.tokenizer/`` beside the token file.
"""

from __future__ import annotations

import bisect
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mtc.data.chat import encode_conversation
from mtc.data.sources import RecordFaults, input_files, iter_conversations, iter_texts
from mtc.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer, special_affixes
from mtc.data.tokens import TokenFile, TokenWriter, token_file_paths
from mtc.errors import BadRecordError, DataError

__all__ = ["prepare"]

# records are tokenized in batches of about 256 Ki characters (encode_batch): the library holds
# about 90 bytes per character of a batch while it works (offsets, token strings), 4 Mi cost 370 MB.
# A longer document is tokenized in windows of this size (see `_stitched`).
_BATCH_CHARS = 1 << 18
# Characters at the end of a window tokenized again at the start of the next: where the two
# tokenizations agree there, the document's ids pass from one window to the next.
_OVERLAP = 1 << 11
_AGREE = 8  # tokens both windows must share on each side of the point where they are joined
# The longest window grown to find such a point (a run of one character, or a tokenizer without
# offsets, has none): beyond it a document could only be tokenized whole, so it is refused.
_MAX_WINDOW = 1 << 23


def _encode_many(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    batch = getattr(tok, "encode_batch", None)
    return batch(texts, special=False) if batch is not None else [tok.encode(t, special=False) for t in texts]


class _Counts:
    """Documents read, and those of them that came out empty (no tokens: dropped)."""

    __slots__ = ("empty", "read")

    def __init__(self) -> None:
        self.read = self.empty = 0


class _Text:
    """One document's text, read from its pieces as far as asked; what was dropped is let go."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self._pieces = pieces
        self.buf = ""  # the text from character `base` of the document on, as far as read
        self.base = 0
        self.ended = False  # `buf` runs to the end of the document

    def read(self, n: int) -> None:
        """Read on until `buf` holds more than ``n`` characters or the document ends."""
        parts, size = [self.buf], len(self.buf)
        while size <= n and not self.ended:
            piece = next(self._pieces, None)
            if piece is None:
                self.ended = True
            else:
                parts.append(piece)
                size += len(piece)
        self.buf = "".join(parts)

    def drop(self, n: int) -> None:
        self.buf = self.buf[n:]
        self.base += n


class _Window(NamedTuple):
    """A window's ids, and the start characters of its tokens near its two ends: all that lining
    windows up needs (the offsets of every token cost a tenth of the time to tokenize)."""

    ids: np.ndarray
    head: np.ndarray | None  # starts of its tokens 0, 1, ... that start in its first `_OVERLAP` characters
    tail_at: int  # its first token that starts in its last `_OVERLAP` characters
    tail: np.ndarray | None  # starts of tokens tail_at, tail_at + 1, ...; None: no offsets (in order)


def _starts(start: Callable[[int], int], i: int, n: int, end: int) -> np.ndarray | None:
    """The starts of tokens ``i``, ``i`` + 1, ... of ``n`` that start before character ``end``;
    None when they are out of order (offsets that cannot line windows up)."""
    out = []
    for k in range(i, n):
        c = start(k)
        if c >= end:
            break
        out.append(c)
    arr = np.asarray(out, dtype=np.int64)
    return None if len(arr) and (arr[0] < 0 or np.any(arr[1:] < arr[:-1])) else arr


def _window(tok: Tokenizer, text: str) -> _Window:
    """``text`` tokenized, with the starts of its tokens near its ends when the tokenizer tells them."""
    located = getattr(tok, "encode_located", None)
    if located is None:
        return _Window(tok.encode(text, special=False), None, 0, None)
    ids, start = located(text)
    n, cut = len(ids), len(text) - _OVERLAP
    at = bisect.bisect_left(range(n), cut, key=start)
    return _Window(ids, _starts(start, 0, n, _OVERLAP), at, _starts(start, at, n, len(text) + 1))


def _join_point(a: _Window, b: _Window, b0: int, first: int) -> tuple[int, int] | None:
    """(i, j): window A's tokens before its i-th and window B's (B starts at character ``b0`` of A,
    within A's last `_OVERLAP` characters) from its j-th are the document's; or None when the two
    do not agree on `_AGREE` tokens on each side of a token at or after A's token ``first``. The
    point is the middle of the longest stretch where both give the same tokens at the same
    characters: away from A's end and B's start, where each may differ from the whole text's
    tokens (a word or a run of newlines cut there)."""
    if a.tail is None or b.head is None or not len(a.tail):
        return None
    bs = b.head[:np.searchsorted(b.head, a.tail[-1] - b0, side="right")] + b0
    n = len(bs)
    if n == 0:
        return None
    # B's token j lines up with A's token i: the same start, and as many tokens before it with
    # that start (a character split over several byte tokens gives them all its start)
    i = np.searchsorted(a.tail, bs) + (np.arange(n) - np.searchsorted(bs, bs))
    ok = i < len(a.tail)
    i += a.tail_at
    ok[ok] = (a.tail[i[ok] - a.tail_at] == bs[ok]) & (a.ids[i[ok]] == b.ids[:n][ok])
    shift = np.where(ok, i - np.arange(n), -1)
    # stretches of lined-up tokens with one shift: [lo, hi) of B's
    brk = np.flatnonzero(~ok[1:] | ~ok[:-1] | (shift[1:] != shift[:-1])) + 1
    best = None
    for lo, hi in zip(np.r_[0, brk].tolist(), np.r_[brk, n].tolist(), strict=True):
        if not ok[lo] or (best is not None and hi - lo <= best[1] - best[0]):
            continue
        d = int(shift[lo])
        j = min(max((lo + hi) // 2, lo + _AGREE, first - d), hi - _AGREE)
        if j >= lo + _AGREE and j + d >= first:
            best = (lo, hi, j + d, j)
    return None if best is None else (best[2], best[3])


def _stitched(tok: Tokenizer, text: _Text, doc: int) -> Iterator[np.ndarray]:
    """The ids of a document longer than a window, equal to the tokenizer's for its whole text,
    holding a window or two of it at a time. Window A is tokenized; window B starts `_OVERLAP`
    characters before A's end; they are joined where they agree (`_join_point`), and B becomes
    A. Where they do not (a run of spaces longer than the overlap across A's end), A grows to twice
    its length and is tried again, up to `_MAX_WINDOW` characters."""
    span = _BATCH_CHARS
    text.read(span)
    a = _window(tok, text.buf[:span])
    first = 0  # A's tokens before this one are out already
    while True:
        text.read(span)
        if text.ended and len(text.buf) <= span:  # A runs to the document's end: its tokens stand
            yield a.ids[first:]
            return
        b0 = span - _OVERLAP
        join = None
        if a.tail is not None:  # without offsets A can only grow to the document's end
            text.read(b0 + _BATCH_CHARS)
            b = _window(tok, text.buf[b0:b0 + _BATCH_CHARS])
            join = _join_point(a, b, b0, first)
        if join is not None:
            yield a.ids[first:join[0]]
            text.drop(b0)
            a, first = b, join[1]
            span = min(_BATCH_CHARS, len(text.buf))
            continue
        if span >= _MAX_WINDOW:
            if a.tail is None:
                raise DataError(f"tokenizer {tok.name!r} gives no character offsets of its tokens in order, so "
                                f"document {doc:,} (counted from 1 in input order; over {_MAX_WINDOW:,} characters) "
                                "cannot be tokenized exactly in pieces; split the document, or use a tokenizer.json")
            raise DataError(f"characters {text.base:,} to {text.base + span:,} of document {doc:,} (counted from 1 "
                            f"in input order) hold no place where tokenizer {tok.name!r} gives the same tokens for "
                            "the text cut there as for it whole (e.g. one long run of a repeated character), and "
                            "tokenizing it whole would take too much memory; split that document or shorten the run")
        grow = min(2 * span, _MAX_WINDOW)
        text.read(grow)
        grown = _window(tok, text.buf[:grow])
        # the tokens A was joined by must stay as they were: the join held whatever came after
        lo, hi = max(first - _AGREE, 0), first + _AGREE
        if first and not (a.head is not None and grown.head is not None and np.array_equal(grown.ids[lo:hi], a.ids[lo:hi])
                          and np.array_equal(grown.head[lo:hi], a.head[lo:hi])):
            raise DataError(f"tokenizer {tok.name!r} changed its tokens at character {text.base + int(a.head[first]):,} "
                            f"of document {doc:,} (counted from 1 in input order) when the text after them grew from "
                            f"{span:,} to {grow:,} characters, so the document cannot be tokenized exactly in "
                            "pieces; split it")
        a, span = grown, grow


def _documents(tok: Tokenizer, pieces: Iterator[tuple[str, bool]],
               counts: _Counts | None = None) -> Iterator[tuple[np.ndarray, bool]]:
    """(ids, ends_document) of every document, with its affixes and separator; empty documents are
    dropped (and counted in ``counts``). A document's ids are the tokenizer's for its whole text,
    however it came in pieces: short documents are tokenized whole, in batches; longer ones in
    windows joined where the tokenizer's output agrees (`_stitched`)."""
    counts = counts if counts is not None else _Counts()
    pre, post = special_affixes(tok)
    sep = np.asarray([tok.eos_id]) if tok.eos_id is not None else tok.encode("\n", special=False)
    if len(post) and tok.eos_id is not None and post[-1] == tok.eos_id:
        sep = sep[:0]  # the post-processor already ends a text with EOS
    tail = np.concatenate([post, sep]).astype(np.int64)
    # one byte per token: a piece's ids are the whole text's, so pieces need no stitching
    exact = isinstance(tok, ByteTokenizer)
    pending: list[str] = []
    size = 0

    def flush() -> Iterator[tuple[np.ndarray, bool]]:
        for ids in _encode_many(tok, pending):
            counts.read += 1
            if len(ids):
                yield np.concatenate([pre, ids, tail]).astype(np.int64), True
            else:
                counts.empty += 1
                yield ids, True
        pending.clear()

    def rest(head: list[str]) -> Iterator[str]:
        """The current document's pieces: ``head``, then the rest of ``pieces`` up to its end."""
        yield from head
        for text, end in pieces:
            yield text
            if end:
                return

    pieces = iter(pieces)
    for text, end in pieces:
        head, n = [text], len(text)
        while not end and n <= _BATCH_CHARS:
            text, end = next(pieces)
            head.append(text)
            n += len(text)
        if end:  # short enough to tokenize whole
            pending.append("".join(head))
            size += n
            if size >= _BATCH_CHARS:
                yield from flush()
                size = 0
            continue
        yield from flush()
        size = 0
        doc = rest(head)
        chunks = (tok.encode(t, special=False) for t in doc) if exact else _stitched(tok, _Text(doc), counts.read + 1)
        started = False
        for ids in chunks:
            if len(ids):
                yield (ids if started else np.concatenate([pre, ids])).astype(np.int64), False
                started = True
        counts.read += 1
        counts.empty += not started
        yield (tail if started else tail[:0]), True
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
    # (the writer makes the output's directory, or says why it cannot)
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
