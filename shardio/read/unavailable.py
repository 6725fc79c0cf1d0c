"""Shard files held unavailable after a stall, shared by every process of a node.

When a read of a shard stalls past its deadline (or fails with an errno that says its server
is gone), the shard's other samples would stall too: the path is held unavailable for a
while, and reads of it fail at once. Every DataLoader worker and every rank of the node
learns it through a small registry in ``/dev/shm``:

``/dev/shm/shardio-unavailable-<uid>/<scope>/<hash of the path>``, one file per held path
holding ``{"path": ..., "until": unix time}``, written to a temp file and renamed into place
(atomic; no lock). The top directory is made mode 0700 and must be a real directory owned by
this user with no access for others; the scope (a hash of the dataset's id) too. Files are
opened without following symlinks and read only when regular, small and owned by this user;
at most :data:`MAX_ENTRIES` are kept (expired ones are removed first). Anything wrong with the
registry (no ``/dev/shm``, a directory another user made first) leaves the hold to this
process alone: a registry problem never stops training.

The directory is re-read only when its modification time changed, and at most every
:data:`_REFRESH_S` seconds, so checking a path on every read costs a dictionary look-up.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Any

from shardio.storage.stall import HOLDING_ERRNOS

__all__ = ["MAX_ENTRIES", "UnavailableShards", "holds_path"]

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
MAX_ENTRIES = 1024
_MAX_FILE_BYTES = 8192
_REFRESH_S = 0.5
_FRESH_S = 4 * _REFRESH_S  # a mark of this process outlives refreshes this long
_MAX_SUSPECT_S = 600.0  # a suspicion planted with a far "until" ends by then


def holds_path(code: int | None) -> bool:
    """Whether an error with errno ``code`` puts its path on hold."""
    return code is not None and code in HOLDING_ERRNOS


class UnavailableShards:
    """Paths held unavailable until a time, in this process and (with a scope) the node.

    Args:
        scope: what the registry is shared for (the dataset's id); None: this process only.
        hold_s: how long a path is held once marked.
        root: where the node's registry lives.
        clock: the wall clock (shared by the processes of the node), injected for tests.
    """

    def __init__(
        self,
        scope: str | None,
        *,
        hold_s: float,
        root: str = DEFAULT_ROOT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.scope = scope
        self.hold_s = float(hold_s)
        self.root = root
        self.clock = clock
        self._held: dict[str, float] = {}
        self._local: dict[str, float] = {}  # marks the node registry could not take
        # This process's marks, (when, until): a refresh of another thread that lists the
        # directory before a mark's entry is written must not drop it.
        self._recent: dict[str, tuple[float, float]] = {}
        # Files a call of some process of the node has waited on for a while, not yet held:
        # path -> until (see suspect()).
        self._suspects: dict[str, float] = {}
        self._dir: str | None = None
        self._checked = False
        self._seen_mtime = -1
        self._next_refresh = 0.0
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"scope": self.scope, "hold_s": self.hold_s, "root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["scope"], hold_s=state["hold_s"], root=state["root"])  # type: ignore[misc]

    # -- the node directory ------------------------------------------------------------------
    def _directory(self) -> str | None:
        if self._checked:
            return self._dir
        self._checked = True
        if self.scope is None:
            return None
        top = os.path.join(self.root, f"shardio-unavailable-{os.getuid()}")
        key = hashlib.sha256(self.scope.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        sub = os.path.join(top, key)
        try:
            for path in (top, sub):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                    logger.warning(
                        "%s is not a private directory of this user: stalled shards are "
                        "held in this process only",
                        path,
                    )
                    return None
        except OSError as exc:
            logger.info("no node registry of stalled shards (%s): this process only", exc)
            return None
        self._dir = sub
        return sub

    def _refresh(self, now: float) -> None:
        if self._pid != os.getpid():
            self._pid, self._seen_mtime = os.getpid(), -1
        if now < self._next_refresh:
            return
        self._next_refresh = now + _REFRESH_S
        directory = self._directory()
        if directory is None:
            return
        try:
            mtime = os.lstat(directory).st_mtime_ns
        except OSError:
            return
        if mtime == self._seen_mtime:
            return
        self._seen_mtime = mtime
        # The registry is the node's truth: a hold released there (its shard rebuilt) is
        # dropped here too; marks it could not take stay this process's.
        held = {p: u for p, u in self._local.items() if u > now}
        for mine, (when, ends) in list(self._recent.items()):
            if now - when < _FRESH_S and ends > now:
                held[mine] = ends
            else:
                self._recent.pop(mine, None)
        suspects: dict[str, float] = {}
        for _name, entry in self._entries(directory):
            path, until = entry.get("path"), entry.get("until")
            if not isinstance(path, str) or not isinstance(until, int | float):
                continue
            if entry.get("suspect") is True:
                if until > now:
                    suspects[path] = min(float(until), now + _MAX_SUSPECT_S)
                continue
            if until > now and until > held.get(path, 0.0):
                held[path] = min(float(until), now + self.hold_s)
        self._held = held
        self._suspects = suspects

    def _entries(self, directory: str) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        try:
            names = [n for n in os.listdir(directory) if not n.startswith(".")]
        except OSError:
            return out
        for name in names[:MAX_ENTRIES]:
            data = _read_small(os.path.join(directory, name))
            if data is not None:
                out.append((name, data))
        return out

    # -- the API ------------------------------------------------------------------------------
    def held(self, path: str) -> float | None:
        """Seconds ``path`` stays held, or None when it is available."""
        if not path:
            return None
        now = self.clock()
        self._refresh(now)
        until = self._held.get(path)
        if until is None:
            return None
        if until <= now:
            del self._held[path]
            return None
        return until - now

    def mark(self, path: str) -> None:
        """Hold ``path`` unavailable for ``hold_s`` (here, and on the node when shared)."""
        now = self.clock()
        until = now + self.hold_s
        self._recent[path] = (now, until)
        self._held[path] = until
        directory = self._directory()
        if directory is None:
            self._local[path] = until
            return
        name = _entry_name(path)
        try:
            self._prune(directory, now, keep=name)
            _publish(directory, name, {"path": path, "until": until})
        except OSError as exc:
            self._local[path] = until
            logger.info("cannot share the hold of %s on the node: %s", path, exc)

    def suspect(self, path: str, seconds: float) -> None:
        """Tell the node that a call on ``path`` has not answered for a while: for up to
        ``seconds`` (the deadline left), other processes hold their calls on it back
        (:meth:`suspected`) rather than send requests after it. Ended by :meth:`unsuspect`
        (the call answered) or by :meth:`mark` (it stalled)."""
        directory = self._directory()
        if directory is None:
            return
        now = self.clock()
        record = {"path": path, "until": now + seconds, "suspect": True}
        try:
            _publish(directory, _entry_name(path) + "-s", record)
        except OSError as exc:
            logger.debug("cannot share the suspicion of %s on the node: %s", path, exc)

    def unsuspect(self, path: str) -> None:
        """End this node's suspicion of ``path`` (see :meth:`suspect`)."""
        self._suspects.pop(path, None)
        directory = self._directory()
        if directory is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, _entry_name(path) + "-s"))

    def suspected(self, path: str) -> bool:
        """Whether a process of the node waits on a call on ``path`` (see :meth:`suspect`)."""
        if not path:
            return False
        now = self.clock()
        self._refresh(now)
        return self._suspects.get(path, 0.0) > now

    def release(self, path: str) -> None:
        """End the hold of ``path`` here and on the node (its file was replaced: a rebuilt
        shard on a live server); the node's other processes drop it at their next look."""
        self._held.pop(path, None)
        self._local.pop(path, None)
        self._recent.pop(path, None)
        self.unsuspect(path)
        directory = self._directory()
        if directory is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, _entry_name(path)))

    def _prune(self, directory: str, now: float, *, keep: str) -> None:
        entries = self._entries(directory)
        if len(entries) < MAX_ENTRIES:
            return
        for name, entry in entries:
            until = entry.get("until")
            if name != keep and (not isinstance(until, int | float) or until <= now):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
        if len(os.listdir(directory)) >= MAX_ENTRIES:
            raise OSError(errno.ENOSPC, f"more than {MAX_ENTRIES} shards held")

    def clear(self) -> None:
        """Forget every hold of this process (the node's entries expire by themselves)."""
        self._held.clear()
        self._local.clear()
        self._recent.clear()

    def __repr__(self) -> str:
        return f"UnavailableShards(scope={self.scope!r}, hold_s={self.hold_s:g})"


def _entry_name(path: str) -> str:
    return hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _read_small(path: str) -> dict[str, Any] | None:
    """A small regular file of this user, parsed as a JSON object (None otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        if st.st_size > _MAX_FILE_BYTES:
            return None
        data = json.loads(os.read(fd, _MAX_FILE_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


def _publish(directory: str, name: str, record: dict[str, object]) -> None:
    """Write ``record`` as the registry entry ``name`` of ``directory``, whole or not at all
    (a private temp file renamed over the entry; a symlink at the temp name is refused)."""
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(record).encode())
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(directory, name))
