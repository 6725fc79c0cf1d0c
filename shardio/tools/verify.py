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

The report is :mod:`shardio.tools.verify_report`'s; each file is checked by
:mod:`shardio.tools.verify_files`, its bytes read by :mod:`shardio.tools.verify_bytes`.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Collection
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from shardio._pool import WorkerPool, check_workers, default_workers
from shardio.errors import ShardioError, UsageError
from shardio.format.manifest import ShardEntry
from shardio.metrics.progress import Counters, ProgressCallback, ProgressThread
from shardio.read.reader import ShardReader
from shardio.staging.identity import source_mismatch
from shardio.storage.files import describe_kind
from shardio.storage.opener import Opener
from shardio.tools.verify_bytes import file_digest
from shardio.tools.verify_files import (
    adopt_dataset,
    forget_root,
    init_counters,
    verify_parity_task,
    verify_task,
)
from shardio.tools.verify_report import (
    MISSING,
    UNSTAGED,
    AreaReport,
    ShardProblem,
    VerifyReport,
)

__all__ = ["verify_dataset"]

# verify_dataset(workers=None): a dataset this size or larger is checked by a pool of worker
# processes; a smaller one in the calling process (the pool's start-up costs more than it
# saves: about 0.3 s, twice a small dataset's whole check here).
POOL_MIN_BYTES = 256 << 20


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
    workers: int | None = 1,
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
            shards to check). None: the CPUs of this job (SLURM's allocation, then the
            affinity mask) where the shards to check hold at least 256 MiB, else this
            process alone (a pool of processes costs more than it saves there: about 0.3 s
            of start-up, each worker importing shardio); a quick check reads no shard
            data and runs in this process.
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
    if workers is not None:
        check_workers(workers, what="workers")
    root = os.fspath(root)
    ds = ShardReader(root, opener=opener)
    problems: list[ShardProblem] = []
    source = ds.manifest.staged_from
    try:
        index_entry_path = ds.manifest.index.path
        index_path = os.path.join(root, index_entry_path)
        if file_digest(ds, index_path, "index") != ds.manifest.index.xxh3_128:
            problems.append(ShardProblem(ds.manifest.index.path, "index checksum mismatch"))
        chosen = _chosen(root, len(ds.manifest.shards), shards)
        section = ds.manifest.parity if source is None else None
        extra = []
        if section is not None and (parity_files is not None or shards is None):
            wanted = set(parity_files) if parity_files is not None else None
            extra = [f for f in section.files() if wanted is None or f.path in wanted]
        if workers is None:
            cpus = default_workers()  # a malformed SLURM count is refused whatever the size
            data = sum(ds.manifest.shards[s].size_bytes for s in chosen)
            workers = cpus if not quick and data >= POOL_MIN_BYTES else 1
        pooled = workers > 1 and len(chosen) > 1
        counters = Counters(shared=pooled)  # shared memory only for worker processes
        init_counters(counters)
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
            if not pooled:
                adopt_dataset(root, ds)
                results = [verify_task(root, s, quick, opener) for s in chosen]
                results += [
                    verify_parity_task(root, (f.path, f.size_bytes, f.xxh3_128), quick, opener)
                    for f in extra
                ]
            else:
                size = min(workers, len(chosen))  # never a process with nothing to do
                with WorkerPool(size, initializer=init_counters, initargs=(counters,)) as pool:
                    n, x = len(chosen), len(extra)
                    try:
                        results = pool.map(
                            verify_task, [root] * n, chosen, [quick] * n, [opener] * n
                        )
                        results += pool.map(
                            verify_parity_task,
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
            forget_root(root)
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
