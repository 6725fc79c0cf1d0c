"""Write one planned shard: read its files ahead, hand them to the writer, record it as done.

Small files are read whole by a few reader threads, ahead of the writer; a file above the
stream threshold is copied by the writer itself in chunks, so a file larger than RAM packs.
A file that cannot be read or whose size changed since it was planned is skipped (reported
in the pack report) or, under ``--strict``, fails the pack. A shard is done once its
done-record is published; ``--resume`` reuses it if every checksum still matches.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import io
import itertools
import logging
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from shardio.errors import PackError, ShardioError, StorageError
from shardio.format.checksum import file_xxh3_128, member_xxh3_64
from shardio.format.index_write import IndexBuilder, MemberEntry
from shardio.format.spec import LABEL_EXT
from shardio.metrics.progress import Counters
from shardio.packing.calls import SourceCalls
from shardio.packing.plan import ShardPlan, shard_paths
from shardio.packing.scan import PlannedFile, PlannedSample, Skipped
from shardio.packing.workfiles import (
    ShardRecord,
    done_path,
    fragment_path,
    load_record,
    write_record,
)
from shardio.storage.atomic import atomic_write
from shardio.storage.files import open_regular
from shardio.writers.base import ShardFileWriter, SourceChangedError
from shardio.writers.hdf5 import HDF5ShardWriter
from shardio.writers.tar import TarShardWriter, dali_index_text

__all__ = ["STREAM_THRESHOLD_BYTES", "ShardJob", "init_worker", "reusable", "write_shard"]

logger = logging.getLogger(__name__)

# Files above this size are streamed by the writer instead of read whole ahead of it.
STREAM_THRESHOLD_BYTES = 16 * 1024 * 1024
# Source files read ahead of the shard writer, per worker process.
_READ_THREADS = 4
_READ_AHEAD = 8  # samples: keep what was read in the CPU cache for hashing and the write
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker process needs to write one shard."""

    src: str
    dst: str
    plan: ShardPlan
    shard_format: str
    labelled: bool
    strict: bool
    durable: bool
    alignment: int
    fingerprint: str
    stream_threshold_bytes: int = STREAM_THRESHOLD_BYTES


_WORKER_COUNTERS: Counters | None = None


def init_worker(counters: Counters) -> None:
    """Pool initializer: keep the progress counters (the pool's own initializer stops the
    worker if the packing process dies)."""
    global _WORKER_COUNTERS  # noqa: PLW0603 - per-process handle set by the pool initializer
    _WORKER_COUNTERS = counters


class _Stream:
    """Marks a file the writer streams itself."""


_STREAM = _Stream()
_Loaded = list[tuple[bytes, int] | str | _Stream]  # (data, xxh3-64), skip reason, or stream


def _read_small(path: bytes, size: int) -> bytes | str:
    """A small file's bytes, or why it cannot be packed.

    No fstat (a metadata round trip per file on a parallel filesystem; the plan stat'ed it
    already): opened ``O_NONBLOCK``, a FIFO or device swapped in since reads short or long,
    and a directory fails its read, so each ends as a size change or an unreadable file.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    try:
        parts, got = [], 0
        while got <= size:  # one byte more than planned tells a grown file
            chunk = os.read(fd, size + 1 - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    finally:
        os.close(fd)
    if got != size:
        found = "more" if got > size else f"{got:,}"
        return f"changed size during the pack (planned {size:,} bytes, found {found})"
    return b"".join(parts)


def _load_files(root: bytes, sample: PlannedSample, threshold: int) -> _Loaded:
    """Read and hash a sample's small files (in a read-ahead thread; os.read drops the GIL)."""
    out: _Loaded = []
    for f in sample.files:
        if f.size > threshold:
            out.append(_STREAM)
            continue
        data = _read_small(os.path.join(root, f.rel), f.size)
        out.append(data if isinstance(data, str) else (data, member_xxh3_64(data)))
    return out


def _prefetch(
    root: bytes, samples: Sequence[PlannedSample], threshold: int
) -> Iterator[tuple[PlannedSample, _Loaded]]:
    """Yield samples with their files read, in order, keeping reads ahead of the writer.

    Several reads in flight hide per-file latency (an open and a read per file cost a
    metadata and a data round trip on a parallel filesystem) behind the shard writes.
    """
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=_READ_THREADS, thread_name_prefix="shardio-read"
    ) as pool:
        pending: collections.deque[tuple[PlannedSample, concurrent.futures.Future[_Loaded]]]
        pending = collections.deque()
        it = iter(samples)
        for sample in itertools.islice(it, _READ_AHEAD):
            pending.append((sample, pool.submit(_load_files, root, sample, threshold)))
        try:
            while pending:
                sample, fut = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(_load_files, root, nxt, threshold)))
                yield sample, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()


def _stream(
    writer: ShardFileWriter, root: bytes, f: PlannedFile, calls: SourceCalls
) -> tuple[int, int, int] | str:
    """Stream one large file into the writer: (offset, size, xxh3-64) or why it was skipped.

    Unlike a small file read whole, it is checked with ``fstat`` once opened
    (:func:`open_regular` refuses anything but a regular file before the writer begins
    the member); the open and the fstat are added to ``calls``.
    """
    calls.opens += 1
    try:
        fd = open_regular(os.path.join(root, f.rel), what="source file")
    except StorageError as exc:
        if exc.errno == errno.EINVAL:  # opened, and its fstat found no regular file
            calls.fstat_calls += 1
        return f"unreadable ({exc})"
    calls.fstat_calls += 1
    try:
        return writer.add_stream(f.ext, f.size, lambda view: os.readv(fd, [view]))
    except SourceChangedError as exc:
        return exc.reason
    finally:
        os.close(fd)


class _Shard:
    """The state of one shard being written."""

    def __init__(self, job: ShardJob, writer: ShardFileWriter) -> None:
        self.job = job
        self.writer = writer
        self.builder = IndexBuilder()
        self.skipped: list[Skipped] = []
        self.data_bytes = 0
        self.num_members = 0
        self.calls = SourceCalls()

    def skip(self, f: PlannedFile, reason: str) -> None:
        name = os.fsdecode(f.rel)
        if self.job.strict:
            raise PackError(f"cannot pack {name}: {reason}")
        logger.warning("skipping %s: %s", name, reason)
        self.skipped.append(Skipped(f.rel, reason))

    def add(self, sample: PlannedSample, loaded: _Loaded, root: bytes) -> None:
        writer = self.writer
        writer.begin_sample(sample.key, sample.label)
        entries: list[MemberEntry] = []
        opened = 0  # small files: each was opened once by a read-ahead thread
        for f, result in zip(sample.files, loaded, strict=True):
            if not isinstance(result, _Stream):
                opened += 1
            if isinstance(result, str):
                self.skip(f, result)
                continue
            if isinstance(result, _Stream):
                streamed = _stream(writer, root, f, self.calls)
                if isinstance(streamed, str):
                    self.skip(f, streamed)
                    continue
                offset, size, digest = streamed
            else:
                data, digest = result
                offset, size = writer.add_member(f.ext, data, digest)
            entries.append(MemberEntry(f.ext, offset, size, digest, f.rel))
            self.data_bytes += size
        self.calls.opens += opened
        if entries and self.job.labelled:
            label = b"%d" % sample.label
            digest = member_xxh3_64(label)
            offset, size = writer.add_member(LABEL_EXT, label, digest)
            entries.append(MemberEntry(LABEL_EXT, offset, size, digest, b""))
        writer.end_sample()
        if entries:
            self.builder.add_sample(shard=0, key=sample.key, label=sample.label, members=entries)
            self.num_members += len(entries)


def _new_writer(job: ShardJob, path: str) -> ShardFileWriter:
    if job.shard_format == "tar":
        return TarShardWriter(path, durable=job.durable)
    plan = job.plan
    label_bytes = 24 * len(plan.samples) if job.labelled else 0
    capacity = sum(f.size for s in plan.samples for f in s.files) + label_bytes
    return HDF5ShardWriter(
        path, capacity_bytes=capacity, alignment=job.alignment, durable=job.durable
    )


class FilledShard(Protocol):
    """What a shard's writer kept while it was filled (pack's ``_Shard``, the ShardWriter's
    ``StagedShard``)."""

    builder: IndexBuilder
    data_bytes: int
    num_members: int


def finish_shard_files(
    shard: FilledShard,
    writer: ShardFileWriter,
    *,
    fingerprint: str,
    seq: int,
    rel_path: str,
    dali_rel: str | None,
    dali_path: str | None,
    fragment: str,
    durable: bool,
    skipped: tuple[Skipped, ...] = (),
    source_calls: SourceCalls | None = None,
) -> ShardRecord:
    """Finish a shard's writer, write its DALI index (tar shards) at ``dali_path`` and its
    index fragment at ``fragment``, and return the shard's record (not yet written).

    Shared by ``shardio pack`` and the public ``ShardWriter``, so both write the same files.
    The writer is aborted (its temp file removed) when finishing it fails.
    """
    try:
        size, digest = writer.finish()
    except BaseException:
        writer.abort()
        raise
    if dali_path is not None and isinstance(writer, TarShardWriter):
        with atomic_write(dali_path, durable=durable) as fh:
            fh.write(dali_index_text(writer.samples))
    buf = io.BytesIO()
    shard.builder.write(buf)
    data = buf.getvalue()
    with atomic_write(fragment, durable=durable) as fh:
        fh.write(data)
    return ShardRecord(
        fingerprint=fingerprint,
        seq=seq,
        path=rel_path,
        size_bytes=size,
        num_samples=shard.builder.num_samples,
        num_members=shard.num_members,
        data_bytes=shard.data_bytes,
        xxh3_128=digest,
        dali_index=dali_rel,
        index_size_bytes=len(data),
        index_xxh3_128=xxhash.xxh3_128_hexdigest(data),
        skipped=skipped,
        source_calls=source_calls if source_calls is not None else SourceCalls(),
    )


def write_shard(job: ShardJob, counters: Counters | None = None) -> ShardRecord:
    """Write one shard, its DALI index, its index fragment and, last, its done-record."""
    counters = counters or _WORKER_COUNTERS
    plan = job.plan
    rel_path, dali_rel = shard_paths(plan.name, job.shard_format)
    root = os.fsencode(job.src)
    shard = _Shard(job, _new_writer(job, os.path.join(job.dst, rel_path)))
    try:
        for sample, loaded in _prefetch(root, plan.samples, job.stream_threshold_bytes):
            shard.add(sample, loaded, root)
            if counters is not None:
                counters.add(len(sample.files), sum(f.size for f in sample.files))
    except BaseException:
        shard.writer.abort()
        raise
    record = finish_shard_files(
        shard,
        shard.writer,
        fingerprint=job.fingerprint,
        seq=plan.seq,
        rel_path=rel_path,
        dali_rel=dali_rel,
        dali_path=None if dali_rel is None else os.path.join(job.dst, dali_rel),
        fragment=fragment_path(job.dst, plan.name),
        durable=job.durable,
        skipped=tuple(shard.skipped),
        source_calls=shard.calls,
    )
    write_record(done_path(job.dst, plan.name), record, durable=job.durable)
    return record


def _regular_size(path: str) -> int | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def reusable(job: ShardJob) -> ShardRecord | None:
    """The done-record of a shard if it and its files are intact, else None (rewrite it).

    A damaged record, a changed plan or any checksum that no longer matches makes the shard
    "not done", so it is written again.
    """
    name = job.plan.name
    path = done_path(job.dst, name)
    if not os.path.lexists(path):
        return None
    try:
        record = load_record(path, ShardRecord)
    except ShardioError as exc:
        logger.warning("%s: writing shard %s again", exc, name)
        return None
    if record.fingerprint != job.fingerprint:
        return None
    rel_path, dali_rel = shard_paths(name, job.shard_format)
    if (record.seq, record.path, record.dali_index) != (job.plan.seq, rel_path, dali_rel):
        logger.warning("done-record %s names other files: writing shard %s again", path, name)
        return None
    shard = os.path.join(job.dst, rel_path)
    fragment = fragment_path(job.dst, name)
    if (
        _regular_size(shard) != record.size_bytes
        or _regular_size(fragment) != record.index_size_bytes
        or (dali_rel is not None and _regular_size(os.path.join(job.dst, dali_rel)) is None)
    ):
        return None
    try:
        if file_xxh3_128(shard, what="shard") != record.xxh3_128:
            logger.warning("shard %s is damaged: writing it again", rel_path)
            return None
        if file_xxh3_128(fragment, what="index fragment") != record.index_xxh3_128:
            logger.warning("index fragment %s is damaged: writing shard %s again", fragment, name)
            return None
    except ShardioError:
        return None
    return record
