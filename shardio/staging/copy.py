"""Stage one shard into a staging area, under its per-shard lock (and its DALI index, metadata).

Each copy is hashed while its pages are still in the page cache and published under its
final name only when its xxh3-128 matches the manifest. A per-shard ``flock`` on the local
filesystem makes it safe for every rank of a node to stage at once (each shard is copied
once; the others wait, then find it done); the kernel drops the lock of a killed process,
so stale locks recover by themselves. Files staging wrote are opened without following a
symlink and so that a FIFO or device cannot block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import stat
from collections.abc import Callable
from functools import partial

from shardio.errors import (
    FormatError,
    IntegrityError,
    ShardioError,
    StorageError,
    UsageError,
    wrap_os_error,
)
from shardio.format.checksum import fd_xxh3_128
from shardio.format.manifest import Manifest, ShardEntry
from shardio.format.spec import MANIFEST_FILENAME
from shardio.metrics.progress import Counters
from shardio.staging.area import storage_errors
from shardio.staging.protocol import (
    drop_if_same,
    drop_staged,
    shard_lock,
    stamp_matches,
    stamp_rel,
    write_stamp,
)
from shardio.staging.verified import COPY_CHUNK_BYTES, copy_verified
from shardio.storage.atomic import (
    atomic_write,
)
from shardio.storage.files import (
    describe_kind,
    find_temps_inside,
    make_dirs_inside,
    read_regular,
    unlink_inside,
)
from shardio.storage.opener import Opener

__all__ = [
    "READ_NOFOLLOW",
    "leftover_temps",
    "stage_one",
    "temps_of",
    "write_local_metadata",
]

logger = logging.getLogger(__name__)

READ_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# A DALI .idx holds one short text line per sample: bound what is read of one.
_IDX_BASE_BYTES = 64 * 1024 * 1024
_IDX_BYTES_PER_SAMPLE = 64


# --------------------------------------------------------------------------- staged files


def _refuse_staged(path: str, kind: str) -> UsageError:
    return UsageError(
        f"{path} is a {kind}, not a copy staged by shardio: it is not read, replaced or "
        "removed; remove it yourself and stage again"
    )


def _open_staged(path: str, what: str) -> int | None:
    """Open a file staging wrote, without following a symlink or blocking on a FIFO; None
    when absent. Anything but a regular file is refused (UsageError)."""
    try:
        fd = os.open(path, READ_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse_staged(path, "symlink") from exc
        raise wrap_os_error(exc, f"cannot read {what} {path}: {exc.strerror}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse_staged(path, describe_kind(mode))
    return fd


def _staged_digest(path: str, what: str, opener: Opener | None = None) -> str | None:
    """xxh3-128 of a staged file (None when absent), read through ``opener``, not mapped: a
    file truncated meanwhile ends the hash early instead of killing the process with
    SIGBUS."""
    fd = _open_staged(path, what)
    if fd is None:
        return None
    try:
        return fd_xxh3_128(fd, chunk_bytes=COPY_CHUNK_BYTES, opener=opener)
    finally:
        os.close(fd)


def _staged_equals(path: str, data: bytes, what: str) -> bool:
    """Whether the staged file at ``path`` holds exactly ``data`` (False when absent)."""
    fd = _open_staged(path, what)
    if fd is None:
        return False
    try:
        if os.fstat(fd).st_size != len(data):
            return False
        got = bytearray()
        while len(got) <= len(data) and (chunk := os.read(fd, len(data) + 1 - len(got))):
            got += chunk
        return got == data
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- one shard


def leftover_temps(dest: str, folders: set[str]) -> dict[str, list[str]]:
    """Temp files in ``folders`` of DEST: final relative path -> the temps' relative paths.

    Listed once per folder; each is removed under its shard's lock, which every writer of
    that final name holds, so a live copy's temp is never removed.
    """
    found: dict[str, list[str]] = {}
    for folder in folders:
        prefix = f"{folder}/" if folder else ""
        for final, names in find_temps_inside(dest, folder).items():
            found[prefix + final] = [prefix + n for n in names]
    return found


def temps_of(entry: ShardEntry, temps: dict[str, list[str]]) -> list[str]:
    """Leftover temps of a shard's copy, its DALI index and its stamp."""
    finals = [entry.path, stamp_rel(entry.path)]
    if entry.dali_index is not None:
        finals.append(entry.dali_index)
    return [t for f in finals for t in temps.get(f, ())]


def stage_one(
    src_root: str,
    dest: str,
    entry: ShardEntry,
    temps: list[str],
    *,
    durable: bool,
    counters: Counters,
    bad_copy: tuple[int, int] | None = None,
    read_timeout_s: float = 0.0,
    opener: Opener | None = None,
    rebuild: Callable[[ShardEntry], object] | None = None,
    dali_text: Callable[[ShardEntry], bytes] | None = None,
    from_peer: Callable[[ShardEntry, str, Counters], int | None] | None = None,
) -> tuple[str, str, int]:
    """Stage one shard (and its DALI index) under its lock; return (rel, outcome, bytes).

    The outcome is "present" (a verified copy was there), "copied" or "replaced" (a damaged
    copy was removed and copied again), or "peer" (copied from another node's area).

    Args:
        bad_copy: (device, inode) of a staged copy a reader found bad: dropped first if it is
            still the file staged (a copy another process re-staged meanwhile is kept).
        read_timeout_s: the copy's read deadline (:func:`copy_verified`); 0: none.
        opener: what reads the source (:func:`copy_verified`); default: POSIX calls.
        rebuild: when the source shard is bad (damaged or missing), rebuild it from its
            parity straight into the staging area (:func:`source_rebuild`; the source is
            never written), verified; None: the source's fault is raised.
        dali_text: the DALI ``.idx`` of a shard, derived from the dataset's verified index
            (:func:`shardio.staging.dali_index.dali_index_reader`): written beside the staged copy
            instead of copying the source's. None: the source's is copied; either way a
            ``.idx`` that cannot be had is a warning, never a failure of the shard.
        from_peer: tried before the source: copies the shard from another node's staging
            area to the final path, verified (:class:`shardio.staging.peers.PeerFetch`), and
            returns its bytes, or None when no peer had a good copy.
    """
    rel, expected = entry.path, entry.xxh3_128
    final = os.path.join(dest, rel)
    with storage_errors(final, "staging"), shard_lock(dest, rel):
        for temp in temps:  # a killed run's partial copy; the lock excludes live ones
            unlink_inside(dest, temp)
        if bad_copy is not None and drop_if_same(dest, rel, bad_copy):
            logger.warning("staged copy %s was found bad by a reader: copying it again", final)
        outcome, copied = "present", 0
        if not stamp_matches(dest, rel, expected):
            digest = _staged_digest(final, "staged copy", opener)
            if digest == expected:
                write_stamp(dest, rel, expected, durable)  # a verified copy, no stamp
            else:
                outcome = "copied"
                if digest is None:  # gone: its stamp must not outlive it if the copy fails
                    unlink_inside(dest, stamp_rel(rel))
                if digest is not None:
                    logger.warning("staged copy %s is damaged: copying it again", final)
                    drop_staged(dest, rel)
                    outcome = "replaced"
                copy = partial(
                    copy_verified,
                    os.path.join(src_root, rel),
                    final,
                    expected,
                    size_bytes=entry.size_bytes,
                    durable=durable,
                    counters=counters,
                    read_timeout_s=read_timeout_s,
                    opener=opener,
                )
                got = from_peer(entry, final, counters) if from_peer is not None else None
                try:
                    if got is not None:
                        copied, outcome = got, "peer"
                    else:
                        copied = copy()
                except StorageError as exc:
                    if rebuild is None or not _source_fault(exc):
                        raise
                    copied = _rebuild_here(entry, final, rebuild, exc, opener)
                    counters.add(0, copied)
                write_stamp(dest, rel, expected, durable)
        if entry.dali_index is not None:  # DALI wants the .idx beside the staged tar
            _stage_dali_index(src_root, dest, entry, durable=durable, dali_text=dali_text)
    counters.add(1, 0)
    return rel, outcome, copied


def _rebuild_here(
    entry: ShardEntry,
    final: str,
    rebuild: Callable[[ShardEntry], object],
    exc: StorageError,
    opener: Opener | None,
) -> int:
    """Rebuild a bad source shard straight into the staging area at ``final`` (the source is
    only read: it may be read-only shared data) and check the copy's own bytes; return its
    size. Called under the shard's lock.

    Raises:
        IntegrityError: the rebuild failed, or what it wrote does not verify (removed).
    """
    logger.warning("source shard %s is bad (%s): rebuilding it from parity into %s",
                   entry.path, exc, final)  # fmt: skip
    try:
        rebuild(entry)
    except ShardioError as again:
        raise wrap_os_error(exc, f"{exc}; rebuilding it failed: {again}", IntegrityError) from again
    digest = _staged_digest(final, "rebuilt copy", opener)
    if digest != entry.xxh3_128:
        if digest is not None:  # a regular file the rebuild wrote: never left to be read
            with contextlib.suppress(OSError):
                os.unlink(final)
        raise wrap_os_error(
            exc,
            f"{exc}; the copy rebuilt from parity at {final} does not match its manifest "
            f"checksum (got {digest})",
            IntegrityError,
        )
    return entry.size_bytes


def _stage_dali_index(
    src_root: str,
    dest: str,
    entry: ShardEntry,
    *,
    durable: bool,
    dali_text: Callable[[ShardEntry], bytes] | None,
) -> None:
    """Put the shard's DALI ``.idx`` beside its staged copy (the shard is staged already).

    With ``dali_text`` (the index derived from the dataset's verified index), that is
    written, and the source's ``.idx`` is not read at all. Without it, the source's is
    copied; a source ``.idx`` that is missing or unreadable only costs a warning: PyTorch
    reads need no ``.idx``, and ``shardio verify --repair`` on the source writes it again.
    """
    if entry.dali_index is None:  # an HDF5 shard
        return
    dst = os.path.join(dest, entry.dali_index)
    if dali_text is not None:
        try:
            data = dali_text(entry)
        except ShardioError as exc:
            logger.warning("DALI index of %s not staged: %s", entry.path, exc)
            return
        if not _staged_equals(dst, data, "staged DALI index"):
            with atomic_write(dst, durable=durable) as out:
                out.write(data)
        return
    src = os.path.join(src_root, entry.dali_index)
    max_bytes = _IDX_BASE_BYTES + _IDX_BYTES_PER_SAMPLE * entry.num_samples
    try:
        data = read_regular(src, max_bytes=max_bytes, what="DALI index")
    except (StorageError, FormatError) as exc:
        logger.warning(
            "%s: %s is staged without its DALI index (DALI cannot read it, PyTorch can); "
            "shardio verify --repair on the source writes it again",
            exc,
            entry.path,
        )
        return
    if not _staged_equals(dst, data, "staged DALI index"):
        with atomic_write(dst, durable=durable) as out:
            out.write(data)


def _source_fault(exc: StorageError) -> bool:
    """Whether a failed copy says the source shard's bytes are bad or gone (not that writing
    here failed). A stall is not rebuilt here: the rebuild's own reads have no deadline, and
    readers fall back to the source, where ResilientDataset rebuilds under its deadline."""
    return isinstance(exc, IntegrityError) or exc.errno in (errno.ENOENT, errno.EIO)


def source_rebuild(
    src_root: str, manifest: Manifest, dest: str, *, durable: bool = False
) -> Callable[[ShardEntry], object] | None:
    """The rebuild for :func:`stage_one` of a source with parity (None without): the shard
    is rebuilt from its group's other files, read at the source, and written into the
    staging area ``dest`` (never into the source, which may be read-only shared data)."""
    section = manifest.parity
    if section is None:
        return None
    numbers = {e.path: i for i, e in enumerate(manifest.shards)}

    def rebuild(entry: ShardEntry) -> object:
        from shardio.parity.dataset import rebuild_files

        group = section.group_of(numbers[entry.path])
        return rebuild_files(
            src_root, manifest, group, [entry.path], out_root=dest, durable=durable
        )

    return rebuild


def write_local_metadata(src_root: str, dest: str, manifest: Manifest, durable: bool) -> None:
    """Copy the index (verified) and write DEST's manifest, which names the source."""
    index_rel = manifest.index.path
    make_dirs_inside(dest, os.path.dirname(index_rel))
    index_dst = os.path.join(dest, index_rel)
    if _staged_digest(index_dst, "staged index") != manifest.index.xxh3_128:
        copy_verified(
            os.path.join(src_root, index_rel),
            index_dst,
            manifest.index.xxh3_128,
            size_bytes=manifest.index.size_bytes,
            durable=durable,
            counters=Counters(shared=False),
            what="index",
        )
    data = dataclasses.replace(manifest, staged_from=os.path.abspath(src_root)).dumps()
    target = os.path.join(dest, MANIFEST_FILENAME)
    if not _staged_equals(target, data, "staged manifest"):
        with atomic_write(target, durable=durable) as fh:
            fh.write(data)
