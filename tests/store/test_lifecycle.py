"""Store creation through the set-up marker, read-only handles, and commits that fail to write."""

from __future__ import annotations

import base64
import builtins
import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from mtc.store import CommitRecord, TensorStore, repair, verify
from mtc.store import directory as directory_mod
from mtc.store.directory import dir_state

from mtc.errors import StoreCorruptionError, StoreError, StoreLockedError
from tests.store.runs import make_run, record, snapshot

# -- commit records ---------------------------------------------------------------------------


def test_commit_record_durability_and_meta_and_old_records():
    rec = record(3, 1, "weights")
    assert CommitRecord.from_json(rec.to_json()) == rec and rec.meta == {"data": "corpus.bin"}
    old = {k: v for k, v in json.loads(rec.to_json()).items() if k not in ("durability", "meta", "extra")}
    back = CommitRecord.from_json(json.dumps(old))  # written before these fields existed
    assert (back.durability, back.meta, back.extra) == ("full", {}, {})
    with pytest.raises(ValueError, match="durability"):
        CommitRecord.from_json(json.dumps({**old, "durability": "most"}))
    with pytest.raises(TypeError, match="meta"):
        CommitRecord.from_json(json.dumps({**old, "meta": [1]}))
    with TensorStore.create(None) as st, pytest.raises(StoreError, match="durability 'most'; use one of full, weights, none"):
        st.commit(dataclasses.replace(rec, durability="most"))


def _rng(step: int) -> dict[str, str]:
    """The CPU generator's state after seeding with ``step``, as the trainer records it (kilobytes of base64)."""
    torch.manual_seed(step)
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def _to_inline(p, rng_of=None) -> None:
    """Rewrite the commit files of store ``p`` as mtc wrote them before context files (config and
    meta inline in every history line) and, given ``rng_of``, before resume files (RNG states inline)."""
    def old(line: str) -> str:
        d = json.loads(line)
        if digest := d.pop("context", None):
            ctx = json.loads((p / "contexts" / f"{digest}.json").read_text())
            d = {**d, "config": ctx["config"], "meta": {**d.get("meta", {}), **ctx["meta"]},
                 "rng_state": d.get("rng_state", {}), "extra": d.get("extra", {})}
        if rng_of is not None and d.pop("resume", None):
            d["rng_state"] = rng_of(d["step"])
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    (p / "commit.json").write_text(old((p / "commit.json").read_text()) + "\n")
    (p / "commits.jsonl").write_text("".join(old(x) + "\n" for x in (p / "commits.jsonl").read_text().splitlines()))
    shutil.rmtree(p / "contexts", ignore_errors=True)
    if rng_of is not None:
        for g in (0, 1):
            (p / f"resume-g{g}.json").unlink(missing_ok=True)


def test_history_lines_stay_small_and_the_rng_states_live_with_their_generation(tmp_path):
    """The RNG states (base64 of torch's CPU generator) were inlined in every history line: kilobytes per
    commit in a file that grows by a line each commit and that verify and repair read whole."""
    p = tmp_path / "s"
    st = make_run(p)
    sizes = []
    for step in range(2, 6):
        before = (p / "commits.jsonl").stat().st_size
        st.commit(dataclasses.replace(record(step, step % 2), rng_state=_rng(step)))
        sizes.append((p / "commits.jsonl").stat().st_size - before)
        assert _rng(step)["torch"] not in (p / "commits.jsonl").read_text() + (p / "commit.json").read_text()
    assert max(sizes) < len(_rng(0)["torch"]), sizes  # a line is smaller than the states it no longer carries
    st.close()
    assert sorted(f.name for f in p.glob("resume-*")) == ["resume-g0.json", "resume-g1.json"]  # never more than two
    with TensorStore.open(p) as st:
        assert st.last_commit().step == 5 and st.last_commit().rng_state == _rng(5)
        assert verify(st).ok
    # the previous commit, in the other generation, keeps its own: a roll-back to it resumes exactly
    (p / "commit.json").unlink()
    shutil.rmtree(p / "layers" / "0000" / "master" / "g1")
    with TensorStore.open(p) as st:
        assert repair(st).restored.step == 4 and st.last_commit().rng_state == _rng(4)
        assert verify(st).ok


def test_a_damaged_resume_file_is_damage_and_repair_rolls_back_past_it(tmp_path):
    p = tmp_path / "s"
    st = make_run(p, steps=3)  # step 2 in generation 0, step 1 in generation 1
    st.commit(dataclasses.replace(record(3, 1), rng_state=_rng(3)))
    st.close()
    text = (p / "resume-g1.json").read_text()
    (p / "resume-g1.json").write_text(text.replace(_rng(3)["torch"][:8], "AAAAAAAA", 1))  # a bit flip: still JSON
    with TensorStore.open(p, read_only=True) as ro:
        rep = verify(ro)
        assert [x.where for x in rep.problems] == ["resume-g1.json"] and "would not restore its RNG states" in str(rep.problems[0])
        assert "rolls back" in rep.lines()[-1]
        # the weights' readers get the record without the states only a resume needs, and a
        # resume asking next is still told (the lenient read is not kept)
        assert ro.last_commit(rng=False).step == 3 and ro.last_commit(rng=False).rng_state == {}
        with pytest.raises(StoreCorruptionError, match=r"RNG states of step 3's commit cannot be read .*resume-g1.json.*`mtc repair"):
            ro.last_commit()
    with TensorStore.open(p) as st:
        done = repair(st)
        assert done.restored.step == 2 and "step 3's state is damaged" in done.actions[-1]
        assert st.last_commit().rng_state == record(2, 0).rng_state and verify(st).ok
        damaged = st.commit_history()[-2]  # step 3's record, as the history keeps it: its RNG states are gone
        with pytest.raises(StoreError, match="cannot commit step 3 again: the RNG states its record names are gone"):
            st.commit(damaged)
        st.commit(dataclasses.replace(st.commit_history()[-1], time_unix=9.0))  # step 2's: still in its resume file
        assert st.last_commit().rng_state == record(2, 0).rng_state and st.last_commit().time_unix == 9.0


def test_a_store_with_inline_rng_states_still_opens_verifies_repairs_and_resumes(tmp_path):
    """Stores written before the resume files: their records carry the RNG states inline."""
    p = tmp_path / "s"
    st = make_run(p)
    st.commit(dataclasses.replace(record(2, 0), rng_state=_rng(2)))
    st.commit(dataclasses.replace(record(3, 1), rng_state=_rng(3)))
    st.close()
    _to_inline(p, _rng)
    assert '"resume"' not in (p / "commits.jsonl").read_text() and _rng(3)["torch"] in (p / "commit.json").read_text()
    with TensorStore.open(p, read_only=True) as ro:
        assert verify(ro).ok and ro.last_commit().rng_state == _rng(3)
    (p / "commit.json").unlink()
    with TensorStore.open(p) as st:
        assert repair(st).restored.rng_state == _rng(3) and st.last_commit().rng_state == _rng(3)
        st.commit(dataclasses.replace(record(4, 0), rng_state=_rng(4)))  # the resumed run writes the new form
        assert verify(st).ok
    with TensorStore.open(p) as st:
        assert st.last_commit().rng_state == _rng(4)
        shutil.rmtree(p / "layers" / "0000" / "master" / "g0")  # step 4's state: roll back to the old record
        done = repair(st)
        assert done.restored.step == 3 and st.last_commit().rng_state == _rng(3) and verify(st).ok


def _run_record(step: int, generation: int, lr: float = 3e-3, data: str = "corpus.bin") -> CommitRecord:
    """A commit record carrying a whole run's config and data identity, as the trainer writes them."""
    from mtc.config import TrainConfig

    config = TrainConfig(model="tiny", steps=20, optim={"lr": lr}).to_dict()
    identity = {"path": f"/data/{data}", "hash": "de48bb13" * 8, "size_bytes": 372624,
                "header": {"format": "mtc-tokens", "vocab_size": 256, "tokenizer": "byte", "n_tokens": 186312}}
    return dataclasses.replace(record(step, generation), config=config,
                               meta={"data": identity, "changes": [], "moments_from": step // 2})


def test_history_lines_name_the_config_and_data_once_per_change(tmp_path):
    """Every history line carried the run's config and data identity (~1.5 KB), though they change
    only when a run resumes with other settings; with disk layers a run commits every step."""
    p = tmp_path / "s"
    st = make_run(p)
    committed = []
    sizes = []
    for step in range(2, 8):
        rec = _run_record(step, step % 2, lr=3e-3 if step < 5 else 1e-3)  # a resume at step 5 changed the lr
        before = (p / "commits.jsonl").stat().st_size
        st.commit(rec)
        sizes.append((p / "commits.jsonl").stat().st_size - before)
        committed.append(dataclasses.replace(rec, rng_state={}))
    context = json.dumps({"config": rec.config, "data": rec.meta["data"]})
    assert max(sizes) < len(context) / 4, sizes  # a line is a fraction of what it no longer carries
    assert '"lr"' not in (p / "commits.jsonl").read_text() and '"lr"' in (p / "commit.json").read_text()
    assert len(list((p / "contexts").iterdir())) == 3  # make_run's, and the two of steps 2-4 and 5-7
    # read back exactly: the configs, data identities and the meta left in the lines
    assert st.commit_history()[2:] == committed and st.commit_history()[-1].meta["moments_from"] == 3
    assert st.commit_history()[3].config["optim"]["lr"] == 3e-3 and st.commit_history()[-1].config["optim"]["lr"] == 1e-3
    st.close()
    with TensorStore.open(p) as st:
        assert verify(st).ok and st.last_commit() == rec
        st.commit(_run_record(8, 0, lr=1e-3))  # a resume with the same settings reuses the file
        assert len(list((p / "contexts").iterdir())) == 3
    (p / "commit.json").unlink()
    shutil.rmtree(p / "layers" / "0000" / "master" / "g0")  # step 8's state: repair rolls back to step 7's record
    with TensorStore.open(p) as st:
        assert repair(st).restored == committed[-1] and st.last_commit() == rec and verify(st).ok


def test_a_lost_or_damaged_context_file_is_damage_and_repair_rewrites_it_from_commit_json(tmp_path):
    p = tmp_path / "s"
    st = make_run(p)
    for step in (2, 3):
        st.commit(_run_record(step, step % 2))
    st.close()
    f = p / "contexts" / json.loads((p / "commits.jsonl").read_text().splitlines()[-1])["context"]
    f = f.with_name(f.name + ".json")
    text = f.read_text()
    for damage in ("lost", "bit flip"):
        f.unlink() if damage == "lost" else f.write_text(text.replace("tiny", "tinz"))
        with TensorStore.open(p, read_only=True) as ro:
            rep = verify(ro)
            assert [x.where for x in rep.problems] == [f"contexts/{f.name}"], rep.lines()
            assert ("is missing" if damage == "lost" else "is damaged") in str(rep.problems[0])
            assert "rewrites the context file from commit.json" in rep.lines()[-1]
            assert ro.last_commit().config == _run_record(3, 1).config  # a resume reads commit.json alone
            assert [r.step for r in ro.commit_history()] == [0, 1]  # the lines of steps 2 and 3 cannot be read
        with TensorStore.open(p) as st:
            done = repair(st)
            assert done.actions[0].startswith(f"rewrote context file contexts/{f.name}") and done.restored is None
            assert f.read_text() == text and verify(st).ok
            assert [r.step for r in st.commit_history()] == [0, 1, 2, 3]


def test_a_store_with_inline_configs_still_opens_verifies_repairs_and_resumes(tmp_path):
    """Stores written before the context files: every history line carries its config and meta."""
    p = tmp_path / "s"
    st = make_run(p)
    old = [_run_record(2, 0), _run_record(3, 1)]
    for rec in old:
        st.commit(rec)
    st.close()
    _to_inline(p)
    assert not (p / "contexts").exists() and all('"config"' in x for x in (p / "commits.jsonl").read_text().splitlines())
    old = [dataclasses.replace(r, rng_state={}) for r in old]  # (as the history keeps them: RNG states in resume files)
    with TensorStore.open(p, read_only=True) as ro:
        assert verify(ro).ok and ro.commit_history()[-2:] == old
    (p / "commit.json").unlink()
    with TensorStore.open(p) as st:
        assert repair(st).restored == old[-1]
        st.commit(_run_record(4, 0))  # the resumed run writes the new form after the old lines
        assert verify(st).ok and [r.step for r in st.commit_history()] == [0, 1, 2, 3, 4]
        assert st.commit_history()[-2].meta == st.commit_history()[-1].meta | {"moments_from": 1}
        shutil.rmtree(p / "layers" / "0000" / "master" / "g0")  # step 4's state: roll back to an old line
        done = repair(st)
        assert done.restored == old[-1] and verify(st).ok


# -- the set-up marker ------------------------------------------------------------------------


def test_first_commit_renames_the_marker(tmp_path):
    p = tmp_path / "s"
    st = TensorStore.create(p)
    assert dir_state(p) == "uncommitted" and (p / "setup.json").is_file() and not (p / "commit.json").exists()
    first = record(0, 0)
    st.commit(first)
    assert dir_state(p) == "committed" and not (p / "setup.json").exists()
    # the record names its RNG states, which are in the generation's resume file
    assert CommitRecord.from_json((p / "commit.json").read_text()) == dataclasses.replace(first, rng_state={})
    assert [r.step for r in st.commit_history()] == [0]
    st.commit(record(1, 1))
    assert not (p / "setup.json").exists() and not (p / "commit.json.tmp").exists()
    st.close()
    with TensorStore.open(p) as st:
        assert st.last_commit().step == 1


def test_open_refuses_an_uncommitted_store(tmp_path):
    p = tmp_path / "s"
    with TensorStore.create(p) as st:
        st.create_array("layers/0000/master/g0", (4,), torch.float32)
        st.write("layers/0000/master/g0", torch.ones(4))
        # closed (or killed) before the first commit
    for ro in (False, True):
        with pytest.raises(StoreError, match=r"has no commit yet.*run the same `mtc train \.\.\. --store .*` command again"):
            TensorStore.open(p, read_only=ro)


def test_create_reinitialises_an_uncommitted_store(tmp_path):
    p = tmp_path / "s"
    with TensorStore.create(p) as st:
        st.create_array("layers/0000/master/g0", (4,), torch.float32)
        st.write("layers/0000/master/g0", torch.ones(4))
    # what the runtime and an interrupted first commit leave behind
    (p / "plan").mkdir()
    (p / "plan" / "program.json").write_text("{}")
    (p / "logs").mkdir()
    (p / "commits.jsonl").write_text(record(0, 0).to_json() + "\n")  # appended, but the marker was never renamed
    (p / "resume-g0.json").write_text("{}")  # the first commit's RNG states, written before its record
    (p / "zarr.0123456789abcdef0123456789abcdef.partial").write_text("x")  # zarr's temp file of a metadata write
    with TensorStore.create(p) as st:  # no overwrite needed: it never was a store
        assert st.array_names() == [] and st.last_commit() is None
        assert sorted(c.name for c in p.iterdir()) == [".lock", "setup.json", "zarr.json"]
        st.commit(record(0, 0))
    with TensorStore.open(p) as st:
        assert [r.step for r in st.commit_history()] == [0]


def test_create_refuses_foreign_files_in_an_uncommitted_store(tmp_path):
    p = tmp_path / "s"
    TensorStore.create(p).close()
    (p / "notes.txt").write_text("mine")
    (p / "data").mkdir()
    with pytest.raises(StoreError, match=r"cannot re-initialise the uncommitted store .*data, notes.txt, which mtc did not make"):
        TensorStore.create(p)
    assert (p / "notes.txt").read_text() == "mine" and (p / "setup.json").exists()


def test_interrupted_setups_leave_a_reinitialisable_directory(tmp_path):
    # killed right after the marker was written: no zarr.json yet
    p = tmp_path / "a"
    p.mkdir()
    (p / ".lock").write_text("")
    (p / "setup.json").write_text('{"mtc_store_setup": 1}')
    with pytest.raises(StoreError, match="has no commit yet"):
        TensorStore.open(p)
    TensorStore.create(p).close()
    # killed while the first commit was writing its record into the marker: still uncommitted
    q = tmp_path / "b"
    TensorStore.create(q).close()
    (q / "setup.json").write_text('{"step": 0, "gen')
    assert dir_state(q) == "uncommitted"
    TensorStore.create(q).close()


def test_interrupted_overwrite_keeps_a_whole_store_or_none(tmp_path):
    p = tmp_path / "s"
    make_run(p).close()
    # overwrite killed after writing the marker, before removing commit.json: still the old store
    (p / "setup.json").write_text('{"mtc_store_setup": 1}')
    assert dir_state(p) == "committed"
    with TensorStore.open(p, read_only=True) as st:
        assert st.last_commit().step == 1
    with TensorStore.open(p) as st:  # a writer tidies the leftover marker
        assert st.last_commit().step == 1
    assert not (p / "setup.json").exists()
    # killed after removing commit.json: an uncommitted store, which create starts over
    (p / "setup.json").write_text('{"mtc_store_setup": 1}')
    (p / "commit.json").unlink()
    assert dir_state(p) == "uncommitted"
    with TensorStore.create(p) as st:
        assert st.array_names() == []


def test_create_refuses_a_committed_store_and_names_repair(tmp_path):
    p = tmp_path / "s"
    make_run(p).close()
    with pytest.raises(StoreError, match="already holds a committed mtc store; resume it"):
        TensorStore.create(p)
    (p / "commit.json").unlink()
    with pytest.raises(StoreError, match=r"commit.json is missing: `mtc repair .*` restores it"):
        TensorStore.create(p)
    with TensorStore.create(p, overwrite=True) as st:
        assert st.array_names() == [] and dir_state(p) == "uncommitted"


def test_store_of_an_older_mtc_without_marker_or_commit(tmp_path):
    p = tmp_path / "s"
    TensorStore.create(p).close()
    (p / "setup.json").unlink()  # what an older mtc left when it stopped during set-up
    assert dir_state(p) == "no-commit"
    with pytest.raises(StoreError, match=r"no commit record.*--overwrite"):
        TensorStore.open(p)
    with pytest.raises(StoreError, match="not empty"):
        TensorStore.create(p)
    TensorStore.create(p, overwrite=True).close()


def test_locking_a_store_that_is_not_there_says_so_not_check_the_disk(tmp_path):
    # a directory removed between the check in TensorStore.open and the lock (or a caller that
    # locks on its own) once read "I/O error ... check the disk (dmesg)": the disk is fine
    with pytest.raises(StoreError, match=r"no store at .*gone: the directory does not exist") as e:
        directory_mod.lock_store(tmp_path / "gone")
    assert "mtc train --store" in str(e.value) and "TensorStore.create" in str(e.value) and "dmesg" not in str(e.value)
    assert not (tmp_path / "gone").exists()  # (and nothing was created)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=r"no store at .*file/s: a part of that path is a file, not a directory; pick"):
        directory_mod.lock_store(tmp_path / "file" / "s")


# -- read-only handles ------------------------------------------------------------------------


def test_a_store_path_under_a_file_names_that_file_not_the_disk(tmp_path):
    # `mtc train --store afile/sub` (and `mtc import`) once read "I/O error (Not a directory);
    # check the disk (dmesg)": the disk is fine, a parent of the path is a file
    (tmp_path / "afile").write_text("x")
    for sub in ("sub", "sub/deeper"):
        with pytest.raises(StoreError) as e:
            TensorStore.create(tmp_path / "afile" / sub)
        assert f"{tmp_path / 'afile'}, a parent of {tmp_path / 'afile' / sub}, is a file, not a directory; " \
               f"move {tmp_path / 'afile'} away" in str(e.value)
        assert "dmesg" not in str(e.value) and "I/O error" not in str(e.value)
    # EEXIST: a dangling symlink stands where a folder of the path should be
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(StoreError, match=r"directory .*link/sub: .*link is a broken symlink, not a directory; move .*link away"):
        TensorStore.create(tmp_path / "link" / "sub")
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "nowhere").exists()


def test_read_only_open_beside_a_writer_takes_no_lock_and_changes_nothing(tmp_path):
    p = tmp_path / "s"
    writer = make_run(p)  # holds the lock
    before = snapshot(p)
    with TensorStore.open(p, read_only=True) as ro:
        assert ro.read_only and ro.last_commit().step == 1
        assert ro.read("layers/0000/master/g1").shape == (40,)
        assert verify(ro).ok
        for write in (
            lambda: ro.write("layers/0000/master/g1", torch.zeros(40)),
            lambda: ro.write_rows("layers/0000/master/g1", 0, torch.zeros(2)),
            lambda: ro.create_array("x", (3,), torch.float32),
            lambda: ro.commit(record(2, 0)),
            lambda: ro.set_attribute("k", 1),
        ):
            with pytest.raises(StoreError, match="opened read-only"):
                write()
        with TensorStore.open(p, read_only=True) as ro2:  # any number of readers
            assert ro2.last_commit().step == 1
    assert snapshot(p) == before  # no file created or modified, .lock content (the writer's pid) included
    with pytest.raises(StoreLockedError):
        TensorStore.open(p)  # the writer still holds its lock
    writer.commit(record(2, 0))  # and still works
    writer.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("capsh") is None, reason="needs root and capsh to drop CAP_DAC_OVERRIDE")
def test_read_only_directory_as_a_user_sees_it(tmp_path):
    p = tmp_path / "s"
    make_run(p).close()
    for q in [p, *p.rglob("*")]:
        q.chmod(0o555 if q.is_dir() else 0o444)
    os.chmod(tmp_path, 0o555)  # a new store beside it cannot be made either
    code = textwrap.dedent(f"""
        from mtc.store import TensorStore, verify
        p = {str(p)!r}
        with TensorStore.open(p, read_only=True) as st:
            print("read", st.last_commit().step, st.read("layers/0002/master/g1").shape[0], verify(st).ok)
        for f in (lambda: TensorStore.open(p), lambda: TensorStore.create({str(tmp_path / "new")!r})):
            try:
                f()
            except Exception as e:
                print(type(e).__name__, e)
    """)
    # root ignores file modes; without CAP_DAC_OVERRIDE it is held to them, like any user
    cmd = ["capsh", "--drop=cap_dac_override,cap_dac_read_search,cap_fowner", "--", "-c", f'exec "{sys.executable}" -c "$0"', code]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    finally:
        os.chmod(tmp_path, 0o755)
        for q in [p, *p.rglob("*")]:
            q.chmod(0o755 if q.is_dir() else 0o644)
    lines = out.stdout.splitlines()
    assert lines[0] == "read 1 24 True", out.stdout + out.stderr
    assert lines[1].startswith("StoreError cannot lock store") and "permission denied" in lines[1] and "read-only" in lines[1]
    assert lines[2].startswith("StoreError cannot create store directory") and "permission denied" in lines[2]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("capsh") is None, reason="needs root and capsh to drop CAP_DAC_OVERRIDE")
def test_writing_a_read_only_directory_through_a_writable_lock_is_a_store_error(tmp_path):
    # the lock file is writable (the owner left it so), everything else read-only: opening works,
    # and the first metadata write (a resume sets the layout attribute) must be one clear line
    p = tmp_path / "s"
    make_run(p).close()
    for q in [p, *p.rglob("*")]:
        q.chmod(0o555 if q.is_dir() else 0o444)
    (p / ".lock").chmod(0o666)
    code = textwrap.dedent(f"""
        from mtc.store import TensorStore
        with TensorStore.open({str(p)!r}) as st:
            try:
                st.set_attribute("mtc_layers", {{"numels": [1]}})
            except Exception as e:
                print(type(e).__name__, e)
    """)
    cmd = ["capsh", "--drop=cap_dac_override,cap_dac_read_search,cap_fowner", "--", "-c", f'exec "{sys.executable}" -c "$0"', code]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    finally:
        for q in [p, *p.rglob("*")]:
            q.chmod(0o755 if q.is_dir() else 0o644)
    assert out.stdout.startswith("StoreError cannot write root attribute 'mtc_layers'"), out.stdout + out.stderr
    assert "permission denied" in out.stdout and "fix the permissions" in out.stdout


def test_permission_errors_are_store_errors(tmp_path, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("pathlib.Path.mkdir", denied)
    with pytest.raises(StoreError, match=r"cannot create store directory .*: permission denied"):
        TensorStore.create(tmp_path / "new")


# -- failed commits ---------------------------------------------------------------------------


class _Faults:
    """Raise OSError(code) at the n-th call of one file operation in the commit code."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, op: str, n: int, code: int = errno.ENOSPC) -> None:
        self.op, self.n, self.code, self.fired = op, n, code, False
        real_open, real_fsync, real_replace = builtins.open, os.fsync, os.replace

        def fault(op: str) -> None:
            if op == self.op and not self.fired:
                if self.n == 0:
                    self.fired = True
                    raise OSError(self.code, os.strerror(self.code))
                self.n -= 1

        class File:
            def __init__(self, f):
                self.f = f

            def write(self, data):
                fault("write")
                return self.f.write(data)

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        def fake_open(*a, **k):
            fault("open")
            return File(real_open(*a, **k))

        def fake_fsync(fd):
            fault("fsync")
            return real_fsync(fd)

        def fake_replace(a, b):
            fault("replace")
            return real_replace(a, b)

        monkeypatch.setattr(directory_mod, "open", fake_open, raising=False)  # the commit files' open only
        monkeypatch.setattr(os, "fsync", fake_fsync)
        monkeypatch.setattr(os, "replace", fake_replace)


@pytest.mark.parametrize(
    "code, words", [(errno.ENOSPC, "no space left on device"), (errno.EROFS, "read-only file system")], ids=["ENOSPC", "EROFS"]
)
def test_a_commit_that_cannot_be_written_keeps_the_last_commit(tmp_path, monkeypatch, code, words):
    p = tmp_path / "s"
    st = make_run(p)  # last commit: step 1
    sites = 0
    for op in ("open", "write", "fsync", "replace"):
        for n in range(30):  # fail the n-th call of `op`, for every n until the commit makes no such call
            st.create_array(f"extra/{op}{n}", (2,), torch.float32)  # new metadata: its fsync is part of the commit
            with monkeypatch.context() as m:
                faults = _Faults(m, op, n, code)
                try:
                    st.commit(record(2, 0))
                    msg = None
                except StoreError as e:
                    msg = str(e)
            if msg is None:
                assert not faults.fired
                st.commit(record(1, 1))  # the commit went through; back to step 1 for the next operation
                break
            assert faults.fired
            sites += 1
            if "may not survive a power loss" in msg:  # the directory fsync after the rename: too late to undo
                assert st.last_commit().step == 2 and "fsync of directory" in msg
                st.commit(record(1, 1))
                continue
            assert words in msg and ("the last commit (step 1) is intact" in msg or "the last commit is unchanged" in msg), msg
            with TensorStore.open(p, read_only=True) as ro:  # what a resume would see
                assert ro.last_commit().step == 1
                assert ro.commit_history()[-1].step == 1
                assert not (p / "commit.json.tmp").exists()
                assert verify(ro, check_chunks=False).ok, verify(ro).lines()
        else:
            raise AssertionError(f"the commit still failed after 30 faults of {op}")
    assert sites >= 6  # metadata fsyncs, record open/write/fsync, history open/write/fsync, rename, dir fsync
    st.close()


def test_a_failed_first_commit_leaves_the_store_uncommitted(tmp_path, monkeypatch):
    p = tmp_path / "s"
    st = TensorStore.create(p)
    with monkeypatch.context() as m:
        _Faults(m, "write", 1)  # the history append (the record went into the marker)
        with pytest.raises(StoreError, match="no space left on device writing .*commits.jsonl.*stays uncommitted.*same `mtc train`"):
            st.commit(record(0, 0))
    assert dir_state(p) == "uncommitted" and not (p / "commits.jsonl").exists()
    st.commit(record(0, 0))  # space is back
    assert dir_state(p) == "committed"
    st.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_enospc_on_a_real_small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        st = TensorStore.create(mnt / "s")
        st.commit(record(1, 1))
        with open(mnt / "filler", "wb", buffering=0) as f:  # take every free block
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        with pytest.raises(StoreError, match=r"no space left on device writing .*; the last commit \(step 1\) is intact"):
            st.commit(dataclasses.replace(record(2, 0), meta={"pad": "x" * 20000}))
        with TensorStore.open(mnt / "s", read_only=True) as ro:
            assert ro.last_commit().step == 1 and [r.step for r in ro.commit_history()] == [1]
        (mnt / "filler").unlink()
        st.commit(record(2, 0))
        assert st.last_commit().step == 2
        st.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
