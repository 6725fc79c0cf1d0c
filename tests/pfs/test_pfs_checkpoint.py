"""Checkpoints on the real MooseFS bed: saved and loaded through the FUSE client, and a save
whose data server is dead: a clear error within the write deadline, the previous checkpoint
still the latest and loadable.

Storage classes in strict mode (labels A and B, scripts/pfs/moosefs.sh) place the first
checkpoint on chunkserver B and make new files go to A; A is then stopped. A write to a chunk
no live server may hold is held by the client (the close stalls for minutes, in the kernel):
shardio abandons the save after ``write_timeout_s`` and says so.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

from mfsbed import Bed

_SAVE = """
import json, os, sys, time
import torch
from shardio.checkpoint import load_latest, save
d, step = sys.argv[1], int(sys.argv[2])
out = {}
began = time.monotonic()
try:
    out["path"] = save({"w": torch.full((1 << 20,), float(step)), "step": step}, d, step=step,
                       environ={"SLURM_JOB_ID": "77"}, write_timeout_s=15, read_timeout_s=20)
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["save_s"] = time.monotonic() - began
ck = load_latest(d, read_timeout_s=20)
out.update(step=ck.step, w=float(ck.state["w"][0]), loaded=ck.path)
print(json.dumps(out), flush=True)
os._exit(0)  # not waiting for the close a dead server holds
"""


def _save(ckdir: pathlib.Path, step: int) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVE, str(ckdir), str(step)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the result comes before the exit a stalled close holds
    assert line, proc.stderr.read() if proc.stderr else ""
    return proc, json.loads(line)


def test_a_save_with_its_data_server_dead_fails_clearly_and_the_previous_loads(
    private_bed: Callable[..., Bed],
) -> None:
    bed = private_bed(chunkservers=2, ioretries=3, goal=1)
    for label in "AB":
        bed.admin("mfsscadmin", str(bed.mount), "create", "-m", "S", "-K", label, f"ck_{label}")
    ckdir = bed.mount / "ckpt"
    ckdir.mkdir()
    bed.admin("mfssetsclass", "ck_B", str(ckdir))
    proc, first = _save(ckdir, 1)
    proc.communicate(timeout=60)
    assert "error" not in first and first["step"] == 1 and first["w"] == 1.0
    (rank_file,) = pathlib.Path(first["path"]).glob("*.pt.zst")
    assert bed.copies(rank_file) == [2]  # on B

    bed.admin("mfssetsclass", "ck_A", str(ckdir))  # what is written next goes to A
    bed.stop_chunkserver(1)
    began = time.monotonic()
    proc, second = _save(ckdir, 2)
    try:
        print(f"\n[checkpoint, data server dead] save failed after {second['save_s']:.1f} s")
        assert "CheckpointError" in second["error"] and "stalled for 15 s" in second["error"]
        assert second["save_s"] < 40 and time.monotonic() - began < 90
        assert (second["step"], second["w"], second["loaded"]) == (1, 1.0, first["path"])
    finally:
        bed.start_chunkserver(1)  # releases the close the dead server held
        proc.communicate(timeout=300)
    names = [p.name for p in ckdir.iterdir() if not p.name.startswith(".")]
    assert names == [pathlib.Path(first["path"]).name]  # nothing of step 2 under a final name


_LOAD = """
import json, os, sys, time
d = sys.argv[1]
if sys.argv[2] == "1":  # drop the cached pages only: what is read comes from the servers
    for root, _, names in os.walk(d):
        for name in names:
            if os.path.islink(os.path.join(root, name)):  # the lease: metadata only
                continue
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    print("{}", flush=True)
    os._exit(0)
from shardio.checkpoint import load_latest
began = time.monotonic()
try:
    ck = load_latest(d, read_timeout_s=5)
    out = {"step": ck.step}
except Exception as exc:
    out = {"type": type(exc).__name__, "error": str(exc),
           "retryable": getattr(exc, "retryable", False)}
out["load_s"] = time.monotonic() - began
print(json.dumps(out), flush=True)
os._exit(0)  # not waiting for the reads a dead server holds
"""


def _load(
    ckdir: pathlib.Path, *, dead: bool, uncache: bool = False
) -> tuple[subprocess.Popen[str], dict]:
    """load_latest in a child; ``uncache``: only drop the cached pages of the checkpoints (a
    walk of the directory: only while the metadata server is up)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOAD, str(ckdir), "1" if uncache else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else ""
    result = json.loads(line)
    if dead:
        print(f"\n[checkpoint load, server dead] {result}")
    return proc, result


def test_a_dead_server_makes_load_latest_retryable_never_a_fresh_start(
    private_bed: Callable[..., Bed],
) -> None:
    """A data server, then the metadata server, down: load_latest says "cannot be read now"
    (retryable) within its deadline, never NoCheckpointError (which restart code reads as
    "start afresh"), and loads the checkpoint once the server is back."""
    bed = private_bed(chunkservers=1, goal=1)
    ckdir = bed.mount / "ckpt"
    proc, first = _save(ckdir, 1)
    proc.communicate(timeout=60)
    assert "error" not in first and first["step"] == 1
    procs, stopped = [], []
    try:
        _load(ckdir, dead=False, uncache=True)[0].communicate(timeout=60)
        bed.stop_chunkserver(1)
        stopped.append("cs")
        proc, seen = _load(ckdir, dead=True)
        procs.append(proc)
        # the lease, the manifest or the file: whichever is read first names what stalled
        assert seen["type"] == "CheckpointUnavailableError" and seen["retryable"]
        assert "cannot be read now (not damaged; retry)" in seen["error"]
        assert str(ckdir) in seen["error"] and seen["load_s"] < 30
        bed.start_chunkserver(1)
        stopped.remove("cs")
        proc, back = _load(ckdir, dead=False)
        procs.append(proc)
        assert back.get("step") == 1, back
        bed.stop_master()
        stopped.append("master")
        time.sleep(2)  # past the client's attribute and entry caches
        proc, seen = _load(ckdir, dead=True)
        procs.append(proc)
        assert seen["type"] == "CheckpointUnavailableError" and seen["retryable"]
        assert "cannot be read now (not damaged; retry)" in seen["error"]
        assert "stalled for 5 s" in seen["error"] and seen["load_s"] < 30
    finally:
        if "master" in stopped:
            bed.start_master()
        if "cs" in stopped:
            bed.start_chunkserver(1)
        for p in procs:
            p.communicate(timeout=300)
