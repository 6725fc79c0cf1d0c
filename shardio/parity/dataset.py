"""Parity of a whole dataset: encode its groups (resumable), load them, rebuild from them.

- :func:`encode_parity` writes every group's parity files and cell table (in ``workers``
  threads), journaling each finished group in DST's work directory, so a run killed
  anywhere (SIGKILL included) resumes with what it finished; ``pack --parity`` (at the merge)
  and ``shardio parity add`` both use it.
- :func:`group_files`, :func:`load_table` and :func:`codec_for` describe a group of a
  manifest for :mod:`shardio.parity.group`.
- :func:`rebuild_files` rebuilds the files of one group that verify found bad (data, parity,
  cell table), in place or into another directory, under the group's lock, so that ranks
  hitting the same damaged shard at once rebuild it once.

Every path written is checked first: shardio writes over nothing it did not create (a
symlink or special file at a parity path is refused, never replaced).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from shardio.errors import FormatError, IntegrityError, StorageError, UsageError
from shardio.format.checksum import digest_or_none
from shardio.format.manifest import Manifest, ShardEntry
from shardio.format.parity import (
    MAX_ROW_BYTES,
    PARITY_BACKENDS,
    PARITY_DIR,
    ParityFile,
    ParityGroup,
    ParitySection,
    cells_path,
    parity_path,
)
from shardio.format.spec import WORK_DIR
from shardio.parity.cells import CellTable
from shardio.parity.codec import ParityCodec
from shardio.parity.group import EncodedGroup, GroupFiles, encode_group, rebuild_group
from shardio.storage.atomic import fsync_dir
from shardio.storage.files import (
    check_replaceable,
    make_dirs_inside,
    open_regular,
    remove_temps_inside,
    rmdir_inside,
)
from shardio.storage.opener import Opener, PosixOpener, open_named, read_fully

__all__ = [
    "DEFAULT_CELL_BYTES",
    "JOURNAL",
    "LOCK_DIR",
    "cell_bytes_for",
    "codec_for",
    "encode_parity",
    "finish_journal",
    "group_files",
    "group_lock",
    "load_table",
    "planned_paths",
    "rebuild_files",
]

logger = logging.getLogger(__name__)

DEFAULT_CELL_BYTES = 1 << 20  # HDFS's cell: 1 MiB
JOURNAL = f"{WORK_DIR}/parity-journal.jsonl"
LOCK_DIR = f"{PARITY_DIR}/.locks"
_MAX_JOURNAL_BYTES = 256 << 20
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


# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class _Plan:
    k: int
    m: int
    cell_bytes: int
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        return {"k": self.k, "m": self.m, "cell_bytes": self.cell_bytes,
                "fingerprint": self.fingerprint}  # fmt: skip


def _fingerprint(shards: Sequence[ShardEntry], k: int, m: int, cell_bytes: int) -> str:
    h = xxhash.xxh3_128()
    h.update(json.dumps([k, m, cell_bytes, PARITY_BACKENDS[0]]).encode())
    for s in shards:
        h.update(f"{s.path}\0{s.size_bytes}\0{s.xxh3_128}\n".encode())
    return h.hexdigest()


def _groups(num_shards: int, k: int) -> list[range]:
    return [range(i, min(i + k, num_shards)) for i in range(0, num_shards, k)]


def _group_paths(g: int, m: int) -> list[str]:
    return [parity_path(g, j) for j in range(m)] + [cells_path(g)]


class _Journal:
    """DST/.shardio-work/parity-journal.jsonl: the plan, then one line per finished group."""

    def __init__(self, root: str, durable: bool) -> None:
        self.path = os.path.join(root, JOURNAL)
        self.durable = durable

    def read(self) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
        """The plan and the finished groups (a torn last line, from a kill, is ignored)."""
        try:
            fd = open_regular(self.path, what="parity journal", nofollow=True)
        except StorageError as exc:
            if exc.errno == errno.ENOENT:
                return None, {}
            raise
        try:
            size = os.fstat(fd).st_size
            if size > _MAX_JOURNAL_BYTES:
                raise FormatError(f"parity journal {self.path} is {size:,} bytes: damaged")
            data = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        plan: dict[str, Any] | None = None
        groups: dict[int, dict[str, Any]] = {}
        for line in data.split(b"\n"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if not isinstance(doc, dict):
                continue
            if "plan" in doc and isinstance(doc["plan"], dict):
                plan, groups = doc["plan"], {}
            elif isinstance(doc.get("group"), int):
                groups[doc["group"]] = doc
        return plan, groups

    def start(self, plan: _Plan) -> None:
        self._append({"plan": plan.to_json()}, truncate=True)

    def done(self, g: int, paths: Sequence[str], encoded: EncodedGroup) -> None:
        files = [
            {"path": p, "size_bytes": size, "xxh3_128": digest}
            for p, (size, digest) in zip(paths, (*encoded.parity, encoded.cells), strict=True)
        ]
        self._append({"group": g, "files": files})

    def _append(self, doc: Mapping[str, Any], *, truncate: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        flags |= os.O_TRUNC if truncate else os.O_APPEND
        try:
            fd = os.open(self.path, flags, 0o644)
            try:
                os.write(fd, (json.dumps(doc) + "\n").encode("ascii"))
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StorageError(
                exc.errno or errno.EIO, f"cannot write the parity journal {self.path}: {exc}"
            ) from exc

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _reusable(root: str, record: Mapping[str, Any], paths: Sequence[str]) -> ParityGroup | None:
    """The group a journal line recorded, when its files are still there and intact."""
    try:
        files = [ParityFile.from_json(f, "parity journal") for f in record.get("files", [])]
    except FormatError:
        return None
    if [f.path for f in files] != list(paths):
        return None
    for f in files:
        if digest_or_none(os.path.join(root, f.path), size=f.size_bytes) != f.xxh3_128:
            return None
    return ParityGroup(first_shard=0, num_shards=0, parity=tuple(files[:-1]), cells=files[-1])


def encode_parity(
    root: str,
    shards: Sequence[ShardEntry],
    *,
    k: int,
    m: int,
    cell_bytes: int | None = None,
    workers: int = 1,
    durable: bool = True,
) -> ParitySection:
    """Write the parity of every group of ``shards`` (the dataset's, in order) under
    ``root/parity/``; return the manifest's parity section. The caller holds DST's lock.

    Resumable: groups a killed run journaled, whose files are intact, are kept.

    Raises:
        UsageError: a path of the parity files holds something shardio did not write (a
            symlink, a directory, or a file no run of shardio journaled).
        IntegrityError: a data shard does not match its checksum (nothing of its group is
            published): repair the dataset first.
        MissingExtraError: pyeclib is not installed.
    """
    cell = cell_bytes if cell_bytes is not None else cell_bytes_for(shards)
    codec_for(k, m, cell)  # the extra and the scheme, before anything is written
    if (2 * k + m) * cell > MAX_ROW_BYTES:
        raise UsageError(f"{k}+{m} with {cell}-byte cells needs more than "
                         f"{MAX_ROW_BYTES >> 20} MiB per row: use smaller cells")  # fmt: skip
    if not shards:
        raise UsageError("a dataset without shards has nothing to protect with parity")
    plan = _Plan(k, m, cell, _fingerprint(shards, k, m, cell))
    journal = _Journal(root, durable)
    make_dirs_inside(root, WORK_DIR)
    old_plan, finished = journal.read()
    ours = set(planned_paths(root, len(shards)))  # what a journaled run planned is shardio's
    if old_plan != plan.to_json():
        finished = {}
    groups = _groups(len(shards), k)
    make_dirs_inside(root, PARITY_DIR)
    for g in range(len(groups)):
        for rel in _group_paths(g, m):
            path = os.path.join(root, rel)
            check_replaceable(path, what="parity file")
            if rel not in ours and os.path.lexists(path):
                raise UsageError(
                    f"{path} exists, and no parity run of shardio recorded writing it: shardio "
                    "does not overwrite files it did not write; remove it by hand"
                )
    # Temps of the parity files a killed run was writing (DST's lock: none is live now).
    remove_temps_inside(root, PARITY_DIR, {rel.rsplit("/", 1)[1] for g in range(len(groups))
                                           for rel in _group_paths(g, m)})  # fmt: skip
    if old_plan != plan.to_json():
        journal.start(plan)
    done: dict[int, ParityGroup] = {}
    for g, line in finished.items():
        if 0 <= g < len(groups):
            kept = _reusable(root, line, _group_paths(g, m))
            if kept is not None:
                done[g] = kept
    todo = [g for g in range(len(groups)) if g not in done]
    logger.info("parity %d+%d: %d groups, %d to encode", k, m, len(groups), len(todo))

    def files_of(g: int) -> GroupFiles:
        members = [shards[i] for i in groups[g]]
        return GroupFiles(
            data=[os.path.join(root, s.path) for s in members],
            sizes=[s.size_bytes for s in members],
            digests=[s.xxh3_128 for s in members],
            parity=[os.path.join(root, p) for p in _group_paths(g, m)[:-1]],
            cells=os.path.join(root, cells_path(g)),
        )

    def record(g: int, encoded: EncodedGroup) -> None:
        paths = _group_paths(g, m)
        journal.done(g, paths, encoded)
        files = [
            ParityFile(path=p, size_bytes=size, xxh3_128=digest)
            for p, (size, digest) in zip(paths, (*encoded.parity, encoded.cells), strict=True)
        ]
        done[g] = ParityGroup(first_shard=0, num_shards=0, parity=tuple(files[:-1]),
                              cells=files[-1])  # fmt: skip

    codec = codec_for(k, m, cell)
    if workers <= 1 or len(todo) <= 1:
        for g in todo:
            record(g, encode_group(files_of(g), codec, durable=durable))
    else:
        # Threads, not processes: the reads, ISA-L's encode and the writes all run without
        # the GIL, and no process has to start (which costs more than a small group takes).
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(todo))) as pool:
            futures = {
                pool.submit(encode_group, files_of(g), codec, durable=durable): g for g in todo
            }
            try:
                for future in concurrent.futures.as_completed(futures):
                    record(futures[future], future.result())
            except BaseException:
                for future in futures:
                    future.cancel()  # the groups not begun; those running finish or fail
                raise
    if durable:
        fsync_dir(os.path.join(root, PARITY_DIR))
    return ParitySection(
        k=k,
        m=m,
        cell_bytes=cell,
        backend=PARITY_BACKENDS[0],
        groups=tuple(
            ParityGroup(
                first_shard=groups[g].start,
                num_shards=len(groups[g]),
                parity=done[g].parity,
                cells=done[g].cells,
            )
            for g in range(len(groups))
        ),
    )


def planned_paths(root: str, num_shards: int) -> list[str]:
    """The parity paths a journaled (unfinished) encode planned for a dataset of
    ``num_shards`` shards: what a killed run may have left, all of it shardio's."""
    plan, _groups_done = _Journal(root, durable=False).read()
    if plan is None or not isinstance(plan.get("k"), int) or not isinstance(plan.get("m"), int):
        return []
    k, m = plan["k"], plan["m"]
    if not 1 <= k <= 64 or not 1 <= m <= 16:
        return []
    return [p for g in range(len(_groups(num_shards, k))) for p in _group_paths(g, m)]


def finish_journal(root: str) -> None:
    """Remove the parity journal once the manifest that lists the parity is published (and
    the work directory, when nothing else is in it)."""
    _Journal(root, durable=False).remove()
    rmdir_inside(root, WORK_DIR)


# --------------------------------------------------------------------------- rebuilding


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
        raise StorageError(exc.errno or errno.EIO, f"cannot open the lock {path}: {exc}") from exc
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
