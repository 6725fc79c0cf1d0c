"""Verify a dataset: every shard's xxh3-128 and every member's xxh3-64 against the index."""

from __future__ import annotations

import concurrent.futures
import mmap
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import xxhash

from shardio.errors import FormatError, StorageError
from shardio.format.checksum import file_xxh3_128, hex64
from shardio.progress import Counters, ProgressCallback, ProgressThread
from shardio.read.packed import PackedDataset
from shardio.storage.files import open_regular

__all__ = ["BadMember", "ShardProblem", "VerifyReport", "verify_dataset"]


@dataclass(frozen=True)
class BadMember:
    """A member whose bytes do not match the index."""

    key: str
    ext: str
    expected: str
    actual: str


@dataclass(frozen=True)
class ShardProblem:
    """What is wrong with one shard (or the index)."""

    path: str
    reason: str
    bad_members: tuple[BadMember, ...] = ()


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of a verify run."""

    root: str
    quick: bool
    shards_checked: int
    bytes_checked: int
    seconds: float
    problems: tuple[ShardProblem, ...] = field(default_factory=tuple)
    index_path: str = "index.bin"  # the index's path in the manifest (a problem may name it)

    @property
    def ok(self) -> bool:
        """Whether the dataset is intact."""
        return not self.problems

    @property
    def damaged_samples(self) -> tuple[str, ...]:
        """Keys of the samples with at least one bad member."""
        return tuple(dict.fromkeys(b.key for p in self.problems for b in p.bad_members))


_DATASETS: dict[str, PackedDataset] = {}


def _open(root: str) -> PackedDataset:
    ds = _DATASETS.get(root)
    if ds is None:
        ds = _DATASETS[root] = PackedDataset(root)
    return ds


def _verify_shard(root: str, shard: int, quick: bool) -> tuple[ShardProblem | None, int]:
    ds = _open(root)
    entry = ds.manifest.shards[shard]
    path = ds.shard_path(shard)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return ShardProblem(entry.path, "missing"), 0
    except OSError as exc:
        return ShardProblem(entry.path, f"cannot stat: {exc.strerror}"), 0
    reasons = []
    try:
        ds.index.check_shard(shard)
    except FormatError as exc:
        return ShardProblem(entry.path, f"its index records are damaged: {exc}"), 0
    if size != entry.size_bytes:
        reasons.append(f"size {size} bytes, expected {entry.size_bytes}")
    if entry.dali_index and not os.path.exists(os.path.join(root, entry.dali_index)):
        reasons.append(f"DALI index {entry.dali_index} missing")
    if quick or size == 0:
        return (ShardProblem(entry.path, "; ".join(reasons)) if reasons else None), 0
    samples = ds.index.samples[entry.first_sample : entry.first_sample + entry.num_samples]
    bad: list[BadMember] = []
    whole = xxhash.xxh3_128()
    try:
        fd = open_regular(path, what="shard")
    except StorageError as exc:
        return ShardProblem(entry.path, str(exc)), 0
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    with mm:
        mm.madvise(mmap.MADV_SEQUENTIAL)
        view = memoryview(mm)
        pos = 0
        try:
            for i, rec in enumerate(samples):
                first = int(rec["first_member"])
                for m in range(first, first + int(rec["n_members"])):
                    mrec = ds.index.members[m]
                    off, msize = int(mrec["offset"]), int(mrec["size"])
                    if off + msize > size:
                        bad.append(
                            BadMember(
                                ds.key(entry.first_sample + i),
                                ds.index.exts[int(mrec["ext_id"])],
                                hex64(int(mrec["xxh3_64"])),
                                "truncated",
                            )
                        )
                        continue
                    if off >= pos:
                        whole.update(view[pos:off])
                        pos = off + msize
                        whole.update(view[off:pos])
                    actual = xxhash.xxh3_64_intdigest(view[off : off + msize])
                    if actual != int(mrec["xxh3_64"]):
                        bad.append(
                            BadMember(
                                ds.key(entry.first_sample + i),
                                ds.index.exts[int(mrec["ext_id"])],
                                hex64(int(mrec["xxh3_64"])),
                                hex64(actual),
                            )
                        )
            whole.update(view[pos:])
        finally:
            view.release()
    if whole.hexdigest() != entry.xxh3_128:
        if not bad:
            reasons.append("shard checksum mismatch outside sample data (tar headers or padding)")
        else:
            reasons.append(f"{len(bad)} damaged member(s)")
    if reasons or bad:
        return ShardProblem(entry.path, "; ".join(reasons), tuple(bad)), size
    return None, size


def _verify_task(root: str, shard: int, quick: bool) -> tuple[ShardProblem | None, int]:
    result = _verify_shard(root, shard, quick)
    counters = _COUNTERS.get("c")
    if counters is not None:
        counters.add(1, result[1])
    return result


_COUNTERS: dict[str, Counters] = {}


def _init(counters: Counters) -> None:
    _COUNTERS["c"] = counters


def verify_dataset(
    root: str | os.PathLike[str],
    *,
    quick: bool = False,
    workers: int = 1,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Check a dataset against its manifest and index.

    Args:
        root: the dataset directory.
        quick: only check that the index is intact and every shard exists with its size
            (no shard data is read).
        workers: processes hashing shards in parallel.
        progress: called with (shards, bytes) snapshots while running.

    Raises:
        FormatError: the manifest or index cannot be read at all.
    """
    start = time.monotonic()
    root = os.fspath(root)
    ds = PackedDataset(root)
    problems: list[ShardProblem] = []
    try:
        index_entry_path = ds.manifest.index.path
        index_path = os.path.join(root, index_entry_path)
        if file_xxh3_128(index_path) != ds.manifest.index.xxh3_128:
            problems.append(ShardProblem(ds.manifest.index.path, "index checksum mismatch"))
        shards = range(len(ds.manifest.shards))
        counters = Counters()
        _init(counters)
        results: list[tuple[ShardProblem | None, int]] = []
        thread = (
            ProgressThread(
                counters,
                progress,
                files_total=len(shards),
                bytes_total=0 if quick else ds.manifest.total_bytes,
            )
            if progress is not None
            else None
        )
        if thread is not None:
            thread.__enter__()
        try:
            if workers <= 1 or len(shards) <= 1:
                _DATASETS[root] = ds
                results = [_verify_task(root, s, quick) for s in shards]
            else:
                ctx = multiprocessing.get_context("forkserver")
                with concurrent.futures.ProcessPoolExecutor(
                    max_workers=workers, mp_context=ctx, initializer=_init, initargs=(counters,)
                ) as pool:
                    results = list(
                        pool.map(
                            _verify_task,
                            [root] * len(shards),
                            shards,
                            [quick] * len(shards),
                            chunksize=1,
                        )
                    )
        finally:
            _DATASETS.pop(root, None)
            if thread is not None:
                thread.__exit__(None, None, None)
        problems.extend(p for p, _ in results if p is not None)
        checked = sum(n for _, n in results)
    finally:
        ds.close()
    return VerifyReport(
        root,
        quick,
        len(shards),
        checked,
        time.monotonic() - start,
        tuple(problems),
        index_path=index_entry_path,
    )
