"""``Checkpointer``: asynchronous checkpoints on a cadence (full hourly, light every 10 min).

The training step pays for copying the state to host memory and nothing more: compressing,
writing, reading back, committing and pruning run on one background thread
(``shardio-checkpoint``). One save is in flight at a time: ``save`` waits for the one before
(bounded by ``stall_timeout_s``), ``maybe_save`` never waits and takes a due checkpoint at
the first step after the one in flight is done (due checkpoints coalesce into one). A
background failure is raised by the next call, with the original as ``__cause__``; the
checkpoint before it stays the latest.

Under torch.distributed every rank makes its Checkpointer and calls ``maybe_save`` at every
step: rank 0's clock decides when a checkpoint is due, and a save starts only when no rank
is still writing the one before (one small gather per call, on a gloo group of its own).
Every rank calls ``save``, ``maybe_save``, ``wait`` and ``close`` at the same points, and
every rank sees the same outcome of each: when one rank's call fails (its background save
failed, a bad state, a stall), every rank raises there, so a rank that catches the
CheckpointError and trains on is never one collective apart from the others.

A process that saves and exits at once (the final save, a SIGTERM handler) still writes
its checkpoint: at exit, the save in flight is waited for (up to ``stall_timeout_s``) and
the background thread stopped, before the interpreter tears anything down.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import typing
from collections.abc import Callable, Mapping
from typing import Any

from shardio._check import require_bool, require_int, require_path, require_seconds
from shardio.checkpoint import ranks
from shardio.checkpoint.naming import check_kind, check_step, new_token
from shardio.checkpoint.snapshot import copied_tensors, snapshot_bytes, to_host
from shardio.checkpoint.store import Plan
from shardio.checkpoint.writing import (
    SaveOptions,
    checked_payload,
    resolve_options,
    run_save_bounded,
)
from shardio.errors import CheckpointError, UsageError
from shardio.storage.stall import IoThreads

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)


class Checkpointer:
    """Saves checkpoints in the background, on a cadence or when asked.

    Args:
        directory: the checkpoint directory (created if missing).
        full_every_s: seconds between full checkpoints (``maybe_save``).
        light_every_s: seconds between light ones (a full one counts as one).
        keep_full: full checkpoints kept (older ones removed once a new one is checked).
        keep_light: light ones kept.
        loader: a loader whose ``state_dict()`` rides in every checkpoint.
        per_rank: every rank saves its own state (else rank 0's stands for all).
        reuse_buffers: copy each save's state into the host memory of the one before (the
            copy of a state of the same shapes then costs no new pages; the memory stays
            held between saves: twice the state in all).
        stall_timeout_s: how long a call waits for a save in flight before it raises.
        environ: where ``SLURM_JOB_ID`` is read (default: the process environment).
        clock: the cadence's clock (monotonic seconds).
        options: how to write (:class:`~shardio.checkpoint.writing.SaveOptions`), or its
            fields as keywords.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        full_every_s: float = 3600.0,
        light_every_s: float = 600.0,
        keep_full: int = 3,
        keep_light: int = 2,
        loader: Any = None,
        per_rank: bool = False,
        reuse_buffers: bool = True,
        stall_timeout_s: float = 1800.0,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        options: SaveOptions | None = None,
        **option_values: Any,
    ) -> None:
        self.directory = require_path(directory, "checkpoint directory")
        self.full_every_s = require_seconds(full_every_s, "full_every_s", positive=True)
        self.light_every_s = require_seconds(light_every_s, "light_every_s", positive=True)
        self.keep = {
            "full": require_int(keep_full, "keep_full", minimum=1, maximum=1_000_000),
            "light": require_int(keep_light, "keep_light", minimum=1, maximum=1_000_000),
        }
        self.stall_timeout_s = require_seconds(stall_timeout_s, "stall_timeout_s", positive=True)
        if loader is not None and not callable(getattr(loader, "state_dict", None)):
            raise UsageError(f"loader {type(loader).__name__} has no state_dict()")
        self.loader = loader
        self.per_rank = require_bool(per_rank, "per_rank")
        self.reuse_buffers = require_bool(reuse_buffers, "reuse_buffers")
        self._buffers: list[Any] = []
        if not callable(clock):
            raise UsageError(
                f"clock must be a function returning seconds (like time.monotonic), not {clock!r}"
            )
        self.clock = clock
        self.options = resolve_options(options, option_values)
        env = os.environ if environ is None else ranks.check_environ(environ)
        self.group = ranks.side_group()
        self.identity = ranks.resolve_identity(env, self.group)
        self._lock = threading.Condition()
        self._job: tuple[Plan, dict[str, Any], int] | None = None
        self._busy = False
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._pool = IoThreads(max_abandoned=2)
        self._last: dict[str, float] | None = None
        self.last_path: str | None = None
        self.last_stall_s = 0.0
        self.last_write_s = 0.0
        self.saves = 0

    # -- the training thread -------------------------------------------------------------

    def save(self, state: Any, *, kind: str = "full", step: int) -> None:
        """Save ``state`` now, in the background: returns once it is copied to host memory.

        Raises:
            CheckpointError: an earlier background save failed, or the one in flight did not
                finish within ``stall_timeout_s`` (on this rank or another: all raise).
            UsageError: a bad argument, or a state ``torch.load(weights_only=True)`` would
                not load back (the key and type named).
        """
        self._save(lambda: state, kind, step, None)

    def maybe_save(
        self,
        step: int,
        *,
        full: Callable[[], Any] | None = None,
        light: Callable[[], Any] | None = None,
    ) -> str | None:
        """Save when a checkpoint is due: ``full()`` every ``full_every_s``, ``light()``
        every ``light_every_s`` (the state made only when due). Never waits for a save in
        flight: a due one is taken at the first call after it. Returns the kind started, or
        None. The first call starts the clock.

        Raises:
            CheckpointError: an earlier background save failed (on this rank or another:
                every rank raises at the same call).
        """
        failure: Exception | None = None
        due: str | None = None
        busy = False
        try:
            step = check_step(step)
            if any(f is not None and not callable(f) for f in (full, light)):
                raise UsageError("full= and light= must be functions that return the state")
            self._check_open()
            self._raise_failure()
            now = self._now()
            if self._last is None:
                self._last = {"full": now, "light": now}
            if full is not None and now - self._last["full"] >= self.full_every_s:
                due = "full"
            elif light is not None and now - self._last["light"] >= self.light_every_s:
                due = "light"
            with self._lock:
                busy = self._busy
        except Exception as exc:  # said to every rank first: none is left in the gather
            failure = exc
        votes = ranks.gather((ranks.said(failure), due, busy), self.group)
        self._agree(failure, [why for why, _, _ in votes], f"checkpoint check at step {step}")
        due = votes[0][1]
        if due is None or any(b for _, _, b in votes):
            return None
        make = full if due == "full" else light
        problem = None
        if make is None:  # rank 0 has the callable, this rank has not: a caller's mistake
            problem = UsageError(f"rank 0 saves a {due} checkpoint: pass {due}= on every rank")
        self._save(make, due, step, problem)
        return str(due)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight (up to ``timeout_s``, default ``stall_timeout_s``).

        Raises:
            CheckpointError: it failed, or is still running after the wait (on this rank or
                another: every rank raises).
        """
        failure: Exception | None = None
        try:
            self._wait_idle(timeout_s)
            self._raise_failure()
        except Exception as exc:
            failure = exc
        said = ranks.gather(ranks.said(failure), self.group)
        self._agree(failure, said, "checkpoint wait")

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread (a second call does
        nothing).

        Raises:
            CheckpointError: the last save failed or did not finish in time (on any rank).
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._stop()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # the training failed, maybe on this rank alone: stop without a collective
            self._finish("while stopping after a failure")

    @property
    def busy(self) -> bool:
        """Whether a save is in flight."""
        with self._lock:
            return self._busy

    # -- inside ---------------------------------------------------------------------------

    def _save(self, make: Any, kind: str, step: int, problem: BaseException | None) -> None:
        """Prepare a save on this rank, agree with the others, then hand it to the thread."""
        began = time.perf_counter()
        failure: BaseException | None = problem
        job: tuple[dict[str, Any], int] | None = None
        now: float | None = None
        if failure is None:
            try:
                kind = check_kind(kind)
                step = check_step(step)
                self._check_open()
                self._wait_idle()
                self._raise_failure()
                now = self._now() if self._last is not None else None  # the cadence's
                job = self._copy(make())
            except Exception as exc:  # said to every rank first: none is left in the gather
                failure = exc
        votes = ranks.gather((ranks.said(failure), new_token()), self.group)
        self._agree(failure, [why for why, _ in votes], f"checkpoint of step {step} not saved")
        payload, size_hint = typing.cast("tuple[dict[str, Any], int]", job)  # no rank failed
        plan = Plan(
            directory=self.directory, identity=self.identity, kind=kind, step=step,
            token=str(votes[0][1]),
        )  # fmt: skip
        with self._lock:
            if self._closed:
                raise UsageError("this Checkpointer is closed")
            self._start()
            self._job = (plan, payload, size_hint)
            self._busy = True
            self._lock.notify_all()
        if self._last is not None and now is not None:
            self._last["light"] = now
            if kind == "full":
                self._last["full"] = now
        self.last_stall_s = time.perf_counter() - began

    def _copy(self, state: Any) -> tuple[dict[str, Any], int]:
        """This rank's payload, checked (what weights_only loads), copied to host memory."""
        own = state if self.per_rank or self.identity.rank == 0 else None
        checked = checked_payload(own, self.loader)  # before the copy: a refusal costs none
        state_copy = to_host(own, self._buffers if self.reuse_buffers else None)
        payload = {**checked, "state": state_copy, "loader": to_host(checked["loader"])}
        self._buffers = copied_tensors(state_copy) if self.reuse_buffers else []
        return payload, snapshot_bytes(state_copy)

    def _agree(self, failure: BaseException | None, said: list[str | None], what: str) -> None:
        """Raise on every rank when any rank's call failed: this rank's own exception, or a
        CheckpointError naming the ranks that failed."""
        if failure is not None:
            raise failure
        failed = [f"rank {r}: {why}" for r, why in enumerate(said) if why is not None]
        if failed:
            raise CheckpointError(f"{what}: {'; '.join(failed)}")

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this Checkpointer is closed")

    def _now(self) -> float:
        now = self.clock()
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise UsageError(f"clock() must return seconds as a finite number, not {now!r}")
        return float(now)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="shardio-checkpoint", daemon=True
            )
            self._thread.start()
            atexit.register(self._at_exit)

    def _stop(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            busy = self._busy
        thread = self._thread
        if thread is not None and not busy:
            thread.join(timeout=5.0)
        self._pool.close()
        atexit.unregister(self._at_exit)

    def _finish(self, why: str, level: int = logging.WARNING) -> None:
        """Wait for the save in flight and stop, on this rank alone; failures are logged."""
        try:
            self._wait_idle()
            self._raise_failure()
        except CheckpointError as err:
            logger.log(level, "%s: %s", why, err)
        finally:
            self._stop()

    def _at_exit(self) -> None:
        """At interpreter exit: the save in flight is written, the thread stopped, before
        the interpreter frees anything (a forked child, which did not start it, leaves it)."""
        if os.getpid() != self._pid or self._closed:
            return
        if self.busy:
            logger.info("waiting for the checkpoint save in flight before exiting")
        self._finish("the checkpoint saved at exit failed", logging.ERROR)

    def _wait_idle(self, timeout_s: float | None = None) -> None:
        limit = (
            self.stall_timeout_s
            if timeout_s is None
            else require_seconds(timeout_s, "timeout_s", positive=True)
        )
        with self._lock:
            if not self._lock.wait_for(lambda: not self._busy, timeout=limit):
                raise CheckpointError(
                    f"the checkpoint save in flight has not finished after {limit:g} s "
                    f"(stalled storage under {self.directory}?)"
                )

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._error = self._error, None
        if failure is not None:
            step, exc = failure
            raise CheckpointError(
                f"the background save of step {step} failed: {exc}; the checkpoint before "
                "it is still the latest"
            ) from exc

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                plan, payload, size_hint = self._job
                self._job = None
            began = time.perf_counter()
            try:
                path = run_save_bounded(
                    plan, payload, self.options, pool=self._pool, per_rank=self.per_rank,
                    size_hint=size_hint, keep=self.keep[plan.kind], check_state=False,
                )  # fmt: skip
            except BaseException as exc:  # surfaced by the next call
                logger.warning("checkpoint of step %d failed: %s", plan.step, exc)
                with self._lock:
                    self._error = (plan.step, exc)
                    self._buffers = []  # an abandoned write may still read them
            else:
                self.saves += 1
                if path is not None:
                    self.last_path = path
            finally:
                del payload
                self.last_write_s = time.perf_counter() - began
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()
