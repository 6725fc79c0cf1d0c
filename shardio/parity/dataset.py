"""Parity of a whole dataset as its manifest describes it: its groups' files, rebuilt from them.

- :func:`group_files`, :func:`load_table` and :func:`codec_for` describe a group of a
  manifest for :mod:`shardio.parity.group`.
- :func:`rebuild_files` rebuilds the files of one group that verify found bad (data, parity,
  cell table), in place or into another directory, under the group's lock, so that ranks
  hitting the same damaged shard at once rebuild it once.

Every path written is checked first: shardio writes over nothing it did not create (a
symlink or special file at a parity path is refused, never replaced).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from shardio.errors import FormatError, IntegrityError, StorageError, UsageError, wrap_os_error
from shardio.format.checksum import digest_or_none
from shardio.format.manifest import Manifest, ShardEntry
from shardio.format.parity import (
    PARITY_DIR,
    ParitySection,
)
from shardio.parity.cells import CellTable
from shardio.parity.codec import ParityCodec
from shardio.parity.group import GroupFiles, encode_group, rebuild_group
from shardio.storage.files import (
    check_replaceable,
    make_dirs_inside,
    remove_temps_inside,
)
from shardio.storage.opener import Opener, PosixOpener, open_named, read_fully

__all__ = [
    "DEFAULT_CELL_BYTES",
    "LOCK_DIR",
    "cell_bytes_for",
    "codec_for",
    "group_files",
    "group_lock",
    "load_table",
    "rebuild_files",
]

logger = logging.getLogger(__name__)

DEFAULT_CELL_BYTES = 1 << 20  # HDFS's cell: 1 MiB
LOCK_DIR = f"{PARITY_DIR}/.locks"
_CODECS: dict[tuple[int, int, int], ParityCodec] = {}


def codec_for(k: int, m: int, cell_bytes: int) -> ParityCodec:
    """The codec of a scheme (built once per process)."""
    key = (k, m, cell_bytes)
    if key not in _CODECS:
        _CODECS[key] = ParityCodec(k, m, cell_bytes)
    return _CODECS[key]


def cell_bytes_for(shards: Sequence[ShardEntry]) -> int:
    """The cell size for a dataset: 1 MiB, or less for small shards (a multiple of 4 KiB)."""
    longest = max((s.size_bytes for s in shards), default=0)
    return min(DEFAULT_CELL_BYTES, max(4096, -(-longest // 4096) * 4096))


def group_files(
    manifest: Manifest, group: int, *, data_root: str, parity_root: str | None = None
) -> GroupFiles:
    """The files of group ``group`` of ``manifest``: data shards under ``data_root``, parity
    files and cell table under ``parity_root`` (default: the same)."""
    section = _section(manifest)
    entry = section.groups[group]
    proot = parity_root if parity_root is not None else data_root
    shards = [manifest.shards[i] for i in entry.shards]
    return GroupFiles(
        data=[os.path.join(data_root, s.path) for s in shards],
        sizes=[s.size_bytes for s in shards],
        digests=[s.xxh3_128 for s in shards],
        parity=[os.path.join(proot, p.path) for p in entry.parity],
        cells=os.path.join(proot, entry.cells.path),
    )


def load_table(
    root: str, manifest: Manifest, group: int, *, opener: Opener | None = None
) -> CellTable | None:
    """The cell table of ``group``, checked against the manifest; None when it is missing,
    unreadable or damaged (a rebuild then goes by whole-file digests)."""
    section = _section(manifest)
    entry = section.groups[group]
    path = os.path.join(root, entry.cells.path)
    reader = opener if opener is not None else PosixOpener()
    try:
        fd = open_named(reader, path, what="cell table")
        try:
            size = reader.size(fd)
            if size != entry.cells.size_bytes:
                return None
            buf = bytearray(size)
            if read_fully(reader, fd, memoryview(buf), 0) != size:
                return None
        finally:
            reader.close(fd)
        if xxhash.xxh3_128_hexdigest(buf) != entry.cells.xxh3_128:
            return None
        rows = -(-max(manifest.shards[i].size_bytes for i in entry.shards) // section.cell_bytes)
        return CellTable.loads(
            bytes(buf),
            k=section.k,
            m=section.m,
            num_data=entry.num_shards,
            cell_bytes=section.cell_bytes,
            rows=rows,
            where=path,
        )
    except (OSError, FormatError) as exc:
        logger.info("cell table of parity group %d unusable: %s", group, exc)
        return None


def _section(manifest: Manifest) -> ParitySection:
    if manifest.parity is None:
        raise UsageError("the dataset has no parity (pack it with --parity K+M, or shardio "
                         "parity add DST --parity K+M)")  # fmt: skip
    return manifest.parity


@dataclass(frozen=True)
class GroupRebuild:
    """What :func:`rebuild_files` did for one group: the paths it wrote (relative)."""

    group: int
    rebuilt: tuple[str, ...]


@contextlib.contextmanager
def group_lock(root: str, group: int, *, timeout_s: float) -> Iterator[None]:
    """Hold the rebuild lock of ``group`` (``parity/.locks/group-NNNNNN.lock`` under
    ``root``): one process rebuilds, the others wait (at most ``timeout_s``) and then find
    the result.

    Raises:
        StorageError: the lock was not had within ``timeout_s`` (ETIMEDOUT), or cannot be
            taken where ``root`` lives.
    """
    folder = make_dirs_inside(root, LOCK_DIR)
    path = os.path.join(folder, f"group-{group:06d}.lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise wrap_os_error(exc, f"cannot open the lock {path}: {exc}") from exc
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StorageError(
                        errno.ETIMEDOUT,
                        f"parity group {group} of {root}: another process has been rebuilding "
                        f"it for over {timeout_s:g} s",
                    ) from None
                time.sleep(0.05)
            except OSError as exc:
                logger.warning("cannot lock %s (%s): rebuilding without it", path, exc)
                break
        yield
    finally:
        os.close(fd)


def rebuild_files(
    root: str,
    manifest: Manifest,
    group: int,
    bad: Sequence[str],
    *,
    opener: Opener | None = None,
    durable: bool = True,
    lock_timeout_s: float = 600.0,
    out_root: str | None = None,
) -> GroupRebuild:
    """Rebuild the files ``bad`` (paths relative to ``root``, as the manifest lists them:
    data shards, parity files, the cell table) of parity group ``group``.

    The group's lock is held throughout; once had, a file another process rebuilt meanwhile
    (its digest now matches) is left as it is. A rebuilt file is published over the bad one
    only when its xxh3-128 matches the manifest's.

    Args:
        out_root: write each rebuilt file under this directory instead (at the same relative
            path: a staging area), and write nothing at all under ``root``, which may be
            read-only (shared training data): no lock, no temp, no cell table there. The
            caller holds the lock of each file written (staging holds the shard's); a cell
            table is never written this way (``bad`` names data shards or parity files).

    Raises:
        IntegrityError: the group lost more than its parity can rebuild (nothing written).
        StorageError: a path to write is a symlink or special file, or writing failed.
    """
    if out_root is not None:
        return _rebuild_elsewhere(
            root, manifest, group, bad, out_root, opener=opener, durable=durable
        )
    section = _section(manifest)
    entry = section.groups[group]
    codec = codec_for(section.k, section.m, section.cell_bytes)
    reader = opener if opener is not None else PosixOpener()
    files_size: dict[int, int] = {}
    index_of: dict[str, tuple[int, str]] = {}
    for n, i in enumerate(entry.shards):
        index_of[manifest.shards[i].path] = (n, manifest.shards[i].xxh3_128)
        files_size[n] = manifest.shards[i].size_bytes
    for j, p in enumerate(entry.parity):
        index_of[p.path] = (section.k + j, p.xxh3_128)
        files_size[section.k + j] = p.size_bytes
    unknown = [p for p in bad if p not in index_of and p != entry.cells.path]
    if unknown:
        raise UsageError(f"{unknown[0]} is no file of parity group {group}")
    with group_lock(root, group, timeout_s=lock_timeout_s):
        # Temps a killed rebuild of these files left (the lock: none is being written now).
        by_folder: dict[str, set[str]] = {}
        for rel in bad:
            folder, _, name = rel.rpartition("/")
            by_folder.setdefault(folder, set()).add(name)
        for folder, names in by_folder.items():
            remove_temps_inside(root, folder, names)
        lost: dict[int, str] = {}
        out: dict[int, str] = {}
        for rel in bad:
            if rel == entry.cells.path:
                continue
            idx, digest = index_of[rel]
            dest = os.path.join(make_dirs_inside(root, os.path.dirname(rel)),
                                os.path.basename(rel))  # fmt: skip
            check_replaceable(dest, what="rebuilt file")
            size = files_size[idx]
            if digest_or_none(dest, opener=reader, size=size) == digest:
                continue  # rebuilt by another process meanwhile
            lost[idx] = digest
            out[idx] = dest
        files = group_files(manifest, group, data_root=root)
        table_bad = entry.cells.path in bad
        table = None if table_bad else load_table(root, manifest, group, opener=reader)
        written: list[str] = []
        if lost:
            rebuild_group(files, codec, lost, table=table, opener=reader, durable=durable, out=out)
            written += [rel for rel in bad if rel != entry.cells.path and index_of[rel][0] in lost]
        if table_bad or table is None:
            cells_dest = os.path.join(root, entry.cells.path)
            check_replaceable(cells_dest, what="cell table")
            size = entry.cells.size_bytes
            if digest_or_none(cells_dest, opener=reader, size=size) != entry.cells.xxh3_128:
                written += _rewrite_table(root, manifest, group, opener=reader, durable=durable)
        return GroupRebuild(group, tuple(written))


def _rebuild_elsewhere(
    root: str,
    manifest: Manifest,
    group: int,
    bad: Sequence[str],
    out_root: str,
    *,
    opener: Opener | None,
    durable: bool,
) -> GroupRebuild:
    """:func:`rebuild_files` into ``out_root``: only reads under ``root``."""
    section = _section(manifest)
    entry = section.groups[group]
    codec = codec_for(section.k, section.m, section.cell_bytes)
    reader = opener if opener is not None else PosixOpener()
    index_of: dict[str, tuple[int, str, int]] = {}
    for n, i in enumerate(entry.shards):
        s = manifest.shards[i]
        index_of[s.path] = (n, s.xxh3_128, s.size_bytes)
    for j, p in enumerate(entry.parity):
        index_of[p.path] = (section.k + j, p.xxh3_128, p.size_bytes)
    unknown = [p for p in bad if p not in index_of]
    if unknown:
        raise UsageError(f"{unknown[0]} is no data shard or parity file of parity group {group}")
    lost: dict[int, str] = {}
    out: dict[int, str] = {}
    for rel in bad:
        idx, digest, size = index_of[rel]
        dest = os.path.join(make_dirs_inside(out_root, os.path.dirname(rel)),
                            os.path.basename(rel))  # fmt: skip
        check_replaceable(dest, what="rebuilt file")
        if digest_or_none(dest, size=size) == digest:
            continue  # already there, intact
        lost[idx] = digest
        out[idx] = dest
    if not lost:
        return GroupRebuild(group, ())
    files = group_files(manifest, group, data_root=root)
    table = load_table(root, manifest, group, opener=reader)
    rebuild_group(files, codec, lost, table=table, opener=reader, durable=durable, out=out)
    return GroupRebuild(group, tuple(rel for rel in bad if index_of[rel][0] in lost))


def _rewrite_table(
    root: str, manifest: Manifest, group: int, *, opener: Opener, durable: bool
) -> list[str]:
    """Write the group's cell table again (and check its parity) from its intact files."""
    section = _section(manifest)
    entry = section.groups[group]
    codec = codec_for(section.k, section.m, section.cell_bytes)
    # The parity is written again beside the locks (under the group's lock, named for this
    # process) only to be compared with the manifest's, then removed.
    scratch = make_dirs_inside(root, LOCK_DIR)
    files = group_files(manifest, group, data_root=root)
    names = [f"check-{group:06d}-{os.getpid()}.p{j}" for j in range(section.m)]
    staged = GroupFiles(
        data=files.data,
        sizes=files.sizes,
        digests=files.digests,
        parity=[os.path.join(scratch, name) for name in names],
        cells=files.cells,
    )
    try:
        encoded = encode_group(staged, codec, opener=opener, durable=durable)
    finally:
        for p in staged.parity:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    if encoded.cells[1] != entry.cells.xxh3_128 or [d for _, d in encoded.parity] != [
        p.xxh3_128 for p in entry.parity
    ]:
        raise IntegrityError(
            errno.EIO,
            f"parity group {group}: the cell table written again does not match the manifest",
        )
    return [entry.cells.path]
