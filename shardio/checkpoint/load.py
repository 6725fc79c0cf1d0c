"""``save`` (now, in the calling thread) and ``load_latest`` (the newest intact checkpoint).

``load_latest`` reads the newest checkpoint's files this rank needs, verifies every byte
against the manifest as it reads, and falls back to the one before when anything is wrong,
saying which it skipped and why. It deletes nothing. Under torch.distributed every rank
loads the same checkpoint: one that any rank cannot load is skipped by all.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any

from shardio._check import require_path
from shardio.checkpoint import ranks
from shardio.checkpoint.codec import read_payload
from shardio.checkpoint.manifest import CheckpointManifest, RankFile
from shardio.checkpoint.naming import check_kind, check_step
from shardio.checkpoint.snapshot import snapshot_bytes
from shardio.checkpoint.store import Listed, Plan, list_checkpoints
from shardio.checkpoint.writing import (
    SaveOptions,
    check_seconds,
    dataset_id_of,
    loader_state_of,
    make_payload,
    resolve_options,
    run_save_bounded,
)
from shardio.errors import CheckpointError, NoCheckpointError, ShardioError, UsageError
from shardio.storage.stall import IoThreads

__all__ = ["Checkpoint", "load_latest", "save"]


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


def save(
    state: Any,
    directory: str | os.PathLike[str],
    *,
    kind: str = "full",
    step: int,
    loader: Any = None,
    per_rank: bool = False,
    keep: int | None = None,
    environ: Mapping[str, str] | None = None,
    options: SaveOptions | None = None,
    **option_values: Any,
) -> str | None:
    """Save ``state`` (and ``loader.state_dict()``) as one checkpoint, now.

    Under torch.distributed every rank calls it at the same step. With ``per_rank`` every
    rank's ``state`` is saved (sharded state); else rank 0's stands for all (a replicated
    model), and the other ranks save only their loader's state.

    Args:
        state: what to save (tensors, dicts, lists, numbers, strings).
        directory: the checkpoint directory (created if missing).
        kind: ``full`` or ``light``.
        step: the training step (ordering: the newest is the highest step).
        loader: a :class:`~shardio.ShardDataLoader` (or anything with ``state_dict()``)
            whose position rides in the checkpoint.
        per_rank: every rank's own state, rather than rank 0's for all.
        keep: keep this many checkpoints of ``kind`` (older ones removed); None keeps all.
        environ: where ``SLURM_JOB_ID`` is read (default: the process environment).
        options: how to write (:class:`SaveOptions`); or its fields as keywords.

    Returns:
        The checkpoint's directory (on every rank).

    Raises:
        CheckpointError, StorageError: the save failed on some rank; the previous
            checkpoint is still the latest.
        UsageError: a bad argument.
    """
    kind = check_kind(kind)
    step = check_step(step)
    if keep is not None:
        from shardio._check import require_int

        keep = require_int(keep, "keep", minimum=1, maximum=1_000_000)
    opts = resolve_options(options, option_values)
    folder = require_path(directory, "checkpoint directory")
    identity = ranks.resolve_identity(os.environ if environ is None else environ)
    plan = Plan(
        directory=folder, identity=identity, kind=kind, step=step,
        token=ranks.new_shared_token(),
    )  # fmt: skip
    own_state = state if per_rank or identity.rank == 0 else None
    payload = make_payload(own_state, loader_state_of(loader), dataset_id_of(loader))
    error: BaseException | None = None
    path = None
    pool = IoThreads(max_abandoned=2)
    try:
        path = run_save_bounded(
            plan, payload, opts, pool=pool, per_rank=per_rank,
            size_hint=snapshot_bytes(own_state), keep=keep,
        )  # fmt: skip
    except Exception as exc:
        error = exc
    finally:
        pool.close()
    failures = ranks.agree(error is None, str(error))
    shared = ranks.share_from_zero(path)
    if error is not None:
        raise error
    if failures:
        raise CheckpointError(f"checkpoint of step {step} not saved: {'; '.join(failures)}")
    return shared if isinstance(shared, str) else None


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
    if isinstance(saved, str) and reading is not None and saved != reading:
        raise UsageError(
            f"checkpoint {path} holds a position in dataset {saved[:12]}, this loader reads "
            f"dataset {reading[:12]} (another dataset, or one packed again): not resumed"
        )


def load_latest(
    directory: str | os.PathLike[str],
    *,
    kind: str | None = None,
    loader: Any = None,
    weights_only: bool = True,
    map_location: Any = "cpu",
    read_timeout_s: float = 120.0,
) -> Checkpoint:
    """The newest intact checkpoint in ``directory``, loaded.

    Args:
        directory: the checkpoint directory.
        kind: only ``full`` or only ``light`` ones (default: either).
        loader: restore this loader's position from the checkpoint
            (``loader.load_state_dict``; with another number of ranks too).
        weights_only: ``torch.load``'s safe mode (only tensors and plain values).
        map_location: where tensors load (``torch.load``'s).
        read_timeout_s: how long one read may stall before the checkpoint is skipped.

    Raises:
        NoCheckpointError: none is intact (``.skipped`` says why for each found).
        UsageError: a bad argument, or ``loader`` refuses the saved position (another
            dataset or order).
    """
    if kind is not None:
        check_kind(kind)
    timeout_s = check_seconds("read_timeout_s", read_timeout_s)
    folder = require_path(directory, "checkpoint directory")
    rank, world = ranks.rank_and_world()
    skipped: list[tuple[str, str]] = []
    pool = IoThreads(max_abandoned=4)
    try:
        listed, _ = list_checkpoints(folder, pool=pool, timeout_s=timeout_s)
        for candidate in listed:
            manifest = candidate.manifest
            if manifest is not None and kind is not None and manifest.kind != kind:
                continue
            state: Any = None
            loader_state: Any = None
            saved_dataset: Any = None
            why = ""
            try:
                if manifest is None:
                    raise CheckpointError(candidate.problem or "no manifest")
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
                why = str(exc)
            failures = ranks.agree(not why, why)
            if failures:
                skipped.append((candidate.path, "; ".join(failures) if world > 1 else why))
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
    reasons = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in skipped[:5])
    raise NoCheckpointError(
        f"no intact checkpoint in {folder}: {len(skipped)} found, none loads ({reasons})",
        skipped,
    )
