"""The data calls of one process in flight, by path: what a slow or dead file is told by.

A forked child starts with none (the parent's calls in flight are not its own).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

__all__ = ["InFlightCalls"]


class InFlightCalls:
    """The start times (``time.monotonic_ns()``) of this process's data calls in flight."""

    def __init__(self) -> None:
        self._pending: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _forget_parent_calls(self) -> None:
        """In a forked child: the parent's calls in flight are not this process's."""
        if self._pid != os.getpid():
            self._pending, self._lock = {}, threading.Lock()
            self._pid = os.getpid()

    def oldest_ns(self, path: str | None = None) -> int:
        """The age of the oldest data call in flight in this process (on ``path``, when
        given), in ns; 0 when none."""
        self._forget_parent_calls()
        with self._lock:
            if path is None:
                starts = [t for ts in self._pending.values() for t in ts]
            else:
                starts = list(self._pending.get(path, ()))
        return time.monotonic_ns() - min(starts) if starts else 0

    @contextlib.contextmanager
    def tracked(self, path: str) -> Iterator[None]:
        """Count a data call on ``path`` as in flight while it runs ("": not counted)."""
        call = self.begin(path)
        try:
            yield
        finally:
            self.end(call)

    def begin(self, path: str, start: int | None = None) -> tuple[str, int]:
        """Count a data call on ``path`` as in flight from now (or from ``start``, a
        ``time.monotonic_ns()`` of when it began) until :meth:`end` ("": not counted);
        returns what ``end`` takes."""
        if start is None:
            start = time.monotonic_ns()
        if path:
            self._forget_parent_calls()
            with self._lock:
                self._pending.setdefault(path, []).append(start)
        return path, start

    def end(self, call: tuple[str, int]) -> None:
        """The call :meth:`begin` returned is no longer in flight (returned, or its caller
        gave up on it); a second end of the same call changes nothing."""
        path, start = call
        if not path:
            return
        with self._lock:
            starts = self._pending.get(path, [])
            with contextlib.suppress(ValueError):
                starts.remove(start)
            if not starts:
                self._pending.pop(path, None)
