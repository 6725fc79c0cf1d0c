"""Planned reads for a parallel filesystem: coalesced requests, several in flight.

On a network or parallel filesystem each request pays a round trip to a data server, so a
member read one ``pread`` at a time in the reading thread is latency-bound. Two tools:

- :func:`read_members_planned` (map mode): a batch's members, sorted by shard and offset,
  neighbours coalesced into requests of at most ``request_bytes``, issued on a small pool of
  I/O threads (``os.preadv`` releases the GIL) with ``inflight`` requests at once. Every
  member is hashed on the calling thread once its bytes lie in the final buffer; a request
  that fails, comes back short, or holds a member that fails its check hands the members
  concerned to :meth:`ShardReader.read_member_into`, which owns recovery (staged copies,
  error types, stalls), so that recovery stays in one place.
- :class:`StreamReadahead` (stream mode): one thread per reading process that reads the
  shards of the epoch's windows sequentially, in first-use order, in large requests into a
  scratch buffer: the page cache fills the way ``cat`` fills it, and the shuffled member
  reads that follow (the unchanged per-member path, which verifies every member) find their
  pages in memory. The order of the epoch is not touched, only how its bytes arrive.

The read-ahead's bytes are never handed to anyone: they only warm the page cache. A request
it makes on a descriptor the pool closed meanwhile costs wasted I/O, never a wrong byte.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardio.errors import ReadStalledError
from shardio.read.deadline import AbandonedBufferError
from shardio.read.digest import member_digest_problem
from shardio.read.reader import ShardReader
from shardio.read.strategy import ReadStrategy
from shardio.storage.opener import Opener, read_many

__all__ = [
    "Request",
    "io_pool",
    "plan_requests",
    "read_members_planned",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Request:
    """One read: ``[start, end)`` of a shard file, holding the members ``items`` (their
    positions in the caller's arrays), in file order."""

    start: int
    end: int
    items: tuple[int, ...]


def plan_requests(
    offsets: Sequence[int], sizes: Sequence[int], *, gap_bytes: int, request_bytes: int
) -> list[Request]:
    """Coalesce the members of one shard into requests.

    Members are taken in file order; a member joins the request before it when it starts at
    most ``gap_bytes`` after that request's end and the request stays within
    ``request_bytes`` (a member longer than that is a request of its own). Overlapping
    members (never written by ``shardio pack``, but records are data) are kept apart.

    Args:
        offsets: each member's offset in the shard file.
        sizes: each member's size.
        gap_bytes: the largest hole read and dropped to join two members.
        request_bytes: the largest coalesced request.
    """
    order = sorted(range(len(offsets)), key=lambda i: (offsets[i], sizes[i]))
    out: list[Request] = []
    start = end = 0
    items: list[int] = []
    for i in order:
        lo, hi = int(offsets[i]), int(offsets[i]) + int(sizes[i])
        if items and end <= lo <= end + gap_bytes and hi - start <= request_bytes:
            items.append(i)
            end = hi
            continue
        if items:
            out.append(Request(start=start, end=end, items=tuple(items)))
        start, end, items = lo, hi, [i]
    if items:
        out.append(Request(start=start, end=end, items=tuple(items)))
    return out


# -- the I/O threads of a process ------------------------------------------------------------
class _Task:
    """One function run on an I/O thread; :meth:`wait` returns its result or raises."""

    __slots__ = ("_done", "_error", "_fn", "_result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # handed to the waiting caller
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class _IoPool:
    """Daemon threads ``shardio-io-N`` taking tasks from one queue (a stalled ``pread`` can
    hold one, never the interpreter's exit)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def ensure(self, width: int) -> None:
        with self._lock:
            while len(self._threads) < width:
                thread = threading.Thread(
                    target=self._loop, name=f"shardio-io-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    @property
    def width(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable[[], Any]) -> _Task:
        task = _Task(fn)
        self._tasks.put(task)
        return task

    def _loop(self) -> None:
        while True:
            self._tasks.get().run()


_POOL: _IoPool | None = None
_POOL_LOCK = threading.Lock()


def io_pool(width: int) -> _IoPool:
    """This process's I/O threads, at least ``width`` of them, started on first use.

    A forked child inherits the parent's pool object but none of its threads: it gets a
    pool of its own.
    """
    global _POOL  # noqa: PLW0603 - one pool per process, by design
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = _IoPool()
        pool = _POOL
    pool.ensure(width)
    return pool


# -- map mode: a batch's members read with several requests in flight -------------------------
_Job = tuple[Request, int, "memoryview | None"]  # a request, its descriptor, its member's slice
# A request read_many did not attempt (one before it stalled): its members are read again.
_NOT_ATTEMPTED = OSError(errno.EAGAIN, "not attempted")


def _read_requests(opener: Opener, jobs: Sequence[_Job]) -> list[Any]:
    """Read each request in turn (into its member's own slice when it holds one member, else
    into a scratch buffer), with one :func:`read_many` (one hand-off to a deadline opener's
    thread for the run, not one per request); return per request (bytes read or the
    OSError, scratch or None, nanoseconds)."""
    scratches = [
        None if into is not None else bytearray(req.end - req.start) for req, _fd, into in jobs
    ]
    reads = [
        (fd, req.start, into if into is not None else memoryview(scratch))  # type: ignore[arg-type]
        for (req, fd, into), scratch in zip(jobs, scratches, strict=True)
    ]
    took: list[int] = []
    outcomes = read_many(opener, reads, took)
    return [
        (got if got is not None else _NOT_ATTEMPTED, scratch, ns)
        for got, scratch, ns in zip(outcomes, scratches, took, strict=True)
    ]


def read_members_planned(  # noqa: PLR0917 - one call shape, from read_batch
    ds: ShardReader,
    rows: Sequence[int],
    shards: Sequence[int],
    samples: Sequence[int],
    targets: Sequence[memoryview],
    strategy: ReadStrategy,
    *,
    verify: bool = True,
) -> None:
    """Read members ``rows`` into ``targets`` (each its member's exact size), checked.

    Members of a shard read from its source are coalesced (:func:`plan_requests`) and read
    with up to ``strategy.inflight`` requests in flight; everything else, and every member
    whose request failed or whose check failed, is read by ``ds.read_member_into``. The
    records of ``shards`` must be checked (``ds.index.records``) before the call.

    Raises:
        ChecksumMismatchError: a member's bytes differ from the index (read again first).
        StorageError: a shard is missing, unreadable or short.
        AbandonedBufferError: a request read straight into a target stalled and was
            abandoned (as :meth:`~shardio.read.reader.ShardReader.read_members_into`).
    """
    spent = 0  # ns the requests took, each on its own
    members = ds.index.members
    by_shard: dict[int, list[int]] = {}
    for k, shard in enumerate(shards):
        by_shard.setdefault(int(shard), []).append(k)
    fallback: list[int] = []
    later: list[int] = []  # requests not made (one before them stalled): read after the rest
    jobs: list[_Job] = []
    tasks: list[tuple[list[_Job], _Task]] = []
    try:
        for shard, ks in by_shard.items():
            loc = ds.resolver.locate(shard)
            if loc.staged or (ds.restage and ds.cache_root is not None):
                # A local copy, or a source read that may first stage the shard again: the
                # per-member path owns those decisions.
                fallback.extend(ks)
                continue
            try:
                fd = ds.pool.fd(loc.path, staged=False)  # on this thread: the pool is not shared
            except OSError:
                fallback.extend(ks)  # read_member_into raises the proper error
                continue
            offs = [int(members[rows[k]]["offset"]) for k in ks]
            sizes = [len(targets[k]) for k in ks]
            for req in plan_requests(
                offs,
                sizes,
                gap_bytes=strategy.coalesce_gap_bytes,
                request_bytes=strategy.request_bytes,
            ):
                mapped = Request(
                    start=req.start, end=req.end, items=tuple(ks[i] for i in req.items)
                )
                into = targets[mapped.items[0]] if len(mapped.items) == 1 else None
                jobs.append((mapped, fd, into))
        # ``inflight`` runs of requests in file order, one per I/O thread: one hand-off per
        # thread and batch, not per member (each costs a wake-up on a busy node).
        width = min(strategy.inflight, len(jobs))
        if width:
            pool = io_pool(width)
            bounds = [len(jobs) * w // width for w in range(width + 1)]
            for lo, hi in itertools.pairwise(bounds):
                run = jobs[lo:hi]
                tasks.append((run, pool.submit(functools.partial(_read_requests, ds.opener, run))))
        results = (
            (job, result)
            for run, task in tasks
            for job, result in zip(run, task.wait(), strict=True)
        )
        for (req, _fd, into), (got, scratch, took) in results:
            spent += took
            direct = into is not None
            if got is _NOT_ATTEMPTED:
                later.extend(req.items)
                continue
            if isinstance(got, AbandonedBufferError) and direct:
                # Read straight into the caller's buffer, which that read may still write:
                # the caller reads the batch again into a fresh one (a scratch buffer of this
                # call is only given up: the I/O thread keeps it until the read returns).
                ds.metrics.record_stall(got.waited_s)
                raise got
            if isinstance(got, OSError):
                if isinstance(got, ReadStalledError) and got.waited_s > 0:
                    # Counted here: the fallback read of its members is refused at once
                    # (the file is held), which counts as a held fail, not as the stall.
                    ds.metrics.record_stall(got.waited_s)
                fallback.extend(req.items)
                continue
            timed = took if ds.timed else None
            for k in req.items:
                target = targets[k]
                lo = int(members[rows[k]]["offset"])
                if not direct:
                    rel = lo - req.start
                    if rel + len(target) > got:
                        fallback.append(k)
                        continue
                    target[:] = scratch[rel : rel + len(target)]
                elif got != len(target):
                    fallback.append(k)
                    continue
                # Hashed here, once the bytes lie in the final buffer.
                if verify and member_digest_problem(target, int(members[rows[k]]["xxh3_64"])):
                    fallback.append(k)
                    continue
                ds.metrics.record_read(False, len(target), timed)
    finally:
        # No request may still write into the caller's buffer once this returns or raises.
        for _run, task in tasks:
            with contextlib.suppress(BaseException):
                task.wait()
    fallback_began = time.perf_counter_ns()
    # The members whose request failed first: a stalled one's file is held, so its member
    # fails at once and names the sample whose shard stalled; the members of requests that
    # were not made come after (read first, they could wait on a mount the stall holds and
    # be taken for the stalled ones).
    for k in [*sorted(fallback), *sorted(later)]:
        ds.read_member_into(
            int(rows[k]), targets[k], shard=int(shards[k]), sample=int(samples[k]), verify=verify
        )
    # Paced by the requests' own times (in flight together, the batch's wall time says
    # little of where the bytes came from), and the member reads made after them.
    ds.note_pace(
        spent + time.perf_counter_ns() - fallback_began, len(targets), sum(len(t) for t in targets)
    )
