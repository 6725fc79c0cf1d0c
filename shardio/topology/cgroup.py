"""The CPU quota of this process's cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), read safely.

A container or a systemd slice may cap a process at, say, 1 CPU of time while its affinity
mask still lists 32 CPUs: nothing but the cgroup says so. The process's cgroup comes from
``<procfs>/self/cgroup``; the cgroup tree is ``<sysfs>/fs/cgroup`` (v2 when it holds
``cgroup.controllers``, else v1 with the ``cpu`` controller mounted at ``cpu,cpuacct``,
``cpuacct,cpu`` or ``cpu``). The quota in force is the tightest of the process's cgroup and
its ancestors (a parent's cap holds for its children), walked up to the tree's root: a few
small files. When the cgroup's directory is not in the tree (a container that sees its own
cgroup as the root, through a cgroup namespace or a bind mount), the root is read.

Every file goes through :func:`~shardio.topology.sysfs.read_attribute` (opened without
blocking, refused unless regular, at most 64 KiB). Roots are arguments (``SHARDIO_PROCFS``
and ``SHARDIO_SYSFS`` in the CLI and the loader), so tests use fake trees. What cannot be
read (a FIFO, a malformed file) is a one-line note, never an exception or a hang.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from shardio._env import shown_value
from shardio.errors import ShardioError
from shardio.topology.sysfs import read_attribute

__all__ = ["PROCFS_ENV", "CpuQuota", "read_cpu_quota"]

PROCFS_ENV = "SHARDIO_PROCFS"  # another procfs root to read (tests, containers)
_MAX_LEVELS = 16  # cgroups nest a handful deep (systemd slice, job, step, task)
_V1_MOUNTS = ("cpu,cpuacct", "cpuacct,cpu", "cpu")
_V2_MAX = re.compile(r"(max|[1-9][0-9]{0,17}) ([1-9][0-9]{0,17})")
_V1_QUOTA = re.compile(r"-1|[1-9][0-9]{0,17}")
_V1_PERIOD = re.compile(r"[1-9][0-9]{0,17}")


@dataclass(frozen=True, kw_only=True)
class CpuQuota:
    """The tightest CPU quota of this process's cgroup and its ancestors.

    Attributes:
        quota_us: CPU time the cgroup may use per period, in microseconds.
        period_us: the period, in microseconds.
        path: the file that sets it (``.../cpu.max`` or ``.../cpu.cfs_quota_us``).
        version: 1 or 2 (the cgroup hierarchy).
    """

    quota_us: int
    period_us: int
    path: str
    version: int

    @property
    def cpus(self) -> float:
        """The quota as CPUs: ``quota_us / period_us`` (1.5: one and a half CPUs of time)."""
        return self.quota_us / self.period_us

    def describe(self) -> str:
        """``"cgroup CPU quota 100000/100000 in /sys/fs/cgroup/job/cpu.max"``."""
        return f"cgroup CPU quota {self.quota_us}/{self.period_us} in {self.path}"


def _own_cgroups(procfs: str) -> list[tuple[str, list[str], str]]:
    """(hierarchy id, controllers, path) of each line of ``<procfs>/self/cgroup``."""
    text = read_attribute(os.path.join(procfs, "self", "cgroup"), what="procfs file")
    rows = []
    for line in (text or "").splitlines():
        hier, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if sep1 and sep2:
            rows.append((hier, [c for c in controllers.split(",") if c], path))
    return rows


def _levels(mount: str, path: str) -> list[str]:
    """The cgroup directories from the process's own up to the tree's root (``mount``).

    Raises:
        ShardioError: a path that is not absolute or climbs with ``..``.
    """
    parts = [p for p in path.split("/") if p]
    if not path.startswith("/") or any(p in (".", "..") for p in parts):
        raise ShardioError(f"cgroup path {shown_value(path)} is not a plain absolute path")
    own = os.path.join(mount, *parts)
    if not os.path.isdir(own):
        return [mount]  # the tree shows this cgroup as its root (a namespace, a container)
    levels = [os.path.join(mount, *parts[:n]) for n in range(len(parts), -1, -1)]
    return levels[:_MAX_LEVELS]


def _v2_quota(directory: str) -> CpuQuota | None:
    path = os.path.join(directory, "cpu.max")
    text = read_attribute(path, what="cgroup file")
    if text is None:
        return None
    match = _V2_MAX.fullmatch(text)
    if match is None:
        raise ShardioError(f"malformed cgroup file {path}: {shown_value(text)}")
    if match.group(1) == "max":
        return None
    return CpuQuota(
        quota_us=int(match.group(1)), period_us=int(match.group(2)), path=path, version=2
    )


def _v1_quota(directory: str) -> CpuQuota | None:
    path = os.path.join(directory, "cpu.cfs_quota_us")
    quota = read_attribute(path, what="cgroup file")
    if quota is None:
        return None
    if _V1_QUOTA.fullmatch(quota) is None:
        raise ShardioError(f"malformed cgroup file {path}: {shown_value(quota)}")
    if quota == "-1":
        return None
    period_path = os.path.join(directory, "cpu.cfs_period_us")
    period = read_attribute(period_path, what="cgroup file")
    if period is None or _V1_PERIOD.fullmatch(period) is None:
        shown = "missing" if period is None else shown_value(period)
        raise ShardioError(f"malformed cgroup file {period_path}: {shown}")
    return CpuQuota(quota_us=int(quota), period_us=int(period), path=path, version=1)


def read_cpu_quota(*, procfs: str = "/proc", sysfs: str = "/sys") -> tuple[CpuQuota | None, str]:
    """The CPU quota of this process's cgroup, and a note when it could not be read.

    Args:
        procfs: the procfs root (``self/cgroup`` is read there).
        sysfs: the sysfs root (the cgroup tree is its ``fs/cgroup``).

    Returns:
        The tightest quota of the process's cgroup and its ancestors, or None when none is
        set (``max``, ``-1``), there is no cgroup tree, or it could not be read; and ``""``,
        or one line saying what could not be read and why (a FIFO or device in place of a
        file, a malformed file, an odd path).
    """
    tree = os.path.join(sysfs, "fs", "cgroup")
    try:
        rows = _own_cgroups(procfs)
        if os.path.isfile(os.path.join(tree, "cgroup.controllers")):
            paths = [path for hier, ctl, path in rows if hier == "0" and not ctl]
            mount, read = tree, _v2_quota
        else:
            paths = [path for _, ctl, path in rows if "cpu" in ctl]
            mounts = [os.path.join(tree, m) for m in _V1_MOUNTS]
            mount = next((m for m in mounts if os.path.isdir(m)), "")
            read = _v1_quota
        if not paths or not mount:
            return None, ""
        found = [q for q in map(read, _levels(mount, paths[0])) if q is not None]
    except ShardioError as exc:  # StorageError (a FIFO, a device), FormatError (too big)
        return None, f"cgroup CPU quota not read: {exc}"
    return (min(found, key=lambda q: q.cpus) if found else None), ""
