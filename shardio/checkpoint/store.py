"""Writing a checkpoint directory atomically: each rank's file, the sealed manifest, the rename.

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
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from shardio._version import __version__
from shardio.checkpoint.catalog import list_checkpoints
from shardio.checkpoint.codec import check_file, write_payload
from shardio.checkpoint.lease import claim
from shardio.checkpoint.manifest import (
    CheckpointManifest,
    RankFile,
    parse_rank_file,
)
from shardio.checkpoint.naming import (
    MANIFEST_NAME,
    Identity,
    dir_name,
    fragment_name,
    rank_file_name,
    temp_dir_name,
)
from shardio.errors import (
    CheckpointError,
    FormatError,
    ShardioError,
    StorageError,
    wrap_os_error,
)
from shardio.storage.atomic import (
    atomic_write,
    create_temp,
    fsync_dir,
    publish,
    rename_noreplace,
    temp_path_for,
)
from shardio.storage.files import read_regular, rmdir_inside, unlink_inside
from shardio.storage.stall import IoThreads

__all__ = [
    "Plan",
    "commit",
    "discard_temp",
    "make_directory",
    "make_temp_dir",
    "remove_stale_temps",
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
        raise wrap_os_error(
            exc, f"cannot create checkpoint directory {folder}: {exc.strerror}", CheckpointError
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
            raise wrap_os_error(
                exc,
                f"cannot create checkpoint directory {staging}: {exc.strerror}",
                CheckpointError,
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
                raise wrap_os_error(
                    exc,
                    f"cannot create checkpoint directory {tmp}: {exc.strerror}",
                    CheckpointError,
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
        raise wrap_os_error(exc, f"cannot create {tmp}: {exc.strerror}") from exc
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
            raise wrap_os_error(
                exc, f"cannot publish checkpoint {final}: {exc.strerror}", CheckpointError
            ) from exc
        fsync_dir(plan.directory)
        return final, manifest
    raise CheckpointError(
        errno.EEXIST, f"{_MAX_ATTEMPTS} checkpoints of step {plan.step} exist in {plan.directory}"
    )


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
