"""Watched reads: a table of the reads in flight in a process, and the thread that holds stalls.

The hop to an I/O thread costs every small read from the page cache (on this kind of
machine a 110 KB ``pread`` takes 40 us directly and about 120 us through the hop). A
process that can be killed and replaced without losing anything (a worker of
:class:`~shardio.runtime.loader.ShardLoader`, which resumes at the first sample not yet
delivered) reads directly instead (:meth:`shardio.read.deadline.DeadlineOpener.watch`),
each read publishing its start time and descriptor in a :class:`ReadWatch` table shared
with the loader. The watch's monitor thread reports a read older than the deadline (its
opener holds the path node-wide) and counts it in the table's first row; the loader sees
the count, kills the workers and starts new ones.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shardio.errors import UsageError

__all__ = ["WATCH_SLOTS", "ReadWatch"]

# Threads of one process whose reads a watch table follows (the reading thread, the map
# mode's I/O threads, the stream read-ahead); a thread beyond them takes the hop.
WATCH_SLOTS = 31


class ReadWatch:
    """A process's watch table and the monitor thread that reports what stalls in it.

    Args:
        table: int64, shape ``(WATCH_SLOTS + 1, 2)``, in memory shared with whoever
            replaces this process when it stalls. Row 0 counts the calls held as stalled;
            row ``k`` is the ``k``-th reading thread's call in flight: its start
            (``time.monotonic_ns()``, 0 when none) and its descriptor.
        timeout_s: how long a read may run before it counts as stalled.
        active: whether the watch is still the one in use (the monitor ends when not).
        on_stall: called with the descriptor and the time waited (ns) of a stalled read,
            before it is counted (so the replacement finds its path held).

    Raises:
        UsageError: ``table`` has another shape or type.
    """

    def __init__(
        self,
        table: np.ndarray[Any, Any],
        *,
        timeout_s: float,
        active: Callable[[], bool],
        on_stall: Callable[[int, int], None],
    ) -> None:
        shape = (WATCH_SLOTS + 1, 2)
        if not isinstance(table, np.ndarray) or table.dtype != np.int64 or table.shape != shape:
            raise UsageError(
                f"a watch table is an int64 array of shape {shape}, got "
                f"{getattr(table, 'dtype', type(table).__name__)} "
                f"{getattr(table, 'shape', '')}"
            )
        self.table = table
        self.timeout_s = timeout_s
        self._active = active
        self._on_stall = on_stall
        table[:] = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._taken = 0
        self._seen: set[tuple[int, int]] = set()  # (slot, start) already held

    def start(self) -> None:
        """Start the monitor (once the opener holds this watch: it ends when it does not)."""
        thread = threading.Thread(target=self._monitor, name="shardio-read-watch", daemon=True)
        thread.start()

    def slot(self) -> int | None:
        """This thread's row of the table (1..WATCH_SLOTS), None when all are taken."""
        got: int | None = getattr(self._local, "slot", -1)
        if got == -1:
            with self._lock:
                self._taken += 1
                got = self._taken if self._taken <= WATCH_SLOTS else None
            self._local.slot = got
        return got

    def _monitor(self) -> None:
        limit_ns = int(self.timeout_s * 1e9)
        tick = min(1.0, max(0.05, self.timeout_s / 4))
        pid = os.getpid()
        while self._active() and os.getpid() == pid:
            time.sleep(tick)
            now = time.monotonic_ns()
            for slot in range(1, WATCH_SLOTS + 1):
                start, fd = (int(v) for v in self.table[slot])
                if not start or now - start <= limit_ns or (slot, start) in self._seen:
                    continue
                self._seen.add((slot, start))
                self._on_stall(fd, now - start)
                self.table[0, 0] += 1
