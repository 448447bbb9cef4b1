"""Weights for inference (eval, generation), one layer at a time, from a run's store or its live tiers.

Both sources hand out parameters by key (the program's parameter names), on the compute device in
the compute dtype, for one layer call at a time: a model never has to be resident to be evaluated.
`StoreWeights` reads the fp32 master of a committed state generation and keeps what fits a device
budget resident (all of it, for a model that fits); the rest is read again when next needed, from a
host copy while that fits a host budget, else from the store. `TierWeights` reads a training run's
compute copies (after the step's updates have landed: see `wait_for_updates`).

Which steps a store can serve (`committed_steps`): always its last commit; also the commit before it
(the other state generation) when no write into that generation started since. Training records
each start of a write into the store in ``logs/writes.jsonl`` (fsynced before the write begins,
`record_write_start`), so a generation torn by a crash mid-commit is never offered.

A data-parallel run's store holds no state itself: its commit records name per-rank shard stores
(`mtc.shards`), and `StoreWeights` given the step's record assembles each layer from them. The
previous commit is offered only when it has the same layout as the last (a reshard in between
moved the state).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from mtc.errors import StoreError
from mtc.graphs.program import Program
from mtc.runtime.optimizer import handed_weights
from mtc.runtime.tiers import StateTiers
from mtc.shards import StateReader, is_sharded
from mtc.store import CommitRecord, TensorStore, state_array_name
from mtc.store.directory import read_write_starts, record_write_start, written_since

__all__ = ["CommittedStep", "StoreWeights", "TierWeights", "WeightsOverwritten", "check_untouched", "committed_steps",
           "default_budgets", "open_run_store", "pick_step", "record_write_start", "wait_for_updates"]

# -- which steps a store holds ------------------------------------------------------------------


def open_run_store(store_dir: str | Path) -> TensorStore:
    """A run's store opened read-only (eval, generate, export, load_state_dict, inspect). One with
    no commit says why (`TensorStore.open`): a set-up that stopped, or a run trained with
    ``--durability none``, which keeps no weights by design."""
    return TensorStore.open(store_dir, read_only=True)


@dataclasses.dataclass(frozen=True, slots=True)
class CommittedStep:
    """A step whose master weights a store holds, and the state generation that holds them."""

    step: int
    generation: int
    record: CommitRecord
    last: bool  # the store's last commit (else: the one before, in the other generation)


class WeightsOverwritten(StoreError):
    """Training began writing another step into the generation being read: what was read may mix steps."""


def check_untouched(store_dir: str | Path | None, step: int, generation: int, *, what: str) -> None:
    """After reading step ``step``'s weights from ``generation``: raise `WeightsOverwritten` when a
    write of a later step into that generation has started since (training logs each before it
    begins, so a write that overlapped the reads is in the log by now; one not logged yet had not
    begun, and the reads are done). A store without the log (in memory) was not being trained."""
    starts = read_write_starts(store_dir) if store_dir is not None else None
    if starts and written_since(starts, step, generation):
        raise WeightsOverwritten(
            f"{what}: training began writing a later step into state generation {generation} while step {step}'s "
            "weights were read from it, so the result could mix steps; run it again (the newest commit), or read "
            "that step while the run is stopped"
        )


def committed_steps(store: TensorStore) -> list[CommittedStep]:
    """Steps whose master weights ``store`` holds intact, newest first (empty: nothing committed)."""
    last = store.last_commit(rng=False)  # (the weights only: a resume file's damage is no reason to refuse them)
    if last is None:
        return []
    out = [CommittedStep(last.step, last.generation, last, True)]
    if store.path is None:
        return out
    history = [r for r in store.commit_history() if r.step < last.step]
    prev = history[-1] if history else None
    starts = read_write_starts(store.path)
    if prev is None or prev.generation == last.generation or prev.durability == "none" or starts is None:
        return out
    if _layout(prev) != _layout(last):  # resharded since: the previous layout's state is gone or stale
        return out
    # any write into the previous commit's generation for a later step (a commit cut short, or a
    # disk layer written without a commit) may have overwritten part of it
    if written_since(starts, prev.step, prev.generation):
        return out
    return out + [CommittedStep(prev.step, prev.generation, prev, False)]


def _layout(record: CommitRecord) -> object:
    """Where a record's state lies: None (the run directory), else the shard stores' world size and directories."""
    shards = record.meta.get("shards")
    if not isinstance(shards, dict):
        return None
    return shards.get("world_size"), [e.get("dir") for e in shards.get("ranks", [])]


def pick_step(store: TensorStore, step: int | None) -> CommittedStep:
    """The committed step to read (``None``: the last); StoreError naming the available ones otherwise."""
    steps = committed_steps(store)
    if not steps:
        raise StoreError(f"store {store.path} has no committed weights yet (train it first; durability 'none' commits nothing)")
    if step is None:
        return steps[0]
    for s in steps:
        if s.step == step:
            return s
    avail = ", ".join(f"{s.step}" + (" (last commit)" if s.last else " (previous commit)") for s in steps)
    raise StoreError(f"step {step} is not in store {store.path}: it holds the weights of step {avail}; "
                     "a store keeps two state generations, older steps are overwritten")


# -- weights from the store ---------------------------------------------------------------------


def default_budgets(dev: torch.device) -> tuple[int, int]:
    """(device, host) bytes a `StoreWeights` keeps resident by default: on a GPU its free memory less
    2 GiB (activations, a KV cache), on the CPU half the free RAM; and half the free RAM for layers
    kept in host memory between uses. Without them a model larger than the GPU ran out of memory."""
    from mtc.runtime.placement import available_host_bytes

    host = int(available_host_bytes() * 0.5)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return max(0, free - 2 * 2**30), host
    return host, host


class StoreWeights:
    """Parameters of a committed generation, per layer call, on ``device`` in ``dtype``.

    ``device_budget_bytes``: how much of the model may stay resident on the device (None: all);
    ``host_budget_bytes``: how much of what does not may be kept in host RAM between uses (None: all).
    Call `prefetch` with the next call's keys to read them while the current one computes.
    """

    def __init__(self, program: Program, store: TensorStore, generation: int, *, device: torch.device | str,
                 dtype: torch.dtype, device_budget_bytes: int | None = None, host_budget_bytes: int | None = None,
                 record: CommitRecord | None = None) -> None:
        self.program, self.store, self.generation = program, store, generation
        # a data-parallel run's step (``record``, of ``generation``): its layers come from the shard stores
        self._shards = None
        if is_sharded(record):
            if record.generation != generation:
                raise ValueError(f"record of generation {record.generation} given for generation {generation}")
            self._shards = StateReader(store.path, record, what="reading a data-parallel run's weights")
        self.device, self.dtype = torch.device(device), dtype
        self.device_budget, self.host_budget = device_budget_bytes, host_budget_bytes
        self._device: dict[int, torch.Tensor] = {}
        self._host: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-weights")
        self._pending: dict[int, Future[torch.Tensor]] = {}
        self.reads = 0  # owner arrays read from the store (tests: streaming re-reads)

    def _bytes(self, owner: int) -> int:
        return self.program.layer_numel(owner) * torch.empty((), dtype=self.dtype).element_size()

    def _load_host(self, owner: int) -> torch.Tensor:
        self.reads += 1
        if self._shards is not None:
            flat = self._shards.read(owner, "master", self.program.layer_numel(owner))
        else:
            flat = self.store.read(state_array_name(owner, "master", self.generation))
        return flat if self.dtype == torch.float32 else flat.to(self.dtype)

    def _owner(self, owner: int) -> torch.Tensor:
        if owner in self._device:
            return self._device[owner]
        fut = self._pending.pop(owner, None)
        host = self._host.get(owner)
        if host is None:
            host = fut.result() if fut is not None else self._load_host(owner)
        dev = host.to(self.device)
        size = self._bytes(owner)
        if self.device_budget is None or sum(self._bytes(o) for o in self._device) + size <= self.device_budget:
            self._device[owner] = dev
        elif (self.device.type != "cpu" and owner not in self._host  # on the CPU the device budget is the host's
              and (self.host_budget is None or sum(self._bytes(o) for o in self._host) + size <= self.host_budget)):
            self._host[owner] = host
        return dev

    def owners(self, keys: list[str]) -> list[int]:
        """The layers whose state holds ``keys``."""
        return list(dict.fromkeys(self.program.params[k].layer for k in keys))

    def prefetch(self, keys: list[str]) -> None:
        """Start reading the owners of ``keys`` that are neither resident nor kept in host RAM."""
        for o in self.owners(keys):
            if o not in self._device and o not in self._host and o not in self._pending:
                self._pending[o] = self._pool.submit(self._load_host, o)

    def get(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Parameters ``keys`` as device tensors (views of their owner's flat state)."""
        flats = {o: self._owner(o) for o in self.owners(keys)}
        out = {}
        for k in keys:
            p = self.program.params[k]
            out[k] = flats[p.layer][p.offset : p.offset + p.numel].view(p.spec.shape)
        return out

    @property
    def resident_layers(self) -> list[int]:
        """Layers kept on the device."""
        return sorted(self._device)

    def close(self) -> None:
        """Stop the reader thread (and close the shard stores)."""
        self._pool.shutdown(wait=True)
        if self._shards is not None:
            self._shards.close()


# -- weights from a training run's tiers --------------------------------------------------------


def wait_for_updates(tiers: StateTiers) -> None:
    """The barrier before reading a step's weights: every layer's update of that step has landed.

    A layer's update future completes once its master and compute copy hold the new values (for
    `gpu` layers the update is queued on the compute stream, ahead of anything queued after; a
    handed-over layer's new compute copy is in its GPU scratch set, where `TierWeights` reads it). This
    is the same condition the executor's next fetch of the layer waits for; write-behind and commits
    may still be in flight (they only read the state). A data-parallel gpu-tier layer's update ends
    with the all-gather of its shards into the compute copy on the comm stream: wait for that too
    (the executor makes its compute stream wait for it; a reader here may use any stream).
    """
    for s in tiers.layers:
        for f in (s.update, s.state_back):  # weights first, then (GPU-side updates) the rest of the state
            if f is not None:
                f.result()
        if s.gathered is not None:
            s.gathered.wait()


class TierWeights:
    """Parameters of a running training step from its tiers' compute copies (call `wait_for_updates` first)."""

    def __init__(self, program: Program, tiers: StateTiers, device: torch.device | str) -> None:
        self.program, self.tiers, self.device = program, tiers, torch.device(device)

    def prefetch(self, keys: list[str]) -> None:
        """Nothing to read ahead: compute copies sit in pinned host memory or on the device."""

    def get(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Parameters ``keys`` on the device (a blocking copy, so the next update cannot race it)."""
        out = {}
        for k in keys:
            p = self.program.params[k]
            st = self.tiers[p.layer]
            if st.compute is None:
                # a disk layer whose compute copy is read per visit: its newest master is in the store
                # once the step's write-behind has landed, in the generation the optimizer flipped to
                if st.write is not None:
                    st.write.result()
                assert self.tiers.store is not None, "disk layers read per visit need the store"
                buf = torch.empty(p.numel, dtype=torch.float32)
                name = state_array_name(p.layer, "master", self.tiers.disk_generation)
                self.tiers.store.read_rows_into(name, p.offset, buf)
                src = buf.view(p.spec.shape).to(self.tiers.compute_dtype)
            elif (handed := handed_weights(st)) is not None:  # newer than the host copy: on the device only
                src = handed[p.offset : p.offset + p.numel].view(p.spec.shape).clone()  # the next update rewrites it
            else:
                src = st.compute[p.offset : p.offset + p.numel].view(p.spec.shape)
            out[k] = src.to(self.device) if src.device != self.device else src
        return out

    def close(self) -> None:
        """Nothing to stop."""
