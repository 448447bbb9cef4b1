"""verify: damaged chunks, metadata, arrays and commit files are found; repair: commit.json is restored."""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest
from mtc.store import TensorStore, repair, state_array_name, verify

from mtc.errors import StoreCorruptionError, StoreError
from tests.store.runs import make_run, record, write_generation

M1 = state_array_name(0, "m", 1)  # layer 0's Adam m in generation 1, which the last commit (step 1) uses


def _flip(path, offset: int = 5) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.fixture
def run(tmp_path):
    st = make_run(tmp_path / "s")
    yield st
    st.close()


def test_a_healthy_store_verifies(run, tmp_path):
    rep = verify(run)
    assert rep.ok and rep.problems == () and rep.record.step == 1
    assert (rep.arrays_checked, rep.chunks_checked) == (6, 3 * 3 + 3 * 2)  # master, m, v of layers 0 and 2
    assert rep.lines()[-1] == "healthy"
    with TensorStore.create(None) as mem:  # in memory too
        assert verify(mem).ok and verify(mem).record is None
    mem = make_run(None)
    assert verify(mem).ok and verify(mem).chunks_checked == 15
    mem.close()


def test_fresh_zero_moments_are_written_and_checked(tmp_path):
    st = make_run(tmp_path / "s", steps=1)  # step 0: m and v all zeros
    zero = st.chunk_path(state_array_name(2, "v", 0), 1)
    assert zero.is_file(), "zero chunks are written (write_empty_chunks=True): an absent chunk is always damage"
    assert verify(st).ok
    zero.unlink()
    rep = verify(st)
    assert [(p.array, p.chunk) for p in rep.problems] == [(state_array_name(2, "v", 0), 1)]
    assert "is missing" in rep.problems[0].message and str(zero) in rep.problems[0].message
    st.close()


def test_corrupt_and_missing_chunks_are_named(run):
    _flip(run.chunk_path(M1, 1))
    run.chunk_path(state_array_name(2, "master", 1), 0).unlink()
    _flip(run.chunk_path(state_array_name(0, "m", 0), 0))  # the other generation: not the committed state
    rep = verify(run)
    assert not rep.ok
    got = {(p.array, p.chunk): p.message for p in rep.problems}
    assert set(got) == {(M1, 1), (state_array_name(2, "master", 1), 0)}
    assert "CRC32C" in got[(M1, 1)] and "is missing" in got[(state_array_name(2, "master", 1), 0)]
    assert any(line.startswith(f"damaged: array {M1} chunk 1: ") for line in rep.lines())
    assert "restore the store from a copy" in rep.lines()[-1]
    assert verify(run, check_chunks=False).ok  # the quick check reads no chunk


def test_garbled_array_metadata_and_missing_array(run, tmp_path):
    p = tmp_path / "s"
    (p / "layers/0000/v/g1/zarr.json").write_text("{not json")
    shutil.rmtree(p / "layers/0002/m/g1")
    with TensorStore.open(p, read_only=True) as ro:
        assert "layers/0000/v/g1" not in ro.array_names()  # listed without failing
        rep = verify(ro, check_chunks=False)
    got = {p.array: p.message for p in rep.problems}
    assert set(got) == {"layers/0000/v/g1", "layers/0002/m/g1"}
    assert "does not parse" in got["layers/0000/v/g1"] and "zarr.json" in got["layers/0000/v/g1"]
    assert "is missing (durability 'full' of step 1 needs it)" in got["layers/0002/m/g1"]


def test_metadata_that_parses_but_is_not_an_mtc_array(run, tmp_path):
    meta = tmp_path / "s/layers/0000/master/g0/zarr.json"
    meta.write_text(meta.read_text().replace('"mtc_dtype": "float32"', '"mtc_dtype": "float64"'))
    rep = verify(run, check_chunks=False)  # generation 0 is not the committed one, but every array's metadata is checked
    assert [(p.array, "damaged" in p.message) for p in rep.problems] == [("layers/0000/master/g0", True)]


def test_durability_modes_decide_what_must_exist(tmp_path):
    st = make_run(tmp_path / "w", durability="weights")  # step 1 wrote only master of generation 1
    assert verify(st).ok, verify(st).lines()
    st.chunk_path(state_array_name(0, "master", 1), 2).unlink()
    assert [(p.array, p.chunk) for p in verify(st).problems] == [(state_array_name(0, "master", 1), 2)]
    st.close()
    st = make_run(tmp_path / "n", durability="none")
    shutil.rmtree(tmp_path / "n/layers/0000/master/g1")
    assert verify(st).ok and verify(st).arrays_checked == 0
    st.close()


def test_commit_files_agree_or_say_why(run, tmp_path):
    p = tmp_path / "s"
    hist = p / "commits.jsonl"
    lines = hist.read_text().splitlines(keepends=True)
    # a commit interrupted between its history line and its rename: harmless
    hist.write_text("".join(lines) + record(2, 0).to_json() + "\n")
    rep = verify(run)
    assert rep.ok and any("never became commit.json" in n for n in rep.notes)
    # a torn line from a crash mid-append: harmless
    hist.write_text("".join(lines) + '{"step": 2, "gen')
    rep = verify(run)
    assert rep.ok and any("line 3 is torn" in n for n in rep.notes)
    # the history lost the last commit: damage (repair appends it)
    hist.write_text(lines[0])
    rep = verify(run)
    assert [p.where for p in rep.problems] == ["commits.jsonl"] and "disagrees" in rep.problems[0].message
    assert rep.lines()[-1].endswith("`mtc repair " + str(p) + "` writes commit.json's record back into commits.jsonl"), rep.lines()
    done = repair(run)
    assert "appended it to commits.jsonl" in done.actions[0] and verify(run).ok


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_repair_restores_commit_json(run, tmp_path, damage):
    p = tmp_path / "s"
    good = run.last_commit()
    run.close()
    if damage == "missing":
        (p / "commit.json").unlink()
    else:
        (p / "commit.json").write_text('{"step": 1, "generation"')
    with TensorStore.open(p, read_only=True) as ro:
        rep = verify(ro)
        # arrays checked via the history, whose record names its RNG states (in the resume file)
        assert [x.where for x in rep.problems] == ["commit.json"] and rep.record == dataclasses.replace(good, rng_state={})
        with pytest.raises(StoreCorruptionError, match=r"commit.json.*`mtc repair"):
            ro.last_commit()
        with pytest.raises(StoreError, match="read-only"):
            repair(ro)
    with TensorStore.open(p) as st:
        done = repair(st)
        assert done.restored == dataclasses.replace(good, rng_state={}) and f"commit.json was {damage}" in done.actions[-1]
        assert "step 1" in done.actions[-1]
        assert st.last_commit() == good
        assert repair(st).actions == ("commit.json is intact (step 1); nothing to repair",)
    with TensorStore.open(p, read_only=True) as ro:
        assert verify(ro).ok and ro.last_commit() == good and [r.step for r in ro.commit_history()] == [0, 1]


def _history(p):
    with TensorStore.open(p, read_only=True) as ro:
        return ro.commit_history()


def test_repair_falls_back_only_to_a_generation_nobody_rewrote(tmp_path):
    p = tmp_path / "s"
    st = make_run(p, steps=3)  # steps 0 (g0), 1 (g1), 2 (g0)
    st.close()
    (p / "commit.json").unlink()
    history = (p / "commits.jsonl").read_text()
    with TensorStore.open(p) as st:
        st.chunk_path(state_array_name(2, "v", 0), 0).unlink()  # step 2's state is damaged
        done = repair(st)
    # step 1 (g1) is intact; step 0 (g0) was rewritten by step 2 and is never a candidate
    assert done.restored.step == 1
    assert "skipped step 2" in done.actions[0] and "is missing" in done.actions[0]
    assert "the 1 step(s) since are lost" in done.actions[-1] and [r.step for r in _history(p)] == [0, 1, 2, 1]
    (p / "commit.json").unlink()
    (p / "commits.jsonl").write_text(history)  # as the run left it (repair appended the record it restored)
    with TensorStore.open(p) as st:
        time.sleep(0.05)  # file times are coarser than time.time()
        write_generation(st, 1)  # the write-behind of step 3 had begun overwriting generation 1 after step 2 committed
        refused = r"cannot repair store .*no record in commits.jsonl has intact state.*step 1.*written after the next commit"
        with pytest.raises(StoreError, match=refused):
            repair(st)
        assert not (p / "commit.json").exists()


def test_repair_refuses_without_history(run, tmp_path):
    p = tmp_path / "s"
    run.close()
    (p / "commit.json").write_text("garbage")
    (p / "commits.jsonl").write_text('{"torn"\n')
    with TensorStore.open(p) as st, pytest.raises(
        StoreError, match=r"cannot repair store .*commit.json is garbled.*commits.jsonl has no intact record.*restore the store from a copy"
    ):
        repair(st)



def test_repair_rolls_back_from_a_damaged_last_commit_to_the_whole_one_before(tmp_path):
    """commit.json intact, but a chunk of its generation fails its CRC: no run could resume from it.
    repair restores the previous commit (the other generation, whole), says which steps are lost,
    and then the store verifies; with nothing whole before it, it refuses as for a lost commit.json."""
    p = tmp_path / "s"
    st = make_run(p, steps=3)  # steps 0 (g0), 1 (g1), 2 (g0)
    _flip(st.chunk_path(state_array_name(0, "master", 0), 1))  # step 2's state
    assert not verify(st).ok and "rolls back to the newest earlier commit" in verify(st).lines()[-1]
    st.close()
    with TensorStore.open(p) as st:
        done = repair(st)
        assert done.restored.step == 1 and st.last_commit().step == 1
        assert "commit.json was intact, but step 2's state is damaged" in done.actions[-1]
        assert "training resumes from step 1 (the 1 step(s) since are lost)" in done.actions[-1]
        # the history ends with the restored commit again: verify reports no interrupted commit
        assert st.commit_history()[-1] == done.restored and [r.step for r in st.commit_history()] == [0, 1, 2, 1]
        rep = verify(st)
        assert rep.ok and rep.notes == (), rep.lines()
        assert repair(st).actions == ("commit.json is intact (step 1); nothing to repair",)
    with TensorStore.open(p) as st:
        _flip(st.chunk_path(state_array_name(0, "master", 1), 0))  # now step 1's too: step 0's generation was rewritten
        with pytest.raises(StoreError, match=r"cannot repair store .*step 1's state is damaged.*skipped step 0"):
            repair(st)


def test_a_groups_garbled_metadata_is_named_as_such_and_repair_rewrites_it(run, tmp_path):
    # the arrays below a group whose zarr.json does not parse were reported missing (the walk
    # stopped there) and repair refused, although a run still resumes from them
    g = tmp_path / "s" / "layers" / "zarr.json"
    g.write_text("{x")
    rep = verify(run)
    assert [p.where for p in rep.problems] == ["group layers"] and rep.arrays_checked == 6, rep.lines()
    assert "`mtc repair" in rep.lines()[-1] and "rewrites a group's garbled metadata" in rep.lines()[-1]
    done = repair(run)
    assert done.actions[0] == f"rewrote {g}, a group's metadata that did not parse (the nodes below it were whole)"
    assert done.restored is None and verify(run).ok
    (tmp_path / "s" / "layers" / "0000" / "master" / "g1" / "zarr.json").write_text("{x")  # an array's: not a group
    assert [p.where for p in verify(run).problems] == [M1.replace("/m/", "/master/")]
