"""The resolver: where shard k is read from now (a staged copy or the source).

A shard is read from its staged copy while that copy's stamp matches (see the protocol in
:mod:`shardio.staging.protocol`), else from the source. A staging area given as the cache is
checked at open (:meth:`ShardResolver.check_cache`): another dataset's area is refused, and
a missing or empty one is said once and counted (``cache_missing``); a bad copy is staged
again only into an area that holds this very dataset. A copy that fails a read is dropped
(only if it is still the file that failed) and, when asked, staged again from the source
under the shard's lock, so that however many workers and ranks of a node hit it at the same
moment it is copied once. Decisions are cached per process; a forked worker starts afresh,
except for the copies its parent found staged when the epoch began (:meth:`ShardResolver.decide`).

A shard rebuilt from parity outside its read-only source (:mod:`shardio.read.rebuild`) is
served from then on, in this process and those it forks afterwards, from the rebuilt copy
this resolver holds open (:meth:`ShardResolver.serve_rebuilt`); the copy has no name left in
any directory, so nothing is left behind when the processes end, however they end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from shardio.errors import ShardioError
from shardio.format.manifest import Manifest
from shardio.metrics.progress import Counters
from shardio.metrics.read import ReadMetrics
from shardio.staging.copy import source_rebuild, stage_one
from shardio.staging.identity import (
    DatasetIdentity,
    area_dataset_id,
    cache_problem,
    check_area_holds,
    identity_of,
    same_dataset,
)
from shardio.staging.protocol import (
    STAGE_DIR,
    StampCache,
    drop_if_same,
    read_area_marker,
    shard_lock,
    stamp_path,
)
from shardio.storage.files import make_dirs_inside

__all__ = ["Location", "ShardResolver"]

logger = logging.getLogger(__name__)

# The identity of a staged copy that could not even be opened: nothing to compare against, so
# a file found there later (re-staged by another process) is kept.
NOT_OPENED = (-1, -1)

# The most shards a process reads from copies rebuilt outside a read-only source (each holds
# a descriptor and the shard's size on the scratch disk until the reader is closed).
MAX_REBUILT_COPIES = 64


@dataclass(frozen=True)
class Location:
    """Where a shard is read from.

    Attributes:
        path: the file.
        staged: True for a staged copy (read under the shared lock, never through a symlink).
    """

    path: str
    staged: bool


class ShardResolver:
    """Decide, per shard, between the staged copy and the source.

    Args:
        manifest: the dataset's manifest (a staging area's names its source).
        root: the directory the manifest was read from.
        cache: a staging area to read verified copies from; a staging area given as
            ``root`` is its own cache.

        metrics: counts ``cache_hits``/``cache_misses`` (shards located in the staging area /
            at the source while one is in use), ``drops`` and ``restages`` (bad copies
            dropped, staged again), ``cache_missing`` (the cache holds no staging area).
        dataset_id: the id of the bytes of the manifest read from ``root``
            (:func:`shardio.format.identity.load_identified`); None when not known here (a
            worker whose parent checked the cache).

    Attributes:
        cache_problem: why the cache could not serve reads when it was checked (missing,
            empty, not a staging area), or None.
    """

    def __init__(
        self,
        manifest: Manifest,
        root: str,
        cache: str | None,
        *,
        metrics: ReadMetrics | None = None,
        dataset_id: str | None = None,
    ) -> None:
        self.manifest = manifest
        self.root = root
        self.dataset_id = dataset_id
        self.cache_problem: str | None = None
        self._area_ours = False  # an older release's area was found to hold this dataset
        self.source_root = manifest.staged_from or root
        self.cache_root = cache if cache is not None else (root if manifest.staged_from else None)
        self._source: dict[int, str] = {}  # joined on first use: 100,000 shards cost nothing
        self._where: dict[int, Location] = {}
        self._stamps_checked: set[int] = set()  # shards asked about in copy_changed
        # Shards found staged by decide(), here or in the process that started this one: kept
        # over fork (and handed over when pickled), unlike _where.
        self._handed: set[int] = set()
        self._stamps = StampCache()  # each stamp read once while it is unchanged
        self._pid = os.getpid()
        self.metrics = metrics if metrics is not None else ReadMetrics()
        # Shards rebuilt from parity outside the source: shard -> descriptor of the verified,
        # unlinked copy, read through /proc/PID/fd, and that file's (st_dev, st_ino).
        self._rebuilt: dict[int, int] = {}
        self._rebuilt_ids: dict[int, tuple[int, int]] = {}
        self._rebuilt_owner = [os.getpid()]  # the process whose descriptors they are
        weakref.finalize(self, _close_all, self._rebuilt, self._rebuilt_owner)

    def identity(self) -> DatasetIdentity:
        """The identity of the dataset read (its manifest's id, or its area's)."""
        if self.dataset_id is None:
            return DatasetIdentity(None, self.manifest, self.root)
        return identity_of(self.root, self.manifest, self.dataset_id)

    def check_cache(self) -> None:
        """Check the cache against the dataset, once at open.

        Another dataset's staging area is refused (it is never read or written for this
        one). A cache that does not exist, is empty or is not a staging area is said once
        (a warning) and counted (``cache_missing``); its shards are read from the source,
        and copies staged there later (``EpochStager``) are still read.

        Raises:
            UsageError: the cache holds another dataset, or one it cannot tell.
        """
        if self.cache_root is None:
            return
        problem = cache_problem(self.cache_root)
        if problem is not None:
            self.cache_problem = problem
            self.metrics.add("cache_missing")
            logger.warning(
                "stage=%s %s: shards are read from the source %s until it is staged "
                "(shardio stage %s %s)",
                self.cache_root,
                problem,
                self.source_root,
                self.source_root,
                self.cache_root,
            )
            return
        check_area_holds(self.cache_root, self.identity(), action="read it as that dataset's cache")
        self._area_ours = True

    def _cache(self) -> dict[int, Location]:
        if self._rebuilt_owner[0] != os.getpid():
            self._adopt_rebuilt()
        if self._pid != os.getpid():
            self._where.clear()
            self._stamps_checked.clear()
            self._pid = os.getpid()
        return self._where

    def source_path(self, shard: int) -> str:
        """The source shard's path."""
        path = self._source.get(shard)
        if path is None:
            path = self._source[shard] = os.path.join(
                self.source_root, self.manifest.shards[shard].path
            )
        return path

    def locate(self, shard: int) -> Location:
        """Where shard ``shard`` is read from now."""
        where = self._cache()
        fd = self._rebuilt.get(shard)
        if fd is not None:
            return Location(_fd_path(fd), staged=False)
        loc = where.get(shard)
        if loc is None:
            entry = self.manifest.shards[shard]
            # A copy decide() found staged is not checked again: its stamp was checked when
            # the epoch began, and if it has changed since, the O_NOFOLLOW open, the size or a
            # member's xxh3-64 fails and the copy is dropped for the source, as for any copy
            # that changes after its check. A wrong decision costs a fallback, never a byte.
            if self.cache_root is not None and (
                shard in self._handed
                or self._stamps.matches(self.cache_root, entry.path, entry.xxh3_128)
            ):
                loc = Location(os.path.join(self.cache_root, entry.path), staged=True)
                self.metrics.add("cache_hits")
            else:
                loc = Location(self.source_path(shard), staged=False)
                if self.cache_root is not None:
                    self.metrics.add("cache_misses")
            where[shard] = loc
        return loc

    def decide(self, shards: Iterable[int]) -> None:
        """Check now which of ``shards`` are staged, for this process and those it starts.

        The training process calls this once per epoch before its DataLoader workers start;
        a worker (forked, or handed :meth:`handed` when it is started by pickling) then reads
        a shard found staged without checking its stamp again: one check per shard and epoch
        for the rank instead of one per worker. A shard not found staged is checked again at
        its first use in each process, so a copy staged meanwhile is still read.
        """
        where = self._cache()
        if self.cache_root is None:
            return
        staged = set()
        for shard in shards:
            where.pop(shard, None)
            entry = self.manifest.shards[shard]
            if self._stamps.matches(self.cache_root, entry.path, entry.xxh3_128):
                staged.add(shard)
        self._handed = staged

    def handed(self) -> frozenset[int]:
        """The shards :meth:`decide` found staged (to hand to a worker started by pickling)."""
        return frozenset(self._handed)

    def inherit(self, staged: Iterable[int]) -> None:
        """Take the shards a parent process found staged (:meth:`handed`) as decided."""
        if self.cache_root is not None:
            self._handed = set(staged)

    def copy_changed(self, shard: int) -> bool:
        """Whether the staged copy of ``shard`` was verified once but was written, cut or
        removed since: its stamp is there and no longer matches. Such a copy is read from
        the source by :meth:`locate` like a shard never staged, unless someone stages it
        again. Answered True at most once per shard and process (one attempt to repair it).
        """
        self._cache()
        if self.cache_root is None or shard in self._stamps_checked:
            return False
        self._stamps_checked.add(shard)
        entry = self.manifest.shards[shard]
        try:
            st = os.lstat(stamp_path(self.cache_root, entry.path))
        except OSError:
            return False  # never staged (or evicted: eviction removes the stamp first)
        return stat.S_ISREG(st.st_mode) and not self._stamps.matches(
            self.cache_root, entry.path, entry.xxh3_128
        )

    def recheck_unstaged(self) -> None:
        """Check again, at their next use, the shards this process reads from the source
        (a copy may have been staged since: a process that lives for several epochs, such
        as a persistent DataLoader worker, calls this at each epoch's start)."""
        if self.cache_root is None:
            return
        where = self._cache()
        for shard in [k for k, loc in where.items() if not loc.staged]:
            del where[shard]

    def _adopt_rebuilt(self) -> None:
        """In a forked process: keep serving the parent's rebuilt copies through the
        descriptors inherited, each only while it is still open on that very file (code of
        this process may have closed and reused the number); the others are forgotten."""
        self._rebuilt_owner[0] = os.getpid()
        for shard, fd in list(self._rebuilt.items()):
            try:
                st = os.fstat(fd)
                same = (st.st_dev, st.st_ino) == self._rebuilt_ids.get(shard) and not st.st_nlink
            except OSError:
                same = False
            if not same:
                del self._rebuilt[shard]
                self._rebuilt_ids.pop(shard, None)

    def serve_rebuilt(self, shard: int, fd: int) -> str:
        """Read ``shard`` from now on (in this process) from the open file ``fd``: a copy
        rebuilt from parity and verified against the manifest, with no name left in any
        directory (:class:`shardio.read.rebuild.ParityRebuild`). The resolver owns ``fd``
        from now on (closed by :meth:`close`, or when the resolver is collected); a copy it
        served before for the shard is closed. Return the path the shard is read from."""
        self._cache()
        st = os.fstat(fd)
        old = self._rebuilt.pop(shard, None)
        self._rebuilt[shard] = fd
        self._rebuilt_ids[shard] = (st.st_dev, st.st_ino)
        closing = [old] if old is not None and old != fd else []
        while len(self._rebuilt) > MAX_REBUILT_COPIES:
            # The oldest copy goes (its space with it): that shard is read from its source
            # again, and rebuilt again should it still fail.
            evicted = next(iter(self._rebuilt))
            closing.append(self._rebuilt.pop(evicted))
            self._rebuilt_ids.pop(evicted, None)
            self._where.pop(evicted, None)
            logger.info("rebuilt copy of shard %d closed: over %d held", evicted,
                        MAX_REBUILT_COPIES)  # fmt: skip
        for stale in closing:
            with contextlib.suppress(OSError):
                os.close(stale)
        return _fd_path(fd)

    def rebuilt(self, shard: int) -> bool:
        """Whether ``shard`` is read from a copy rebuilt outside the source (this process)."""
        self._cache()
        return shard in self._rebuilt

    def close(self) -> None:
        """Close the rebuilt copies held (their space is freed; the shards are read from
        their source again, should the resolver be used after all)."""
        _close_all(self._rebuilt, self._rebuilt_owner)
        self._rebuilt_ids.clear()

    def forget(self, shard: int) -> None:
        """Decide again on the next :meth:`locate` (a copy may have been staged meanwhile)."""
        self._cache().pop(shard, None)
        self._handed.discard(shard)

    def drop(self, shard: int, identity: tuple[int, int]) -> bool:
        """Drop the bad staged copy of ``shard`` (if it is still the file ``identity`` names)
        and read the source from now on; return whether a file was removed."""
        if self.cache_root is None:  # pragma: no cover - only called for staged shards
            raise RuntimeError("no staging area to drop from")
        rel = self.manifest.shards[shard].path
        try:
            with shard_lock(self.cache_root, rel):
                removed = drop_if_same(self.cache_root, rel, identity)
        except ShardioError as exc:
            # A node disk remounted read-only after an I/O error (EROFS), or a lock file
            # that is not ours: the copy stays, and this process reads the intact source.
            removed = False
            self.metrics.add("drop_failures")
            logger.warning(
                "cannot remove the bad staged copy %s (%s): reading %s instead",
                os.path.join(self.cache_root, rel),
                exc,
                self.source_path(shard),
            )
        self._cache()[shard] = Location(self.source_path(shard), staged=False)
        self._handed.discard(shard)
        self.metrics.add("drops")
        return removed

    def can_restage(self) -> bool:
        """Whether bad copies can be staged again here: a recognised staging area that holds
        this very dataset (never another dataset's, which would be overwritten)."""
        if self.cache_root is None or read_area_marker(self.cache_root) is None:
            return False
        ident = self.identity()
        held = area_dataset_id(self.cache_root)
        if held is not None and ident.dataset_id is not None:
            # Asked again each time (a marker read, on the repair path only): the area may
            # have been given to another dataset (stage --force) since it was checked.
            return held == ident.dataset_id
        if not self._area_ours:  # an older release's area: told by its manifest, once
            try:
                self._area_ours = bool(same_dataset(self.cache_root, ident))
            except OSError:
                return False
        return self._area_ours

    def evicted(self, shard: int) -> bool:
        """Whether the staged copy of ``shard`` is gone with its stamp: evicted (or cleaned),
        not a fault (eviction removes the stamp first, then the copy)."""
        if self.cache_root is None:
            return False
        rel = self.manifest.shards[shard].path
        return not os.path.lexists(os.path.join(self.cache_root, rel)) and not os.path.lexists(
            stamp_path(self.cache_root, rel)
        )

    def restage(self, shard: int, identity: tuple[int, int]) -> str:
        """Stage ``shard`` again from the source, verified, under its lock; the staged copy is
        read from now on. Return "copied" when this process copied it, "present" when another
        one had already.

        Raises:
            ShardioError: the source is damaged or the copy failed (the shard is then read
                from the source).
        """
        if self.cache_root is None:  # pragma: no cover - callers check can_restage
            raise RuntimeError("no staging area to stage into")
        entry = self.manifest.shards[shard]
        try:
            # Refuse a symlink planted on the way since the area was staged (as stage does).
            for folder in (os.path.dirname(entry.path), f"{STAGE_DIR}/locks", f"{STAGE_DIR}/ok"):
                make_dirs_inside(self.cache_root, folder)
            _rel, outcome, _copied = stage_one(
                self.source_root,
                self.cache_root,
                entry,
                [],
                durable=False,
                counters=Counters(shared=False),
                bad_copy=None if identity == NOT_OPENED else identity,
                # A bad source shard is rebuilt from the source's parity into the area (the
                # source, often read-only shared data, is only read).
                rebuild=source_rebuild(self.source_root, self.manifest, self.cache_root),
            )
        except ShardioError:
            self._cache()[shard] = Location(self.source_path(shard), staged=False)
            raise
        self._cache()[shard] = Location(os.path.join(self.cache_root, entry.path), staged=True)
        if outcome != "present":
            self.metrics.add("restages")
            return "copied"
        return "present"


def _fd_path(fd: int) -> str:
    """The path that opens what ``fd`` is open on (a file with no name left); it names this
    process, so that it means one file on the node (as the stall registry needs)."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def _close_all(fds: dict[int, int], owner: list[int]) -> None:
    """Close the descriptors ``fds`` holds, in the process ``owner`` names only (a forked
    one may have closed and reused their numbers)."""
    if owner[0] != os.getpid():
        fds.clear()
        return
    for fd in list(fds.values()):
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
