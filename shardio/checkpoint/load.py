"""``load_latest``: the newest intact checkpoint (falling back past damaged ones), or one given.

``load_latest`` reads the newest checkpoint's files this rank needs, verifies every byte
against the manifest as it reads, and falls back to the one before when it is damaged,
saying which it skipped and why. It deletes nothing. What it raises says what a restart
should do: ``NoCheckpointError`` only when there is none (a fresh start);
``CheckpointUnavailableError`` when the storage does not answer now (retry); a
``CheckpointError`` when every one found is damaged, or one is intact but will not load as
asked (never a fresh start). Given one checkpoint (``SHARDIO_RESUME_FROM``), it loads that one
or fails. Under torch.distributed every rank loads the same checkpoint: one that any rank
cannot load is skipped by all.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import typing
from collections.abc import Mapping
from typing import Any

from shardio._check import require_bool, require_path, require_seconds
from shardio.checkpoint import ranks
from shardio.checkpoint.catalog import (
    Listed,
    all_damaged,
    list_checkpoints,
    one_checkpoint,
    unavailable,
)
from shardio.checkpoint.codec import read_payload
from shardio.checkpoint.lease import check_not_owned
from shardio.checkpoint.manifest import CheckpointManifest, RankFile
from shardio.checkpoint.naming import (
    MANIFEST_NAME,
    check_kind,
    is_checkpoint_name,
    job_id_from,
    this_host,
)
from shardio.checkpoint.writing import (
    dataset_id_of,
)
from shardio.errors import (
    CheckpointError,
    CheckpointUnavailableError,
    FormatError,
    NoCheckpointError,
    ShardioError,
    StorageError,
    UsageError,
    wrap_os_error,
)
from shardio.storage.stall import IoThreads, call_with_deadline

__all__ = ["Checkpoint", "load_latest"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint loaded and verified.

    Attributes:
        state: the training state it holds (this rank's, or rank 0's when saved for all).
        path: its directory.
        kind: ``full`` or ``light``.
        step: the step it was taken at.
        skipped: ``[(path, reason), ...]``: the newer ones not loaded, and why.
        loader_state: the loader's state (``loader.load_state_dict``), or None.
        manifest: its manifest.
    """

    state: Any
    path: str
    kind: str
    step: int
    skipped: list[tuple[str, str]]
    loader_state: dict[str, Any] | None
    manifest: CheckpointManifest


def _files_for(manifest: CheckpointManifest, rank: int, world: int) -> tuple[RankFile, RankFile]:
    """The files this rank reads: the one with its state, the one with its loader's."""
    if manifest.per_rank:
        if manifest.world_size != world:
            raise CheckpointError(
                f"saved per rank by {manifest.world_size} ranks, this job has {world}: its "
                "state cannot be shared out anew"
            )
        return manifest.files[rank], manifest.files[rank]
    loader_file = manifest.files[rank] if manifest.world_size == world else manifest.files[0]
    return manifest.files[0], loader_file


def _read(listed: Listed, entry: RankFile, pool: IoThreads, **kw: Any) -> dict[str, Any]:
    payload = read_payload(
        os.path.join(listed.path, entry.name), size_bytes=entry.size_bytes,
        raw_bytes=entry.raw_bytes, xxh3_128=entry.xxh3_128, compression=entry.compression,
        pool=pool, **kw,
    )  # fmt: skip
    if not isinstance(payload, dict) or payload.get("shardio_checkpoint") != 1:
        raise CheckpointError(f"{listed.path}/{entry.name} is not a shardio checkpoint file")
    return payload


def _check_dataset(loader: Any, saved: Any, path: str) -> None:
    """Refuse to resume ``loader`` from a position in another dataset."""
    reading = dataset_id_of(loader)
    if not isinstance(saved, str) or reading is None:  # nothing to compare: said, not refused
        logger.warning(
            "checkpoint %s: %s, so the position restored cannot be checked to be in the "
            "dataset %s reads",
            path,
            "it records no dataset id" if not isinstance(saved, str) else "the loader has none",
            type(loader).__name__,
        )
        return
    if saved != reading:
        raise UsageError(
            f"checkpoint {path} holds a position in dataset {saved[:12]}, this loader reads "
            f"dataset {reading[:12]} (another dataset, or one packed again): not resumed"
        )


def _verdict(exc: ShardioError) -> str:
    """What a failure to load a checkpoint says: ``unavailable`` (the storage could not be
    read now: retry later), ``damaged`` (this checkpoint is unusable: fall back to the one
    before) or ``refused`` (it is intact but will not load as asked, or the call is wrong)."""
    if unavailable(exc):
        return "unavailable"
    if isinstance(exc, CheckpointError) and exc.errno == errno.EINVAL:
        return "refused"  # verified bytes that torch.load refused (weights_only)
    if isinstance(exc, (StorageError, FormatError)):
        return "damaged"
    return "refused"


_WORST = {"unavailable": 3, "refused": 2, "damaged": 1}


def _given(folder: str, pool: IoThreads, timeout_s: float) -> bool:
    """Whether ``folder`` names one checkpoint (its name, or a manifest in it) rather than a
    directory of them."""
    if is_checkpoint_name(os.path.basename(os.path.normpath(folder))):
        return True
    look = functools.partial(os.path.lexists, os.path.join(folder, MANIFEST_NAME))
    try:
        return bool(call_with_deadline(pool, look, timeout_s, f"looking into {folder}"))
    except OSError as exc:
        raise wrap_os_error(
            exc,
            f"the checkpoints in {folder} cannot be read now (not damaged; retry): {exc}",
            CheckpointUnavailableError,
        ) from exc


def _check_owner(
    directory: str, environ: Mapping[str, str], pool: IoThreads, timeout_s: float
) -> None:
    """Refuse a directory another live job saves into (rank 0 reads the lease for all: a
    lease names rank 0's host and process).

    Raises:
        CheckpointError: another live job holds it (EBUSY).
        CheckpointUnavailableError: the lease cannot be read now.
    """
    if ranks.rank_and_world()[0] != 0:
        return
    try:
        call_with_deadline(
            pool,
            functools.partial(
                check_not_owned, directory, job_id=job_id_from(environ), host=this_host()
            ),
            timeout_s, f"reading the lease of {directory}",
        )  # fmt: skip
    except CheckpointError:
        raise
    except StorageError as exc:
        raise wrap_os_error(
            exc,
            f"the checkpoints in {directory} cannot be read now (not damaged; retry): "
            f"its lease: {exc}",
            CheckpointUnavailableError,
        ) from exc


def _find(
    folder: str, kind: str | None, environ: Mapping[str, str], pool: IoThreads, timeout_s: float
) -> tuple[bool, list[Listed]]:
    """Whether ``folder`` is one given checkpoint, and the checkpoints to try, newest first.

    Raises:
        CheckpointError, CheckpointUnavailableError, UsageError: as :func:`load_latest`.
    """
    given = _given(folder, pool, timeout_s)
    if not given:  # resuming "the newest": not from a directory another live job saves into
        _check_owner(folder, environ, pool, timeout_s)
        return False, list_checkpoints(folder, pool=pool, timeout_s=timeout_s)[0]
    # One given checkpoint is named explicitly and only read (an evaluation of a running
    # job's checkpoint): no lease is asked for, taken or written, nothing pruned.
    one = one_checkpoint(folder, pool=pool, timeout_s=timeout_s)
    if one is None:
        raise CheckpointError(errno.ENOENT, f"checkpoint {folder} does not exist")
    if one.manifest is not None and kind is not None and one.manifest.kind != kind:
        raise CheckpointError(
            errno.EINVAL, f"checkpoint {folder} is a {one.manifest.kind} one, not {kind}"
        )
    return True, [one]


def _together(found: tuple[bool, list[Listed]] | ShardioError) -> tuple[bool, list[Listed]]:
    """What every rank found; when any rank failed, every rank raises (the first failure's
    type and message), so that no rank waits for the others in a later collective."""
    failure = (type(found).__name__, str(found)) if isinstance(found, ShardioError) else None
    said = ranks.gather(failure)
    first = next(((r, f) for r, f in enumerate(said) if f is not None), None)
    if first is None:
        return typing.cast("tuple[bool, list[Listed]]", found)
    if isinstance(found, ShardioError):
        raise found
    rank, (name, message) = first
    error = CheckpointUnavailableError if name == "CheckpointUnavailableError" else CheckpointError
    raise error(errno.EIO, f"rank {rank}: {message}")


def _check_load_options(
    directory: object, *, kind: object, loader: object, weights_only: object,
    map_location: object, read_timeout_s: object, environ: object,
) -> tuple[str, float, Mapping[str, str]]:  # fmt: skip
    """:func:`load_latest`'s arguments checked: the folder, the read deadline, the environment.

    Raises:
        UsageError: one line naming the argument that is wrong.
    """
    if kind is not None:
        check_kind(kind)
    timeout_s = require_seconds(read_timeout_s, "read_timeout_s", positive=True)
    folder = require_path(directory, "checkpoint directory")
    require_bool(weights_only, "weights_only")  # "no" is truthy: it would load unsafely
    if loader is not None and (
        isinstance(loader, type) or not callable(getattr(loader, "load_state_dict", None))
    ):  # (a class is not a loader: its load_state_dict wants an instance)
        raise UsageError(
            f"loader must have load_state_dict() (a shardio loader or dataset), got "
            f"{type(loader).__name__}"
        )
    if not _map_location_ok(map_location):
        raise UsageError(
            "map_location must be a device name (str), a torch.device, a dict of device "
            f"names or a function (as torch.load takes it), got {type(map_location).__name__} "
            f"{map_location!r}"[:300]
        )
    env = ranks.check_environ(os.environ if environ is None else environ)
    return folder, timeout_s, env


def _map_location_ok(value: object) -> bool:
    if value is None or isinstance(value, str) or callable(value):
        return True
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    import torch

    return isinstance(value, torch.device)


def load_latest(
    directory: str | os.PathLike[str],
    *,
    kind: str | None = None,
    loader: Any = None,
    weights_only: bool = True,
    map_location: Any = "cpu",
    read_timeout_s: float = 120.0,
    environ: Mapping[str, str] | None = None,
) -> Checkpoint:
    """The newest intact checkpoint in ``directory``, loaded; or the one checkpoint
    ``directory`` is (``SHARDIO_RESUME_FROM``), and no other.

    ``NoCheckpointError`` means one thing: there is no checkpoint (of ``kind``) to resume,
    the one case where a fresh start is right. A checkpoint that cannot be read now (a
    server down, a read or the listing past ``read_timeout_s``) raises
    ``CheckpointUnavailableError`` (retryable) naming it, rather than falling back or
    starting afresh; a damaged one is skipped for the one before, and when every one found
    is damaged a ``CheckpointError`` names each and why.

    Args:
        directory: the checkpoint directory; or one checkpoint in it (a directory named
            ``checkpoint_...``, or holding a ``manifest.json``): that one is loaded, and it
            being damaged or missing is an error, never a fallback.
        kind: only ``full`` or only ``light`` ones (default: either).
        loader: restore this loader's position from the checkpoint
            (``loader.load_state_dict``; with another number of ranks too).
        weights_only: ``torch.load``'s safe mode (only tensors and plain values).
        map_location: where tensors load (``torch.load``'s).
        read_timeout_s: how long one read (or the listing) may stall before it is given up.
        environ: where ``SLURM_JOB_ID`` is read (default: the process environment): a
            directory that another live job saves into is refused. One given checkpoint is
            loaded whoever owns its directory (an evaluation of a running job's checkpoint):
            it is named explicitly and only read, no lease is asked for or taken.

    Raises:
        NoCheckpointError: there is none (of ``kind``) in ``directory``.
        CheckpointUnavailableError: the directory or a checkpoint could not be read now.
        CheckpointError: every one found is damaged or unusable (each named, with why); the
            given checkpoint is damaged, missing or of another kind; an intact one that
            ``torch.load`` refuses (``weights_only``); another live job owns the directory
            (not for one given checkpoint).
        UsageError: a bad argument (one line naming it, on every rank), or ``loader``
            refuses the saved position (another dataset or order).
    """
    rank, world = ranks.rank_and_world()
    skipped: list[tuple[str, str]] = []
    pool = IoThreads(max_abandoned=4)
    folder = str(directory)
    try:
        try:  # a bad argument on one rank is raised on every rank, at this call
            folder, timeout_s, env = _check_load_options(
                directory, kind=kind, loader=loader, weights_only=weights_only,
                map_location=map_location, read_timeout_s=read_timeout_s, environ=environ,
            )  # fmt: skip
            found: tuple[bool, list[Listed]] | ShardioError = _find(
                folder, kind, env, pool, timeout_s
            )
        except ShardioError as exc:
            found = exc
        given, listed = _together(found)
        for candidate in listed:
            manifest = candidate.manifest
            if manifest is not None and kind is not None and manifest.kind != kind:
                continue
            state: Any = None
            loader_state: Any = None
            saved_dataset: Any = None
            verdict, why = "", ""
            try:
                if manifest is None:
                    raise (
                        CheckpointUnavailableError(errno.EIO, candidate.problem or "unreadable")
                        if candidate.unreadable
                        else CheckpointError(candidate.problem or "no manifest")
                    )
                state_file, loader_file = _files_for(manifest, rank, world)
                kw = {
                    "timeout_s": timeout_s, "weights_only": weights_only,
                    "map_location": map_location,
                }  # fmt: skip
                payload = _read(candidate, state_file, pool, **kw)
                state = payload["state"]
                if loader_file is not state_file:
                    payload = _read(candidate, loader_file, pool, **kw)
                loader_state, saved_dataset = payload["loader"], payload.get("dataset_id")
            except ShardioError as exc:
                verdict, why = _verdict(exc), str(exc)
            said = ranks.gather((verdict, why))
            failed = [(r, v, w) for r, (v, w) in enumerate(said) if v]
            if failed:
                worst = max(failed, key=lambda f: _WORST[f[1]])[1]
                reason = "; ".join(
                    (f"rank {r}: {w}" if world > 1 else w) for r, v, w in failed if v == worst
                )
                _refuse(candidate.path, worst, reason, given=given)
                skipped.append((candidate.path, reason))
                continue
            manifest = typing.cast("CheckpointManifest", manifest)  # set when nothing failed
            if loader is not None and loader_state is not None:
                _check_dataset(loader, saved_dataset, candidate.path)
                loader.load_state_dict(loader_state)
            return Checkpoint(
                state=state, path=candidate.path, kind=manifest.kind, step=manifest.step,
                skipped=skipped, loader_state=loader_state, manifest=manifest,
            )  # fmt: skip
    finally:
        pool.close()
    if not skipped:
        what = f" {kind}" if kind else ""
        raise NoCheckpointError(f"no{what} checkpoint in {folder}", skipped)
    raise all_damaged(folder, skipped)


def _refuse(path: str, verdict: str, reason: str, *, given: bool) -> None:
    """Raise for a checkpoint that failed to load, unless it is one to skip (damaged, and
    not the one checkpoint asked for)."""
    if verdict == "unavailable":
        raise CheckpointUnavailableError(
            errno.EIO, f"checkpoint {path} cannot be read now (not damaged; retry): {reason}"
        )
    if verdict == "refused":
        raise CheckpointError(errno.EINVAL, f"checkpoint {path} not loaded: {reason}")
    if given:
        raise CheckpointError(errno.EIO, f"checkpoint {path} is damaged: {reason}")
