"""Stage a node's shards into a staging area: options, the run, and what it did.

``stage_dataset`` copies the shards a node will read, in the order training first needs
them, with parallel copy streams, each copy verified against the manifest (see
:mod:`shardio.staging.copy`). A rerun copies only what is missing or bad.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass, field

from shardio.errors import IntegrityError, StorageUnavailableError, UsageError
from shardio.format.identity import load_identified
from shardio.format.manifest import Manifest
from shardio.metrics.progress import Counters, ProgressCallback, ProgressThread
from shardio.staging.area import check_paths, open_area, storage_errors
from shardio.staging.copy import (
    leftover_temps,
    source_rebuild,
    stage_one,
    temps_of,
    write_local_metadata,
)
from shardio.staging.dali_index import dali_index_reader
from shardio.staging.evict import evict_for
from shardio.staging.identity import DatasetIdentity
from shardio.staging.options import (
    MAX_NODES,
    MAX_RANKS_PER_NODE,
    MAX_STREAMS,
    StageOptions,
)
from shardio.staging.peers import PeerFetch, find_peers
from shardio.staging.plan import choose_shards, node_shard_order
from shardio.staging.protocol import STAGE_DIR, read_held, write_plan
from shardio.storage.files import make_dirs_inside
from shardio.units import format_size

__all__ = [
    "MAX_NODES",
    "MAX_RANKS_PER_NODE",
    "MAX_STREAMS",
    "StageOptions",
    "StageResult",
    "stage_dataset",
]

logger = logging.getLogger(__name__)


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
    bytes_kept: int = 0
    bytes_from_peers: int = 0
    bytes_from_source: int = 0
    peers: int = 0

    def moved_line(self) -> str:
        """``kept 1.2 GB, from peers 180 MB, from source 20 MB (3 peer areas)``."""
        return (
            f"kept {format_size(self.bytes_kept)}, from peers "
            f"{format_size(self.bytes_from_peers)}, from source "
            f"{format_size(self.bytes_from_source)} ({self.peers} peer area(s))"
        )


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
            or special file where staging writes; a peer named in ``options.peers`` is not
            a staging area of this dataset.
        IntegrityError: a source shard does not match its size or checksum.
        StorageError: copying failed (ENOSPC included); published copies stay valid.
    """
    start = time.monotonic()
    src_root, dest_root = os.fspath(src), os.fspath(dest)
    manifest, manifest_id = load_identified(src_root)
    check_paths(manifest, src_root)
    _check_partition(manifest, options)  # before anything is written
    ident = DatasetIdentity(manifest_id, manifest, src_root)
    peers = find_peers(options.peers, dest_root, ident) if options.peers else []
    open_area(src_root, dest_root, ident, durable=options.durable, force=options.force)
    from_peer = (
        PeerFetch(peers, durable=options.durable, read_timeout_s=options.read_timeout_s)
        if peers
        else None
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
        # Copies of earlier plans stay (until evicted): recorded, so that a node re-staging
        # after a lost node finds them as a peer's (a re-dealt share).
        known = {e.path for e in manifest.shards}
        held = {
            rel
            for rel in ((read_held(dest_root) or set()) & known) - {e.path for e in chosen}
            if os.path.lexists(os.path.join(dest_root, rel))
        }
        write_plan(
            dest_root,
            [e.path for e in chosen],
            durable=options.durable,
            staged_for=options.plan_record(),
            held=sorted(held),
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
        # A source with parity heals the copy: rebuilt into DEST, the source only read.
        rebuild = source_rebuild(src_root, manifest, dest_root, durable=options.durable)
        # DALI's .idx of each tar shard comes from the index staged (verified) above.
        dali_text = dali_index_reader(dest_root, manifest)
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
                    rebuild=rebuild,
                    dali_text=dali_text,
                    from_peer=from_peer,
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
    sizes = {e.path: e.size_bytes for e in chosen}
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
        bytes_kept=sum(sizes[r] for r, o, _ in outcomes if o == "present"),
        bytes_from_peers=sum(n for _, o, n in outcomes if o == "peer"),
        bytes_from_source=sum(n for _, o, n in outcomes if o in ("copied", "replaced")),
        peers=len(peers),
    )
