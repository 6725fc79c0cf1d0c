"""Bounded waits for DataLoader workers: one stuck in the storage is left to a reaper.

A worker killed while a read of it waits on a dead data server does not end at once: the
kernel closes its files as it exits, and the close of a file on a FUSE or network filesystem
(a flush) waits for the client, which answers once it gives up on the server (MooseFS: about
2 minutes with its default 30 retries; Lustre: at eviction). torch's DataLoader joins each
worker for 5 s, terminates it and joins it for 5 s more; shardio's replacement of stalled
workers joined them too, and Python's exit (multiprocessing's exit handler) joins every child
with no bound at all. A dead server thus cost tens of seconds per replacement of the workers,
and a job could not end until the client gave up.

:func:`bound_workers` swaps a DataLoader iterator's worker handles for handles that share one
grace period: past it, a worker still alive is killed (SIGKILL), detached from
multiprocessing's children (exit does not wait for it) and reaped by a daemon thread
(``shardio-reaper``) whenever the kernel lets it go. :func:`kill_workers` and
:func:`stop_workers` are the loader's two ways to end its workers, both bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

from shardio.runtime import internals

__all__ = ["KILLED_GRACE_S", "STOP_GRACE_S", "bound_workers", "kill_workers", "stop_workers"]

logger = logging.getLogger(__name__)

# How long the workers of one iterator may take to end, all together: after SIGKILL (a
# process that can end does so in milliseconds), and after a polite request to stop (a worker
# may be finishing a batch; what it would deliver is discarded anyway).
KILLED_GRACE_S = 0.5
STOP_GRACE_S = 2.0


def _reap(process: Any) -> None:
    with contextlib.suppress(Exception):
        process.join()


class _Grace:
    """One grace period shared by the workers of an iterator."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class _BoundedWorker:
    """A worker's process handle whose joins end with the grace period: past it the worker
    is killed and handed to a reaper thread (see the module doc)."""

    def __init__(self, process: Any, grace: _Grace) -> None:
        self.process = process
        self.grace = grace
        self.abandoned = False

    @property
    def pid(self) -> int | None:
        pid: int | None = self.process.pid
        return pid

    def is_alive(self) -> bool:
        return not self.abandoned and bool(self.process.is_alive())

    def join(self, timeout: float | None = None) -> None:
        if self.abandoned:
            return
        left = self.grace.left()
        with contextlib.suppress(Exception):
            self.process.join(left if timeout is None else min(float(timeout), left))
        if self.grace.left() <= 0 and self.is_alive():
            self.abandon()

    def terminate(self) -> None:
        if not self.abandoned:
            with contextlib.suppress(Exception):
                self.process.terminate()

    def kill(self) -> None:
        if not self.abandoned:
            with contextlib.suppress(Exception):
                self.process.kill()

    def abandon(self) -> None:
        """Kill the worker, stop counting it as a child of this process, reap it later."""
        self.abandoned = True
        process = self.process
        with contextlib.suppress(Exception):
            process.kill()
        internals.forget_child(process)  # exit would join it without a bound
        logger.warning(
            "DataLoader worker %s did not end within its grace period (a read of it waits on "
            "the storage): left to a reaper thread",
            self.pid,
        )
        if internals.parent_pid(process) in (None, os.getpid()):  # unknown: try; _reap copes
            threading.Thread(
                target=_reap, args=(process,), name="shardio-reaper", daemon=True
            ).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.process, name)

    def __repr__(self) -> str:
        return f"_BoundedWorker({self.process!r})"


def bound_workers(batches: Any, grace_s: float) -> None:
    """Make every later join of the workers of the DataLoader iterator ``batches`` end within
    ``grace_s`` from now, all together (workers already bounded keep the earlier end when it
    comes first); takes them off torch's SIGCHLD watch."""
    workers = internals.workers(batches)
    if not workers:
        return
    internals.unwatch(batches)
    grace = _Grace(grace_s)
    bounded = []
    for worker in workers:
        if isinstance(worker, _BoundedWorker):
            if worker.grace.end > grace.end:
                worker.grace = grace
            bounded.append(worker)
        else:
            bounded.append(_BoundedWorker(worker, grace))
    internals.replace_workers(batches, bounded)


def kill_workers(batches: Any) -> None:
    """SIGKILL the workers of a DataLoader iterator (a worker blocked in a FUSE or network
    filesystem wait is killable, not interruptible) and bound their shutdown to
    :data:`KILLED_GRACE_S`: one whose exit waits on the storage is left to a reaper."""
    internals.unwatch(batches)
    for worker in internals.workers(batches):
        pid = getattr(worker, "pid", None)
        if pid is not None and worker.is_alive():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    bound_workers(batches, KILLED_GRACE_S)
    for worker in internals.workers(batches):
        worker.join()


def stop_workers(batches: Any, grace_s: float = STOP_GRACE_S) -> None:
    """Shut down the workers of a DataLoader iterator the DataLoader's way, in at most
    ``grace_s`` (plus the queues' own bounded waits)."""
    bound_workers(batches, grace_s)
    internals.shutdown(batches)
