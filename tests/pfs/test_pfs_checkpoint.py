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
