"""Join the parts of a pack (one per SLURM task, or the single part) into one dataset.

Reads each part's record and per-shard index fragments from the work directory (each
fragment checked against the xxh3-128 its done-record holds), writes the global index, the
pack report and, last and atomically, the manifest, which records every part's plan
fingerprint for a later ``--resume`` to compare against. Every part must carry the same
plan fingerprint (of the listing of the tree, the label map and the shard-shaping
options): parts packed from different states of the source are refused. The pack report
also gives each part's metadata calls on the source tree
(:class:`~shardio.packing.calls.SourceCalls`) and their total.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field

from shardio._version import __version__
from shardio.errors import FormatError, PackError, ShardioError, StorageError, UsageError
from shardio.format.checksum import file_xxh3_128
from shardio.format.index import Index
from shardio.format.index_write import merge_indexes, seal_manifest
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry
from shardio.format.spec import INDEX_FILENAME, MANIFEST_FILENAME, REPORT_FILENAME, WORK_DIR
from shardio.metrics.progress import Counters, ProgressCallback, ProgressThread
from shardio.packing.calls import SourceCalls
from shardio.packing.dest import existing_dir, remove_temps, remove_work_dir
from shardio.packing.workfiles import (
    PartRecord,
    ShardRecord,
    fragment_path,
    load_record,
    parse_record_name,
    part_record_name,
)
from shardio.parity.codec import parse_scheme
from shardio.storage.atomic import atomic_write
from shardio.storage.dirlock import lock_directory

__all__ = ["MergeResult", "merge_locked", "merge_parts", "part_record_name"]


@dataclass(frozen=True)
class MergeResult:
    """The dataset a merge produced.

    ``part_calls`` holds each part's metadata calls on the source tree, as its record
    says: the scan of the run that finished it, and the opens made writing each of its
    shards (by whichever run wrote it, so a resumed pack reports what one that ran
    through does); ``source_calls`` is their sum.
    """

    manifest: Manifest
    num_parts: int
    part_calls: tuple[SourceCalls, ...] = field(default_factory=tuple)

    @property
    def source_calls(self) -> SourceCalls:
        """The parts' metadata calls on the source tree, added up."""
        return SourceCalls.total(list(self.part_calls))


def _load_parts(dst: str) -> list[PartRecord]:
    work = os.path.join(dst, WORK_DIR)
    if not existing_dir(work):
        if os.path.lexists(os.path.join(dst, MANIFEST_FILENAME)):
            raise UsageError(f"{dst} is already merged")
        raise UsageError(
            f"{dst} holds no packed parts to merge (run shardio pack --part I/N first)"
        )
    found: dict[int, int] = {}
    for name in os.listdir(work):
        split = parse_record_name(name, "part")
        if split is not None:
            found[split[0]] = split[1]
    if not found:
        raise UsageError(f"{dst} holds no finished parts to merge")
    totals = set(found.values())
    if len(totals) != 1:
        raise UsageError(f"{dst} holds parts of different splits ({sorted(totals)}): repack")
    num_parts = totals.pop()
    missing = sorted(set(range(num_parts)) - set(found))
    if missing:
        shown = ", ".join(str(m) for m in missing[:10])
        raise UsageError(f"{dst}: parts {shown} of {num_parts} have not finished: run them first")
    parts = []
    for i in range(num_parts):
        path = os.path.join(work, part_record_name(i, num_parts))
        record = load_record(path, PartRecord)
        if (record.part, record.num_parts) != (i, num_parts):
            raise FormatError(f"part record {path} is damaged: it says part {record.part}")
        parts.append(record)
    first = parts[0]
    for p in parts[1:]:
        for key, what in _MUST_AGREE:
            if getattr(p, key) != getattr(first, key):
                raise UsageError(f"{dst}: part {p.part} was packed with a different {what}")
    _check_one_plan(dst, parts)
    return parts


# What every part must share, and its name in messages.
_MUST_AGREE = (
    ("shard_format", "shard format"),
    ("classes", "label map (classes)"),
    ("label_layout", "label layout"),
    ("options", "set of options"),
)


def _check_one_plan(dst: str, parts: list[PartRecord]) -> None:
    """Every part must come from one plan of one state of the source tree (and one pinned
    label map): parts of different plans overlap or leave samples out."""
    n = len(parts)
    plans = [p.plan_fingerprint for p in parts]
    for p in parts:
        if p.plan_fingerprint is None:
            raise PackError(
                f"{dst}: part {p.part}/{n} was packed by a shardio that did not record its "
                "plan, so merge cannot tell that it fits the other parts: pack every part "
                "again into a new directory"
            )
    first = parts[0]
    for p, plan in zip(parts[1:], plans[1:], strict=True):
        if plan != plans[0] or _origin(p) != _origin(first):
            raise PackError(
                f"{dst}: part {p.part}/{n} was planned from another state of the source tree "
                f"than part {first.part}/{n} (files added or removed between the runs, another "
                "label map or other options; plan "
                f"{str(plan)[:12]} vs {str(plans[0])[:12]}): merging them "
                "would duplicate or lose samples; pack every part again from one unchanged "
                "source into a new directory"
            )


def _origin(part: PartRecord) -> tuple[str, str] | None:
    return part.label_source.identity if part.label_source is not None else None


def _open_fragment(dst: str, part: PartRecord, rec: ShardRecord) -> Index:
    """Open a shard's index fragment after checking it against its done-record."""
    stem = os.path.basename(rec.path).rsplit(".", 1)[0]
    path = fragment_path(dst, stem)
    again = f"rerun `shardio pack --resume` for part {part.part}/{part.num_parts} to rewrite it"
    try:
        digest = file_xxh3_128(path, what="index fragment")
    except StorageError as exc:
        raise FormatError(
            f"index fragment {path} is missing or unreadable ({exc}): {again}"
        ) from exc
    if digest != rec.index_xxh3_128:
        raise FormatError(f"index fragment {path} is damaged (checksum mismatch): {again}")
    try:
        frag = Index.open(path)
    except (ShardioError, ValueError, OSError) as exc:
        raise FormatError(f"index fragment {path} is damaged ({exc}): {again}") from exc
    if len(frag) != rec.num_samples or frag.n_shards != 1:
        frag.close()
        raise FormatError(f"index fragment {path} does not match {rec.path}: {again}")
    return frag


def _check_unique_keys(dst: str, fragments: list[tuple[Index, int]]) -> None:
    """Parts written by ShardWriters each checked their own keys; across parts, here."""
    seen: dict[str, int] = {}
    for number, (frag, _) in enumerate(fragments):
        for sample in range(len(frag)):
            key = frag.key(sample)
            if seen.setdefault(key, number) != number:
                raise UsageError(
                    f"{dst}: key {key!r} was written by two parts (shards {seen[key]} and "
                    f"{number} of the merge): give every sample of a dataset its own key, then "
                    "write the parts again (overwrite=True)"
                )


def merge_parts(
    dst: str,
    *,
    durable: bool = True,
    progress: ProgressCallback | None = None,
    workers: int = 1,
) -> MergeResult:
    """Merge the finished parts in ``dst`` into one dataset and remove the work files.

    Holds an exclusive lock on DST, so no part can still be writing.

    Args:
        dst: the dataset directory the parts were packed into.
        durable: fsync what is written (the index, the pack report, the manifest).
        progress: called from a helper thread with (shards, bytes) snapshots: a shard
            counts, with its size, once its index fragment is checked; the final
            snapshot comes when the manifest is written (not after a failure).
        workers: processes computing parity (a pack with ``--parity``).

    Raises:
        UsageError: no parts, parts missing, parts packed with different options, or a
            pack is still writing to DST.
        PackError: the parts come from different plans (the source tree, the label map or
            the options changed between their runs); the message names the part.
        FormatError: a part record or index fragment is damaged (naming the file).
    """
    if not os.path.isdir(dst):
        raise UsageError(f"{dst} is not a directory holding packed parts")
    with lock_directory(dst, shared=False):
        return merge_locked(dst, durable=durable, progress=progress, workers=workers)


def merge_locked(
    dst: str,
    *,
    durable: bool = True,
    progress: ProgressCallback | None = None,
    workers: int = 1,
) -> MergeResult:
    """:func:`merge_parts` for a caller that already holds DST's lock."""
    parts = _load_parts(dst)
    counters = Counters(shared=False)  # counted by this thread only
    tracker = (
        ProgressThread(
            counters,
            progress,
            files_total=sum(len(p.shards) for p in parts),
            bytes_total=sum(rec.size_bytes for p in parts for rec in p.shards),
        )
        if progress is not None
        else contextlib.nullcontext()
    )
    with tracker:
        return _merge(dst, parts, counters, durable=durable, workers=workers)


def _merge(
    dst: str, parts: list[PartRecord], counters: Counters, *, durable: bool, workers: int
) -> MergeResult:
    """Join ``parts`` into DST's index, pack report and manifest; count shards as joined."""
    remove_temps(dst)  # left by a merge killed mid-write
    shards: list[ShardEntry] = []
    fragments: list[tuple[Index, int]] = []
    num_members = data_bytes = first_sample = 0
    try:
        for part in parts:
            for rec in part.shards:
                fragments.append((_open_fragment(dst, part, rec), len(shards)))
                shards.append(
                    ShardEntry(
                        path=rec.path,
                        size_bytes=rec.size_bytes,
                        num_samples=rec.num_samples,
                        first_sample=first_sample,
                        xxh3_128=rec.xxh3_128,
                        dali_index=rec.dali_index,
                    )
                )
                first_sample += rec.num_samples
                num_members += rec.num_members
                data_bytes += rec.data_bytes
                counters.add(1, rec.size_bytes)
        if len(parts) > 1 and parts[0].options.get("writer"):
            _check_unique_keys(dst, fragments)
        index_path = os.path.join(dst, INDEX_FILENAME)
        with atomic_write(index_path, durable=durable) as fh:
            num_samples = merge_indexes(fh, fragments, n_shards=len(shards))
    finally:
        for frag, _ in fragments:
            frag.close()
    first = parts[0]
    part_calls = tuple(p.source_calls.copy() for p in parts)
    report = {
        "skipped": [s.to_json() for p in parts for s in p.skipped],
        "oversized": [k for p in parts for k in p.oversized],
        "source_calls": {
            "total": SourceCalls.total(list(part_calls)).to_json(),
            "parts": [c.to_json() for c in part_calls],
        },
    }
    with atomic_write(os.path.join(dst, REPORT_FILENAME), durable=durable) as fh:
        fh.write(json.dumps(report, indent=1).encode("ascii"))
    manifest = Manifest(
        shard_format=first.shard_format,
        num_samples=num_samples,
        num_members=num_members,
        data_bytes=data_bytes,
        index=IndexEntry(
            path=INDEX_FILENAME,
            size_bytes=os.path.getsize(index_path),
            xxh3_128=file_xxh3_128(index_path, what="index"),
        ),
        shards=tuple(shards),
        classes=first.classes,
        label_layout=first.label_layout,
        options=first.options,
        layout=first.layout.to_json(),
        created_by=f"shardio {__version__}",
        pack_fingerprints=tuple(p.fingerprint for p in parts),
        label_source=first.label_source,
    )
    manifest = seal_manifest(manifest, index_path)  # per-shard index checksums, checked
    scheme = first.options.get("parity")
    if scheme:  # pack --parity: every shard is published and checked; the journal resumes it
        from shardio.parity.encode import encode_parity  # the parity extra, only then

        k, m = parse_scheme(scheme)
        section = encode_parity(dst, manifest.shards, k=k, m=m, workers=workers, durable=durable)
        manifest = dataclasses.replace(manifest, parity=section)
    with atomic_write(os.path.join(dst, MANIFEST_FILENAME), durable=durable) as fh:
        fh.write(manifest.dumps())
    remove_work_dir(dst)
    return MergeResult(manifest=manifest, num_parts=len(parts), part_calls=part_calls)
