"""The rebuild step of recovery for a dataset with parity: the default ``rebuild`` hook.

:class:`ParityRebuild` rebuilds a damaged, missing or stalled source shard from the other
files of its parity group (:func:`shardio.parity.dataset.rebuild_files`), read through the
reader's own opener (so a survivor on a dead server costs one deadline, then another
survivor is read; a survivor held after a stall is tried again, under the deadline, since a
dead server's stall can hold a whole mount for a while). The shard is then read again and
checked like any other read before a byte of it is used.

Where the rebuilt shard goes:

* a dataset the job may write: over the bad file in the dataset, on the servers that are
  alive, so that every later reader (other jobs, the next epoch) has it whole. The group's
  lock makes the ranks and workers that hit the same shard at once rebuild it once: the
  others wait (at most ``lock_timeout_s``) and find it rebuilt.
* a read-only dataset (the usual shared training data: a read-only mount, or no write
  permission), or one whose in-place rebuild is refused for that reason: nothing is written
  under it. The shard is rebuilt into a private directory of this process (``mkdtemp``:
  mode 0700, a name nobody can create beforehand; in the staging area when one is used,
  else under ``$TMPDIR``), verified whole against the manifest's xxh3-128, opened, and its
  name removed at once: the resolver serves the shard from that open copy for the rest of
  the process (:meth:`shardio.read.resolver.ShardResolver.serve_rebuilt`), and its space is
  freed when the reader is closed or the process ends. Each process that hits the shard
  (each DataLoader worker) rebuilds it once for itself (a process forked later reads its
  parent's copy); at most ``MAX_REBUILT_COPIES`` (64) copies are held, the oldest closed
  first. ``shardio verify --repair`` by someone who may write the dataset repairs it for good.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile

from shardio.errors import IntegrityError, ShardioError, StorageError, wrap_os_error
from shardio.format.checksum import fd_xxh3_128
from shardio.format.manifest import Manifest, ShardEntry
from shardio.read.reader import ShardReader
from shardio.storage.files import open_regular
from shardio.storage.opener import Opener

__all__ = ["LOCK_TIMEOUT_S", "SCRATCH_PREFIX", "ParityRebuild", "parity_rebuild_for"]

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 300.0

# The private directory a rebuild of a read-only dataset's shard is written into (removed
# before the rebuild returns).
SCRATCH_PREFIX = ".shardio-rebuild-"

# An in-place rebuild that fails for one of these: the dataset may not (or can no longer) be
# written by this job; a private copy is rebuilt instead.
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


class ParityRebuild:
    """``rebuild(shard) -> bool`` from the parity of the dataset ``ds`` reads.

    Args:
        ds: the reader (its resolver serves a shard rebuilt outside a read-only dataset).
        lock_timeout_s: the longest wait for another process rebuilding the same group in
            place.
        in_place: rebuild over the bad file in the dataset (True), never (False: always
            into a private copy), or when the dataset can be written (None, the default).

    Attributes:
        wrote: whether the last call wrote the shard (False: it was intact when the group's
            lock was had: rebuilt by another process meanwhile, or held only for a
            mount-wide stall).
        aside: whether the last call rebuilt it outside the dataset (read-only).
    """

    def __init__(
        self,
        ds: ShardReader,
        *,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
        in_place: bool | None = None,
    ) -> None:
        self.ds = ds
        self.lock_timeout_s = lock_timeout_s
        self.in_place = in_place
        self.wrote = False
        self.aside = False

    def __call__(self, shard: int) -> bool:
        from shardio.parity.dataset import rebuild_files

        manifest = self.ds.manifest
        section = manifest.parity
        if section is None:
            return False
        entry = manifest.shards[shard]
        # Survivors held after a stall are tried too, under the deadline: a dead server's
        # stall may have held healthy shards of the same mount for a while.
        trying = getattr(self.ds.opener, "trying_held", None)
        opener = trying() if trying is not None else self.ds.opener
        self.wrote = self.aside = False
        if self.in_place or (self.in_place is None and self._writable(entry)):
            try:
                done = rebuild_files(
                    self.ds.root,
                    manifest,
                    section.group_of(shard),
                    [entry.path],
                    opener=opener,
                    durable=True,
                    lock_timeout_s=self.lock_timeout_s,
                )
            except StorageError as exc:
                if self.in_place or exc.errno not in _NOT_WRITABLE:
                    raise
                logger.warning(
                    "cannot rebuild shard %s in %s (%s): rebuilding a private copy instead",
                    entry.path,
                    self.ds.root,
                    exc,
                )
            else:
                self.wrote = bool(done.rebuilt)
                return True
        fd = self._rebuild_aside(shard, manifest, entry, opener)
        old = self.ds.shard_path(shard)  # the bad source, or a copy rebuilt before
        path = self.ds.resolver.serve_rebuilt(shard, fd)
        for stale in (old, path):  # a descriptor number reused: never an old file's
            self.ds.pool.discard(stale)
            self.ds.maps.discard(stale)
        self.wrote = self.aside = True
        logger.warning(
            "shard %s of the read-only dataset %s rebuilt from parity into a private copy "
            "this process reads from now on (the dataset is not written: shardio verify "
            "--repair by its owner repairs it)",
            entry.path,
            self.ds.root,
        )
        return True

    def _writable(self, entry: ShardEntry) -> bool:
        """Whether this job may write the dataset where an in-place rebuild writes (the
        shard's folder, the parity folder with its locks): a read-only mount or missing
        permission says no."""
        root = self.ds.root
        folders = {root, os.path.join(root, os.path.dirname(entry.path))}
        return all(os.access(folder, os.W_OK) for folder in folders)

    def _scratch_parent(self) -> str:
        """Where the private directory goes: the staging area in use, else ``$TMPDIR``."""
        area = self.ds.resolver.cache_root
        if area is not None and self.ds.resolver.cache_problem is None and os.path.isdir(area):
            return area
        return tempfile.gettempdir()

    def _make_scratch(self) -> str:
        """A fresh directory only this user can enter (``mkdtemp``: 0700, O_EXCL)."""
        parents = [self._scratch_parent(), tempfile.gettempdir()]
        for parent in dict.fromkeys(parents):
            try:
                return tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=parent)
            except OSError as exc:
                last = exc
                logger.debug("cannot make a rebuild directory in %s: %s", parent, exc)
        raise wrap_os_error(
            last,
            f"cannot make a private directory to rebuild a shard into under {parents[-1]}: "
            f"{last.strerror or last}",
        ) from last

    def _rebuild_aside(
        self, shard: int, manifest: Manifest, entry: ShardEntry, opener: Opener
    ) -> int:
        """Rebuild ``entry`` into a private directory, verify the whole copy against the
        manifest, and return a descriptor on it once its name is gone (the directory is
        removed whatever happens).

        Raises:
            IntegrityError: the group is beyond repair, or the copy does not verify.
            StorageError: writing or reading the copy failed (ENOSPC, ...).
        """
        from shardio.parity.dataset import rebuild_files

        assert manifest.parity is not None
        if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
            raise StorageError(
                errno.ENOENT,
                f"shard {entry.path} of the read-only dataset {self.ds.root} cannot be served "
                "from a private rebuilt copy: /proc is not mounted here",
            )
        scratch = self._make_scratch()
        try:
            rebuild_files(
                self.ds.root,
                manifest,
                manifest.parity.group_of(shard),
                [entry.path],
                opener=opener,
                durable=False,
                out_root=scratch,
            )
            fd = open_regular(os.path.join(scratch, entry.path), what="rebuilt shard",
                              nofollow=True)  # fmt: skip
            try:
                size = os.fstat(fd).st_size
                digest = fd_xxh3_128(fd)
                if size != entry.size_bytes or digest != entry.xxh3_128:
                    raise IntegrityError(
                        errno.EIO,
                        f"shard {entry.path} rebuilt from parity does not match the manifest "
                        f"({size} bytes, xxh3-128 {digest}; want {entry.size_bytes} bytes, "
                        f"{entry.xxh3_128})",
                    )
            except OSError as exc:
                os.close(fd)
                if isinstance(exc, ShardioError):
                    raise
                raise wrap_os_error(
                    exc, f"cannot read shard {entry.path} rebuilt into {scratch}: {exc}"
                ) from exc
            except BaseException:
                os.close(fd)
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return fd

    def __repr__(self) -> str:
        return f"ParityRebuild({self.ds.root!r})"


def parity_rebuild_for(ds: ShardReader) -> ParityRebuild | None:
    """The default hook for ``ds``: one when its dataset has parity and is read in place
    (a staging area opened directly holds no parity: its source is repaired by
    ``shardio verify --repair``)."""
    manifest = ds.manifest
    if manifest.parity is None or manifest.staged_from is not None:
        return None
    return ParityRebuild(ds)
