"""Periodic reporters of metrics snapshots: the thread they share, a log line, a JSON line.

A reporter takes a *source*, any zero-argument callable that returns a
:class:`~shardio.metrics.snapshots.MetricsSnapshot` (``loader.metrics`` is one), and reports
what it returns every ``interval_s`` from a thread of its own named
``shardio-metrics-<kind>``. The thread starts in :meth:`PeriodicReporter.start` (or
``__enter__``), never earlier; :meth:`PeriodicReporter.close` (or ``__exit__``) stops and joins
it, then reports once more, so the last figures of a run are never lost.

The first report is taken in :meth:`PeriodicReporter.start`, before training has delivered
anything. So that the first real figures follow the first batches instead of a full interval
of zeros, the thread then looks at the source every :data:`FIRST_POLL_S` until a snapshot
holds a delivered batch and the sink took it
(:meth:`PeriodicReporter.delivered`), for one interval at most. A look that finds only zeros
reports nothing (no log line of zeros); from the first real report on, one report follows
every ``interval_s``.

Metrics must never stop training: a source or sink that fails, at ``start()`` or later, is
logged once per distinct error (repeats go to the debug level) and the reporter
carries on at the next interval; a thread that cannot be started leaves only the last report
at close. Only arguments wrong in themselves raise, from the constructor.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import threading
from collections.abc import Callable
from typing import ClassVar, TypeVar

from shardio._check import require_path, require_seconds
from shardio.errors import StorageError, UsageError
from shardio.metrics.snapshots import MetricsSnapshot
from shardio.storage.atomic import storage_error
from shardio.storage.files import describe_kind

__all__ = [
    "FIRST_POLL_S",
    "JsonlWriter",
    "LogReporter",
    "PeriodicReporter",
    "SnapshotSource",
    "first_polls",
]

logger = logging.getLogger(__name__)

SnapshotSource = Callable[[], MetricsSnapshot]
_R = TypeVar("_R", bound="PeriodicReporter")
# Distinct errors remembered for "log once"; past this, new ones go to the debug level too
# (a message that embeds a changing value must not grow the set without bound).
_MAX_DISTINCT_ERRORS = 64
CLOSE_TIMEOUT_S = 10.0  # how long close() waits for a report in flight
# Until a first real report, the thread looks this often (for one interval at most).
FIRST_POLL_S = 0.5


class PeriodicReporter:
    """Calls a source every ``interval_s`` from a thread and hands the snapshot to :meth:`emit`.

    Subclasses set :attr:`kind`, implement :meth:`emit`, and may acquire what they write to
    in :meth:`open` and release it in :meth:`release`.

    Attributes:
        source: the zero-argument callable that returns a snapshot.
        interval_s: seconds between reports.
    """

    kind: ClassVar[str] = "reporter"
    failure_logger: ClassVar[logging.Logger] = logger

    def __init__(self, source: SnapshotSource, *, interval_s: float) -> None:
        """Check the arguments; nothing starts before :meth:`start`.

        Raises:
            UsageError: ``source`` is not callable or ``interval_s`` is not > 0.
        """
        if not callable(source):
            raise UsageError(f"a metrics source must be callable, not {type(source).__name__}")
        self.source = source
        self.interval_s = require_seconds(interval_s, "interval_s", positive=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._report_lock = threading.Lock()  # one report at a time (thread, report(), close)
        self._errors_lock = threading.Lock()
        self._errors_seen: set[tuple[str, str, str]] = set()
        self._state = "new"  # "new" -> "running" -> "closed"
        self._first_done = False  # a report with figures reached the sink (see _run)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self: _R) -> _R:
        """Acquire the sink and start the reporting thread (again: a no-op).

        A sink that cannot be opened is the subclass's to log (see :meth:`open`); a thread
        that cannot be started is logged, and the reporter reports once more at close.

        Raises:
            UsageError: the reporter was closed.
        """
        if self._state == "closed":
            raise UsageError(f"this metrics {self.kind} reporter is closed; make a new one")
        if self._state == "running":
            return self
        self.open()
        self._state = "running"
        thread = threading.Thread(target=self._run, name=f"shardio-metrics-{self.kind}")
        # A daemon thread: a reporter nobody closed must not keep the job alive at exit.
        thread.daemon = True
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": the job trains on
            self.log_failure(f"starting the metrics {self.kind} thread", exc)
            return self
        except BaseException:
            self._state = "closed"
            self.release()
            raise
        self._thread = thread
        return self

    def close(self) -> None:
        """Stop and join the thread, report one last time, release the sink (again: a no-op).

        Never raises for a failing source or sink (that is logged), so it is safe in a
        ``finally`` of a training loop.
        """
        if self._state != "running":
            self._state = "closed"
            return
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(CLOSE_TIMEOUT_S)
            if thread.is_alive():
                # Its sink stalls (a hung network filesystem): the end of training must not
                # wait on it. The daemon thread is left behind; no last report races it.
                self._state = "closed"
                self.log_failure(
                    f"closing the metrics {self.kind} reporter",
                    TimeoutError(f"its sink did not return within {CLOSE_TIMEOUT_S:g} s"),
                )
                return
        try:
            self.report()
        finally:
            self._state = "closed"
            try:
                self.release()
            except Exception as exc:
                self.log_failure(f"closing the metrics {self.kind} reporter", exc)

    def __enter__(self: _R) -> _R:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """Whether the reporter was started and not yet closed."""
        return self._state == "running"

    # -- reporting ------------------------------------------------------------------------
    def report(self) -> bool:
        """Take a snapshot and report it now, in the calling thread.

        Returns:
            Whether it was reported; a failure is logged (once per distinct error).

        Raises:
            UsageError: the reporter is not running.
        """
        if self._state != "running":
            raise UsageError(f"this metrics {self.kind} reporter is not running; start() it")
        return self._report(figures_only=False)

    def _report(self, *, figures_only: bool) -> bool:
        with self._report_lock:
            try:
                snap = self.source()
            except Exception as exc:  # a broken source must not break training
                self.log_failure("taking a metrics snapshot", exc)
                return False
            if figures_only and not snap.has_data:
                return False
            try:
                self.emit(snap)
            except Exception as exc:
                self.log_failure(f"reporting metrics ({self.kind})", exc)
                return False
            # The first real report holds a delivered batch: one taken while the first batch
            # was being read (samples counted, no batch yet) would leave the batches at zero
            # for a whole interval.
            if snap.has_data and (snap.batches > 0 or not figures_only) and self.delivered():
                self._first_done = True
        return True

    def log_failure(self, action: str, exc: BaseException) -> None:
        """Log a failure at warning level the first time it is seen, at debug level after."""
        key = (action, type(exc).__qualname__, str(exc))
        with self._errors_lock:
            first = key not in self._errors_seen and len(self._errors_seen) < _MAX_DISTINCT_ERRORS
            if first:
                self._errors_seen.add(key)
        if first:
            self.failure_logger.warning(
                "%s failed (logged once; metrics go on): %s: %s",
                action,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        else:
            self.failure_logger.debug("%s failed again: %s: %s", action, type(exc).__name__, exc)

    def _run(self) -> None:
        # The report at start() came before any batch: look again every FIRST_POLL_S until
        # a real one reached the sink, for one interval at most, then report every interval.
        polls = first_polls(self.interval_s)
        looked = 0
        while looked < polls and not self._first_done:
            if self._stop.wait(FIRST_POLL_S):
                return
            looked += 1
            self._report(figures_only=True)
        if not self._first_done:  # nothing real yet: the regular report, one interval in
            if self._stop.wait(self.interval_s - looked * FIRST_POLL_S):
                return
            self._report(figures_only=False)
        while not self._stop.wait(self.interval_s):
            self._report(figures_only=False)

    # -- what subclasses provide ----------------------------------------------------------
    def open(self) -> None:
        """Acquire what the reports go to (called by :meth:`start`, before the thread); a
        sink that cannot be acquired is logged (:meth:`log_failure`), never raised."""

    def emit(self, snap: MetricsSnapshot) -> None:
        """Report one snapshot (called from the thread, or from :meth:`close`)."""
        raise NotImplementedError

    def release(self) -> None:
        """Release what :meth:`open` acquired (called by :meth:`close`, after the thread)."""

    def delivered(self) -> bool:
        """Whether the last :meth:`emit` reached the reports' readers (a sink that has
        nowhere to write yet says no, and the thread looks again soon; see the module
        docstring)."""
        return True


def first_polls(interval_s: float) -> int:
    """How many looks for a first real report fit in one interval, every
    :data:`FIRST_POLL_S` (0 for an interval that short: the regular report comes as soon)."""
    return max(0, math.ceil(interval_s / FIRST_POLL_S) - 1)


class LogReporter(PeriodicReporter):
    """Logs :meth:`MetricsSnapshot.line` every ``interval_s``.

    Example:
        >>> with LogReporter(loader.metrics, interval_s=60):  # doctest: +SKIP
        ...     train(loader)
    """

    kind: ClassVar[str] = "log"

    def __init__(
        self,
        source: SnapshotSource,
        *,
        interval_s: float = 60.0,
        logger: logging.Logger | None = None,
        level: int = logging.INFO,
    ) -> None:
        """Args:
            source: returns the snapshot to log.
            interval_s: seconds between lines.
            logger: where the lines go (default: this module's logger).
            level: their level.

        Raises:
            UsageError: an argument is invalid.
        """
        super().__init__(source, interval_s=interval_s)
        if not isinstance(level, int) or isinstance(level, bool):
            raise UsageError(f"level must be a logging level (an int), not {level!r}")
        self.logger = logger if logger is not None else logging.getLogger(__name__)
        self.level = level

    def emit(self, snap: MetricsSnapshot) -> None:
        """Log the snapshot's one-line summary."""
        self.logger.log(self.level, "%s", snap.line())


class JsonlWriter(PeriodicReporter):
    """Appends one JSON line per interval to a file: :meth:`MetricsSnapshot.to_dict`, plus
    ``"job"`` when given.

    The file is opened in :meth:`start` for appending (``O_APPEND | O_CREAT | O_NOFOLLOW``):
    an existing file is never truncated, and a symlink, FIFO, directory or device is refused.
    Each line is written whole with one ``write`` (no buffering to lose), not fsynced. A file
    that cannot be opened (or written: a full disk) is logged once and tried again at the next
    interval: training goes on.

    Attributes:
        path: the file.
        job: the job name added to each line (None: none).
    """

    kind: ClassVar[str] = "jsonl"

    def __init__(
        self,
        source: SnapshotSource,
        path: str | os.PathLike[str],
        *,
        interval_s: float = 10.0,
        job: str | None = None,
    ) -> None:
        """Args:
            source: returns the snapshot to write.
            path: the JSON-lines file (created if missing, appended to otherwise).
            interval_s: seconds between lines.
            job: a job name to add to every line.

        Raises:
            UsageError: an argument is invalid.
        """
        super().__init__(source, interval_s=interval_s)
        name = require_path(path, "JsonlWriter path")
        if job is not None and not isinstance(job, str):
            raise UsageError(f"job must be a string, not {job!r}")
        self.path = name
        self.job = job
        self._fd: int | None = None
        self._torn = False  # the last write stopped mid-line: start the next on a new line

    def open(self) -> None:
        """Open the file for appending; one that cannot be (a symlink, not a regular file,
        a directory not writable) is logged, and each report tries again."""
        try:
            self._fd = open_for_append(self.path, what="metrics log")
        except StorageError as exc:  # logged as the reports that try again will be: once
            self.log_failure(f"reporting metrics ({self.kind})", exc)

    def emit(self, snap: MetricsSnapshot) -> None:
        """Append the snapshot as one JSON line (opening the file first if :meth:`open`
        could not).

        Raises:
            StorageError: the file cannot be opened or written (the caller logs it).
        """
        if self._fd is None:
            self._fd = open_for_append(self.path, what="metrics log")
        data = snap.to_dict()
        if self.job is not None:
            data["job"] = self.job
        line = json.dumps(data, separators=(",", ":")) + "\n"
        if self._torn:
            line = "\n" + line
        view = memoryview(line.encode())
        self._torn = True
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise storage_error(exc, self.path, "appending to") from exc
        self._torn = False

    def release(self) -> None:
        """Close the file."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def open_for_append(path: str, *, what: str) -> int:
    """Open (or create, mode 0644) a regular file for appending, never through a symlink.

    Raises:
        StorageError: ``path`` is a symlink or not a regular file, or cannot be opened.
    """
    flags = (
        os.O_WRONLY
        | os.O_APPEND
        | os.O_CREAT
        | os.O_NOFOLLOW
        | os.O_NONBLOCK  # a FIFO fails at once (ENXIO) instead of waiting for a reader
        | os.O_NOCTTY
        | os.O_CLOEXEC
    )
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorageError(
                exc.errno, f"{what} {path} is a symlink: shardio does not write through symlinks"
            ) from exc
        if exc.errno in (errno.ENXIO, errno.EISDIR):
            kind = "FIFO (named pipe)" if exc.errno == errno.ENXIO else "directory"
            raise StorageError(exc.errno, f"{what} {path} is a {kind}, not a regular file") from exc
        raise storage_error(exc, path, f"opening {what}") from exc
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise storage_error(exc, path, f"opening {what}") from exc
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise StorageError(
            errno.EINVAL, f"{what} {path} is a {describe_kind(mode)}, not a regular file"
        )
    return fd
