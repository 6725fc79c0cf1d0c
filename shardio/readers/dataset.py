"""Open a packed dataset (manifest + memory-mapped index) and read members with pread."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardio.cache.stamps import drop_staged, stamp_matches
from shardio.errors import ChecksumMismatchError, FormatError, StorageError
from shardio.format.checksum import hex64, member_xxh3_64
from shardio.format.index import Index
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import LABEL_EXT, MANIFEST_FILENAME
from shardio.readers.mapcache import MapCache
from shardio.storage.files import open_for_pread

__all__ = ["FilePool", "PackedDataset"]

logger = logging.getLogger(__name__)

# Ranges closer than this are advised as one (reading a tar header between two members
# costs less than another request).
_ADVISE_GAP = 128 * 1024


class FilePool:
    """Open read-only file descriptors, at most ``max_open`` at a time (least recently used
    is closed first). Opens lazily, so it can be created before a fork and used after."""

    def __init__(self, max_open: int = 64) -> None:
        self.max_open = max_open
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._pid = os.getpid()
        self.opens = 0

    def fd(self, path: str, *, shared_lock: bool = False) -> int:
        """Return an open descriptor for ``path``.

        Args:
            path: the file.
            shared_lock: hold a shared ``flock`` while open (staged copies: eviction takes
                the exclusive lock and skips files being read).
        """
        if self._pid != os.getpid():
            # Descriptors inherited over fork are this process's copies: close them and
            # start afresh (pread keeps no offset, but each process owns its pool).
            for inherited in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(inherited)
            self._fds.clear()
            self._pid = os.getpid()
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        # A staged copy (shared_lock) is a file shardio wrote: never read one through a symlink.
        # No fstat: a FIFO or directory fails its pread instead (storage.files.open_for_pread).
        fd = open_for_pread(path, what="shard", nofollow=shared_lock)
        if shared_lock:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError as exc:
                os.close(fd)
                raise StorageError(exc.errno, f"cannot lock shard {path}: {exc.strerror}") from exc
        self.opens += 1
        self._fds[path] = fd
        if len(self._fds) > self.max_open:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def discard(self, path: str) -> None:
        """Close the descriptor of ``path`` if open (after the file was replaced)."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every descriptor."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds.clear()


class PackedDataset:
    """A dataset written by ``shardio pack``.

    Reads a shard from a staging cache when a verified copy is there, else from the source
    (a read-through cache): ``PackedDataset(SRC, cache=DEST)``, or ``PackedDataset(DEST)``
    for a staging area, whose manifest names its source. A cached copy that fails its
    checksum on read is dropped and the member is read again from the source.

    Args:
        root: the dataset directory (holding manifest.json), or a staging area.
        max_open: bound on shard files held open at once.
        cache: a staging area (``shardio stage``) to read verified copies from.

    Attributes:
        cache_stats: per-process counts: ``hits``/``misses`` (shards opened from the cache /
            the source), ``bytes_cache``/``bytes_source``, ``dropped`` (bad cached copies).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_open: int = 64,
        cache: str | os.PathLike[str] | None = None,
    ) -> None:
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            what = "is not a directory" if os.path.lexists(self.root) else "no such directory"
            raise FormatError(f"{self.root}: {what} (a dataset is a directory with a manifest)")
        self.manifest: Manifest = load_manifest(os.path.join(self.root, MANIFEST_FILENAME))
        # Bound to the manifest: header checked now, each shard's records on first use.
        self.index = Index.open(
            os.path.join(self.root, self.manifest.index.path), manifest=self.manifest
        )
        source = self.manifest.staged_from or self.root
        self.cache_root = (
            os.fspath(cache)
            if cache is not None
            else (self.root if self.manifest.staged_from else None)
        )
        self._source_paths = [os.path.join(source, s.path) for s in self.manifest.shards]
        self._resolved: dict[int, str] = {}
        self._cached_shards: set[int] = set()
        self._resolved_pid = os.getpid()
        self.cache_stats = {
            "hits": 0,
            "misses": 0,
            "bytes_cache": 0,
            "bytes_source": 0,
            "dropped": 0,
        }
        self.pool = FilePool(max_open)
        self.maps = MapCache()

    def __len__(self) -> int:
        return len(self.index)

    def __enter__(self) -> PackedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shard_path(self, shard: int) -> str:
        """Path shard ``shard`` is read from: its verified cached copy, else the source."""
        if self.cache_root is None:
            return self._source_paths[shard]
        if self._resolved_pid != os.getpid():
            self._resolved.clear()
            self._cached_shards.clear()
            self._resolved_pid = os.getpid()
        path = self._resolved.get(shard)
        if path is None:
            entry = self.manifest.shards[shard]
            if stamp_matches(self.cache_root, entry.path, entry.xxh3_128):
                path = os.path.join(self.cache_root, entry.path)
                self._cached_shards.add(shard)
                self.cache_stats["hits"] += 1
            else:
                path = self._source_paths[shard]
                self.cache_stats["misses"] += 1
            self._resolved[shard] = path
        return path

    def key(self, sample: int) -> str:
        """Key of a sample."""
        return self.index.key(sample)

    def advise(self, samples: Sequence[int]) -> None:
        """Tell the kernel these samples will be read soon (``POSIX_FADV_WILLNEED``).

        Reads of a batch then go to the device (or the parallel filesystem) together instead
        of one synchronous pread at a time; nearby ranges are merged first.
        """
        if len(samples) == 0:
            return
        recs = self.index.records(samples)
        counts = recs["n_members"].astype(np.int64)
        total = int(counts.sum())
        starts = np.cumsum(counts) - counts
        rows = np.repeat(recs["first_member"].astype(np.int64), counts) + (
            np.arange(total) - np.repeat(starts, counts)
        )
        shards = np.repeat(recs["shard"].astype(np.int64), counts)
        offsets = self.index.members["offset"][rows].astype(np.int64)
        ends = offsets + self.index.members["size"][rows].astype(np.int64)
        order = np.lexsort((offsets, shards))
        cur_shard, cur_lo, cur_hi = -1, 0, 0
        for k in order.tolist():
            shard, lo, hi = int(shards[k]), int(offsets[k]), int(ends[k])
            if shard == cur_shard and lo - cur_hi <= _ADVISE_GAP:
                cur_hi = max(cur_hi, hi)
                continue
            if cur_shard >= 0:
                self._advise_range(cur_shard, cur_lo, cur_hi)
            cur_shard, cur_lo, cur_hi = shard, lo, hi
        if cur_shard >= 0:
            self._advise_range(cur_shard, cur_lo, cur_hi)

    def _advise_range(self, shard: int, lo: int, hi: int) -> None:
        path = self.shard_path(shard)
        with contextlib.suppress(OSError):
            fd = self.pool.fd(path, shared_lock=shard in self._cached_shards)
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)

    def read_member_into(
        self,
        member: int,
        target: memoryview,
        *,
        shard: int,
        sample: int | None = None,
        verify: bool = True,
    ) -> None:
        """Read one member's bytes into ``target`` (its exact size) with preadv, checking its
        xxh3-64.

        Raises:
            ChecksumMismatchError: the bytes differ from the index's checksum (in the source;
                a bad cached copy is dropped and the source read instead).
            StorageError: the shard is missing or short.
        """
        self.index.check_shard(shard)
        rec = self.index.members[member]
        path = self.shard_path(shard)
        cached = shard in self._cached_shards
        size = len(target)
        problem = None
        try:
            fd = self.pool.fd(path, shared_lock=cached)
            got = os.preadv(fd, [target], int(rec["offset"])) if size else 0
        except OSError as exc:
            if not cached:
                raise StorageError(exc.errno, f"cannot read shard {path}: {exc.strerror}") from exc
            problem, got = f"unreadable: {exc}", size
        if problem is None and got != size:
            problem = "truncated"
        elif problem is None and verify:
            actual = member_xxh3_64(target)
            if actual != int(rec["xxh3_64"]):
                problem = "checksum mismatch"
        if problem is not None:
            if cached:  # drop the bad copy, read the source
                self._drop_cached(shard, problem)
                return self.read_member_into(
                    member, target, shard=shard, sample=sample, verify=verify
                )
            if sample is None:
                sample = self._sample_of(member)
            if problem == "truncated":
                raise StorageError(5, f"shard {path} is truncated (sample {self.key(sample)!r})")
            raise ChecksumMismatchError(
                path=path,
                shard=self.manifest.shards[shard].path,
                key=self.key(sample),
                expected=hex64(int(rec["xxh3_64"])),
                actual=hex64(member_xxh3_64(target)),
            )
        self.cache_stats["bytes_cache" if cached else "bytes_source"] += size
        return None

    def _drop_cached(self, shard: int, why: str) -> None:
        """Drop a bad cached copy; the shard is read from the source from now on."""
        if self.cache_root is None:  # pragma: no cover - only called for cached shards
            raise RuntimeError("no cache to drop from")
        rel = self.manifest.shards[shard].path
        logger.warning(
            "staged copy %s is bad (%s): dropped, reading %s", rel, why, self._source_paths[shard]
        )
        self.pool.discard(self._resolved[shard])
        drop_staged(self.cache_root, rel)
        self._cached_shards.discard(shard)
        self._resolved[shard] = self._source_paths[shard]
        self.cache_stats["dropped"] += 1

    def member_view(
        self, member: int, *, shard: int, sample: int | None = None, verify: bool = True
    ) -> tuple[str, memoryview]:
        """Map a member without copying it: return (shard path, view of its bytes), checked.

        The view lies in this process's mapping of the shard file (page cache, no copy).

        Raises:
            ChecksumMismatchError: the bytes differ from the index (in the source; a bad
                cached copy is dropped and the source mapped instead).
            StorageError: the shard is missing or short.
        """
        self.index.check_shard(shard)
        rec = self.index.members[member]
        path = self.shard_path(shard)
        cached = shard in self._cached_shards
        off, size = int(rec["offset"]), int(rec["size"])
        view = self.maps.view(path)
        problem = None
        if off + size > len(view):
            problem = "truncated"
        elif verify and member_xxh3_64(view[off : off + size]) != int(rec["xxh3_64"]):
            problem = "checksum mismatch"
        if problem is None:
            self.cache_stats["bytes_cache" if cached else "bytes_source"] += size
            return path, view[off : off + size]
        if sample is None:
            sample = self._sample_of(member)
        if cached:
            self.maps.discard(path)
            self._drop_cached(shard, problem)
            return self.member_view(member, shard=shard, sample=sample, verify=verify)
        if problem == "truncated":
            raise StorageError(5, f"shard {path} is truncated (sample {self.key(sample)!r})")
        raise ChecksumMismatchError(
            path=path,
            shard=self.manifest.shards[shard].path,
            key=self.key(sample),
            expected=hex64(int(rec["xxh3_64"])),
            actual=hex64(member_xxh3_64(view[off : off + size])),
        )

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
        exts = self.index.exts
        for m in self.index.sample_member_range(sample):
            ext = exts[int(self.index.members[m]["ext_id"])]
            data = self.read_member(m, shard=shard, sample=sample, verify=verify)
            synthesised = int(self.index.members[m]["path_length"]) == 0
            out[ext] = int(data) if ext == LABEL_EXT and synthesised else data
        return out

    def close(self) -> None:
        """Close shard files and the index mapping."""
        self.pool.close()
        self.maps.close()
        self.index.close()
