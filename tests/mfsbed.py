"""The MooseFS test bed for tests: bring it up and down with scripts/pfs/moosefs.sh.

A bed is a real master (metadata server), chunkservers (data servers) and a FUSE client
mount, all on this machine, the servers inside a private network namespace. Tests that stop
a chunkserver or the master take a bed of their own (:func:`start_bed`); the others share the
session's bed (the ``pfs_bed`` fixture in conftest.py).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pfs" / "moosefs.sh"

# SHARDIO_PFS=required (CI) turns a bed that cannot start into a failure instead of a skip;
# SHARDIO_PFS=off skips the pfs tests outright.
REQUIRED = os.environ.get("SHARDIO_PFS", "") == "required"


class BedError(RuntimeError):
    """The bed could not be started, or a command on it failed."""


def unavailable_reason() -> str | None:
    """Why no bed can start here (not root, no FUSE, no ip), or None."""
    if os.environ.get("SHARDIO_PFS", "") == "off":
        return "SHARDIO_PFS=off"
    if os.geteuid() != 0:
        return "the MooseFS bed needs root (network namespace, FUSE mount)"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "the MooseFS bed needs ip (iproute2) and nsenter (util-linux)"
    return None


@dataclasses.dataclass
class Bed:
    """A running bed: its directory, mount point, namespace and master address."""

    root: pathlib.Path
    mount: pathlib.Path
    netns: str
    addr: str
    chunkservers: int

    def _script(self, *args: str, timeout: float = 120.0) -> str:
        proc = subprocess.run(
            [str(SCRIPT), args[0], str(self.root), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise BedError(f"moosefs.sh {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def admin(self, *cmd: str, timeout: float = 60.0) -> str:
        """Run an mfs* admin tool (mfsfileinfo, mfssetgoal, mfscli) in the bed's namespace."""
        return self._script("exec", *cmd, timeout=timeout)

    def stop_chunkserver(self, i: int) -> None:
        """Stop chunkserver ``i`` (1-based): its chunks become unreachable."""
        self._script("stop-cs", str(i))

    def start_chunkserver(self, i: int) -> None:
        self._script("start-cs", str(i))

    def stop_master(self) -> None:
        self._script("stop-master")

    def start_master(self) -> None:
        self._script("start-master")

    def chunk_files(self, path: os.PathLike[str] | str) -> list[tuple[int, pathlib.Path]]:
        """(chunkserver number, chunk file on its disk) for every chunk copy of ``path``.

        Found from ``mfsfileinfo`` (the chunk id and the copy's port) and the chunkserver's
        hdd directory, where a chunk lives as ``XX/chunk_<id>_<version>.mfs``.
        """
        out = self.admin("mfsfileinfo", os.fspath(path))
        found: list[tuple[int, pathlib.Path]] = []
        chunk = ""
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("chunk ") and ":" in line:
                chunk = line.split(":", 1)[1].split("/")[0].strip()  # 000..02_00000001
            elif line.startswith("copy ") and chunk:
                port = int(line.split(":")[2].split()[0])
                cs = port - 9421
                hdd = self.root / f"cs{cs}" / "hdd"
                matches = sorted(hdd.glob(f"*/chunk_{chunk}.mfs"))
                found.extend((cs, m) for m in matches)
        return found

    def stats(self) -> dict[str, int]:
        """The client's counters from MOUNT/.stats (``master.packets_sent`` among them)."""
        counters: dict[str, int] = {}
        text = (self.mount / ".stats").read_text(errors="replace")
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and value.strip().lstrip("-").isdigit():
                counters[name.strip()] = int(value.strip())
        return counters

    def down(self) -> None:
        self._script("down", timeout=180.0)


def start_bed(
    root: os.PathLike[str] | str,
    *,
    chunkservers: int = 2,
    ioretries: int = 30,
    goal: int = 1,
    extra: Sequence[str] = (),
) -> Bed:
    """Start a bed in ``root`` (new or empty); the caller must call :meth:`Bed.down`."""
    root = pathlib.Path(root)
    proc = subprocess.run(
        [
            str(SCRIPT),
            "up",
            str(root),
            "--chunkservers",
            str(chunkservers),
            "--ioretries",
            str(ioretries),
            "--goal",
            str(goal),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        # Leave nothing behind from a half-started bed.
        subprocess.run([str(SCRIPT), "down", str(root)], capture_output=True, check=False)
        raise BedError(f"the MooseFS bed did not start: {proc.stderr.strip()[-2000:]}")
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return Bed(
        root=root,
        mount=pathlib.Path(env["MFS_MOUNT"]),
        netns=env["MFS_NETNS"],
        addr=env["MFS_ADDR"],
        chunkservers=int(env["MFS_CHUNKSERVERS"]),
    )
