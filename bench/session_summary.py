"""One screen of a GPU session's headline figures, printed last, from the JSON records it wrote.

The device tool returns only the last 12,000 characters of a call's output, and its files only when
there are few enough of them (2026-11-27: a call's records were lost, and the P3 and P1-16 tables,
printed minutes before the end, had scrolled out of the reply). `bench/gpu_session.sh` runs this
after its last part so that the reply's tail holds every part's table and goal verdict whatever
happens to the files: bench_train's table (the same printer the benchmark uses; a part cut off by
the time limit shows the settings it finished), bench_fusion's goal table and per-variant medians,
the whole-model line, and the gpu tests' outcome.

    python3 bench/session_summary.py --newer FILE [--tests-log PATH]   # records in bench/results newer than FILE
    python3 bench/session_summary.py RECORD.json ...                    # these records
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS  # noqa: E402


def load(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """Each readable record with its path, in the order given (unreadable ones reported and skipped)."""
    out = []
    for p in paths:
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError) as e:
            print(f"session summary: cannot read {p}: {e}")
    return out


def newer_than(directory: Path, marker: Path) -> list[Path]:
    """Records in ``directory`` modified after ``marker`` (the session's start), oldest first."""
    since = marker.stat().st_mtime
    found = [p for p in directory.glob("*.json") if p.stat().st_mtime > since]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def tests_outcome(log: Path) -> list[str]:
    """The gpu tests' closing lines (one per pytest run the log holds: gpu_session.sh runs the tests
    that time the GPU after the others, by themselves) and every FAILED / ERROR line of a pytest log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as e:
        return [f"gpu tests: no log ({e})"]
    bad = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    # pytest's last line, whatever it counts: a run whose gpu tests all skipped (torch saw no GPU)
    # or that selected none ended too, and says so there
    closing = [ln for ln in lines if ln.startswith("=") and re.search(
        r"\d+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b|no tests ran", ln)]
    return (closing or ["gpu tests: no closing line in the log (cut off?)"]) + bad


def _train_rows(rec: dict[str, Any]) -> dict[str, Any]:
    """A bench_train record as `print_table` takes it; a part cut off mid-way keeps the settings it finished."""
    if "settings_done" in rec and "settings" not in rec:
        return {**rec, "settings": list(rec["settings_done"].values())}
    return rec


def _fusion_lines(rec: dict[str, Any]) -> list[str]:
    """A bench_fusion block or head: each variant's median, then the launches."""
    name = f"{rec['arch']}/{rec['part']}"
    rows = [f"{name:12s} {v:22s} {r['median_ms']:8.2f} ms {r['tflops']:7.1f} TFLOP/s"
            + (f", enqueued in {r['enqueue_median_ms']:.2f} ms" if r.get("enqueue_median_ms") is not None else "")
            for v, r in rec["results"].items() if "median_ms" in r]
    if rec.get("launches_per_block"):
        rows.append(f"{name:12s} launches per block: {rec['launches_per_block']}")
    if rec.get("compute_floor"):
        import bench_fusion

        f = rec["compute_floor"]
        rows.append(f"{name:12s} {bench_fusion._floor_text(f)}")
        # where each profiled variant's time goes: what a missed goal is read off (the kernel tables are in the log)
        for v, sp in f.get("split_ms", {}).items():
            busy = (rec.get("profile", {}).get(v) or {}).get("gpu_ms_total")
            med = rec["results"].get(v, {}).get("median_ms")
            tail = f", GPU busy {busy:.2f} of {med:.2f} ms" if busy is not None and med is not None else ""
            rows.append(f"{name:12s}   {v:20s} matmul {sp['matmul']:.2f}, attention {sp['attention']:.2f}, "
                        f"other kernels {sp['other']:.2f} ms{tail}")
    return rows


def _model_lines(rec: dict[str, Any]) -> list[str]:
    """bench_fusion's whole-model record: its line as the benchmark prints it, then each variant's ms per step."""
    import bench_fusion

    times = ", ".join(f"{v} {r['median_ms']:.1f}" for v, r in rec.get("results", {}).items() if "median_ms" in r)
    return [bench_fusion.model_text(rec), f"model/{rec['shape']:5s} ms per step: {times or 'none finished'}"]


def _guarded(what: str, fn: Callable[[], object]) -> bool:
    """Run one section's printer; a record it cannot read is reported, and the summary goes on."""
    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001 - the summary is the last thing a device call prints: never lose the rest
        print(f"session summary: {what} could not be printed ({type(e).__name__}: {e})")
        return False


def _print_siblings(rec: dict[str, Any]) -> None:
    for shape, gs in rec.get("results", {}).items():
        print(f"siblings {shape}: merged matmuls save per joint call " + "; ".join(
            f"{g} {r['saved_ms_per_joint']:.3f} ms ({r['saved_ms_per_joint_with_cat']:.3f} with the cat)" for g, r in gs.items()))


def summarize(records: list[tuple[Path, dict[str, Any]]], tests_log: Path | None = None) -> None:
    """Print every record's headline figures, grouped by benchmark, and the gpu tests' outcome."""
    print("\n=== session summary: this call's records ===")
    if tests_log is not None:
        for ln in tests_outcome(tests_log):
            print(ln)
    kinds: dict[str, list[tuple[Path, dict[str, Any]]]] = {"train": [], "model": [], "part": [], "siblings": [], "other": []}
    for p, r in records:
        name = r.get("benchmark", "")
        kind = ("train" if name.startswith("bench_train") else "model" if name.startswith("bench_fusion-model")
                else "part" if name.startswith("bench_fusion") and "goal" in r
                else "siblings" if name.startswith("bench_sibling_matmuls") else "other")
        kinds[kind].append((p, r))
    if kinds["train"]:
        import bench_train  # torch and mtc: only when there is a table to print

        table = {r["part"]: _train_rows(r) for _, r in kinds["train"]}
        if not _guarded("bench_train's table", lambda: bench_train.print_table(table)):
            for part, rec in table.items():  # one part's odd record must not hide the others'
                _guarded(f"bench_train's {part}", lambda rec=rec, part=part: bench_train.print_table({part: rec}))
    if kinds["part"]:
        import bench_fusion

        for _, rec in kinds["part"]:
            _guarded(f"{rec.get('arch')}/{rec.get('part')}", lambda rec=rec: [print(ln) for ln in _fusion_lines(rec)])
        _guarded("bench_fusion's goal table", lambda: bench_fusion.print_goals([r for _, r in kinds["part"]]))
    for _, rec in kinds["model"]:
        _guarded("the whole-model line", lambda rec=rec: [print(ln) for ln in _model_lines(rec)])
    for _, rec in kinds["siblings"]:
        _guarded("bench_sibling_matmuls", lambda rec=rec: _print_siblings(rec))
    for p, rec in kinds["other"]:
        print(f"{rec.get('benchmark', '?')}: {p.name}")
    devices = sorted({str(r.get("device")) for _, r in records})
    shas = sorted({str(r.get("git_sha", ""))[:7] for _, r in records})
    print(f"records: {len(records)}; device {', '.join(devices) or '-'}; git {', '.join(shas) or '-'}")


def main() -> None:
    """Parse, load the records, print the summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="*", type=Path, help="record files (default: --newer's)")
    ap.add_argument("--newer", type=Path, help="take the records in --dir modified after this file")
    ap.add_argument("--dir", type=Path, default=RESULTS, help="where records are (default bench/results)")
    ap.add_argument("--tests-log", type=Path, help="the gpu tests' pytest log: its closing line and failures")
    a = ap.parse_args()
    if not a.records and a.newer is None:
        ap.error("name record files or --newer FILE")
    paths = list(a.records) + (newer_than(a.dir, a.newer) if a.newer is not None else [])
    summarize(load(paths), a.tests_log)


if __name__ == "__main__":
    main()
