"""The timed loop of ``shardio bench`` and its shardio runner: a DLIO-style emulated training.

Each step takes a batch from a runner (``next()`` on its iterator, timed: the wait) and then
sleeps the emulated compute time, as a GPU would be busy with the model. Every runner (shardio
here; loose files and webdataset in :mod:`shardio.runtime.peers`) goes through the same loop
and the same :class:`~shardio.metrics.steps.StepTimer`, so their figures compare. The result
is a :class:`~shardio.metrics.report.BenchRun`.

Torch is imported only when a runner starts, so a mistake in the settings costs no import.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shardio.errors import UsageError
from shardio.metrics.histogram import LatencyHistogram
from shardio.metrics.report import BenchRun, StepSample
from shardio.metrics.snapshot import MetricsSnapshot
from shardio.metrics.steps import StepTimer

if TYPE_CHECKING:
    from shardio.read.opener import Opener

__all__ = [
    "MODES",
    "BenchSettings",
    "Peer",
    "Runner",
    "RunnerStats",
    "ShardioRunner",
    "drop_page_cache",
    "parse_compare",
    "run_bench",
    "run_shardio",
    "timed_loop",
]

logger = logging.getLogger(__name__)

MODES = ("map", "stream")
DROP_CACHES = "/proc/sys/vm/drop_caches"


def _whole(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise UsageError(f"{what} must be at least {minimum}, got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """How to run the bench (the same for every runner).

    Attributes:
        mode: "map" (a new random order each epoch) or "stream" (shard order; loose files
            in sorted order).
        workers: DataLoader worker processes (0: read in the loop's own process).
        batch_size: samples per batch.
        compute_ms: emulated compute per step, in milliseconds (a sleep).
        epochs: epochs to run.
        seed: the seed of every shuffle.
        cold: empty the page cache before each epoch (see :func:`drop_page_cache`).
    """

    mode: str = "map"
    workers: int = 4
    batch_size: int = 32
    compute_ms: float = 0.0
    epochs: int = 1
    seed: int = 0
    cold: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"invalid mode {self.mode!r}: choose one of {', '.join(MODES)}")
        _whole(self.workers, "workers", 0)
        _whole(self.batch_size, "batch size", 1)
        _whole(self.epochs, "epochs", 1)
        _whole(self.seed, "seed", 0)
        ms = self.compute_ms
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
            raise UsageError(f"compute time must be a finite number of ms, got {ms!r}")
        if ms < 0:
            raise UsageError(f"compute time must be at least 0 ms, got {ms}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready values."""
        return {
            "mode": self.mode,
            "workers": self.workers,
            "batch_size": self.batch_size,
            "compute_ms": float(self.compute_ms),
            "epochs": self.epochs,
            "seed": self.seed,
            "cold": self.cold,
        }


@dataclass(frozen=True, kw_only=True)
class RunnerStats:
    """What a runner measured itself, beside the loop's timing.

    Attributes:
        read_latency: its read latencies, or None where it cannot time its reads.
        files_opened: files it opened, where known.
        notes: what the report should say about it.
    """

    read_latency: LatencyHistogram | None
    files_opened: int | None = None
    notes: tuple[str, ...] = ()


class Runner(Protocol):
    """One way of reading a dataset into batches, as the timed loop drives it."""

    name: str
    source: str

    def batches(self, epoch: int) -> Iterator[Any]:
        """The batches of ``epoch`` (workers start here, not before)."""

    def account(self, batch: Any) -> tuple[int, int]:
        """(samples, payload bytes) of ``batch``; takes in the read latencies it carries.

        Raises:
            ShardioError: the batch stands for a failure in a worker.
        """

    def files(self) -> list[str]:
        """Every file the run reads (for a cold start)."""

    def finish(self) -> RunnerStats:
        """What it measured itself, once the epochs are done."""

    def close(self) -> None:
        """Release what it holds (idempotent)."""


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


# -- the shardio runner ----------------------------------------------------------------------
class ShardioRunner:
    """``ShardDataset(path).loader(...)``, as a training job uses it.

    Args:
        path: the dataset directory.
        settings: the bench settings.
        opener: the opener the dataset reads through (a FaultyOpener in tests).
    """

    name = "shardio"

    def __init__(self, path: str, settings: BenchSettings, *, opener: Opener | None = None) -> None:
        from shardio.runtime.dataset import ShardDataset

        self.dataset = ShardDataset(path, mode=settings.mode, seed=settings.seed, opener=opener)
        fmt = self.dataset.packed.manifest.shard_format
        self.source = f"{path} ({fmt} shards)"
        self.loader = self.dataset.loader(
            batch_size=settings.batch_size, num_workers=settings.workers
        )

    def batches(self, epoch: int) -> Iterator[Any]:
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def account(self, batch: Any) -> tuple[int, int]:
        from shardio.runtime.batch import ByteColumn

        nbytes = 0
        for column in batch.values():
            if isinstance(column, ByteColumn) and len(column):
                nbytes += int(column.offsets[-1] - column.offsets[0])
        return len(batch["__key__"]), nbytes

    def files(self) -> list[str]:
        root = self.dataset.path
        return [os.path.join(root, s.path) for s in self.dataset.packed.manifest.shards]

    def finish(self) -> RunnerStats:
        snap = self.loader.metrics()
        hist = LatencyHistogram()
        for name in ("read_staged", "read_source"):
            found = snap.histograms.get(name)
            if found is not None:
                hist.merge(found)
        opened = snap.counters.get("opens_staged", 0) + snap.counters.get("opens_source", 0)
        return RunnerStats(
            read_latency=hist, files_opened=opened, notes=stall_notes(snap, self.dataset)
        )

    def close(self) -> None:
        self.loader.close()
        self.dataset.close()


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


def run_shardio(path: str, settings: BenchSettings, *, opener: Opener | None = None) -> BenchRun:
    """Bench shardio's loader on the dataset at ``path``.

    Raises:
        ShardioError: the dataset cannot be read (missing, damaged, a read failed).
    """
    runner = ShardioRunner(path, settings, opener=opener)
    try:
        return timed_loop(runner, settings)
    finally:
        runner.close()


# -- the whole bench -------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """A runner to compare shardio with: ``loose`` (with its tree) or ``webdataset``."""

    kind: str
    root: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.root}" if self.root is not None else self.kind


def parse_compare(text: str) -> Peer:
    """Parse a ``--compare`` value: ``loose:DIR`` or ``webdataset``.

    Raises:
        UsageError: another value, or DIR is empty or not a directory.
    """
    kind, sep, root = text.partition(":")
    if kind == "webdataset" and not sep:
        return Peer("webdataset")
    if kind == "loose" and sep:
        if not root:
            raise UsageError("--compare loose:DIR needs the directory of the loose files")
        if not os.path.isdir(root):
            raise UsageError(f"--compare loose:{root}: not a directory")
        return Peer("loose", root)
    raise UsageError(f"invalid --compare {text!r}: use loose:DIR or webdataset")


def run_bench(
    path: str,
    settings: BenchSettings,
    *,
    compare: Sequence[Peer] = (),
    opener: Opener | None = None,
) -> list[BenchRun]:
    """Bench shardio on ``path``, then each peer of ``compare`` with the same loop.

    Every runner is set up (trees listed, formats checked) before the first one runs, so a
    mistake shows at once, not after the shardio run.

    Raises:
        UsageError: a peer cannot read this dataset (webdataset on HDF5 shards), or a loose
            tree holds no regular file.
        ShardioError: a dataset or file cannot be read.
    """
    from shardio.runtime.peers import LooseRunner, WebDatasetRunner

    if not os.path.isdir(path):
        raise UsageError(f"no dataset directory {path}")
    runners: list[Runner] = []
    try:
        runners.append(ShardioRunner(path, settings, opener=opener))
        for peer in compare:
            if peer.kind == "loose" and peer.root is not None:
                runners.append(LooseRunner(peer.root, settings))
            else:
                runners.append(WebDatasetRunner(path, settings))
        runs = []
        for runner in runners:
            logger.info("bench: running %s", runner.name)
            runs.append(timed_loop(runner, settings))
            runner.close()  # its workers and files go before the next runner starts
        return runs
    finally:
        for runner in runners:
            runner.close()
