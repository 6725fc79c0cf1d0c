"""``save``: one checkpoint, now, in the calling thread, every rank at the same step.

Each rank first checks what it was given and tells the others (one failure stops all before
anything is written); the save then runs under a deadline and every rank learns how it ended.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from typing import Any

from shardio._check import require_bool, require_int, require_path
from shardio.checkpoint import ranks
from shardio.checkpoint.naming import check_kind, check_step, new_token
from shardio.checkpoint.snapshot import snapshot_bytes
from shardio.checkpoint.store import Plan
from shardio.checkpoint.writing import (
    SaveOptions,
    checked_payload,
    resolve_options,
    run_save_bounded,
)
from shardio.errors import CheckpointError
from shardio.storage.stall import IoThreads

__all__ = ["save"]


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
    env = os.environ if environ is None else environ
    rank = ranks.rank_and_world()[0]
    failure: Exception | None = None
    prepared: tuple[str, str, int | None, SaveOptions, dict[str, Any], int] | None = None
    try:  # every local failure is said to every rank before anything else is done together
        kind, step = check_kind(kind), check_step(step)
        if keep is not None:
            keep = require_int(keep, "keep", minimum=1, maximum=1_000_000)
        require_bool(per_rank, "per_rank")
        opts = resolve_options(options, option_values)
        folder = require_path(directory, "checkpoint directory")
        ranks.check_environ(env)
        own_state = state if per_rank or rank == 0 else None
        payload = checked_payload(own_state, loader)
        prepared = (kind, folder, keep, opts, payload, snapshot_bytes(own_state))
    except Exception as exc:
        failure = exc
    votes = ranks.gather((ranks.said(failure), new_token()))
    if failure is not None:
        raise failure
    failed = [f"rank {r}: {why}" for r, (why, _) in enumerate(votes) if why is not None]
    if failed:
        raise CheckpointError(f"checkpoint of step {step} not saved: {'; '.join(failed)}")
    kind, folder, keep, opts, payload, size_hint = typing.cast("Any", prepared)
    identity = ranks.resolve_identity(env)
    plan = Plan(
        directory=folder, identity=identity, kind=kind, step=step, token=str(votes[0][1]),
    )  # fmt: skip
    error: BaseException | None = None
    path = None
    pool = IoThreads(max_abandoned=2)
    try:
        path = run_save_bounded(
            plan, payload, opts, pool=pool, per_rank=per_rank,
            size_hint=size_hint, keep=keep, check_state=False,
        )  # fmt: skip
    except Exception as exc:
        error = exc
    finally:
        pool.close()
    failures = ranks.agree(error is None, ranks.said(error) or "")
    shared = ranks.share_from_zero(path)
    if error is not None:
        raise error
    if failures:
        raise CheckpointError(f"checkpoint of step {step} not saved: {'; '.join(failures)}")
    return shared if isinstance(shared, str) else None
