"""Verify a dataset: every shard's xxh3-128 and every member's xxh3-64 against the index.

A packed dataset is checked shard by shard. A staging area (``shardio stage``) is checked as
what it is: its staged copies themselves, each "ok", "missing" (not staged, or deleted),
"damaged" (bytes wrong: flipped, truncated), "stale" (changed since it was staged, so readers
no longer trust it, though its bytes may be intact) or "foreign" (a symlink or special file
where a copy belongs). For each copy that is not ok, the source shard that readers fall back
to is checked quickly (it exists with its size): the area is "degraded" when training still
gets every byte from the source, "damaged" when it does not.

A dataset with parity (``--parity K+M``) has its parity files and cell tables checked too
(there, regular, their size and xxh3-128): a bad one makes the dataset "degraded" (every
byte of training data is intact, its protection is not), and ``verify --repair`` rebuilds it.
A damaged data shard whose group can rebuild it is said so.

Shards are read with ``pread`` into one reused buffer, never mapped: a file truncated while
it is read ends short instead of raising SIGBUS.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Collection
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from shardio._pool import WorkerPool, check_workers
from shardio.cache.identity import source_mismatch
from shardio.cache.protocol import read_plan, stamp_matches, stamp_path
from shardio.errors import FormatError, ShardioError, StorageError, UsageError
from shardio.format.checksum import file_xxh3_128, hex64, new_file_hasher
from shardio.format.manifest import ShardEntry
from shardio.metrics.progress import Counters, ProgressCallback, ProgressThread
from shardio.read.check import member_digest_problem
from shardio.read.packed import PackedDataset
from shardio.storage.files import describe_kind, refuse_irregular
from shardio.storage.opener import Opener, open_named, read_fully

__all__ = [
    "REWRITABLE",
    "AreaReport",
    "BadMember",
    "ShardProblem",
    "VerifyReport",
    "verify_dataset",
]

# The states of a problem (a staged copy's, or a shard's of a packed dataset).
MISSING, DAMAGED, STALE, FOREIGN = "missing", "damaged", "stale", "foreign"
# A DALI ``.idx`` that is missing beside an intact shard: a function of the shard and the
# index, written again by ``verify --repair`` (no training byte is lost; DALI needs it).
REWRITABLE = "rewritable"
# A shard never staged (or evicted) in a partly staged area: no copy and no stamp. Not a
# problem (``--node I/N`` and ``--capacity`` stage a share); its source is checked instead.
UNSTAGED = "unstaged"

_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class BadMember:
    """A member whose bytes do not match the index."""

    key: str
    ext: str
    expected: str
    actual: str


@dataclass(frozen=True)
class ShardProblem:
    """What is wrong with one shard (or the index).

    Attributes:
        path: the shard's (or index's) path in the manifest.
        reason: one line saying what is wrong.
        bad_members: the members whose bytes do not match the index.
        state: "missing", "damaged", "stale" (a staged copy changed since it was staged,
            bytes intact), "foreign" (a symlink or special file where a staged copy
            belongs: never read, replaced or removed) or "rewritable" (a DALI ``.idx``
            missing beside its intact shard: ``path`` is the ``.idx``'s; written again from
            the shard's index records by ``verify --repair``).
        staged: the problem is a staged copy's in a staging area (the source may be fine).
        identity: (device, inode) of the file found with wrong bytes, so that a repair drops
            that file only and keeps one another process has replaced it with meanwhile.
        samples_lost: samples of the shard none of whose bytes could be checked (the shard
            is missing, empty, unreadable, or its index records are damaged): every one of
            its samples, from the manifest; 0 when the damage is in ``bad_members``.
    """

    path: str
    reason: str
    bad_members: tuple[BadMember, ...] = ()
    state: str = DAMAGED
    staged: bool = False
    identity: tuple[int, int] | None = field(default=None, compare=False, repr=False)
    samples_lost: int = 0
    parity: bool = False  # a parity file or cell table (no training data in it)

    def to_json(self) -> dict[str, Any]:
        """The problem as the JSON of ``shardio verify --json``."""
        return {
            "shard": self.path,
            "reason": self.reason,
            "bad_samples": [
                {"key": b.key, "member": b.ext, "expected": b.expected, "actual": b.actual}
                for b in self.bad_members
            ],
            "state": self.state,
            "staged": self.staged,
            "samples_lost": self.samples_lost,
            "parity": self.parity,
        }


@dataclass(frozen=True)
class AreaReport:
    """What a verify of a staging area found beyond its copies.

    Attributes:
        source: the dataset the area was staged from, which readers fall back to.
        copies_ok: staged copies found intact and stamped.
        not_staged: shards of the dataset this area holds no copy of (never staged here, or
            evicted): read from the source, whose copy of them is checked.
        source_checked: source shards checked (those whose staged copy is not ok): exists,
            a regular file, its size as the manifest says. Their bytes are not read.
        source_problems: what is wrong with those source shards.
    """

    source: str
    copies_ok: int
    source_checked: int = 0
    not_staged: int = 0
    source_problems: tuple[ShardProblem, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The area's section of ``shardio verify --json``."""
        return {
            "source": self.source,
            "copies_ok": self.copies_ok,
            "not_staged": self.not_staged,
            "source_checked": self.source_checked,
            "source_problems": [p.to_json() for p in self.source_problems],
        }


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of a verify run.

    ``status`` sums it up: "intact"; "degraded" (a staging area whose copies are missing,
    damaged or stale while the source shards readers fall back to are intact: training gets
    every byte, from the parallel filesystem; or a dataset whose parity files or DALI
    indexes alone are bad);
    "damaged" (bytes are lost: a shard or the index of a dataset, or a staged copy whose
    source is bad too). ``rebuildable`` lists the damaged shards parity can rebuild.
    """

    root: str
    quick: bool
    shards_checked: int
    bytes_checked: int
    seconds: float
    problems: tuple[ShardProblem, ...] = field(default_factory=tuple)
    index_path: str = "index.bin"  # the index's path in the manifest (a problem may name it)
    area: AreaReport | None = None  # set when ``root`` is a staging area
    parity_checked: int = 0  # parity files and cell tables checked
    rebuildable: tuple[str, ...] = ()  # bad shards whose parity group can rebuild them
    over_parity: tuple[int, ...] = ()  # parity groups with more bad files than parity files

    @property
    def ok(self) -> bool:
        """Whether the dataset (or every staged copy) is intact."""
        return not self.problems and not (self.area is not None and self.area.source_problems)

    @property
    def damaged(self) -> bool:
        """Whether bytes are lost: damage outside staged copies, or a bad source for one (a
        rewritable DALI index loses none)."""
        return any(
            not p.staged and not p.parity and p.state != REWRITABLE for p in self.problems
        ) or bool(self.area is not None and self.area.source_problems)

    @property
    def status(self) -> str:
        """ "intact", "degraded" or "damaged" (see the class docstring)."""
        if self.ok:
            return "intact"
        return "damaged" if self.damaged else "degraded"

    @property
    def parity_paths(self) -> frozenset[str]:
        """The paths of the parity files and cell tables among the problems."""
        return frozenset(p.path for p in self.problems if p.parity)

    @property
    def damaged_samples(self) -> tuple[str, ...]:
        """Keys of the samples with at least one bad member."""
        return tuple(dict.fromkeys(b.key for p in self.problems for b in p.bad_members))

    @property
    def samples_lost(self) -> int:
        """Samples of the shards that could not be checked at all (missing, empty,
        unreadable, damaged index records), counted from the manifest."""
        return sum(p.samples_lost for p in self.problems)

    @property
    def samples_affected(self) -> int:
        """Samples training cannot get intact: those with a bad member, and every sample
        of a shard that could not be checked at all."""
        return len(self.damaged_samples) + self.samples_lost

    def to_json(self) -> dict[str, Any]:
        """The report as the JSON of ``shardio verify --json`` (fields are only ever added)."""
        return {
            "ok": self.ok,
            "quick": self.quick,
            "shards_checked": self.shards_checked,
            "bytes_checked": self.bytes_checked,
            "seconds": round(self.seconds, 3),
            "problems": [p.to_json() for p in self.problems],
            "samples_affected": self.samples_affected,
            "status": self.status,
            "staging_area": self.area.to_json() if self.area is not None else None,
            "parity_checked": self.parity_checked,
            "rebuildable": list(self.rebuildable),
            "parity_groups_over_parity": list(self.over_parity),
        }


# --------------------------------------------------------------------------- reading


class _Reader:
    """Ranges of an open file read through the opener into one reused buffer.

    Not a mapping: a file truncated (or failing) while it is read gives a short read or an
    OSError here, where a mapping would kill the process with SIGBUS.
    """

    def __init__(self, opener: Opener, fd: int) -> None:
        self._opener = opener
        self._fd = fd
        self._buf = bytearray(_CHUNK)
        self._lo = self._hi = 0  # the range of the file that the buffer holds

    def view(self, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) of the file, fewer when it ends first; valid until the next call."""
        if not (self._lo <= lo and hi <= self._hi):
            want = max(hi - lo, _CHUNK)
            if len(self._buf) < want:  # a member larger than the chunk
                self._buf = bytearray(want)
            got = read_fully(self._opener, self._fd, memoryview(self._buf)[:want], lo)
            self._lo, self._hi = lo, lo + got
        return memoryview(self._buf)[lo - self._lo : max(lo, min(hi, self._hi)) - self._lo]


def _digest(ds: PackedDataset, path: str, what: str) -> str:
    """xxh3-128 of the file at ``path``, read through the dataset's opener."""
    fd = _open_shard(ds, path, what)
    try:
        refuse_irregular(fd, path, what=what, close=lambda _fd: None)
        hasher = new_file_hasher()
        _feed(hasher, _Reader(ds.opener, fd), 0, ds.opener.size(fd))
        return hasher.hexdigest()
    finally:
        ds.opener.close(fd)


def _feed(hasher: Any, reader: _Reader, lo: int, hi: int) -> None:
    """Hash bytes [lo, hi) of the file in chunks (what lies between members)."""
    while lo < hi:
        part = reader.view(lo, min(hi, lo + _CHUNK))
        if not part:
            return  # the file ended early: the whole-file checksum fails
        hasher.update(part)
        lo += len(part)


def _bad(ds: PackedDataset, sample: int, mrec: Any, actual: str) -> BadMember:
    ext = ds.index.exts[int(mrec["ext_id"])]
    return BadMember(ds.key(sample), ext, hex64(int(mrec["xxh3_64"])), actual)


def _scan(ds: PackedDataset, shard: int, fd: int, size: int) -> tuple[list[BadMember], str]:
    """Check every member of ``shard`` in the open file ``fd`` (``size`` bytes) and hash the
    whole file; return (the bad members, the file's xxh3-128)."""
    entry = ds.manifest.shards[shard]
    samples = ds.index.samples[entry.first_sample : entry.first_sample + entry.num_samples]
    reader = _Reader(ds.opener, fd)
    whole = new_file_hasher()
    bad: list[BadMember] = []
    pos = 0
    for i, rec in enumerate(samples):
        first = int(rec["first_member"])
        for m in range(first, first + int(rec["n_members"])):
            mrec = ds.index.members[m]
            off, msize = int(mrec["offset"]), int(mrec["size"])
            expected = int(mrec["xxh3_64"])
            if off + msize > size:
                bad.append(_bad(ds, entry.first_sample + i, mrec, "truncated"))
                continue
            in_order = off >= pos  # members in file order: hash the gap, then the member
            if in_order:
                _feed(whole, reader, pos, off)
            data = reader.view(off, off + msize)
            if len(data) < msize:  # the file shrank while it was read
                bad.append(_bad(ds, entry.first_sample + i, mrec, "truncated"))
                continue
            if in_order:
                whole.update(data)
                pos = off + msize
            actual = member_digest_problem(data, expected)
            if actual is not None:
                bad.append(_bad(ds, entry.first_sample + i, mrec, hex64(actual)))
    _feed(whole, reader, pos, size)
    return bad, whole.hexdigest()


def _check_bytes(
    ds: PackedDataset, shard: int, fd: int, reasons: list[str]
) -> tuple[list[BadMember], int]:
    """Scan an open shard file; add to ``reasons``; return (bad members, bytes checked)."""
    entry = ds.manifest.shards[shard]
    size = ds.opener.size(fd)
    if size == 0:
        return [], 0
    bad, digest = _scan(ds, shard, fd, size)
    if digest != entry.xxh3_128:
        if not bad:
            reasons.append("shard checksum mismatch outside sample data (tar headers or padding)")
        else:
            reasons.append(f"{len(bad)} damaged member(s)")
    return bad, size


# --------------------------------------------------------------------------- one shard


_DATASETS: dict[str, PackedDataset] = {}
_PLANS: dict[str, set[str] | None] = {}


def _plan(root: str) -> set[str] | None:
    """The staging area's plan (read once per process; None: every shard is planned)."""
    if root not in _PLANS:
        _PLANS[root] = read_plan(root)
    return _PLANS[root]


def _open(root: str, opener: Opener | None = None) -> PackedDataset:
    ds = _DATASETS.get(root)
    if ds is None:
        ds = _DATASETS[root] = PackedDataset(root, opener=opener)
    return ds


def _open_shard(ds: PackedDataset, path: str, what: str, *, nofollow: bool = False) -> int:
    """``path`` opened through the dataset's opener; StorageError naming it."""
    return open_named(ds.opener, path, what=what, nofollow=nofollow)


def _index_problem(ds: PackedDataset, shard: int) -> ShardProblem | None:
    """The shard's index records, checked: damaged records are the dataset's damage (the
    index), never a staged copy's."""
    try:
        ds.index.check_shard(shard)
    except FormatError as exc:
        entry = ds.manifest.shards[shard]
        why = f"its index records are damaged: {exc}"
        return ShardProblem(entry.path, why, staged=False, samples_lost=entry.num_samples)
    return None


def _verify_shard(root: str, shard: int, quick: bool) -> tuple[ShardProblem | None, int]:
    """Check shard ``shard`` of a packed dataset (its file, wherever it is read from)."""
    ds = _open(root)
    entry = ds.manifest.shards[shard]
    path = ds.shard_path(shard)
    lost = entry.num_samples  # when none of the shard's bytes can be checked
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ShardProblem(entry.path, "missing", state=MISSING, samples_lost=lost), 0
    except OSError as exc:
        why = f"cannot stat: {exc.strerror}"
        return ShardProblem(entry.path, why, samples_lost=lost), 0
    if not stat.S_ISREG(st.st_mode):  # never read: a FIFO would block, a device is not ours
        why = f"shard {path} is a {describe_kind(st.st_mode)}, not a regular file"
        return ShardProblem(entry.path, why, samples_lost=lost), 0
    size = st.st_size
    reasons: list[str] = []
    problem = _index_problem(ds, shard)
    if problem is not None:
        return problem, 0
    if size != entry.size_bytes:
        reasons.append(f"size {size} bytes, expected {entry.size_bytes}")
    if quick or size == 0:
        empty = lost if size == 0 and entry.size_bytes > 0 else 0
        found = ShardProblem(entry.path, "; ".join(reasons), samples_lost=empty)
        return (found if reasons else _dali_problem(root, entry)), 0
    try:
        fd = _open_shard(ds, path, "shard")
    except StorageError as exc:
        return ShardProblem(entry.path, str(exc), samples_lost=lost), 0
    try:
        identity = ds.opener.identity(fd)
        bad, checked = _check_bytes(ds, shard, fd, reasons)
    except OSError as exc:
        why = f"cannot read: {exc.strerror or exc}"
        return ShardProblem(entry.path, why, samples_lost=lost), 0
    finally:
        ds.opener.close(fd)
    if reasons or bad:
        return ShardProblem(entry.path, "; ".join(reasons), tuple(bad), identity=identity), checked
    return _dali_problem(root, entry), checked


def _dali_problem(root: str, entry: ShardEntry) -> ShardProblem | None:
    """A DALI ``.idx`` missing beside a shard found intact (or, with ``--quick``, of its
    size): "rewritable", from the shard's index records. (Beside a bad shard it is not
    reported: repairing the shard writes it too.)"""
    if entry.dali_index is None:
        return None
    path = os.path.join(root, entry.dali_index)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        why = (
            f"DALI index missing beside the intact shard {entry.path} (DALI cannot read the "
            "shard; PyTorch can): shardio verify --repair writes it again from the index"
        )
        return ShardProblem(entry.dali_index, why, state=REWRITABLE)
    except OSError as exc:
        return ShardProblem(entry.dali_index, f"DALI index: cannot stat: {exc.strerror}")
    if not stat.S_ISREG(mode):
        why = (
            f"a {describe_kind(mode)} is where the DALI index belongs, not a file shardio "
            "wrote: it is never replaced (remove it yourself, then shardio verify --repair)"
        )
        return ShardProblem(entry.dali_index, why, state=FOREIGN)
    return None


def _verify_staged(root: str, shard: int, quick: bool) -> tuple[ShardProblem | None, int]:
    """Check the staged copy of shard ``shard`` in the staging area ``root`` (never its
    source; never through a symlink; a FIFO never blocks)."""
    ds = _open(root)
    entry = ds.manifest.shards[shard]
    rel = entry.path
    path = os.path.join(root, rel)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not os.path.lexists(stamp_path(root, rel)):
            plan = _plan(root)
            if plan is not None and rel not in plan:
                return ShardProblem(rel, "not staged", state=UNSTAGED, staged=True), 0
            why = "not staged, though the last stage run chose it (did it finish?)"
            return ShardProblem(rel, why, state=MISSING, staged=True), 0
        why = "deleted after it was staged (its stamp remains)"
        return ShardProblem(rel, why, state=MISSING, staged=True), 0
    except OSError as exc:
        return ShardProblem(rel, f"cannot stat: {exc.strerror}", staged=True), 0
    if not stat.S_ISREG(st.st_mode):
        why = (
            f"a {describe_kind(st.st_mode)} is there, not a copy shardio staged: it is never "
            "read, replaced or removed (remove it yourself)"
        )
        return ShardProblem(rel, why, state=FOREIGN, staged=True), 0
    problem = _index_problem(ds, shard)
    if problem is not None:
        return problem, 0
    stamped = stamp_matches(root, rel, entry.xxh3_128)
    reasons: list[str] = []
    if st.st_size != entry.size_bytes:
        reasons.append(f"size {st.st_size} bytes, expected {entry.size_bytes}")
    if quick:
        if reasons:
            return ShardProblem(rel, "; ".join(reasons), staged=True), 0
        if not stamped:
            why = "changed since it was staged (its stamp does not match; --quick reads no data)"
            return ShardProblem(rel, why, state=STALE, staged=True), 0
        return _staged_dali_problem(root, entry), 0
    try:
        fd = _open_shard(ds, path, "staged copy", nofollow=True)
        refuse_irregular(fd, path, what="staged copy", close=ds.opener.close)
    except StorageError as exc:  # replaced by a symlink or FIFO since the lstat
        return ShardProblem(rel, str(exc), state=FOREIGN, staged=True), 0
    try:
        identity = ds.opener.identity(fd)
        bad, checked = _check_bytes(ds, shard, fd, reasons)
    except OSError as exc:
        why = f"cannot read: {exc.strerror or exc}"
        return ShardProblem(rel, why, staged=True, identity=_identity_of(path)), 0
    finally:
        ds.opener.close(fd)
    if reasons or bad:
        why = "; ".join(reasons)
        return ShardProblem(rel, why, tuple(bad), staged=True, identity=identity), checked
    if not stamped:
        why = (
            "changed since it was staged (its stamp does not match) but its bytes are intact: "
            "readers use the source until it is stamped again"
        )
        return ShardProblem(rel, why, state=STALE, staged=True), checked
    return _staged_dali_problem(root, entry), checked


def _identity_of(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _staged_dali_problem(root: str, entry: ShardEntry) -> ShardProblem | None:
    """A staged tar whose DALI index is missing (staging copies it beside the tar)."""
    if entry.dali_index is None or os.path.lexists(os.path.join(root, entry.dali_index)):
        return None
    why = f"DALI index {entry.dali_index} missing"
    return ShardProblem(entry.path, why, state=MISSING, staged=True)


def _verify_task(
    root: str, shard: int, quick: bool, opener: Opener | None = None
) -> tuple[ShardProblem | None, int]:
    ds = _open(root, opener)
    check = _verify_shard if ds.manifest.staged_from is None else _verify_staged
    result = check(root, shard, quick)
    counters = _COUNTERS.get("c")
    if counters is not None:
        counters.add(1, result[1])
    return result


_COUNTERS: dict[str, Counters] = {}


def _init(counters: Counters) -> None:
    _COUNTERS["c"] = counters


def _verify_parity_task(
    root: str, item: tuple[str, int, str], quick: bool, opener: Opener | None = None
) -> tuple[ShardProblem | None, int]:
    """Check one parity file or cell table (``item``: its path, size and xxh3-128): there,
    regular, its size and (unless quick) its digest. Never through a symlink; a FIFO is
    never opened."""
    rel, size, digest = item
    path = os.path.join(root, rel)
    result: tuple[ShardProblem | None, int] = (None, 0)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        result = ShardProblem(rel, "missing", state=MISSING, parity=True), 0
    except OSError as exc:
        result = ShardProblem(rel, f"cannot stat: {exc.strerror}", parity=True), 0
    else:
        if not stat.S_ISREG(st.st_mode):
            why = f"{path} is a {describe_kind(st.st_mode)}, not a regular file"
            result = ShardProblem(rel, why, state=FOREIGN, parity=True), 0
        elif st.st_size != size:
            why = f"size {st.st_size} bytes, expected {size}"
            result = ShardProblem(rel, why, parity=True), 0
        elif not quick:
            try:
                actual = file_xxh3_128(path, what="parity file", opener=opener, nofollow=True)
            except ShardioError as exc:
                result = ShardProblem(rel, str(exc), parity=True), 0
            else:
                bad = actual != digest
                why = f"checksum mismatch (expected {digest}, got {actual})"
                result = (ShardProblem(rel, why, parity=True) if bad else None), size
    counters = _COUNTERS.get("c")
    if counters is not None:
        counters.add(1, result[1])
    return result


def _parity_summary(
    manifest: Any, problems: Collection[ShardProblem]
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The damaged shards parity can rebuild, and the groups with more bad files than M."""
    section = manifest.parity
    if section is None:
        return (), ()
    bad = {p.path for p in problems if not p.staged}
    rebuildable: list[str] = []
    over: list[int] = []
    for g, group in enumerate(section.groups):
        data = [manifest.shards[i].path for i in group.shards if manifest.shards[i].path in bad]
        lost = len(data) + sum(1 for f in group.parity if f.path in bad)
        if lost > section.m:
            over.append(g)
        else:
            rebuildable += data
    return tuple(rebuildable), tuple(over)


# --------------------------------------------------------------------------- the source


def _check_source(source: str, entry: ShardEntry) -> ShardProblem | None:
    """The quick check of a source shard that readers fall back to: there, regular, its
    size (its bytes are not read: every read checks them)."""
    path = os.path.join(source, entry.path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ShardProblem(entry.path, f"missing at the source {path} too", state=MISSING)
    except OSError as exc:
        return ShardProblem(entry.path, f"cannot stat the source {path}: {exc.strerror}")
    if not stat.S_ISREG(st.st_mode):
        why = f"the source {path} is a {describe_kind(st.st_mode)}, not a shard"
        return ShardProblem(entry.path, why)
    if st.st_size != entry.size_bytes:
        why = f"the source {path} is {st.st_size} bytes, expected {entry.size_bytes}"
        return ShardProblem(entry.path, why)
    return None


# --------------------------------------------------------------------------- the run


def _chosen(root: str, num_shards: int, shards: Collection[int] | None) -> list[int]:
    """The shard numbers to check, sorted; every one must be a shard of the manifest."""
    if shards is None:
        return list(range(num_shards))
    chosen = sorted(set(shards))
    for shard in chosen:
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < num_shards:
            raise UsageError(
                f"shard {shard!r} is not a shard of {root}: its manifest lists shards "
                f"0 to {num_shards - 1}"
            )
    return chosen


def verify_dataset(
    root: str | os.PathLike[str],
    *,
    quick: bool = False,
    workers: int = 1,
    progress: ProgressCallback | None = None,
    shards: Collection[int] | None = None,
    opener: Opener | None = None,
    parity_files: Collection[str] | None = None,
) -> VerifyReport:
    """Check a dataset, or a staging area's copies, against its manifest and index.

    Args:
        root: the dataset directory, or a staging area (its manifest names its source).
        quick: only check that the index is intact and every shard exists with its size
            (no shard data is read); in a staging area, a copy whose stamp does not match
            is reported stale without being read.
        workers: processes hashing shards in parallel (1 to 4096; never more than the
            shards to check).
        progress: called with (shards, bytes) snapshots while running.
        shards: check only these shards (numbers in the manifest); default all.
        opener: what every byte is read through (the manifest and index under its
            deadline); default: POSIX calls. Worker processes get a copy.
        parity_files: the parity files and cell tables to check (paths as the manifest
            lists them); default: all of them when ``shards`` is None, else none. A staging
            area holds none (they stay with the source).

    Raises:
        FormatError: the manifest or index cannot be read at all.
        UsageError: ``workers`` out of range, or a shard number the manifest does not have.
        KeyboardInterrupt: Ctrl-C; the worker processes are stopped and waited for first.
        ShardioError: a worker process died (killed by a signal, out of memory).
    """
    start = time.monotonic()
    check_workers(workers, what="workers")
    root = os.fspath(root)
    ds = PackedDataset(root, opener=opener)
    problems: list[ShardProblem] = []
    source = ds.manifest.staged_from
    try:
        index_entry_path = ds.manifest.index.path
        index_path = os.path.join(root, index_entry_path)
        if _digest(ds, index_path, "index") != ds.manifest.index.xxh3_128:
            problems.append(ShardProblem(ds.manifest.index.path, "index checksum mismatch"))
        chosen = _chosen(root, len(ds.manifest.shards), shards)
        section = ds.manifest.parity if source is None else None
        extra = []
        if section is not None and (parity_files is not None or shards is None):
            wanted = set(parity_files) if parity_files is not None else None
            extra = [f for f in section.files() if wanted is None or f.path in wanted]
        counters = Counters()
        _init(counters)
        results: list[tuple[ShardProblem | None, int]] = []
        thread = (
            ProgressThread(
                counters,
                progress,
                files_total=len(chosen) + len(extra),
                bytes_total=0
                if quick
                else sum(ds.manifest.shards[s].size_bytes for s in chosen)
                + sum(f.size_bytes for f in extra),
            )
            if progress is not None
            else None
        )
        if thread is not None:
            thread.__enter__()
        failure: BaseException | None = None
        try:
            if workers <= 1 or len(chosen) <= 1:
                _DATASETS[root] = ds
                results = [_verify_task(root, s, quick, opener) for s in chosen]
                results += [
                    _verify_parity_task(root, (f.path, f.size_bytes, f.xxh3_128), quick, opener)
                    for f in extra
                ]
            else:
                size = min(workers, len(chosen))  # never a process with nothing to do
                with WorkerPool(size, initializer=_init, initargs=(counters,)) as pool:
                    n, x = len(chosen), len(extra)
                    try:
                        results = pool.map(
                            _verify_task, [root] * n, chosen, [quick] * n, [opener] * n
                        )
                        results += pool.map(
                            _verify_parity_task,
                            [root] * x,
                            [(f.path, f.size_bytes, f.xxh3_128) for f in extra],
                            [quick] * x,
                            [opener] * x,
                        )
                    except BrokenProcessPool as exc:
                        raise ShardioError(
                            "a verify worker process died (killed by a signal or out of "
                            f"memory?) before {root} was checked: run verify again"
                        ) from exc
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _DATASETS.pop(root, None)
            _PLANS.pop(root, None)
            if thread is not None:  # a final snapshot only when the run got to its end
                thread.__exit__(type(failure), failure, None)
        unstaged = [p for p, _ in results if p is not None and p.state == UNSTAGED]
        problems.extend(p for p, _ in results if p is not None and p.state != UNSTAGED)
        checked = sum(n for _, n in results)
        area = None
        if source is not None:
            by_path = {e.path: e for e in ds.manifest.shards}
            not_ok = [by_path[p.path] for p in [*problems, *unstaged] if p.staged]
            foreign = source_mismatch(root, source) if not_ok else None  # re-packed since
            found = (
                _check_source(source, e) if foreign is None else ShardProblem(e.path, foreign)
                for e in not_ok
            )
            area = AreaReport(
                source=source,
                copies_ok=len(chosen)
                - len(unstaged)
                - sum(1 for p in problems if p.path in by_path),
                source_checked=len(not_ok),
                source_problems=tuple(p for p in found if p is not None),
                not_staged=len(unstaged),
            )
        rebuildable, over = _parity_summary(ds.manifest, problems)
    finally:
        ds.close()
    return VerifyReport(
        root,
        quick,
        len(chosen),
        checked,
        time.monotonic() - start,
        tuple(problems),
        index_path=index_entry_path,
        area=area,
        parity_checked=len(extra),
        rebuildable=rebuildable if source is None else (),
        over_parity=over if source is None else (),
    )
