"""Calls on daemon I/O threads that a caller waits for with a timeout, and may abandon.

Python cannot interrupt a system call blocked in the kernel (a ``pread`` or
``copy_file_range`` on a network filesystem whose server is gone). :class:`IoThreads` runs
each call on a thread of its own (reserved per call, so a call never queues behind another)
and lets the caller stop waiting: :func:`call_with_deadline`. An abandoned call keeps its
thread until the kernel returns; its result is then dropped (and undone by the job's
``cleanup``), and a read's bytes, read into the thread's private scratch buffer, are copied
into the caller's buffer only while the caller still waits (under the job's lock), never
after it gave up. The number of calls abandoned at once is capped: beyond it, calls fail at
once instead of piling up threads.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from shardio.errors import ReadStalledError

__all__ = ["HOLDING_ERRNOS", "IoThreads", "Job", "call_with_deadline", "plain_threads", "submit"]

# Errors that say the path's server is gone (after the client's own retries): its other
# reads would wait as long. EIO, ESTALE, EAGAIN are not here: a reopen or a retry may cure
# them at once.
HOLDING_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ETIMEDOUT", "ENXIO", "EHOSTDOWN", "EHOSTUNREACH", "ENOLINK", "EREMOTEIO",
        "ECONNREFUSED", "ENETUNREACH", "ENETDOWN",
    )
    if hasattr(errno, name)
)  # fmt: skip

logger = logging.getLogger(__name__)

_KEEP_SCRATCH = 16 << 20  # a thread keeps its scratch buffer up to this size between reads


class Job:
    """One call handed to an I/O thread; ``lock`` orders its completion and abandonment."""

    __slots__ = (
        "abandoned", "call", "cleanup", "done", "error", "event", "lock", "on_done", "result",
        "target",
    )  # fmt: skip

    def __init__(
        self,
        call: Callable[[], Any],
        target: memoryview | None,
        cleanup: Callable[[Any], None] | None = None,
    ) -> None:
        self.call: Callable[[], Any] | None = call  # None once it ran (what it reached let go)
        self.cleanup = cleanup  # undoes the result of a call that completes once abandoned
        self.target = target  # a pread's caller buffer: copied into only while still waited for
        self.lock = threading.Lock()
        self.event = threading.Event()
        self.done = False
        self.abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None
        # Called on the I/O thread once ``event`` is set: one waiter watching several jobs.
        self.on_done: Callable[[], None] | None = None


class IoThreads:
    """Daemon threads (named ``name``) that run jobs; one is reserved per job, so a job
    never queues."""

    def __init__(self, max_abandoned: int, name: str = "shardio-io-deadline") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._idle = 0
        self._count = 0
        self.abandoned = 0
        self.max_abandoned = max_abandoned
        self._local = threading.local()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.abandoned >= self.max_abandoned:
                raise ReadStalledError(
                    errno.ETIMEDOUT,
                    f"{self.abandoned} calls of this process are still stalled in the storage",
                )
            if self._idle > 0:
                self._idle -= 1
                spawn = False
            else:
                self._count += 1
                spawn = True
        if spawn:
            thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            thread.start()
        self._jobs.put(job)

    def abandon(self, job: Job) -> bool:
        """Give up waiting for ``job``; False when it completed meanwhile."""
        with job.lock:
            if job.done:
                return False
            job.abandoned = True
        with self._lock:
            self.abandoned += 1
        return True

    def scratch(self, size: int) -> memoryview:
        """This thread's private buffer of at least ``size`` bytes."""
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            if size <= _KEEP_SCRATCH:
                self._local.buf = buf
        return memoryview(buf)[:size]

    def close(self) -> None:
        """Let the idle threads end (a thread still in an abandoned call ends once it
        returns); the pool takes no more calls."""
        with self._lock:
            count, self._count = self._count, 0
        for _ in range(count):
            self._jobs.put(None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with job.lock:
                # Given up on before it started: never run it (its descriptor may be another
                # file's by now).
                skip = job.abandoned
            result: Any = None
            error: BaseException | None = None
            if not skip:
                try:
                    assert job.call is not None  # a job runs once
                    result = job.call()
                except BaseException as exc:
                    error = exc
            with job.lock:
                job.done = True
                abandoned = job.abandoned
                if not abandoned:
                    if job.target is not None and error is None:
                        scratch, got = result
                        job.target[:got] = scratch[:got]
                        result = got
                    job.result, job.error = result, error
            if abandoned and not skip and error is None and job.cleanup is not None:
                try:
                    job.cleanup(result)  # an abandoned open's descriptor is closed here
                except Exception:
                    logger.debug("cleanup of an abandoned call failed", exc_info=True)
            # What the call reached (a batch's targets, through its closure) is not held
            # while this thread waits for the next job: a reused batch buffer is free again
            # once its batch is dropped (held here, every other in-process batch of a FUSE
            # mount was read into a fresh buffer, faulted in page by page).
            job.target = job.call = job.cleanup = None
            on_done, job.on_done = job.on_done, None
            job.event.set()
            if on_done is not None:
                on_done()
            del job, result, error, on_done
            with self._lock:
                if abandoned:
                    self.abandoned -= 1
                self._idle += 1


_PLAIN: tuple[int, IoThreads] | None = None
_PLAIN_LOCK = threading.Lock()


def plain_threads() -> IoThreads:
    """This process's I/O threads for reads with no deadline (``shardio-io``: an opener
    without one reading several runs at once, :func:`shardio.storage.opener.read_each`);
    a forked child gets threads of its own."""
    global _PLAIN  # noqa: PLW0603 - one pool per process, by design
    with _PLAIN_LOCK:
        if _PLAIN is None or _PLAIN[0] != os.getpid():
            _PLAIN = (os.getpid(), IoThreads(1, name="shardio-io"))
        return _PLAIN[1]


def submit(pool: IoThreads, job: Job, what: str) -> None:
    """Hand ``job`` to ``pool``; a :class:`~shardio.errors.ReadStalledError` naming ``what``
    ("not attempted") when too many of the process's calls are abandoned already."""
    try:
        pool.submit(job)
    except ReadStalledError as exc:
        raise ReadStalledError(exc.errno, f"{what}: not attempted, {exc.strerror}") from None


def call_with_deadline(
    pool: IoThreads,
    call: Callable[[], Any],
    timeout_s: float,
    what: str,
    *,
    cleanup: Callable[[Any], None] | None = None,
) -> Any:
    """``call()`` on ``pool``; a :class:`~shardio.errors.ReadStalledError` ("WHAT stalled
    for T s", with ``waited_s``) when it has not returned after ``timeout_s``.

    Raises:
        ReadStalledError: it stalled (it is abandoned), or too many calls are abandoned.
    """
    job = Job(call, None, cleanup)
    submit(pool, job, what)
    began = time.monotonic()
    if not job.event.wait(timeout_s) and pool.abandon(job):
        stalled = ReadStalledError(errno.ETIMEDOUT, f"{what} stalled for {timeout_s:g} s")
        stalled.waited_s = time.monotonic() - began
        raise stalled
    job.event.wait()
    if job.error is not None:
        raise job.error
    return job.result
