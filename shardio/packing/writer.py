"""Write a dataset from code, sample by sample: the same shards, index and manifest as pack.

``ShardWriter`` cuts the samples it is given, in order, into tar or HDF5 shards of a target
size, hashing every member (xxh3-64) and every shard (xxh3-128), as ``shardio pack`` does.
Nothing is visible until :meth:`ShardWriter.close`: shards are written into a staging folder
of the work directory (striped like the shard folder, so a rename keeps their layout), then
renamed into ``shards/``, recorded, and merged into the index and manifest, which are written
last. A write killed half-way leaves only work files, which ``overwrite=True`` (for this
part) or ``shardio pack --force`` removes. N writers (ranks, SLURM tasks) write parts
``part=I, num_parts=N`` into one directory; ``shardio merge`` joins them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import xxhash

from shardio._check import require_int, require_path
from shardio.errors import UsageError
from shardio.format.spec import SHARD_DIR, SHARD_FORMATS, WORK_DIR
from shardio.packing.dest import (
    make_dst,
    remove_bare_dst,
)
from shardio.packing.merge import merge_locked
from shardio.packing.part import alignment_of
from shardio.packing.plan import shard_name
from shardio.packing.samples import check_classes, check_sample
from shardio.packing.staged import EMPTY_TAR_BYTES, StagedShard, tar_cost
from shardio.packing.workfiles import (
    MAX_PARTS,
    PartRecord,
    ShardRecord,
    StateRecord,
    done_path,
    part_record_name,
    state_name,
    write_record,
)
from shardio.packing.writer_dst import check_writer_dst, holds_files, remove_part
from shardio.storage.atomic import fsync_dir, rename_noreplace
from shardio.storage.dirlock import lock_directory
from shardio.storage.files import make_dirs_inside
from shardio.storage.fsdetect import resolve_fs_type
from shardio.storage.runner import CommandRunner, run_command
from shardio.storage.stripe_spec import parse_stripe
from shardio.storage.striping import LayoutResult, apply_layout
from shardio.units import parse_size

__all__ = ["ShardWriter", "WriteResult"]

logger = logging.getLogger(__name__)

_MIN_SHARD_BYTES = 4096
_BUSY = "another shardio pack or ShardWriter is writing to"


@dataclass(frozen=True, kw_only=True)
class WriteResult:
    """What a ShardWriter wrote: this part's samples and shards; ``merged`` once the dataset
    is complete (one part, or the parts joined later by ``shardio merge``)."""

    dst: str
    part: int
    num_parts: int
    num_samples: int
    num_shards: int
    data_bytes: int
    total_bytes: int
    oversized: tuple[str, ...]
    layout: LayoutResult
    merged: bool


class ShardWriter:
    """Writes samples into a shardio dataset (or one part of it) at ``dst``.

    Use it as a context manager: the dataset is published when the block ends, and nothing
    is left behind when it raises::

        with ShardWriter("out/", format="tar", shard_size="1GiB") as w:
            for key, image, label in samples:
                w.write({"__key__": key, "jpg": image, "cls": label})

    Args:
        dst: a new or empty directory (or one holding the other parts of the same write).
        format: ``"tar"`` (WebDataset layout, with DALI indexes) or ``"hdf5"``.
        shard_size: target shard size, bytes or text such as ``"512MiB"``; a sample larger
            than it gets a shard of its own (reported in ``oversized``). An HDF5 shard is
            held in memory until it is full, so this is also its memory bound.
        classes: the label map (class index -> name). Without it the labels are indexes and
            the classes are named ``"0"``, ``"1"``, ...; with several parts it is required for
            labelled data, so that every part records one map.
        part: this writer's part of a write split over ``num_parts`` writers
            (``0 <= part < num_parts``); the parts are joined by ``shardio merge`` once all
            have closed.
        num_parts: how many writers share the write (1: this one alone).
        overwrite: remove what an interrupted earlier write of this part left (never a
            finished dataset, never a file shardio did not write).
        stripe: the shard folder's layout, as ``shardio pack --stripe``.
        fs_type: the filesystem type to plan it for, as ``shardio pack --fs-type`` (None:
            detected).
        durable: fsync shards and records before they are published.
        runner: runs ``lfs``/``beegfs-ctl`` for striping.
    """

    def __init__(
        self,
        dst: str | os.PathLike[str],
        *,
        format: str = "tar",  # pack's --format; shadows the builtin in this method only
        shard_size: int | str = "1GiB",
        classes: Sequence[str] | None = None,
        part: int = 0,
        num_parts: int = 1,
        overwrite: bool = False,
        stripe: str = "auto",
        fs_type: str | None = None,
        durable: bool = True,
        runner: CommandRunner = run_command,
    ) -> None:
        self.dst = require_path(dst, "ShardWriter destination")
        if format not in SHARD_FORMATS:
            raise UsageError(f"invalid format {format!r}: choose one of {', '.join(SHARD_FORMATS)}")
        self.shard_format = format
        if isinstance(shard_size, str):
            self.shard_size_bytes = parse_size(shard_size)
        else:
            self.shard_size_bytes = require_int(shard_size, "shard_size", minimum=1)
        if self.shard_size_bytes < _MIN_SHARD_BYTES:
            raise UsageError(f"shard size {self.shard_size_bytes} bytes is too small (min 4 KiB)")
        self.num_parts = require_int(num_parts, "num_parts", minimum=1, maximum=MAX_PARTS)
        self.part = require_int(part, "part", minimum=0, maximum=self.num_parts - 1)
        self.classes = check_classes(classes)
        if not isinstance(overwrite, bool) or not isinstance(durable, bool):
            raise UsageError("overwrite and durable must be True or False")
        parse_stripe(stripe)
        self.stripe, self.fs_type = stripe, fs_type
        self.overwrite, self.durable = overwrite, durable
        self._runner = runner
        self._labelled: bool | None = True if self.classes is not None else None
        self._stack: contextlib.ExitStack | None = None
        self._created = False
        self._result: WriteResult | None = None  # what close() returned (it is idempotent)
        self._state = "new"  # new -> open -> closed | failed
        self._keys: set[str] = set()
        self._shard: StagedShard | None = None
        self._records: list[ShardRecord] = []
        self._oversized: list[str] = []
        self._max_label = -1
        self._layout: LayoutResult | None = None
        self._alignment = 0

    # -- names ---------------------------------------------------------------------------------
    @property
    def _work(self) -> str:
        return os.path.join(self.dst, WORK_DIR)

    @property
    def _staging(self) -> str:
        return os.path.join(self._work, f"write-{self.part:04d}-of-{self.num_parts:04d}")

    def _whole_fingerprint(self) -> str:
        plan = ("shardio-writer", self.shard_format, self.shard_size_bytes, self.classes)
        return xxhash.xxh3_128_hexdigest(ascii((plan, self.num_parts)).encode())

    def _part_fingerprint(self) -> str:
        return xxhash.xxh3_128_hexdigest(f"{self._whole_fingerprint()}:{self.part}".encode())

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> ShardWriter:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def open(self) -> None:
        """Lock and check ``dst``, then make the work folders (``write`` calls it if needed).

        Raises:
            UsageError: ``dst`` holds a dataset, foreign files, another split, or an
                interrupted write of this part (without ``overwrite``); or it is locked.
            PackError: other parts in ``dst`` were begun with other options.
        """
        if self._state != "new":
            raise UsageError(f"the ShardWriter for {self.dst} was already opened")
        self._state = "failed"  # until open succeeds
        stack = contextlib.ExitStack()
        try:
            self._created = make_dst(self.dst)
            stack.enter_context(lock_directory(self.dst, shared=self.num_parts > 1, busy=_BUSY))
            check_writer_dst(
                self.dst,
                part=self.part,
                num_parts=self.num_parts,
                fingerprint=self._whole_fingerprint(),
            )
            staging = make_dirs_inside(self.dst, os.path.relpath(self._staging, self.dst))
            busy = f"another ShardWriter is writing part {self.part}/{self.num_parts} to"
            stack.enter_context(lock_directory(staging, shared=False, busy=busy))
            self._check_own_part()
            self._prepare(staging)
        except BaseException:
            stack.close()
            if self._created:
                remove_bare_dst(self.dst)
            raise
        self._stack = stack
        self._state = "open"

    def _remove_part(self) -> None:
        """Remove this part's files: staged shards, fragments, published shards, records."""
        remove_part(
            self.dst,
            staging=self._staging,
            part=self.part,
            num_parts=self.num_parts,
            shard_format=self.shard_format,
        )

    def _check_own_part(self) -> None:
        """Under the part's lock: what an earlier write of this part left."""
        names = (state_name, part_record_name)
        own = [os.path.join(self._work, f(self.part, self.num_parts)) for f in names]
        if not any(os.path.lexists(p) for p in own) and not holds_files(self._staging):
            return
        if not self.overwrite:
            raise UsageError(
                f"{self.dst} holds an earlier write of part {self.part}/{self.num_parts} "
                "(interrupted, or not merged yet): pass overwrite=True to write it again"
            )
        self._remove_part()

    def _prepare(self, staging: str) -> None:
        shard_dir = make_dirs_inside(self.dst, SHARD_DIR)
        make_dirs_inside(self.dst, f"{WORK_DIR}/frag")
        fs_type = resolve_fs_type(self.dst, self.fs_type)
        for folder in (staging, shard_dir):  # staged shards keep their layout when renamed
            layout = apply_layout(
                folder,
                fs_type=fs_type,
                stripe=parse_stripe(self.stripe),
                shard_size_bytes=self.shard_size_bytes,
                runner=self._runner,
            )
        self._layout = layout
        self._alignment = alignment_of(layout, self.stripe, self.shard_size_bytes)
        self._write_state(0)

    def _write_state(self, num_shards: int) -> None:
        state = StateRecord(
            fingerprint=self._part_fingerprint(),
            part=self.part,
            num_parts=self.num_parts,
            num_shards=num_shards,
            shard_format=self.shard_format,
            plan_fingerprint=self._whole_fingerprint(),
        )
        path = os.path.join(self._work, state_name(self.part, self.num_parts))
        write_record(path, state, durable=self.durable)

    # -- writing -------------------------------------------------------------------------------
    def write(self, sample: dict[str, Any]) -> None:
        """Write one sample: ``{"__key__": key, ext: bytes | str, ..., "cls": label}``.

        A sample refused for its content (a bad or duplicate key, a reserved name, a label
        missing or out of range) raises UsageError, and a str member UTF-8 cannot write (a
        lone surrogate) FormatError, naming the sample; either writes nothing: the writer
        goes on.
        A failure to write (ENOSPC, EIO) leaves the writer failed: ``close`` raises and
        the context manager removes what it wrote.
        """
        if self._state == "new":
            self.open()
        if self._state != "open":
            raise UsageError(f"the ShardWriter for {self.dst} is {self._state}: cannot write")
        checked = check_sample(
            sample, len(self._keys), labelled=self._labelled, classes=self.classes
        )
        if checked.key in self._keys:
            raise UsageError(
                f"duplicate key {checked.key!r}: each sample of a dataset needs its own key"
            )
        if self._labelled is None:
            if checked.label >= 0 and self.num_parts > 1:
                raise UsageError(
                    f"sample {checked.key!r} is labelled: with {self.num_parts} parts give "
                    "classes= to every writer, so that all parts record one label map"
                )
            self._labelled = checked.label >= 0
        self._state = "failed"  # until the sample is in
        cost = tar_cost(checked)
        shard = self._shard
        if shard is not None and shard.cost + cost > self.shard_size_bytes:
            self._finish_shard()
            shard = None
        if shard is None:
            seq = len(self._records)
            name = shard_name(seq, part=self.part, num_parts=self.num_parts)
            shard = self._shard = StagedShard.begin(
                seq, name, staging=self._staging, shard_format=self.shard_format,
                durable=self.durable,
            )  # fmt: skip
        if shard.cost == EMPTY_TAR_BYTES and EMPTY_TAR_BYTES + cost > self.shard_size_bytes:
            self._oversized.append(checked.key)
        shard.add(checked)
        shard.cost += cost
        self._keys.add(checked.key)
        self._max_label = max(self._max_label, checked.label)
        self._state = "open"

    def _finish_shard(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        record = shard.finish(
            dst=self.dst,
            alignment=self._alignment,
            fingerprint=self._part_fingerprint(),
            durable=self.durable,
        )
        self._records.append(record)
        logger.debug("%s: shard %s written (%d bytes)", self.dst, shard.name, record.size_bytes)

    # -- publishing ----------------------------------------------------------------------------
    def close(self) -> WriteResult:
        """Finish the last shard, publish this part and, with one part, the dataset.

        Idempotent: closing a closed writer (``close()`` inside its ``with`` block, whose end
        closes again) publishes nothing more and returns the same result.

        Raises:
            UsageError: nothing was written (one part), or the writer failed earlier.
            StorageError: writing failed (what this part wrote is removed by ``abort``).
        """
        if self._state == "closed" and self._result is not None:
            return self._result
        if self._state == "new":
            self.open()
        if self._state != "open":
            raise UsageError(f"the ShardWriter for {self.dst} is {self._state}: cannot close it")
        self._state = "failed"
        if not self._keys and self.num_parts == 1:
            self.abort()
            raise UsageError(f"no sample was written to {self.dst}: nothing to publish")
        try:
            self._finish_shard()
            self._publish()
            merged = self.num_parts == 1
            if merged:
                merge_locked(self.dst, durable=self.durable)
        except BaseException:
            self.abort()
            raise
        with contextlib.suppress(OSError):
            os.rmdir(self._staging)
        self._release()
        self._state = "closed"
        assert self._layout is not None  # set by open()
        self._result = WriteResult(
            dst=self.dst,
            part=self.part,
            num_parts=self.num_parts,
            num_samples=len(self._keys),
            num_shards=len(self._records),
            data_bytes=sum(r.data_bytes for r in self._records),
            total_bytes=sum(r.size_bytes for r in self._records),
            oversized=tuple(self._oversized),
            layout=self._layout,
            merged=merged,
        )
        return self._result

    def _publish(self) -> None:
        """Rename the staged shards into ``shards/``, then write their records and the part's."""
        pairs = []
        for rec in self._records:
            for rel in (rec.path, rec.dali_index):
                if rel is None:
                    continue
                final = os.path.join(self.dst, rel)
                if os.path.lexists(final):
                    raise UsageError(f"{final} appeared during the write: shardio left it alone")
                pairs.append((os.path.join(self._staging, os.path.basename(rel)), final))
        self._write_state(len(self._records))  # an interrupted overwrite knows what to remove
        for staged, final in pairs:
            rename_noreplace(staged, final)
        if self.durable:
            fsync_dir(os.path.join(self.dst, SHARD_DIR))
        for rec in self._records:
            stem = os.path.basename(rec.path).rsplit(".", 1)[0]
            write_record(done_path(self.dst, stem), rec, durable=self.durable)
        classes = self.classes
        if self._labelled and classes is None:
            classes = tuple(str(i) for i in range(self._max_label + 1))
        assert self._layout is not None  # set by open()
        record = PartRecord(
            part=self.part,
            num_parts=self.num_parts,
            fingerprint=self._part_fingerprint(),
            shard_format=self.shard_format,
            classes=classes if self._labelled else None,
            label_layout="writer" if self._labelled else "none",
            num_listed_files=len(self._keys),
            options={
                "writer": True,
                "shard_size_bytes": self.shard_size_bytes,
                "labels": "writer" if self._labelled else "none",
                "stripe": self.stripe,
                "strict": True,
                "num_parts": self.num_parts,
                "parity": None,
            },
            layout=self._layout,
            shards=tuple(self._records),
            skipped=(),
            oversized=tuple(self._oversized),
            plan_fingerprint=self._whole_fingerprint(),
        )
        path = os.path.join(self._work, part_record_name(self.part, self.num_parts))
        write_record(path, record, durable=self.durable)

    def abort(self) -> None:
        """Remove what this writer wrote (its part only) and release ``dst``; idempotent."""
        if self._stack is None:
            self._state = "closed" if self._state == "closed" else "failed"
            return
        shard, self._shard = self._shard, None
        if shard is not None and shard.writer is not None:
            shard.writer.abort()
        try:
            self._remove_part()
            with contextlib.suppress(OSError):
                os.rmdir(self._staging)
        finally:
            self._release()
            self._state = "failed"
            if self._created:
                remove_bare_dst(self.dst)

    def _release(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
