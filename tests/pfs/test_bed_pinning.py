"""The bed's --cpus: its master, chunkservers and client (every thread) run on those CPUs."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import tempfile
import uuid

import pytest
from mfsbed import SCRIPT, start_bed


def _online() -> list[int]:
    cpus: list[int] = []
    for item in pathlib.Path("/sys/devices/system/cpu/online").read_text().strip().split(","):
        lo, _, hi = item.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, check=True
    ).stdout
    return [int(p) for p in out.split()]


def _allowed(pid: int) -> dict[str, set[str]]:
    """Each thread's Cpus_allowed_list of ``pid``, by the process's name."""
    comm = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    lists: set[str] = set()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return {comm: lists}


def _daemons(netns: str) -> dict[str, list[set[str]]]:
    found: dict[str, list[set[str]]] = {}
    for pid in _netns_pids(netns):
        try:
            for comm, lists in _allowed(pid).items():
                found.setdefault(comm, []).append(lists)
        except FileNotFoundError:  # a short-lived helper ended meanwhile
            continue
    return found


def test_cpus_pins_every_daemon_and_its_later_threads():
    cpu = str(_online()[-1])
    root = pathlib.Path(tempfile.gettempdir()) / f"shardio-bed-{uuid.uuid4().hex[:10]}"
    bed = start_bed(root, chunkservers=2, extra=["--cpus", cpu])
    try:
        assert f"MFS_CPUS={cpu}" in (root / "bed.env").read_text().splitlines()
        # Reads through the client make it start its worker threads: they inherit the pin.
        data = os.urandom(4 << 20)
        (bed.mount / "blob").write_bytes(data)
        assert (bed.mount / "blob").read_bytes() == data
        bed.stop_chunkserver(2)
        stopped = subprocess.run(
            [str(SCRIPT), "status", str(root)], capture_output=True, text=True, check=True
        ).stdout
        # The master lists a stopped chunkserver as disconnected: not counted.
        assert "chunkservers connected: 1 of 2" in stopped, stopped
        bed.start_chunkserver(2)  # started again: pinned again, from bed.env
        # start-cs returns once the master lists it as connected.
        daemons = _daemons(bed.netns)
        assert sorted(daemons) == ["mfschunkserver", "mfsmaster", "mfsmount"], daemons
        assert len(daemons["mfschunkserver"]) == 2
        for comm, per_process in daemons.items():
            for lists in per_process:
                assert lists == {cpu}, f"{comm}: threads allowed on {lists}, not only {cpu}"
        status = subprocess.run(
            [str(SCRIPT), "status", str(root)], capture_output=True, text=True, check=True
        ).stdout
        assert f"pinned to CPUs: {cpu}" in status
        shown = [ln for ln in status.splitlines() if ln.startswith("  mfs")]
        assert len(shown) == sum(len(v) for v in daemons.values()), status
        assert all(ln.endswith(f"Cpus_allowed_list {cpu}") for ln in shown), status
    finally:
        bed.down()


@pytest.mark.parametrize("cpus", ["99", "a-b", "", "1-0", "0,,1", "0-99999"])
def test_a_bad_cpu_list_fails_in_one_line_and_starts_nothing(cpus):
    root = pathlib.Path(tempfile.gettempdir()) / f"shardio-bed-{uuid.uuid4().hex[:10]}"
    netns = "shardio-mfs-" + hashlib.sha256(str(root).encode()).hexdigest()[:8]  # moosefs.sh's
    proc = subprocess.run(
        [str(SCRIPT), "up", str(root), "--cpus", cpus],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--cpus" in lines[0] and repr(cpus) in lines[0].replace('"', "'")
    assert not root.exists()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert netns not in listed.stdout
