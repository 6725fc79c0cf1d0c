"""Peers: other nodes' staging areas of the same dataset, read (verified) before the source.

When a job restarts on other nodes (a node lost, an elastic restart), a node's new share is
mostly staged already, in the areas of the nodes that held it (on a shared filesystem or
BeeOND, or a node-local disk another node exports). ``shardio stage --peers`` names them:
a list of paths or glob patterns. A peer is used only when it is a real directory (not a
symlink) holding a staging area of the SAME dataset (its marker's dataset id, checked as
``stage=`` checks it, :mod:`shardio.staging.identity`); a named peer that is not is refused
with one line, a glob's match that is not is skipped with a warning, and DEST itself is
never a peer. Each copy read from a peer is opened without following a symlink, must lie
inside the peer's area, and is verified against the manifest while it is copied
(:func:`~shardio.staging.verified.copy_verified`): a damaged or vanished peer copy is
passed over for the next peer, then the source (or its parity). Peers are only read.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from shardio.errors import StorageError, UsageError
from shardio.format.manifest import ShardEntry
from shardio.metrics.progress import Counters
from shardio.staging.identity import DatasetIdentity, describe_area, same_dataset
from shardio.staging.protocol import read_area_marker, read_held
from shardio.staging.verified import copy_verified
from shardio.storage.opener import PosixOpener

__all__ = ["MAX_PEERS", "Peer", "PeerFetch", "find_peers"]

logger = logging.getLogger(__name__)

MAX_PEERS = 4096
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class Peer:
    """A peer's staging area, checked: its path, its real path and the shards its plan
    lists or holds from earlier plans (None: no plan recorded, every shard is looked for)."""

    path: str
    real: str
    planned: frozenset[str] | None


def _problem(path: str, dest_real: str, ident: DatasetIdentity) -> str | None:
    """Why ``path`` cannot be a peer (None: it can; "self": it is DEST)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink (name the area itself)"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if os.path.realpath(path) == dest_real:
        return "self"
    if read_area_marker(path) is None:
        return "is not a shardio staging area (no .shardio-stage marker)"
    if same_dataset(path, ident) is not True:
        return f"holds {describe_area(path)}, not {ident.describe()}"
    return None


def find_peers(patterns: Sequence[str], dest: str, ident: DatasetIdentity) -> list[Peer]:
    """The usable peers among ``patterns`` (paths or glob patterns), in order, DEST left out.

    Raises:
        UsageError: a path named without a glob is not a staging area of this dataset (or is
            a symlink, or missing), or the patterns match more than MAX_PEERS areas.
    """
    dest_real = os.path.realpath(dest)
    found: list[Peer] = []
    seen: set[str] = set()
    for pattern in patterns:
        if not pattern or "\0" in pattern:
            raise UsageError(f"--peers: {pattern!r} is not a path or glob pattern")
        named = not (_GLOB_CHARS & set(pattern))
        for path in [pattern] if named else sorted(glob.glob(pattern)):
            why = _problem(path, dest_real, ident)
            if why == "self":
                continue
            if why is not None:
                if named:
                    raise UsageError(f"peer {path} {why}: refusing to read from it")
                logger.warning("peer %s (matched by %s) %s: not used", path, pattern, why)
                continue
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            plan = read_held(path)
            found.append(Peer(path, real, frozenset(plan) if plan is not None else None))
            if len(found) > MAX_PEERS:
                raise UsageError(f"--peers names more than {MAX_PEERS:,} staging areas")
    return found


class _NoFollowOpener(PosixOpener):
    """POSIX calls that never follow a symlink at the file opened (a peer's copy)."""

    def open(self, path: str, *, nofollow: bool = False) -> int:
        return super().open(path, nofollow=True)


class PeerFetch:
    """Copies a shard from the first peer holding a copy that verifies (see the module
    docstring): what :func:`shardio.staging.copy.stage_one` calls before the source."""

    def __init__(
        self, peers: Sequence[Peer], *, durable: bool, read_timeout_s: float = 0.0
    ) -> None:
        self.peers = list(peers)
        self.durable = durable
        self.read_timeout_s = read_timeout_s
        self._opener = _NoFollowOpener()

    def __call__(self, entry: ShardEntry, final: str, counters: Counters) -> int | None:
        """Copy ``entry`` from a peer to ``final`` (verified, then published); its bytes, or
        None when no peer had a copy that verified."""
        for peer in self.peers:
            if peer.planned is not None and entry.path not in peer.planned:
                continue
            path = os.path.join(peer.path, entry.path)
            # A symlinked folder inside the peer would lead out of it: the copy must be there.
            if not os.path.realpath(path).startswith(peer.real.rstrip(os.sep) + os.sep):
                logger.warning("peer copy %s lies outside its area: not used", path)
                continue
            try:
                return copy_verified(
                    path,
                    final,
                    entry.xxh3_128,
                    size_bytes=entry.size_bytes,
                    durable=self.durable,
                    counters=counters,
                    what="peer copy",
                    read_timeout_s=self.read_timeout_s,
                    opener=self._opener,
                )
            except StorageError as exc:  # missing, a symlink, damaged (IntegrityError), stalled
                if exc.errno != errno.ENOENT:  # a missing copy is the common case: no warning
                    logger.warning("peer copy %s not used: %s", path, exc)
        return None
