"""benchmarks/bench_pfs.py and common.run_child's timeout: the parts that need no bed.

The benchmark itself needs root and a MooseFS bed and is never run by the tests; these check
that a child that hangs is killed with its whole process group, that the fault report is
parsed, and that a report with failed peers still renders (a failing peer is a row, never a
crash).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_pfs  # noqa: E402
import common  # noqa: E402


def test_run_child_timeout_kills_the_process_group(tmp_path: pathlib.Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    start = time.monotonic()
    run = common.run_child(["sh", "-c", script], timeout_s=0.5)
    assert time.monotonic() - start < 30
    assert run.timed_out
    assert run.returncode < 0
    grandchild = int(pidfile.read_text())
    for _ in range(100):  # the grandchild got SIGKILL too; give the kernel a moment
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the grandchild outlived the timeout")


def test_run_child_without_timeout_is_unchanged() -> None:
    run = common.run_child([sys.executable, "-c", "pass"])
    assert run.returncode == 0
    assert not run.timed_out


def test_fatal_frames_takes_the_current_thread() -> None:
    stderr = "\n".join(
        [
            "Fatal Python error: Bus error",
            "",
            "Thread 0x00007f (most recent call first):",
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait',
            "",
            "Current thread 0x00007e (most recent call first):",
            f'  File "{bench_pfs.REPO}/shardio/format/index.py", line 257 in open',
            '  File "/x/site.py", line 1 in f',
            "",
            "Thread 0x00007d (most recent call first):",
            '  File "/y.py", line 2 in g',
        ]
    )
    assert bench_pfs._fatal_frames(stderr) == "shardio/format/index.py:257 open; /x/site.py:1 f"


def test_chunkservers_of_parses_mfsfileinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    bed = bench_pfs.Bed("/nonexistent", chunkservers=2, ioretries=3)
    out = (
        "/m/a.tar:\n\tchunk 0: 02_01 / (id:2 ver:1)\n\t\tcopy 1: 10.1.2.1:9422 (status:VALID)\n"
        "/m/b.tar:\n\tchunk 0: 03_01 / (id:3 ver:1)\n\t\tcopy 1: 10.1.2.1:9423 (status:VALID)\n"
        "\tchunk 1: 04_01 / (id:4 ver:1)\n\t\tcopy 1: 10.1.2.1:9422 (status:VALID)\n"
    )
    monkeypatch.setattr(bed, "admin", lambda *argv: out)
    assert bed.chunkservers_of(["/m/a.tar", "/m/b.tar"]) == {"/m/a.tar": {1}, "/m/b.tar": {1, 2}}


def test_report_renders_failed_and_unavailable_peers(tmp_path: pathlib.Path) -> None:
    args = argparse.Namespace(
        mean_kb=110.0, classes=100, chunkservers=2, shard_size="32MiB", batch_size=64,
        workers=2, repeat=2, seed=0, spdl_threads=8, ioretries=3, read_timeout_s=5.0,
        dead_timeout=60.0, dead_modes="map",
    )  # fmt: skip
    by = {c.name: c for c in bench_pfs.CONFIGS}
    cat = bench_pfs.Outcome(by["cat-shards"], times={"cold": [1.0, 1.2], "warm": [0.1, 0.1]})
    sio = bench_pfs.Outcome(by["shardio-map-auto"], times={"cold": [2.0, None], "warm": []})
    sio.meta = dict.fromkeys(bench_pfs.COUNTERS, 10.0)
    lit = bench_pfs.Outcome(by["litdata"], status="unavailable", note="exit 3: no litdata")
    lit.times = {"cold": [None, None], "warm": [None, None]}
    lit.meta_note = "exit 3: no litdata"
    state = common.code_state(bench_pfs.REPO)
    facts = {
        "files": 3000, "payload": 330e6, "bed_argv": ["bash", "up"], "mfs_version": "MFS 4",
        "bed_fs": "ext2/ext3", "shards": 10, "shard_bytes": 331e6, "workdir_fs": "ext2/ext3",
        "argv": ["python", "bench_pfs.py"], "started": "now", "elapsed_s": 60.0,
        "load_before": "1 1 1", "load_after": "2 2 2", "cold_ok": True, "code_before": state,
        "code_after": state, "versions": "torch 2",
    }  # fmt: skip
    probe = {
        "read_timeout_s": False, "read_strategy": False, "strategy_users": [],
        "strategy-auto": {"name": "pfs", "reason": "auto"},
        "strategy-local": {"name": "local", "reason": "forced"},
    }  # fmt: skip
    dead = {
        "shards": 10, "lost_shards": ["shard-000001.tar"],
        "runs": {
            "map-healthy": {"time_s": 3.0, "samples": 3000, "expected": 3000, "done": True},
            "map-dead": {"time_s": 60.0, "samples": 12, "timed_out": True, "expected": 3000},
        },
    }  # fmt: skip
    body = bench_pfs._report(args, [cat, sio, lit], {}, probe, None, dead, facts)
    assert "unavailable: exit 3: no litdata" in body
    assert "0.50x" in body  # shardio's one cold round against cat's: 1.0 / 2.0
    assert "**not available**" in body
    assert "did not finish" in body
