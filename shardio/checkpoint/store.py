"""Checkpoint directories on disk: write one atomically, list them, check them, prune them.

A save writes every rank's file into a hidden temp directory (each file itself under a temp
name until complete and fsynced), then rank 0 writes the sealed manifest and renames the
directory to its final name (never over an existing one) and fsyncs the parent: before
that rename nothing of the checkpoint is visible, after it all of it is. The ranks meet
through the filesystem, not a collective, so a background save needs no process group: each
rank other than 0 leaves a small record once its file is written (or a ``.failed`` one), and
rank 0 waits for them, for a bounded time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from shardio._version import __version__
from shardio.checkpoint.codec import check_file, write_payload
from shardio.checkpoint.lease import claim
from shardio.checkpoint.manifest import (
    MAX_MANIFEST_BYTES,
    CheckpointManifest,
    RankFile,
    parse_manifest,
    parse_rank_file,
)
from shardio.checkpoint.naming import (
    MANIFEST_NAME,
    Identity,
    dir_name,
    fragment_name,
    is_checkpoint_name,
    is_temp_dir_name,
    rank_file_name,
    step_of_name,
    temp_dir_name,
)
from shardio.errors import (
    CheckpointError,
    CheckpointUnavailableError,
    FormatError,
    IntegrityError,
    ShardioError,
    StorageError,
)
from shardio.storage.atomic import (
    TEMP_MARK,
    atomic_write,
    create_temp,
    fsync_dir,
    publish,
    rename_noreplace,
    temp_path_for,
)
from shardio.storage.files import read_regular, rmdir_inside, unlink_inside
from shardio.storage.stall import IoThreads, call_with_deadline

__all__ = [
    "Listed",
    "Plan",
    "all_damaged",
    "commit",
    "discard_temp",
    "list_checkpoints",
    "make_directory",
    "make_temp_dir",
    "prune",
    "unavailable",
    "verify_files",
    "write_rank",
]

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_MAX_FRAGMENT_BYTES = 1 << 20
_MAX_ATTEMPTS = 100
_STAGING = ".new"  # the temp directory's name while rank 0 sets its layout
# What a save writes into its temp directory (and temp names of it): all a cleanup removes.
_TEMP_CONTENT = ("rank", "checkpoint_", ".checkpoint_", ".rank", f".{MANIFEST_NAME}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """One save, as every rank of it sees it: where, who, what, and the token they share."""

    directory: str
    identity: Identity
    kind: str
    step: int
    token: str

    @property
    def temp_dir(self) -> str:
        """The hidden directory the ranks write into."""
        return os.path.join(
            self.directory, temp_dir_name(self.identity, self.kind, self.step, self.token)
        )


def _real_dir(path: str) -> bool | None:
    """True: a directory (not a symlink to one) is at ``path``; False: something else is;
    None: nothing is (yet). One lstat, so that a directory appearing between two looks is
    never taken for something else."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None
    except OSError:
        return False


def make_directory(folder: str) -> None:
    """Create the checkpoint directory if missing; refuse a path that is not one.

    Raises:
        CheckpointError: it cannot be created, or something else is there.
    """
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            exc.errno or errno.EIO, f"cannot create checkpoint directory {folder}: {exc.strerror}"
        ) from exc
    if not os.path.isdir(folder):
        raise CheckpointError(errno.ENOTDIR, f"{folder} is not a directory")


def make_temp_dir(plan: Plan, *, layout: Callable[[str], None] | None) -> None:
    """Rank 0 creates the save's temp directory (and sets its layout); the others wait for it.

    Rank 0 makes it under a staging name, sets its stripe layout there and only then renames
    it to the name the others wait for: no rank creates its file before the layout is set (a
    file takes its directory's layout when it is created, never after).

    Raises:
        CheckpointError: it cannot be created, something else is at its name, or it did not
            appear within 60 s.
    """
    tmp = plan.temp_dir
    if plan.identity.rank == 0:
        make_directory(plan.directory)
        staging = tmp + _STAGING
        try:
            os.mkdir(staging, 0o755)
        except FileExistsError:
            raise CheckpointError(
                errno.EEXIST, f"{staging} exists already: another save has this token"
            ) from None
        except OSError as exc:
            raise CheckpointError(
                exc.errno or errno.EIO,
                f"cannot create checkpoint directory {staging}: {exc.strerror}",
            ) from exc
        try:
            if layout is not None:
                layout(staging)
            claim(plan.directory, plan.identity)  # no other live job saves here
            rename_noreplace(staging, tmp)
        except BaseException as exc:
            rmdir_inside(plan.directory, os.path.basename(staging))  # ours, and still empty
            if isinstance(exc, FileExistsError):
                raise CheckpointError(
                    errno.EEXIST, f"{tmp} exists already: another save has this token"
                ) from None
            if isinstance(exc, OSError) and not isinstance(exc, ShardioError):
                raise CheckpointError(
                    exc.errno or errno.EIO,
                    f"cannot create checkpoint directory {tmp}: {exc.strerror}",
                ) from exc
            raise
        return
    deadline = time.monotonic() + 60.0
    while (found := _real_dir(tmp)) is not True:
        if found is False:
            raise CheckpointError(errno.EEXIST, f"{tmp} is not a directory shardio made")
        if time.monotonic() > deadline:
            raise CheckpointError(
                errno.ETIMEDOUT, f"rank 0 did not create {tmp} within 60 s: is it saving?"
            )
        time.sleep(_POLL_S)


def write_rank(
    plan: Plan,
    payload: Any,
    *,
    has_state: bool,
    has_loader: bool,
    level: int | None,
    threads: int,
    verify: bool,
    timeout_s: float,
) -> RankFile:
    """Write this rank's file into the temp directory: temp name, fsync, rename.

    With ``verify``, the file is read back (its cached pages dropped first) and checked.

    Raises:
        StorageError: writing failed (ENOSPC named), or the read-back does not match.
    """
    ident = plan.identity
    name = rank_file_name(
        ident.host, ident.job_id, plan.kind, plan.step, ident.rank, zstd=level is not None
    )
    final = os.path.join(plan.temp_dir, name)
    tmp = temp_path_for(final)
    try:
        fd = create_temp(tmp)
    except OSError as exc:
        raise StorageError(exc.errno or errno.EIO, f"cannot create {tmp}: {exc.strerror}") from exc
    try:
        try:
            written = write_payload(fd, final, payload, level=level, threads=threads)
        finally:
            os.close(fd)
        publish(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if verify:
        pool = IoThreads(max_abandoned=2)
        try:
            check_file(
                final, size_bytes=written.size_bytes, xxh3_128=written.xxh3_128,
                timeout_s=timeout_s, pool=pool, uncached=True,
            )  # fmt: skip
        finally:
            pool.close()
    return RankFile(
        rank=ident.rank,
        host=ident.host,
        name=name,
        size_bytes=written.size_bytes,
        raw_bytes=written.raw_bytes,
        xxh3_128=written.xxh3_128,
        compression="none" if level is None else "zstd",
        has_state=has_state,
        has_loader=has_loader,
    )


def leave_fragment(plan: Plan, entry: RankFile | None, failure: str | None = None) -> None:
    """A rank other than 0 records its written file (or why it failed) for rank 0."""
    name = fragment_name(plan.identity.rank)
    body: dict[str, Any]
    if entry is None:
        name = name.replace(".json", ".failed")
        body = {"token": plan.token, "error": (failure or "failed")[:2000]}
    else:
        body = {"token": plan.token, "file": entry.to_json()}
    with atomic_write(os.path.join(plan.temp_dir, name)) as fh:
        fh.write(json.dumps(body).encode())


def _gather(plan: Plan, own: RankFile, timeout_s: float) -> list[RankFile]:
    """Rank 0 waits for every rank's record; their files, by rank."""
    world = plan.identity.world_size
    files: dict[int, RankFile] = {0: own}
    deadline = time.monotonic() + timeout_s
    while len(files) < world:
        for rank in range(1, world):
            if rank in files:
                continue
            path = os.path.join(plan.temp_dir, fragment_name(rank))
            failed = path.replace(".json", ".failed")
            if os.path.lexists(failed):
                raise CheckpointError(
                    errno.EIO, f"rank {rank} failed to write its part of {plan.temp_dir}: "
                    f"{_fragment(failed).get('error', '?')}"
                )  # fmt: skip
            if os.path.lexists(path):
                body = _fragment(path)
                if body.get("token") != plan.token:
                    raise CheckpointError(errno.EIO, f"{path} belongs to another save")
                try:
                    files[rank] = parse_rank_file(
                        body.get("file"), rank, path,
                        kind=plan.kind, step=plan.step, job_id=plan.identity.job_id,
                    )  # fmt: skip
                except FormatError as exc:
                    raise CheckpointError(errno.EIO, str(exc)) from None
        if len(files) < world:
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in files]
                raise CheckpointError(
                    errno.ETIMEDOUT, f"ranks {missing[:8]} did not finish their part of "
                    f"{plan.temp_dir} within {timeout_s:g} s: checkpoint not committed"
                )  # fmt: skip
            time.sleep(_POLL_S)
    return [files[r] for r in range(world)]


def _fragment(path: str) -> dict[str, Any]:
    try:
        body = json.loads(read_regular(path, max_bytes=_MAX_FRAGMENT_BYTES, nofollow=True))
    except (ValueError, StorageError) as exc:
        raise CheckpointError(errno.EIO, f"cannot read {path}: {exc}") from None
    if not isinstance(body, dict):
        raise CheckpointError(errno.EIO, f"{path} is not a rank's record")
    return body


def commit(
    plan: Plan,
    own: RankFile,
    *,
    per_rank: bool,
    loader: dict[str, int] | None,
    timeout_s: float,
    cancelled: threading.Event | None = None,
    clock_ns: Callable[[], int] = time.time_ns,
) -> tuple[str, CheckpointManifest]:
    """Rank 0: wait for the other ranks, write the manifest, rename the directory to its
    final name. Returns the final path and the manifest.

    Raises:
        CheckpointError: a rank failed or did not finish in time, or the rename failed.
    """
    files = _gather(plan, own, timeout_s)
    for entry in files:
        path = os.path.join(plan.temp_dir, entry.name)
        try:
            size = os.lstat(path).st_size
        except OSError:
            size = -1
        if size != entry.size_bytes:
            raise CheckpointError(errno.EIO, f"rank {entry.rank}'s file {path} is not complete")
    manifest = CheckpointManifest(
        kind=plan.kind,
        step=plan.step,
        job_id=plan.identity.job_id,
        world_size=plan.identity.world_size,
        per_rank=per_rank,
        saved_at_ns=clock_ns(),
        token=plan.token,
        files=tuple(files),
        loader=loader,
        shardio_version=__version__,
    )
    with atomic_write(os.path.join(plan.temp_dir, MANIFEST_NAME)) as fh:
        fh.write(manifest.to_bytes())
    for rank in range(1, plan.identity.world_size):
        unlink_inside(plan.temp_dir, fragment_name(rank))
    fsync_dir(plan.temp_dir)
    if cancelled is not None and cancelled.is_set():  # abandoned while it stalled
        raise CheckpointError(errno.ETIMEDOUT, f"the save into {plan.temp_dir} was abandoned")
    for attempt in range(_MAX_ATTEMPTS):
        final = os.path.join(plan.directory, dir_name(plan.identity, plan.kind, plan.step, attempt))
        try:
            rename_noreplace(plan.temp_dir, final)
        except FileExistsError:
            continue
        except OSError as exc:
            raise CheckpointError(
                exc.errno or errno.EIO, f"cannot publish checkpoint {final}: {exc.strerror}"
            ) from exc
        fsync_dir(plan.directory)
        return final, manifest
    raise CheckpointError(
        errno.EEXIST, f"{_MAX_ATTEMPTS} checkpoints of step {plan.step} exist in {plan.directory}"
    )


@dataclasses.dataclass(frozen=True)
class Listed:
    """One checkpoint directory found: its manifest, or why it has none that parses
    (``unreadable``: its manifest could not be read now, which says nothing of its state)."""

    path: str
    manifest: CheckpointManifest | None
    problem: str | None
    unreadable: bool = False


# A file that is not there, or not a file shardio wrote (a symlink, a FIFO): damage, not an
# outage. Any other error of the storage may pass (a server back, a permission restored).
_DAMAGE_ERRNOS = frozenset((errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EISDIR, errno.EINVAL))


def all_damaged(folder: str, skipped: list[tuple[str, str]]) -> CheckpointError:
    """The one-line error for a directory whose checkpoints are all damaged: each named,
    with why (the first five)."""
    reasons = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in skipped[:5])
    more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
    return CheckpointError(
        errno.EIO,
        f"every checkpoint in {folder} is damaged: {len(skipped)} found, none loads "
        f"({reasons}){more}; not a fresh start: restore or remove them",
    )


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc``, raised reading a checkpoint, says the storage could not be read now
    (a server down, a stalled read, a permission) rather than that the checkpoint is damaged
    (bytes or sizes that do not match, a malformed manifest, a missing or foreign file)."""
    if isinstance(exc, (IntegrityError, FormatError)) or not isinstance(exc, StorageError):
        return False
    if isinstance(exc, CheckpointError) and not isinstance(exc, CheckpointUnavailableError):
        return False  # a verdict on the checkpoint itself (torch.load refused it, ...)
    return exc.errno not in _DAMAGE_ERRNOS


def read_manifest(path: str) -> CheckpointManifest:
    """The manifest of the checkpoint directory ``path``.

    Raises:
        FormatError: it is malformed or fails its seal. StorageError: it cannot be read.
    """
    where = os.path.join(path, MANIFEST_NAME)
    data = read_regular(where, max_bytes=MAX_MANIFEST_BYTES, what="manifest", nofollow=True)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{where}: not JSON ({exc})") from None
    return parse_manifest(doc, where)


def list_checkpoints(
    directory: str, *, pool: IoThreads | None = None, timeout_s: float = 120.0
) -> tuple[list[Listed], list[str]]:
    """The checkpoints in ``directory``, newest first, and the temp directories of saves in
    flight or interrupted.

    Only real directories with a checkpoint's name count: a symlink is never followed. With
    ``pool``, each manifest is read under a ``timeout_s`` deadline (one on a dead server is
    listed as unreadable, not waited for).

    Raises:
        StorageError: ``directory`` cannot be listed.
    """
    try:
        if pool is None:
            dirs = _scan(directory)
        else:  # a dead metadata server holds a listing as long as a read
            dirs = call_with_deadline(
                pool, functools.partial(_scan, directory), timeout_s,
                f"listing the checkpoints in {directory}",
            )  # fmt: skip
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        reason = str(exc) if isinstance(exc, ShardioError) else exc.strerror
        raise CheckpointUnavailableError(
            exc.errno or errno.EIO,
            f"the checkpoints in {directory} cannot be read now (not damaged; retry): {reason}",
        ) from exc
    found: list[Listed] = []
    temps: list[str] = []
    for name in dirs:
        path = os.path.join(directory, name)
        if is_temp_dir_name(name):
            temps.append(path)
        elif is_checkpoint_name(name):
            found.append(_listed(path, pool, timeout_s))
    return sorted(found, key=_order_key, reverse=True), temps


def _scan(directory: str) -> list[str]:
    """The names of the real directories (no symlinks) in ``directory``, sorted."""
    names = []
    with os.scandir(directory) as it:
        for entry in it:
            try:
                real = entry.is_dir(follow_symlinks=False)
            except OSError:
                real = False
            if real:
                names.append(entry.name)
    return sorted(names)


def _dir_at(path: str) -> bool | None:
    """As :func:`_real_dir`, but an error other than "nothing there" is raised."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _listed(path: str, pool: IoThreads | None, timeout_s: float) -> Listed:
    """The checkpoint at ``path``, its manifest read (under the deadline, with ``pool``)."""
    try:
        if pool is None:
            manifest = read_manifest(path)
        else:
            manifest = call_with_deadline(
                pool, functools.partial(read_manifest, path), timeout_s,
                f"reading the manifest of {path}",
            )  # fmt: skip
    except ShardioError as exc:
        return Listed(path, None, str(exc), unreadable=unavailable(exc))
    return Listed(path, manifest, None)


def one_checkpoint(path: str, *, pool: IoThreads, timeout_s: float) -> Listed | None:
    """The one checkpoint at ``path`` (None: nothing is there), its manifest read under the
    deadline.

    Raises:
        CheckpointUnavailableError: whether it is there cannot be told now.
    """
    try:
        found = call_with_deadline(
            pool, functools.partial(_dir_at, path), timeout_s, f"looking for {path}"
        )
    except OSError as exc:
        raise CheckpointUnavailableError(
            exc.errno or errno.EIO,
            f"checkpoint {path} cannot be read now (not damaged; retry): {exc}",
        ) from exc
    if found is None:
        return None
    if found is False:
        return Listed(path, None, "not a directory (or not one shardio wrote)")
    return _listed(path, pool, timeout_s)


def _order_key(x: Listed) -> tuple[int, int]:
    """Newest first by step, then commit time; one whose manifest is unreadable by the step
    in its name and its directory's time (so that it is reported where it would stand)."""
    if x.manifest is not None:
        return x.manifest.order_key()
    try:
        when = os.lstat(x.path).st_mtime_ns
    except OSError:
        when = 0
    return (step_of_name(os.path.basename(x.path)), when)


def verify_files(
    listed: Listed, *, ranks: list[int] | None, timeout_s: float, pool: IoThreads
) -> list[str]:
    """Problems with the files of a checkpoint (all ranks', or those of ``ranks``); empty
    when every one matches its manifest."""
    if listed.manifest is None:
        return [listed.problem or "no manifest"]
    problems = []
    for entry in listed.manifest.files:
        if ranks is not None and entry.rank not in ranks:
            continue
        try:
            check_file(
                os.path.join(listed.path, entry.name), size_bytes=entry.size_bytes,
                xxh3_128=entry.xxh3_128, timeout_s=timeout_s, pool=pool,
            )  # fmt: skip
        except ShardioError as exc:
            problems.append(str(exc))
    return problems


def prune(
    directory: str, kind: str, keep: int, *, protect: str, timeout_s: float = 120.0
) -> list[str]:
    """Remove the checkpoints of ``kind`` older than the newest ``keep`` intact ones (``protect``,
    the one just written and checked, counts as one and is never removed).

    Only a checkpoint whose files were read and matched counts: a damaged one, or one that
    cannot be read now, is kept and not counted, so the last intact fallback is never removed
    in favour of one that would not load. Only what a checkpoint's manifest names is removed;
    a directory holding anything else is left with a warning. Nothing is removed when the
    directory cannot be listed. Returns the paths removed."""
    pool = IoThreads(max_abandoned=2)
    removed = []
    try:
        try:
            listed, _ = list_checkpoints(directory, pool=pool, timeout_s=timeout_s)
        except StorageError as exc:
            logger.warning("old checkpoints not pruned: %s", exc)
            return []
        intact = 0
        for old in listed:
            if old.manifest is None or old.manifest.kind != kind:
                continue
            if os.path.abspath(old.path) == os.path.abspath(protect):
                intact += 1
            elif intact >= keep:
                if _remove(old):
                    removed.append(old.path)
            elif not (problems := verify_files(old, ranks=None, timeout_s=timeout_s, pool=pool)):
                intact += 1
            else:
                logger.warning(
                    "checkpoint %s kept, not counted among the %d %s kept: %s",
                    old.path, keep, kind, problems[0],
                )  # fmt: skip
    finally:
        pool.close()
    return removed


def _remove(listed: Listed) -> bool:
    """Take a checkpoint out of sight (a rename to a temp name), then delete its files."""
    if listed.manifest is None:
        return False
    head, name = os.path.split(listed.path)
    doomed = os.path.join(head, f".{name}{TEMP_MARK}removing-{os.getpid()}")
    try:
        rename_noreplace(listed.path, doomed)
    except OSError as exc:
        logger.warning("cannot remove old checkpoint %s: %s", listed.path, exc)
        return False
    try:
        for entry in listed.manifest.files:
            unlink_inside(doomed, entry.name)
        unlink_inside(doomed, MANIFEST_NAME)
    except StorageError as exc:
        logger.warning("cannot remove old checkpoint %s: %s", listed.path, exc)
    if not rmdir_inside(head, os.path.basename(doomed)):
        logger.warning(
            "old checkpoint %s held files shardio did not write: left them in %s",
            listed.path,
            doomed,
        )
    return True


def discard_temp(plan: Plan) -> None:
    """Remove what a failed save wrote into its temp directory, then the directory."""
    _empty_temp(plan.directory, plan.temp_dir)


def _empty_temp(directory: str, tmp: str) -> bool:
    try:
        names = os.listdir(tmp)
    except OSError:
        return False
    for name in names:
        if name == MANIFEST_NAME or name.startswith(_TEMP_CONTENT):
            with contextlib.suppress(StorageError):
                unlink_inside(tmp, name)
    return rmdir_inside(directory, os.path.basename(tmp))


def remove_stale_temps(directory: str, *, older_than_s: float, keep: str | None) -> None:
    """Remove the temp directories of saves interrupted long ago (a killed job's): only
    checkpoint files, temp files, records and manifests in them are removed."""
    _, temps = list_checkpoints(directory)
    now = time.time()
    for tmp in temps:
        if keep is not None and os.path.basename(tmp) == os.path.basename(keep):
            continue
        try:
            if now - os.lstat(tmp).st_mtime < older_than_s:
                continue
        except OSError:
            continue
        if _empty_temp(directory, tmp):
            logger.info("removed %s, left by an interrupted save", tmp)
