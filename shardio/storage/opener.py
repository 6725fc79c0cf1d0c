"""The opener: every byte the read side takes from storage goes through one of these.

An opener opens a path, reads ranges of it with ``pread``, copies ranges of it into a file
of the caller's (staging and repair, in the kernel where it can), tells its size and
identity, passes read-ahead advice and (for the opt-in mapped transport only) maps it. The
POSIX one is the default; :mod:`shardio.read.deadline` bounds every call of another in time,
and :mod:`shardio.read.faults` wraps it to inject faults in tests. Openers are passed in
(``ShardReader(root, opener=...)``, ``verify_dataset(root, opener=...)``,
``copy_verified(..., opener=...)``) and must pickle, since DataLoader and verify workers get a
copy. ``tests/conformance/test_openers.py`` is what every opener must pass.
"""

from __future__ import annotations

import errno
import functools
import itertools
import mmap
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import Protocol, Union

import xxhash

from shardio.errors import StorageError, StorageUnavailableError, wrap_os_error
from shardio.storage.files import open_for_pread, open_regular
from shardio.storage.stall import Job, plain_threads

try:  # built by `make install` (a C compiler); else the same reads the pure-Python way
    from shardio.storage import _fastread
except ImportError:  # pragma: no cover - a build without the compiled fast path
    _fastread = None  # type: ignore[assignment]

__all__ = [
    "MemberHashes",
    "Opener",
    "PosixOpener",
    "ReadOutcome",
    "copy_through_buffer",
    "fetch_to_sink",
    "null_sink",
    "open_named",
    "read_each",
    "read_fully",
    "read_many",
    "split_runs",
]


class Opener(Protocol):
    """What the read side needs from storage. Every method may raise ``OSError``."""

    def open(self, path: str, *, nofollow: bool = False) -> int:
        """Open ``path`` read-only without blocking; return a descriptor."""

    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        """Read up to ``len(target)`` bytes at ``offset``; return how many (0 at the end)."""

    def copy_into(self, fd: int, out: int, offset: int, count: int) -> int:
        """Copy up to ``count`` bytes at ``offset`` of ``fd`` to ``out`` at its own file
        position (advanced); return how many (0 at the end). ``fd``'s position is unchanged."""

    def size(self, fd: int) -> int:
        """The size of the open file in bytes."""

    def identity(self, fd: int) -> tuple[int, int]:
        """(device, inode) of the open file: tells a replaced file from the one read."""

    def advise(self, fd: int, offset: int, length: int) -> None:
        """Hint that ``length`` bytes at ``offset`` will be read soon."""

    def map(self, path: str) -> mmap.mmap | None:
        """A private read mapping of the whole file (None when it is empty)."""

    def close(self, fd: int) -> None:
        """Close a descriptor from :meth:`open` or :meth:`dup`."""

    def dup(self, fd: int, path: str) -> int:
        """A second descriptor of the open file ``fd`` (opened as ``path``, maybe by another
        opener), for a reader in another thread: no open reaches the filesystem. Optional:
        a pool whose opener has none opens ``path`` itself."""


class PosixOpener:
    """Plain POSIX calls: ``open(O_NONBLOCK)``, ``preadv``, ``fstat``, ``posix_fadvise``."""

    def open(self, path: str, *, nofollow: bool = False) -> int:
        return open_for_pread(path, what="shard", nofollow=nofollow)

    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        return os.preadv(fd, [target], offset)

    def copy_into(self, fd: int, out: int, offset: int, count: int) -> int:
        # In the kernel where the two filesystems allow it (copy_file_range within one,
        # sendfile across), else through a buffer.
        for copy in (_copy_file_range, _sendfile):
            try:
                return copy(fd, out, offset, count)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
        return copy_through_buffer(self, fd, out, offset, count)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def identity(self, fd: int) -> tuple[int, int]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino

    def advise(self, fd: int, offset: int, length: int) -> None:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

    def dup(self, fd: int, path: str) -> int:
        return os.dup(fd)

    def map(self, path: str) -> mmap.mmap | None:
        fd = open_regular(path, what="shard")
        try:
            if os.fstat(fd).st_size == 0:
                return None
            return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot map shard {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def __repr__(self) -> str:
        return "PosixOpener()"


_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
_COPY_BUFFER = 8 * 1024 * 1024


def _copy_file_range(fd: int, out: int, offset: int, count: int) -> int:
    return os.copy_file_range(fd, out, count, offset)


def _sendfile(fd: int, out: int, offset: int, count: int) -> int:
    return os.sendfile(out, fd, offset, count)


def copy_through_buffer(opener: Opener, fd: int, out: int, offset: int, count: int) -> int:
    """``copy_into`` by ``opener.pread_into`` and ``write`` (at most 8 MiB a call): for an
    opener whose reads are not the kernel's (faults injected) or filesystems that copy no
    other way."""
    buf = memoryview(bytearray(max(1, min(count, _COPY_BUFFER))))
    got = opener.pread_into(fd, buf, offset)
    written = 0
    while written < got:
        written += os.write(out, buf[written:got])
    return got


def open_named(opener: Opener, path: str, *, what: str, nofollow: bool = False) -> int:
    """``opener.open(path)``; a failure is a StorageError naming ``what`` and ``path``
    ("cannot open index /d/index.bin: No such file or directory"). An unavailable storage's
    error (a stall abandoned, a shard held) is raised as it is.

    Raises:
        StorageError: it cannot be opened (with ``nofollow``: it is a symlink).
    """
    try:
        return opener.open(path, nofollow=nofollow)
    except StorageUnavailableError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP and nofollow:
            reason = "is a symlink, not a file shardio wrote"
        elif exc.errno == errno.EISDIR:
            reason = "is a directory, not a regular file"
        else:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise wrap_os_error(exc, f"cannot open {what} {path}: {reason}") from exc


def null_sink(path: str = "/dev/null") -> int | None:
    """A write descriptor of the null device (``path``), or None where that path is not the
    null device (a regular file in a broken container image, a symlink: nothing is written
    there, and nothing is created)."""
    # Asked before the open (no other device, FIFO or file is even opened) and of the
    # descriptor after it (the same node, in case the path was swapped in between).
    try:
        before = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not _is_null(before):
        return None
    flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        after = os.fstat(fd)
        if _is_null(after) and (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _is_null(st: os.stat_result) -> bool:
    """Whether ``st`` is the null device: a character device, major 1, minor 3 (Linux)."""
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)


def fetch_to_sink(opener: Opener, fd: int, offset: int, count: int, sink: int) -> int:
    """Bring ``[offset, offset + count)`` of ``fd`` into the page cache without copying it
    into this process: ``opener.copy_into`` the null device ``sink`` (:func:`null_sink`;
    ``sendfile`` in the kernel). Bytes fetched: fewer only at the end of the file.

    A read-ahead that reads into a buffer of its own pays a copy per byte for nothing (two
    through the read deadline's scratch buffer). On the MooseFS bed, cold, 0.67 GB in 8 MiB
    requests: 0.17 CPU-seconds this way, 0.24 read into a buffer, the same wall time.
    """
    done = 0
    while done < count:
        got = opener.copy_into(fd, sink, offset + done, count - done)
        if got <= 0:
            break
        done += got
    return done


def read_fully(opener: Opener, fd: int, target: memoryview, offset: int) -> int:
    """Fill ``target`` from ``offset``, looping over short reads; return the bytes read.

    Fewer than ``len(target)`` bytes means the file ended first (it is shorter than its
    index says). ``EINTR`` is retried by Python itself.
    """
    done = 0
    size = len(target)
    while done < size:
        got = opener.pread_into(fd, target[done:], offset + done)
        if got < 0:  # pragma: no cover - a broken opener
            raise OSError(errno.EIO, "negative read")
        if got == 0:
            break
        done += got
    return done


# What read_many says of one read: the bytes read (fewer than the target's size: the file
# ended first), the error, or None (not attempted: an earlier read of the call stalled).
ReadOutcome = Union[int, OSError, None]  # noqa: UP007 - a runtime alias


def read_many(
    opener: Opener,
    reads: Sequence[tuple[int, int, memoryview]],
    took: list[int] | None = None,
    after: Callable[[int], object] | None = None,
    *,
    parallel: int = 1,
) -> list[ReadOutcome]:
    """Fill each ``(descriptor, offset, target)`` of ``reads`` as :func:`read_fully` would;
    return what became of each (:data:`ReadOutcome`), never raising for a read.

    An opener with a ``read_many`` method of its own does them in one call (the deadline
    opener: one hand-off to its I/O thread for a whole batch, not one per member);
    otherwise each is read here in turn. ``took``: where each read's time (ns) is
    appended, in order (0 for one not attempted). ``after(i)``: called in the thread that
    made read ``i``, once it returned without error and its bytes lie in its target, before
    the next read (a check of a member while it is still in the CPU's cache: hashed after
    the whole batch, each member of 110 KB cost 11% more). ``parallel``: the reads split
    into that many runs of neighbours, each run read in turn on a thread of its own, the
    runs at once (a network filesystem's requests in flight together); outcomes, ``took``
    and ``after``'s indices stay those of ``reads``.
    """
    many = getattr(opener, "read_many", None)
    if many is not None:
        got: list[ReadOutcome] = (
            many(reads, took, after, parallel=parallel)
            if parallel > 1
            else many(reads, took, after)
        )
        return got
    return read_each(opener, reads, took, after, parallel=parallel)


def split_runs(count: int, parallel: int) -> list[range]:
    """``range(count)`` cut into ``min(parallel, count)`` runs of neighbours, as even as can
    be (none empty; none at all for no reads)."""
    width = max(1, min(parallel, count))
    bounds = [count * w // width for w in range(width + 1)]
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


class MemberHashes:
    """The ``after`` of a :func:`read_many` that checks members: once read ``j`` returned,
    the xxh3-64 of ``targets[j]`` goes to ``judge(j, digest)``.

    Given as an object rather than a closure so that :func:`read_each` can hash in C: with a
    plain :class:`PosixOpener` and the compiled module built, the whole batch is read and
    hashed with the GIL released once (``judge`` is then called afterwards, for each read
    that filled its target). The digests are the same: xxh3-64, seed 0.
    """

    __slots__ = ("judge", "targets")

    def __init__(self, targets: Sequence[memoryview], judge: Callable[[int, int], None]) -> None:
        self.targets = targets
        self.judge = judge

    def __call__(self, j: int) -> None:
        self.judge(j, xxhash.xxh3_64_intdigest(self.targets[j]))


def read_each(
    opener: Opener,
    reads: Sequence[tuple[int, int, memoryview]],
    took: list[int] | None = None,
    after: Callable[[int], object] | None = None,
    *,
    parallel: int = 1,
) -> list[ReadOutcome]:
    """:func:`read_many` one ``opener.pread_into`` at a time, here (``parallel`` > 1: each
    run but the first on a thread of :func:`shardio.storage.stall.plain_threads`, the first
    here).

    A plain :class:`PosixOpener` (not a subclass or a wrapper) with no ``after`` or a
    :class:`MemberHashes` one reads the batch in one call of the compiled module: the same
    reads, outcomes and digests, with the GIL released once for the batch.
    """
    if parallel > 1 and len(reads) > 1:
        return _read_runs(opener, reads, took, after, parallel)
    if reads_natively(opener, after):
        return _read_each_native(reads, took, after)  # type: ignore[arg-type]
    pread, clock = opener.pread_into, time.perf_counter_ns
    out: list[ReadOutcome] = []
    for i, (fd, offset, target) in enumerate(reads):
        began = clock()
        got: ReadOutcome
        try:
            got = pread(fd, target, offset)
            if 0 < got < len(target):  # a short read: the rest, as read_fully does
                got += read_fully(opener, fd, target[got:], offset + got)
        except OSError as exc:
            got = exc
        out.append(got)
        if took is not None:
            took.append(clock() - began)
        if after is not None and not isinstance(got, OSError):
            after(i)
    return out


def _read_runs(
    opener: Opener,
    reads: Sequence[tuple[int, int, memoryview]],
    took: list[int] | None,
    after: Callable[[int], object] | None,
    parallel: int,
) -> list[ReadOutcome]:
    """:func:`read_each` of ``reads`` in ``parallel`` runs at once: the first in this
    thread, each other on a plain I/O thread (no deadline: the opener has none), waited for
    before this returns, whatever happens here."""
    results: list[ReadOutcome] = [None] * len(reads)
    times = [0] * len(reads)

    def run(span: range) -> None:
        spent: list[int] = []
        hashes = after
        if isinstance(after, MemberHashes):
            hashes = MemberHashes(
                [after.targets[i] for i in span], lambda j, d: after.judge(span[j], d)
            )
        elif after is not None:
            hashes = lambda j: after(span[j])  # noqa: E731 - the run's index is the batch's
        got = read_each(opener, [reads[i] for i in span], spent, hashes)
        results[span.start : span.stop] = got
        times[span.start : span.stop] = spent

    first, *rest = split_runs(len(reads), parallel)
    pool = plain_threads()
    jobs: list[Job] = []
    try:
        for span in rest:
            job = Job(functools.partial(run, span), None)
            pool.submit(job)
            jobs.append(job)
        run(first)
    finally:
        # No read may still write into the caller's buffers once this returns or raises.
        for job in jobs:
            job.event.wait()
    for job in jobs:
        if job.error is not None:
            raise job.error  # a bug, not the storage: a read's OSError is its outcome
    if took is not None:
        took.extend(times)
    return results


def reads_natively(opener: Opener, after: Callable[[int], object] | None) -> bool:
    """Whether reads through ``opener`` checked by ``after`` can go to the compiled module:
    it is built, ``opener`` is a plain :class:`PosixOpener` (not a subclass or a wrapper)
    and ``after`` is None or a :class:`MemberHashes`."""
    return (
        _fastread is not None
        and type(opener) is PosixOpener
        and (after is None or type(after) is MemberHashes)
    )


def read_natively(
    reads: Sequence[tuple[int, int, memoryview]],
    hashes: MemberHashes | None,
    progress: object = None,
) -> tuple[list[ReadOutcome], list[int], list[int | None] | None]:
    """``reads`` in one call of the compiled module (see :func:`reads_natively`): each
    read's outcome and nanoseconds, and the digests to judge (None for a read that did not
    fill its target: a short read is judged by the caller from its length). With
    ``progress`` (a deadline's, see ``_fastread.c``), the lists hold only the reads made."""
    outcomes, digests, times = _fastread.pread_many(reads, hashes is not None, progress)
    out: list[ReadOutcome] = [
        got if got >= 0 else OSError(-got, os.strerror(-got)) for got in outcomes
    ]
    return out, times, digests


def stop_native_reads(progress: object) -> tuple[int, int]:
    """Stop a :func:`read_natively` call given ``progress``: no read starts after this.
    Returns the read in progress then (its index in the call, its start; start 0: none)."""
    return _fastread.stop_reads(progress)


def _read_each_native(
    reads: Sequence[tuple[int, int, memoryview]],
    took: list[int] | None,
    hashes: MemberHashes | None,
) -> list[ReadOutcome]:
    """:func:`read_each` of a plain POSIX opener in one call of the compiled module."""
    out, times, digests = read_natively(reads, hashes)
    if took is not None:
        took.extend(times)
    if hashes is not None and digests is not None:
        for j, digest in enumerate(digests):
            if digest is not None:
                hashes.judge(j, digest)
    return out
