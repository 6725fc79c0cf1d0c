"""One ``verify --repair`` run: verify, repair each problem found, verify what it touched.

Staged copies are staged again from their source, a packed dataset's shards and index are
replaced by a source's verified copies, parity groups rebuild their bad files, and lost DALI
indexes are written again (see :mod:`shardio.tools.repair` for the whole story).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

from shardio.errors import FormatError, IntegrityError, ShardioError, StorageError, wrap_os_error
from shardio.format.checksum import digest_or_none, file_xxh3_128
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry
from shardio.metrics.progress import Counters, ProgressCallback
from shardio.staging.copy import leftover_temps, source_rebuild, stage_one, temps_of
from shardio.staging.dali_index import dali_index_reader
from shardio.staging.protocol import STAGE_DIR, drop_if_same, shard_lock
from shardio.storage.files import make_dirs_inside
from shardio.storage.opener import Opener, PosixOpener
from shardio.tools.repair_files import refuse_non_regular, replace_verified, write_new
from shardio.tools.repair_report import Rebuild, Repaired, Unrepaired
from shardio.tools.verify import verify_dataset
from shardio.tools.verify_report import REWRITABLE, ShardProblem, VerifyReport

__all__ = ["RepairJob"]

logger = logging.getLogger(__name__)


class RepairJob:
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
                refuse_non_regular(os.path.join(self.root, p.path))
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
            write_new(self.root, rel, self._dali_text(entry), durable=self.durable)
        except ShardioError as exc:
            self.unrepaired.append(Unrepaired(rel, f"DALI index not written: {exc}", False))
            return
        how = f"written again from the index records of the intact {entry.path}"
        self.repaired.append(Repaired(rel, state, how))

    def _copy_from(self, entry: ShardEntry | IndexEntry, what: str) -> None:
        """Replace ``entry``'s file by the source's copy of it, verified (see
        :func:`~shardio.tools.repair_files.replace_verified`)."""
        replace_verified(
            os.path.join(self.source, entry.path),
            self.root,
            entry.path,
            entry.xxh3_128,
            entry.size_bytes,
            durable=self.durable,
            what=what,
            opener=self.opener,
        )

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
            self._copy_from(entry, "index")
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
            refuse_non_regular(final)
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
            self._copy_from(entry, "source copy of shard")
        except StorageError as exc:
            if not (isinstance(exc, IntegrityError) or exc.errno == errno.ENOENT):
                raise  # writing here failed, not the source
            note = self._rebuild(shard)
            if note:
                raise wrap_os_error(exc, f"{exc}; {note}", IntegrityError) from exc
            refuse_non_regular(final)
            if digest_or_none(final, opener=self.opener) != entry.xxh3_128:
                raise IntegrityError(
                    errno.EIO, f"{exc}; and the rebuilt {entry.path} does not verify"
                ) from exc
            return "rebuilt (the copy in the source is bad too)"
        return f"replaced by the verified copy from {self.source}"


def _bytes_problem(problem: ShardProblem) -> bool:
    """Whether the problem is the shard file's bytes (what parity rebuilds), not its index
    records (the index's) or a DALI index alone."""
    return not problem.reason.startswith(("its index records", "DALI index"))
