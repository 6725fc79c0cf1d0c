"""Pack one part of a tree into a directory: scan, plan, write the shards, record the part.

A single-part pack also merges, so the directory then holds a complete dataset. Used by
:func:`shardio.packing.run.pack` once it has locked and checked the destination.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import errno
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from shardio._pool import WorkerPool
from shardio.errors import PackError, SourceError
from shardio.format.parity import PARITY_DIR
from shardio.format.spec import SHARD_DIR, WORK_DIR
from shardio.metrics.progress import Counters, ProgressCallback, ProgressThread
from shardio.packing.calls import SourceCalls
from shardio.packing.dest import remove_temps
from shardio.packing.labels import PinnedLabels, load_classes_file, load_dataset_labels
from shardio.packing.merge import merge_locked
from shardio.packing.options import PackOptions, PackResult
from shardio.packing.plan import ShardPlan, listing_fingerprint, plan_fingerprint, plan_shards
from shardio.packing.scan import Listing, PlannedSample, Skipped, list_tree, resolve_samples
from shardio.packing.workfiles import (
    PartRecord,
    ShardRecord,
    StateRecord,
    load_record,
    parse_record_name,
    part_record_name,
    state_name,
    write_record,
)
from shardio.packing.write import ShardJob, init_worker, reusable, write_shard
from shardio.storage.files import make_dirs_inside
from shardio.storage.fsdetect import resolve_fs_type
from shardio.storage.runner import CommandRunner
from shardio.storage.stripe_spec import StripeSpec, parse_stripe
from shardio.storage.striping import LayoutResult, apply_layout
from shardio.units import format_size
from shardio.writers.hdf5 import DEFAULT_HDF5_ALIGNMENT

__all__ = [
    "Plan",
    "RunContext",
    "alignment_for",
    "alignment_of",
    "fingerprint_of",
    "pack_part",
    "pinned_labels",
    "plan_fingerprint_of",
    "scan_part",
]

logger = logging.getLogger(__name__)

MiB = 1024**2


@dataclass(frozen=True)
class RunContext:
    """What a pack run carries down: its progress callback, command runner, start time."""

    progress: ProgressCallback | None
    runner: CommandRunner
    start: float


@dataclass(frozen=True)
class Plan:
    """One part's scan and shard plan."""

    listing: Listing
    samples: list[PlannedSample]
    skipped: list[Skipped]
    shards: list[ShardPlan]
    oversized: tuple[str, ...]
    calls: SourceCalls  # what the scan asked of the source tree

    @property
    def labelled(self) -> bool:
        """Whether samples get a label member."""
        return self.listing.label_layout != "none"


def scan_part(src: str, options: PackOptions) -> Plan:
    """List the tree, stat this part's files and cut them into shards (writes nothing).

    Raises:
        SourceError: the source is missing, unreadable or holds nothing to pack.
        PackError: ``strict`` and a file cannot be packed.
    """
    calls = SourceCalls()
    listing = list_tree(src, labels=options.labels, calls=calls, pinned=pinned_labels(options))
    _first, groups = listing.part(options.part, options.num_parts)
    samples, skipped = resolve_samples(src, listing, groups, calls=calls)
    if options.part == 0:
        skipped = list(listing.excluded) + skipped
    if skipped and options.strict:
        s = skipped[0]
        raise PackError(
            f"cannot pack {os.fsdecode(s.path)}: {s.reason} ({len(skipped)} file(s) "
            "unpackable; drop --strict to skip them)"
        )
    if not samples and options.num_parts == 1:
        raise SourceError(errno.ENOENT, f"source {src} holds no packable files")
    labelled = listing.label_layout != "none"
    shards = plan_shards(
        samples,
        shard_size_bytes=options.shard_size_bytes,
        labelled=labelled,
        part=options.part,
        num_parts=options.num_parts,
    )
    oversized = tuple(
        s.samples[0].key for s in shards if s.planned_bytes > options.shard_size_bytes
    )
    return Plan(listing, samples, skipped, shards, oversized, calls)


def pinned_labels(options: PackOptions) -> PinnedLabels | None:
    """The label map ``--labels-from`` or ``--classes`` pins, read and validated; or None."""
    if options.labels_from is not None:
        return load_dataset_labels(options.labels_from)
    if options.classes_file is not None:
        return load_classes_file(options.classes_file)
    return None


def alignment_for(layout: LayoutResult, options: PackOptions) -> int:
    """HDF5 blob alignment: the stripe size where a stripe layout was applied."""
    return alignment_of(layout, options.stripe, options.shard_size_bytes)


def alignment_of(layout: LayoutResult, stripe_text: str, shard_size_bytes: int) -> int:
    """:func:`alignment_for` from the stripe option and the shard size themselves."""
    stripe = parse_stripe(stripe_text)
    if layout.action == "applied" and isinstance(stripe, StripeSpec):
        return stripe.size_bytes
    if layout.action == "applied":
        return 4 * MiB if shard_size_bytes >= 64 * MiB else MiB
    return DEFAULT_HDF5_ALIGNMENT


def fingerprint_of(plan: Plan, options: PackOptions, alignment: int) -> str:
    """The part's plan fingerprint: what --resume compares."""
    return plan_fingerprint(
        plan.shards,
        {
            "format": options.shard_format,
            "shard_size": options.shard_size_bytes,
            "labels": plan.listing.label_layout,
            "part": f"{options.part}/{options.num_parts}",
            "alignment": alignment,
            **({"parity": options.parity} if options.parity else {}),
        },
    )


def plan_fingerprint_of(plan: Plan, options: PackOptions) -> str:
    """The whole pack's plan fingerprint: the same in every part of one pack, and only then."""
    return listing_fingerprint(
        plan.listing,
        {
            "format": options.shard_format,
            "shard_size": options.shard_size_bytes,
            "labels": options.labels,
            "num_parts": options.num_parts,
            **({"parity": options.parity} if options.parity else {}),
        },
    )


def pack_part(src: str, dst: str, options: PackOptions, ctx: RunContext) -> PackResult:
    """Pack this part into ``dst`` (new, empty, or an interrupted pack to resume)."""
    plan = scan_part(src, options)
    shard_dir = make_dirs_inside(dst, SHARD_DIR)
    make_dirs_inside(dst, f"{WORK_DIR}/frag")
    layout = apply_layout(
        shard_dir,
        fs_type=resolve_fs_type(dst, options.fs_type),
        stripe=parse_stripe(options.stripe),
        shard_size_bytes=options.shard_size_bytes,
        runner=ctx.runner,
    )
    if options.parity:  # parity files are striped like the shards they protect
        apply_layout(
            make_dirs_inside(dst, PARITY_DIR),
            fs_type=resolve_fs_type(dst, options.fs_type),
            stripe=parse_stripe(options.stripe),
            shard_size_bytes=options.shard_size_bytes,
            runner=ctx.runner,
        )
    alignment = alignment_for(layout, options)
    fingerprint = fingerprint_of(plan, options, alignment)
    _check_state(src, dst, options, fingerprint, plan)
    stems = [f".{s.name}" for s in plan.shards]
    remove_temps(shard_dir, stems)
    remove_temps(os.path.join(dst, WORK_DIR, "frag"), stems)
    remove_temps(dst)
    jobs = [
        ShardJob(
            src,
            dst,
            s,
            options.shard_format,
            plan.labelled,
            options.strict,
            options.durable,
            alignment,
            fingerprint,
            options.stream_threshold_bytes,
        )
        for s in plan.shards
    ]
    records: dict[int, ShardRecord] = {}
    if options.resume:
        for job in jobs:
            record = reusable(job)
            if record is not None:
                records[job.plan.seq] = record
    reused = len(records)
    counters = Counters()
    done = [j for j in jobs if j.plan.seq in records]
    counters.add(
        sum(j.plan.num_files for j in done),
        sum(f.size for j in done for s in j.plan.samples for f in s.files),
    )
    todo = [j for j in jobs if j.plan.seq not in records]
    total_files = sum(j.plan.num_files for j in jobs)
    total_bytes = sum(f.size for s in plan.samples for f in s.files)
    if ctx.progress is not None:
        with ProgressThread(
            counters, ctx.progress, files_total=total_files, bytes_total=total_bytes
        ):
            records.update(_run_jobs(todo, options.workers, counters))
    else:
        records.update(_run_jobs(todo, options.workers, counters))
    ordered = [records[j.plan.seq] for j in jobs]
    # This run's calls: the scan, then the opens of the shards it wrote. The part record
    # counts every shard's opens, by whichever run wrote it, so that the pack report is
    # the same whether the pack ran through or was resumed.
    calls = plan.calls.copy()
    for job in todo:
        calls.add(records[job.plan.seq].source_calls)
    part_calls = SourceCalls.total([plan.calls, *(r.source_calls for r in ordered)])
    part_skipped = tuple(plan.skipped) + tuple(s for r in ordered for s in r.skipped)
    part = PartRecord(
        part=options.part,
        num_parts=options.num_parts,
        fingerprint=fingerprint,
        plan_fingerprint=plan_fingerprint_of(plan, options),
        label_source=plan.listing.label_source,
        shard_format=options.shard_format,
        classes=plan.listing.classes,
        label_layout=plan.listing.label_layout,
        num_listed_files=plan.listing.num_files,
        options={
            "shard_size_bytes": options.shard_size_bytes,
            "labels": options.labels,
            "stripe": options.stripe,
            "strict": options.strict,
            "num_parts": options.num_parts,
            "parity": options.parity,
        },
        layout=layout,
        shards=tuple(ordered),
        skipped=part_skipped,
        oversized=plan.oversized,
        source_calls=part_calls,
    )
    write_record(
        os.path.join(dst, WORK_DIR, part_record_name(options.part, options.num_parts)),
        part,
        durable=options.durable,
    )
    logger.info(
        "part %d/%d: %d shards, %s",
        options.part,
        options.num_parts,
        len(ordered),
        format_size(sum(r.size_bytes for r in ordered)),
    )
    merged = (
        merge_locked(dst, durable=options.durable, workers=options.workers)
        if options.num_parts == 1
        else None
    )
    result = PackResult(
        dst=dst,
        num_samples=sum(r.num_samples for r in ordered),
        num_files=total_files - sum(len(r.skipped) for r in ordered),
        num_shards=len(ordered),
        data_bytes=sum(r.data_bytes for r in ordered),
        total_bytes=sum(r.size_bytes for r in ordered),
        seconds=time.monotonic() - ctx.start,
        reused_shards=reused,
        skipped=part_skipped,
        oversized=plan.oversized,
        layout=layout,
        merged=merged,
        part=options.part,
        num_parts=options.num_parts,
        source_calls=calls,
    )
    return result.with_labels(plan.listing)


def _check_state(src: str, dst: str, options: PackOptions, fingerprint: str, plan: Plan) -> None:
    """Record the part's plan; under --resume it must match the interrupted run's, and it
    must be the plan of every other part already begun in DST."""
    work = os.path.join(dst, WORK_DIR)
    own = state_name(options.part, options.num_parts)
    path = os.path.join(work, own)
    whole = plan_fingerprint_of(plan, options)
    if options.resume and os.path.lexists(path):
        previous = load_record(path, StateRecord)  # FormatError names a damaged one
        if previous.fingerprint != fingerprint or previous.plan_fingerprint not in (None, whole):
            raise PackError(
                f"the source or the options changed since the interrupted pack into {dst}: "
                "rerun with the same options, or with --force to start over"
            )
    if options.num_parts > 1:
        _check_other_parts(src, dst, options, whole)
    state = StateRecord(
        fingerprint=fingerprint,
        part=options.part,
        num_parts=options.num_parts,
        num_shards=len(plan.shards),
        shard_format=options.shard_format,
        plan_fingerprint=whole,
    )
    write_record(path, state, durable=options.durable)


def _check_other_parts(src: str, dst: str, options: PackOptions, whole: str) -> None:
    """Refuse to pack a part whose plan is not that of the parts already begun in DST (the
    source tree, the label map or the options changed in between): merge would refuse
    them anyway, after this part's work."""
    work = os.path.join(dst, WORK_DIR)
    for name in sorted(os.listdir(work)):
        split = parse_record_name(name, "state")
        if split is None or split == (options.part, options.num_parts):
            continue
        other = load_record(os.path.join(work, name), StateRecord)
        if other.plan_fingerprint is not None and other.plan_fingerprint != whole:
            raise PackError(
                f"part {other.part}/{other.num_parts} in {dst} was planned from another state "
                f"of the source {src} (files added or removed, another label map or other "
                "options) than this part: the parts would not fit together; pack every part "
                "from one unchanged source into a new directory"
            )


def _run_jobs(jobs: Sequence[ShardJob], workers: int, counters: Counters) -> dict[int, ShardRecord]:
    if not jobs:
        return {}
    if workers == 1 or len(jobs) == 1:
        return {job.plan.seq: write_shard(job, counters) for job in jobs}
    results: dict[int, ShardRecord] = {}
    # WorkerPool: on any failure what has not started is cancelled; a Ctrl-C stops the
    # shards being written (their temp files removed) without a worker traceback.
    size = min(workers, len(jobs))
    with WorkerPool(size, initializer=init_worker, initargs=(counters,)) as pool:
        futures = [pool.submit(write_shard, job) for job in jobs]
        try:
            for fut in pool.as_completed(futures):
                record = fut.result()
                results[record.seq] = record
        except concurrent.futures.process.BrokenProcessPool as exc:
            raise PackError(
                "a pack worker process died (killed by signal or out of memory?): "
                "rerun with --resume"
            ) from exc
    return results
