"""Encoding a whole dataset's parity, resumably: every group's files, journaled as it finishes.

:func:`encode_parity` writes every group's parity files and cell table (in ``workers``
threads), journaling each finished group in DST's work directory, so a run killed anywhere
(SIGKILL included) resumes with what it finished; ``pack --parity`` (at the merge) and
``shardio parity add`` both use it. Every path written is checked first: shardio writes over
nothing it did not create.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from shardio.errors import FormatError, StorageError, UsageError, wrap_os_error
from shardio.format.checksum import digest_or_none
from shardio.format.manifest import ShardEntry
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
from shardio.parity.dataset import cell_bytes_for, codec_for
from shardio.parity.group import EncodedGroup, GroupFiles, encode_group
from shardio.storage.atomic import fsync_dir
from shardio.storage.files import (
    check_replaceable,
    make_dirs_inside,
    open_regular,
    remove_temps_inside,
    rmdir_inside,
)

__all__ = ["JOURNAL", "encode_parity", "finish_journal", "planned_paths"]

logger = logging.getLogger(__name__)

JOURNAL = f"{WORK_DIR}/parity-journal.jsonl"
_MAX_JOURNAL_BYTES = 256 << 20


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
            raise wrap_os_error(exc, f"cannot write the parity journal {self.path}: {exc}") from exc

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
