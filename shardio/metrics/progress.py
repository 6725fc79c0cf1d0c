"""Progress counters shared between pack/verify worker processes and a reporting thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Counters", "ProgressCallback", "ProgressSnapshot", "ProgressThread"]


@dataclass(frozen=True)
class ProgressSnapshot:
    """Work done and planned at one moment."""

    files_done: int
    bytes_done: int
    files_total: int
    bytes_total: int
    elapsed_s: float
    final: bool = False


ProgressCallback = Callable[[ProgressSnapshot], None]


class Counters:
    """Two 64-bit counters (files, bytes) that workers add to.

    ``shared=True`` (default): in shared memory, for worker processes (pack, verify).
    ``shared=False``: for the threads of one process (staging); it needs no shared memory,
    so it starts no multiprocessing helper process, which counts in a job prologue.
    """

    def __init__(self, ctx: Any = None, *, shared: bool = True) -> None:
        self._values: Any
        if not shared:
            self._values = [0, 0]
            self._lock: Any = threading.Lock()
            return
        if ctx is None:
            import multiprocessing  # here: thread-only users need not import it

            # The pools of pack and verify use forkserver (safe beside threads); shared
            # memory must come from the same context.
            ctx = multiprocessing.get_context("forkserver")
        self._values = ctx.Array("q", 2, lock=True)
        self._lock = self._values.get_lock()

    def add(self, files: int, nbytes: int) -> None:
        """Add work done."""
        with self._lock:
            self._values[0] += files
            self._values[1] += nbytes

    def read(self) -> tuple[int, int]:
        """Return (files, bytes) done so far."""
        with self._lock:
            return int(self._values[0]), int(self._values[1])


class ProgressThread:
    """Calls a callback with snapshots of the counters every ``interval_s`` until closed."""

    def __init__(
        self,
        counters: Counters,
        callback: ProgressCallback,
        *,
        files_total: int,
        bytes_total: int,
        interval_s: float = 0.25,
    ) -> None:
        self._counters = counters
        self._callback = callback
        self._totals = (files_total, bytes_total)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def _snapshot(self, final: bool) -> ProgressSnapshot:
        files, nbytes = self._counters.read()
        return ProgressSnapshot(
            files, nbytes, *self._totals, time.monotonic() - self._start, final=final
        )

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._callback(self._snapshot(False))

    def __enter__(self) -> ProgressThread:
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="shardio-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None:
            self._callback(self._snapshot(True))
