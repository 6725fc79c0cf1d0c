"""Stream-mode read-ahead: the shards of an epoch read sequentially, ahead of the reader.

One thread per reading process reads the shards of the epoch's windows sequentially, in
first-use order, in large requests sent to the null device (``sendfile``: the kernel fills
the page cache and copies nothing into this process; into a scratch buffer where there is no
null device): the page cache fills the way ``cat`` fills it, and the shuffled member reads
that follow (the unchanged per-member path, which verifies every member) find their pages in
memory. The order of the epoch is not touched, only how its bytes arrive.

The read-ahead's bytes are never handed to anyone: they only warm the page cache. A request
it makes on a descriptor the pool closed meanwhile costs wasted I/O, never a wrong byte. A
range the page cache holds already (:meth:`ShardReader.resident`: a warm epoch, or a
sibling worker read it) is passed over, not read again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardio.read.reader import ShardReader
from shardio.storage.opener import Opener, fetch_to_sink, null_sink, read_fully

__all__ = ["StreamReadahead"]

logger = logging.getLogger(__name__)

# A waiting reader gives up on the read-ahead (and reads for itself) when it has made no
# progress for this long: a stalled data server then costs this once, not once per batch.
_STALL_S = 5.0
_WAIT_TICK_S = 0.05


class StreamReadahead:
    """Read the shards a stream reader will use, sequentially and ahead of it.

    Shards are read whole, in the order the reader first uses them, in requests of
    ``request_bytes`` sent to the null device (into one scratch buffer where there is none).
    The page cache holds what was read ahead: at most ``ahead_bytes`` of shards the reader
    has not begun yet, plus the shards it is in (its shuffle window). Before each
    batch the reader calls :meth:`before_batch`, which waits (in the reading thread) until
    the read-ahead has passed the batch's members, so that they are read from memory; a
    read-ahead that fails, or makes no progress for a few seconds, is left behind and the
    reader reads for itself. Descriptors come from the dataset's pool, asked for on the
    reader's thread.

    Args:
        ds: the dataset (its opener reads every byte).
        shard_order: the shards, in the order of their first use (each once).
        request_bytes: bytes per request.
        ahead_bytes: the bound on bytes read into shards the reader has not begun.

    Sibling readers (DataLoader workers of one epoch, which read the same window's shards at
    the same pace) each read every shard whole: a page another is reading is waited for in
    the page cache, not fetched twice, and one sequential stream per shard reads faster than
    requests split between the siblings (measured on the MooseFS bed: RESULTS.md "Read path
    per filesystem").
    """

    def __init__(
        self,
        ds: ShardReader,
        shard_order: Sequence[int],
        *,
        request_bytes: int,
        ahead_bytes: int,
    ) -> None:
        self._ds = ds
        self._order = [int(s) for s in shard_order]
        self._pos = {s: i for i, s in enumerate(self._order)}
        self._sizes = [int(ds.manifest.shards[s].size_bytes) for s in self._order]
        self._request = request_bytes
        self._ahead = ahead_bytes
        self._cond = threading.Condition()
        self._fds: dict[int, int | None] = {}  # index in order -> fd (None: not read ahead)
        self._paths: dict[int, str] = {}  # index in order -> the file of that fd
        self._done = [0] * len(self._order)  # bytes of each shard read ahead so far
        self._finished = [False] * len(self._order)  # read whole, failed, or given up
        self._begun = -1  # the furthest index in order the reader has begun
        self._given = 0  # descriptors handed for order[:_given]
        self._ticks = 0  # requests completed (progress, for the stall rule)
        self._closed = False
        self._abandoned = False
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.bytes_read = 0
        self.bytes_resident = 0  # found in the page cache, not read

    def start(self) -> StreamReadahead:
        """Start the read-ahead thread (``shardio-readahead``)."""
        if self._thread is None and self._order:
            self._hand_fds()
            self._thread = threading.Thread(target=self._run, name="shardio-readahead", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop reading ahead (a request in progress ends on its own; the thread is a daemon,
        holding only its null-device descriptor or scratch buffer)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=_WAIT_TICK_S)

    @property
    def finished(self) -> bool:
        """Whether every shard was read ahead (or passed over after a failure)."""
        with self._cond:
            return all(self._finished)

    def __enter__(self) -> StreamReadahead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the reader's side (its own thread) ------------------------------------------------
    def _hand_fds(self) -> None:
        """Open (through the pool, on the reader's thread) the shards the read-ahead may read
        next: those begun, and the next ones up to ``ahead_bytes``."""
        ahead = 0
        handed: dict[int, int | None] = {}
        i = self._given
        while i < len(self._order) and (i <= self._begun or ahead < self._ahead):
            if i > self._begun:
                ahead += self._sizes[i]
            shard = self._order[i]
            fd: int | None = None
            with contextlib.suppress(OSError):
                loc = self._ds.resolver.locate(shard)
                if not loc.staged:  # a local copy needs no read-ahead
                    fd = self._ds.pool.fd(loc.path, staged=False)
                    self._paths[i] = loc.path
            handed[i] = fd
            i += 1
        if handed:
            with self._cond:
                self._fds.update(handed)
                self._given = i
                self._cond.notify_all()

    def before_batch(self, samples: Sequence[int] | np.ndarray[Any, Any]) -> None:
        """Wait until the read-ahead has read past every member of ``samples`` (or failed,
        or stalled): their reads then find the page cache filled."""
        if self._thread is None or not len(samples):
            return
        index = self._ds.index
        idx = np.asarray(samples, dtype=np.int64)
        records = index.samples[idx]
        counts = records["n_members"].astype(np.int64)
        starts = np.cumsum(counts) - counts
        rows = np.repeat(records["first_member"].astype(np.int64), counts) + (
            np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
        )
        members = index.members
        ends = members["offset"][rows].astype(np.int64) + members["size"][rows].astype(np.int64)
        shards = np.repeat(index.shards_of(idx), counts)
        need: dict[int, int] = {}  # index in order -> the furthest byte a member ends at
        for shard, end in zip(shards.tolist(), ends.tolist(), strict=True):
            i = self._pos.get(shard)
            if i is not None and end > need.get(i, 0):
                need[i] = end
        if not need:
            return
        with self._cond:
            self._begun = max(self._begun, *need)
        self._hand_fds()
        if self._abandoned:
            return
        for i in sorted(need):
            if not self._wait_for(i, need[i]):
                return

    def _wait_for(self, i: int, end: int) -> bool:
        """Wait until order[i] is read ahead up to ``end``; False: the read-ahead is given up."""
        with self._cond:
            seen, since = self._ticks, time.monotonic()
            while not self._finished[i] and self._done[i] < end:
                if self._closed or self._abandoned:
                    return False
                self._cond.wait(_WAIT_TICK_S)
                if self._ticks != seen:
                    seen, since = self._ticks, time.monotonic()
                elif time.monotonic() - since > _STALL_S:
                    logger.warning(
                        "stream read-ahead made no progress for %.0f s: reading without it",
                        _STALL_S,
                    )
                    self._abandoned = True
                    self._cond.notify_all()
                    return False
        return True

    # -- the read-ahead thread -------------------------------------------------------------
    def _run(self) -> None:
        sink = null_sink()
        try:
            self._read_order(sink)
        finally:
            if sink is not None:
                os.close(sink)

    def _read_order(self, sink: int | None) -> None:
        scratch = memoryview(bytearray(self._request if sink is None else 0))
        opener = self._ds.opener
        for i in range(len(self._order)):
            with self._cond:
                # Wait for the descriptor, and for room: no more than ahead_bytes read into
                # shards the reader has not begun.
                while not self._stopped() and (i not in self._fds or not self._room(i)):
                    self._cond.wait(_WAIT_TICK_S)
                if self._stopped():
                    return
                fd = self._fds[i]
            if fd is not None:
                self._read_shard(i, fd, opener, scratch, sink)
            with self._cond:
                self._finished[i] = True
                self._ticks += 1
                self._cond.notify_all()

    def _stopped(self) -> bool:
        return self._closed or self._abandoned

    def _room(self, i: int) -> bool:
        """Whether order[i] may be read further: begun by the reader, or less than
        ``ahead_bytes`` read into shards not begun (so the bound is ahead_bytes plus one
        request). Called under the lock."""
        if i <= self._begun:
            return True
        return sum(self._done[j] for j in range(self._begun + 1, i + 1)) < self._ahead

    def _read_shard(
        self, i: int, fd: int, opener: Opener, scratch: memoryview, sink: int | None
    ) -> None:
        size, pos = self._sizes[i], 0
        while pos < size:
            with self._cond:
                while not self._stopped() and not self._room(i):
                    self._cond.wait(_WAIT_TICK_S)
                if self._stopped():
                    return
            n = min(self._request, size - pos)
            if self._ds.resident(fd, self._paths.get(i, ""), pos, n):
                # In the page cache already (a warm epoch, or a sibling worker read it):
                # reading it again would only cost the CPU.
                got = n
                self.bytes_resident += n
            else:
                try:
                    if sink is not None:
                        got = fetch_to_sink(opener, fd, pos, n, sink)
                    else:
                        got = read_fully(opener, fd, scratch[:n], pos)
                except OSError as exc:  # the reader reads this shard itself, with its errors
                    logger.debug("read-ahead of shard %d stopped: %s", self._order[i], exc)
                    return
                self.requests += 1
                self.bytes_read += got
            with self._cond:
                pos += got
                self._done[i] = pos
                self._ticks += 1
                self._cond.notify_all()
            if got < n:
                return
