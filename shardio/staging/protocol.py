"""The staging-cache protocol: how ``shardio stage``, readers and eviction share a staging area.

This module is the protocol's one home; stage, evict and the read side's resolver
(:mod:`shardio.read.resolver`) only call it.

- **Marker.** ``DEST/.shardio-stage/area.json`` says a directory is a staging area: staging,
  cleaning and repair never touch a directory without one. It records the dataset id of
  what is staged there (``dataset_id``: the xxh3-128 of the source manifest's bytes), which
  staging, ``stage=``, verify and repair check (:mod:`shardio.staging.identity`).
- **Stamps.** A copy is published under its final name only after its xxh3-128 matched the
  manifest; then a stamp records its size, inode, ctime and mtime beside the digest. Any
  write changes ctime, which no user can set back, so a copy whose ``lstat`` still matches its
  stamp is trusted without re-hashing (every member is still checked on read). A symlink or
  special file never matches a stamp.
- **Plan.** ``plan.json`` lists the shards the last ``shardio stage`` run chose for this node
  (its ``--node`` share within ``--capacity``): verify and repair tell a planned copy that
  is missing from a shard this node never stages. ``held`` lists the copies earlier runs
  staged that this plan no longer needs (a share re-dealt after a node was lost): they stay
  until evicted, and another node re-staging reads them as a peer (``--peers``).
- **Per-shard lock file** (``locks/``, :func:`shard_lock`, exclusive, blocking). Held by
  whoever copies, re-stages or drops a shard: the first rank of a node copies, the others
  wait and then find the stamp. A killed holder's lock goes with its process.
- **Readers' shared lock** (:func:`lock_for_reading`): a reader holds ``LOCK_SH`` on the staged
  copy's own descriptor while it is open.
- **Eviction** (:func:`try_lock_for_eviction`) takes ``LOCK_EX | LOCK_NB`` on the copy and skips
  any copy a reader holds.
- **Dropping a bad copy** (:func:`drop_if_same`): under the shard's lock, and only when the file
  at the path is still the one that failed (same device and inode): a copy that another
  process has re-staged meanwhile is kept. Re-staging publishes a new file by rename, so
  readers still holding the old descriptor finish on the old bytes.
- Staged files are removed through directory descriptors, never through a symlink, and only
  when they are regular files (:func:`drop_staged`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

import xxhash

from shardio.errors import StorageError, UsageError
from shardio.storage.atomic import atomic_write, storage_error
from shardio.storage.files import (
    describe_kind,
    make_dirs_inside,
    open_regular,
    read_regular,
    real_dir,
    unlink_inside,
)

__all__ = [
    "AREA_FILE",
    "AREA_LOCK",
    "AREA_FORMAT",
    "AREA_VERSION",
    "PLAN_FILE",
    "STAGE_DIR",
    "StampCache",
    "area_lock",
    "drop_if_same",
    "drop_staged",
    "lock_for_reading",
    "lock_path",
    "lock_rel",
    "read_area_marker",
    "read_held",
    "read_plan",
    "read_staged_for",
    "shard_lock",
    "staged_identity",
    "stamp_matches",
    "stamp_path",
    "stamp_rel",
    "try_lock_for_eviction",
    "write_plan",
    "write_area_marker",
    "write_stamp",
]

STAGE_DIR = ".shardio-stage"
AREA_FILE = "area.json"
AREA_LOCK = "area.lock"
AREA_FORMAT = "shardio-stage"
AREA_VERSION = 1

_MAX_RECORD_BYTES = 64 * 1024  # a marker or a stamp is a few hundred bytes
_MAX_NAME = 200  # below NAME_MAX (255) with room for a temp suffix


def _record_name(rel: str, suffix: str) -> str:
    name = rel.replace("/", "__") + suffix
    if len(name) > _MAX_NAME:  # a deep shard path: a fixed-length name that fits NAME_MAX
        name = xxhash.xxh3_128_hexdigest(rel.encode("utf-8", "surrogateescape")) + suffix
    return name


def stamp_rel(rel: str) -> str:
    """The stamp of staged ``rel``, relative to its staging area."""
    return f"{STAGE_DIR}/ok/{_record_name(rel, '.json')}"


def stamp_path(dest: str, rel: str) -> str:
    """Path of the stamp of staged ``rel`` in ``dest``."""
    return os.path.join(dest, stamp_rel(rel))


def lock_rel(rel: str) -> str:
    """The lock file of staged ``rel``, relative to its staging area."""
    return f"{STAGE_DIR}/locks/{_record_name(rel, '.lock')}"


def lock_path(dest: str, rel: str) -> str:
    """Path of the lock file of staged ``rel`` in ``dest``."""
    return os.path.join(dest, lock_rel(rel))


# --------------------------------------------------------------------------- area marker


def read_area_marker(dest: str) -> dict[str, Any] | None:
    """The marker of the staging area ``dest``, or None when it has no valid one.

    Valid: ``DEST/.shardio-stage`` is a real directory (not a symlink) holding a regular
    ``area.json`` whose JSON names the ``shardio-stage`` format. Never blocks (a FIFO there
    is no marker).
    """
    folder = os.path.join(dest, STAGE_DIR)
    if not real_dir(folder):
        return None
    path = os.path.join(folder, AREA_FILE)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        doc = json.loads(read_regular(path, max_bytes=_MAX_RECORD_BYTES, what="area marker"))
    except (OSError, ValueError):  # StorageError, FormatError, bad JSON: no marker
        return None
    if isinstance(doc, dict) and doc.get("format") == AREA_FORMAT:
        return doc
    return None


def write_area_marker(dest: str, staged_from: str, *, dataset_id: str, durable: bool) -> None:
    """Make ``dest`` a staging area of the dataset ``dataset_id`` (the xxh3-128 of the
    source manifest's bytes, see :mod:`shardio.format.identity`): create ``.shardio-stage``
    and publish its marker.

    Raises:
        UsageError: ``.shardio-stage`` is a symlink or not a directory.
        StorageError: the marker cannot be written.
    """
    folder = make_dirs_inside(dest, STAGE_DIR)
    doc = {
        "format": AREA_FORMAT,
        "version": AREA_VERSION,
        "staged_from": staged_from,
        "dataset_id": dataset_id,
    }
    with atomic_write(os.path.join(folder, AREA_FILE), durable=durable) as fh:
        fh.write(json.dumps(doc).encode("utf-8", "surrogateescape") + b"\n")


# --------------------------------------------------------------------------- stamps


def _stat_key(path: str) -> dict[str, int] | None:
    """The stat that a stamp records; None unless ``path`` is a regular file (no symlink)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {
        "size": st.st_size,
        "ino": st.st_ino,
        "ctime_ns": st.st_ctime_ns,
        "mtime_ns": st.st_mtime_ns,
    }


def stamp_matches(dest: str, rel: str, xxh3_128: str) -> bool:
    """Whether DEST holds a verified copy of ``rel`` that has not changed since (a write
    changes ctime, which no user can set back). A symlink or special file never matches."""
    key = _stat_key(os.path.join(dest, rel))
    if key is None:
        return False
    try:
        stamp = json.loads(read_regular(stamp_path(dest, rel), max_bytes=_MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return False
    return bool(
        isinstance(stamp, dict) and stamp.get("xxh3_128") == xxh3_128 and stamp.get("stat") == key
    )


class StampCache:
    """:func:`stamp_matches` for a reader that asks again every epoch: each stamp is read
    once, then only ``lstat``'ed while it stays the same file.

    A stamp is only ever published by rename (a new inode) or removed, never written in
    place, and any write would change its ctime: while the ``lstat`` of the stamp (device,
    inode, size, ctime, mtime) is the one recorded when it was read, its content is the one
    read. The copy itself is still ``lstat``'ed against it on every call, so a question costs
    two ``lstat`` calls instead of an ``lstat``, an open, two ``fstat`` and a close. A stamp
    that is a symlink or a special file never matches (and is never opened through a symlink).
    """

    def __init__(self) -> None:
        self._read: dict[str, tuple[tuple[int, ...], object]] = {}

    def matches(self, dest: str, rel: str, xxh3_128: str) -> bool:
        """Whether DEST holds a verified copy of ``rel`` unchanged since (as
        :func:`stamp_matches`)."""
        key = _stat_key(os.path.join(dest, rel))
        if key is None:
            return False
        path = stamp_path(dest, rel)
        try:
            st = os.lstat(path)
        except OSError:
            self._read.pop(path, None)
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns, st.st_mtime_ns)
        known = self._read.get(path)
        if known is None or known[0] != identity:
            try:
                # Read after the lstat: what is kept under ``identity`` is that file or a
                # newer one, whose own identity differs, so it is read again next time.
                known = (identity, _read_stamp(path))
            except (OSError, ValueError):
                return False
            self._read[path] = known
        stamp = known[1]
        return bool(
            isinstance(stamp, dict)
            and stamp.get("xxh3_128") == xxh3_128
            and stamp.get("stat") == key
        )


def _read_stamp(path: str) -> object:
    """The JSON of a stamp: one open and one fstat (``open_regular``), never through a
    symlink."""
    fd = open_regular(path, what="stamp", nofollow=True)
    try:
        data = b""
        while len(data) <= _MAX_RECORD_BYTES:  # published whole: one read is the usual case
            chunk = os.read(fd, _MAX_RECORD_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > _MAX_RECORD_BYTES:
        raise ValueError(f"stamp {path} is larger than a stamp can be")
    return json.loads(data)


def write_stamp(dest: str, rel: str, xxh3_128: str, durable: bool) -> None:
    """Record that the copy of ``rel`` in ``dest`` was verified against ``xxh3_128``.

    Raises:
        StorageError: the copy is gone or not a regular file, or the stamp cannot be written.
    """
    key = _stat_key(os.path.join(dest, rel))
    if key is None:
        raise StorageError(
            errno.ENOENT, f"staged copy {os.path.join(dest, rel)} vanished before its stamp"
        )
    with atomic_write(stamp_path(dest, rel), durable=durable) as fh:
        fh.write(json.dumps({"xxh3_128": xxh3_128, "stat": key}).encode("ascii"))


def drop_staged(dest: str, rel: str) -> bool:
    """Remove a staged copy and its stamp (it failed its checksum, or is evicted); return
    whether the copy was removed.

    Only a regular file is removed, and never through a symlinked directory: anything else at
    that path was not made by staging and stays (it never matches a stamp either).
    """
    unlink_inside(dest, stamp_rel(rel))
    return unlink_inside(dest, rel)


def staged_identity(dest: str, rel: str) -> tuple[int, int] | None:
    """(device, inode) of the regular file staged as ``rel``, or None."""
    try:
        st = os.lstat(os.path.join(dest, rel))
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def drop_if_same(dest: str, rel: str, identity: tuple[int, int] | None) -> bool:
    """Drop staged ``rel`` if it is still the file ``identity`` names (call under
    :func:`shard_lock`); None drops whatever regular file is there. Return whether a copy was
    removed."""
    if identity is not None and staged_identity(dest, rel) != identity:
        return False
    return drop_staged(dest, rel)


# --------------------------------------------------------------------------- locks


@contextlib.contextmanager
def shard_lock(dest: str, rel: str) -> Iterator[None]:
    """Hold the exclusive lock of staged ``rel`` (its lock file): copy, re-stage or drop it.

    Raises:
        UsageError: the lock file is a symlink or not a regular file.
        StorageError: it cannot be opened.
    """
    with _exclusive(lock_path(dest, rel)):
        yield


@contextlib.contextmanager
def area_lock(dest: str) -> Iterator[None]:
    """Hold the area's own exclusive lock (``.shardio-stage/area.lock``): deciding which
    dataset the area holds (and, with ``--force``, replacing it) is done under it, so two
    stagers of a node never both replace the area.

    Raises:
        UsageError: the lock file is a symlink or not a regular file.
        StorageError: it cannot be opened.
    """
    make_dirs_inside(dest, STAGE_DIR)
    with _exclusive(os.path.join(dest, STAGE_DIR, AREA_LOCK)):
        yield


@contextlib.contextmanager
def _exclusive(path: str) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(
                f"lock file {path} is a symlink: shardio does not write through symlinks; remove it"
            ) from exc
        raise storage_error(exc, path, "locking") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(
                f"lock file {path} is a {describe_kind(mode)}, not a regular file; remove it"
            )
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another rank copies this shard
        yield
    finally:
        os.close(fd)  # releases the lock; a killed holder's lock goes with its process


def lock_for_reading(fd: int, path: str) -> None:
    """Take the reader's shared lock on an open staged copy (eviction then skips it).

    Raises:
        StorageError: the lock cannot be taken.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot lock shard {path}: {exc.strerror}") from exc


def try_lock_for_eviction(fd: int) -> bool:
    """Take the exclusive lock on an open staged copy without waiting; False while a reader
    holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


# --------------------------------------------------------------------------- plan

PLAN_FILE = "plan.json"
_MAX_PLAN_BYTES = 256 * 1024 * 1024


def write_plan(
    dest: str,
    rels: list[str],
    *,
    durable: bool,
    staged_for: dict[str, Any] | None = None,
    held: list[str] | None = None,
) -> None:
    """Record the shards this node's stage run chose (see the module docstring), the order
    spec and layout they were chosen for (``staged_for``), and the copies of earlier plans
    still in the area (``held``)."""
    folder = make_dirs_inside(dest, STAGE_DIR)
    doc: dict[str, Any] = {"format": "shardio-stage-plan", "version": 1, "shards": rels}
    if staged_for is not None:
        doc["staged_for"] = staged_for
    if held:
        doc["held"] = held
    with atomic_write(os.path.join(folder, PLAN_FILE), durable=durable) as fh:
        fh.write(json.dumps(doc).encode("utf-8", "surrogateescape"))


def _plan_doc(dest: str) -> dict[str, Any] | None:
    try:
        path = os.path.join(dest, STAGE_DIR, PLAN_FILE)
        doc = json.loads(read_regular(path, max_bytes=_MAX_PLAN_BYTES, what="stage plan"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_staged_for(dest: str) -> dict[str, Any] | None:
    """The order spec and layout the last stage run chose its shards for, or None (none
    recorded: an older release, or no plan)."""
    found = (_plan_doc(dest) or {}).get("staged_for")
    return found if isinstance(found, dict) else None


def read_held(dest: str) -> set[str] | None:
    """The shards the area may hold: its plan's and the earlier plans' kept copies
    (``held``); None when no valid plan is recorded."""
    doc = _plan_doc(dest) or {}
    found: set[str] = set()
    for part in (doc.get("shards"), doc.get("held", [])):
        if not isinstance(part, list) or not all(isinstance(r, str) for r in part):
            return None
        found.update(part)
    return found


def read_plan(dest: str) -> set[str] | None:
    """The shards the last stage run chose, or None when no valid plan is recorded (an area
    staged by an older release: every shard counts as planned)."""
    shards = (_plan_doc(dest) or {}).get("shards")
    if not isinstance(shards, list) or not all(isinstance(r, str) for r in shards):
        return None
    return set(shards)
