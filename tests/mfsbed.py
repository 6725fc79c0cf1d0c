"""The MooseFS test bed for tests: bring it up and down with scripts/pfs/moosefs.sh.

A bed is a real master (metadata server), chunkservers (data servers) and a FUSE client
mount, all on this machine, the servers inside a private network namespace. Tests that stop
a chunkserver or the master take a bed of their own (:func:`start_bed`); the others share the
session's bed (the ``pfs_bed`` fixture in conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pfs" / "moosefs.sh"

# SHARDIO_PFS=required (CI) turns a bed that cannot start into a failure instead of a skip;
# SHARDIO_PFS=off skips the pfs tests outright.
REQUIRED = os.environ.get("SHARDIO_PFS", "") == "required"


class BedError(RuntimeError):
    """The bed could not be started, or a command on it failed."""


def run_shielded(argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a moosefs.sh command to its end even through Ctrl-C or SIGTERM.

    ``subprocess.run`` kills its child when interrupted, which would cut a ``down`` half-way
    and leave a namespace or a mount behind; here the command runs in a session of its own
    (a terminal's Ctrl-C does not reach it), an interrupt is held until it has finished and
    raised then. Only the timeout kills it.
    """
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    interrupted: BaseException | None = None
    deadline = time.monotonic() + timeout
    while True:
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        except KeyboardInterrupt as exc:
            interrupted = exc  # let the bed's command finish first
    if interrupted is not None:
        raise interrupted
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


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
        proc = run_shielded([str(SCRIPT), args[0], str(self.root), *args[1:]], timeout=timeout)
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
        for raw in out.splitlines():
            line = raw.strip()
            if line.startswith("chunk ") and ":" in line:
                chunk = line.split(":", 1)[1].split("/")[0].strip()  # 000..02_00000001
            elif line.startswith("copy ") and chunk:
                port = int(line.split(":")[2].split()[0])
                cs = port - 9421
                hdd = self.root / f"cs{cs}" / "hdd"
                matches = sorted(hdd.glob(f"*/chunk_{chunk}.mfs"))
                found.extend((cs, m) for m in matches)
        return found

    def copies(self, path: os.PathLike[str] | str) -> list[int]:
        """The chunkservers (1-based) holding a valid copy of ``path``'s chunk."""
        out = self.admin("mfsfileinfo", os.fspath(path))
        return sorted(
            int(line.split(":")[2].split()[0]) - 9421
            for line in out.splitlines()
            if "VALID" in line
        )

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
    argv = [str(SCRIPT), "up", str(root), "--chunkservers", str(chunkservers)]
    argv += ["--ioretries", str(ioretries), "--goal", str(goal), *extra]
    try:
        proc = run_shielded(argv, timeout=600)
    except BaseException:
        # Interrupted or timed out: leave nothing behind of a bed nobody will own.
        run_shielded([str(SCRIPT), "down", str(root)], timeout=180)
        raise
    if proc.returncode != 0:
        # Leave nothing behind from a half-started bed.
        run_shielded([str(SCRIPT), "down", str(root)], timeout=180)
        raise BedError(f"the MooseFS bed did not start: {proc.stderr.strip()[-2000:]}")
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    bed = Bed(
        root=root,
        mount=pathlib.Path(env["MFS_MOUNT"]),
        netns=env["MFS_NETNS"],
        addr=env["MFS_ADDR"],
        chunkservers=int(env["MFS_CHUNKSERVERS"]),
    )
    claim(bed)
    return bed


OWNER_FILE = ".shardio-bed-owner"  # in a bed's directory: the pid of the session that started it


def claim(bed: Bed) -> None:
    """Record this process as the bed's owner (see :func:`reap_orphan_beds`)."""
    (bed.root / OWNER_FILE).write_text(f"{os.getpid()}\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(
    markers: Sequence[pathlib.Path], script: pathlib.Path, owner_file: str, *, timeout: float
) -> list[pathlib.Path]:
    """Take down (``script down DIR``) the directories of ``markers`` whose owning test
    session is gone (killed with SIGKILL, which no finalizer survives). One with no owner
    record, or a live owner, is left alone: it may be another session's, still starting or
    in use. Shared by the MooseFS beds and the SLURM clusters."""
    reaped = []
    for marker in sorted(markers):
        root = marker.parent
        try:
            pid = int((root / owner_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        proc = run_shielded([str(script), "down", str(root)], timeout=timeout)
        if proc.returncode == 0:
            (root / owner_file).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                root.rmdir()
            reaped.append(root)
    return reaped


def reap_orphan_beds(base: pathlib.Path) -> list[pathlib.Path]:
    """The beds under ``base`` whose owning session is gone, taken down (:func:`reap_orphans`)."""
    markers = list(base.glob("shardio-bed-*/.shardio-moosefs-bed"))
    return reap_orphans(markers, SCRIPT, OWNER_FILE, timeout=180)


# --------------------------------------------------------------------------- datasets
@dataclasses.dataclass(frozen=True)
class PfsDataset:
    """The small tree packed onto the shared bed once (read-only by convention: a test that
    damages it copies it first, on the mount).

    Attributes:
        path: the dataset directory on the mount.
        source: the source tree (local disk).
        payload: sample key -> the source file's bytes.
    """

    path: pathlib.Path
    source: pathlib.Path
    payload: Mapping[str, bytes]


def source_payload(src: pathlib.Path) -> dict[str, bytes]:
    """Sample key (the relative path without its extension) -> the file's bytes."""
    return {
        f.relative_to(src).as_posix().rsplit(".", 1)[0]: f.read_bytes()
        for f in sorted(src.rglob("*"))
        if f.is_file()
    }


def pfs_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process on the bed: no SLURM or shardio knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_"))}
    env.update(extra or {})
    return env


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Poll ``check`` every 0.5 s until it holds; fail the test after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.5)


def forget_bed_holds() -> None:
    """Remove the node's unavailability holds of files on a bed (an earlier stall of the same
    path must not help a later test), and only those: the registry's scope directories of
    other datasets, which tests running beside the bed tests may hold, are left alone."""
    import json

    top = pathlib.Path("/dev/shm") / f"shardio-unavailable-{os.getuid()}"
    if not top.is_dir() or top.is_symlink():
        return
    for scope in top.iterdir():
        if scope.is_symlink() or not scope.is_dir():
            continue
        on_bed = False
        for hold in scope.iterdir():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                on_bed = on_bed or "/shardio-bed-" in json.loads(hold.read_bytes()).get("path", "")
        if on_bed:
            shutil.rmtree(scope, ignore_errors=True)
