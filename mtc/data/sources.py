"""Reading a corpus for `prepare`, streamed: plain text files, JSONL and parquet.

A *document* is one text file, one JSONL line or one parquet row. Nothing here holds more than one
record (or, for a text file, one piece of about 1 MiB cut after a newline) at a time, so a corpus
of any size streams through; a long record's text is handed on in pieces cut the same way (`prepare`
tokenizes a long document in overlapping windows, so that its ids are those of its whole text).
SFT records become conversations: a list of ``{"role", "content"}``
messages, from a prompt and a response field or from a ``messages`` field.

A record that cannot be used as asked (a line that is not JSON, a missing or null field, a chat
without an assistant reply) stops the run by default, naming it; with ``skip_bad_records`` it is
skipped and counted (`RecordFaults`), so one bad line of a scraped corpus does not cost the rest.
Problems of a whole file (not UTF-8 text, no such parquet column) always stop.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mtc.errors import BadRecordError, DataError

__all__ = ["FORMATS", "Message", "RecordFaults", "input_files", "iter_conversations", "iter_texts"]

FORMATS = ("text", "jsonl", "parquet")
_SUFFIXES = {"text": (".txt",), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
_PIECE = 1 << 18  # characters of a text file tokenized at once (see ingest._BATCH_CHARS)
_PARQUET_BATCH = 1024  # rows per parquet read

Message = dict[str, str]
_SKIP_HINT = "or pass --skip-bad-records to skip such records (they are counted)"


class RecordFaults:
    """Bad records met while reading a corpus: by default the first one stops the run
    (`BadRecordError` naming it); with ``skip`` each is counted and the first few are kept (where,
    and what was wrong) for the token file's header and the summary."""

    KEPT = 5  # examples kept: enough to see a pattern, little enough for a header

    def __init__(self, skip: bool = False) -> None:
        self.skip = skip
        self.count = 0
        self.examples: list[str] = []

    def bad(self, where: str, problem: str, fix: str) -> None:
        """Record (or raise) that the record at ``where`` has ``problem``; ``fix`` says how to
        repair it, for the error."""
        if not self.skip:
            raise BadRecordError(f"{where}{problem}", f"{fix}, {_SKIP_HINT}")
        self.count += 1
        if len(self.examples) < self.KEPT:
            self.examples.append(f"{where}{problem}")



def _format_of(p: Path) -> str | None:
    return next((f for f, sfx in _SUFFIXES.items() if p.suffix.lower() in sfx), None)


def input_files(inputs: Sequence[str | Path], fmt: str | None,
                skip: Sequence[Path] = ()) -> list[tuple[Path, str]]:
    """Each input file with its format: files as given, directories expanded to the files of the
    format (``fmt``, or every known suffix when None) at any depth, sorted by path. Hidden entries
    (a name starting with ".": temporary files, .git) and ``skip`` (the output's own files, which
    would otherwise come back as input on a re-run into the input directory) are left out of
    directories."""
    if fmt is not None and fmt not in FORMATS:
        raise DataError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not inputs:
        raise DataError("no input given; pass text files, JSONL or parquet files, or directories of them")
    skipped = {s.resolve() for s in skip}
    out: list[tuple[Path, str]] = []
    for raw in inputs:
        p = Path(raw)
        if p.is_dir():
            found = [f for f in _walk(p, skipped) if (_format_of(f) if fmt is None else _format_of(f) == fmt)]
            if not found:
                want = ", ".join(f"*{s}" for s in (_SUFFIXES[fmt] if fmt else sum(_SUFFIXES.values(), ())))
                raise DataError(f"no input files ({want}) in directory {p}; pass files, or --format for their kind")
            out += [(f, fmt or _format_of(f) or "text") for f in found]
        elif p.is_file():
            if p.resolve() in skipped:
                raise DataError(f"input {p} is part of the token file being written; leave it out of the inputs")
            out.append((p, fmt or _format_of(p) or "text"))
        else:
            raise DataError(f"input {p} does not exist; pass text, JSONL or parquet files, or directories of them")
    return out


def _walk(d: Path, skipped: set[Path], seen: set[Path] | None = None) -> list[Path]:
    """The files under directory ``d``, sorted by path, without hidden entries, ``skipped`` ones or
    token files `prepare` wrote (a header and tokenizer directory beside a NAME.bin)."""
    seen = set() if seen is None else seen
    real = d.resolve()
    if real in seen:  # a symlink back up the tree
        return []
    seen.add(real)
    out: list[Path] = []
    for e in sorted(d.iterdir()):
        if e.name.startswith(".") or e.resolve() in skipped or _is_token_file_part(e):
            continue
        if e.is_dir():
            out += _walk(e, skipped, seen)
        elif e.is_file():
            out.append(e)
    return out


def _is_token_file_part(e: Path) -> bool:
    """Whether ``e`` is the header or the tokenizer directory of a token file NAME.bin beside it."""
    if e.suffix not in (".json", ".tokenizer") or not e.with_suffix(".bin").is_file():
        return False
    if e.suffix == ".tokenizer":
        return e.is_dir()
    try:
        with open(e, "rb") as f:
            return b'"mtc-tokens"' in f.read(256)
    except OSError:
        return False


def _cut(buf: str) -> int:
    """Where a piece of ``buf`` ends: after its last blank line, else after its last newline, else
    (a line longer than a piece) before its last space, where word-level pre-tokenizers (a space
    starts the next word's token) split anyway; else at its end."""
    cut = buf.rfind("\n\n", 0, len(buf) - 1)
    cut = cut + 2 if cut >= 0 else buf.rfind("\n") + 1
    if cut <= 0:
        cut = buf.rfind(" ")
        cut = cut if cut > 0 else len(buf)
    return cut


def _record_pieces(text: str) -> Iterator[tuple[str, bool]]:
    """(piece, ends_document) of one record's text, in pieces of at most about `_PIECE` characters
    cut as a text file's are: a tokenizer given a record of 100 MB whole holds ~20 GB for it."""
    while len(text) > _PIECE:
        cut = _cut(text[:_PIECE])
        yield text[:cut], False
        text = text[cut:]
    yield text, True


def _text_pieces(path: Path) -> Iterator[str]:
    """A UTF-8 text file in pieces of about 1 MiB, each cut after a blank line or a newline when
    there is one, so a tokenizer rarely sees a word cut in two; ends with a newline."""
    tail = ""
    last = ""
    try:
        # utf-8-sig: a byte-order mark from a Windows editor is not text to train on.
        with open(path, encoding="utf-8-sig", newline="") as f:
            while True:
                chunk = f.read(_PIECE)
                if not chunk:
                    break
                buf = tail + chunk
                cut = _cut(buf)
                piece, tail = buf[:cut], buf[cut:]
                if piece:
                    last = piece
                    yield piece
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 (byte {_bad_utf8_offset(path)}: {e.reason}); convert it to UTF-8 "
                        "first") from None
    if tail:
        last = tail
        yield tail
    if last and not last.endswith("\n"):
        yield "\n"


def _bad_utf8_offset(path: Path) -> int:
    """The file offset of the first byte that is not valid UTF-8 (a decode error's own offset is
    within the piece being decoded, not the file)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    done = 0  # bytes of the file handed to the decoder so far
    with open(path, "rb") as f:
        while True:
            block = f.read(_PIECE)
            held = len(dec.getstate()[0])  # the last block's unfinished character: decoded with this one
            try:
                dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                return done - held + e.start
            if not block:
                return done
            done += len(block)


class _Unreadable:
    """A JSONL line that does not decode: its problem and fix, for `RecordFaults.bad`."""

    __slots__ = ("fix", "problem")

    def __init__(self, problem: str, fix: str) -> None:
        self.problem, self.fix = problem, fix


# what to do with a .json file holding one array of records, which reads as JSONL whose first
# line is that array (or, written over several lines, its opening bracket)
_ARRAY_FIX = ("mtc prepare reads JSONL, one JSON object per line: write each record of the array on its own line "
              "(e.g. jq -c '.[]' FILE > FILE.jsonl)")


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except UnicodeDecodeError as e:
                rec = _Unreadable(f" is not valid UTF-8 (byte {e.start} of the line: {e.reason})",
                                  "convert the file to UTF-8 first")
            except json.JSONDecodeError as e:
                if n == 1 and line.lstrip().startswith(b"["):
                    rec = _Unreadable(" opens a JSON array, not an object", _ARRAY_FIX)
                else:
                    rec = _Unreadable(f" is not a JSON object ({e})", "each line of a JSONL file holds one")
            yield n, rec


def _parquet_records(path: Path, columns: list[str]) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading parquet needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001  (pyarrow raises ArrowInvalid, OSError and friends)
        raise DataError(f"{path} is not a parquet file pyarrow can read ({e})") from None
    names = pf.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(f"{path} has no column {missing[0]!r}; its columns: {', '.join(names)}; name one with --field")
    n = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=columns):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _records(path: Path, fmt: str, columns: list[str], faults: RecordFaults) -> Iterator[tuple[str, Any]]:
    """(where, record) of a JSONL or parquet file; lines that do not decode go to ``faults``."""
    if fmt == "jsonl":
        for n, rec in _jsonl_records(path):
            if isinstance(rec, _Unreadable):
                faults.bad(f"{path}:{n}", rec.problem, rec.fix)
            else:
                yield f"{path}:{n}", rec
    else:
        for n, rec in _parquet_records(path, columns):
            yield f"{path} row {n}", rec


# JSON's names of the values json.loads gives that are not objects
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _not_an_object(rec: Any, where: str, faults: RecordFaults) -> bool:
    """Whether JSONL record ``rec`` is some other JSON value than an object (reported to ``faults``)."""
    if isinstance(rec, dict):
        return False
    kind = _JSON_KINDS.get(type(rec), type(rec).__name__)
    fix = _ARRAY_FIX if isinstance(rec, list) else "each line of a JSONL file holds one JSON object, such as {\"text\": \"...\"}"
    faults.bad(where, f" holds a JSON {kind}, not an object", fix)
    return True


def _field(rec: Any, name: str, where: str, faults: RecordFaults, flag: str = "--field") -> str | None:
    """The text of field ``name`` of a record, or None (reported to ``faults``) when it has none."""
    if _not_an_object(rec, where, faults):
        return None
    if name not in rec:
        faults.bad(where, f" has no field {name!r} (it has: {', '.join(map(str, rec))})", f"name the text field with {flag}")
        return None
    v = rec[name]
    if not isinstance(v, str):
        faults.bad(where, f": field {name!r} is {'null' if v is None else type(v).__name__}, not text",
                   "give every record text there")
        return None
    return v if _utf8_text(v, f"field {name!r}", where, faults) else None


def _utf8_text(v: str, what: str, where: str, faults: RecordFaults) -> bool:
    """Whether ``v`` is text UTF-8 can hold, else False, reported to ``faults``: JSON's escapes
    can spell half of a surrogate pair ("\\ud83d", a character cut in two), which no tokenizer takes."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        faults.bad(where, f": {what} is not valid UTF-8 text (an unpaired surrogate, U+{ord(v[e.start]):04X}, at character "
                          f"{e.start})", "fix the record (a character cut in two) or drop it")
        return False
    return True


def iter_texts(files: list[tuple[Path, str]], field: str = "text",
               faults: RecordFaults | None = None) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pieces of every document: a text file may come in several pieces.
    Bad records raise, or are skipped and counted by ``faults`` when it skips."""
    faults = faults if faults is not None else RecordFaults()
    for path, fmt in files:
        if fmt == "text":
            for piece in _text_pieces(path):
                yield piece, False
            yield "", True
        else:
            for where, rec in _records(path, fmt, [field], faults):
                text = _field(rec, field, where, faults)
                if text is not None:
                    yield from _record_pieces(text)


def _messages(v: Any, where: str, name: str, faults: RecordFaults) -> list[Message] | None:
    if not isinstance(v, list) or not v:
        faults.bad(where, f": field {name!r} must be a non-empty list of {{role, content}} messages, "
                   f"not {'null' if v is None else type(v).__name__ if not isinstance(v, list) else 'an empty list'}",
                   "fix the record")
        return None
    out = []
    for i, m in enumerate(v):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            faults.bad(where, f": message {i} of {name!r} must be an object with string 'role' and 'content'",
                       "fix the record")
            return None
        if not _utf8_text(m["content"], f"message {i} of {name!r}", where, faults):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        faults.bad(where, ": no 'assistant' message: nothing to train on in this conversation", "fix the record")
        return None
    return out


def iter_conversations(files: list[tuple[Path, str]], *, prompt_field: str | None, response_field: str | None,
                       messages_field: str | None,
                       faults: RecordFaults | None = None) -> Iterator[tuple[str, list[Message]]]:
    """(where, conversation) of each SFT record: prompt -> user message, response -> assistant
    message, or the record's chat ``messages`` as they are. Bad records raise, or are skipped and
    counted by ``faults`` when it skips."""
    faults = faults if faults is not None else RecordFaults()
    if messages_field is None and (prompt_field is None or response_field is None):
        raise DataError("SFT data needs --prompt-field and --response-field, or --messages-field")
    cols = [messages_field] if messages_field is not None else [prompt_field, response_field]
    for path, fmt in files:
        if fmt == "text":
            raise DataError(f"{path}: SFT data must be JSONL or parquet records, not plain text")
        for where, rec in _records(path, fmt, cols, faults):  # type: ignore[arg-type]
            if messages_field is not None:
                if _not_an_object(rec, where, faults):
                    continue
                if messages_field not in rec:
                    faults.bad(where, f" has no field {messages_field!r}", "name the chat field with --messages-field")
                    continue
                conv = _messages(rec[messages_field], where, messages_field, faults)
            else:
                prompt = _field(rec, prompt_field, where, faults, "--prompt-field")  # type: ignore[arg-type]
                reply = None if prompt is None else _field(rec, response_field, where, faults,  # type: ignore[arg-type]
                                                           "--response-field")
                conv = None if reply is None else [{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": reply}]
            if conv is not None:
                yield where, conv
