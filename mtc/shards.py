"""Per-rank shard stores of a data-parallel run, its one global commit, and resharding.

Layout. With world size N > 1 the run directory RUN keeps the plan, logs and the *global* commit
record (``RUN/commit.json``); each rank r keeps its contiguous shard ``[lo, hi)`` of every layer's
master, m and v (both generations, the single-process array names, shape ``(hi - lo,)``) in its
own store ``RUN/ranks/rank-r-of-N/`` (or where ``--rank-dir`` puts it, e.g. node-local disks: see
`mtc.rank_dirs`; the global record names each shard's directory) with its own per-rank commit record. A step is committed
when (1) every rank's generation is written and its per-rank record is durable, (2) the ranks
agree that all of them succeeded (one all-gather of each rank's record digest), (3) rank 0 writes
the global record naming step, generation, world size and each shard's digest, and (4) a barrier
releases the ranks: no rank writes into the other generation before the global record names the
new one, so the generation the global record names is intact on every rank whatever rank dies
when. Resume (`check_shard`): each rank's store must hold a per-rank record of the global step and
generation with the digest the global record names; a missing or stale shard is one StoreError.

A store written at world size 1 (or seeded by an import) holds full arrays in RUN itself; any world
size opens it (each rank reads its range). A sharded store opens only at its world size;
`reshard` rewrites it for another one (M = 1: the single-process layout), bit-identically, and
makes that a new global commit of the same step. The full arrays in RUN are deleted once no record
a resume or a roll-back may use reads them (`drop_root_state`): by `reshard` after its commit, by
a run resumed on N ranks after its second commit (until then `mtc repair` may roll back to the
single-process one).

Verify and repair: a shard store's own last commit may be a step the run never committed (a rank
died during the global commit), so `verify_sharded` checks each shard's state of the commit the
global record names, and `mtc repair RUN` rolls the global record back only to a commit whose
every shard is whole (`run_state_problems`); a shard store is not rolled back alone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch

from mtc import rank_dirs
from mtc.errors import StoreError
from mtc.store import LAYOUT_ATTR, STATE_DTYPE, CommitRecord, TensorStore, state_array_name
from mtc.store.verify import REQUIRED_KINDS, Problem, check_state

__all__ = ["RANKS_DIR", "StateReader", "check_shard", "digest", "is_sharded", "layer_ranges", "open_rank_store", "rank_dir",
           "read_layer", "require_visible", "reshard", "shard_dir", "shard_world"]

RANKS_DIR = "ranks"


def rank_dir(root: Path, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` keeps its shard store by default (see `mtc.rank_dirs`)."""
    return rank_dirs.default_dir(root, rank, world_size)


def shard_dir(root: Path, record: CommitRecord, rank: int) -> Path:
    """Rank ``rank``'s shard store as the global ``record`` names it, seen from this process."""
    return rank_dirs.located(root, record.meta["shards"]["ranks"][rank]["dir"])


def require_visible(root: Path, record: CommitRecord, what: str) -> list[Path]:
    """Every shard directory ``record`` names, or one StoreError saying that ``what`` needs them
    all on this machine (node-local shards of a multi-node run)."""
    paths = [shard_dir(root, record, r) for r in range(shard_world(record))]
    gone = [(r, p) for r, p in enumerate(paths) if not p.is_dir()]
    if gone:
        r, p = gone[0]
        more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
        raise StoreError(f"rank {r}'s shard store {p}{more}, named by {root}'s commit record, is not visible here: {what} reads "
                         "every rank's shard, so all of them must be on this machine; copy or mount the node-local shard "
                         "directories at those paths (the record names each as its rank saw it) and run it again")
    return paths


def digest(record: CommitRecord) -> str:
    """A short identity of a per-rank commit record (its JSON line, time included)."""
    return hashlib.sha256(record.to_json().encode()).hexdigest()[:16]


def is_sharded(record: CommitRecord | None) -> bool:
    """Whether ``record`` names per-rank shard stores (else the state is in the run directory)."""
    return record is not None and isinstance(record.meta.get("shards"), dict)


def shard_world(record: CommitRecord) -> int:
    """The world size whose shard stores ``record`` names (1: the single-process layout)."""
    return int(record.meta["shards"]["world_size"]) if is_sharded(record) else 1


def layer_ranges(numels: list[int], rank: int, world_size: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s ``(lo, hi)`` of every layer (the split of `mtc.runtime.collectives.shard_range`)."""
    out = []
    for n in numels:
        per = -(-n // world_size) if n else 0
        out.append((min(rank * per, n), min((rank + 1) * per, n)))
    return out


def layer_kinds(tier: str, durability: str) -> tuple[str, ...]:
    """The state arrays a layer in ``tier`` keeps in the store (`mtc.runtime.tiers.state_kinds`):
    a disk layer always all three (the store is its tier), any other what the durability keeps."""
    return ("master", "m", "v") if tier == "disk" else REQUIRED_KINDS[durability]


def stored_placement(st: TensorStore, n_layers: int) -> list[str]:
    """The placement a store's layout records (``ram`` for every layer where it records none)."""
    layout = st.attributes().get(LAYOUT_ATTR)
    placement = layout.get("placement") if isinstance(layout, dict) else None
    if isinstance(placement, list) and len(placement) == n_layers:
        return [str(t) for t in placement]
    return ["ram"] * n_layers


def open_rank_store(root: Path, rank: int, world_size: int, numels: list[int], durability: str, *, io_threads: int,
                    fresh: bool, placement: list[str] | None = None, disk_chunk_rows: int | None = None,
                    path: Path | None = None, template: str | None = None) -> TensorStore:
    """This rank's shard store at ``path`` (default: under the run directory; ``template``: the
    --rank-dir it came from), created (``fresh``: a new run, or a single-process store opened at
    this world size) with both generations of its shard arrays, else opened. ``placement``
    (default all ``ram``): which arrays each layer keeps (`layer_kinds`); an opened store gains the
    arrays a changed placement needs. ``disk_chunk_rows``: the chunk of disk layers' arrays
    (default the store's)."""
    path = rank_dir(root, rank, world_size) if path is None else Path(path)
    placement = placement if placement is not None else ["ram"] * len(numels)
    ranges = layer_ranges(numels, rank, world_size)
    where = {"run": os.path.abspath(root), "dir": rank_dirs.recorded_form(root, path), "template": template}
    if not fresh:
        if not (path / "commit.json").exists():
            raise StoreError(rank_dirs.missing_text(rank, path, template, None))
        st = TensorStore.open(path, io_threads=io_threads)
    else:
        rank_dirs.check_owner(path, root, _attributes(path))
        st = TensorStore.create(path, io_threads=io_threads, overwrite=True)
    try:
        if not st.read_only:
            if st.attributes().get(rank_dirs.SHARD_DIR_ATTR) != where:  # new, moved, or the run directory was: record it
                st.set_attribute(rank_dirs.SHARD_DIR_ATTR, where)
            st.set_attribute(LAYOUT_ATTR, {"numels": [hi - lo for lo, hi in ranges], "compute_dtype": None,
                                           "placement": list(placement), "shard": {"rank": rank, "world_size": world_size,
                                                                                   "ranges": ranges}})
        for i, (lo, hi) in enumerate(ranges):
            if hi > lo:
                for k in layer_kinds(placement[i], durability):
                    for g in (0, 1):
                        if not st.has_array(state_array_name(i, k, g)):
                            st.create_array(state_array_name(i, k, g), (hi - lo,), STATE_DTYPE,
                                            chunk_rows=disk_chunk_rows if placement[i] == "disk" else None)
    except BaseException:
        st.close()
        raise
    return st


def _attributes(path: Path) -> dict | None:
    """The root attributes of the store at ``path`` (None: no readable store there)."""
    if not (path / "zarr.json").is_file():
        return None
    try:
        with TensorStore.open(path, read_only=True) as st:
            return st.attributes()
    except Exception:  # noqa: BLE001 - not a store mtc can read: treated as foreign files
        return None


def rank_record(step: int, gen: int, cursor: int, config: dict, durability: str, rank: int, world_size: int) -> CommitRecord:
    """The per-rank commit record of ``step`` (what the global record's digest names)."""
    return CommitRecord(step=step, generation=gen, data_cursor=cursor, rng_state={}, config=config, time_unix=time.time(),
                        durability=durability, meta={"rank": rank, "world_size": world_size})


def shards_meta(world_size: int, digests: list[str], dirs: list[str] | None = None, template: str | None = None) -> dict:
    """The global record's ``meta["shards"]``: the world size, the --rank-dir template (None: the
    default layout) and each rank's directory (`mtc.rank_dirs.recorded_form`) and digest."""
    dirs = dirs or [f"{RANKS_DIR}/rank-{r}-of-{world_size}" for r in range(world_size)]
    return {"world_size": world_size, "template": template,
            "ranks": [{"rank": r, "dir": dirs[r], "digest": d} for r, d in enumerate(digests)]}


def check_shard(root: Path, record: CommitRecord, rank: int, st: TensorStore) -> CommitRecord:
    """Refuse to resume rank ``rank`` unless its shard store holds ``record``'s step and generation,
    written by the commit the global record names (one StoreError line otherwise). Returns that
    per-rank commit: the one whose state a resume loads, which need not be the shard store's last
    (a rank that committed its shard of a step the run never committed is ahead of the record)."""
    entry = record.meta["shards"]["ranks"][rank]
    mine = [r for r in st.commit_history() if r.step == record.step and r.generation == record.generation]
    named = [r for r in mine if digest(r) == entry["digest"]]
    if not named:
        last = st.last_commit()
        what = f"its last commit is step {last.step}" if last is not None else "it has no commit"
        raise StoreError(f"rank {rank}'s shard store {st.path} is stale: the run's commit record names step {record.step} "
                         f"(generation {record.generation}) with shard digest {entry['digest']}, but {what} and no record "
                         "matches; restore that directory from the same run (or relaunch on the nodes that hold it)")
    later = [r for r in st.commit_history() if r.step > record.step and r.generation == record.generation]
    if later:
        raise StoreError(f"rank {rank}'s shard store {st.path} overwrote generation {record.generation} at step {later[-1].step}, "
                         f"after the step {record.step} the run's commit record names: the run directory's commit.json is "
                         "stale; check that every node sees the same run directory")
    return named[-1]


def read_layer(root: Path, record: CommitRecord, layer: int, kind: str, numel: int, *, root_store: TensorStore | None = None,
               io_threads: int = 4) -> torch.Tensor:
    """Layer ``layer``'s whole ``kind`` array of ``record``'s generation, assembled from the
    shard stores ``record`` names (or read from the run directory's store)."""
    if not is_sharded(record) and root_store is None:
        with TensorStore.open(root, read_only=True, io_threads=io_threads) as st, StateReader(root, record, root_store=st) as reader:
            return reader.read(layer, kind, numel)
    with StateReader(root, record, root_store=root_store, io_threads=io_threads) as reader:
        return reader.read(layer, kind, numel)


class StateReader:
    """The state of one commit ``record``, layer by layer: assembled from the shard stores a
    data-parallel run's record names (kept open, each checked against the record), or read from
    ``root_store``, the run directory's store, for the single-process layout. Read-only, so it
    works beside a training run; ``what`` names the reader in the error when a shard is not visible."""

    def __init__(self, root: Path, record: CommitRecord, *, root_store: TensorStore | None = None, io_threads: int = 4,
                 what: str = "reading the weights") -> None:
        self.record, self.world, self.root_store = record, shard_world(record), root_store
        self._stores: list[TensorStore] = []
        if not is_sharded(record):
            if root_store is None:
                raise ValueError("a single-process layout is read from the run directory's store: pass root_store")
            return
        try:
            for r, p in enumerate(require_visible(Path(root), record, what)):
                self._stores.append(TensorStore.open(p, read_only=True, io_threads=io_threads))
                check_shard(Path(root), record, r, self._stores[-1])
        except BaseException:
            self.close()
            raise

    def read_into(self, layer: int, kind: str, out: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s whole ``kind`` array of the record's generation into ``out`` (flat fp32)."""
        name = state_array_name(layer, kind, self.record.generation)
        if not self._stores:
            self.root_store.read_into(name, out)
            return out
        for r, st in enumerate(self._stores):
            lo, hi = layer_ranges([out.numel()], r, self.world)[0]
            if hi > lo:
                st.read_into(name, out[lo:hi])
        return out

    def read(self, layer: int, kind: str, numel: int) -> torch.Tensor:
        """Layer ``layer``'s whole ``kind`` array of the record's generation (a new tensor)."""
        return self.read_into(layer, kind, torch.empty(numel, dtype=STATE_DTYPE))

    def close(self) -> None:
        """Close the shard stores."""
        for st in self._stores:
            st.close()
        self._stores = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reshard(root: Path, world_size: int, *, template: str | None = None, io_threads: int = 4,
            log: Callable[[str], None] | None = None) -> CommitRecord:
    """Rewrite the state of run ``root``'s last commit for ``world_size`` ranks (1: the
    single-process layout in ``root``), bit-identically, and commit it as a new global record of
    the same step. ``template``: where the new shard stores go (``--rank-dir`` with ``{rank}`` and
    ``{world_size}`` only; default: under ``root``). Every old shard must be visible here. The old
    layout stays valid until that commit; after it, its shard stores are removed, or, from the
    single-process layout, the run directory's state arrays (`drop_root_state`)."""
    from mtc.errors import ConfigError
    from mtc.plan import load_plan

    root = Path(root)
    if world_size < 1:
        raise StoreError(f"--world-size must be at least 1, got {world_size}")
    if template is not None:
        if world_size == 1:
            raise ConfigError("--rank-dir: at world size 1 the state goes into the run directory itself; drop --rank-dir")
        rank_dirs.check_reshard_template(template)
    with TensorStore.open(root) as st:  # the lock: no run may commit meanwhile
        last = st.last_commit()
        if last is None:
            raise StoreError(f"store {root} has no commit to reshard")
        old = shard_world(last)
        if old == world_size and (not is_sharded(last) or template == last.meta["shards"].get("template")):
            if is_sharded(last) and drop_root_state(st, last):  # left by a reshard or resume stopped before it did
                if log:
                    log(f"{root} is already laid out for world size {world_size}; removed the single-process state arrays "
                        "no commit reads any more")
            elif log:
                log(f"{root} is already laid out for world size {world_size}; nothing to do")
            return last
        old_dirs = require_visible(root, last, "mtc reshard") if is_sharded(last) else []
        new_dirs = [rank_dirs.resolve(template, root, rank_dirs.Place(r, world_size)) for r in range(world_size)]
        clash = {os.path.realpath(p) for p in new_dirs} & {os.path.realpath(p) for p in old_dirs}
        if world_size > 1 and clash:
            raise ConfigError(f"--rank-dir {template!r} gives {min(clash)}, which holds a shard of the current layout; the "
                              "old shards stay valid until the new commit, so the new ones need other directories "
                              "(e.g. put {world_size} in the template)")
        program = load_plan(root / "plan")
        numels = [program.layer_numel(i) for i in range(program.n_layers)]
        # disk-tier layers keep m and v whatever the durability: carry what each layer keeps
        if is_sharded(last):
            with TensorStore.open(old_dirs[0], read_only=True) as rs:
                placement = stored_placement(rs, len(numels))
        else:
            placement = stored_placement(st, len(numels))
        gen = last.generation
        targets: list[TensorStore] = []
        # every old shard is checked against the record here, before anything is written
        reader = StateReader(root, last, io_threads=io_threads, what="mtc reshard") if is_sharded(last) else None
        try:
            if world_size > 1:
                for r, p in enumerate(new_dirs):
                    targets.append(open_rank_store(root, r, world_size, numels, last.durability, io_threads=io_threads,
                                                   fresh=True, placement=placement, path=p, template=template))
            else:  # the full arrays in the run directory (generation `gen` is unused while the state is sharded)
                st.set_attribute(LAYOUT_ATTR, {"numels": numels, "compute_dtype": None, "placement": placement})
                for i, n in enumerate(numels):
                    for k in layer_kinds(placement[i], last.durability):
                        for g in (0, 1):
                            name = state_array_name(i, k, g)
                            if n and not st.has_array(name):
                                st.create_array(name, (n,), STATE_DTYPE)
            for i, n in enumerate(numels):
                if not n:
                    continue
                for k in layer_kinds(placement[i], last.durability):
                    full = reader.read(i, k, n) if reader is not None else st.read(state_array_name(i, k, gen))
                    if world_size == 1:
                        st.write(state_array_name(i, k, gen), full)
                        continue
                    for r, ts in enumerate(targets):
                        lo, hi = layer_ranges([n], r, world_size)[0]
                        if hi > lo:
                            ts.write(state_array_name(i, k, gen), full[lo:hi].clone())
            digests = []
            for r, ts in enumerate(targets):
                rec = rank_record(last.step, gen, last.data_cursor, last.config, last.durability, r, world_size)
                ts.commit(rec)
                digests.append(digest(rec))
        finally:
            for ts in targets:
                ts.close()
            if reader is not None:
                reader.close()
        meta = {k: v for k, v in last.meta.items() if k not in ("shards", "world_size")}
        if world_size > 1:
            meta.update(shards=shards_meta(world_size, digests, [rank_dirs.recorded_form(root, p) for p in new_dirs], template),
                        world_size=world_size)
        meta["resharded_from"] = old
        new = CommitRecord(step=last.step, generation=gen, data_cursor=last.data_cursor, rng_state=last.rng_state,
                           config=last.config, time_unix=time.time(), extra=last.extra, durability=last.durability, meta=meta)
        st.commit(new)
        if world_size > 1:  # the single-process arrays: the durable record above no longer reads them
            drop_root_state(st, new)
    for p in old_dirs:  # no record names them any more
        shutil.rmtree(p, ignore_errors=True)
    if log:
        log(f"resharded {root} at step {last.step} from world size {old} to {world_size}")
    return new


# -- the trainer's side (called by mtc.train on a data-parallel run) ----------------------------


def committer(root_st: TensorStore, shard_st: TensorStore, rank: int, world_size: int,
              make_record: Callable[[int], CommitRecord]) -> Callable[[int, BaseException | None], None]:
    """The global commit of one step, run by every rank once its writes of generation ``gen``
    ended (``error``: how they failed): per-rank record, agreement, rank 0's global record, barrier.
    ``make_record(gen)`` builds the global record (without its shard names)."""
    import torch.distributed as dist

    from mtc.dist import groups
    from mtc.runtime.collectives import collective

    # where this rank's shard lies, as the record names it (set by open_rank_store)
    where = shard_st.attributes().get(rank_dirs.SHARD_DIR_ATTR) or {"dir": f"{RANKS_DIR}/rank-{rank}-of-{world_size}"}

    def commit(gen: int, error: BaseException | None) -> None:
        record = make_record(gen)
        mine: object = ""
        if error is None:
            try:
                rec = rank_record(record.step, gen, record.data_cursor, record.config, record.durability, rank, world_size)
                shard_st.commit(rec)
                mine = [digest(rec), where["dir"], where.get("template")]
            except Exception as e:  # noqa: BLE001 - still take part below, so the other ranks learn of it at once
                error = e
        got: list[object] = [None] * world_size
        collective(f"step {record.step}'s shard agreement", dist.all_gather_object, got, mine, group=groups().commit)
        if not all(got):
            if error is not None:
                raise error
            bad = [r for r, d in enumerate(got) if not d]
            raise StoreError(f"rank(s) {bad} could not write their shard of step {record.step} (see their error); the run's "
                             "last commit is unchanged: fix that and relaunch the same command to resume from it")
        if rank == 0:
            meta = dict(record.meta, shards=shards_meta(world_size, [d[0] for d in got], [d[1] for d in got], got[0][2]),
                        world_size=world_size)
            new = CommitRecord(step=record.step, generation=gen, data_cursor=record.data_cursor, rng_state=record.rng_state,
                               config=record.config, time_unix=record.time_unix, extra=record.extra,
                               durability=record.durability, meta=meta)
            before = root_st.last_commit(rng=False) if root_st.path is not None and (root_st.path / "layers").is_dir() else None
            root_st.commit(new)
            if is_sharded(before):
                # a single-process store resumed on these ranks (`start_state`): its arrays were kept
                # until the records a resume or a roll-back may use, this one and the one before, are
                # both sharded
                drop_root_state(root_st, new)
        # nobody writes the other generation before the global record names this one
        collective(f"step {record.step}'s commit barrier", dist.barrier, group=groups().commit)

    return commit


def this_rank_dir(root: Path, template: str | None, last: CommitRecord | None, rank: int, world_size: int) -> tuple[Path, str | None]:
    """This rank's shard directory and the template it comes from (``template``: the launch's
    --rank-dir; None: the one the run's record names, else the default). Collective: refuses a
    directory another rank on this host also got, and a resumed shard that is not there."""
    import torch.distributed as dist

    from mtc.dist import groups
    from mtc.runtime.collectives import collective

    if template is None and is_sharded(last):
        template = last.meta["shards"].get("template")
    path = rank_dirs.resolve(template, root, rank_dirs.place_from_env(rank, world_size))
    seen: list[object] = [None] * world_size
    collective("the shard directory check", dist.all_gather_object, seen, (socket.gethostname(), os.path.realpath(path)),
               group=groups().startup)
    rank_dirs.duplicates(seen, template)
    if is_sharded(last) and shard_world(last) == world_size and not (path / "commit.json").exists():
        raise StoreError(rank_dirs.missing_text(rank, path, template, shard_dir(root, last, rank)))
    return path, template


def start_state(root: Path, root_st: TensorStore, program: object, tiers: object, rank: int, world_size: int, last: CommitRecord | None,
                params: dict[str, torch.Tensor] | None, first: CommitRecord, io_threads: int) -> tuple[TensorStore, CommitRecord]:
    """Fill this rank's sharded tiers and open its shard store: a new run takes rank 0's initial
    weights (broadcast layer by layer) and commits them as step 0 on every rank; a resumed run
    loads its shard (checked against the global record); a single-process store is read from the
    run directory (each rank its range). Returns the shard store and the record started from."""
    import torch.distributed as dist

    from mtc.dist import groups
    from mtc.runtime.collectives import collective
    from mtc.runtime.pinned import host_buffer
    from mtc.runtime.state import flatten_layer
    from mtc.runtime.tiers import DISK_CHUNK_NUMEL, zero_moments

    numels = [program.layer_numel(i) for i in range(program.n_layers)]
    durability = first.durability if last is None else last.durability
    placement = list(tiers.placement)
    rows = None if tiers.disk_chunk_numel == DISK_CHUNK_NUMEL else tiers.disk_chunk_numel  # as `StateTiers.create_arrays`
    path, template = this_rank_dir(root, first.config.get("rank_dir"), last, rank, world_size)
    if last is not None and is_sharded(last):
        if shard_world(last) != world_size:
            raise StoreError(f"store {root} was last committed at world size {shard_world(last)}, this launch has {world_size} "
                             f"ranks: run `mtc reshard {root} --world-size {world_size}` first (or launch {shard_world(last)} ranks)")
        st = open_rank_store(root, rank, world_size, numels, durability, io_threads=io_threads, fresh=False,
                             placement=placement, disk_chunk_rows=rows, path=path, template=template)
        try:
            check_shard(root, last, rank, st)
            for s in tiers.layers:
                lo, hi = s.shard if s.shard is not None else (0, 0)
                if s.numel and s.tier == "disk" and durability != "full" and hi > lo:
                    # a commit without moments restarts Adam (`StreamingAdamW.moments_from`): a disk
                    # layer's m and v start at zero, as in RAM (and as a single process's: `zero_moments`)
                    zero_moments(st, s.layer, last.generation)
                if not s.numel or s.tier == "disk":  # a disk layer's shard is read from the store each step
                    continue
                for t in (s.master, s.m, s.v):
                    t.zero_()
                for k in layer_kinds(s.tier, durability):
                    if hi > lo:
                        dst = {"master": s.master, "m": s.m, "v": s.v}[k][: hi - lo]
                        name = state_array_name(s.layer, k, last.generation)
                        if dst.device.type == "cpu":
                            st.read_into(name, dst)
                        else:  # a gpu-tier shard: through host memory
                            dst.copy_(st.read(name))
            # every rank's compute copy is the whole layer: all-gather the master shards once (in
            # host memory over gloo; a gpu layer's copy then goes to the device)
            for s in tiers.layers:
                if s.numel:
                    per = -(-s.numel // world_size)
                    out = s.compute if s.compute.device.type == "cpu" else torch.empty(s.compute.numel(), dtype=s.compute.dtype)
                    parts = [out[r * per : (r + 1) * per] for r in range(world_size)]
                    if s.tier == "disk":  # its master shard, read for the gather only (one shard in RAM at a time)
                        lo, hi = s.shard
                        master = host_buffer(per, STATE_DTYPE, pinned=False)  # zeros, page-aligned for the store
                        if hi > lo:
                            st.read_into(state_array_name(s.layer, "master", last.generation), master[: hi - lo])
                    else:
                        master = s.master
                    src = master.to("cpu", s.compute.dtype)
                    collective(f"layer {s.layer}'s start all-gather", dist.all_gather, parts, src, group=groups().startup)
                    if out is not s.compute:
                        s.compute.copy_(out)
        except BaseException:
            st.close()
            raise
        return st, last
    st = open_rank_store(root, rank, world_size, numels, durability, io_threads=io_threads, fresh=True, placement=placement,
                         disk_chunk_rows=rows, path=path, template=template)
    try:
        if last is not None:  # the single-process layout: each rank reads its range of the full arrays
            tiers.load(root_st, last.generation, durability)
            _copy_disk_shards(root_st, st, tiers, last.generation, durability)
            return st, last
        for s in tiers.layers:
            if not s.numel:
                continue
            flat = flatten_layer(program, s.layer, params) if rank == 0 else torch.empty(s.numel, dtype=STATE_DTYPE)
            flat = flat.to(STATE_DTYPE).contiguous()
            collective(f"layer {s.layer}'s initial weights", dist.broadcast, flat, src=0, group=groups().startup)
            tiers.set_layer(s.layer, flat)
            lo, hi = s.shard
            if hi > lo:
                # page-aligned copies (the store writes them with O_DIRECT; torch's memory went through
                # the I/O threads' bounce buffers), the zeros a never-written mapping for m and v both
                master = host_buffer(hi - lo, STATE_DTYPE, pinned=False).copy_(flat[lo:hi])
                zeros = host_buffer(hi - lo, STATE_DTYPE, pinned=False)
                for k in layer_kinds(s.tier, durability):
                    st.write(state_array_name(s.layer, k, 0), master if k == "master" else zeros)
        committer(root_st, st, rank, world_size, lambda gen: first)(0, None)
    except BaseException:
        st.close()
        raise
    return st, first


def _copy_disk_shards(root_st: TensorStore, st: TensorStore, tiers: object, gen: int, durability: str) -> None:
    """A single-process store opened on several ranks: each disk layer's range of the full arrays
    of generation ``gen`` into this rank's shard store (the disk tier reads it from there); moments
    the commit does not keep (``durability`` weights: a ram layer's were never stored, a disk
    layer's arrays hold no committed step's) start at zero, as a single-process resume starts them."""
    from mtc.runtime.pinned import host_buffer

    for s in tiers.layers:
        if s.tier != "disk" or not s.numel or s.shard[1] == s.shard[0]:
            continue
        lo, hi = s.shard
        for k in ("master", "m", "v"):
            name = state_array_name(s.layer, k, gen)
            buf = host_buffer(hi - lo, STATE_DTYPE, pinned=False)  # zeros, page-aligned: written with O_DIRECT
            if k == "master" or (durability == "full" and root_st.has_array(name)):
                root_st.read_rows_into(name, lo, buf)
            st.write(name, buf)


def verify_sharded(root: Path, record: CommitRecord) -> tuple[bool, list[str]]:
    """`mtc verify` of a sharded run: every shard store the global ``record`` names must hold the
    step and digest ``record`` names, and is verified: its commit files, and the arrays and chunks
    of that per-rank commit (the one a resume loads: a rank may have committed its shard of a later
    step the run never committed, into the other generation). The advice names the run's repair."""
    from mtc.store import verify

    ok, lines = True, [f"global commit: step {record.step}, generation {record.generation}, world size {shard_world(record)}"]
    for r in range(shard_world(record)):
        path = shard_dir(root, record, r)
        if not (path / "commit.json").is_file():
            ok = False
            lines.append(f"rank {r}: damaged or not visible here: {path} holds no shard store (node-local shards: verify where "
                         "every rank's directory is mounted at the path the record names)")
            continue
        try:
            with TensorStore.open(path, read_only=True) as st:
                report = verify(st, record=check_shard(root, record, r, st), repair_at=str(root))
        except StoreError as e:
            ok = False
            lines.append(f"rank {r}: damaged: {e}")
            continue
        ok = ok and report.ok
        lines += [f"rank {r}: {line}" for line in report.lines()]
    return ok, lines


def run_state_problems(root: Path, record: CommitRecord, not_after: float | None = None) -> list[Problem]:
    """Damage to the state of the data-parallel run ``root``'s global ``record``, every rank's shard
    of it (every chunk read): a shard store not visible here, not holding the commit ``record``
    names or overwritten since (`check_shard`), or damaged. ``not_after``: a chunk file modified
    after this time (unix seconds) holds a later step. `mtc repair` of the run restores a commit
    only when this finds nothing."""
    out: list[Problem] = []
    for r in range(shard_world(record)):
        path = shard_dir(root, record, r)
        try:
            with TensorStore.open(path, read_only=True) as st:
                mine = check_shard(root, record, r, st)
                out += [Problem(f"rank {r}'s shard store {path}", str(p)) for p in check_state(st, mine, not_after=not_after)]
        except StoreError as e:
            out.append(Problem(f"rank {r}'s shard store {path}", str(e)))
    return out


def named_in_run(st: TensorStore) -> tuple[Path, int, CommitRecord] | None:
    """For a rank's shard store: its run directory, its rank, and its per-rank commit that the
    run's global record names (the one a resume loads). None for any other store, and where the
    run's record cannot be read or does not name this store (then the run's repair or resume says
    what is wrong)."""
    from mtc.store.directory import read_commit_file

    where, layout = st.attributes().get(rank_dirs.SHARD_DIR_ATTR), st.attributes().get(LAYOUT_ATTR)
    if st.path is None or not isinstance(where, dict) or not isinstance(layout, dict) or not isinstance(layout.get("shard"), dict):
        return None
    rank, form = layout["shard"].get("rank"), Path(str(where.get("dir")))
    # a shard inside its run directory is named relative to it (the run may have been copied or
    # moved with it); one elsewhere (--rank-dir) by the run directory it was made for
    inside = not form.is_absolute() and st.path.parts[-len(form.parts):] == form.parts
    run = st.path.parents[len(form.parts) - 1] if inside else Path(str(where.get("run")))
    try:
        record = read_commit_file(run)
        if not is_sharded(record) or not isinstance(rank, int) or not 0 <= rank < shard_world(record):
            return None
        if os.path.realpath(shard_dir(run, record, rank)) != os.path.realpath(st.path):
            return None  # a shard of another layout (a reshard moved the state)
        return run, rank, check_shard(run, record, rank, st)
    except (StoreError, ValueError, TypeError, KeyError, OSError):
        return None


def drop_root_state(st: TensorStore, record: CommitRecord) -> bool:
    """Delete the run directory's state arrays (``layers/``: a single-process layout's master, m
    and v, both generations) once ``record``, its durable last commit, names shard stores: no
    resume reads them any more, and they are the size of the whole optimizer state (~190 GB for
    an 8B model). The plan, the commit history, the resume and context files stay. Returns
    whether there were any. Idempotent: a crash part-way leaves arrays no record reads, and
    `mtc verify` does not check them (a sharded record has no state in the run directory)."""
    assert is_sharded(record) and st.path is not None, "the run directory's state is dropped behind a sharded commit only"
    layers = st.path / "layers"
    if not layers.is_dir() or layers.is_symlink():
        return False
    inside = [p for p in (shard_dir(st.path, record, r) for r in range(shard_world(record)))
              if os.path.realpath(p).startswith(os.path.realpath(layers) + os.sep)]
    if inside:  # (a --rank-dir inside it: its shards are the run's state now)
        return False
    if isinstance(st.attributes().get(LAYOUT_ATTR), dict):
        st.set_attribute(LAYOUT_ATTR, None)  # as a run started on several ranks: the run directory has no layout
    shutil.rmtree(layers)
    return True
