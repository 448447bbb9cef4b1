"""Where each rank of a data-parallel run keeps its shard store (``--rank-dir``).

By default rank r of N keeps its shard store in ``RUN/ranks/rank-r-of-N/``. A multi-node run may
put each node's ranks on its local disk instead while the run directory (plan, logs, the global
commit record) stays on a shared filesystem: ``rank_dir`` is a path template with the placeholders
``{rank}``, ``{world_size}``, ``{local_rank}``, ``{node}`` (torchrun's ``GROUP_RANK``) and
``{host}`` (the host name), e.g. ``/nvme/run-a/rank-{rank}``. A relative template is relative to the
working directory, like ``--store``.

The global commit record names each shard's directory as its rank saw it: relative to the run
directory when it lies inside it (so a copied run directory stays whole), else absolute. Readers
that run in one process (export, verify, repair, reshard, eval) open the recorded directories, so
they need every shard visible on their machine; a resumed rank opens the directory its template
gives (the run's recorded template when the launch names none) and the global record's digest
proves it is the right shard, wherever it was moved.

This module does no I/O beyond looking at paths; `mtc.shards` opens the stores.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import string
from pathlib import Path

from mtc.errors import ConfigError, StoreError

__all__ = ["PLACEHOLDERS", "SHARD_DIR_ATTR", "Place", "check_owner", "check_reshard_template", "check_template", "default_dir",
           "duplicates", "located", "missing_text", "place_from_env", "recorded_form", "resolve"]

RANKS_DIR = "ranks"
PLACEHOLDERS = ("rank", "world_size", "local_rank", "node", "host")
# a shard store's root attribute: which run it belongs to, how the record names it, the template
SHARD_DIR_ATTR = "mtc_shard_dir"
_FLAG = "--rank-dir (config field rank_dir)"


@dataclasses.dataclass(frozen=True, slots=True)
class Place:
    """What a rank directory template may depend on."""

    rank: int
    world_size: int
    local_rank: int = 0
    node: int = 0
    host: str = ""


def _fields(text: str) -> list[str]:
    try:
        return [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as e:  # an unmatched brace
        raise ValueError(f"not a valid template ({e})") from None


def check_template(text: str) -> None:
    """Raise ValueError unless ``text`` is a rank directory template that gives every rank of a
    host its own directory (the config schema's syntax check of ``rank_dir``)."""
    names = _fields(text)
    bad = sorted({n for n in names if n not in PLACEHOLDERS})
    if bad:
        raise ValueError(f"unknown placeholder(s) {', '.join('{' + n + '}' for n in bad)}; "
                         f"use {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    if "rank" not in names and "local_rank" not in names:
        raise ValueError("it must contain {rank} or {local_rank}, or the ranks of one host would share one directory")
    try:
        _format(text, Place(1, 2, 1, 0, "host"))
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"cannot be filled in ({e})") from None


def _format(text: str, place: Place) -> str:
    return text.format(**dataclasses.asdict(place))


def default_dir(root: Path, rank: int, world_size: int) -> Path:
    """The default: ``RUN/ranks/rank-R-of-N``."""
    return Path(root) / RANKS_DIR / f"rank-{rank}-of-{world_size}"


def place_from_env(rank: int, world_size: int, env: dict[str, str] | None = None) -> Place:
    """This process's `Place` from torchrun's environment (``LOCAL_RANK``, ``GROUP_RANK``)."""
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_RANK") or 0)
    local_size = int(env.get("LOCAL_WORLD_SIZE") or world_size)
    node = int(env.get("GROUP_RANK") or (rank // max(local_size, 1)))
    return Place(rank, world_size, local, node, socket.gethostname())


def resolve(template: str | None, root: Path, place: Place) -> Path:
    """Rank ``place.rank``'s shard directory: ``template`` filled in (absolute), or the default under ``root``."""
    if template is None:
        return default_dir(root, place.rank, place.world_size).absolute()
    return Path(_format(template, place)).expanduser().absolute()


def recorded_form(root: Path, path: Path) -> str:
    """How the global record names ``path``: relative to the run directory inside it, else absolute."""
    a, r = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    return a.relative_to(r).as_posix() if a.is_relative_to(r) else str(a)


def located(root: Path, form: str) -> Path:
    """The directory a recorded form names, seen from this process (relative forms: under ``root``)."""
    p = Path(form)
    return p if p.is_absolute() else Path(root) / p


def duplicates(entries: list[tuple[str, str]], template: str | None) -> None:
    """Refuse two ranks on one host that would share a shard directory; ``entries[r]`` is rank r's
    (host, real path)."""
    seen: dict[tuple[str, str], int] = {}
    for r, e in enumerate(entries):
        if tuple(e) in seen:
            raise ConfigError(f"ranks {seen[tuple(e)]} and {r} on host {e[0]} would share the shard directory {e[1]} "
                              f"({_FLAG} {template!r}); give every rank its own, e.g. with {{rank}} or {{local_rank}} in the path")
        seen[tuple(e)] = r


def check_reshard_template(template: str) -> None:
    """``mtc reshard --rank-dir``: the template of the new layout, filled in on this one machine."""
    try:
        check_template(template)
    except ValueError as e:
        raise ConfigError(f"--rank-dir {template!r}: {e}") from None
    local = sorted({n for n in _fields(template) if n in ("local_rank", "node", "host")})
    if local:
        raise ConfigError(f"--rank-dir {template!r}: mtc reshard writes every new shard from this machine and cannot know "
                          f"{', '.join('{' + n + '}' for n in local)} of the next launch; use {{rank}} and {{world_size}} "
                          "only (then move the directories to their nodes and launch with the matching --rank-dir)")


def missing_text(rank: int, path: Path, template: str | None, recorded: Path | None) -> str:
    """The one line for a resumed rank whose shard directory is not there."""
    how = f"from {_FLAG} {template!r}" if template is not None else "the default under the run directory"
    rec = f"; the run's commit record names {recorded} for this rank" if recorded is not None and recorded != path else ""
    return (f"rank {rank}'s shard store {path} is missing or was never committed (its directory: {how}){rec}. Relaunch on the nodes that hold "
            f"it with the same --rank-dir, restore that directory, or start over with --overwrite")


def check_owner(path: Path, root: Path, attrs: dict | None) -> None:
    """A new shard store outside the run directory must not replace files of something else: an
    existing non-empty ``path`` is refused unless it is a shard store of this same run (``attrs``:
    its root attributes, None when it is no store)."""
    if Path(os.path.abspath(path)).is_relative_to(os.path.abspath(root)) or not path.exists():
        return
    if path.is_dir() and not any(path.iterdir()):
        return
    owner = (attrs or {}).get(SHARD_DIR_ATTR, {}).get("run")
    if owner == os.path.abspath(root):
        return
    what = f"a shard store of run {owner}" if owner else "files that are not a shard store of this run"
    raise StoreError(f"shard directory {path} ({_FLAG}) already holds {what}; point the template at a new or empty "
                     "directory (e.g. include the run's name: /nvme/RUN-NAME/rank-{rank}) or remove it")
