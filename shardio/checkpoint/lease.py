"""Who owns a checkpoint directory: one live job at a time saves into it and loads from it.

Two live jobs saving into one directory (a job submitted twice, an array sharing one
``SHARDIO_CKPT_DIR``) would prune each other's checkpoints and resume each other's model.
Rank 0 of a saving job holds a lease on the directory: ``.shardio-owner`` (a symlink whose
target is the record, so that reading it needs the metadata server only, no data server)
names the owner (the SLURM job id; outside SLURM the host and process id) and is renewed at
every save. Another job is refused, in one line, while the owner is alive; once it is gone (its
SLURM job has left the queue or is no longer running, its process on this host is dead, or
its lease was not renewed for ``LEASE_TTL_S`` where neither can be asked) the next job takes
the lease over: a job chain, a requeue (same job id) and a retried ``srun`` keep working.
The lease is read and written under a short mutex (an ``mkdir``, atomic on every parallel
filesystem), so two jobs cannot both take a free one; a mutex left by a killed claim is
broken by one waiter only (:func:`_break_if_stale`). Loading one given checkpoint and
``shardio checkpoint ls|verify|latest`` only read: they neither check nor take the lease.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from shardio.checkpoint.naming import NO_JOB, Identity, clean_host, is_job_id
from shardio.errors import CheckpointError, ShardioError, wrap_os_error
from shardio.storage.atomic import TEMP_MARK
from shardio.storage.runner import CommandRunner, run_command

__all__ = ["LEASE_NAME", "LEASE_TTL_S", "Owner", "check_not_owned", "claim", "read_owner"]

logger = logging.getLogger(__name__)

LEASE_NAME = ".shardio-owner"
LEASE_TTL_S = 6 * 3600.0  # unrenewed this long, and nothing else can tell: the owner is gone
_MUTEX = ".shardio-owner.lock"
_MUTEX_STALE_S = 60.0  # a claim takes milliseconds: a mutex this old was left by a killed one
_MUTEX_WAIT_S = 90.0  # longer than a stale one lives: a killed claim never fails the next
_NO_SYMLINKS = frozenset(
    getattr(errno, n) for n in ("EPERM", "EOPNOTSUPP", "ENOTSUP", "ENOSYS") if hasattr(errno, n)
)
# squeue's states of a job that still runs (or may run again without a new id, and so may
# write): anything else, or a job squeue no longer knows, is gone.
_LIVE_STATES = frozenset(
    ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT")
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Owner:
    """The job holding a checkpoint directory.

    Attributes:
        job_id: its SLURM job id (``nojob`` outside SLURM).
        host: rank 0's host.
        pid: rank 0's process id.
        renewed_ns: when it last saved (wall clock, nanoseconds).
    """

    job_id: str
    host: str
    pid: int
    renewed_ns: int

    def same_job(self, other: Owner) -> bool:
        """Whether ``other`` is this job (a requeue or a retried srun keeps the SLURM id;
        outside SLURM only the same process is)."""
        if self.job_id != other.job_id:
            return False
        return self.job_id != NO_JOB or (self.host, self.pid) == (other.host, other.pid)

    def describe(self) -> str:
        """The owner, for messages."""
        who = f"job {self.job_id}" if self.job_id != NO_JOB else "a process"
        return f"{who} (pid {self.pid} on {self.host})"


def me(job_id: str, host: str, clock_ns: Callable[[], int] = time.time_ns) -> Owner:
    """This process of job ``job_id`` on ``host``, as a lease names it."""
    return Owner(job_id=job_id, host=host, pid=os.getpid(), renewed_ns=clock_ns())


def _other_live(owner: Owner | None, here: Owner, runner: CommandRunner, now_ns: int) -> bool:
    if owner is None or owner.same_job(here) or (owner.host, owner.pid) == (here.host, here.pid):
        return False
    return _alive(owner, here, runner, now_ns)


def read_owner(directory: str) -> Owner | None:
    """The owner recorded in ``directory`` (None: no lease, or one that does not parse, which
    nobody can be refused on the word of).

    Raises:
        StorageError: the lease cannot be read (a server down): nothing is decided on it.
    """
    path = os.path.join(directory, LEASE_NAME)
    try:
        data = os.readlink(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # not a symlink: not a lease shardio wrote
            return None
        raise wrap_os_error(exc, f"cannot read the lease {path}: {exc.strerror}") from exc
    return _parse(data)


def _parse(data: str) -> Owner | None:
    """The owner a lease's target records (None: not what shardio writes)."""
    try:
        doc = json.loads(data)
        owner = Owner(
            job_id=str(doc["job_id"]), host=str(doc["host"]), pid=int(doc["pid"]),
            renewed_ns=int(doc["renewed_ns"]),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if not is_job_id(owner.job_id) or clean_host(owner.host) != owner.host:
        return None  # not what a lease holds: nobody is refused on its word
    return owner if 0 < owner.pid < 1 << 31 else None


def _foreign(path: str) -> bool:
    """Whether something that is not a lease shardio wrote sits at ``path`` (a file, a
    directory, a symlink that records no owner): it is left alone, never replaced."""
    try:
        data = os.readlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        return exc.errno == errno.EINVAL  # not a symlink
    return _parse(data) is None


def _alive(owner: Owner, here: Owner, runner: CommandRunner, now_ns: int) -> bool:
    """Whether ``owner`` may still be running (and so saving): SLURM is asked about a SLURM
    job, this host's process table about a process of this host, else the lease's age."""
    if owner.job_id != NO_JOB:
        try:
            found = runner(["squeue", "-h", "-j", owner.job_id, "-o", "%T"], timeout_s=30.0)
        except ShardioError as exc:  # no SLURM here: what follows decides
            logger.debug("cannot ask squeue about job %s: %s", owner.job_id, exc)
        else:
            if found.ok:
                states = {s.strip().upper() for s in found.stdout.split()}
                return bool(states & _LIVE_STATES)
            if "invalid job id" in found.stderr.lower():
                return False  # purged from the queue: long finished
    if owner.host == here.host:
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True  # EPERM: a process of another user has that pid
        return True
    return now_ns - owner.renewed_ns < LEASE_TTL_S * 1e9


@contextlib.contextmanager
def _mutex(directory: str) -> Iterator[None]:
    path = os.path.join(directory, _MUTEX)
    deadline = time.monotonic() + _MUTEX_WAIT_S
    while True:
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            if _break_if_stale(path):
                continue
            if time.monotonic() > deadline:
                raise CheckpointError(
                    errno.EBUSY, f"the lease of {directory} is held by a claim for "
                    f"{_MUTEX_WAIT_S:g} s ({path}): another job is saving there?"
                ) from None  # fmt: skip
            time.sleep(0.05)
        except OSError as exc:
            raise wrap_os_error(
                exc, f"cannot lock {path}: {exc.strerror}", CheckpointError
            ) from exc
    try:
        yield None
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _stale(path: str) -> os.stat_result | None:
    """``path``'s status when it is older than a claim lasts (a killed one left it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if time.time() - st.st_mtime > _MUTEX_STALE_S else None


def _break_if_stale(path: str) -> bool:
    """Remove the mutex at ``path`` when a killed claim left it; whether it was removed.

    Two waiters may find the same stale mutex at once: the one that removed it would take
    a new one, which the other must not then remove as stale. So a waiter first takes a
    second mutex (``path.break``, by ``mkdir``) and, holding it, looks again: only a mutex
    that is still the same stale directory (inode and time) is removed; a fresh one is left
    alone. A ``.break`` left by a waiter killed in those milliseconds is itself moved away
    once stale, by a rename to a name of the waiter's own: only the waiter whose rename
    takes the directory seen stale removes it.
    """
    seen = _stale(path)
    if seen is None:
        return False
    guard = f"{path}.break"
    try:
        os.mkdir(guard, 0o700)
    except FileExistsError:
        left = _stale(guard)
        if left is not None:  # a killed breaker's: the winner of the rename removes it
            _remove_renamed(guard, expect_ino=left.st_ino)
        return False
    except OSError:
        return False
    try:
        now = _stale(path)
        if now is None or (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
            return False  # taken anew (or released) since it was seen stale
        try:  # only breakers holding the guard remove a mutex: this is the one seen stale
            os.rmdir(path)
        except OSError:
            return False  # not an empty directory (not a mutex of ours): wait, then say so
        logger.info(
            "removed %s, left by a claim killed %.0f s ago", path, time.time() - now.st_mtime
        )
        return True
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(guard)


def _remove_renamed(path: str, *, expect_ino: int | None = None) -> bool:
    """Rename the directory ``path`` to a name of this call's own, then remove it; whether
    this call did (False: another renamed it first, or what was renamed is not the empty
    directory ``expect_ino`` seen, which is then put back)."""
    aside = f"{path}.stale-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    try:
        os.rename(path, aside)
    except OSError:
        return False  # another waiter's rename won
    try:
        if expect_ino is not None and os.lstat(aside).st_ino != expect_ino:
            raise OSError(errno.ESTALE, "not the directory seen")
        os.rmdir(aside)
    except OSError:
        with contextlib.suppress(OSError):
            os.rename(aside, path)  # not ours to remove: put it back as it was
        return False
    return True


def _refusal(directory: str, owner: Owner, doing: str) -> CheckpointError:
    return CheckpointError(
        errno.EBUSY,
        f"{directory} belongs to {owner.describe()}, which is still running: {doing} (two "
        "live jobs would prune and resume each other's checkpoints; give each job its own "
        f"directory, or remove {LEASE_NAME} once that job is gone)",
    )


def claim(
    directory: str, identity: Identity, *, runner: CommandRunner = run_command,
    clock_ns: Callable[[], int] = time.time_ns,
) -> None:  # fmt: skip
    """Rank 0 of a save: take or renew the lease on ``directory``.

    Raises:
        CheckpointError: another live job holds it (EBUSY), or it cannot be written.
    """
    here = me(identity.job_id, identity.hosts[0], clock_ns)
    with _mutex(directory):
        owner = read_owner(directory)
        if owner is not None and _other_live(owner, here, runner, clock_ns()):
            raise _refusal(directory, owner, "not saved")
        if owner is not None and not owner.same_job(here):
            logger.info("taking over %s from %s, which is gone", directory, owner.describe())
        _write(directory, here)


def _write(directory: str, owner: Owner) -> None:
    """Publish ``owner`` as the lease: a symlink whose target is the record, renamed over the
    old one (a symlink is metadata only: reading it needs the metadata server, no data
    server, so a dead data server never makes a lease unreadable)."""
    path = os.path.join(directory, LEASE_NAME)
    if _foreign(path):  # not shardio's: saves go on, unguarded, and it is left as it is
        logger.warning(
            "no lease on %s: %s is not a lease shardio wrote (left alone)", directory, path
        )
        return
    tmp = f"{path}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(json.dumps(dataclasses.asdict(owner), sort_keys=True), tmp)
        os.rename(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if exc.errno in _NO_SYMLINKS:  # a filesystem without symlinks: saves go on, unguarded
            logger.warning("no lease on %s (symlinks unsupported: %s)", directory, exc.strerror)
            return
        raise wrap_os_error(
            exc, f"cannot write the lease {path}: {exc.strerror}", CheckpointError
        ) from exc


def check_not_owned(
    directory: str, *, job_id: str, host: str, runner: CommandRunner = run_command,
    clock_ns: Callable[[], int] = time.time_ns,
) -> None:  # fmt: skip
    """Refuse to load from ``directory`` while another live job saves into it (its
    checkpoints are that job's model, and it would go on pruning them).

    Raises:
        CheckpointError: another live job holds the lease (EBUSY).
    """
    owner = read_owner(directory)
    if owner is not None and _other_live(owner, me(job_id, host, clock_ns), runner, clock_ns()):
        raise _refusal(directory, owner, "its checkpoints are not loaded")
