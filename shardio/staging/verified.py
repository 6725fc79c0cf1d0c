"""The verified copy of one file: copied in the kernel, hashed from its own bytes, then published.

Used by staging and by ``verify --repair``. The copy is hashed after it is written (its pages
are still in the page cache), so what is checked is what will be read; it is published under
its final name only when its xxh3-128 matches the manifest, and each chunk may run under a
read deadline.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from functools import partial
from typing import Protocol

import xxhash

from shardio.errors import IntegrityError, ShardioError
from shardio.metrics.progress import Counters
from shardio.storage.atomic import create_temp, publish, storage_error, temp_path_for
from shardio.storage.files import refuse_irregular
from shardio.storage.opener import Opener, PosixOpener, open_named
from shardio.storage.stall import IoThreads, call_with_deadline

__all__ = ["COPY_CHUNK_BYTES", "copy_verified"]

COPY_CHUNK_BYTES = 16 * 1024 * 1024
_MAX_ABANDONED_COPIES = 4  # stalled chunks of one copy before it fails at once


def _copy_range(
    reader: Opener, fin: int, fout: int, limit: int, *, counters: Counters, bound: _Bound
) -> int:
    """Copy at most ``limit`` bytes of ``fin`` to ``fout`` through ``reader`` (in the kernel
    where it can); return the bytes copied. ``bound`` runs each chunk's call (under a read
    deadline; an abandoned call writes only into the temp file, which is then removed)."""
    total = 0
    while total < limit:
        n = bound(partial(reader.copy_into, fin, fout, total, min(COPY_CHUNK_BYTES, limit - total)))
        if n == 0:
            break
        total += n
        counters.add(0, n)
    return total


class _Bound(Protocol):
    """Runs one call of the copy under its read deadline."""

    def __call__(
        self, call: Callable[[], int], cleanup: Callable[[int], None] | None = None
    ) -> int: ...


def _hash_file(reader: Opener, fd: int, size: int, bound: _Bound) -> str:
    """xxh3-128 of the first ``size`` bytes of a temp file of ours, read back with ``pread``
    (its pages are still in the page cache). Not mapped: a page the filesystem cannot serve
    (the temp file of a repair lies on the parallel filesystem, and its data server may die)
    is an ``OSError`` for a read, SIGBUS for a mapping. ``bound`` runs each read (the copy's
    deadline)."""
    hasher = xxhash.xxh3_128()
    buf = bytearray(min(COPY_CHUNK_BYTES, max(size, 1)))
    view = memoryview(buf)
    pos = 0
    while pos < size:
        n = bound(partial(reader.pread_into, fd, view[: min(len(buf), size - pos)], pos))
        if n == 0:
            break  # shorter than written: the hash differs, the copy is refused
        hasher.update(view[:n])
        pos += n
    return hasher.hexdigest()


def copy_verified(
    src: str,
    dst: str,
    expected: str,
    *,
    size_bytes: int,
    durable: bool,
    counters: Counters,
    what: str = "source shard",
    action: str = "staging",
    before_publish: Callable[[], None] | None = None,
    read_timeout_s: float = 0.0,
    opener: Opener | None = None,
) -> int:
    """Copy src to a temp file in the kernel, hash the copy's own bytes, publish if it matches.

    The copy is hashed after it is written (its pages are still in the page cache), so what is
    checked is what will be read, not the source. A source whose size is not ``size_bytes``
    is refused before a byte is copied, and no more than ``size_bytes + 1`` are ever copied.
    Used by staging and by ``verify --repair``.

    Args:
        action: what the copy is for, in error messages ("staging", "repairing").
        before_publish: called after the copy verified, just before the rename (a last
            check that nothing was planted at ``dst`` meanwhile); may raise to refuse.
        read_timeout_s: seconds the open or one chunk's copy may stall before the copy is
            abandoned with :class:`~shardio.errors.ReadStalledError` naming the shard (0:
            no deadline).
        opener: what opens, copies and reads back the bytes (default: POSIX calls, in the
            kernel where it can: copy_file_range, else sendfile, else a buffer).

    Raises:
        ReadStalledError: the source stalled past ``read_timeout_s``.
    """
    reader = opener if opener is not None else PosixOpener()
    pool = IoThreads(_MAX_ABANDONED_COPIES) if read_timeout_s else None

    def bound(call: Callable[[], int], cleanup: Callable[[int], None] | None = None) -> int:
        if pool is None:  # no deadline: nothing is abandoned, so nothing to clean up
            return call()
        got: int = call_with_deadline(
            pool, call, read_timeout_s, f"copy of {what} {src}", cleanup=cleanup
        )
        return got

    try:
        return _copy_verified(
            src, dst, expected, size_bytes=size_bytes, durable=durable, counters=counters,
            what=what, action=action, before_publish=before_publish, bound=bound,
            reader=reader,
        )  # fmt: skip
    finally:
        if pool is not None:
            pool.close()


def _copy_verified(
    src: str,
    dst: str,
    expected: str,
    *,
    size_bytes: int,
    durable: bool,
    counters: Counters,
    what: str,
    action: str,
    before_publish: Callable[[], None] | None,
    bound: _Bound,
    reader: Opener,
) -> int:
    fin = _open_source(reader, src, what, bound)
    try:
        size = bound(partial(reader.size, fin))
        if size != size_bytes:
            raise IntegrityError(
                errno.EIO,
                f"{what} {src} is {size:,} bytes, its manifest says {size_bytes:,}: it changed "
                "after it was packed; run shardio verify on the source",
            )
        with contextlib.suppress(OSError):
            os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        tmp = temp_path_for(dst)
        try:
            fout = create_temp(tmp, readable=True)
        except OSError as exc:
            raise storage_error(exc, dst, action) from exc
        try:
            try:
                total = _copy_range(
                    reader, fin, fout, size_bytes + 1, counters=counters, bound=bound
                )
                actual = _hash_file(reader, fout, total, bound) if total == size_bytes else ""
            finally:
                os.close(fout)
            if total != size_bytes:
                raise IntegrityError(
                    errno.EIO,
                    f"{what} {src} changed while it was copied ({total:,} bytes read, its "
                    f"manifest says {size_bytes:,}): run shardio verify on the source",
                )
            if actual != expected:
                raise IntegrityError(
                    errno.EIO,
                    f"{what} {src} does not match its manifest checksum "
                    f"(expected {expected}, got {actual}): run shardio verify on the source",
                )
            if before_publish is not None:
                before_publish()
            publish(tmp, dst, durable=durable)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError) and not isinstance(exc, ShardioError):
                raise storage_error(exc, dst, action) from exc
            raise
    finally:
        reader.close(fin)
    return total


def _open_source(reader: Opener, src: str, what: str, bound: _Bound) -> int:
    """``src`` opened by ``reader`` (under the copy's deadline); anything but a regular file
    refused. Raises StorageError naming it."""
    fin = bound(partial(open_named, reader, src, what=what), reader.close)
    refuse_irregular(fin, src, what=what, close=reader.close)
    return fin
