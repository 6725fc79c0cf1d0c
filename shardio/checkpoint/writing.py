"""One save from a state already in host memory: the steps every rank runs, in order.

Rank 0 creates the temp directory and sets its stripe layout (the same layout code as
``pack``: on Lustre a multi-GB file is spread over many OSTs) before the others can see it;
every rank writes its file;
rank 0 commits, then removes checkpoints beyond ``keep`` (after its own was read back and
checked) and temp directories that killed saves left.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from shardio._check import require_bool, require_int, require_seconds
from shardio.checkpoint.catalog import prune
from shardio.checkpoint.codec import DEFAULT_LEVEL, MAX_LEVEL
from shardio.checkpoint.store import (
    Plan,
    commit,
    discard_temp,
    leave_fragment,
    make_temp_dir,
    remove_stale_temps,
    write_rank,
)
from shardio.errors import CheckpointError, ReadStalledError, UsageError
from shardio.storage.runner import CommandRunner, run_command
from shardio.storage.stall import IoThreads, call_with_deadline

__all__ = [
    "PAYLOAD_VERSION",
    "SaveOptions",
    "check_payload",
    "checked_payload",
    "dataset_id_of",
    "loader_state_of",
    "loader_summary",
    "make_payload",
    "run_save",
    "resolve_options",
    "run_save_bounded",
    "zstandard_installed",
]

logger = logging.getLogger(__name__)

PAYLOAD_VERSION = 1
AUTO_MIN_RATIO = 1.15  # compression="auto" compresses when it saves at least 13% of the bytes


def _default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return min(4, cpus)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How checkpoints are written.

    Attributes:
        compression: ``auto`` (Zstandard where a sample of the state says it saves at least
            13% of the bytes and the ``checkpoint`` extra is installed, else none: fp32
            weights compress about 1.08x at 650 MB/s on two cores, slower than the disks
            they go to; bf16 1.29x), ``zstd`` (always; the ``checkpoint`` extra) or ``none``.
        level: the Zstandard level (1 to 19; 1 measured best, see the module ``codec``).
        threads: compression threads (0: in the writing thread; default: up to 4 cores).
        stripe: the stripe layout on Lustre/BeeGFS, as ``shardio pack --stripe`` takes it.
        fs_type: the filesystem type to plan the layout for (None: detected).
        verify: before old checkpoints are removed (``keep``), read the new one's files back
            from the storage (cached pages dropped) and check them: nothing is removed on
            the word of a write alone. Without ``keep`` nothing is removed, nor read back.
        commit_timeout_s: how long rank 0 waits for the other ranks' files.
        write_timeout_s: how long one rank's whole save may take before it is abandoned as
            stalled (a dead data server holds a write or a close for many minutes): a
            CheckpointError, and the abandoned save can no longer commit.
        read_timeout_s: how long one read may stall (reading back, loading).
        runner: runs ``lfs``/``beegfs-ctl``.
    """

    compression: str = "auto"
    level: int = DEFAULT_LEVEL
    threads: int = dataclasses.field(default_factory=_default_threads)
    stripe: str = "auto"
    fs_type: str | None = None
    verify: bool = True
    commit_timeout_s: float = 600.0
    write_timeout_s: float = 1800.0
    read_timeout_s: float = 120.0
    runner: CommandRunner = run_command

    def __post_init__(self) -> None:
        if self.compression not in ("auto", "zstd", "none"):
            raise UsageError(
                f"compression must be 'auto', 'zstd' or 'none', not {self.compression!r}"
            )
        require_int(self.level, "level", minimum=1, maximum=MAX_LEVEL)
        require_int(self.threads, "threads", minimum=0, maximum=256)
        if not isinstance(self.stripe, str):
            raise UsageError(f"stripe must be text as pack --stripe takes it, not {self.stripe!r}")
        from shardio.storage.stripe_spec import parse_stripe

        parse_stripe(self.stripe)
        if self.fs_type is not None:
            from shardio.storage.fsdetect import KNOWN_FS_TYPES

            if not isinstance(self.fs_type, str) or self.fs_type.lower() not in KNOWN_FS_TYPES:
                raise UsageError(
                    f"fs_type must be one of {', '.join(sorted(KNOWN_FS_TYPES))}, "
                    f"not {self.fs_type!r}"
                )
        require_bool(self.verify, "verify")  # "no" is truthy: it would verify
        require_seconds(self.commit_timeout_s, "commit_timeout_s", positive=True)
        require_seconds(self.write_timeout_s, "write_timeout_s", positive=True)
        require_seconds(self.read_timeout_s, "read_timeout_s", positive=True)
        if not callable(self.runner):
            raise UsageError(f"runner must be callable (see run_command), not {self.runner!r}")
        if self.compression == "zstd":
            from shardio.checkpoint.codec import load_zstandard

            load_zstandard()  # a missing extra is said now, not by a background save

    def zstd_level_for(self, state: Any) -> int | None:
        """The level to compress ``state`` at, None when it is not to be compressed."""
        if self.compression == "none":
            return None
        if self.compression == "auto":
            from shardio.checkpoint.snapshot import estimate_ratio

            if not zstandard_installed():
                return None  # auto compresses only with the checkpoint extra installed
            if estimate_ratio(state, level=self.level) < AUTO_MIN_RATIO:
                return None
        return self.level


def resolve_options(options: SaveOptions | None, values: Mapping[str, Any]) -> SaveOptions:
    """``options``, or a :class:`SaveOptions` of ``values``; a UsageError for both (the
    keywords would be silently ignored)."""
    if options is not None and not isinstance(options, SaveOptions):
        raise UsageError(f"options must be a SaveOptions, not {type(options).__name__}")
    if options is None:
        known = {f.name for f in dataclasses.fields(SaveOptions)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(
                f"unknown checkpoint option {unknown[0]!r}: the options are "
                f"{', '.join(sorted(known))}"
            )
        return SaveOptions(**values)
    if values:
        raise UsageError(
            f"pass options= or its fields ({', '.join(sorted(values))}) as keywords, not both"
        )
    return options


def zstandard_installed() -> bool:
    """Whether the ``zstandard`` module (the ``checkpoint`` extra) can be imported."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


def loader_summary(loader_state: Mapping[str, Any] | None) -> dict[str, int] | None:
    """What the manifest shows of the loader's state: its epoch, position, dataset size."""
    if not isinstance(loader_state, Mapping):
        return None
    out = {
        k: v
        for k in ("epoch", "consumed", "num_samples", "world_size")
        if type(v := loader_state.get(k)) is int
    }
    return out or None


def make_payload(state: Any, loader_state: Any, dataset_id: str | None = None) -> dict[str, Any]:
    """What one rank's file holds: the state, the loader's position, and the id of the
    dataset that position is in (so it resumes no other dataset)."""
    return {
        "shardio_checkpoint": PAYLOAD_VERSION, "state": state, "loader": loader_state,
        "dataset_id": dataset_id,
    }  # fmt: skip


def check_payload(payload: Mapping[str, Any]) -> None:
    """Refuse a payload (:func:`make_payload`) that ``torch.load(weights_only=True)`` would
    not load back: the state and the loader's state are walked, not their tensors' bytes.

    Raises:
        UsageError: one line naming the key and the type.
    """
    from shardio.checkpoint.loadable import check_loadable

    check_loadable(payload["state"], "state")
    check_loadable(payload["loader"], "the loader's state_dict()")


def checked_payload(state: Any, loader: Any) -> dict[str, Any]:
    """The payload (:func:`make_payload`) of ``state`` and of ``loader``'s position and
    dataset, refused as :func:`check_payload` refuses (before any copy or write)."""
    payload = make_payload(state, loader_state_of(loader), dataset_id_of(loader))
    check_payload(payload)
    return payload


def dataset_id_of(loader: Any) -> str | None:
    """The id of the dataset ``loader`` reads, when it says: shardio's loaders (ShardLoader,
    GPUPrefetcher, shardio.dali's), a MixedDataset, and a ShardDataset given
    itself as the loader (its reader's id: the one its loader records)."""
    if loader is None:
        return None
    value = getattr(loader, "dataset_id", None)
    if value is None:  # a ShardDataset: the id its own reader resolved
        resolver = getattr(getattr(loader, "packed", None), "resolver", None)
        value = getattr(resolver, "dataset_id", None)
    return value if isinstance(value, str) else None


def loader_state_of(loader: Any) -> Any:
    """``loader.state_dict()`` (None without a loader)."""
    if loader is None:
        return None
    state_dict = getattr(loader, "state_dict", None)
    if not callable(state_dict):
        raise UsageError(f"loader {type(loader).__name__} has no state_dict()")
    return state_dict()


def _layout(options: SaveOptions, size_hint: int) -> Callable[[str], None]:
    def apply(path: str) -> None:
        from shardio.storage.fsdetect import resolve_fs_type
        from shardio.storage.striping import apply_layout

        fs_type = resolve_fs_type(os.path.dirname(path), options.fs_type)
        apply_layout(
            path, fs_type=fs_type, stripe=options.stripe,
            shard_size_bytes=max(size_hint, 1), runner=options.runner,
        )  # fmt: skip

    return apply


def run_save_bounded(
    plan: Plan,
    payload: dict[str, Any],
    options: SaveOptions,
    *,
    pool: IoThreads,
    per_rank: bool,
    size_hint: int,
    keep: int | None,
    check_state: bool = True,
) -> str | None:
    """:func:`run_save` on an I/O thread, abandoned after ``options.write_timeout_s``.

    Args:
        check_state: refuse a state that ``torch.load(weights_only=True)`` would refuse
            (False: the caller checked it already, see :func:`check_payload`).

    Raises:
        UsageError: ``per_rank`` is not a bool.
        CheckpointError: it stalled (a dead data server holding a write); the abandoned save
            is discarded rather than committed should its write ever return.
    """
    require_bool(per_rank, "per_rank")
    cancelled = threading.Event()
    # The I/O thread keeps its last call (and what that refers to) until its next one: the
    # payload is handed over in a box emptied here, so no idle daemon thread holds tensors
    # that the interpreter would then free while shutting down.
    box = [payload]

    def call() -> str | None:
        try:
            return run_save(
                plan, box[0], options, per_rank=per_rank, size_hint=size_hint, keep=keep,
                cancelled=cancelled, check_state=check_state,
            )  # fmt: skip
        except BaseException as exc:  # its traceback's frames would hold the payload too
            _clear_frames(exc)
            raise

    try:
        path: str | None = call_with_deadline(
            pool, call, options.write_timeout_s,
            f"saving checkpoint step {plan.step} into {plan.directory}",
        )  # fmt: skip
        return path
    except ReadStalledError as exc:
        cancelled.set()
        if plan.identity.rank != 0:
            _record_failure(plan, exc)
        raise CheckpointError(
            errno.ETIMEDOUT,
            f"saving checkpoint step {plan.step} into {plan.directory} stalled for "
            f"{options.write_timeout_s:g} s (a dead data server?): abandoned",
        ) from exc
    finally:
        box.clear()


def _clear_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames in ``exc``'s tracebacks (and its
    causes'): the lines stay, the payload they referred to is not kept alive by them."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        todo += [err.__cause__, err.__context__]


def _record_failure(plan: Plan, exc: BaseException) -> None:
    """A rank other than 0 says it failed, so rank 0 stops waiting for it."""
    if plan.identity.rank == 0:
        return
    try:
        leave_fragment(plan, None, f"{type(exc).__name__}: {exc}")
    except Exception:  # the directory may be what failed: rank 0 then times out
        logger.debug("could not record the failure of rank %d", plan.identity.rank, exc_info=True)


def run_save(
    plan: Plan,
    payload: dict[str, Any],
    options: SaveOptions,
    *,
    per_rank: bool,
    size_hint: int,
    keep: int | None,
    cancelled: threading.Event | None = None,
    check_state: bool = True,
) -> str | None:
    """Write this rank's part of a save; on rank 0 commit it. Returns the checkpoint's path
    on rank 0 (None on the others). A save ``cancelled`` (abandoned as stalled) before its
    commit is discarded instead.

    Raises:
        CheckpointError, StorageError: the save failed; the previous checkpoint stays the
            latest (a rank other than 0 records its failure, so rank 0 stops waiting).
    """
    rank = plan.identity.rank
    has_state = payload["state"] is not None
    try:
        make_temp_dir(plan, layout=_layout(options, size_hint) if rank == 0 else None)
    except BaseException as exc:
        _record_failure(plan, exc)
        raise
    try:
        if check_state:
            check_payload(payload)
        entry = write_rank(
            plan, payload, has_state=has_state, has_loader=payload["loader"] is not None,
            level=options.zstd_level_for(payload), threads=options.threads,
            verify=options.verify and keep is not None,
            timeout_s=options.read_timeout_s,
        )  # fmt: skip
    except BaseException as exc:
        if rank == 0:  # the directory is this save's own: nothing of it is kept
            discard_temp(plan)
        _record_failure(plan, exc)
        raise
    if cancelled is not None and cancelled.is_set():
        if rank == 0:
            discard_temp(plan)
        raise CheckpointError(errno.ETIMEDOUT, f"the save into {plan.temp_dir} was abandoned")
    if rank != 0:
        leave_fragment(plan, entry)
        return None
    try:
        path, manifest = commit(
            plan, entry, per_rank=per_rank, loader=loader_summary(payload["loader"]),
            timeout_s=options.commit_timeout_s, cancelled=cancelled,
        )  # fmt: skip
    except BaseException:
        discard_temp(plan)
        raise
    logger.info(
        "checkpoint %s: %s step %d, %d rank(s), %d bytes (%d before compression)",
        path, manifest.kind, manifest.step, manifest.world_size, manifest.size_bytes,
        manifest.raw_bytes,
    )  # fmt: skip
    if keep is not None:
        for old in prune(plan.directory, plan.kind, keep, protect=path):
            logger.info("removed old checkpoint %s (keeping %d %s)", old, keep, plan.kind)
    # Older than any save can last: a temp directory that old is a killed save's.
    stale_s = max(options.commit_timeout_s, options.write_timeout_s) + 60.0
    remove_stale_temps(plan.directory, older_than_s=stale_s, keep=plan.temp_dir)
    return path
