"""Memory maps of shard files for the opt-in mapped transport, least recently used dropped first.

A mapped view of a file that is truncated, or whose page-in fails (EIO on a parallel
filesystem), raises SIGBUS in the process that touches it: mapped views are for node-local
copies only, never the default.

Every mapping records the identity of the file it maps (:data:`FileIdentity`: device, inode,
size, modification and change times), so that a process that views bytes another process
verified (the training process, for a DataLoader worker) maps that very file: a shard
replaced under its name since (``shardio pack --force``, a re-stage) is refused, never viewed.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections import OrderedDict

from shardio.errors import StorageError, wrap_os_error
from shardio.metrics.read import ReadMetrics
from shardio.storage.opener import Opener, PosixOpener

__all__ = ["FileIdentity", "MapCache", "file_identity"]

# (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): a rename over the name gives another
# inode; a file cut or rewritten in place another size or times.
FileIdentity = tuple[int, int, int, int, int]


def file_identity(st: os.stat_result) -> FileIdentity:
    """The identity of the file ``st`` describes."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class MapCache:
    """Private (copy-on-write) read mappings of whole files, opened lazily.

    Pages come from the page cache, so mapping a shard costs no copy; writes through a view
    would stay private to this process. A map still viewed by a live memoryview cannot be
    closed; it is kept until its views are gone.

    Args:
        max_maps: mappings kept at once (virtual address space is the limit, not memory).
    """

    def __init__(
        self,
        opener: Opener | None = None,
        max_maps: int = 1024,
        *,
        metrics: ReadMetrics | None = None,
    ) -> None:
        self.opener: Opener = opener if opener is not None else PosixOpener()
        self.max_maps = max_maps
        self.metrics = metrics if metrics is not None else ReadMetrics()
        self._maps: OrderedDict[str, tuple[mmap.mmap | None, FileIdentity]] = OrderedDict()
        self._pid = os.getpid()

    def view(self, path: str, identity: FileIdentity | None = None) -> memoryview:
        """A writable (private) view of the whole file at ``path``.

        Args:
            path: the file.
            identity: the file the caller means (:meth:`identity` in the process that
                verified its bytes); None: whatever file the mapping already held, else the
                file at ``path`` now.

        Raises:
            StorageError: the file at ``path`` is not ``identity`` (it was replaced, cut or
                rewritten since), or it changed while being mapped; or it cannot be mapped.
        """
        if self._pid != os.getpid():
            self._maps.clear()  # a forked child maps afresh (the parent's maps stay its own)
            self._pid = os.getpid()
        held = self._maps.get(path)
        if held is not None and (identity is None or held[1] == identity):
            self._maps.move_to_end(path)
            return _view(held[0])
        mm, found = self._map(path)
        if identity is not None and found != identity:
            _close(mm)
            raise StorageError(
                errno.ESTALE,
                f"mmap transport: shard {path} is no longer the file a DataLoader worker "
                f"verified ({_difference(identity, found)}): it was replaced (another "
                "`shardio pack --force` or stage into this directory?) or cut or rewritten "
                "while this job read it, so its bytes are not delivered; open the dataset "
                "again to read it as it is now, and keep transport='mmap' for node-local "
                "copies nothing replaces during a job",
            )
        if held is not None:
            self.discard(path)  # a batch still viewing the old map keeps it alive
        self.metrics.add("map_opens")
        self._maps[path] = (mm, found)
        self._trim()
        return _view(mm)

    def identity(self, path: str) -> FileIdentity | None:
        """The identity of the file this cache maps at ``path``, or None when unmapped."""
        held = self._maps.get(path) if self._pid == os.getpid() else None
        return held[1] if held is not None else None

    def _map(self, path: str) -> tuple[mmap.mmap | None, FileIdentity]:
        """Map ``path`` and tell which file was mapped: stat before and after the map agree,
        or the file was replaced in between (tried twice, then refused)."""
        for _attempt in range(2):
            try:
                before: FileIdentity | None = file_identity(os.stat(path))
            except OSError:
                before = None  # the opener reports why it cannot be opened
            mm = self.opener.map(path)
            try:
                after = file_identity(os.stat(path))
            except OSError as exc:
                _close(mm)
                raise wrap_os_error(exc, f"cannot map shard {path}: {exc.strerror or exc}") from exc
            if before == after:
                return mm, after
            _close(mm)
        raise StorageError(errno.ESTALE, f"shard {path} kept changing while it was mapped")

    def _trim(self) -> None:
        for path in list(self._maps)[: max(0, len(self._maps) - self.max_maps)]:
            mm = self._maps[path][0]
            try:
                if mm is not None:
                    mm.close()
            except BufferError:
                continue  # still viewed by a batch the caller holds
            del self._maps[path]

    def discard(self, path: str) -> None:
        """Forget the mapping of ``path`` (the file was replaced or dropped)."""
        held = self._maps.pop(path, None)
        if held is not None:
            _close(held[0])

    def close(self) -> None:
        """Close every mapping no view holds."""
        for path in list(self._maps):
            self.discard(path)


def _view(mm: mmap.mmap | None) -> memoryview:
    return memoryview(mm) if mm is not None else memoryview(bytearray())


def _close(mm: mmap.mmap | None) -> None:
    # A map some view still holds stays alive with that view and is unmapped with it.
    if mm is not None:
        with contextlib.suppress(BufferError):
            mm.close()


def _difference(expected: FileIdentity, found: FileIdentity) -> str:
    names = ("device", "inode", "size", "mtime_ns", "ctime_ns")
    for name, then, now in zip(names, expected, found, strict=True):
        if then != now:
            return f"{name} {then} then, {now} now"
    return "the same file"  # pragma: no cover - only called on a difference
