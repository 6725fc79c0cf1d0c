"""Checkpoints checked without loading them (no torch): what ``shardio checkpoint`` shows.

``verify_checkpoints`` reads every file of every checkpoint (or of one) and checks it against
its manifest; ``latest_intact`` finds the newest checkpoint whose every file checks, which is
what ``load_latest`` would load on any rank (the retry wrapper says it before a retry).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import stat
from typing import Any

from shardio._check import require_seconds
from shardio.checkpoint.catalog import (
    Listed,
    all_damaged,
    check_files,
    list_checkpoints,
    one_checkpoint,
    unavailable,
)
from shardio.checkpoint.manifest import CheckpointManifest
from shardio.checkpoint.naming import MANIFEST_NAME, check_kind, is_checkpoint_name
from shardio.errors import (
    CheckpointUnavailableError,
    NoCheckpointError,
    UsageError,
    wrap_os_error,
)
from shardio.storage.stall import IoThreads, call_with_deadline

__all__ = ["CheckedCheckpoint", "latest_intact", "list_dir", "verify_checkpoints"]


@dataclasses.dataclass(frozen=True)
class CheckedCheckpoint:
    """One checkpoint and what was found of it.

    Attributes:
        path: its directory.
        manifest: its manifest (None when it has none that parses, or none could be read).
        problems: what is wrong with it: damage (empty: intact, or not checked when
            ``checked`` is False).
        checked: whether its files were read.
        unreadable: what could not be read now (a server down, a read past its deadline):
            it says nothing of the checkpoint's state, so it is neither intact nor damaged.
    """

    path: str
    manifest: CheckpointManifest | None
    problems: tuple[str, ...]
    checked: bool
    unreadable: tuple[str, ...] = ()

    @property
    def intact(self) -> bool:
        """Whether it was checked and nothing is wrong."""
        return self.checked and not self.problems and not self.unreadable

    @property
    def status(self) -> str:
        """``intact``, ``damaged``, ``unreadable`` (cannot be read now) or ``listed``."""
        if self.problems:
            return "damaged"
        if self.unreadable:
            return "unreadable"
        return "intact" if self.checked else "listed"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        m = self.manifest
        return {
            "path": self.path,
            "status": self.status,
            "problems": list(self.problems),
            "unreadable": list(self.unreadable),
            "kind": m.kind if m else None,
            "step": m.step if m else None,
            "job_id": m.job_id if m else None,
            "world_size": m.world_size if m else None,
            "per_rank": m.per_rank if m else None,
            "saved_at_ns": m.saved_at_ns if m else None,
            "size_bytes": m.size_bytes if m else None,
            "raw_bytes": m.raw_bytes if m else None,
            "loader": m.loader if m else None,
            "files": [f.to_json() for f in m.files] if m else [],
        }


def list_dir(
    directory: str, *, read_timeout_s: float = 120.0
) -> tuple[list[CheckedCheckpoint], list[str]]:
    """The checkpoints of ``directory`` (newest first) from their manifests, nothing read
    but those; and the temp directories of saves in flight or interrupted. Nothing is
    written, and no lease is asked for.

    Raises:
        CheckpointUnavailableError: the directory cannot be listed now.
    """
    timeout_s = require_seconds(read_timeout_s, "read_timeout_s", positive=True)
    pool = IoThreads(max_abandoned=4)
    try:
        listed, temps = list_checkpoints(directory, pool=pool, timeout_s=timeout_s)
    finally:
        pool.close()
    return [_unchecked(x) for x in listed], temps


def _unchecked(x: Listed) -> CheckedCheckpoint:
    if x.manifest is not None:
        return CheckedCheckpoint(x.path, x.manifest, (), checked=False)
    if x.unreadable:
        return CheckedCheckpoint(x.path, None, (), checked=False, unreadable=(x.problem or "?",))
    return CheckedCheckpoint(x.path, None, (x.problem or "no manifest",), checked=True)


def _cannot_read(path: str, exc: OSError) -> CheckpointUnavailableError:
    return wrap_os_error(
        exc, f"{path} cannot be read now (not damaged; retry): {exc}", CheckpointUnavailableError
    )


def verify_checkpoints(path: str, *, read_timeout_s: float = 120.0) -> list[CheckedCheckpoint]:
    """Read and check every file of the checkpoints in ``path`` (a directory of them, or one
    checkpoint), newest first. A file (or manifest) that cannot be read now, or not within
    ``read_timeout_s``, makes its checkpoint ``unreadable``, not damaged. Nothing is
    written, and no lease is asked for.

    Raises:
        UsageError: ``path`` is not a directory, or not a checkpoint nor a directory of them.
        CheckpointUnavailableError: ``path`` cannot be looked into (or listed) now.
    """
    timeout_s = require_seconds(read_timeout_s, "read_timeout_s", positive=True)
    pool = IoThreads(max_abandoned=4)
    try:
        try:
            single = call_with_deadline(
                pool, functools.partial(_single, path), timeout_s, f"looking into {path}"
            )
        except OSError as exc:
            raise _cannot_read(path, exc) from exc
        if single:
            one = one_checkpoint(path, pool=pool, timeout_s=timeout_s)
            listed = [one] if one is not None else []
        else:
            listed = list_checkpoints(path, pool=pool, timeout_s=timeout_s)[0]
        return [_verified(x, timeout_s, pool) for x in listed]
    finally:
        pool.close()


def _single(path: str) -> bool:
    """Whether ``path`` is one checkpoint (False: a directory of them)."""
    try:  # an I/O error is raised (cannot be read now), not taken for "not a directory"
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = False
    if not is_dir:
        raise UsageError(f"{path} is not a directory")
    try:
        os.lstat(os.path.join(path, MANIFEST_NAME))
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not is_checkpoint_name(os.path.basename(os.path.normpath(path))):
        raise UsageError(f"{path} is neither a checkpoint directory nor a directory of them")
    return True


def _verified(x: Listed, timeout_s: float, pool: IoThreads) -> CheckedCheckpoint:
    """``x`` with every file read and checked: damage apart from what cannot be read now."""
    if x.manifest is None:
        return _unchecked(x)
    problems: list[str] = []
    unreadable: list[str] = []
    for exc in check_files(x.path, x.manifest, ranks=None, timeout_s=timeout_s, pool=pool):
        (unreadable if unavailable(exc) else problems).append(str(exc))
    return CheckedCheckpoint(
        x.path, x.manifest, tuple(problems), checked=True, unreadable=tuple(unreadable)
    )


def latest_intact(
    directory: str, *, kind: str | None = None, read_timeout_s: float = 120.0
) -> tuple[CheckedCheckpoint, list[tuple[str, str]]]:
    """The newest checkpoint whose every file checks, and those skipped before it (path,
    reason): what :func:`~shardio.checkpoint.load_latest` would load.

    Raises:
        NoCheckpointError: there is none (of ``kind``).
        CheckpointUnavailableError: the listing or a checkpoint could not be read now (not
            damaged: ask again later).
        CheckpointError: every one found is damaged (each named, with why).
    """
    if kind is not None:
        check_kind(kind)
    timeout_s = require_seconds(read_timeout_s, "read_timeout_s", positive=True)
    skipped: list[tuple[str, str]] = []
    pool = IoThreads(max_abandoned=4)
    try:
        listed, _ = list_checkpoints(directory, pool=pool, timeout_s=timeout_s)
        for x in listed:
            if x.manifest is not None and kind is not None and x.manifest.kind != kind:
                continue
            if x.unreadable:
                raise CheckpointUnavailableError(
                    errno.EIO, f"checkpoint {x.path} cannot be read now (not damaged; retry): "
                    f"{x.problem}"
                )  # fmt: skip
            checked = _verified(x, timeout_s, pool)
            if checked.unreadable:
                raise CheckpointUnavailableError(
                    errno.EIO, f"checkpoint {x.path} cannot be read now (not damaged; retry): "
                    f"{checked.unreadable[0]}"
                )  # fmt: skip
            if checked.intact:
                return checked, skipped
            skipped.append((x.path, "; ".join(checked.problems)))
    finally:
        pool.close()
    what = f" {kind}" if kind else ""
    if not skipped:
        raise NoCheckpointError(f"no{what} checkpoint in {directory}", skipped)
    raise all_damaged(directory, skipped)
