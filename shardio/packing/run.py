"""Pack a tree of small files into shards: scan -> plan -> writers -> index -> manifest.

The manifest is written last and atomically; every shard, DALI index and per-shard index
fragment appears under its final name only when complete. A per-shard record in the work
directory marks a shard done, so a killed pack resumes with ``resume=True`` and reuses the
shards whose checksum still matches. A multi-node pack runs one part per SLURM task
(``part``/``num_parts``) and :func:`shardio.packing.merge.merge_parts` joins them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardio.errors import PackError, SourceError, StorageError, UsageError
from shardio.format.checksum import file_xxh3_128, member_xxh3_64
from shardio.format.index import IndexBuilder, MemberEntry
from shardio.format.manifest import load_manifest
from shardio.format.spec import (
    INDEX_FILENAME,
    LABEL_EXT,
    MANIFEST_FILENAME,
    REPORT_FILENAME,
    SHARD_DIR,
    SHARD_FORMATS,
    WORK_DIR,
)
from shardio.packing.merge import MergeResult, merge_parts, part_record_name
from shardio.packing.plan import (
    LABEL_MODES,
    PlannedSample,
    ShardPlan,
    Skipped,
    list_tree,
    plan_fingerprint,
    plan_shards,
    resolve_samples,
)
from shardio.progress import Counters, ProgressCallback, ProgressThread
from shardio.storage.atomic import atomic_write, is_temp_name
from shardio.storage.fsdetect import resolve_fs_type
from shardio.storage.runner import CommandRunner, run_command
from shardio.storage.striping import LayoutResult, StripeSpec, apply_layout, parse_stripe
from shardio.units import format_size
from shardio.writers.hdf5 import DEFAULT_HDF5_ALIGNMENT, HDF5ShardWriter
from shardio.writers.tar import TarShardWriter, dali_index_text

__all__ = ["PackOptions", "PackResult", "pack"]

logger = logging.getLogger(__name__)

GiB = 1024**3
_SUFFIX = {"tar": ".tar", "hdf5": ".h5"}
# Source files read ahead of the shard writer, per worker process.
_READ_THREADS = 4
_READ_AHEAD = 8  # samples: keep what was read in the CPU cache for hashing and the write


@dataclass(frozen=True, kw_only=True)
class PackOptions:
    """How to pack.

    Attributes:
        shard_format: "tar" (WebDataset layout) or "hdf5".
        shard_size_bytes: target size of each shard; a larger single sample gets its own.
        workers: processes writing shards in parallel.
        labels: "auto" (class index from an ImageNet-style layout) or "none".
        stripe: "auto", "none", "pfl" or "COUNTxSIZE" for the destination's layout.
        fs_type: force the filesystem type instead of detecting it.
        strict: fail instead of skipping unpackable files.
        resume: finish an interrupted pack, reusing verified shards.
        force: overwrite an existing dataset in the destination.
        part: which part this process packs (0-based), of ``num_parts``.
        num_parts: parts of a multi-node pack; 1 packs and merges in one go.
        durable: fsync every file before publishing it.
    """

    shard_format: str = "tar"
    shard_size_bytes: int = GiB
    workers: int = 1
    labels: str = "auto"
    stripe: str = "auto"
    fs_type: str | None = None
    strict: bool = False
    resume: bool = False
    force: bool = False
    part: int = 0
    num_parts: int = 1
    durable: bool = True

    def __post_init__(self) -> None:
        if self.shard_format not in SHARD_FORMATS:
            raise UsageError(
                f"invalid format {self.shard_format!r}: choose one of {', '.join(SHARD_FORMATS)}"
            )
        if self.shard_size_bytes < 4096:
            raise UsageError(f"shard size {self.shard_size_bytes} bytes is too small (min 4 KiB)")
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1, got {self.workers}")
        if self.labels not in LABEL_MODES:
            raise UsageError(f"invalid --labels {self.labels!r}: choose one of {LABEL_MODES}")
        if not 0 <= self.part < self.num_parts:
            raise UsageError(f"invalid part {self.part}/{self.num_parts}: need 0 <= I < N")
        if self.resume and self.force:
            raise UsageError("--resume and --force exclude each other")
        parse_stripe(self.stripe)


@dataclass(frozen=True)
class PackResult:
    """What a pack did."""

    dst: str
    num_samples: int
    num_files: int
    num_shards: int
    data_bytes: int
    total_bytes: int
    seconds: float
    reused_shards: int
    skipped: tuple[Skipped, ...]
    oversized: tuple[str, ...]
    layout: LayoutResult
    merged: MergeResult | None = None
    part: int = 0
    num_parts: int = 1
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _check_paths(src: str, dst: str) -> None:
    real_src = os.path.realpath(src)
    real_dst = os.path.realpath(dst)
    if not os.path.exists(src):
        raise SourceError(errno.ENOENT, f"source {src} does not exist")
    if not os.path.isdir(src):
        raise SourceError(errno.ENOTDIR, f"source {src} is not a directory")
    if _inside(real_dst, real_src):
        raise UsageError(f"destination {dst} is inside the source {src}: choose a path outside it")
    if _inside(real_src, real_dst):
        raise UsageError(f"source {src} is inside the destination {dst}: choose another path")


def _check_dst(dst: str, options: PackOptions) -> bool:
    """Check what the destination holds; True if it is a complete dataset to keep (--resume).

    Writes nothing, so a refused pack leaves the destination as it was.
    """
    if os.path.exists(os.path.join(dst, MANIFEST_FILENAME)):
        if options.force:
            return False
        if options.resume:
            return True
        raise UsageError(f"{dst} already holds a shardio dataset: use --force to overwrite it")
    if os.path.isdir(dst) and not options.force and not options.resume:
        ours = {SHARD_DIR, WORK_DIR} if options.num_parts > 1 else set()
        foreign = [n for n in os.listdir(dst) if n not in ours]
        if foreign:
            raise UsageError(
                f"{dst} is not empty ({foreign[0]!r}, ...): use --resume to finish an "
                "interrupted pack or --force to overwrite"
            )
    return False


def _prepare_dst(dst: str, options: PackOptions) -> None:
    """Clear the destination for --force, remove a killed run's temp files, make the dirs."""
    if options.force and os.path.isdir(dst):
        _clear_dataset(dst)
    if os.path.isdir(dst):
        for name in os.listdir(dst):
            if is_temp_name(name):
                os.unlink(os.path.join(dst, name))
    try:
        os.makedirs(os.path.join(dst, SHARD_DIR), exist_ok=True)
        os.makedirs(os.path.join(dst, WORK_DIR, "frag"), exist_ok=True)
    except OSError as exc:
        raise StorageError(exc.errno or errno.EIO, f"cannot create {dst}: {exc.strerror}") from exc


def _clear_dataset(dst: str) -> None:
    """Remove shardio's own files from dst, manifest first so nothing looks complete."""
    for name in (MANIFEST_FILENAME, INDEX_FILENAME, REPORT_FILENAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dst, name))
    shutil.rmtree(os.path.join(dst, WORK_DIR), ignore_errors=True)
    shard_dir = os.path.join(dst, SHARD_DIR)
    if os.path.isdir(shard_dir):
        for name in os.listdir(shard_dir):
            if name.startswith(("shard-", ".shard-")):
                os.unlink(os.path.join(shard_dir, name))


def _remove_temps(dst: str, stems: Sequence[str]) -> None:
    """Remove temp files left by a killed run for this part's shards."""
    prefixes = tuple(f".{s}" for s in stems)
    for sub in (SHARD_DIR, os.path.join(WORK_DIR, "frag")):
        folder = os.path.join(dst, sub)
        for name in os.listdir(folder):
            if is_temp_name(name) and name.startswith(prefixes):
                os.unlink(os.path.join(folder, name))


@dataclass(frozen=True)
class _ShardJob:
    src: str
    dst: str
    plan: ShardPlan
    shard_format: str
    labelled: bool
    strict: bool
    durable: bool
    alignment: int
    fingerprint: str


_WORKER_COUNTERS: Counters | None = None


def _init_worker(counters: Counters, parent_pid: int) -> None:
    global _WORKER_COUNTERS  # noqa: PLW0603 - per-process handle set by the pool initializer
    _WORKER_COUNTERS = counters
    # The forkserver, not the packing process, is our parent, so PR_SET_PDEATHSIG cannot
    # help: watch the packing process and stop if it was killed (kill -9, OOM killer).
    threading.Thread(
        target=_watch_parent, args=(parent_pid,), name="shardio-watchdog", daemon=True
    ).start()


def _watch_parent(pid: int) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)


def _read_source(path: bytes, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        data = os.read(fd, size + 1)
        if len(data) < size:
            parts = [data]
            while True:
                chunk = os.read(fd, size + 1 - sum(map(len, parts)))
                if not chunk:
                    break
                parts.append(chunk)
            data = b"".join(parts)
    finally:
        os.close(fd)
    if len(data) != size:
        raise OSError(errno.EIO, f"changed size during pack (planned {size}, read {len(data)})")
    return data


def _record_path(dst: str, name: str, suffix: str) -> str:
    return os.path.join(dst, WORK_DIR, "frag", name + suffix)


def _write_shard(job: _ShardJob, counters: Counters | None = None) -> dict[str, Any]:
    """Write one shard, its DALI index, its index fragment and its done-record."""
    counters = counters or _WORKER_COUNTERS
    plan = job.plan
    rel_path = f"{SHARD_DIR}/{plan.name}{_SUFFIX[job.shard_format]}"
    path = os.path.join(job.dst, rel_path)
    root = os.fsencode(job.src)
    writer: TarShardWriter | HDF5ShardWriter
    if job.shard_format == "tar":
        writer = TarShardWriter(path, durable=job.durable)
    else:
        label_bytes = 24 * len(plan.samples) if job.labelled else 0
        capacity = sum(f.size for s in plan.samples for f in s.files) + label_bytes
        writer = HDF5ShardWriter(
            path, capacity_bytes=capacity, alignment=job.alignment, durable=job.durable
        )
    builder = IndexBuilder()
    skipped: list[dict[str, str]] = []
    data_bytes = 0
    try:
        for sample, loaded in _prefetch(root, plan.samples):
            members, paths = _collect_sample(sample, loaded, job, skipped)
            if members:
                placed = writer.add_sample(sample.key, sample.label, members)
                builder.add_sample(
                    shard=0,
                    key=sample.key,
                    label=sample.label,
                    members=[
                        MemberEntry(ext, off, size, digest, p)
                        for (ext, _, digest), (off, size), p in zip(
                            members, placed, paths, strict=True
                        )
                    ],
                )
                data_bytes += sum(len(m[1]) for m, p in zip(members, paths, strict=True) if p)
            if counters is not None:
                counters.add(len(sample.files), sum(f.size for f in sample.files))
        size, digest = writer.finish()
    except BaseException:
        writer.abort()
        raise
    dali_rel = None
    if isinstance(writer, TarShardWriter):
        dali_rel = f"{SHARD_DIR}/{plan.name}.idx"
        with atomic_write(os.path.join(job.dst, dali_rel), durable=job.durable) as fh:
            fh.write(dali_index_text(writer.samples))
    with atomic_write(_record_path(job.dst, plan.name, ".index"), durable=job.durable) as fh:
        builder.write(fh)
    record = {
        "fingerprint": job.fingerprint,
        "seq": plan.seq,
        "path": rel_path,
        "size_bytes": size,
        "num_samples": builder.num_samples,
        "num_members": len(builder._members),
        "data_bytes": data_bytes,
        "xxh3_128": digest,
        "dali_index": dali_rel,
        "skipped": skipped,
    }
    with atomic_write(_record_path(job.dst, plan.name, ".json"), durable=job.durable) as fh:
        fh.write(json.dumps(record).encode("ascii"))
    return record


_Loaded = list[tuple[bytes, int] | OSError]


def _load_files(root: bytes, sample: PlannedSample) -> _Loaded:
    """Read and hash a sample's files (runs in a read-ahead thread; os.read drops the GIL)."""
    out: _Loaded = []
    for f in sample.files:
        try:
            data = _read_source(os.path.join(root, f.rel), f.size)
        except OSError as exc:
            out.append(exc)
        else:
            out.append((data, member_xxh3_64(data)))
    return out


def _prefetch(
    root: bytes, samples: Sequence[PlannedSample]
) -> Iterator[tuple[PlannedSample, _Loaded]]:
    """Yield samples with their files read, in order, keeping reads ahead of the writer.

    Several reads in flight hide per-file latency (an open and a read per file cost a
    metadata and a data round trip on a parallel filesystem) behind the shard writes.
    """
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=_READ_THREADS, thread_name_prefix="shardio-read"
    ) as pool:
        pending: collections.deque[tuple[PlannedSample, concurrent.futures.Future[_Loaded]]]
        pending = collections.deque()
        it = iter(samples)
        for sample in itertools.islice(it, _READ_AHEAD):
            pending.append((sample, pool.submit(_load_files, root, sample)))
        try:
            while pending:
                sample, fut = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(_load_files, root, nxt)))
                yield sample, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()


def _collect_sample(
    sample: PlannedSample, loaded: _Loaded, job: _ShardJob, skipped: list[dict[str, str]]
) -> tuple[list[tuple[str, bytes, int]], list[bytes]]:
    members: list[tuple[str, bytes, int]] = []
    paths: list[bytes] = []
    for f, result in zip(sample.files, loaded, strict=True):
        if isinstance(result, OSError):
            exc = result
            reason = f"unreadable ({exc.strerror or exc})"
            if job.strict:
                raise PackError(f"cannot pack {os.fsdecode(f.rel)}: {reason}") from exc
            logger.warning("skipping %s: %s", os.fsdecode(f.rel), reason)
            skipped.append(Skipped(f.rel, reason).to_json())
            continue
        data, digest = result
        members.append((f.ext, data, digest))
        paths.append(f.rel)
    if members and job.labelled:
        label = b"%d" % sample.label
        members.append((LABEL_EXT, label, member_xxh3_64(label)))
        paths.append(b"")
    return members, paths


def _reusable(job: _ShardJob) -> dict[str, Any] | None:
    """Return the done-record of a shard if it and its files are intact."""
    name = job.plan.name
    try:
        with open(_record_path(job.dst, name, ".json"), "rb") as fh:
            record: dict[str, Any] = json.loads(fh.read())
        if record.get("fingerprint") != job.fingerprint:
            return None
        path = os.path.join(job.dst, record["path"])
        if os.path.getsize(path) != record["size_bytes"]:
            return None
        if not os.path.exists(_record_path(job.dst, name, ".index")):
            return None
        if record["dali_index"] and not os.path.exists(os.path.join(job.dst, record["dali_index"])):
            return None
        if file_xxh3_128(path) != record["xxh3_128"]:
            logger.warning("shard %s is damaged: writing it again", record["path"])
            return None
    except (OSError, ValueError, KeyError):
        return None
    return record


def pack(
    src: str,
    dst: str,
    options: PackOptions,
    *,
    progress: ProgressCallback | None = None,
    runner: CommandRunner = run_command,
) -> PackResult:
    """Pack the tree at ``src`` into a shardio dataset at ``dst``.

    Raises:
        SourceError: the source is missing, empty or unreadable.
        UsageError: bad options or destination (non-empty, inside the source, ...).
        PackError: strict mode met an unpackable file, or the source changed under --resume.
        StorageError: writing failed (ENOSPC included); published shards stay for --resume.
    """
    start = time.monotonic()
    _check_paths(src, dst)
    if _check_dst(dst, options):
        return _already_complete(dst, options, start)
    listing = list_tree(src, labels=options.labels)
    _first, groups = listing.part(options.part, options.num_parts)
    samples, skipped = resolve_samples(src, listing, groups)
    if skipped and options.strict:
        s = skipped[0]
        raise PackError(
            f"cannot pack {os.fsdecode(s.path)}: {s.reason} ({len(skipped)} file(s) "
            "unpackable; drop --strict to skip them)"
        )
    if not samples and options.num_parts == 1:
        raise SourceError(errno.ENOENT, f"source {src} holds no packable files")
    _prepare_dst(dst, options)
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
    fs_type = resolve_fs_type(dst, options.fs_type)
    stripe = parse_stripe(options.stripe)
    layout = apply_layout(
        os.path.join(dst, SHARD_DIR),
        fs_type=fs_type,
        stripe=stripe,
        shard_size_bytes=options.shard_size_bytes,
        runner=runner,
    )
    alignment = DEFAULT_HDF5_ALIGNMENT
    if layout.action == "applied" and isinstance(stripe, StripeSpec):
        alignment = stripe.size_bytes
    elif layout.action == "applied":
        alignment = 4 * 1024 * 1024 if options.shard_size_bytes >= 64 * 1024 * 1024 else 1024 * 1024
    fp_options: dict[str, object] = {
        "format": options.shard_format,
        "shard_size": options.shard_size_bytes,
        "labels": listing.label_layout,
        "part": f"{options.part}/{options.num_parts}",
        "alignment": alignment,
    }
    fingerprint = plan_fingerprint(shards, fp_options)
    _check_state(dst, options, fingerprint)
    _remove_temps(dst, [s.name for s in shards])
    jobs = [
        _ShardJob(
            src,
            dst,
            s,
            options.shard_format,
            labelled,
            options.strict,
            options.durable,
            alignment,
            fingerprint,
        )
        for s in shards
    ]
    records: dict[int, dict[str, Any]] = {}
    if options.resume:
        for job in jobs:
            record = _reusable(job)
            if record is not None:
                records[job.plan.seq] = record
    todo = [j for j in jobs if j.plan.seq not in records]
    reused = len(records)
    counters = Counters()
    reused_files = sum(j.plan.num_files for j in jobs if j.plan.seq in records)
    counters.add(
        reused_files,
        sum(f.size for j in jobs if j.plan.seq in records for s in j.plan.samples for f in s.files),
    )
    total_files = sum(j.plan.num_files for j in jobs)
    total_bytes = sum(f.size for s in samples for f in s.files)
    if progress is not None:
        with ProgressThread(counters, progress, files_total=total_files, bytes_total=total_bytes):
            records.update(_run_jobs(todo, options.workers, counters))
    else:
        records.update(_run_jobs(todo, options.workers, counters))
    part_skipped = list(skipped) + [
        Skipped(os.fsencode(s["path"]), s["reason"]) for r in records.values() for s in r["skipped"]
    ]
    _write_part_record(
        dst,
        options=options,
        listing=listing,
        records=records,
        skipped=part_skipped,
        oversized=oversized,
        layout=layout,
        fingerprint=fingerprint,
    )
    merged = merge_parts(dst) if options.num_parts == 1 else None
    ordered = [records[j.plan.seq] for j in jobs]
    return PackResult(
        dst=dst,
        num_samples=sum(r["num_samples"] for r in ordered),
        num_files=total_files - sum(1 for r in ordered for _ in r["skipped"]),
        num_shards=len(ordered),
        data_bytes=sum(r["data_bytes"] for r in ordered),
        total_bytes=sum(r["size_bytes"] for r in ordered),
        seconds=time.monotonic() - start,
        reused_shards=reused,
        skipped=tuple(part_skipped),
        oversized=oversized,
        layout=layout,
        merged=merged,
        part=options.part,
        num_parts=options.num_parts,
    )


def _already_complete(dst: str, options: PackOptions, start: float) -> PackResult:
    """--resume on a finished dataset: tidy what a kill after the manifest left, report it."""
    manifest = load_manifest(os.path.join(dst, MANIFEST_FILENAME))
    shutil.rmtree(os.path.join(dst, WORK_DIR), ignore_errors=True)
    for name in os.listdir(dst):
        if is_temp_name(name):
            os.unlink(os.path.join(dst, name))
    files = manifest.num_members - (manifest.num_samples if manifest.classes is not None else 0)
    return PackResult(
        dst=dst,
        num_samples=manifest.num_samples,
        num_files=files,
        num_shards=len(manifest.shards),
        data_bytes=manifest.data_bytes,
        total_bytes=manifest.total_bytes,
        seconds=time.monotonic() - start,
        reused_shards=len(manifest.shards),
        skipped=(),
        oversized=(),
        layout=LayoutResult.from_json(manifest.layout),
        part=options.part,
        num_parts=options.num_parts,
        warnings=(f"{dst} was already complete: nothing to resume",),
    )


def _check_state(dst: str, options: PackOptions, fingerprint: str) -> None:
    """Record the plan's fingerprint; under --resume it must match the interrupted run's."""
    state_path = os.path.join(
        dst, WORK_DIR, f"state-{options.part:04d}-of-{options.num_parts:04d}.json"
    )
    if os.path.exists(state_path):
        with open(state_path, "rb") as fh:
            previous = json.loads(fh.read()).get("fingerprint")
        if previous != fingerprint and options.resume:
            raise PackError(
                f"the source or the options changed since the interrupted pack into {dst}: "
                "rerun with the same options, or with --force to start over"
            )
    with atomic_write(state_path, durable=options.durable) as fh:
        fh.write(json.dumps({"fingerprint": fingerprint}).encode("ascii"))


def _run_jobs(
    jobs: Sequence[_ShardJob], workers: int, counters: Counters
) -> dict[int, dict[str, Any]]:
    if not jobs:
        return {}
    if workers == 1 or len(jobs) == 1:
        return {job.plan.seq: _write_shard(job, counters) for job in jobs}
    ctx = multiprocessing.get_context("forkserver")
    results: dict[int, dict[str, Any]] = {}
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(counters, os.getpid()),
    ) as pool:
        futures = {pool.submit(_write_shard, job): job for job in jobs}
        try:
            for fut in concurrent.futures.as_completed(futures):
                record = fut.result()
                results[record["seq"]] = record
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return results


def _write_part_record(
    dst: str,
    *,
    options: PackOptions,
    listing: Any,
    records: dict[int, dict[str, Any]],
    skipped: Sequence[Skipped],
    oversized: Sequence[str],
    layout: LayoutResult,
    fingerprint: str,
) -> None:
    doc = {
        "part": options.part,
        "num_parts": options.num_parts,
        "fingerprint": fingerprint,
        "shard_format": options.shard_format,
        "classes": list(listing.classes) if listing.classes is not None else None,
        "label_layout": listing.label_layout,
        "num_listed_files": listing.num_files,
        "options": {
            "shard_size_bytes": options.shard_size_bytes,
            "labels": options.labels,
            "stripe": options.stripe,
            "strict": options.strict,
            "num_parts": options.num_parts,
        },
        "layout": layout.to_json(),
        "shards": [records[k] for k in sorted(records)],
        "skipped": [s.to_json() for s in skipped],
        "oversized": list(oversized),
    }
    with atomic_write(
        os.path.join(dst, WORK_DIR, part_record_name(options.part, options.num_parts)),
        durable=options.durable,
    ) as fh:
        fh.write(json.dumps(doc, indent=1).encode("ascii"))
    logger.info(
        "part %d/%d: %d shards, %s",
        options.part,
        options.num_parts,
        len(records),
        format_size(sum(r["size_bytes"] for r in records.values())),
    )
