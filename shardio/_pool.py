"""Worker process pools of pack and verify: a bounded size, and stopped quietly by Ctrl-C.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the command and
each of its workers. A worker that let it raise KeyboardInterrupt while waiting for work
printed a traceback and broke the pool. Here the parent decides: workers are born ignoring
SIGINT (the forkserver they are forked from is started so), then install a handler that
stops the task they run, once, by raising KeyboardInterrupt inside it (so the task's own
cleanup removes its temp files) and refuses every later task. The pool sends that back as
the task's result, never printed. On KeyboardInterrupt the parent cancels what has not
started, forwards SIGINT to its workers (when only it got one: ``kill -INT PID``), waits
for them and re-raises; the CLI prints one line. While the pool runs, the parent's SIGINT
only sets a flag that its waits check (see :class:`WorkerPool`), so a second Ctrl-C cannot
break a lock half-way. Each worker also watches the process it works for and exits when
that one is gone (kill -9, the OOM killer), rather than wait for work forever.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType, TracebackType
from typing import Any, TypeVar

from shardio._check import require_int
from shardio._env import env_int

__all__ = ["MAX_WORKERS", "WorkerPool", "check_workers", "default_workers"]

MAX_WORKERS = 4096  # processes of one pack or verify
_WATCH_INTERVAL_S = 0.5  # how often a worker checks that the process it works for lives
_POLL_S = 0.1  # how often a wait for results looks whether Ctrl-C was pressed
# The forkserver listens on a socket at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a socket
# path holds at most 107 bytes: TMPDIR may be at most this long (a job's TMPDIR can be longer).
_MAX_SOCKET_BASE = 70

T = TypeVar("T")


def check_workers(workers: object, *, what: str = "--workers") -> int:
    """Return ``workers`` if it is a whole number of processes from 1 to MAX_WORKERS.

    Raises:
        UsageError: anything else (0, negative, huge, a float, a bool), naming ``what``.
    """
    return require_int(workers, what, minimum=1, maximum=MAX_WORKERS)


def default_workers(environ: Mapping[str, str] | None = None) -> int:
    """CPUs this job may use: SLURM's allocation first, then the affinity mask."""
    env = os.environ if environ is None else environ
    for var in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = env_int(env, var, minimum=1)  # a malformed count is refused, not skipped
        if value is not None:
            return min(value, MAX_WORKERS)  # a default, so capped rather than refused
    return min(MAX_WORKERS, max(1, len(os.sched_getaffinity(0))))


# --------------------------------------------------------------------------- in a worker


class _WorkerState:
    """What a worker's SIGINT handler knows: whether a task runs, and whether it was told
    to stop. One per worker process (set up by the pool's initializer)."""

    def __init__(self) -> None:
        self.in_task = False
        self.interrupted = False


_STATE = _WorkerState()


def _on_sigint(_signum: int, _frame: FrameType | None) -> None:
    first = not _STATE.interrupted
    _STATE.interrupted = True
    if first and _STATE.in_task:
        raise KeyboardInterrupt  # once: a second SIGINT must not break the task's cleanup


def _init_worker(
    parent_pid: int, initializer: Callable[..., object] | None, initargs: tuple[Any, ...]
) -> None:
    signal.signal(signal.SIGINT, _on_sigint)
    # The forkserver, not the process that runs the pool, is our parent, so
    # PR_SET_PDEATHSIG cannot help: watch that process and stop if it was killed (kill -9,
    # the OOM killer), rather than wait for work forever.
    threading.Thread(
        target=_watch_parent, args=(parent_pid,), name="shardio-watchdog", daemon=True
    ).start()
    if initializer is not None:
        initializer(*initargs)


def _watch_parent(pid: int) -> None:
    while True:
        time.sleep(_WATCH_INTERVAL_S)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)


def _call(fn: Callable[..., T], *args: Any) -> T:
    if _STATE.interrupted:
        raise KeyboardInterrupt  # a task queued before the stop: refused, not started
    _STATE.in_task = True
    try:
        return fn(*args)
    finally:
        _STATE.in_task = False


# --------------------------------------------------------------------------- the parent


def short_socket_dir() -> None:
    """Give multiprocessing a short directory for its sockets when TMPDIR is too long for one.

    The forkserver's socket lives in multiprocessing's temp dir, under TMPDIR; with a TMPDIR
    of more than about 70 bytes its path exceeds what a socket address holds and starting a
    pool failed with "AF_UNIX path too long". Then the dir is made under the first short,
    writable system temp dir instead and removed at exit, as multiprocessing removes its own
    (Python 3.12 does the same). Nothing else is written there.
    """
    # where multiprocessing.util.get_temp_dir() keeps its dir (not in the stubs)
    config: dict[str, Any] = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is not None:
        return
    if len(os.fsencode(tempfile.gettempdir())) <= _MAX_SOCKET_BASE:
        return
    for base in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            tempdir = tempfile.mkdtemp(prefix="pymp-", dir=base)
            multiprocessing.util.Finalize(None, shutil.rmtree, args=[tempdir], exitpriority=-100)
            config["tempdir"] = tempdir
            return


def _start_forkserver() -> None:
    """Start the forkserver (if not yet running) with SIGINT ignored, so that the workers
    forked from it ignore SIGINT until their handler is installed.

    Only the main thread may change a signal's handler; from another thread the forkserver
    starts as multiprocessing would start it.
    """
    short_socket_dir()
    if threading.current_thread() is not threading.main_thread():
        multiprocessing.forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


class WorkerPool:
    """A forkserver process pool of at most ``workers`` processes (see the module docstring).

    Processes start in ``__enter__``; ``__exit__`` waits for them. Tasks are module-level
    functions (sent by reference) and picklable arguments. Results are waited for through
    :meth:`map` and :meth:`as_completed`.

    In the main thread, while the pool runs, SIGINT only sets a flag (when it would have
    raised KeyboardInterrupt: its handler is Python's default): KeyboardInterrupt raised in
    the middle of a lock's or a condition's code, as a second Ctrl-C does, leaves the
    pool's threads waiting forever. The waits check the flag and raise KeyboardInterrupt
    themselves; the shutdown in ``__exit__`` cannot be interrupted, and a Ctrl-C that came
    during it is raised once it is over.
    """

    def __init__(
        self,
        workers: int,
        *,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        self._workers = check_workers(workers, what="workers")
        self._initializer = initializer
        self._initargs = initargs
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future[Any]] = []
        self._children_before: set[int] = set()
        self._interrupted = False
        self._previous_handler: Any = None  # the SIGINT handler to restore; None: not ours

    def __enter__(self) -> WorkerPool:
        _start_forkserver()
        self._children_before = {p.pid for p in multiprocessing.active_children() if p.pid}
        self._take_sigint()
        try:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self._workers,
                mp_context=multiprocessing.get_context("forkserver"),
                initializer=_init_worker,
                initargs=(os.getpid(), self._initializer, self._initargs),
            )
        except BaseException:
            self._give_back_sigint()
            raise
        return self

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` in a worker."""
        if self._pool is None:
            raise RuntimeError("WorkerPool.submit outside its with block")
        future = self._pool.submit(_call, fn, *args)
        self._futures.append(future)
        return future

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any]) -> list[T]:
        """``fn`` over the items (all submitted at once); the results in order.

        Raises:
            KeyboardInterrupt: Ctrl-C (or a worker's task was interrupted).
            Exception: the first exception a task raised.
        """
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=True)]
        for _ in self.as_completed(futures):
            pass
        return [f.result() for f in futures]

    def as_completed(
        self, futures: Iterable[concurrent.futures.Future[T]]
    ) -> Iterator[concurrent.futures.Future[T]]:
        """Each future once it is done, in the order they finish; a failed one raises its
        exception here (KeyboardInterrupt on Ctrl-C)."""
        pending = set(futures)
        while pending:
            self._check_interrupt()
            done, pending = concurrent.futures.wait(
                pending, timeout=_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                future.result()  # raises the task's exception
                yield future

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pool = self._pool
        if pool is None:
            return
        self._pool = None
        try:
            interrupted = self._interrupted or (
                exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
            )
            if exc_type is not None or interrupted:
                for future in self._futures:
                    future.cancel()  # those not started; a running one finishes or stops
            if interrupted:
                self._interrupt_workers()
            pool.shutdown(wait=True)  # bounded: a stopped worker ends its task at once
        finally:
            self._give_back_sigint()
        if self._interrupted and exc_type is None:
            raise KeyboardInterrupt  # a Ctrl-C during the shutdown

    # -- SIGINT ------------------------------------------------------------------------

    def _take_sigint(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # a signal reaches the main thread only: its own handler decides
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # ignored, or a caller's own handler: left as it is
        self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def _give_back_sigint(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None

    def _on_sigint(self, _signum: int, _frame: FrameType | None) -> None:
        self._interrupted = True  # raised by the next wait, never inside a lock's code

    def _check_interrupt(self) -> None:
        if self._interrupted:
            raise KeyboardInterrupt

    def _interrupt_workers(self) -> None:
        """SIGINT to this pool's workers (a terminal's Ctrl-C reached them already; a
        ``kill -INT`` of this process alone did not). A second one is ignored."""
        for child in multiprocessing.active_children():
            if child.pid and child.pid not in self._children_before:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGINT)
