"""The test beds' reaper (tests/mfsbed.py: reap_orphans, used for the MooseFS beds and the
SLURM clusters): a bed whose owning session died (SIGKILL) is taken down by the next session;
one with a live owner, or no owner record, is left alone. ``down`` here is a recording script,
not moosefs.sh or cluster.sh: the real ones are run by tests/pfs and tests/slurm."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from mfsbed import reap_orphans

MARKER = ".marker"
OWNER = ".owner"


def _bed(base: pathlib.Path, name: str, owner: int | str | None) -> pathlib.Path:
    root = base / name
    root.mkdir()
    (root / MARKER).write_text("")
    if owner is not None:
        (root / OWNER).write_text(f"{owner}\n")
    return root


def test_only_beds_of_dead_sessions_are_taken_down(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "calls"
    script = tmp_path / "down.sh"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = down ] && rm -f "$2/{MARKER}"\n')
    script.chmod(0o755)
    base = tmp_path / "beds"
    base.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = _bed(base, "gone", int(dead.stdout))
    live = _bed(base, "live", os.getppid())
    mine = _bed(base, "mine", os.getpid())
    ownerless = _bed(base, "ownerless", None)
    garbled = _bed(base, "garbled", "12x")
    reaped = reap_orphans(list(base.glob(f"*/{MARKER}")), script, OWNER, timeout=30)
    assert reaped == [gone]
    assert log.read_text().split("\n")[:-1] == [f"down {gone}"]
    assert not gone.exists()  # down emptied it; the reaper removed the owner file and the dir
    for kept in (live, mine, ownerless, garbled):
        assert (kept / MARKER).exists()


def test_a_failed_down_keeps_the_bed_and_its_owner_record(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "down.sh"
    script.write_text("#!/bin/sh\nexit 1\n")
    script.chmod(0o755)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    root = _bed(tmp_path, "bed", int(dead.stdout))
    assert reap_orphans([root / MARKER], script, OWNER, timeout=30) == []
    assert (root / OWNER).exists() and (root / MARKER).exists()
