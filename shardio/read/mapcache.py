"""Memory maps of shard files for the opt-in mapped transport, least recently used dropped first.

A mapped view of a file that is truncated, or whose page-in fails (EIO on a parallel
filesystem), raises SIGBUS in the process that touches it: mapped views are for node-local
copies only, never the default.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import OrderedDict

from shardio.metrics.read import ReadMetrics
from shardio.read.opener import Opener, PosixOpener

__all__ = ["MapCache"]


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
        self._maps: OrderedDict[str, mmap.mmap | None] = OrderedDict()
        self._pid = os.getpid()

    def view(self, path: str) -> memoryview:
        """A writable (private) view of the whole file at ``path``."""
        if self._pid != os.getpid():
            self._maps.clear()  # a forked child maps afresh (the parent's maps stay its own)
            self._pid = os.getpid()
        if path in self._maps:
            self._maps.move_to_end(path)
            mm = self._maps[path]
            return memoryview(mm) if mm is not None else memoryview(bytearray())
        mm = self.opener.map(path)
        self.metrics.add("map_opens")
        self._maps[path] = mm
        self._trim()
        return memoryview(mm) if mm is not None else memoryview(bytearray())

    def _trim(self) -> None:
        for path in list(self._maps)[: max(0, len(self._maps) - self.max_maps)]:
            mm = self._maps[path]
            try:
                if mm is not None:
                    mm.close()
            except BufferError:
                continue  # still viewed by a batch the caller holds
            del self._maps[path]

    def discard(self, path: str) -> None:
        """Forget the mapping of ``path`` (the file was replaced or dropped)."""
        mm = self._maps.pop(path, None)
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()

    def close(self) -> None:
        """Close every mapping no view holds."""
        for path in list(self._maps):
            self.discard(path)
