"""Per-rank shard stores of a data-parallel run, its one global commit, and resharding.

Layout. With world size N > 1 the run directory RUN keeps the plan, logs and the *global* commit
record (``RUN/commit.json``); each rank r keeps its contiguous shard ``[lo, hi)`` of every layer's
master, m and v (both generations, the single-process array names, shape ``(hi - lo,)``) in its
own store ``RUN/ranks/rank-r-of-N/`` with its own per-rank commit record. A step is committed
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
makes that a new global commit of the same step.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mtc.errors import StoreError
from mtc.store import LAYOUT_ATTR, STATE_DTYPE, CommitRecord, TensorStore, state_array_name
from mtc.store.verify import REQUIRED_KINDS

__all__ = ["RANKS_DIR", "check_shard", "digest", "is_sharded", "layer_ranges", "open_rank_store", "rank_dir", "read_layer",
           "reshard", "shard_world"]

RANKS_DIR = "ranks"


def rank_dir(root: Path, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` keeps its shard store."""
    return Path(root) / RANKS_DIR / f"rank-{rank}-of-{world_size}"


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
                    fresh: bool, placement: list[str] | None = None, disk_chunk_rows: int | None = None) -> TensorStore:
    """This rank's shard store, created (``fresh``: a new run, or a single-process store opened
    at this world size) with both generations of its shard arrays, else opened. ``placement``
    (default all ``ram``): which arrays each layer keeps (`layer_kinds`); an opened store gains the
    arrays a changed placement needs. ``disk_chunk_rows``: the chunk of disk layers' arrays
    (default the store's)."""
    path = rank_dir(root, rank, world_size)
    placement = placement if placement is not None else ["ram"] * len(numels)
    ranges = layer_ranges(numels, rank, world_size)
    if not fresh:
        if not (path / "commit.json").exists():
            raise StoreError(f"rank {rank}'s shard store {path} is missing or was never committed; the run's commit "
                             "record names it. Restore that directory (node-local disk: relaunch on the same nodes), "
                             "or start over with --overwrite")
        st = TensorStore.open(path, io_threads=io_threads)
    else:
        st = TensorStore.create(path, io_threads=io_threads, overwrite=True)
    try:
        if not st.read_only:
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


def rank_record(step: int, gen: int, cursor: int, config: dict, durability: str, rank: int, world_size: int) -> CommitRecord:
    """The per-rank commit record of ``step`` (what the global record's digest names)."""
    return CommitRecord(step=step, generation=gen, data_cursor=cursor, rng_state={}, config=config, time_unix=time.time(),
                        durability=durability, meta={"rank": rank, "world_size": world_size})


def shards_meta(world_size: int, digests: list[str]) -> dict:
    """The global record's ``meta["shards"]``: the world size and each rank's directory and digest."""
    return {"world_size": world_size, "ranks": [{"rank": r, "dir": f"{RANKS_DIR}/rank-{r}-of-{world_size}", "digest": d}
                                                 for r, d in enumerate(digests)]}


def check_shard(root: Path, record: CommitRecord, rank: int, st: TensorStore) -> None:
    """Refuse to resume rank ``rank`` unless its shard store holds ``record``'s step and generation,
    written by the commit the global record names (one StoreError line otherwise)."""
    entry = record.meta["shards"]["ranks"][rank]
    mine = [r for r in st.commit_history() if r.step == record.step and r.generation == record.generation]
    if not any(digest(r) == entry["digest"] for r in mine):
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


def read_layer(root: Path, record: CommitRecord, layer: int, kind: str, numel: int, *, root_store: TensorStore | None = None,
               io_threads: int = 4) -> torch.Tensor:
    """Layer ``layer``'s whole ``kind`` array of ``record``'s generation, assembled from the
    shard stores ``record`` names (or read from the run directory's store)."""
    name = state_array_name(layer, kind, record.generation)
    if not is_sharded(record):
        if root_store is not None:
            return root_store.read(name)
        with TensorStore.open(root, read_only=True, io_threads=io_threads) as st:
            return st.read(name)
    world = shard_world(record)
    out = torch.empty(numel, dtype=STATE_DTYPE)
    for r in range(world):
        lo, hi = layer_ranges([numel], r, world)[0]
        if hi > lo:
            with TensorStore.open(rank_dir(root, r, world), read_only=True, io_threads=io_threads) as st:
                st.read_into(name, out[lo:hi])
    return out


def reshard(root: Path, world_size: int, *, io_threads: int = 4, log: Callable[[str], None] | None = None) -> CommitRecord:
    """Rewrite the state of run ``root``'s last commit for ``world_size`` ranks (1: the
    single-process layout in ``root``), bit-identically, and commit it as a new global record of
    the same step. The old layout stays valid until that commit; its shard stores are removed after."""
    from mtc.plan import load_plan

    root = Path(root)
    if world_size < 1:
        raise StoreError(f"--world-size must be at least 1, got {world_size}")
    with TensorStore.open(root) as st:  # the lock: no run may commit meanwhile
        last = st.last_commit()
        if last is None:
            raise StoreError(f"store {root} has no commit to reshard")
        old = shard_world(last)
        if old == world_size:
            if log:
                log(f"{root} is already laid out for world size {world_size}; nothing to do")
            return last
        if is_sharded(last):
            for r in range(old):
                with TensorStore.open(rank_dir(root, r, old), read_only=True) as rs:
                    check_shard(root, last, r, rs)
        program = load_plan(root / "plan")
        numels = [program.layer_numel(i) for i in range(program.n_layers)]
        # disk-tier layers keep m and v whatever the durability: carry what each layer keeps
        if is_sharded(last):
            with TensorStore.open(rank_dir(root, 0, old), read_only=True) as rs:
                placement = stored_placement(rs, len(numels))
        else:
            placement = stored_placement(st, len(numels))
        gen = last.generation
        targets: list[TensorStore] = []
        try:
            if world_size > 1:
                targets = [open_rank_store(root, r, world_size, numels, last.durability, io_threads=io_threads, fresh=True,
                                           placement=placement)
                           for r in range(world_size)]
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
                    full = read_layer(root, last, i, k, n, root_store=st, io_threads=io_threads)
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
        meta = {k: v for k, v in last.meta.items() if k not in ("shards", "world_size")}
        if world_size > 1:
            meta.update(shards=shards_meta(world_size, digests), world_size=world_size)
        meta["resharded_from"] = old
        new = CommitRecord(step=last.step, generation=gen, data_cursor=last.data_cursor, rng_state=last.rng_state,
                           config=last.config, time_unix=time.time(), extra=last.extra, durability=last.durability, meta=meta)
        st.commit(new)
    if old > 1:  # no record names them any more
        for r in range(old):
            shutil.rmtree(rank_dir(root, r, old), ignore_errors=True)
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

    def commit(gen: int, error: BaseException | None) -> None:
        record = make_record(gen)
        mine = ""
        if error is None:
            try:
                rec = rank_record(record.step, gen, record.data_cursor, record.config, record.durability, rank, world_size)
                shard_st.commit(rec)
                mine = digest(rec)
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
            meta = dict(record.meta, shards=shards_meta(world_size, [str(d) for d in got]), world_size=world_size)
            root_st.commit(CommitRecord(step=record.step, generation=gen, data_cursor=record.data_cursor,
                                        rng_state=record.rng_state, config=record.config, time_unix=record.time_unix,
                                        extra=record.extra, durability=record.durability, meta=meta))
        # nobody writes the other generation before the global record names this one
        collective(f"step {record.step}'s commit barrier", dist.barrier, group=groups().commit)

    return commit


def start_state(root: Path, root_st: TensorStore, program: object, tiers: object, rank: int, world_size: int, last: CommitRecord | None,
                params: dict[str, torch.Tensor] | None, first: CommitRecord, io_threads: int) -> tuple[TensorStore, CommitRecord]:
    """Fill this rank's sharded tiers and open its shard store: a new run takes rank 0's initial
    weights (broadcast layer by layer) and commits them as step 0 on every rank; a resumed run
    loads its shard (checked against the global record); a single-process store is read from the
    run directory (each rank its range). Returns the shard store and the record started from."""
    import torch.distributed as dist

    from mtc.dist import groups
    from mtc.runtime.collectives import collective
    from mtc.runtime.state import flatten_layer
    from mtc.runtime.tiers import DISK_CHUNK_NUMEL

    numels = [program.layer_numel(i) for i in range(program.n_layers)]
    durability = first.durability if last is None else last.durability
    placement = list(tiers.placement)
    rows = None if tiers.disk_chunk_numel == DISK_CHUNK_NUMEL else tiers.disk_chunk_numel  # as `StateTiers.create_arrays`
    if last is not None and is_sharded(last):
        if shard_world(last) != world_size:
            raise StoreError(f"store {root} was last committed at world size {shard_world(last)}, this launch has {world_size} "
                             f"ranks: run `mtc reshard {root} --world-size {world_size}` first (or launch {shard_world(last)} ranks)")
        st = open_rank_store(root, rank, world_size, numels, durability, io_threads=io_threads, fresh=False,
                             placement=placement, disk_chunk_rows=rows)
        try:
            check_shard(root, last, rank, st)
            for s in tiers.layers:
                lo, hi = s.shard if s.shard is not None else (0, 0)
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
                        master = torch.zeros(per, dtype=STATE_DTYPE)
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
                         disk_chunk_rows=rows)
    try:
        if last is not None:  # the single-process layout: each rank reads its range of the full arrays
            tiers.load(root_st, last.generation, durability)
            _copy_disk_shards(root_st, st, tiers, last.generation)
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
                for k in layer_kinds(s.tier, durability):
                    st.write(state_array_name(s.layer, k, 0), flat[lo:hi].clone() if k == "master" else torch.zeros(hi - lo))
        committer(root_st, st, rank, world_size, lambda gen: first)(0, None)
    except BaseException:
        st.close()
        raise
    return st, first


def _copy_disk_shards(root_st: TensorStore, st: TensorStore, tiers: object, gen: int) -> None:
    """A single-process store opened on several ranks: each disk layer's range of the full arrays
    of generation ``gen`` into this rank's shard store (the disk tier reads it from there); moments
    the store did not keep (a ram layer under durability 'weights' before) start at zero, as a
    single-process resume starts them."""
    for s in tiers.layers:
        if s.tier != "disk" or not s.numel or s.shard[1] == s.shard[0]:
            continue
        lo, hi = s.shard
        for k in ("master", "m", "v"):
            name = state_array_name(s.layer, k, gen)
            buf = torch.zeros(hi - lo, dtype=STATE_DTYPE)
            if k == "master" or root_st.has_array(name):
                root_st.read_rows_into(name, lo, buf)
            st.write(name, buf)


def verify_sharded(root: Path, record: CommitRecord) -> tuple[bool, list[str]]:
    """`mtc verify` of a sharded run: every shard store the global ``record`` names is verified
    (its commit files, arrays and chunks) and must hold the step and digest ``record`` names."""
    from mtc.store import verify

    ok, lines = True, [f"global commit: step {record.step}, generation {record.generation}, world size {shard_world(record)}"]
    for r in range(shard_world(record)):
        path = rank_dir(root, r, shard_world(record))
        try:
            with TensorStore.open(path, read_only=True) as st:
                report = verify(st)
                check_shard(root, record, r, st)
        except StoreError as e:
            ok = False
            lines.append(f"rank {r}: damaged: {e}")
            continue
        ok = ok and report.ok
        lines += [f"rank {r}: {line}" for line in report.lines()]
    return ok, lines
