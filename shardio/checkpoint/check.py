"""Checkpoints checked without loading them (no torch): what ``shardio checkpoint`` shows.

``verify_checkpoints`` reads every file of every checkpoint (or of one) and checks it against
its manifest; ``latest_intact`` finds the newest checkpoint whose every file checks, which is
what ``load_latest`` would load on any rank (the retry wrapper says it before a retry).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardio.checkpoint.manifest import CheckpointManifest
from shardio.checkpoint.naming import MANIFEST_NAME, check_kind, is_checkpoint_name
from shardio.checkpoint.store import Listed, list_checkpoints, read_manifest, verify_files
from shardio.checkpoint.writing import check_seconds
from shardio.errors import NoCheckpointError, ShardioError, UsageError
from shardio.storage.stall import IoThreads

__all__ = ["CheckedCheckpoint", "latest_intact", "list_dir", "verify_checkpoints"]


@dataclasses.dataclass(frozen=True)
class CheckedCheckpoint:
    """One checkpoint and what was found of it.

    Attributes:
        path: its directory.
        manifest: its manifest (None when it has none that parses).
        problems: what is wrong (empty: intact, or not checked when ``checked`` is False).
        checked: whether its files were read.
    """

    path: str
    manifest: CheckpointManifest | None
    problems: tuple[str, ...]
    checked: bool

    @property
    def intact(self) -> bool:
        """Whether it was checked and nothing is wrong."""
        return self.checked and not self.problems

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        m = self.manifest
        return {
            "path": self.path,
            "status": ("intact" if self.intact else "damaged")
            if self.checked
            else ("listed" if m is not None else "damaged"),
            "problems": list(self.problems),
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


def list_dir(directory: str) -> tuple[list[CheckedCheckpoint], list[str]]:
    """The checkpoints of ``directory`` (newest first) from their manifests, nothing read
    but those; and the temp directories of saves in flight or interrupted."""
    pool = IoThreads(max_abandoned=4)
    try:
        listed, temps = list_checkpoints(directory, pool=pool)
    finally:
        pool.close()
    return [_unchecked(x) for x in listed], temps


def _unchecked(x: Listed) -> CheckedCheckpoint:
    problems = () if x.manifest is not None else (x.problem or "no manifest",)
    return CheckedCheckpoint(x.path, x.manifest, problems, checked=x.manifest is None)


def _one(path: str) -> Listed:
    if not is_checkpoint_name(os.path.basename(os.path.normpath(path))):
        raise UsageError(f"{path} is neither a checkpoint directory nor a directory of them")
    try:
        return Listed(path, read_manifest(path), None)
    except ShardioError as exc:
        return Listed(path, None, str(exc))


def verify_checkpoints(path: str, *, read_timeout_s: float = 120.0) -> list[CheckedCheckpoint]:
    """Read and check every file of the checkpoints in ``path`` (a directory of them, or one
    checkpoint), newest first.

    Raises:
        UsageError: ``path`` is not a directory.
    """
    timeout_s = check_seconds("read_timeout_s", read_timeout_s)
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory")
    single = os.path.lexists(os.path.join(path, MANIFEST_NAME))
    pool = IoThreads(max_abandoned=4)
    try:
        listed = [_one(path)] if single else list_checkpoints(path, pool=pool)[0]
        return [
            CheckedCheckpoint(
                x.path,
                x.manifest,
                tuple(verify_files(x, ranks=None, timeout_s=timeout_s, pool=pool)),
                checked=True,
            )
            for x in listed
        ]
    finally:
        pool.close()


def latest_intact(
    directory: str, *, kind: str | None = None, read_timeout_s: float = 120.0
) -> tuple[CheckedCheckpoint, list[tuple[str, str]]]:
    """The newest checkpoint whose every file checks, and those skipped before it (path,
    reason).

    Raises:
        NoCheckpointError: none is intact (``skipped`` lists what was found).
    """
    if kind is not None:
        check_kind(kind)
    timeout_s = check_seconds("read_timeout_s", read_timeout_s)
    skipped: list[tuple[str, str]] = []
    pool = IoThreads(max_abandoned=4)
    try:
        listed, _ = list_checkpoints(directory, pool=pool, timeout_s=timeout_s)
        for x in listed:
            if x.manifest is not None and kind is not None and x.manifest.kind != kind:
                continue
            problems = verify_files(x, ranks=None, timeout_s=timeout_s, pool=pool)
            if not problems:
                return CheckedCheckpoint(x.path, x.manifest, (), checked=True), skipped
            skipped.append((x.path, "; ".join(problems)))
    finally:
        pool.close()
    what = f" {kind}" if kind else ""
    if not skipped:
        raise NoCheckpointError(f"no{what} checkpoint in {directory}", skipped)
    raise NoCheckpointError(
        f"no intact{what} checkpoint in {directory}: {len(skipped)} found, all damaged", skipped
    )
