"""ShardReader: a dataset written by ``shardio pack``, read member by member, checked.

Opens the manifest and the index (checked at open, each shard's records on first use), then
reads members with ``pread`` through the opener, from wherever the resolver says, and passes
every member through the one member check before a caller sees it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from shardio._deprecated import renamed_option
from shardio.errors import ReadStalledError, ShardioError, StorageError
from shardio.format.index import Index
from shardio.format.manifest import Manifest
from shardio.format.spec import LABEL_EXT, MANIFEST_FILENAME
from shardio.metrics.read import ReadMetrics
from shardio.read.advice import merged_member_ranges
from shardio.read.deadline import AbandonedBufferError, bounded
from shardio.read.digest import digest_problem, member_digest_problem
from shardio.read.failures import member_read_error
from shardio.read.filepool import FilePool
from shardio.read.handoff import Event, Handoff, emit_event
from shardio.read.mapcache import MapCache
from shardio.read.resolver import NOT_OPENED, Location, ShardResolver
from shardio.read.strategy import ReadStrategy
from shardio.read.tables import open_tables
from shardio.staging.protocol import read_staged_for
from shardio.storage.fsdetect import FsInfo, describe_fs
from shardio.storage.opener import (
    MemberHashes,
    Opener,
    PosixOpener,
    ReadOutcome,
    read_fully,
    read_many,
)
from shardio.storage.residency import resident

__all__ = ["ShardReader"]

# _read_at's problem for a staged copy evicted after it was located: not a fault, the shard
# is located again (its stamp is gone: the source).
EVICTED = "evicted"
# A member whose read has not been checked (it failed, or was not made).
_NOT_CHECKED = -1


# A batch whose reads took less than this came from the page cache, and the next batch gets no
# advice (advice on cached pages costs a system call per range and finds nothing to do):
# (ns per member, bytes per ns), by "network filesystem". Measured on this kind of machine: a
# 110 KB member from the page cache took about 20 us on a local disk and 54 us through the
# MooseFS client, a cold one 49 us and 190 us (checksum included).
_CACHED_PACE = {False: (5_000, 2.5), True: (20_000, 1.4)}


def _failure_counter(problem: str) -> str:
    return "checksum_failures" if problem == "checksum mismatch" else "read_errors"


class ShardReader:
    """A dataset written by ``shardio pack``.

    Reads a shard from a staging area when a verified copy is there, else from the source
    (a read-through cache): ``ShardReader(SRC, stage=DEST)``, or ``ShardReader(DEST)``
    for a staging area, whose manifest names its source. A staged copy that fails a read is
    dropped and the member read again from the source (or from a fresh copy, with
    ``restage=True``).

    Args:
        root: the dataset directory (holding manifest.json), or a staging area.
        max_open: bound on shard files held open at once.
        stage: a staging area (``shardio stage``) to read verified copies from.
        cache: the old name of ``stage`` (warns; goes in 0.3).
        opener: how bytes are read (default: POSIX calls).
        restage: stage a bad copy again from the source (once per node) instead of only
            dropping it; also a copy written, cut or removed after it was staged (its stamp
            no longer matches), which is otherwise only passed over for the source.
        timed: time every member read into the latency histograms of ``metrics`` (False
            keeps only the counters).
        handoff: from :meth:`handoff` in the process that started this one: its manifest
            and its resolver's decisions are taken instead of being read and made again.
        fs: the filesystem of ``root`` where the caller has told it (one statfs and one read
            of the mount table a process; default: told here).
        on_event: called with a dict for each recovery event (a dropped or re-staged copy);
            None: each is logged.
        read_strategy: how :func:`shardio.runtime.batch.read_batch` reads a batch's members
            (the runtime's choice from :func:`shardio.read.strategy.choose_strategy`); None
            or one in flight: one pread per member in the reading thread.

    Attributes:
        resolver: where each shard is read from.
        metrics: this process's read counters and latency histograms (the one place the
            pool, the map cache, the resolver, the reader and the recovery steps count).
        advising: whether :meth:`advise` sends advice (the runtime turns it off while a
            stream read-ahead runs).
        reads_cached: the last :meth:`read_members_into` was as fast as the page cache (so
            :meth:`advise` sends none until a read is slower).
    """

    advising = True  # False while a stream read-ahead fills the page cache (see advise)

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_open: int = 64,
        stage: str | os.PathLike[str] | None = None,
        cache: str | os.PathLike[str] | None = None,
        opener: Opener | None = None,
        restage: bool = False,
        timed: bool = True,
        handoff: Handoff | None = None,
        fs: FsInfo | None = None,
        on_event: Callable[[Event], None] | None = None,
        read_strategy: ReadStrategy | None = None,
    ) -> None:
        self.root = os.fspath(root)
        stage = renamed_option("ShardReader", "cache", cache, "stage", stage)
        self.read_strategy = read_strategy
        self.opener: Opener = opener if opener is not None else PosixOpener()

        # The manifest and the index are read outside the opener, under its deadline: with
        # their server gone the open fails in bounded time, not after the client's retries.
        def open_all() -> tuple[Manifest, str | None, Index, FsInfo]:
            info = fs if fs is not None else describe_fs(self.root)
            manifest, dataset_id, index = open_tables(self.root, handoff, info)
            return manifest, dataset_id, index, info

        self.manifest, dataset_id, self.index, fs_info = bounded(
            self.opener,
            os.path.join(self.root, MANIFEST_FILENAME),
            f"opening the dataset {self.root} (its manifest and index)",
            open_all,
            cleanup=lambda opened: opened[2].close(),
        )
        self.metrics = ReadMetrics()
        self.timed = timed
        self.reads_cached = False
        network = fs_info.network
        self._cached_pace = _CACHED_PACE[network]
        # Asked of local filesystems only: a network client may take locks or wait on a
        # server before it answers even a read that may not wait.
        self._nowait_probe = hasattr(os, "RWF_NOWAIT") and not network
        self._network = network
        self._probe_byte = memoryview(bytearray(1))
        self.resolver = ShardResolver(
            self.manifest,
            self.root,
            os.fspath(stage) if stage is not None else None,
            metrics=self.metrics,
            dataset_id=dataset_id,
        )
        if handoff is not None:
            self.resolver.inherit(handoff.staged)
        elif stage is not None:
            self.resolver.check_cache()  # another dataset's area is refused, a missing one said
        self.restage = restage
        self.on_event = on_event
        self.pool = FilePool(self.opener, max_open, self.metrics)
        self.maps = MapCache(self.opener, metrics=self.metrics)

    @property
    def cache_root(self) -> str | None:
        """The staging area read from, or None."""
        return self.resolver.cache_root

    @property
    def staged_for(self) -> dict[str, Any] | None:
        """What the staging area read from was staged for (the order spec and rank layout
        its last stage run recorded), or None: no area, or nothing recorded."""
        root = self.resolver.cache_root
        return read_staged_for(root) if root is not None else None

    def __len__(self) -> int:
        return len(self.index)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def handoff(self) -> Handoff:
        """What a worker started by pickling needs to open this dataset without reading the
        manifest again (see ``handoff`` in the constructor)."""
        return Handoff(
            manifest=self.manifest,
            staged=self.resolver.handed(),
            dataset_id=self.resolver.dataset_id,
        )

    def decide(self, samples: Sequence[int] | np.ndarray[Any, Any]) -> None:
        """Check now which shards of ``samples`` are staged, once for this process and the
        workers it starts next (:meth:`ShardResolver.decide`); without a staging area, a
        no-op."""
        if self.resolver.cache_root is None:
            return
        shards = self.index.shards_of(np.asarray(samples, dtype=np.int64))
        # bincount, not np.unique: that loads numpy.ma (8 ms per process).
        used = np.bincount(shards, minlength=len(self.manifest.shards))
        self.resolver.decide(np.flatnonzero(used).tolist())

    def open_ahead(self, shards: Iterable[int], *, limit: int | None = None) -> int:
        """Open the source files of ``shards`` now, in this order, for the processes this
        one forks next: they read through the inherited descriptors, so a shard costs the
        metadata server one open a process, not one a worker and epoch. Staged copies are
        left to the readers (each locks its own). Returns the opens.

        At most ``limit`` descriptors are held (default: a quarter of the open-files limit,
        so that two or three datasets leave the process room for its pipes and shared
        memory), never more than the pool's bound. A shard that cannot be opened is passed
        over (its reader meets the error, with its own handling), up to four of them
        (:meth:`~shardio.read.filepool.FilePool.open_ahead`); an open that stalled ends it at
        once (it has cost this process its deadline once: the filesystem is not answering).
        """
        return self.pool.open_ahead((self.resolver.locate(shard) for shard in shards), limit=limit)

    def adopt_opens(self, other: ShardReader) -> int:
        """Hold duplicates of the source descriptors ``other`` (a reader of the same
        dataset in this process) holds open, for reads in another thread; returns how many
        (see :meth:`~shardio.read.filepool.FilePool.adopt`)."""
        return self.pool.adopt(other.pool)

    def shard_path(self, shard: int) -> str:
        """Path shard ``shard`` is read from now: its verified staged copy, else the source."""
        return self.resolver.locate(shard).path

    def key(self, sample: int) -> str:
        """Key of a sample."""
        return self.index.key(sample)

    def shard_of(self, sample: int) -> int:
        """The shard holding ``sample``."""
        return int(self.index.samples["shard"][sample])

    def advise(self, samples: Sequence[int], *, ahead: bool = False) -> None:
        """Tell the kernel these samples will be read soon (``POSIX_FADV_WILLNEED``).

        Reads of a batch then go to the device (or the parallel filesystem) together instead
        of one synchronous pread at a time; nearby ranges are merged first. Nothing while
        :attr:`advising` is off (a stream read-ahead is filling the page cache: advice would
        only ask the filesystem for the same pages again, one call per member range), nor
        while :attr:`reads_cached` (the last batch came from the page cache). Advice for
        batches read later (``ahead``: a stream's next ones) makes those come as fast as the
        page cache, so their speed cannot stop it: it is left out only while the first
        member of ``samples`` is in the page cache already, or, where that cannot be asked
        (a network filesystem), while the reads are fast (there each piece of advice is a
        hand-off to the read deadline's thread: on the MooseFS bed, warm, about a third of
        a map epoch's CPU).
        """
        if len(samples) == 0 or not self.advising:
            return
        if self.reads_cached and (
            not ahead or not self._nowait_probe or self.first_member_cached(samples)
        ):
            return
        for shard, lo, hi in merged_member_ranges(self.index, samples):
            self._advise_range(shard, lo, hi)

    def first_member_cached(self, samples: Sequence[int] | np.ndarray[Any, Any]) -> bool:
        """Whether the first member of ``samples`` is in the page cache now, asked without
        reading it through the opener. On a local filesystem: a one-byte read that may not
        wait (``RWF_NOWAIT``): it never waits (no deadline to keep) and its byte is never
        handed on (no check to pass). On a network filesystem, whose client may take locks
        or wait on a server before it answers even such a read (a FUSE client refuses it):
        ``mincore`` of a mapping of the member (:func:`~shardio.storage.residency.resident`,
        no byte read, no request sent). False where the filesystem cannot say (a local one
        that refuses the flag is never asked again in this process)."""
        try:
            rec = self.index.records([int(samples[0])])[0]  # its shard's records checked
            shard, member = int(rec["shard"]), int(rec["first_member"])
            loc = self.resolver.locate(shard)
            fd = self.pool.fd(loc.path, staged=loc.staged)
            offset = int(self.index.members[member]["offset"])
            if self._network:
                return self.resident(fd, loc.path, offset, int(self.index.members[member]["size"]))
            if not self._nowait_probe:
                return False
            return os.preadv(fd, [self._probe_byte], offset, os.RWF_NOWAIT) > 0
        except BlockingIOError:
            return False  # not in the page cache
        except (OSError, ShardioError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait_probe = False
            return False

    def resident(self, fd: int, path: str, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` of ``fd`` (the file ``path``) is in the page
        cache (:func:`~shardio.storage.residency.resident`), asked under the opener's
        deadline: mapping a file of a network filesystem may ask its server (NFS
        revalidates). False where it cannot be told, or the call failed or stalled."""
        try:
            return bool(
                bounded(
                    self.opener,
                    path,
                    f"page-cache residency of {path}",
                    lambda: resident(fd, offset, length),
                )
            )
        except OSError:
            return False

    def first_cached(self, samples: Sequence[int]) -> bool:
        """Whether the reads of ``samples`` will come from the page cache: the last batch
        did, or (on a network filesystem) the first member of these is there now. What
        ``read_batch`` asks before it sends advice or chooses planned reads (many requests
        in flight: their hand-offs cost more than they gain on cached pages, and their own
        times cannot tell cached from not). On a local filesystem the last batch's pace
        alone decides: advice there is cheap, and a worker's first batches are advised
        before any of its reads."""
        if len(samples) == 0:
            return False
        return self.reads_cached or (self._network and self.first_member_cached(samples))

    def _advise_range(self, shard: int, lo: int, hi: int) -> None:
        # Advice only: a shard that cannot be opened fails its read, with a proper error.
        with contextlib.suppress(OSError):
            loc = self.resolver.locate(shard)
            self.opener.advise(self.pool.fd(loc.path, staged=loc.staged), lo, hi - lo)

    # -- reading ---------------------------------------------------------------------------
    def _was_evicted(self, loc: Location, exc: OSError, shard: int) -> bool:
        """Whether a staged copy that could not be opened was evicted (counted as an
        eviction, not as a read error; the shard is located again)."""
        if not loc.staged or exc.errno != errno.ENOENT or not self.resolver.evicted(shard):
            return False
        self.metrics.add("evictions")
        self.resolver.forget(shard)
        return True

    def _where(self, shard: int) -> Location:
        """Where a member of ``shard`` is read from now (a copy whose stamp no longer
        matches is staged again first, where allowed)."""
        loc = self.resolver.locate(shard)
        if (
            not loc.staged
            and self.restage
            and self.resolver.copy_changed(shard)
            and self.resolver.can_restage()
        ):
            # Its stamp no longer matches: stage it again (it is hashed whole under the
            # shard's lock first) instead of reading the source for the rest of the job.
            self._recover_copy(shard, "changed since it was staged", NOT_OPENED)
            loc = self.resolver.locate(shard)
        return loc

    def _read_at(
        self, loc: Location, offset: int, expected: int, target: memoryview, *, verify: bool,
        shard: int = -1,
    ) -> tuple[str | None, OSError | None, tuple[int, int]]:  # fmt: skip
        """Read one member from ``loc``; return (problem, OS error, identity of the file).

        A read that succeeds is timed (open included, check excluded) and counted by source.
        """
        fd = -1
        began = time.perf_counter_ns() if self.timed else 0
        try:
            fd = self.pool.fd(loc.path, staged=loc.staged)
            got: int | OSError = read_fully(self.opener, fd, target, offset)
        except OSError as exc:
            if fd < 0 and self._was_evicted(loc, exc, shard):
                return EVICTED, exc, NOT_OPENED
            got = exc
        return self._judge(loc, fd, got, target, expected, verify=verify, began=began)

    def _judge(
        self,
        loc: Location,
        fd: int,
        got: int | OSError,
        target: memoryview,
        expected: int,
        *,
        verify: bool,
        began: int,
    ) -> tuple[str | None, OSError | None, tuple[int, int]]:
        """The outcome of one read of ``target`` from ``fd`` (``got``: the bytes read, or
        the error): (problem, OS error, identity of the file), counted.

        A failed staged copy stays open: while this process holds it, its inode cannot be
        reused by a fresh copy, so the identity compared before dropping it stays unique.
        The caller closes it once the copy is dealt with.
        """
        identity = NOT_OPENED
        problem: str | None = None
        error: OSError | None = None
        if isinstance(got, OSError):
            if isinstance(got, ReadStalledError):
                self.metrics.record_stall(got.waited_s)
            problem, error = f"unreadable: {got.strerror or got}", got
        elif got != len(target):
            problem = "truncated"
        elif verify and member_digest_problem(target, expected) is not None:
            problem = "checksum mismatch"
        else:
            took = time.perf_counter_ns() - began if self.timed else None
            self.metrics.record_read(loc.staged, got, took)
            return None, None, identity
        self.metrics.add(_failure_counter(problem))
        if not loc.staged:
            self.pool.discard(loc.path)  # a replaced file is reopened on the next read
        elif fd >= 0:
            # Asked only now, not on every read (an fstat per member): the descriptor that
            # failed is still open, so it still names the file that failed. Should even
            # this fstat fail, NOT_OPENED keeps the copy and this process reads the source.
            with contextlib.suppress(OSError):
                identity = self.opener.identity(fd)
        return problem, error, identity

    def read_member_into(
        self,
        member: int,
        target: memoryview,
        *,
        shard: int,
        sample: int | None = None,
        verify: bool = True,
    ) -> None:
        """Read one member's bytes into ``target`` (its exact size), checking its xxh3-64.

        Raises:
            ChecksumMismatchError: the bytes differ from the index's checksum (in the source;
                a bad staged copy is dropped and the source read instead).
            StorageError: the shard is missing, unreadable or short.
        """
        self.index.check_shard(shard)
        rec = self.index.members[member]
        offset, expected = int(rec["offset"]), int(rec["xxh3_64"])
        self._settle(member, offset, expected, target, shard, sample, verify, None)

    def read_members_into(
        self,
        members: Sequence[int] | np.ndarray[Any, Any],
        shards: Sequence[int],
        samples: Sequence[int],
        targets: Sequence[memoryview],
        *,
        verify: bool = True,
    ) -> None:
        """Read many members, each into its target (its exact size), checking each xxh3-64.

        What :meth:`read_member_into` does for each member, with what need not be done per
        member done once: the offsets and checksums are taken from the index for all of
        them at once, and each shard's records are checked and its location found once.
        A member whose read fails goes on exactly as in :meth:`read_member_into` (a staged
        copy dropped or staged again, the source read, or the error raised).

        Args:
            members: member rows of the index.
            shards: the shard of each member.
            samples: the sample each member belongs to (named in errors).
            targets: where each member's bytes go.
            verify: check each member's xxh3-64 after reading it.

        Raises:
            AbandonedBufferError: a read into a target stalled past the read deadline and
                was abandoned; it may still write that target. Give up the memory of every
                target (never hand it out, never reuse it) and read again into fresh ones
                (:func:`~shardio.read.deadline.into_fresh_buffers`).
        """
        rows = np.asarray(members, dtype=np.int64)
        records = self.index.members
        offsets = records["offset"][rows].astype(np.int64).tolist()
        digests = records["xxh3_64"][rows].tolist()
        rows_list = rows.tolist()
        # The reads go out in groups, each with one descriptor held per shard: the whole
        # batch while its shards fit in the pool with one to spare (it closes only
        # descriptors no read of the group used more recently), else a member at a time.
        group = max(1, len(targets)) if len(set(shards)) < self.pool.max_open else 1
        clock = time.perf_counter_ns
        started = clock()
        # By staged (a copy) or not (the source): reads, their bytes, how long each took.
        reads = {False: 0, True: 0}
        read_bytes = {False: 0, True: 0}
        took: dict[bool, list[int]] = {False: [], True: []}
        for lo in range(0, len(targets), group):
            self._read_group(
                range(lo, min(lo + group, len(targets))),
                (rows_list, shards, samples, targets, offsets, digests),
                verify,
                (reads, read_bytes, took),
            )
        for staged, count in reads.items():
            if count:
                self.metrics.record_reads(staged, count, read_bytes[staged], took[staged])
        # The reads' own times where they were taken: the batch's wall time also holds the
        # hand-offs and whatever else the node ran meanwhile.
        spent = sum(took[False]) + sum(took[True]) if self.timed else clock() - started
        self.note_pace(spent, len(targets), read_bytes[False] + read_bytes[True])

    def note_pace(self, took_ns: int, members: int, nbytes: int) -> None:
        """Set :attr:`reads_cached` from how long a batch's reads took (``took_ns``, the
        sum of its reads' times)."""
        per_member_ns, bytes_per_ns = self._cached_pace
        self.reads_cached = took_ns < members * per_member_ns + nbytes / bytes_per_ns

    def _read_group(
        self,
        ks: range,
        batch: tuple[
            list[int], Sequence[int], Sequence[int], Sequence[memoryview], list[int], list[int]
        ],
        verify: bool,
        counts: tuple[dict[bool, int], dict[bool, int], dict[bool, list[int]]],
    ) -> None:
        """Read members ``ks`` of a batch (its rows, shards, samples, targets, offsets and
        checksums) with one :func:`read_many`, then judge each; a failure goes the careful
        way (:meth:`_settle`). ``counts``: reads, bytes and times by staged, added to."""
        rows, shards, samples, targets, offsets, digests = batch
        reads, read_bytes, took = counts
        where: dict[int, tuple[Location, int] | OSError] = {}
        ats: list[tuple[Location, int] | OSError] = []
        for k in ks:
            shard = shards[k]
            at = where.get(shard)
            if at is None:
                try:
                    self.index.check_shard(shard)
                    loc = self._where(shard)
                    at = (loc, self.pool.fd(loc.path, staged=loc.staged))
                except OSError as exc:
                    at = exc
                where[shard] = at
            ats.append(at)
        times: list[int] | None = [] if self.timed else None
        began = time.perf_counter_ns()
        opened = [i for i, at in enumerate(ats) if not isinstance(at, OSError)]
        # Each member is hashed as soon as it is read, while it is in the CPU's cache, by
        # the thread that read it; judged below. ``problems``: the actual digest of a member
        # that failed its check (as member_digest_problem gives it), None once it passed,
        # _NOT_CHECKED before.
        problems: list[int | None] = [_NOT_CHECKED if verify else None] * len(ats)
        first_k = ks.start  # ks: a range of step 1

        def judge_all(j: int, actual: int) -> None:  # every shard opened: read j is ks[j]
            problems[j] = digest_problem(actual, digests[first_k + j])

        def judge_opened(j: int, actual: int) -> None:
            i = opened[j]
            problems[i] = digest_problem(actual, digests[first_k + i])

        outcomes: list[ReadOutcome]
        if len(opened) == len(ats):  # the usual case: every shard opened
            read_targets = [targets[k] for k in ks]
            outcomes = read_many(
                self.opener,
                [(at[1], offsets[k], targets[k]) for k, at in zip(ks, ats, strict=True)],  # type: ignore[index]
                times,
                MemberHashes(read_targets, judge_all) if verify else None,
            )
        else:
            read_targets = [targets[ks[i]] for i in opened]
            some = read_many(
                self.opener,
                [(ats[i][1], offsets[ks[i]], targets[ks[i]]) for i in opened],  # type: ignore[index]
                times,
                MemberHashes(read_targets, judge_opened) if verify else None,
            )
            outcomes = [None] * len(ats)
            spent = [0] * len(ats)
            for j, i in enumerate(opened):
                outcomes[i] = some[j]
                spent[i] = times[j] if times is not None else 0
            times = spent if times is not None else None
        for got in outcomes:
            if isinstance(got, AbandonedBufferError):
                # Its target may still be written when the read returns: none of these
                # targets' bytes may be handed out; the caller reads them again into fresh
                # buffers (the file is held now: its reads fail at once then).
                self.metrics.record_stall(got.waited_s)
                raise got
        failed = False
        for i, (k, at, got) in enumerate(zip(ks, ats, outcomes, strict=True)):
            target = targets[k]
            if got == len(target) and problems[i] is None:
                staged = at[0].staged  # type: ignore[index]
                reads[staged] += 1
                read_bytes[staged] += got
                if times is not None:
                    took[staged].append(times[i])
                continue
            # Anything else goes the careful way, judged as one read would be (a shard that
            # could not be opened is located again: that tells an evicted copy; a read not
            # attempted after a stall is made again, and refused at once if its file is held).
            # Only the first failure is judged from its read: the recovery may close and
            # reopen descriptors, so the later ones are read again.
            first = None
            if not failed and not isinstance(at, OSError) and got is not None:
                first = (at[0], at[1], got, began)
            failed = True
            self._settle(
                rows[k], offsets[k], digests[k], target, shards[k], samples[k], verify, first
            )

    def _settle(  # noqa: PLR0917 - one call shape, private
        self,
        member: int,
        offset: int,
        expected: int,
        target: memoryview,
        shard: int,
        sample: int | None,
        verify: bool,
        first: tuple[Location, int, int | OSError, int] | None,
    ) -> None:
        """Read one member until it is right: the staged copy, a fresh copy, the source.

        ``first``: a read already made (location, descriptor, bytes read, start time) to
        judge before reading again.
        """
        for _attempt in range(3):  # staged copy, a fresh copy, the source
            if first is not None:
                loc, fd, got, began = first
                first = None
                problem, error, identity = self._judge(
                    loc, fd, got, target, expected, verify=verify, began=began
                )
            else:
                loc = self._where(shard)
                problem, error, identity = self._read_at(
                    loc, offset, expected, target, verify=verify, shard=shard
                )
            if problem is None:
                return
            if problem == EVICTED:
                continue
            if not loc.staged:
                raise self._source_error(problem, error, loc.path, shard, member, sample, target)
            try:
                self._recover_copy(shard, problem, identity)
            finally:
                self.pool.discard(loc.path)
        raise self._source_error(  # pragma: no cover - the source is read by the third try
            "unreadable", None, self.resolver.source_path(shard), shard, member, sample, target
        )

    def _recover_copy(self, shard: int, problem: str, identity: tuple[int, int]) -> None:
        """A staged copy failed: stage it again when allowed, else drop it for the source."""
        rel = self.manifest.shards[shard].path
        if self.restage and self.resolver.can_restage():
            try:
                outcome = self.resolver.restage(shard, identity)
            except ShardioError as exc:
                failed = {"event": "restage_failed", "shard": rel, "why": problem}
                self._emit({**failed, "error": str(exc)})
                return
            self._emit({"event": "restage", "shard": rel, "why": problem, "outcome": outcome})
            return
        removed = self.resolver.drop(shard, identity)
        self._emit(
            {
                "event": "drop",
                "shard": rel,
                "why": problem,
                "source": self.resolver.source_path(shard),
                "removed": removed,
            }
        )

    def _emit(self, event: Event) -> None:
        emit_event(event, self.on_event)

    def _source_error(  # noqa: PLR0917 - one call shape, private
        self,
        problem: str,
        error: OSError | None,
        path: str,
        shard: int,
        member: int,
        sample: int | None,
        target: memoryview,
    ) -> StorageError:
        """The error for a member that failed in the source, naming the sample it is of."""
        if sample is None:
            sample = self._sample_of(member)
        failure = member_read_error(
            self.index,
            problem,
            error,
            path=path,
            shard_name=self.manifest.shards[shard].path,
            member=member,
            sample=sample,
            bytes_read=target,
        )
        failure.sample_index = sample
        return failure

    def member_view(
        self, member: int, *, shard: int, sample: int | None = None, verify: bool = True
    ) -> tuple[str, memoryview]:
        """Map a member without copying it: return (shard path, view of its bytes), checked.

        For the opt-in mapped transport only: the view lies in this process's mapping of the
        shard file, and a file truncated or unreadable later raises SIGBUS when a page is
        touched. The default path (:meth:`read_member_into`) reads with pread.

        Raises:
            ChecksumMismatchError: the bytes differ from the index (in the source; a bad
                staged copy is dropped and the source mapped instead).
            StorageError: the shard is missing or short.
        """
        self.index.check_shard(shard)
        rec = self.index.members[member]
        off, size = int(rec["offset"]), int(rec["size"])
        for _attempt in range(2):
            loc = self.resolver.locate(shard)
            problem: str | None = None
            error: OSError | None = None
            began = time.perf_counter_ns() if self.timed else 0
            try:
                view = self.maps.view(loc.path)
            except OSError as exc:
                if self._was_evicted(loc, exc, shard):
                    continue
                if isinstance(exc, ReadStalledError):
                    self.metrics.record_stall(exc.waited_s)
                problem, error, view = f"unreadable: {exc.strerror or exc}", exc, memoryview(b"")
            if problem is None and off + size > len(view):
                problem = "truncated"
            elif (
                problem is None
                and verify
                and member_digest_problem(view[off : off + size], int(rec["xxh3_64"]))
            ):
                problem = "checksum mismatch"
            if problem is None:
                took = time.perf_counter_ns() - began if self.timed else None
                self.metrics.record_read(loc.staged, size, took)
                return loc.path, view[off : off + size]
            self.metrics.add(_failure_counter(problem))
            self.maps.discard(loc.path)
            if not loc.staged:
                data = memoryview(bytes(view[off : min(off + size, len(view))]))
                raise self._source_error(problem, error, loc.path, shard, member, sample, data)
            self.resolver.drop(shard, NOT_OPENED)
            self._emit({"event": "drop", "shard": self.manifest.shards[shard].path, "why": problem})
        raise StorageError(errno.EIO, f"cannot map shard {shard}")  # pragma: no cover

    def read_member(
        self, member: int, *, shard: int, sample: int | None = None, verify: bool = True
    ) -> bytes:
        """Return one member's bytes (see :meth:`read_member_into`).

        The size comes from checked records: it lies inside the shard's size in the manifest.
        """
        self.index.check_shard(shard)
        buf = bytearray(int(self.index.members[member]["size"]))
        self.read_member_into(member, memoryview(buf), shard=shard, sample=sample, verify=verify)
        return bytes(buf)

    def _sample_of(self, member: int) -> int:
        return int(np.searchsorted(self.index.samples["first_member"], member, side="right") - 1)

    def read_sample(self, sample: int, *, verify: bool = True) -> dict[str, Any]:
        """Return a sample in the WebDataset convention: ``__key__`` and bytes per extension.

        The label member ``cls`` is returned as an int.
        """
        rec = self.index.records([sample])[0]
        shard = int(rec["shard"])
        out: dict[str, Any] = {"__key__": self.index.key(sample)}
        self.metrics.add("samples")
        exts = self.index.exts
        for m in self.index.sample_member_range(sample):
            ext = exts[int(self.index.members[m]["ext_id"])]
            data = self.read_member(m, shard=shard, sample=sample, verify=verify)
            synthesised = int(self.index.members[m]["path_length"]) == 0
            out[ext] = int(data) if ext == LABEL_EXT and synthesised else data
        return out

    def close(self) -> None:
        """Close shard files and the index mapping (and free the copies of shards rebuilt
        from parity outside a read-only dataset)."""
        self.pool.close()
        self.maps.close()
        self.index.close()
        self.resolver.close()
