"""Check a store's integrity (`verify`) and restore a lost or garbled ``commit.json`` (`repair`).

What `verify` checks:

* every node's metadata (``zarr.json``) parses, and every array's is an mtc array's;
* the state of the committed generation that the commit's durability mode says is on disk
  (`REQUIRED_KINDS`: ``full`` needs master, m and v; ``weights`` master; ``none`` nothing) exists,
  has the shape recorded by `create_layer_state`, and every one of its chunks is present and
  passes its CRC32C;
* the generation's resume file holds the RNG states the commit names (its digest), unless the
  record carries them inline (written before resume files existed);
* ``commit.json`` parses and agrees with the last record of ``commits.jsonl``;
* the context file (config and data identity) of ``commit.json``'s record is whole, where the
  history's lines name it.

A missing chunk is always damage. The store writes every chunk, all-zero ones (fresh Adam
moments) included (``write_empty_chunks=True``, see `mtc.store.tensor_store`), so no chunk is
ever "deliberately unwritten" and an absent chunk file cannot be a fill-value chunk: no
written-chunk manifest is needed, and `verify` reports exactly the chunks a resume would fail to
read. The other generation is not checked: it is the one the running step writes behind.

`repair` rewrites ``commit.json`` from the newest record of ``commits.jsonl`` whose arrays verify,
skipping a record whose generation a later record rewrote, or whose chunk files are newer than
the next commit (a later step's write-behind had begun overwriting them). It does so when
``commit.json`` is lost or garbled, and when it is intact but names a generation whose state is
damaged (a roll-back: the steps since the restored commit are lost, nothing else). A record older
than the history's last is appended to ``commits.jsonl`` again, so the history ends with the
commit a resume uses, as after any commit. A missing or damaged context file that history lines
name is rewritten from ``commit.json`` when its record has that context.

A data-parallel run (`mtc.shards`) keeps no state in its run directory: its global record names
the ranks' shard stores, so `verify` of the run directory checks no arrays of it. `repair` of the
run directory checks a commit's every shard (the shard stores' commit the record names, which may
be older than a shard's own last commit) before it keeps or restores that commit; `repair` of a
rank's shard store refuses to roll it back alone while its run's record names damaged state in it
(that needs the run's repair, which rolls every shard back alike).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from mtc.store.directory import (
    COMMIT_FILE,
    CONTEXT_DIR,
    GROUP_METADATA,
    HISTORY_FILE,
    RESUME_FILES,
    CommitRecord,
    HistoryLine,
    looks_like_group,
    os_error_message,
    read_commit_file,
    read_context,
    read_history,
    read_resume,
    read_write_starts,
    restore_context,
    split_context,
    written_since,
)
from mtc.store.layout import KINDS, LAYOUT_ATTR, state_array_name
from mtc.store.tensor_store import TensorStore

from mtc.errors import StoreError

__all__ = ["REQUIRED_KINDS", "Problem", "RepairReport", "VerifyReport", "check_state", "repair", "verify"]

# which state kinds of the committed generation each durability mode guarantees are on disk
REQUIRED_KINDS: dict[str, tuple[str, ...]] = {"full": ("master", "m", "v"), "weights": ("master",), "none": ()}
_STATE_NAME = re.compile(r"layers/(\d{4,})/(" + "|".join(KINDS) + r")/g([01])")


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """One piece of damage: in an array (and chunk), or in a commit file (``array`` None)."""

    where: str
    message: str
    array: str | None = None
    chunk: int | None = None

    def __str__(self) -> str:
        loc = self.where if self.array is None else f"array {self.array}" + (f" chunk {self.chunk}" if self.chunk is not None else "")
        return f"{loc}: {self.message}"


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `verify` found: ``problems`` (damage) and ``notes`` (harmless, e.g. a torn history line)."""

    store: str
    record: CommitRecord | None  # the commit whose generation was checked
    problems: tuple[Problem, ...]
    notes: tuple[str, ...]
    arrays_checked: int
    chunks_checked: int
    repair_at: str | None = None  # the store whose `mtc repair` fixes this one (None: this one)

    @property
    def ok(self) -> bool:
        """True when nothing is damaged."""
        return not self.problems

    def lines(self) -> list[str]:
        """The report as printable lines: a summary, one line per problem and note, and what to do."""
        r = self.record
        head = f"store {self.store}: " + (
            f"step {r.step}, generation {r.generation}, durability {r.durability}" if r is not None else "no readable commit"
        )
        out = [f"{head}; checked {self.arrays_checked} arrays, {self.chunks_checked} chunks"]
        out += [f"damaged: {p}" for p in self.problems]
        out += [f"note: {n}" for n in self.notes]
        if self.ok:
            out.append("healthy")
            return out
        out.append(f"{len(self.problems)} problem(s); " + "; ".join(self.fixes()))
        return out

    def fixes(self) -> list[str]:
        """What to do about the problems found, one phrase per kind of damage."""
        out = []
        at = self.repair_at or self.store  # a rank's shard store: its run's repair, which rolls every shard back alike
        if any(p.where == COMMIT_FILE for p in self.problems):
            out.append(f"`mtc repair {at}` restores {COMMIT_FILE} from {HISTORY_FILE}")
        elif any(p.where == HISTORY_FILE for p in self.problems):  # commit.json is whole: the history lacks it
            out.append(f"`mtc repair {at}` writes {COMMIT_FILE}'s record back into {HISTORY_FILE}")
        if any(p.where.startswith(CONTEXT_DIR + "/") for p in self.problems):
            out.append(f"`mtc repair {at}` rewrites the context file from {COMMIT_FILE}")
        if any(p.where.startswith("group ") for p in self.problems):
            out.append(f"`mtc repair {at}` rewrites a group's garbled metadata (mtc's groups below the root hold "
                       "no attributes: nothing is lost)")
        if any(p.array is not None or p.where in RESUME_FILES for p in self.problems):
            out.append(f"`mtc repair {at}` rolls back to the newest earlier commit whose state is whole (losing the "
                       "steps since), if there is one; else restore the store from a copy, or start over with "
                       "`mtc train ... --overwrite`")
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class RepairReport:
    """What `repair` did, in words, and the record it restored as ``commit.json`` (None: none needed)."""

    actions: tuple[str, ...]
    restored: CommitRecord | None


def verify(store: TensorStore, *, check_chunks: bool = True, record: CommitRecord | None = None,
           repair_at: str | None = None) -> VerifyReport:
    """Check ``store`` (see the module docstring); ``check_chunks=False`` skips reading the chunks.

    ``record``: check the state of this commit (one of the store's history) instead of the last
    one's: a rank's shard store is resumed from the commit its run's global record names, and the
    shard's own last commit may be a step the run never committed (`mtc.shards.verify_sharded`).
    ``repair_at``: the store whose `mtc repair` the report's advice names (default ``store``).
    Works on a read-only handle, beside a run that holds the store.
    """
    problems: list[Problem] = []
    notes: list[str] = []
    bad_nodes = dict(store.metadata_problems())
    if store.path is None:
        current = store.last_commit()
    else:
        current = _check_commit_files(store.path, problems, notes)
    record = record if record is not None else current
    arrays = chunks = 0
    if record is not None:
        found, arrays, chunks = _check_record(store, record, check_chunks=check_chunks, bad_nodes=bad_nodes)
        problems += found
        if store.path is not None and current is not None:
            try:
                now = read_commit_file(store.path)
            except (ValueError, TypeError, OSError):
                now = None
            if now is not None and now != current:
                # a run holding the store committed meanwhile; its new generation was not checked
                notes.append(
                    f"the store was committed again while it was checked (now step {now.step}); this report is about step {record.step}"
                )
    reported = {p.array for p in problems}
    for name, msg in bad_nodes.items():
        if name in reported:
            continue
        group = store.path is not None and name != "<root group>" and looks_like_group(store.path.joinpath(*name.split("/")))
        problems.append(Problem(f"group {name}", msg) if group else Problem(name, msg, array=name))
    return VerifyReport(str(store.path or "<memory>"), record, tuple(problems), tuple(notes), arrays, chunks, repair_at)


def check_state(store: TensorStore, record: CommitRecord, *, not_after: float | None = None) -> list[Problem]:
    """Damage to the state arrays ``record`` (a commit of ``store``) needs, every chunk read: the
    check `repair` makes before it restores a commit. ``not_after``: a chunk file modified after
    this time (unix seconds) is damage too (it holds a later step)."""
    return _check_record(store, record, check_chunks=True, bad_nodes=dict(store.metadata_problems()), not_after=not_after)[0]


# a data-parallel run's global record's state, every rank's shard of it: `mtc.shards.run_state_problems`
# bound to the run directory (the store layer knows no ranks: the caller wires it)
ShardState = Callable[[CommitRecord, float | None], list[Problem]]


def repair(store: TensorStore, *, shard_state: ShardState | None = None,
           in_run: tuple[Path, int, CommitRecord] | None = None) -> RepairReport:
    """Restore a missing or garbled ``commit.json`` of ``store`` (opened for writing) from ``commits.jsonl``.

    Picks the newest intact history record whose arrays verify; raises StoreError when there is
    none. When ``commit.json`` is intact its state is checked (every chunk's CRC): when that state
    is damaged it rolls back the same way to the newest earlier record whose state is whole;
    otherwise it only appends ``commit.json`` to a history that lacks it. A restored record older
    than the history's last is appended to the history too.

    A data-parallel run (see the module docstring): ``shard_state`` checks a global record's every
    shard (without it such a record's state is not checked); ``in_run``: ``store`` is rank r's
    shard store of run directory d, whose global record names its commit c, as ``(d, r, c)``.
    """
    p = store.path
    if p is None:
        raise StoreError("repair works on store directories; an in-memory store has no commit files")
    if store.read_only:
        raise StoreError(f"store {p} was opened read-only; repair needs TensorStore.open({str(p)!r}) (it takes the lock)")
    rewritten = _rewrite_group_metadata(store)
    if rewritten:
        report = repair(store, shard_state=shard_state, in_run=in_run)  # (then what else there is to do, if anything)
        rest = tuple(a.removesuffix("; nothing to repair") for a in report.actions)
        return RepairReport(tuple(rewritten) + rest, report.restored)
    try:
        current = read_commit_file(p)
        damage = "missing" if current is None else ""
    except (ValueError, TypeError) as e:
        current, damage = None, f"garbled ({e})"
    except OSError as e:
        current, damage = None, f"unreadable ({e})"
    if current is not None and _context_problem(p, current, read_history(p)) is not None:
        # the history's lines of this run cannot be read without it, and commit.json holds it whole
        try:
            restore_context(p, current)
        except OSError as e:
            raise StoreError(f"cannot repair store {p}: writing the context file of {COMMIT_FILE}'s record failed "
                             f"({os_error_message(e)})") from e
        if (still := _context_problem(p, current, read_history(p))) is not None:
            raise StoreError(f"cannot repair store {p}: {still.where} was rewritten but does not read back ({still.message}); "
                             "check the disk (dmesg)")
        report = repair(store, shard_state=shard_state, in_run=in_run)  # (then what else there is to do, if anything)
        rest = tuple(a.removesuffix("; nothing to repair") for a in report.actions)
        what = f"rewrote context file {CONTEXT_DIR}/{split_context(current)[2]}.json (the run's config and data identity) " \
               f"from {COMMIT_FILE}"
        return RepairReport((what, *rest), report.restored)
    history = [h for h in read_history(p) if h.record is not None]
    newest = history[-1].record if history else None
    bad_nodes = dict(store.metadata_problems())
    named = _check_run_commit(store, bad_nodes, in_run)  # (a rank's shard store: the commit its run resumes from is whole)
    if current is not None:
        damaged = [] if current == named else _state_problems(store, current, bad_nodes=bad_nodes, shard_state=shard_state)
        if not damaged:
            return _reconcile_history(store, current, history)
        # the last commit's state is damaged: no run can resume from it, so roll back to the newest
        # earlier commit whose state is whole (the other generation: a few steps of training lost)
        damage = f"intact, but step {current.step}'s state is damaged ({_first(damaged)})"
        history = [h for h in history if h.record.step < current.step]
    actions: list[str] = []
    starts = read_write_starts(p)
    for i in range(len(history) - 1, -1, -1):
        line, rec = history[i].line_no, history[i].record
        assert rec is not None
        later = [h.record for h in history[i + 1 :] if h.record is not None and h.record.step > rec.step]
        if current is not None:  # (rolling back: the damaged commit came after it too)
            later.append(current)
        if any(r.generation == rec.generation for r in later):
            newer = next(r for r in later if r.generation == rec.generation)
            actions.append(
                f"skipped step {rec.step} ({HISTORY_FILE} line {line}): its generation {rec.generation} was rewritten by step {newer.step}"
            )
            continue
        successor = min(later, key=lambda r: r.step, default=None)
        if successor is not None and starts is not None and written_since(starts, rec.step, rec.generation):
            actions.append(f"skipped step {rec.step} ({HISTORY_FILE} line {line}): the write log shows a later step's "
                           f"state written into its generation {rec.generation}")
            continue
        # without the write log, chunk files newer than the next commit tell it (file times: a plain
        # copy of the store resets them, and then this refuses what the log would have allowed)
        found = _state_problems(store, rec, bad_nodes=bad_nodes, shard_state=shard_state,
                                not_after=successor.time_unix if successor is not None and starts is None else None)
        if found:
            actions.append(f"skipped step {rec.step} ({HISTORY_FILE} line {line}): {_first(found)}")
            continue
        # a roll-back past the history's last record appends the restored one, so that the history
        # ends with the commit a resume uses (else `verify` took the record rolled back from for an
        # interrupted commit)
        back = rec != newest
        store.restore_commit(rec, append_to_history=back)
        lost = max(r.step for r in (current, newest) if r is not None) - rec.step
        actions.append(
            f"{COMMIT_FILE} was {damage}: restored it from {HISTORY_FILE} line {line}: step {rec.step}, "
            f"generation {rec.generation}, durability {rec.durability}"
            + (f"; training resumes from step {rec.step} (the {lost} step(s) since are lost)" if lost > 0 else "")
            + (f"; appended it to {HISTORY_FILE}, which ends with the commit a resume uses again" if back else "")
        )
        return RepairReport(tuple(actions), rec)
    why = "; ".join(actions) if actions else f"{HISTORY_FILE} has no intact record"
    raise StoreError(
        f"cannot repair store {p}: {COMMIT_FILE} is {damage} and no record in {HISTORY_FILE} has intact state ({why}); "
        "restore the store from a copy, or start over with `mtc train ... --overwrite`"
    )


def _names_shards(record: CommitRecord) -> bool:
    """Whether ``record`` is a data-parallel run's global record: its state is in the ranks' shard
    stores it names (`mtc.shards`), none of it in the run directory's store."""
    return isinstance(record.meta.get("shards"), dict)


def _state_problems(store: TensorStore, record: CommitRecord, *, bad_nodes: dict[str, str],
                    not_after: float | None = None, shard_state: ShardState | None = None) -> list[Problem]:
    """Damage to the state ``record`` needs, every chunk read: in ``store``, or, for a data-parallel
    run's global record, in every rank's shard store (``shard_state``: a roll-back of the run is
    only safe to a commit whose every shard is whole). ``bad_nodes`` and ``not_after`` as in
    `_check_record`."""
    if _names_shards(record) and shard_state is not None:
        return shard_state(record, not_after)
    return _check_record(store, record, check_chunks=True, bad_nodes=bad_nodes, not_after=not_after)[0]


def _check_run_commit(store: TensorStore, bad_nodes: dict[str, str],
                      in_run: tuple[Path, int, CommitRecord] | None) -> CommitRecord | None:
    """For a rank's shard store of a data-parallel run (``in_run``: its run directory, its rank,
    and the commit the run's global record names, the one a resume loads): that commit, checked
    whole; None for any other store. A damaged one raises: rolling back one shard alone leaves
    the run's record naming the damaged state, so only the run's repair can roll back (every
    shard alike)."""
    if in_run is None:
        return None
    run, rank, record = in_run
    found = _check_record(store, record, check_chunks=True, bad_nodes=bad_nodes)[0]
    if found:
        raise StoreError(
            f"cannot repair store {store.path} alone: it is rank {rank}'s shard store of the data-parallel run {run}, whose "
            f"commit record names this shard's step {record.step} (generation {record.generation}), and that state is damaged "
            f"({_first(found)}); run `mtc repair {run}`, which rolls every rank's shard back alike to the newest commit "
            "whose state is whole, if there is one"
        )
    return record


def _first(found: list[Problem]) -> str:
    """The first problem, and how many more there are."""
    return str(found[0]) + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")


def _rewrite_group_metadata(store: TensorStore) -> list[str]:
    """Rewrite the garbled ``zarr.json`` of groups below the root that still hold their child nodes
    (mtc's groups below the root carry no attributes: the plain group's metadata is all they had);
    what was done, one line each. A garbled root keeps the store's attributes: not rewritten here."""
    assert store.path is not None
    done = []
    for name, why in store.metadata_problems():
        d = store.path.joinpath(*name.split("/"))
        if name == "<root group>" or "does not parse" not in why or not looks_like_group(d):
            continue
        f = d / "zarr.json"
        tmp = f.with_name(f".zarr.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(GROUP_METADATA, indent=2))
        os.replace(tmp, f)
        done.append(f"rewrote {f}, a group's metadata that did not parse (the nodes below it were whole)")
    return done


def _reconcile_history(store: TensorStore, current: CommitRecord, history: list[HistoryLine]) -> RepairReport:
    """``commit.json`` is intact: append it to the history if the history lost it; else nothing."""
    records = [h.record for h in history if h.record is not None]
    if current in records[-2:]:
        return RepairReport((f"{COMMIT_FILE} is intact (step {current.step}); nothing to repair",), None)
    if not records or current.step > records[-1].step:
        store.restore_commit(current, append_to_history=True)
        return RepairReport((f"{COMMIT_FILE} is intact (step {current.step}); appended it to {HISTORY_FILE}, which lacked it",), None)
    what = (
        f"{COMMIT_FILE} is intact (step {current.step}) but {HISTORY_FILE} ends at step {records[-1].step}; "
        f"left both as they are ({COMMIT_FILE} is the authoritative one)"
    )
    return RepairReport((what,), None)


def _check_commit_files(p: Path, problems: list[Problem], notes: list[str]) -> CommitRecord | None:
    """Check commit.json and commits.jsonl; return the record whose arrays to check (None: none readable)."""
    history = read_history(p)
    try:
        current = read_commit_file(p)
        if current is None:
            problems.append(Problem(COMMIT_FILE, f"{p / COMMIT_FILE} is missing"))
    except (ValueError, TypeError, OSError) as e:
        current = None
        problems.append(Problem(COMMIT_FILE, f"{p / COMMIT_FILE} does not parse ({e})"))
    if current is not None and (bad := _context_problem(p, current, history)) is not None:
        problems.append(bad)
        history = read_history(p, known=current)  # its lines compare with commit.json as they would with the file whole
    for h in history:
        if h.record is None:
            what = "cannot be read" if h.context else "is torn or garbled"
            notes.append(f"{HISTORY_FILE} line {h.line_no} {what} ({h.error}); it is skipped")
    records = [h.record for h in history if h.record is not None]
    if current is None:
        if records:
            notes.append(f"checked the arrays of the last record of {HISTORY_FILE} (step {records[-1].step}) instead")
            return records[-1]
        return None
    if not records:
        problems.append(Problem(HISTORY_FILE, f"{p / HISTORY_FILE} has no intact record; {COMMIT_FILE} (step {current.step}) is not in it"))
    elif records[-1] == current:
        pass
    elif len(records) >= 2 and records[-2] == current and records[-1].step > current.step:
        notes.append(
            f"the last record of {HISTORY_FILE} (step {records[-1].step}) never became {COMMIT_FILE}: that commit was "
            f"interrupted; {COMMIT_FILE} (step {current.step}) is the one a resume uses"
        )
    else:
        last = records[-1]
        problems.append(  # (the history's damage: repair keeps commit.json, whose state it checks, and writes it back)
            Problem(
                HISTORY_FILE,
                f"{COMMIT_FILE} (step {current.step}, generation {current.generation}) disagrees with the last record of "
                f"{HISTORY_FILE} (step {last.step}, generation {last.generation})",
            )
        )
    return current


def _context_problem(p: Path, current: CommitRecord, history: list[HistoryLine]) -> Problem | None:
    """The problem when lines of ``history`` name the context of ``current`` (``commit.json``'s
    record) and its file is missing or damaged; None otherwise (a history written before the
    context files names none)."""
    digest = split_context(current)[2]
    if not any(h.context == digest for h in history):
        return None
    try:
        read_context(p, digest)
    except (ValueError, OSError) as e:
        return Problem(f"{CONTEXT_DIR}/{digest}.json", f"{e}: the history's records of this run cannot be read without it")
    return None


def _check_record(
    store: TensorStore, record: CommitRecord, *, check_chunks: bool, bad_nodes: dict[str, str], not_after: float | None = None
) -> tuple[list[Problem], int, int]:
    """Problems of the arrays ``record`` needs; and how many arrays and chunks were checked.

    ``bad_nodes`` maps a node whose metadata is damaged to its problem. ``not_after``: a chunk
    file modified after this time (unix seconds) is a problem too: it was written for a later
    step than ``record``.
    """
    required = REQUIRED_KINDS.get(record.durability)
    if required is None:
        return [Problem(COMMIT_FILE, f"unknown durability mode {record.durability!r}")], 0, 0
    g = record.generation
    names = set(store.array_names())
    layout = store.attributes().get(LAYOUT_ATTR)
    expect: dict[int, int | None]
    if _names_shards(record):  # a data-parallel run's record: none of its state is here (`mtc.shards.verify_sharded`)
        expect = {}
    elif isinstance(layout, dict) and isinstance(layout.get("numels"), list):
        expect = {i: n for i, n in enumerate(layout["numels"]) if isinstance(n, int) and n > 0}
    else:  # a store from before the layout was recorded: the layers that have any state array
        expect = {int(m.group(1)): None for n in names if (m := _STATE_NAME.fullmatch(n))}
    problems: list[Problem] = []
    if record.resume and store.path is not None:
        try:
            read_resume(store.path, record)
        except (ValueError, OSError) as e:
            where = RESUME_FILES[g] if g in (0, 1) else COMMIT_FILE
            problems.append(Problem(where, f"{e}; a resume from step {record.step} would not restore its RNG states"))
    arrays = chunks = 0
    for layer in sorted(expect):
        for kind in required:
            name = state_array_name(layer, kind, g)
            if name in bad_nodes:
                problems.append(Problem(name, bad_nodes[name], array=name))
                continue
            if name not in names:
                problems.append(
                    Problem(name, f"is missing (durability {record.durability!r} of step {record.step} needs it)", array=name)
                )
                continue
            info = store.array_info(name)
            arrays += 1
            if expect[layer] is not None and info.shape != (expect[layer],):
                problems.append(Problem(name, f"has shape {info.shape}, the layout records ({expect[layer]},)", array=name))
                continue
            if not check_chunks:
                continue
            chunks += info.n_chunks
            problems += [Problem(name, msg, array=name, chunk=c) for c, msg in store.check_array(name)]
            if not_after is not None and store.path is not None:
                for c in range(info.n_chunks):
                    path = store.chunk_path(name, c)
                    try:
                        newer = path is not None and path.stat().st_mtime > not_after
                    except FileNotFoundError:
                        continue  # reported as missing by check_array
                    if newer:
                        what = f"chunk file {path} was written after the next commit: it holds a later step"
                        problems.append(Problem(name, what, array=name, chunk=c))
                        break
    return problems, arrays, chunks
