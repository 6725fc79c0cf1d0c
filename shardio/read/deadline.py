"""The read deadline: an opener whose calls that stall past ``timeout_s`` are abandoned.

Python cannot interrupt a ``pread`` blocked in the kernel (a FUSE or Lustre client waiting
for a dead data server). :class:`DeadlineOpener` therefore runs every call of the opener it
wraps (open, pread, fstat, advice, close, map) on a small pool of daemon I/O threads
(``shardio-io-deadline``) and waits for it with a timeout. A call that does not answer in
time is abandoned and raises :class:`~shardio.errors.ReadStalledError` ("... stalled for
5 s"); its thread stays blocked in the kernel until the filesystem gives up (MooseFS after
its retries, Lustre on eviction) and then returns to the pool.

An abandoned read may complete later. A single read (:meth:`DeadlineOpener.pread_into`)
therefore never writes into the caller's buffer (a ring slot in shared memory may hold
another batch by then): the I/O thread reads into a private scratch buffer and copies into
the target under a lock, only while the caller still waits. A batch's reads
(:meth:`DeadlineOpener.read_many`) go straight into their targets (the copy cost a tenth of
a CPU-second per GB on the MooseFS bed); when one of them is abandoned its outcome is an
:class:`AbandonedBufferError`, and the buffer it reads into is given up by whoever allocated
it: kept alive (by the I/O thread, until the read returns) and never handed out, the batch
read again into a fresh one (:func:`into_fresh_buffers`).
At most :data:`MAX_ABANDONED` calls of a process may be abandoned at once; beyond that every
call fails at once (the storage is not answering; piling up threads would not help).

A path whose call stalled (or failed with an errno that says its server is gone, such as
``ENXIO``) is then held unavailable for a while (:mod:`shardio.read.unavailable`, node-wide
when a registry is given): its later calls fail at once, so a dead server costs one deadline
per shard, not one per sample.

**One request per dead file.** On a dead server each request holds a client thread until
the client gives up (a FUSE client has 10; MooseFS with its default 30 retries gives up after
about 2 minutes), and a few such requests stall the whole mount, healthy files included. So
a file with a data call of this process in flight for more than :attr:`~DeadlineOpener.slow_s`
gets no further request from any process of the node (the registry tells them) until that
call returns or its path is held; read-ahead advice goes only to files that answered a read
in this process, and never while a call is slow; and a held file is not closed (its close, a
FUSE flush, would wait with the read).

The opener pickles (DataLoader workers get a copy) and makes a fresh pool in a forked child.

**Watched reads.** A process that can be killed and replaced without losing anything reads
directly in its own thread instead (:meth:`DeadlineOpener.watch`, :mod:`shardio.read.watch`);
opens, ``fstat``, closes and maps keep the hop (one per shard, not per sample).

Which deadline a dataset gets is :mod:`shardio.read.timeouts`'.
"""

from __future__ import annotations

import copy
import errno
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from shardio._check import require_int
from shardio.errors import ReadStalledError, UsageError
from shardio.read.gate import CallGate
from shardio.read.timeouts import check_read_timeout, hold_for
from shardio.read.unavailable import UnavailableShards, holds_path
from shardio.read.watch import ReadWatch
from shardio.storage.opener import (
    MemberHashes,
    Opener,
    PosixOpener,
    ReadOutcome,
    read_each,
    read_fully,
    read_natively,
    reads_natively,
    split_runs,
    stop_native_reads,
)
from shardio.storage.stall import IoThreads, Job, submit

__all__ = [
    "MAX_ABANDONED",
    "AbandonedBufferError",
    "DeadlineOpener",
    "bounded",
    "into_fresh_buffers",
]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_ABANDONED = 16  # abandoned calls per process before every call fails at once
_CLOSE_WAIT_S = 2.0  # at most this long (or the deadline) for a close
# Descriptors of held files a process keeps open rather than close (see close); past this
# many (a dead server holding thousands of shards) they are closed, each a bounded wait.
MAX_KEPT = 256


class AbandonedBufferError(ReadStalledError):
    """A read straight into the caller's buffer stalled and was abandoned: the kernel may
    still write that buffer when the read returns (minutes later, on a dead server). Its
    bytes are never handed out: the caller gives the whole buffer up (its memory is kept
    alive by the I/O thread until then) and reads again into a fresh one
    (:func:`into_fresh_buffers`). Where that is not done it is a ReadStalledError like any
    other."""


def into_fresh_buffers(read: Callable[[], _T]) -> _T:
    """``read()``, made again while it raises :class:`AbandonedBufferError`: each time into
    buffers it allocates afresh (the ones an abandoned read may still write are given up).

    Bounded: each such error is one stalled read (one deadline), its file held from then on
    (its reads fail at once), and after :data:`MAX_ABANDONED` abandoned calls a process's
    calls fail at once; the last try's error is raised as it is.
    """
    for _ in range(MAX_ABANDONED):
        try:
            return read()
        except AbandonedBufferError:
            continue
    return read()


class DeadlineOpener:
    """An opener whose every call is abandoned after ``timeout_s`` (see the module doc).

    Args:
        inner: the opener that does the I/O (default: POSIX calls).
        timeout_s: seconds a call may take before it is abandoned (> 0).
        registry: where stalled paths are held unavailable (node-wide); None: this process
            alone, for :func:`hold_for` ``(timeout_s)``.
        max_abandoned: abandoned calls of one process before every call fails at once.
    """

    def __init__(
        self,
        inner: Opener | None = None,
        *,
        timeout_s: float,
        registry: UnavailableShards | None = None,
        max_abandoned: int = MAX_ABANDONED,
    ) -> None:
        seconds = check_read_timeout(timeout_s, "timeout_s")
        if not seconds:
            raise UsageError("DeadlineOpener needs timeout_s > 0")
        max_abandoned = require_int(max_abandoned, "max_abandoned", minimum=1, maximum=1024)
        self.inner: Opener = inner if inner is not None else PosixOpener()
        self.timeout_s = seconds
        self.max_abandoned = max_abandoned
        self.registry = (
            registry if registry is not None else UnavailableShards(None, hold_s=hold_for(seconds))
        )
        self.stalls = 0  # calls abandoned in this process
        self.stalled_ns = 0  # time callers waited on them
        self._paths: dict[int, str] = {}
        self._threads: IoThreads | None = None
        self._pid = os.getpid()
        self._watch: ReadWatch | None = None
        self._try_held = False
        self._kept: dict[int, str] = {}  # descriptors of held paths left open (see close)
        self._calls = CallGate(self.registry, seconds)  # held files, slow calls in flight
        self._answered: set[str] = set()  # paths a data call of this process read from

    # -- pickling and fork ------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {
            "inner": self.inner,
            "timeout_s": self.timeout_s,
            "registry": self.registry,
            "max_abandoned": self.max_abandoned,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["inner"],
            timeout_s=state["timeout_s"],
            registry=state["registry"],
            max_abandoned=state["max_abandoned"],
        )

    def _pool(self) -> IoThreads:
        if self._pid != os.getpid():
            # A forked child has none of the parent's threads (nor its stalled calls); it has
            # the parent's descriptors, so their paths stay known (a loader opens shards once
            # before it forks its workers: FilePool).
            self._threads, self._pid, self._watch = None, os.getpid(), None
            self.stalls, self.stalled_ns, self._calls.held_fails = 0, 0, 0
        if self._threads is None:
            self._threads = IoThreads(self.max_abandoned)
        return self._threads

    @property
    def abandoned(self) -> int:
        """Calls of this process abandoned and not returned yet."""
        pool = self._threads
        return pool.abandoned if pool is not None and self._pid == os.getpid() else 0

    def held(self, path: str) -> float | None:
        """Seconds ``path`` stays unavailable after a stall, or None when it is not held."""
        return self.registry.held(path)

    def release(self, path: str) -> None:
        """End the hold of ``path`` (its file was rebuilt), here and on the node."""
        self.registry.release(path)

    def trying_held(self) -> DeadlineOpener:
        """This opener (its threads, deadline and registry), but trying held paths too: what
        a rebuild reads the survivors of a group through. A path may be held only because
        the whole mount stalled for a while (a dead server's requests hold the client's
        threads); each call is still abandoned after ``timeout_s``."""
        view = copy.copy(self)
        view._try_held = True
        return view

    # -- the calls --------------------------------------------------------------------------
    def _refuse_held(self, path: str, what: str) -> None:
        if not self._try_held:
            self._calls.refuse_held(path, what)

    def _admit(self, path: str, what: str) -> None:
        """Refuse a held ``path``, and wait behind a slow call on it (:class:`CallGate`)."""
        if not self._try_held:
            self._calls.refuse_held(path, what)
            self._calls.wait(path, what)

    @property
    def slow_s(self) -> float:
        """:attr:`CallGate.slow_s`: how long a data call may run before its file counts as
        not answering promptly."""
        return self._calls.slow_s

    @property
    def held_fails(self) -> int:
        """Calls refused at once: their path was held unavailable."""
        return self._calls.held_fails

    def _run_data(
        self,
        path: str,
        what: str,
        call: Callable[[], Any],
        *,
        target: memoryview | None = None,
    ) -> Any:
        """:meth:`_run` for a call that reads the file's data (gated and tracked)."""
        self._admit(path, what)
        with self._calls.inflight.tracked(path):
            got = self._run(path, what, call, target=target, suspect=True)
        if path:
            self._answered.add(path)
        return got

    def _run(
        self,
        path: str,
        what: str,
        call: Callable[[], Any],
        *,
        target: memoryview | None = None,
        cleanup: Callable[[Any], None] | None = None,
        wait_s: float | None = None,
        suspect: bool = False,
    ) -> Any:
        wait_s = self.timeout_s if wait_s is None else wait_s
        self._refuse_held(path, what)
        pool = self._pool()
        job = Job(call, target, cleanup)
        submit(pool, job, what)
        began = time.monotonic_ns()
        suspected = False
        if suspect and path and not job.event.wait(min(self.slow_s, wait_s)):
            # Slow: the node's other processes hold their calls on it back from now on.
            suspected = True
            self.registry.suspect(path, wait_s)
        done = job.event.wait(max(0.0, wait_s - (time.monotonic_ns() - began) / 1e9))
        if not done and pool.abandon(job):
            self.stalls += 1
            self.stalled_ns += time.monotonic_ns() - began
            if path:
                self.registry.mark(path)  # held before the suspicion ends: no gap
            if suspected:
                self.registry.unsuspect(path)
            logger.warning("%s stalled for %g s: abandoned", what, wait_s)
            stalled = ReadStalledError(errno.ETIMEDOUT, f"{what} stalled for {wait_s:g} s")
            stalled.waited_s = wait_s
            raise stalled
        job.event.wait()  # it completed as it was being abandoned
        if suspected:
            self.registry.unsuspect(path)
        if job.error is not None:
            error = job.error
            if path and isinstance(error, OSError) and holds_path(error.errno):
                self.registry.mark(path)
            raise error
        return job.result

    def open(self, path: str, *, nofollow: bool = False) -> int:
        inner = self.inner

        def call() -> int:
            return inner.open(path, nofollow=nofollow)

        fd: int = self._run(path, f"opening {path}", call, cleanup=inner.close)
        self._paths[fd] = path
        return fd

    def dup(self, fd: int, path: str) -> int:
        """A duplicate of ``fd`` (a local call: no deadline), read under this opener's. An
        inner opener without ``dup`` (a caller's) opens ``path`` again, under the deadline."""
        inner_dup = getattr(self.inner, "dup", None)
        if inner_dup is None:
            return self.open(path)
        new: int = inner_dup(fd, path)
        self._paths[new] = path
        return new

    def watch(self, table: np.ndarray[Any, Any]) -> None:
        """Read directly in the calling thread from now on (this process only), publishing
        each ``pread`` and advice in ``table`` (see :class:`~shardio.read.watch.ReadWatch`,
        which holds what stalls there, and the module doc).

        Raises:
            UsageError: ``table`` has another shape or type.
        """
        watch = ReadWatch(
            table,
            timeout_s=self.timeout_s,
            active=lambda: self._watch is watch,
            on_stall=self._held_by_watch,
        )
        self._pool()  # a forked child's state reset first
        self._watch = watch
        watch.start()

    def _held_by_watch(self, fd: int, waited_ns: int) -> None:
        """A watched read of ``fd`` stalled: hold its path (before the watch counts it, so
        the replacement finds it held)."""
        path = self._paths.get(fd, "")
        if path:
            self.registry.mark(path)
        self.stalls += 1
        self.stalled_ns += waited_ns
        logger.warning(
            "read of %s stalled for %g s: held; the loader replaces this worker",
            path or f"descriptor {fd}",
            self.timeout_s,
        )

    @property
    def watched(self) -> bool:
        """Whether this process reads directly under a watch table (:meth:`watch`)."""
        return self._watch is not None and self._pid == os.getpid()

    def _direct(self, fd: int, path: str, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` in this thread, published in the watch table; None when this thread
        has no slot (the caller takes the hop)."""
        watch = self._watch
        if watch is None or self._pid != os.getpid():
            return None
        slot = watch.slot()
        if slot is None:
            return None
        self._admit(path, what)
        row = watch.table[slot]
        row[1] = fd
        row[0] = time.monotonic_ns()
        try:
            with self._calls.inflight.tracked(path):
                got = call()
            if path:
                self._answered.add(path)
            return got
        except OSError as exc:
            if path and holds_path(exc.errno):
                self.registry.mark(path)
            raise
        finally:
            row[0] = 0

    def copy_into(self, fd: int, out: int, offset: int, count: int) -> int:
        """The inner copy, abandoned after the deadline: an abandoned call writes on into
        ``out`` alone (the caller's temp file, removed when the copy fails)."""
        path = self._paths.get(fd, "")
        inner = self.inner

        def call() -> int:
            return inner.copy_into(fd, out, offset, count)

        what = f"copy of {path or f'descriptor {fd}'} at offset {offset}"
        got: int = self._run_data(path, what, call)
        return got

    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        path = self._paths.get(fd, "")
        if self._watch is not None:
            inner_ = self.inner
            direct = self._direct(
                fd,
                path,
                f"read of {path or f'descriptor {fd}'} at offset {offset}",
                lambda: inner_.pread_into(fd, target, offset),
            )
            if direct is not None:
                return int(direct)
        pool = self._pool()
        inner = self.inner
        size = len(target)

        def call() -> tuple[memoryview, int]:
            scratch = pool.scratch(size)
            return scratch, inner.pread_into(fd, scratch, offset)

        got: int = self._run_data(
            path, f"read of {path or f'descriptor {fd}'} at offset {offset}", call, target=target
        )
        return got

    def read_many(
        self,
        reads: Sequence[tuple[int, int, memoryview]],
        took: list[int] | None = None,
        after: Callable[[int], object] | None = None,
        *,
        parallel: int = 1,
    ) -> list[ReadOutcome]:
        """:func:`~shardio.storage.opener.read_many` with one hand-off per run of reads.

        The reads run in turn on one I/O thread (``parallel`` > 1: in that many runs of
        neighbours, each on an I/O thread of its own, all watched from this thread), each
        straight into its target and under the deadline of its own: a run is abandoned when
        one of its reads has run for ``timeout_s`` (an :class:`AbandonedBufferError` for
        it, its path held: its target may still be written, so the caller gives up the
        buffer it lies in; None for the reads after it, which are not made, and, where the
        run went to the compiled module as one call (a plain POSIX opener), for the reads
        before it too: that call's outcomes are not waited for); the other runs go on.
        Each path is admitted once (held: its reads fail at once; behind a slow call:
        waited for), a read slow past :attr:`slow_s` is told to the node as one call would
        be, and a watched process reads directly. On the MooseFS bed a batch of 64 members
        cost 64 hand-offs, most of its CPU; now one per run.
        """
        if self.watched:
            # Each direct, in the watch table (runs at once on plain threads).
            return read_each(self, reads, took, after, parallel=parallel)
        results: list[ReadOutcome] = [None] * len(reads)
        times = [0] * len(reads)
        paths = [self._paths.get(fd, "") for fd, _off, _target in reads]
        refused: dict[str, OSError | None] = {}
        todo: list[int] = []
        for k, path in enumerate(paths):
            if path not in refused:
                try:
                    self._admit(path, f"read of {path or 'a descriptor'}")
                    refused[path] = None
                except OSError as exc:
                    refused[path] = exc
            results[k] = refused[path]
            if refused[path] is None:
                todo.append(k)
        if todo:
            batch = _Batch(reads, paths, results, times, after)
            native = reads_natively(self.inner, after)
            self._watch_runs(
                batch,
                [
                    (_NativeRun if native else _PythonRun)(self, batch, [todo[i] for i in span])
                    for span in split_runs(len(todo), parallel)
                ],
            )
        for k in todo:
            got = results[k]
            if isinstance(got, int) and paths[k]:
                self._answered.add(paths[k])
            elif isinstance(got, OSError) and paths[k] and holds_path(got.errno):
                self.registry.mark(paths[k])
        if took is not None:
            took.extend(times)
        return results

    def _watch_runs(self, batch: _Batch, runs: list[_Run]) -> None:
        """Start each of ``runs`` on an I/O thread of its own and watch them all until each
        returned or was given up: a run whose read in progress has run for ``timeout_s`` is
        abandoned (see :meth:`read_many`), a path whose read has run for :attr:`slow_s` is
        told to the node while it runs. This thread wakes when the last run returns, or
        when a read in progress may turn slow or reach its deadline: not once per run."""
        pool = self._pool()
        left = _Countdown(len(runs))
        live: list[_Run] = []
        for number, run in enumerate(runs):
            run.job.on_done = functools.partial(left.done, number)
            first = run.todo[0]
            try:
                submit(pool, run.job, f"read of {batch.paths[first] or 'a descriptor'} at "
                       f"offset {batch.reads[first][1]}")  # fmt: skip
            except ReadStalledError as exc:  # too many calls abandoned: these not attempted
                for k in run.todo:
                    batch.results[k] = exc
                left.done(number)
                continue
            run.number = number
            live.append(run)
        limit_ns, slow_ns = int(self.timeout_s * 1e9), int(self.slow_s * 1e9)
        suspected: dict[str, int] = {}  # paths told to the node as slow: runs on each
        errors: list[BaseException] = []
        try:
            while live:
                wait_ns = slow_ns
                for run in list(live):
                    done = run.job.event.is_set()
                    k, began = (-1, 0) if done else run.current()
                    age = time.monotonic_ns() - began if began else 0
                    if not done:
                        run.count_in_flight(k, began, age >= slow_ns)
                    if not done and began and age >= limit_ns and pool.abandon(run.job):
                        run.give_up(began)
                        left.done(run.number)  # not waited for any longer
                        done = True
                    slow = "" if done or not began or age < slow_ns else batch.paths[k]
                    if run.suspected != slow:
                        if run.suspected:
                            _unsuspect(self.registry, suspected, run.suspected)
                        if slow:
                            if not suspected.get(slow):
                                self.registry.suspect(slow, self.timeout_s)
                            suspected[slow] = suspected.get(slow, 0) + 1
                        run.suspected = slow
                    if done:
                        run.count_in_flight(-1, 0, False)
                        live.remove(run)
                        error = run.job.error
                        if error is not None and not isinstance(error, OSError):
                            errors.append(error)  # a bug, not the storage (a read-only target)
                        continue
                    if began:  # until it turns slow, then until its deadline
                        wait_ns = min(wait_ns, slow_ns - age if age < slow_ns else limit_ns - age)
                if live:
                    left.event.wait(max(wait_ns, 1_000_000) / 1e9)
        except BaseException:
            # Interrupted (a KeyboardInterrupt): no read may still write into the caller's
            # buffers once this raises; the runs return, or one deadline passes for them all.
            until = time.monotonic() + self.timeout_s
            for run in live:
                run.job.event.wait(max(0.0, until - time.monotonic()))
            raise
        finally:
            for run in live:
                run.count_in_flight(-1, 0, False)
            for path in suspected:
                self.registry.unsuspect(path)
        if errors:
            raise errors[0]

    def _stalled(
        self,
        reads: Sequence[tuple[int, int, memoryview]],
        paths: list[str],
        k: int,
        age_ns: int,
        results: list[ReadOutcome],
    ) -> None:
        """Read ``k`` of an abandoned :meth:`read_many` stalled: counted, its path held; its
        outcome an :class:`AbandonedBufferError` (it may still write its target)."""
        self.stalls += 1
        self.stalled_ns += age_ns
        if paths[k]:
            self.registry.mark(paths[k])
        what = f"read of {paths[k] or f'descriptor {reads[k][0]}'} at offset {reads[k][1]}"
        logger.warning("%s stalled for %g s: abandoned", what, self.timeout_s)
        stalled = AbandonedBufferError(errno.ETIMEDOUT, f"{what} stalled for {self.timeout_s:g} s")
        stalled.waited_s = self.timeout_s
        results[k] = stalled

    def size(self, fd: int) -> int:
        path = self._paths.get(fd, "")
        inner = self.inner
        got: int = self._run(path, f"fstat of {path}", lambda: inner.size(fd))
        return got

    def identity(self, fd: int) -> tuple[int, int]:
        path = self._paths.get(fd, "")
        inner = self.inner
        got: tuple[int, int] = self._run(path, f"fstat of {path}", lambda: inner.identity(fd))
        return got

    def advise(self, fd: int, offset: int, length: int) -> None:
        path = self._paths.get(fd, "")
        if self.abandoned or self._calls.slow():
            # A call of this process is stuck (or slow) in the storage: read-ahead advice
            # would queue more requests behind it (a FUSE client has a few threads, a dead
            # server's requests hold them for minutes), so it is left out until it returns.
            return
        if path and (path not in self._answered or self.registry.suspected(path)):
            # Not before a read of the file answered in this process: read-ahead of a file
            # on a dead server (the epoch's first advice goes out before any read could
            # stall) queues requests that hold client threads for minutes.
            return
        inner = self.inner
        if self._watch is not None:

            def advise() -> bool:
                inner.advise(fd, offset, length)
                return True

            if self._direct(fd, path, f"advice on {path}", advise) is not None:
                return
        self._run_data(path, f"advice on {path}", lambda: inner.advise(fd, offset, length))

    def map(self, path: str) -> mmap.mmap | None:
        """Map through the inner opener (the open and fstat are bounded; a page fault on the
        mapping later is not: the mapped transport is for node-local copies)."""
        inner = self.inner
        got: mmap.mmap | None = self._run(
            path, f"mapping {path}", lambda: inner.map(path), cleanup=_close_map
        )
        return got

    def close(self, fd: int) -> None:
        """Close ``fd`` (bounded, see below), or keep it open when its path is held: a read
        of it may still wait on a dead server, and a FUSE client answers the close (a flush)
        of that file only once the read ends, holding one of its few threads till then (all
        of them, with a few such closes: the whole mount stalls, healthy files included).
        A kept descriptor stays open until the process ends (at most :data:`MAX_KEPT`)."""
        path = self._paths.get(fd, "")
        if (
            path
            and not self._try_held
            and len(self._kept) < MAX_KEPT
            and (self.registry.held(path) is not None or self._calls.slow(path))
        ):
            self._kept[fd] = path
            return
        self._paths.pop(fd, None)
        inner = self.inner
        try:
            # A FUSE close sends a flush to the daemon: bounded too (briefly: the descriptor is
            # gone either way, and a failed read closes before the next one), never held.
            self._run(
                "",
                f"closing {path}",
                lambda: inner.close(fd),
                wait_s=min(self.timeout_s, _CLOSE_WAIT_S),
            )
        except ReadStalledError as exc:
            logger.info("%s", exc)

    def bounded(
        self,
        path: str,
        what: str,
        call: Callable[[], _T],
        *,
        cleanup: Callable[[_T], None] | None = None,
    ) -> _T:
        """``call()`` (I/O of ``path`` outside the opener: a dataset's manifest and index)
        under the deadline: a stall raises :class:`~shardio.errors.ReadStalledError` and
        holds ``path``; ``cleanup`` receives what an abandoned call returns later."""
        got: _T = self._run(path, what, call, cleanup=cleanup)
        return got

    def __repr__(self) -> str:
        return f"DeadlineOpener({self.inner!r}, timeout_s={self.timeout_s:g})"


class _Batch:
    """The reads of one :meth:`DeadlineOpener.read_many` and what became of them, shared by
    its runs (each writes only its own reads' entries)."""

    __slots__ = ("after", "paths", "reads", "results", "times")

    def __init__(
        self,
        reads: Sequence[tuple[int, int, memoryview]],
        paths: list[str],
        results: list[ReadOutcome],
        times: list[int],
        after: Callable[[int], object] | None,
    ) -> None:
        self.reads, self.paths, self.results, self.times = reads, paths, results, times
        self.after = after


class _Countdown:
    """Set :attr:`event` once each of ``count`` runs is done (returned, or given up by the
    watcher: whichever says so first counts)."""

    def __init__(self, count: int) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._left = count
        self._gone: set[int] = set()
        if count <= 0:
            self.event.set()

    def done(self, number: int) -> None:
        with self._lock:
            if number in self._gone:
                return
            self._gone.add(number)
            self._left -= 1
            if self._left <= 0:
                self.event.set()


class _Run:
    """Reads ``todo`` of a batch in turn, as one job on an I/O thread, watched by the
    caller (:meth:`DeadlineOpener._watch_runs`). The job holds the run, and so the batch's
    targets, until its call returns: the memory of a target an abandoned read still writes
    is not freed meanwhile."""

    def __init__(self, opener: DeadlineOpener, batch: _Batch, todo: list[int]) -> None:
        self.opener, self.batch, self.todo = opener, batch, todo
        self.inflight = opener._calls.inflight
        self.suspected = ""  # the path this run's slow read is told to the node as
        self.number = 0  # its place among the batch's runs
        self.job = Job(self.run, None)

    def run(self) -> None:
        raise NotImplementedError

    def current(self) -> tuple[int, int]:
        """The read in progress and when it began (``time.monotonic_ns()``); (-1, 0):
        none."""
        raise NotImplementedError

    def count_in_flight(self, k: int, began: int, slow: bool) -> None:
        """Count read ``k``, in progress since ``began``, as in flight on its path once it
        is ``slow`` (began 0: none is, anymore)."""

    def give_up(self, began: int) -> None:
        """The job was just abandoned, its read in progress seen to begin at ``began``:
        that read, if still the one in progress, stalled; a later one was left running."""
        raise NotImplementedError

    def _settle(self, k_now: int, began_now: int, began: int) -> None:
        batch = self.batch
        if k_now < 0:
            return
        if began_now == began:
            age = time.monotonic_ns() - began
            self.opener._stalled(batch.reads, batch.paths, k_now, age, batch.results)
        else:  # the read seen returned as it was given up; the next one is left running
            batch.results[k_now] = _left_behind(batch.reads, batch.paths, k_now)


class _PythonRun(_Run):
    """A run through the inner opener's ``pread_into``, a read at a time; each read counts
    as in flight on its path while it runs."""

    def __init__(self, opener: DeadlineOpener, batch: _Batch, todo: list[int]) -> None:
        super().__init__(opener, batch, todo)
        self._at = [-1, 0]  # the read in progress (-1: none) and its start, under the lock
        self._call: tuple[str, int] | None = None  # it, counted in flight

    def run(self) -> None:
        batch, job, inflight, inner = self.batch, self.job, self.inflight, self.opener.inner
        for k in self.todo:
            fd, offset, target = batch.reads[k]
            with job.lock:
                if job.abandoned:
                    return
                call = self._call = inflight.begin(batch.paths[k])
                self._at[:] = [k, call[1]]
            try:
                got: int | OSError = read_fully(inner, fd, target, offset)
            except OSError as exc:
                got = exc
            with job.lock:
                inflight.end(call)
                self._call = None
                if job.abandoned:
                    return
                batch.results[k], batch.times[k] = got, time.monotonic_ns() - call[1]
                self._at[0] = -1
            # Outside the lock (the caller may be giving up meanwhile: what this computes is
            # then never looked at; it only reads the target).
            if batch.after is not None and isinstance(got, int):
                batch.after(k)

    def current(self) -> tuple[int, int]:
        with self.job.lock:
            k, began = self._at
        return (k, began) if k >= 0 else (-1, 0)

    def give_up(self, began: int) -> None:
        with self.job.lock:  # abandoned: no read starts or ends in the run from now on
            k_now, began_now = self._at
            if self._call is not None:
                self.inflight.end(self._call)  # given up: no longer this process's call
                self._call = None
        self._settle(k_now, began_now, began)


class _NativeRun(_Run):
    """A run of a plain POSIX opener: one call of the compiled module (the GIL released
    once for all its reads, each member hashed there), which publishes the read in progress
    and its start in ``progress``; the watcher counts that read in flight once it has run
    long enough to matter (past :attr:`~DeadlineOpener.slow_s`, what the slow-call gate
    asks), and stops the call when it gives up: no read starts after that."""

    def __init__(self, opener: DeadlineOpener, batch: _Batch, todo: list[int]) -> None:
        super().__init__(opener, batch, todo)
        self.progress = np.zeros(3, dtype=np.int64)
        self._counted: tuple[str, int] | None = None

    def run(self) -> None:
        batch, todo = self.batch, self.todo
        hashes = cast("MemberHashes | None", batch.after)
        outcomes, spent, digests = read_natively(
            [batch.reads[k] for k in todo], hashes, self.progress
        )
        with self.job.lock:
            if self.job.abandoned:  # nothing is written into the results once abandoned
                return
            for j, got in enumerate(outcomes):
                batch.results[todo[j]], batch.times[todo[j]] = got, spent[j]
            if hashes is not None and digests is not None:
                for j, digest in enumerate(digests):
                    if digest is not None:
                        hashes.judge(todo[j], digest)

    def current(self) -> tuple[int, int]:
        j, began = _published(self.progress)
        return (self.todo[j], began) if began else (-1, 0)

    def count_in_flight(self, k: int, began: int, slow: bool) -> None:
        if self._counted is not None and self._counted[1] != began:
            self.inflight.end(self._counted)  # that read returned
            self._counted = None
        if began and slow and self._counted is None:
            self._counted = self.inflight.begin(self.batch.paths[k], start=began)

    def give_up(self, began: int) -> None:
        j, began_now = stop_native_reads(self.progress)
        self.count_in_flight(-1, 0, False)
        self._settle(self.todo[j] if began_now else -1, began_now, began)


def _unsuspect(registry: UnavailableShards, suspected: dict[str, int], path: str) -> None:
    """One run less waits on ``path``'s slow read; the node is told once none does."""
    suspected[path] -= 1
    if not suspected[path]:
        del suspected[path]
        registry.unsuspect(path)


def _published(progress: np.ndarray[Any, Any]) -> tuple[int, int]:
    """The read in progress of a compiled :func:`read_natively` call and its start (0:
    none), read as one: again until the start did not move meanwhile."""
    while True:
        began = int(progress[1])
        index = int(progress[0])
        if int(progress[1]) == began:
            return index, began


def _left_behind(
    reads: Sequence[tuple[int, int, memoryview]], paths: list[str], k: int
) -> AbandonedBufferError:
    """The outcome of a read that started as the call was given up for an earlier one: not
    stalled itself (its path is not held), but it may still write its target."""
    what = f"read of {paths[k] or f'descriptor {reads[k][0]}'} at offset {reads[k][1]}"
    left = AbandonedBufferError(
        errno.ETIMEDOUT, f"{what}: left running when an earlier read was given up"
    )
    left.waited_s = 0.0
    return left


def bounded(
    opener: Opener,
    path: str,
    what: str,
    call: Callable[[], _T],
    *,
    cleanup: Callable[[_T], None] | None = None,
) -> _T:
    """``call()`` under ``opener``'s deadline where it has one (:meth:`DeadlineOpener.bounded`),
    else directly."""
    if isinstance(opener, DeadlineOpener):
        return opener.bounded(path, what, call, cleanup=cleanup)
    return call()


def _close_map(mapped: mmap.mmap | None) -> None:
    if mapped is not None:
        mapped.close()
