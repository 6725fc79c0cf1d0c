"""Check one file of a dataset against its manifest: a shard, a staged copy, a parity file.

Each check runs in a verify worker process (or in the caller's, with one worker) and
returns the problem found, if any, and the bytes it read. A worker opens each dataset
once and keeps it (and a staging area's plan) until :func:`forget_root`.
"""

from __future__ import annotations

import os
import stat

from shardio.errors import FormatError, ShardioError, StorageError
from shardio.format.checksum import file_xxh3_128
from shardio.format.manifest import ShardEntry
from shardio.metrics.progress import Counters
from shardio.read.reader import ShardReader
from shardio.staging.protocol import read_plan, stamp_matches, stamp_path
from shardio.storage.files import describe_kind, refuse_irregular
from shardio.storage.opener import Opener, open_named
from shardio.tools.verify_bytes import check_bytes
from shardio.tools.verify_report import (
    FOREIGN,
    MISSING,
    REWRITABLE,
    STALE,
    UNSTAGED,
    ShardProblem,
)

__all__ = ["adopt_dataset", "forget_root", "init_counters", "verify_parity_task", "verify_task"]

_DATASETS: dict[str, ShardReader] = {}
_PLANS: dict[str, set[str] | None] = {}


def _plan(root: str) -> set[str] | None:
    """The staging area's plan (read once per process; None: every shard is planned)."""
    if root not in _PLANS:
        _PLANS[root] = read_plan(root)
    return _PLANS[root]


def _open(root: str, opener: Opener | None = None) -> ShardReader:
    ds = _DATASETS.get(root)
    if ds is None:
        ds = _DATASETS[root] = ShardReader(root, opener=opener)
    return ds


def adopt_dataset(root: str, ds: ShardReader) -> None:
    """Check the shards of ``root`` in this process through ``ds`` (already open)."""
    _DATASETS[root] = ds


def forget_root(root: str) -> None:
    """Drop what this process keeps of ``root`` (its dataset and plan) once a run ends."""
    _DATASETS.pop(root, None)
    _PLANS.pop(root, None)


def _open_shard(ds: ShardReader, path: str, what: str, *, nofollow: bool = False) -> int:
    """``path`` opened through the dataset's opener; StorageError naming it."""
    return open_named(ds.opener, path, what=what, nofollow=nofollow)


def _index_problem(ds: ShardReader, shard: int) -> ShardProblem | None:
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
        bad, checked = check_bytes(ds, shard, fd, reasons)
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
        bad, checked = check_bytes(ds, shard, fd, reasons)
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


def verify_task(
    root: str, shard: int, quick: bool, opener: Opener | None = None
) -> tuple[ShardProblem | None, int]:
    """Check shard ``shard`` of the dataset (or staging area) at ``root``."""
    ds = _open(root, opener)
    check = _verify_shard if ds.manifest.staged_from is None else _verify_staged
    result = check(root, shard, quick)
    return _counted(result)


_COUNTERS: dict[str, Counters] = {}


def init_counters(counters: Counters) -> None:
    """Count the files and bytes this process checks into ``counters`` (a pool initializer)."""
    _COUNTERS["c"] = counters


def _counted(result: tuple[ShardProblem | None, int]) -> tuple[ShardProblem | None, int]:
    """``result`` (a problem, the bytes read), counted as one file checked."""
    counters = _COUNTERS.get("c")
    if counters is not None:
        counters.add(1, result[1])
    return result


def verify_parity_task(
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
    return _counted(result)
