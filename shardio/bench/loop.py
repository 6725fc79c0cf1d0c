"""The timed loop of ``shardio bench``: a DLIO-style emulated training, and cold caches.

Each step takes a batch from a runner (``next()`` on its iterator, timed: the wait) and then
sleeps the emulated compute time, as a GPU would be busy with the model. Every runner
(shardio's in :mod:`shardio.bench.runners`; loose files and webdataset in
:mod:`shardio.bench.peers`) goes through the same loop and the same
:class:`~shardio.metrics.steps.StepTimer`, so their figures compare. The result is a
:class:`~shardio.bench.report.BenchRun`.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shardio.bench.report import BenchRun, StepSample
from shardio.bench.settings import BenchSettings, Runner
from shardio.metrics.snapshots import MetricsSnapshot
from shardio.metrics.steps import StepTimer

if TYPE_CHECKING:
    pass

__all__ = ["drop_page_cache", "stall_notes", "timed_loop"]

logger = logging.getLogger(__name__)


DROP_CACHES = "/proc/sys/vm/drop_caches"


def timed_loop(
    runner: Runner,
    settings: BenchSettings,
    *,
    clock: Callable[[], int] = time.perf_counter_ns,
    sleep: Callable[[float], None] = time.sleep,
) -> BenchRun:
    """Run ``settings.epochs`` epochs of ``runner`` with the emulated compute; time them.

    Each epoch's clock starts before its iterator is made (worker start-up counts in its
    first wait) and stops after the compute on its last batch; pauses between epochs (a cold
    start) count nowhere.
    """
    timer = StepTimer()
    compute_s = settings.compute_ms / 1e3
    series: list[StepSample] = []
    first_waits: list[float] = []
    notes: list[str] = []
    offset_ns = 0  # run time of the epochs before this one
    computed_ns = 0
    for epoch in range(settings.epochs):
        if settings.cold:
            note = drop_page_cache(runner.files())
            if note not in notes:
                notes.append(note)
        began = clock()
        timer.start(began)
        batches = iter(runner.batches(epoch))
        last = began
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            arrived = clock()
            wait = arrived - last
            samples, nbytes = runner.account(batch)
            timer.batch(wait_ns=wait, samples=samples, now_ns=arrived)
            if not series or series[-1].epoch != epoch:
                first_waits.append(wait / 1e9)
            sleep(compute_s)  # the model's step: the batch stays held, as in training
            del batch
            last = clock()
            computed_ns += last - arrived
            series.append(
                StepSample(
                    epoch=epoch,
                    t_s=(offset_ns + arrived - began) / 1e9,
                    wait_s=wait / 1e9,
                    compute_s=(last - arrived) / 1e9,
                    samples=samples,
                    nbytes=nbytes,
                )
            )
        offset_ns += last - began
    stats = runner.finish()
    hist = stats.read_latency
    return BenchRun(
        runner=runner.name,
        source=runner.source,
        mode=settings.mode,
        workers=settings.workers,
        batch_size=settings.batch_size,
        epochs=settings.epochs,
        compute_ms=float(settings.compute_ms),
        samples=timer.samples,
        batches=timer.batches,
        bytes_read=sum(s.nbytes for s in series),
        wall_s=offset_ns / 1e9,
        compute_s=computed_ns / 1e9,
        wait_s=timer.wait_ns / 1e9,
        first_wait_s=tuple(first_waits),
        steps=timer.step.count,
        step_mean_s=timer.step_mean_s,
        step_std_s=timer.step_std_s,
        read_latency=hist.summary() if hist is not None else None,
        read_histogram=hist,
        files_opened=stats.files_opened,
        series=tuple(series),
        notes=(*notes, *stats.notes),
        order_quality=stats.order_quality,
    )


# -- cold start ------------------------------------------------------------------------------
def drop_page_cache(paths: Sequence[str], *, allow_global: bool = True) -> str:
    """Empty the page cache before an epoch; return what was done, in words.

    As root: ``sync`` and ``3`` into ``/proc/sys/vm/drop_caches`` (page, dentry and inode
    caches of the whole node). Where that is not allowed (not root, or a container that
    refuses it), or ``allow_global`` is False: ``POSIX_FADV_DONTNEED`` on each of ``paths``
    (opened without following a symlink and without blocking; others are skipped), which
    evicts their clean pages unless another process holds them mapped.
    """
    why = "not asked to"
    if allow_global:
        if os.geteuid() != 0:
            why = "not root"
        else:
            try:
                os.sync()
                with open(DROP_CACHES, "w") as fh:
                    fh.write("3\n")
            except OSError as exc:
                why = f"{DROP_CACHES}: {exc.strerror or exc}"
            else:
                return f"cold: page cache dropped before each epoch (sync; 3 > {DROP_CACHES})"
    evicted = sum(_evict(path) for path in paths)
    return (
        f"cold: could not drop the page cache ({why}); evicted the {evicted:,} files the run "
        "reads with POSIX_FADV_DONTNEED before each epoch instead"
    )


def _evict(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        logger.info("cold start: cannot open %s: %s", path, exc.strerror)
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError as exc:
        logger.info("cold start: cannot evict %s: %s", path, exc.strerror)
        return False
    finally:
        os.close(fd)


def stall_notes(snap: MetricsSnapshot, dataset: Any) -> tuple[str, ...]:
    """The report's line on read stalls: the deadline in force, reads abandoned after it and
    the time lost, reads refused at once (shard held), workers replaced."""
    deadline = float(getattr(dataset, "read_timeout_s", 0.0) or 0.0)
    counts = snap.counters
    if not deadline and not counts.get("stalls", 0):
        return ()
    told = f"{deadline:g} s" if deadline else "none"
    return (
        f"read stalls {counts.get('stalls', 0):,} (deadline {told}, "
        f"{snap.stall_time_s:.1f} s lost), {counts.get('held_fails', 0):,} reads of held "
        f"shards refused at once, {counts.get('worker_restarts', 0):,} workers replaced",
    )
