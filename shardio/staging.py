"""Stage shards from the parallel filesystem to node-local storage (NVMe, BeeOND), verified.

``stage_dataset`` copies the shards a node will read, in the order training first needs
them, with parallel copy streams. Each copy is hashed while it is written and published
under its final name only when its xxh3-128 matches the manifest. A per-shard ``flock`` on
the local filesystem makes it safe for every rank of a node to run it at once (each shard is
copied once; the others wait, then find it done); the kernel drops the lock of a killed
process, so stale locks recover by themselves. A rerun copies only what is missing or bad.

Layout of the destination::

    DEST/manifest.json            the source's manifest plus "staged_from" (the source path)
    DEST/index.bin                copy of the source index
    DEST/shards/...               staged shards, same relative names as in the source
    DEST/.shardio-stage/locks/    one lock file per shard
    DEST/.shardio-stage/ok/       one stamp per verified shard (size, inode, ctime, xxh3)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import xxhash

from shardio.errors import IntegrityError, StorageError, UsageError
from shardio.format.checksum import file_xxh3_128
from shardio.format.manifest import Manifest, ShardEntry, load_manifest
from shardio.format.spec import MANIFEST_FILENAME
from shardio.progress import Counters, ProgressCallback, ProgressThread
from shardio.runtime.order import check_order, epoch_order, rank_positions
from shardio.storage.atomic import (
    TEMP_MARK,
    atomic_write,
    create_temp,
    publish,
    storage_error,
    temp_path_for,
)
from shardio.storage.stamps import STAGE_DIR, drop_staged, stamp_matches, write_stamp

__all__ = [
    "StageOptions",
    "StageResult",
    "clean_stage",
    "node_shard_order",
    "stage_dataset",
]

logger = logging.getLogger(__name__)

_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """What to stage and how.

    Attributes:
        node: this node's number (0-based), of ``num_nodes``.
        num_nodes: nodes of the job; 1 stages every shard.
        ranks_per_node: training ranks per node (the rank layout decides which shards a
            node reads first).
        seed, epoch, order, window_shards, drop_last: as given to ShardDataset, so the
            stager computes the same order as training.
        streams: parallel copy streams.
        capacity_bytes: stage at most this many bytes (the shards needed first); None: all.
        durable: fsync each copy before publishing it. Off by default: a staging area is a
            job-scoped cache, a kill -9 cannot expose a half-written copy (temp name, then
            rename), and every read verifies each member and falls back to the source, which
            also covers a copy damaged by a node crash.
    """

    node: int = 0
    num_nodes: int = 1
    ranks_per_node: int = 1
    seed: int = 0
    epoch: int = 0
    order: str = "shard-local"
    window_shards: int = 4
    drop_last: bool = False
    streams: int = 4
    capacity_bytes: int | None = None
    durable: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.node < self.num_nodes:
            raise UsageError(f"invalid node {self.node}/{self.num_nodes}: need 0 <= I < N")
        if self.ranks_per_node < 1 or self.streams < 1:
            raise UsageError("ranks per node and copy streams must be at least 1")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise UsageError("capacity must be positive")
        check_order(self.order)


@dataclass(frozen=True)
class StageResult:
    """What a stage run did."""

    dest: str
    shards_needed: int
    copied: int
    present: int
    replaced: int
    from_source: tuple[str, ...]
    bytes_copied: int
    bytes_staged: int
    seconds: float
    evicted: tuple[str, ...] = field(default_factory=tuple)


def node_shard_order(manifest: Manifest, options: StageOptions) -> list[int]:
    """The shards this node's ranks read in the epoch, in the order they first need them.

    Uses the same order and rank split as ShardDataset (epoch_order + rank_positions), with
    global rank = node * ranks_per_node + local rank.
    """
    # Imported here: stage_dataset runs this beside its first I/O, so that numpy's import
    # (a good part of a cold start) overlaps the copy of the index.
    import numpy as np

    sizes = np.array([s.num_samples for s in manifest.shards], dtype=np.int64)
    order = epoch_order(
        shard_sizes=sizes,
        seed=options.seed,
        epoch=options.epoch,
        order=options.order,
        window_shards=options.window_shards,
    )
    world = options.num_nodes * options.ranks_per_node
    first = options.node * options.ranks_per_node
    per_rank = [
        rank_positions(order, consumed=0, rank=r, world_size=world, drop_last=options.drop_last)
        for r in range(first, first + options.ranks_per_node)
    ]
    steps = np.stack(per_rank).T.ravel()  # time order: step 0 of every rank, then step 1, ...
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    shards = shard_of[steps]
    _, first_seen = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in sorted(first_seen)]


@contextlib.contextmanager
def _shard_lock(dest: str, rel: str) -> Iterator[None]:
    path = os.path.join(dest, STAGE_DIR, "locks", rel.replace("/", "__") + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another rank copies this shard
        yield
    finally:
        os.close(fd)  # releases the lock; a killed holder's lock goes with its process


def _copy_range(fin: int, fout: int, counters: Counters) -> int:
    """Copy a whole file inside the kernel (copy_file_range, else sendfile, else read/write)."""
    total = 0
    for copy in (os.copy_file_range, _sendfile):
        try:
            while True:
                n = copy(fin, fout, _CHUNK)
                if n == 0:
                    return total
                total += n
                counters.add(0, n)
        except OSError as exc:
            if total or exc.errno not in (
                errno.EXDEV,
                errno.ENOSYS,
                errno.EINVAL,
                errno.EOPNOTSUPP,
            ):
                raise
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = os.readv(fin, [buf])
        if n == 0:
            return total
        written = 0
        while written < n:
            written += os.write(fout, view[written:n])
        total += n
        counters.add(0, n)


def _sendfile(fin: int, fout: int, count: int) -> int:
    return os.sendfile(fout, fin, None, count)


def _hash_file(fd: int) -> str:
    """xxh3-128 of an open file through a mapping (its pages are hashed where they lie)."""
    hasher = xxhash.xxh3_128()
    if os.fstat(fd).st_size:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for pos in range(0, len(view), _CHUNK):
                    hasher.update(view[pos : pos + _CHUNK])
            finally:
                view.release()
    return hasher.hexdigest()


def _copy_verified(src: str, dst: str, expected: str, *, durable: bool, counters: Counters) -> int:
    """Copy src to a temp file in the kernel, hash the copy's own bytes, publish if it matches.

    The copy is hashed after it is written (its pages are still in the page cache), so what is
    checked is what will be read, not the source.
    """
    tmp = temp_path_for(dst)
    try:
        fin = os.open(src, os.O_RDONLY)
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot read source shard {src}: {exc.strerror}") from exc
    try:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        fout = create_temp(tmp, readable=True)
        try:
            total = _copy_range(fin, fout, counters)
            actual = _hash_file(fout)
        finally:
            os.close(fout)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise storage_error(exc, dst, "staging") from exc
    finally:
        os.close(fin)
    if actual != expected:
        os.unlink(tmp)
        raise IntegrityError(
            errno.EIO,
            f"source shard {src} does not match its manifest checksum "
            f"(expected {expected}, got {actual}): run shardio verify on the source",
        )
    publish(tmp, dst, durable=durable)
    return total


def _sync_small_file(src: str, dst: str, durable: bool) -> None:
    """Make dst a copy of a small file (no checksum in the manifest: compare the bytes)."""
    with open(src, "rb") as fh:
        data = fh.read()
    with contextlib.suppress(FileNotFoundError), open(dst, "rb") as fh:
        if fh.read() == data:
            return
    with atomic_write(dst, durable=durable) as out:
        out.write(data)


def _remove_temps_of(final: str) -> None:
    folder, name = os.path.split(final)
    prefix = f".{name}{TEMP_MARK}"
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(folder):
            if entry.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, entry))


def _stage_one(
    src_root: str, dest: str, entry: ShardEntry, *, durable: bool, counters: Counters
) -> tuple[str, str, int]:
    """Stage one shard (and its DALI index) under its lock; return (rel, outcome, bytes)."""
    rel, expected = entry.path, entry.xxh3_128
    final = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with _shard_lock(dest, rel):
        _remove_temps_of(final)  # a killed run's partial copy; the lock excludes live ones
        outcome, copied = "present", 0
        if not stamp_matches(dest, rel, expected):
            if os.path.exists(final) and file_xxh3_128(final) == expected:
                write_stamp(dest, rel, expected, durable)  # a verified copy without a stamp
            else:
                outcome = "copied"
                if os.path.exists(final):
                    logger.warning("staged copy %s is damaged: copying it again", final)
                    drop_staged(dest, rel)
                    outcome = "replaced"
                copied = _copy_verified(
                    os.path.join(src_root, rel),
                    final,
                    expected,
                    durable=durable,
                    counters=counters,
                )
                write_stamp(dest, rel, expected, durable)
        if entry.dali_index is not None:  # DALI's reader wants the .idx beside the staged tar
            _sync_small_file(
                os.path.join(src_root, entry.dali_index),
                os.path.join(dest, entry.dali_index),
                durable,
            )
    counters.add(1, 0)
    return rel, outcome, copied


def _write_local_metadata(src_root: str, dest: str, manifest: Manifest, durable: bool) -> None:
    """Copy the index (verified) and write DEST's manifest, which names the source."""
    index_dst = os.path.join(dest, manifest.index.path)
    if not (os.path.exists(index_dst) and file_xxh3_128(index_dst) == manifest.index.xxh3_128):
        _copy_verified(
            os.path.join(src_root, manifest.index.path),
            index_dst,
            manifest.index.xxh3_128,
            durable=durable,
            counters=Counters(shared=False),
        )
    data = dataclasses.replace(manifest, staged_from=os.path.abspath(src_root)).dumps()
    target = os.path.join(dest, MANIFEST_FILENAME)
    with contextlib.suppress(FileNotFoundError), open(target, "rb") as fh:
        if fh.read() == data:
            return
    with atomic_write(target, durable=durable) as fh:
        fh.write(data)


def _evict_for(
    dest: str, manifest: Manifest, keep: set[str], need_bytes: int, capacity: int
) -> list[str]:
    """Remove staged shards not needed now while DEST would exceed ``capacity`` with the
    ``need_bytes`` of the kept ones; oldest first, skipping any a reader holds open."""
    staged = []
    for s in manifest.shards:
        path = os.path.join(dest, s.path)
        if s.path not in keep and os.path.exists(path):
            staged.append((os.path.getmtime(path), s))
    used = sum(s.size_bytes for _, s in staged)  # the kept shards are in need_bytes
    evicted = []
    for _, entry in sorted(staged, key=lambda t: (t[0], t[1].path)):
        if used + need_bytes <= capacity:
            break
        path = os.path.join(dest, entry.path)
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # readers hold LOCK_SH
            except BlockingIOError:
                continue
            drop_staged(dest, entry.path)
            if entry.dali_index is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dest, entry.dali_index))
        finally:
            os.close(fd)
        used -= entry.size_bytes
        evicted.append(entry.path)
    return evicted


def stage_dataset(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    options: StageOptions,
    *,
    progress: ProgressCallback | None = None,
) -> StageResult:
    """Stage this node's shards of the dataset at ``src`` into ``dest``.

    Raises:
        FormatError: src holds no valid manifest.
        UsageError: dest is inside src or the same directory.
        IntegrityError: a source shard does not match its checksum.
        StorageError: copying failed (ENOSPC included); published copies stay valid.
    """
    start = time.monotonic()
    src_root, dest_root = os.fspath(src), os.fspath(dest)
    manifest = load_manifest(os.path.join(src_root, MANIFEST_FILENAME))
    real_src, real_dest = os.path.realpath(src_root), os.path.realpath(dest_root)
    if real_src == real_dest or real_dest.startswith(real_src.rstrip(os.sep) + os.sep):
        raise UsageError(f"stage destination {dest_root} must be outside the source {src_root}")
    dest_manifest = os.path.join(dest_root, MANIFEST_FILENAME)
    if os.path.exists(dest_manifest) and load_manifest(dest_manifest).staged_from is None:
        raise UsageError(
            f"{dest_root} holds a packed dataset, not a staging area: refusing to stage into it"
        )
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=options.streams, thread_name_prefix="shardio-stage"
    ) as pool:
        # The order needs numpy, whose import is a good part of a cold start: it is
        # computed beside the copy of the index.
        order = pool.submit(node_shard_order, manifest, options)
        for sub in ("locks", "ok"):
            os.makedirs(os.path.join(dest_root, STAGE_DIR, sub), exist_ok=True)
        _write_local_metadata(src_root, dest_root, manifest, options.durable)
        needed = order.result()
        chosen, from_source, budget = [], [], options.capacity_bytes
        for shard in needed:
            entry = manifest.shards[shard]
            if budget is not None and entry.size_bytes > budget:
                from_source.append(entry.path)
                budget = 0
                continue
            chosen.append(entry)
            if budget is not None:
                budget -= entry.size_bytes
        evicted: list[str] = []
        if options.capacity_bytes is not None:
            evicted = _evict_for(
                dest_root,
                manifest,
                {e.path for e in chosen},
                sum(e.size_bytes for e in chosen),
                options.capacity_bytes,
            )
        counters = Counters(shared=False)
        tracker = (
            ProgressThread(
                counters,
                progress,
                files_total=len(chosen),
                bytes_total=sum(e.size_bytes for e in chosen),
            )
            if progress is not None
            else contextlib.nullcontext()
        )
        with tracker:
            futures = [
                pool.submit(
                    _stage_one,
                    src_root,
                    dest_root,
                    e,
                    durable=options.durable,
                    counters=counters,
                )
                for e in chosen
            ]
            try:
                outcomes = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    if from_source:
        logger.warning(
            "%d shard(s) exceed --capacity and will be read from %s", len(from_source), src_root
        )
    return StageResult(
        dest=dest_root,
        shards_needed=len(needed),
        copied=sum(1 for _, o, _ in outcomes if o == "copied"),
        present=sum(1 for _, o, _ in outcomes if o == "present"),
        replaced=sum(1 for _, o, _ in outcomes if o == "replaced"),
        from_source=tuple(from_source),
        bytes_copied=sum(n for _, _, n in outcomes),
        bytes_staged=sum(e.size_bytes for e in chosen),
        seconds=time.monotonic() - start,
        evicted=tuple(evicted),
    )


def clean_stage(dest: str | os.PathLike[str]) -> int:
    """Remove what staging put in ``dest`` (epilogue); return the number of shards removed.

    Only files named by DEST's staged manifest and shardio's own metadata are removed.
    """
    dest_root = os.fspath(dest)
    manifest_path = os.path.join(dest_root, MANIFEST_FILENAME)
    if not os.path.exists(manifest_path):
        if os.path.isdir(os.path.join(dest_root, STAGE_DIR)):
            shutil.rmtree(os.path.join(dest_root, STAGE_DIR))
            return 0
        raise UsageError(f"{dest_root} holds no staged dataset")
    manifest = load_manifest(manifest_path)
    if manifest.staged_from is None:
        raise UsageError(f"{dest_root} is a packed dataset, not a staging area: refusing to clean")
    os.unlink(manifest_path)  # first, so nothing reads a half-removed cache
    removed = 0
    for s in manifest.shards:
        path = os.path.join(dest_root, s.path)
        _remove_temps_of(path)
        if os.path.exists(path):
            os.unlink(path)
            removed += 1
        if s.dali_index is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dest_root, s.dali_index))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(dest_root, manifest.index.path))
    shutil.rmtree(os.path.join(dest_root, STAGE_DIR), ignore_errors=True)
    for sub in sorted({os.path.dirname(s.path) for s in manifest.shards}, reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(dest_root, sub))
    return removed
