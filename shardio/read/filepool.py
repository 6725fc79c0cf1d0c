"""FilePool: the reader's open shard descriptors, bounded, safe across fork.

Sources and staged copies are opened lazily through the opener (a staged copy under the
readers' shared lock), the least recently used closed first; :meth:`FilePool.open_ahead`
opens sources before a fork so that the workers read through inherited descriptors.
"""

from __future__ import annotations

import contextlib
import os
import resource
import weakref
from collections import OrderedDict
from collections.abc import Iterable

from shardio.errors import ReadStalledError, StorageError
from shardio.metrics.read import ReadMetrics
from shardio.read.resolver import Location
from shardio.staging.protocol import lock_for_reading
from shardio.storage.opener import Opener

__all__ = ["FilePool"]

# Shards open_ahead passes over, failing to open them, before it stops trying.
_OPEN_AHEAD_FAILURES = 4


class FilePool:
    """Open read-only descriptors, at most ``max_open`` at a time (least recently used is
    closed first). Opens lazily, so it can be created before a fork and used after.

    Args:
        opener: opens and closes the files.
        max_open: the bound on open descriptors.
        metrics: counts the opens (``opens_staged``, ``opens_source``).
    """

    def __init__(
        self, opener: Opener, max_open: int = 64, metrics: ReadMetrics | None = None
    ) -> None:
        self.opener = opener
        self.max_open = max_open
        self.metrics = metrics if metrics is not None else ReadMetrics()
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._staged: set[str] = set()  # paths of staged copies among them
        self._pid = os.getpid()
        # A pool dropped without close() (a dataset made per evaluation and let go) closes
        # its descriptors when collected: they are plain ints, which nothing else closes.
        # Not at exit, where the process's end closes them (and an opener may need threads).
        weakref.finalize(self, _close_all, opener, self._fds).atexit = False

    def fd(self, path: str, *, staged: bool = False) -> int:
        """Return an open descriptor for ``path``.

        Args:
            path: the file.
            staged: a staged copy: opened without following a symlink and held under the
                readers' shared lock (eviction skips it).
        """
        if self._pid != os.getpid():
            # Descriptors inherited over fork are this process's copies of the parent's (a
            # loader opens the epoch's shards once, before it forks its workers: one open per
            # shard on the metadata server instead of one per worker). pread keeps no offset,
            # so sources are used as they are. Staged copies are opened afresh: the parent's
            # may name a copy dropped and staged again since (closing this process's copy of
            # the descriptor leaves the parent's shared lock in place).
            for copy in self._staged:
                inherited = self._fds.pop(copy, None)
                if inherited is not None:
                    with contextlib.suppress(OSError):
                        os.close(inherited)
            self._staged.clear()
            self._pid = os.getpid()
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        # No fstat: a FIFO or directory fails its pread instead (storage.files.open_for_pread).
        fd = self.opener.open(path, nofollow=staged)
        if staged:
            try:
                lock_for_reading(fd, path)
            except StorageError:
                self.opener.close(fd)
                raise
        self.metrics.add("opens_staged" if staged else "opens_source")
        self._fds[path] = fd
        if staged:
            self._staged.add(path)
        if len(self._fds) > self.max_open:
            old_path, old = self._fds.popitem(last=False)
            self._staged.discard(old_path)
            self.opener.close(old)
        return fd

    def holds(self, path: str) -> bool:
        """Whether a descriptor of ``path`` is open in this pool (own or inherited)."""
        return path in self._fds

    @property
    def held(self) -> int:
        """Descriptors open in this pool."""
        return len(self._fds)

    @property
    def room(self) -> int:
        """Descriptors that can still be opened before the least recently used is closed."""
        return max(0, self.max_open - len(self._fds))

    def open_ahead(self, locations: Iterable[Location], *, limit: int | None = None) -> int:
        """Open the sources among ``locations`` now, in this order (staged copies and files
        already held are passed over); return the opens (see
        :meth:`shardio.read.reader.ShardReader.open_ahead`).

        Args:
            locations: where each shard is read from, located as they are consumed.
            limit: descriptors held at most (default: a quarter of the open-files limit),
                never more than ``max_open``.
        """
        if limit is None:
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            limit = self.max_open if soft == resource.RLIM_INFINITY else soft // 4
        opened = failed = 0
        for loc in locations:
            if loc.staged or self.holds(loc.path):
                continue
            if self.room == 0 or self.held >= limit:
                break
            try:
                self.fd(loc.path)
            except ReadStalledError as exc:
                if exc.waited_s > 0:
                    break
                continue  # held unavailable: refused at once, without a request
            except OSError:
                failed += 1
                if failed >= _OPEN_AHEAD_FAILURES:
                    break
                continue
            opened += 1
        return opened

    def adopt(self, other: FilePool) -> int:
        """Hold a duplicate (``dup``: no open reaches the filesystem) of each source
        descriptor ``other`` holds that this pool does not, within this pool's room; returns
        how many. Staged copies are passed over: each reader opens and locks its own."""
        dup = getattr(self.opener, "dup", None)  # an opener of the caller's may have none
        adopted = 0
        for path, fd in list(other._fds.items()):
            if dup is None or self.room == 0:
                break
            if path in other._staged or path in self._fds:
                continue
            try:
                self._fds[path] = dup(fd, path)
            except OSError:
                break  # out of descriptors: the rest are opened as they are read
            adopted += 1
        return adopted

    def discard(self, path: str) -> None:
        """Close the descriptor of ``path`` if open (the file failed, or was replaced)."""
        fd = self._fds.pop(path, None)
        self._staged.discard(path)
        if fd is not None:
            with contextlib.suppress(OSError):
                self.opener.close(fd)

    def close(self) -> None:
        """Close every descriptor (in a forked child: its copies of the inherited ones)."""
        _close_all(self.opener, self._fds)
        self._staged.clear()
        self._pid = os.getpid()


def _close_all(opener: Opener, fds: OrderedDict[str, int]) -> None:
    """Close the descriptors in ``fds`` and empty it."""
    for fd in fds.values():
        with contextlib.suppress(OSError):
            opener.close(fd)
    fds.clear()
