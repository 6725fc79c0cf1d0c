"""Stage a node's shards into a staging area: options, the run, and what it did.

``stage_dataset`` copies the shards a node will read, in the order training first needs
them, with parallel copy streams, each copy verified against the manifest (see
:mod:`shardio.cache.copy`). A rerun copies only what is missing or bad.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from shardio.cache.area import check_paths, open_area, storage_errors
from shardio.cache.copy import leftover_temps, stage_one, temps_of, write_local_metadata
from shardio.cache.evict import evict_for
from shardio.cache.identity import DatasetIdentity
from shardio.cache.plan import choose_shards, node_shard_order
from shardio.cache.protocol import STAGE_DIR, write_plan
from shardio.errors import IntegrityError, StorageUnavailableError, UsageError
from shardio.format.identity import load_identified
from shardio.format.manifest import Manifest
from shardio.metrics.progress import Counters, ProgressCallback, ProgressThread
from shardio.order import OrderSpec
from shardio.storage.files import make_dirs_inside

__all__ = [
    "MAX_NODES",
    "MAX_RANKS_PER_NODE",
    "MAX_STREAMS",
    "StageOptions",
    "StageResult",
    "stage_dataset",
]

logger = logging.getLogger(__name__)

MAX_RANKS_PER_NODE = 4096
MAX_NODES = 1 << 20
MAX_STREAMS = 256
MAX_AHEAD = 16


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """What to stage and how.

    Attributes:
        node: this node's number (0-based), of ``num_nodes``.
        num_nodes: nodes of the job; 1 stages every shard.
        ranks_per_node: training ranks per node (the rank layout decides which shards a
            node reads first), at most MAX_RANKS_PER_NODE.
        spec: the order training uses (the one :class:`~shardio.order.OrderSpec` the job's
            stage step and ShardDataset share), recorded in the area's plan.
        epoch: the epoch to stage for.
        ahead: also stage the shards of this many following epochs (after this epoch's, as
            capacity allows), and evict every staged shard none of those epochs needs (a
            rotating order hands shards on every epoch; see :class:`EpochStager`).
        streams: parallel copy streams, at most MAX_STREAMS.
        capacity_bytes: stage at most this many bytes (the shards needed first); None: all.
        durable: fsync each copy before publishing it. Off by default: a staging area is a
            job-scoped cache, a kill -9 cannot expose a half-written copy (temp name, then
            rename), and every read verifies each member and falls back to the source, which
            also covers a copy damaged by a node crash.
        force: DEST holds another dataset (its marker records another dataset id): remove
            what shardio staged there, then stage (without it, staging is refused).
        read_timeout_s: seconds a copy's open or one of its chunks may stall (a dead data
            server) before that shard is given up, like a damaged one (it is read from the
            source later); 0: no deadline.
    """

    node: int = 0
    num_nodes: int = 1
    ranks_per_node: int = 1
    spec: OrderSpec = field(default_factory=OrderSpec)
    epoch: int = 0
    ahead: int = 0
    streams: int = 4
    capacity_bytes: int | None = None
    durable: bool = False
    force: bool = False
    read_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.read_timeout_s, bool)
            or not isinstance(self.read_timeout_s, int | float)
            or not 0 <= self.read_timeout_s <= 86_400  # NaN fails both
        ):
            raise UsageError(
                f"read_timeout_s must be seconds in [0, 86400] (0: none), got "
                f"{self.read_timeout_s!r}"
            )
        if not 1 <= self.num_nodes <= MAX_NODES or not 0 <= self.node < self.num_nodes:
            raise UsageError(
                f"invalid node {self.node}/{self.num_nodes}: need 0 <= I < N <= {MAX_NODES:,}"
            )
        if not 1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE:
            raise UsageError(
                f"invalid ranks per node {self.ranks_per_node}: need 1 to {MAX_RANKS_PER_NODE}"
            )
        if not 1 <= self.streams <= MAX_STREAMS:
            raise UsageError(f"invalid copy streams {self.streams}: need 1 to {MAX_STREAMS}")
        if not isinstance(self.spec, OrderSpec):
            raise UsageError(f"spec must be an OrderSpec, got {type(self.spec).__name__}")
        if self.epoch < 0:
            raise UsageError(f"epoch ({self.epoch}) must be >= 0")
        if not 0 <= self.ahead <= MAX_AHEAD:
            raise UsageError(f"epochs ahead ({self.ahead}) must be 0 to {MAX_AHEAD}")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise UsageError("capacity must be positive")

    def plan_record(self) -> dict[str, Any]:
        """What the plan records about the order and the layout it was staged for."""
        return {
            "spec": self.spec.to_dict(),
            "epoch": self.epoch,
            "ahead": self.ahead,
            "node": self.node,
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
        }


@dataclass(frozen=True)
class StageResult:
    """What a stage run did."""

    dest: str
    shards_needed: int
    copied: int
    present: int
    replaced: int
    from_source: tuple[str, ...]
    bytes_copied: int
    bytes_staged: int
    seconds: float
    evicted: tuple[str, ...] = field(default_factory=tuple)


def _check_partition(manifest: Manifest, options: StageOptions) -> None:
    """Refuse a node partition that would leave a node without a shard.

    Raises:
        UsageError: fewer shards with samples than nodes.
    """
    if not options.spec.partitioned:
        return
    with_samples = sum(1 for s in manifest.shards if s.num_samples > 0)
    if with_samples < options.num_nodes:
        raise UsageError(
            f"a node-partitioned order needs at least one shard per node: "
            f"{options.num_nodes} nodes, {with_samples} shards with samples (repack with "
            "smaller shards, or use partition=none)"
        )


def stage_dataset(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    options: StageOptions,
    *,
    progress: ProgressCallback | None = None,
) -> StageResult:
    """Stage this node's shards of the dataset at ``src`` into ``dest``.

    ``dest`` must be missing, an empty directory, or a staging area made by shardio for
    this dataset (or ``options.force``); a new area gets its marker
    (``.shardio-stage/area.json``, naming the dataset id) before anything else is written.

    Raises:
        FormatError: src holds no valid manifest.
        UsageError: dest is inside src (or holds it), is not a directory, is neither empty
            nor a staging area, holds another dataset (without ``force``), or has a symlink
            or special file where staging writes.
        IntegrityError: a source shard does not match its size or checksum.
        StorageError: copying failed (ENOSPC included); published copies stay valid.
    """
    start = time.monotonic()
    src_root, dest_root = os.fspath(src), os.fspath(dest)
    manifest, manifest_id = load_identified(src_root)
    check_paths(manifest, src_root)
    _check_partition(manifest, options)  # before anything is written
    open_area(
        src_root,
        dest_root,
        DatasetIdentity(manifest_id, manifest, src_root),
        durable=options.durable,
        force=options.force,
    )
    with (
        storage_errors(dest_root, "staging into"),
        concurrent.futures.ThreadPoolExecutor(
            max_workers=options.streams, thread_name_prefix="shardio-stage"
        ) as pool,
    ):
        # The order needs numpy, whose import is a good part of a cold start: it is
        # computed beside the copy of the index.
        order = pool.submit(node_shard_order, manifest, options)
        write_local_metadata(src_root, dest_root, manifest, options.durable)
        needed = order.result()
        chosen, from_source = choose_shards(manifest, needed, options.capacity_bytes)
        write_plan(
            dest_root,
            [e.path for e in chosen],
            durable=options.durable,
            staged_for=options.plan_record(),
        )
        folders = {os.path.dirname(e.path) for e in chosen} | {
            os.path.dirname(e.dali_index) for e in chosen if e.dali_index is not None
        }
        for folder in sorted(folders):
            make_dirs_inside(dest_root, folder)  # refuses a symlink on the way
        temps = leftover_temps(dest_root, folders | {f"{STAGE_DIR}/ok"})
        evicted: list[str] = []
        keep_bytes = sum(e.size_bytes for e in chosen)
        if options.ahead > 0:
            # Nothing else is needed in the epochs ahead: make room now (a copy a reader
            # still holds is skipped, and goes at a later run).
            evicted = evict_for(dest_root, manifest, {e.path for e in chosen}, keep_bytes, 0)
        elif options.capacity_bytes is not None:
            evicted = evict_for(
                dest_root,
                manifest,
                {e.path for e in chosen},
                keep_bytes,
                options.capacity_bytes,
            )
        counters = Counters(shared=False)
        tracker = (
            ProgressThread(
                counters,
                progress,
                files_total=len(chosen),
                bytes_total=sum(e.size_bytes for e in chosen),
            )
            if progress is not None
            else contextlib.nullcontext()
        )
        with tracker:
            futures = [
                pool.submit(
                    stage_one,
                    src_root,
                    dest_root,
                    e,
                    temps_of(e, temps),
                    durable=options.durable,
                    counters=counters,
                    read_timeout_s=options.read_timeout_s,
                )
                for e in chosen
            ]
            # A damaged source shard does not stop the others: they are staged, then the
            # damage is reported (readers fall back to the source; ResilientDataset decides).
            outcomes, damaged = [], []
            try:
                for f in futures:
                    try:
                        outcomes.append(f.result())
                    except (IntegrityError, StorageUnavailableError) as exc:
                        damaged.append(exc)  # a stalled or unreachable shard too
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise IntegrityError(
            errno.EIO,
            f"{len(damaged)} source shard(s) are damaged or unavailable and were not staged, "
            f"the other "
            f"{len(outcomes)} were: {damaged[0]}{more}",
        ) from damaged[0]
    if from_source:
        logger.warning(
            "%d shard(s) exceed --capacity and will be read from %s", len(from_source), src_root
        )
    return StageResult(
        dest=dest_root,
        shards_needed=len(needed),
        copied=sum(1 for _, o, _ in outcomes if o == "copied"),
        present=sum(1 for _, o, _ in outcomes if o == "present"),
        replaced=sum(1 for _, o, _ in outcomes if o == "replaced"),
        from_source=tuple(from_source),
        bytes_copied=sum(n for _, _, n in outcomes),
        bytes_staged=sum(e.size_bytes for e in chosen),
        seconds=time.monotonic() - start,
        evicted=tuple(evicted),
    )
