"""Repair what ``verify`` finds: staged copies from their source, a dataset's shards from a copy.

Two kinds of destination:

- **A staging area** (``shardio stage``): every staged copy that is missing, damaged, stale
  or lacks its DALI index is staged again from the area's source (or ``source``), through
  :func:`shardio.cache.copy.stage_one`, under the shard's lock, so ranks reading or staging
  the same area meanwhile stay safe; a damaged copy is dropped only if it is still the file
  verify found bad (:func:`shardio.cache.protocol.drop_if_same`). A symlink or special file
  where a copy belongs is refused, never read, replaced or removed.
- **A packed dataset**, with ``source``: another copy of the same dataset (its manifest must
  list the same shards with the same xxh3-128). A damaged, truncated or missing shard (or
  index) is copied from it into a temp file beside the bad one, the copy's own bytes are
  hashed, and only a match is renamed over the bad file. Nothing is written through a
  symlink, and the dataset's lock (the one ``pack`` holds) is held throughout, so no pack
  runs meanwhile.

- **A packed dataset with parity** (``--parity K+M``), with or without ``source``: its damaged
  or missing data shards, parity files and cell tables are rebuilt from their group
  (:func:`shardio.parity.dataset.rebuild_files`: only the surviving files it needs are read,
  every cell checked against the group's cell table, a rebuilt file published only when its
  xxh3-128 matches), under the dataset's lock. A group with more damage than its parity can
  rebuild is reported with its files, never guessed at. With ``source`` too, a data shard is
  copied from the source first and rebuilt only when that copy is bad.

When no copy in a source is good, the ``rebuild`` hook is tried. What could not be repaired
is reported with why; the files touched are verified again at the end.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardio._pool import check_workers
from shardio.cache.copy import (
    leftover_temps,
    source_rebuild,
    stage_one,
    temps_of,
)
from shardio.cache.dali_index import dali_index_reader
from shardio.cache.identity import check_area_holds, source_identity
from shardio.cache.protocol import STAGE_DIR, drop_if_same, read_area_marker, shard_lock
from shardio.cache.verified import copy_verified
from shardio.errors import FormatError, IntegrityError, ShardioError, StorageError, UsageError
from shardio.format.checksum import digest_or_none, file_xxh3_128
from shardio.format.manifest import Manifest, ShardEntry, load_manifest
from shardio.format.spec import MANIFEST_FILENAME
from shardio.metrics.progress import Counters, ProgressCallback
from shardio.storage.atomic import (
    create_temp,
    fsync_dir,
    rename_noreplace,
    storage_error,
    temp_path_for,
)
from shardio.storage.dirlock import lock_directory
from shardio.storage.files import describe_kind, make_dirs_inside
from shardio.storage.opener import Opener, PosixOpener
from shardio.tools.verify import REWRITABLE, ShardProblem, VerifyReport, verify_dataset

__all__ = ["PARITY_SOURCE", "Rebuild", "RepairReport", "Repaired", "Unrepaired", "repair_dataset"]

PARITY_SOURCE = "parity"  # RepairReport.source of a repair from the dataset's own parity

logger = logging.getLogger(__name__)

Rebuild = Callable[[int], bool]
"""``rebuild(shard) -> bool``: make shard ``shard`` good again in place from a repair source
of its own (parity): the dataset's own shard, or, for a staging area, its source's. Return
whether it did; the result is verified before it is trusted."""

_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class Repaired:
    """One thing fixed.

    Attributes:
        path: the shard's (or index's) path in the manifest.
        state: what verify found ("missing", "damaged", "stale").
        how: what was done, one line.
    """

    path: str
    state: str
    how: str


@dataclass(frozen=True)
class Unrepaired:
    """One thing that could not be fixed.

    Attributes:
        path: the shard's (or index's) path in the manifest.
        why: one line.
        damage: bytes are lost for training until it is restored (a dataset's own shard or
            index, or a staged copy whose source is bad too); False for a staged copy whose
            source is intact (training reads that).
    """

    path: str
    why: str
    damage: bool


@dataclass(frozen=True)
class RepairReport:
    """What ``verify --repair`` found, fixed and could not fix.

    Attributes:
        root: the dataset or staging area repaired.
        source: where good copies came from.
        staging_area: ``root`` is a staging area.
        found: the verify run before repairing (after the index was repaired, if it was).
        after: the shards touched (and the index), verified again; None if none were.
        repaired: what was fixed.
        unrepaired: what could not be fixed, with why.
        seconds: the whole run.
    """

    root: str
    source: str
    staging_area: bool
    found: VerifyReport
    after: VerifyReport | None
    repaired: tuple[Repaired, ...]
    unrepaired: tuple[Unrepaired, ...]
    seconds: float

    @property
    def status(self) -> str:
        """ "intact" (nothing to repair), "repaired" (everything found was fixed),
        "degraded" (staged copies left that the source stands in for) or "damaged"."""
        after_damaged = self.after is not None and self.after.damaged
        if any(u.damage for u in self.unrepaired) or after_damaged:
            return "damaged"
        if self.unrepaired or (self.after is not None and not self.after.ok):
            return "degraded"
        return "repaired" if self.repaired else "intact"

    def to_json(self) -> dict[str, Any]:
        """``shardio verify --repair --json``: the verify report of what was found, with
        ``status`` the state after the repair (``found_status`` before it)."""
        return {
            **self.found.to_json(),
            "status": self.status,
            "found_status": self.found.status,
            "repair_source": self.source,
            "repaired": [{"shard": r.path, "state": r.state, "how": r.how} for r in self.repaired],
            "unrepaired": [
                {"shard": u.path, "why": u.why, "damage": u.damage} for u in self.unrepaired
            ],
        }


# --------------------------------------------------------------------------- entry point


def repair_dataset(
    root: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None = None,
    workers: int = 1,
    progress: ProgressCallback | None = None,
    rebuild: Rebuild | None = None,
    durable: bool | None = None,
    opener: Opener | None = None,
) -> RepairReport:
    """Verify ``root`` and repair what is wrong (see the module docstring).

    Args:
        root: a staging area, or a packed dataset.
        source: another copy of the same dataset to copy good shards from; required for a
            packed dataset without parity, default for a staging area: the source it was
            staged from.
        workers: processes verifying shards (1 to 4096).
        progress: called with snapshots while the first verify runs.
        rebuild: tried for a shard when no source copy of it is good (see :data:`Rebuild`).
        durable: fsync each replacement before renaming it (default: yes for a dataset; no
            for a staging area, a job-scoped cache, as ``shardio stage`` does).
        opener: what every byte checked or copied is read through (verify, the copies,
            the digests); default: POSIX calls.

    Raises:
        UsageError: no source for a dataset; a source that is not a copy of the same dataset;
            a staging area without its marker; the dataset is locked by a pack; ``workers``
            out of range.
        KeyboardInterrupt: Ctrl-C; what was being copied is removed (nothing half-written
            has a shard's name), so a second run picks up where this one stopped.
        FormatError: a manifest cannot be read, or the index is broken beyond repair.
    """
    start = time.monotonic()
    check_workers(workers, what="workers")  # before anything is written
    root_path = os.fspath(root)
    manifest = load_manifest(os.path.join(root_path, MANIFEST_FILENAME))
    if manifest.staged_from is not None:
        if read_area_marker(root_path) is None:
            raise UsageError(
                f"{root_path} has no staging-area marker (.shardio-stage/area.json): "
                "stage it again with shardio stage SRC DEST"
            )
        src = os.fspath(source) if source is not None else manifest.staged_from
        if source is not None:
            _check_same_dataset(root_path, manifest, src)
        else:  # the dataset at staged_from may have been re-packed since: never its bytes
            ident = source_identity(src)
            check_area_holds(root_path, ident, action="repair it from that source")
        job = _Repair(root_path, manifest, src, rebuild, durable=bool(durable), opener=opener)
        found = job.run(workers, progress, staged=True)
    else:
        if source is None and manifest.parity is None:
            raise UsageError(
                f"{root_path} is a packed dataset, not a staging area: --repair needs "
                "--source SRC, another copy of the same dataset to copy good shards from "
                "(or re-pack it: shardio pack TREE DST --force)"
            )
        src = os.fspath(source) if source is not None else ""
        if src:
            _check_same_dataset(root_path, manifest, src)
        job = _Repair(
            root_path, manifest, src, rebuild, durable=durable is not False, opener=opener
        )
        with _dataset_lock(root_path):
            job.manifest = load_manifest(os.path.join(root_path, MANIFEST_FILENAME))
            if src:
                _check_same_dataset(root_path, job.manifest, src)  # it may have changed
            elif job.manifest.parity is None:
                raise UsageError(f"{root_path} lost its parity meanwhile: give --source SRC")
            found = job.run(workers, progress, staged=False)
        src = src or PARITY_SOURCE
    return RepairReport(
        root=root_path,
        source=src,
        staging_area=manifest.staged_from is not None,
        found=found,
        after=job.after,
        repaired=tuple(job.repaired),
        unrepaired=tuple(job.unrepaired),
        seconds=time.monotonic() - start,
    )


@contextlib.contextmanager
def _dataset_lock(root: str) -> Iterator[None]:
    """Hold the dataset's exclusive lock (pack's), so no pack or merge runs meanwhile."""
    with lock_directory(
        root, shared=False, busy="another shardio process (a pack, merge or repair) is writing to"
    ):
        yield


def _check_same_dataset(root: str, manifest: Manifest, src: str) -> None:
    """Refuse a source that is not another copy of the dataset in ``root``.

    Raises:
        UsageError: the same directory, or a manifest listing other shards or checksums.
        FormatError: the source has no readable manifest.
    """
    try:
        same = os.path.samefile(root, src)
    except OSError:
        same = False
    if same:
        raise UsageError(f"--source {src} is {root} itself: give another copy of the dataset")
    other = load_manifest(os.path.join(src, MANIFEST_FILENAME))
    mine = [(s.path, s.size_bytes, s.xxh3_128) for s in manifest.shards]
    theirs = [(s.path, s.size_bytes, s.xxh3_128) for s in other.shards]
    if mine != theirs:
        if len(mine) != len(theirs):
            detail = f"{len(theirs)} shards, {root} has {len(mine)}"
        else:
            a, b = next((a, b) for a, b in zip(mine, theirs, strict=True) if a != b)
            detail = f"its {b[0]} has xxh3 {b[2]} ({b[1]} bytes), {root}'s {a[0]} has {a[2]}"
        raise UsageError(
            f"--source {src} is not a copy of the dataset in {root} ({detail}): "
            "give another copy of the same dataset"
        )


# --------------------------------------------------------------------------- the run


class _Repair:
    """One repair run: its findings and outcomes, filled in by :meth:`run`."""

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        source: str,
        rebuild: Rebuild | None,
        *,
        durable: bool,
        opener: Opener | None = None,
    ) -> None:
        self.root = root
        self.opener: Opener = opener if opener is not None else PosixOpener()
        self.manifest = manifest
        self.source = source
        self.rebuild = rebuild
        self._by_parity: set[str] = set()  # bad data shards handed to their parity group
        self.durable = durable
        # A staging area whose source has parity: a bad source shard is rebuilt from the
        # source's parity straight into the area (the source, often read-only shared data,
        # is only read), inside stage_one.
        self._area_rebuild = None
        if rebuild is None and manifest.parity is not None:
            if manifest.staged_from is not None:
                self._area_rebuild = source_rebuild(source, manifest, root, durable=durable)
            else:
                self.rebuild = self._parity_rebuild
        self._dali_reader: Callable[[ShardEntry], bytes] | None = None
        self.after: VerifyReport | None = None
        self.repaired: list[Repaired] = []
        self.unrepaired: list[Unrepaired] = []

    def run(self, workers: int, progress: ProgressCallback | None, *, staged: bool) -> VerifyReport:
        """Repair the index, verify, repair each problem, verify what was touched; return
        what the first verify found."""
        index_touched = self._repair_index()
        try:
            found = verify_dataset(
                self.root, workers=workers, progress=progress, opener=self.opener
            )
        except FormatError as exc:
            lost = [u for u in self.unrepaired if u.path == self.manifest.index.path]
            if not lost:
                raise
            raise FormatError(f"{exc} (and it could not be repaired: {lost[0].why})") from exc
        numbers = {e.path: k for k, e in enumerate(self.manifest.shards)}
        source_bad = {p.path for p in found.area.source_problems} if found.area else set()
        touched: set[int] = set()
        parity_touched: set[str] = set()
        if not staged and self.manifest.parity is not None:
            by_group = self._parity_problems(found, numbers)
            for g, problems in sorted(by_group.items()):
                touched |= {numbers[p.path] for p in problems if p.path in numbers}
                parity_touched |= {p.path for p in problems if p.path not in numbers}
                self._rebuild_group(g, problems)
        dali_of = {e.dali_index: k for k, e in enumerate(self.manifest.shards) if e.dali_index}
        for problem in found.problems:
            if problem.parity or (not staged and self._parity_handled(problem.path)):
                continue
            if problem.state == REWRITABLE and problem.path in dali_of:
                touched.add(dali_of[problem.path])
                self._rewrite_dali(dali_of[problem.path], problem.state)
                continue
            shard = numbers.get(problem.path)
            if shard is None:  # the index: repaired first, or reported there
                if not index_touched:
                    self.unrepaired.append(Unrepaired(problem.path, problem.reason, damage=True))
                continue
            touched.add(shard)
            if staged and problem.staged:
                self._restage(shard, problem, problem.path in source_bad)
            elif staged:  # an area's index records: its index could not be repaired
                self.unrepaired.append(
                    Unrepaired(problem.path, f"{problem.reason}: stage it again", damage=True)
                )
            else:
                self._replace_shard(shard, problem)
        if not staged:  # a shard repaired above gets its DALI index back too, if it lost it
            for shard in sorted(touched):
                self._rewrite_dali(shard, "missing", quiet=True)
        if touched or index_touched or parity_touched:
            after = verify_dataset(
                self.root,
                workers=workers,
                shards=touched,
                opener=self.opener,
                parity_files=parity_touched if self.manifest.parity is not None else None,
            )
            self.after = after
            self._settle(after)
        return found

    def _settle(self, after: VerifyReport) -> None:
        """Move what the second verify still finds bad from repaired to unrepaired."""
        still = {p.path: p for p in after.problems}
        src_bad = {p.path for p in after.area.source_problems} if after.area else set()
        kept: list[Repaired] = []
        for fixed in self.repaired:
            problem = still.get(fixed.path)
            if problem is None:
                kept.append(fixed)
                continue
            damage = not problem.staged or problem.path in src_bad
            self.unrepaired.append(
                Unrepaired(
                    fixed.path, f"still {problem.state} after the repair: {problem.reason}", damage
                )
            )
        self.repaired = kept

    # -- parity ----------------------------------------------------------------------------

    def _parity_problems(
        self, found: VerifyReport, numbers: dict[str, int]
    ) -> dict[int, list[ShardProblem]]:
        """The problems parity repairs, by group: bad parity files and cell tables, and bad
        data shards (without a source, or when the source's copy will not do)."""
        section = self.manifest.parity
        assert section is not None
        owner: dict[str, int] = {}
        for g, group in enumerate(section.groups):
            for f in group.files():
                owner[f.path] = g
        out: dict[int, list[ShardProblem]] = {}
        for problem in found.problems:
            if problem.parity:
                out.setdefault(owner[problem.path], []).append(problem)
            elif problem.path in numbers and not self.source and _bytes_problem(problem):
                out.setdefault(section.group_of(numbers[problem.path]), []).append(problem)
                self._by_parity.add(problem.path)
        return out

    def _parity_rebuild(self, shard: int) -> bool:
        """The default rebuild hook of a dataset with parity: rebuild the shard in place
        from its group (a staging area's copies are rebuilt into it by stage_one)."""
        from shardio.parity.dataset import rebuild_files

        section = self.manifest.parity
        assert section is not None
        entry = self.manifest.shards[shard]
        rebuild_files(self.root, self.manifest, section.group_of(shard), [entry.path],
                      opener=self.opener, durable=self.durable)  # fmt: skip
        return True

    def _parity_handled(self, path: str) -> bool:
        return path in self._by_parity

    def _rebuild_group(self, group: int, problems: list[ShardProblem]) -> None:
        """Rebuild the bad files of one group from the rest of it."""
        from shardio.parity.dataset import rebuild_files

        paths = [p.path for p in problems]
        for p in problems:
            try:
                _refuse_non_regular(os.path.join(self.root, p.path))
            except ShardioError as exc:
                for q in problems:
                    self.unrepaired.append(Unrepaired(q.path, str(exc), damage=not q.parity))
                return
        try:
            done = rebuild_files(
                self.root, self.manifest, group, paths, opener=self.opener, durable=self.durable
            )
        except ShardioError as exc:
            for p in problems:
                why = f"{p.reason}; parity group {group} could not rebuild it: {exc}"
                self.unrepaired.append(Unrepaired(p.path, why, damage=not p.parity))
            return
        for p in problems:
            if p.path in done.rebuilt:
                how = f"rebuilt from parity group {group}"
                self.repaired.append(Repaired(p.path, p.state, how))
            else:
                why = f"{p.reason} (found again; its bytes match: nothing to rebuild)"
                self.unrepaired.append(Unrepaired(p.path, why, damage=not p.parity))

    # -- DALI indexes ----------------------------------------------------------------------

    def _dali_text(self, entry: ShardEntry) -> bytes:
        """The DALI ``.idx`` of ``entry`` from ``root``'s index (opened on first use, after
        the index was repaired, with the manifest read under the dataset's lock)."""
        if self._dali_reader is None:
            self._dali_reader = dali_index_reader(self.root, self.manifest)
        return self._dali_reader(entry)

    def _rewrite_dali(self, shard: int, state: str, *, quiet: bool = False) -> None:
        """Write the missing DALI ``.idx`` of shard ``shard`` of a packed dataset again, from
        its index records, once the shard itself verifies; atomically, where nothing is (a
        symlink or anything else there is never replaced). ``quiet``: a shard that does not
        verify is not reported here (its own problem is)."""
        entry = self.manifest.shards[shard]
        rel = entry.dali_index
        if rel is None or os.path.lexists(os.path.join(self.root, rel)):
            return
        shard_path = os.path.join(self.root, entry.path)
        if digest_or_none(shard_path, opener=self.opener, size=entry.size_bytes) != entry.xxh3_128:
            if not quiet:
                why = (
                    f"DALI index not written: its shard {entry.path} does not verify (it is "
                    "written only beside an intact shard)"
                )
                self.unrepaired.append(Unrepaired(rel, why, damage=False))
            return
        try:
            _write_new(self.root, rel, self._dali_text(entry), durable=self.durable)
        except ShardioError as exc:
            self.unrepaired.append(Unrepaired(rel, f"DALI index not written: {exc}", False))
            return
        how = f"written again from the index records of the intact {entry.path}"
        self.repaired.append(Repaired(rel, state, how))

    # -- the index -------------------------------------------------------------------------

    def _repair_index(self) -> bool:
        """Replace a missing or damaged index by the source's (verified); whether it was bad."""
        entry = self.manifest.index
        path = os.path.join(self.root, entry.path)
        try:
            if file_xxh3_128(path, what="index", opener=self.opener) == entry.xxh3_128:
                return False
            state, was = "damaged", "index checksum mismatch"
        except StorageError as exc:
            state = "missing" if exc.errno == errno.ENOENT else "damaged"
            was = str(exc)
        try:
            _replace_verified(
                os.path.join(self.source, entry.path),
                self.root,
                entry.path,
                entry.xxh3_128,
                entry.size_bytes,
                durable=self.durable,
                what="index",
                opener=self.opener,
            )
        except ShardioError as exc:
            why = f"{was}; {exc}"
            self.unrepaired.append(Unrepaired(entry.path, why, damage=True))
            return True
        self.repaired.append(Repaired(entry.path, state, f"replaced by {self.source}'s"))
        return True

    # -- a staging area --------------------------------------------------------------------

    def _restage(self, shard: int, problem: ShardProblem, source_bad: bool) -> None:
        """Stage shard ``shard`` again from the source (stage_one, under its lock); when the
        source's copy is bad too, try the rebuild hook, then stage again."""
        entry = self.manifest.shards[shard]
        try:
            how = self._stage_one(entry, problem.identity)
            if problem.reason.startswith("DALI index") and how.startswith("its bytes"):
                how = "its DALI index copied again beside it"
        except ShardioError as exc:
            if not (source_bad or isinstance(exc, IntegrityError)):  # here, not the source
                self.unrepaired.append(Unrepaired(entry.path, str(exc), damage=False))
                return
            if self._area_rebuild is not None:  # stage_one tried the source's parity already
                self.unrepaired.append(Unrepaired(entry.path, str(exc), damage=True))
                return
            note = self._rebuild(shard)
            if note:
                self.unrepaired.append(Unrepaired(entry.path, f"{exc}; {note}", damage=True))
                return
            try:
                how = "rebuilt at the source, then " + self._stage_one(entry, None)
            except ShardioError as again:
                why = f"{exc}; rebuilt at the source, then: {again}"
                self.unrepaired.append(Unrepaired(entry.path, why, damage=True))
                return
        self.repaired.append(Repaired(entry.path, problem.state, how))

    def _stage_one(self, entry: ShardEntry, bad_copy: tuple[int, int] | None) -> str:
        """Stage ``entry`` again; ``bad_copy``: the (device, inode) of the copy verify found
        damaged, dropped first if it is still the file there (its stamp may still match:
        bit rot does not change a file's stat)."""
        dropped = False
        if bad_copy is not None:
            with shard_lock(self.root, entry.path):
                dropped = drop_if_same(self.root, entry.path, bad_copy)
            if dropped:
                logger.info("dropped the damaged staged copy %s", entry.path)
        folders = {os.path.dirname(entry.path)}
        if entry.dali_index is not None:
            folders.add(os.path.dirname(entry.dali_index))
        for folder in sorted(folders):
            make_dirs_inside(self.root, folder)  # refuses a symlink on the way
        temps = leftover_temps(self.root, folders | {f"{STAGE_DIR}/ok"})
        _rel, outcome, _copied = stage_one(
            self.source,
            self.root,
            entry,
            temps_of(entry, temps),
            durable=self.durable,
            counters=Counters(shared=False),
            opener=self.opener,
            rebuild=self._area_rebuild,
            dali_text=self._dali_text,
        )
        if outcome == "present":  # intact (or staged by another process meanwhile)
            return "its bytes are intact: verified and stamped again"
        if outcome == "replaced" or dropped:
            return f"the damaged copy was dropped and staged again from {self.source}"
        return f"staged again from {self.source}"

    def _rebuild(self, shard: int) -> str:
        """Try the rebuild hook on ``shard``: "" when it rebuilt it, else why not."""
        if self.rebuild is None:
            return "no rebuild source (parity) for it"
        try:
            done = self.rebuild(shard)
        except Exception as exc:  # a hook's failure is reported with the shard, not raised
            logger.debug("rebuild of shard %d failed", shard, exc_info=True)
            return f"rebuilding it failed: {exc}"
        return "" if done else "it could not be rebuilt"

    # -- a packed dataset ------------------------------------------------------------------

    def _replace_shard(self, shard: int, problem: ShardProblem) -> None:
        """Replace shard ``shard`` of the dataset by the source's copy (verified), unless its
        own bytes are intact; restore a missing DALI index beside it."""
        entry = self.manifest.shards[shard]
        final = os.path.join(self.root, entry.path)
        try:
            _refuse_non_regular(final)
            how = ""
            if digest_or_none(final, opener=self.opener) != entry.xxh3_128:
                how = self._copy_from_source(shard, entry)
        except ShardioError as exc:
            self.unrepaired.append(Unrepaired(entry.path, str(exc), damage=True))
            return
        if not how:
            why = f"{problem.reason} (found again; nothing to copy)"
            self.unrepaired.append(Unrepaired(entry.path, why, damage=True))
            return
        self.repaired.append(Repaired(entry.path, problem.state, how))

    def _copy_from_source(self, shard: int, entry: ShardEntry) -> str:
        """Replace the shard by the source's verified copy; when that copy is bad or
        missing, try the rebuild hook (its result is verified). Return what was done."""
        final = os.path.join(self.root, entry.path)
        try:
            _replace_verified(
                os.path.join(self.source, entry.path),
                self.root,
                entry.path,
                entry.xxh3_128,
                entry.size_bytes,
                durable=self.durable,
                what="source copy of shard",
                opener=self.opener,
            )
        except StorageError as exc:
            if not (isinstance(exc, IntegrityError) or exc.errno == errno.ENOENT):
                raise  # writing here failed, not the source
            note = self._rebuild(shard)
            if note:
                raise IntegrityError(exc.errno or errno.EIO, f"{exc}; {note}") from exc
            _refuse_non_regular(final)
            if digest_or_none(final, opener=self.opener) != entry.xxh3_128:
                raise IntegrityError(
                    errno.EIO, f"{exc}; and the rebuilt {entry.path} does not verify"
                ) from exc
            return "rebuilt (the copy in the source is bad too)"
        return f"replaced by the verified copy from {self.source}"


# --------------------------------------------------------------------------- files


def _bytes_problem(problem: ShardProblem) -> bool:
    """Whether the problem is the shard file's bytes (what parity rebuilds), not its index
    records (the index's) or a DALI index alone."""
    return not problem.reason.startswith(("its index records", "DALI index"))


def _refuse_non_regular(path: str) -> None:
    """Refuse to replace anything but a regular file (or nothing) at ``path``.

    Raises:
        UsageError: a symlink, directory, FIFO, socket or device is there.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(exc, path, "checking") from exc
    if not stat.S_ISREG(mode):
        raise UsageError(
            f"{path} is a {describe_kind(mode)}, not a shard shardio wrote: refusing to write "
            "through or replace it; remove it yourself and repair again"
        )


def _replace_verified(
    src: str,
    root: str,
    rel: str,
    expected: str,
    size_bytes: int,
    *,
    durable: bool,
    what: str,
    opener: Opener,
) -> None:
    """Copy ``src`` into a temp file beside ``root/rel``, hash the copy's own bytes, and
    rename it over ``root/rel`` only if it matches ``expected``.

    Raises:
        UsageError: ``root/rel`` (or a folder on the way) is a symlink or not a regular file.
        IntegrityError: the source's copy has the wrong size or checksum.
        StorageError: reading or writing failed.
    """
    final = os.path.join(root, rel)
    _refuse_non_regular(final)
    make_dirs_inside(root, os.path.dirname(rel))
    copy_verified(
        src,
        final,
        expected,
        size_bytes=size_bytes,
        durable=durable,
        counters=Counters(shared=False),
        what=what,
        action="repairing",
        before_publish=lambda: _refuse_non_regular(final),  # nothing planted is replaced
        opener=opener,
    )
    logger.info("replaced %s by the verified copy %s", final, src)


def _write_new(root: str, rel: str, data: bytes, *, durable: bool) -> None:
    """Write ``root/rel`` atomically where nothing is: a temp file, then a rename that
    replaces nothing (something put there meanwhile, a symlink included, is never replaced).

    Raises:
        UsageError: something is at ``root/rel`` (or a folder on the way is a symlink).
        StorageError: writing failed.
    """
    final = os.path.join(make_dirs_inside(root, os.path.dirname(rel)), os.path.basename(rel))
    tmp = temp_path_for(final)
    try:
        fd = create_temp(tmp)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        rename_noreplace(tmp, final)
    except FileExistsError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UsageError(
            f"{final} appeared while it was being written, and shardio replaces nothing it did "
            "not write: check what is there"
        ) from exc
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise storage_error(exc, final, "writing") from exc
    if durable:
        fsync_dir(os.path.dirname(final))
