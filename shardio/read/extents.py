"""Planned reads for a parallel filesystem: coalesced requests, several in flight.

On a network or parallel filesystem each request pays a round trip to a data server, so a
member read one ``pread`` at a time in the reading thread is latency-bound.
:func:`read_members_planned` (map mode) takes a batch's members sorted by shard and offset,
coalesces neighbours into requests of at most ``request_bytes`` and makes them in
``inflight`` runs at once, each run one hand-off to an I/O thread of the opener
(:func:`~shardio.storage.opener.read_many` with ``parallel``; a deadline opener watches all
its runs from the calling thread). A request of one member is read straight into its target
and hashed by the thread that read it; a coalesced one is read into a scratch buffer and its
members copied out and hashed on the calling thread. A request that fails, comes back short,
or holds a member that fails its check hands the members concerned to
:meth:`ShardReader.read_member_into`, which owns recovery (staged copies, error types,
stalls), so that recovery stays in one place.

Stream mode's read-ahead is :mod:`shardio.read.readahead`'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from shardio.errors import ReadStalledError
from shardio.read.deadline import AbandonedBufferError
from shardio.read.digest import digest_problem, member_digest_problem
from shardio.read.reader import ShardReader
from shardio.read.strategy import ReadStrategy
from shardio.storage.opener import MemberHashes, read_many

__all__ = [
    "Request",
    "plan_requests",
    "read_members_planned",
]


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


# -- map mode: a batch's members read with several requests in flight -------------------------
_Job = tuple[Request, int, "memoryview | None"]  # a request, its descriptor, its member's slice


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
            offs, sizes, gap_bytes=strategy.coalesce_gap_bytes, request_bytes=strategy.request_bytes
        ):
            mapped = Request(start=req.start, end=req.end, items=tuple(ks[i] for i in req.items))
            jobs.append((mapped, fd, targets[mapped.items[0]] if len(mapped.items) == 1 else None))
    # A request of one member is read straight into its target and hashed on the thread that
    # read it, while in the CPU's cache; one of several into a scratch buffer, each member
    # copied out and hashed here (the scratch's own digest, made as every read's is, goes
    # unused). ``strategy.inflight`` runs of requests in file order, each one hand-off to an
    # I/O thread of the opener (a deadline opener's: watched from here).
    scratches = [
        None if into is not None else bytearray(req.end - req.start) for req, _, into in jobs
    ]
    reads = [
        (fd, req.start, into if into is not None else memoryview(scratch))  # type: ignore[arg-type]
        for (req, fd, into), scratch in zip(jobs, scratches, strict=True)
    ]
    digests: dict[int, int] = {}
    hashes = (
        MemberHashes([target for _fd, _off, target in reads], digests.__setitem__)
        if verify
        else None
    )
    took: list[int] = []
    outcomes = read_many(ds.opener, reads, took, hashes, parallel=strategy.inflight)
    for j, ((req, _fd, into), got, scratch) in enumerate(
        zip(jobs, outcomes, scratches, strict=True)
    ):
        spent += took[j]
        direct = into is not None
        if got is None:  # not made: one before it in its run stalled
            later.extend(req.items)
            continue
        if isinstance(got, AbandonedBufferError) and direct:
            # Read straight into the caller's buffer, which that read may still write: the
            # caller reads the batch again into a fresh one (a scratch buffer of this call
            # is only given up: the I/O thread keeps it until the read returns).
            ds.metrics.record_stall(got.waited_s)
            raise got
        if isinstance(got, OSError):
            if isinstance(got, ReadStalledError) and got.waited_s > 0:
                # Counted here: the fallback read of its members is refused at once (the
                # file is held), which counts as a held fail, not as the stall.
                ds.metrics.record_stall(got.waited_s)
            fallback.extend(req.items)
            continue
        timed = took[j] if ds.timed else None
        for k in req.items:
            target = targets[k]
            expected = int(members[rows[k]]["xxh3_64"])
            if direct:
                if got != len(target):
                    fallback.append(k)
                    continue
                if hashes is not None:  # hashed by the thread that read it
                    actual = digests.get(j)
                    bad = actual is None or digest_problem(actual, expected) is not None
                else:
                    bad = verify and member_digest_problem(target, expected) is not None
            else:
                rel = int(members[rows[k]]["offset"]) - req.start
                if rel + len(target) > got:
                    fallback.append(k)
                    continue
                target[:] = scratch[rel : rel + len(target)]  # type: ignore[index]
                # Hashed here, once the bytes lie in the final buffer.
                bad = verify and member_digest_problem(target, expected) is not None
            if bad:
                fallback.append(k)
                continue
            ds.metrics.record_read(False, len(target), timed)
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
