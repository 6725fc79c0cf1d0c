"""The typed, validated records of a pack's work directory, and where each one lives.

Layout of ``DST/.shardio-work/`` (removed once the dataset is complete)::

    state-IIII-of-NNNN.json   a part's plan: fingerprint, shard count, format; written before
                              the part's first shard, so shardio knows every file it may
                              have created
    frag/<shard>.index        the shard's index fragment
    frag/<shard>.json         the shard's done-record (written last: the shard is reusable)
    part-IIII-of-NNNN.json    a finished part: its shards, skipped files, layout
    next/                     a --force replacement being packed (a complete pack of its own)
    commit.json               the journal of a replacement being committed

Every record is read with a bounded, FIFO-safe read and validated field by field; a damaged
record is a :class:`~shardio.errors.FormatError` that names the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardio.errors import FormatError, StorageError
from shardio.format.fields import get_field
from shardio.format.label_source import LabelSource
from shardio.format.spec import SHARD_FORMATS, WORK_DIR
from shardio.packing.calls import SourceCalls
from shardio.packing.plan import shard_name
from shardio.packing.scan import Skipped
from shardio.storage.atomic import atomic_write
from shardio.storage.files import read_regular
from shardio.storage.striping import LayoutResult

__all__ = [
    "COMMIT_NAME",
    "MAX_PARTS",
    "NEXT_DIR",
    "CommitRecord",
    "PartRecord",
    "ShardRecord",
    "StateRecord",
    "done_path",
    "fragment_path",
    "is_dataset_path",
    "load_record",
    "part_record_name",
    "parse_record_name",
    "state_name",
    "write_record",
]

COMMIT_NAME = "commit.json"
MAX_PARTS = 9999  # part records are named part-IIII-of-NNNN
NEXT_DIR = "next"
_STATE_RE = re.compile(r"^state-(\d{4})-of-(\d{4})\.json$")
_PART_RE = re.compile(r"^part-(\d{4})-of-(\d{4})\.json$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
# Files shardio writes into a dataset: nothing else is ever listed for removal.
_DATASET_PATH = re.compile(
    r"^(manifest\.json|index\.bin|pack-report\.json|shards/shard-(p\d{4}-)?\d{6,}\.(tar|h5|idx)"
    r"|parity/group-\d{6,}\.(p\d{1,2}|cells))$"
)
_SHARD_NAME = re.compile(r"^shards/shard-(p\d{4}-)?(?P<seq>\d{6,})\.(?P<ext>tar|h5|idx)$")
_MAX_RECORD_BYTES = 1 << 30  # a part record lists every skipped file of the part


def state_name(part: int, num_parts: int) -> str:
    """File name of a part's state record in the work directory."""
    return f"state-{part:04d}-of-{num_parts:04d}.json"


def part_record_name(part: int, num_parts: int) -> str:
    """File name of a part's record in the work directory."""
    return f"part-{part:04d}-of-{num_parts:04d}.json"


def parse_record_name(name: str, kind: str) -> tuple[int, int] | None:
    """(part, num_parts) of a ``state`` or ``part`` record's file name, else None."""
    m = (_STATE_RE if kind == "state" else _PART_RE).match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def fragment_path(dst: str, name: str) -> str:
    """Path of a shard's index fragment."""
    return os.path.join(dst, WORK_DIR, "frag", name + ".index")


def done_path(dst: str, name: str) -> str:
    """Path of a shard's done-record."""
    return os.path.join(dst, WORK_DIR, "frag", name + ".json")


def is_dataset_path(rel: str) -> bool:
    """Whether ``rel`` is the name of a file shardio writes into a dataset."""
    return _DATASET_PATH.match(rel) is not None


# --------------------------------------------------------------------------- validation


def _count(doc: Mapping[str, Any], key: str, where: str, *, minimum: int = 0) -> int:
    value: int = get_field(doc, key, int, where)
    if value < minimum:
        raise FormatError(f"{where}: field {key!r} is {value}, below {minimum}")
    return value


def _hex(doc: Mapping[str, Any], key: str, where: str) -> str:
    value: str = get_field(doc, key, str, where)
    if not _HEX32.match(value):
        raise FormatError(f"{where}: field {key!r} is not 32 hex digits")
    return value


def _split(doc: Mapping[str, Any], where: str) -> tuple[int, int]:
    num_parts = _count(doc, "num_parts", where, minimum=1)
    part = _count(doc, "part", where)
    if part >= num_parts or num_parts > 9999:
        raise FormatError(f"{where}: part {part} of {num_parts} is out of range")
    return part, num_parts


def _format(doc: Mapping[str, Any], where: str) -> str:
    value: str = get_field(doc, "shard_format", str, where)
    if value not in SHARD_FORMATS:
        raise FormatError(f"{where}: unknown shard_format {value!r}")
    return value


def _skipped(doc: Mapping[str, Any], key: str, where: str) -> tuple[Skipped, ...]:
    out = []
    for i, item in enumerate(get_field(doc, key, list, where)):
        w = f"{where}: {key}[{i}]"
        if not isinstance(item, dict):
            raise FormatError(f"{w} is not an object")
        out.append(
            Skipped(os.fsencode(get_field(item, "path", str, w)), get_field(item, "reason", str, w))
        )
    return tuple(out)


def _calls(doc: Mapping[str, Any], where: str) -> SourceCalls:
    """The ``source_calls`` counts; absent (an older shardio wrote the record) means zeros."""
    if "source_calls" not in doc:
        return SourceCalls()
    return SourceCalls.from_json(doc["source_calls"], where)


def _plan(doc: Mapping[str, Any], where: str) -> str | None:
    """The ``plan_fingerprint``; absent (an older shardio wrote the record) means unknown."""
    if doc.get("plan_fingerprint") is None:
        return None
    return _hex(doc, "plan_fingerprint", where)


def _strings(doc: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    values = get_field(doc, key, list, where)
    if not all(isinstance(v, str) for v in values):
        raise FormatError(f"{where}: {key} must be a list of strings")
    return tuple(values)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, kw_only=True)
class StateRecord:
    """A part's plan, written before its first shard.

    ``fingerprint`` is the part's (its shards and files); ``plan_fingerprint`` the whole
    pack's, which every part must share (None in a record an older shardio wrote).
    """

    fingerprint: str
    part: int
    num_parts: int
    num_shards: int
    shard_format: str
    plan_fingerprint: str | None = None

    def owns(self, rel: str) -> bool:
        """Whether ``rel`` (relative to the dataset) is a file this part planned to write."""
        m = _SHARD_NAME.match(rel)
        if m is None or int(m.group("seq")) >= self.num_shards:
            return False
        if m.group("ext") not in (("tar", "idx") if self.shard_format == "tar" else ("h5",)):
            return False
        name = shard_name(int(m.group("seq")), part=self.part, num_parts=self.num_parts)
        return rel.rsplit("/", 1)[1].rsplit(".", 1)[0] == name

    def to_json(self) -> dict[str, Any]:
        """The JSON document."""
        return {
            "fingerprint": self.fingerprint,
            "part": self.part,
            "num_parts": self.num_parts,
            "num_shards": self.num_shards,
            "shard_format": self.shard_format,
            "plan_fingerprint": self.plan_fingerprint,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str) -> StateRecord:
        """Validate a JSON document."""
        part, num_parts = _split(doc, where)
        return cls(
            fingerprint=_hex(doc, "fingerprint", where),
            part=part,
            num_parts=num_parts,
            num_shards=_count(doc, "num_shards", where),
            shard_format=_format(doc, where),
            plan_fingerprint=_plan(doc, where),
        )


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """A finished shard (its done-record): the shard, its DALI index and index fragment."""

    fingerprint: str
    seq: int
    path: str
    size_bytes: int
    num_samples: int
    num_members: int
    data_bytes: int
    xxh3_128: str
    dali_index: str | None
    index_size_bytes: int
    index_xxh3_128: str
    skipped: tuple[Skipped, ...] = ()
    source_calls: SourceCalls = field(default_factory=SourceCalls)  # opens, fstats of sources

    def to_json(self) -> dict[str, Any]:
        """The JSON document."""
        return {
            "fingerprint": self.fingerprint,
            "seq": self.seq,
            "path": self.path,
            "size_bytes": self.size_bytes,
            "num_samples": self.num_samples,
            "num_members": self.num_members,
            "data_bytes": self.data_bytes,
            "xxh3_128": self.xxh3_128,
            "dali_index": self.dali_index,
            "index_size_bytes": self.index_size_bytes,
            "index_xxh3_128": self.index_xxh3_128,
            "skipped": [s.to_json() for s in self.skipped],
            "source_calls": self.source_calls.to_json(),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str) -> ShardRecord:
        """Validate a JSON document."""
        path = get_field(doc, "path", str, where)
        dali = doc.get("dali_index")
        if dali is not None and not isinstance(dali, str):
            raise FormatError(f"{where}: field 'dali_index' has the wrong type")
        for rel in (path, dali):
            if rel is not None and (not is_dataset_path(rel) or not rel.startswith("shards/")):
                raise FormatError(f"{where}: {rel!r} is not a shard path shardio writes")
        return cls(
            fingerprint=_hex(doc, "fingerprint", where),
            seq=_count(doc, "seq", where),
            path=path,
            size_bytes=_count(doc, "size_bytes", where),
            num_samples=_count(doc, "num_samples", where),
            num_members=_count(doc, "num_members", where),
            data_bytes=_count(doc, "data_bytes", where),
            xxh3_128=_hex(doc, "xxh3_128", where),
            dali_index=dali,
            index_size_bytes=_count(doc, "index_size_bytes", where),
            index_xxh3_128=_hex(doc, "index_xxh3_128", where),
            skipped=_skipped(doc, "skipped", where),
            source_calls=_calls(doc, where),
        )


@dataclass(frozen=True, kw_only=True)
class PartRecord:
    """A finished part of a pack, as the merge reads it."""

    part: int
    num_parts: int
    fingerprint: str
    shard_format: str
    classes: tuple[str, ...] | None
    label_layout: str
    num_listed_files: int
    options: Mapping[str, Any]
    layout: LayoutResult
    shards: tuple[ShardRecord, ...]
    skipped: tuple[Skipped, ...]
    oversized: tuple[str, ...]
    # The calls on the source: the scan of the run that finished the part, and the opens
    # made writing each of its shards, by whichever run wrote it.
    source_calls: SourceCalls = field(default_factory=SourceCalls)
    # The whole pack's plan (see StateRecord); None in a record an older shardio wrote.
    plan_fingerprint: str | None = None
    label_source: LabelSource | None = None  # a pinned label map's origin

    def to_json(self) -> dict[str, Any]:
        """The JSON document."""
        return {
            "part": self.part,
            "num_parts": self.num_parts,
            "fingerprint": self.fingerprint,
            "plan_fingerprint": self.plan_fingerprint,
            "shard_format": self.shard_format,
            "classes": list(self.classes) if self.classes is not None else None,
            "label_layout": self.label_layout,
            "num_listed_files": self.num_listed_files,
            "options": dict(self.options),
            "layout": self.layout.to_json(),
            "shards": [s.to_json() for s in self.shards],
            "skipped": [s.to_json() for s in self.skipped],
            "oversized": list(self.oversized),
            "source_calls": self.source_calls.to_json(),
            "label_source": self.label_source.to_json() if self.label_source else None,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str) -> PartRecord:
        """Validate a JSON document."""
        part, num_parts = _split(doc, where)
        classes = doc.get("classes")
        if classes is not None:
            classes = _strings(doc, "classes", where)
        shards = []
        for i, item in enumerate(get_field(doc, "shards", list, where)):
            if not isinstance(item, dict):
                raise FormatError(f"{where}: shards[{i}] is not an object")
            shards.append(ShardRecord.from_json(item, f"{where}: shards[{i}]"))
        try:
            layout = LayoutResult.from_json(get_field(doc, "layout", dict, where))
        except (FormatError, ValueError) as exc:
            raise FormatError(f"{where}: {exc}") from exc
        source = doc.get("label_source")
        label_source = LabelSource.from_json(source, where) if source is not None else None
        if label_source is not None and classes is None:
            raise FormatError(f"{where}: label_source is set, but there are no classes")
        return cls(
            part=part,
            num_parts=num_parts,
            fingerprint=_hex(doc, "fingerprint", where),
            plan_fingerprint=_plan(doc, where),
            label_source=label_source,
            shard_format=_format(doc, where),
            classes=classes,
            label_layout=get_field(doc, "label_layout", str, where),
            num_listed_files=_count(doc, "num_listed_files", where),
            options=get_field(doc, "options", dict, where),
            layout=layout,
            shards=tuple(shards),
            skipped=_skipped(doc, "skipped", where),
            oversized=_strings(doc, "oversized", where),
            source_calls=_calls(doc, where),
        )


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    """The journal of a replacement: old files to remove, new files to move in.

    Attributes:
        remove: the old dataset's files (relative to DST), the old manifest among them.
        move: the new dataset's files (relative to the ``next`` directory, and to DST once
            moved), the manifest excluded: it moves last.
    """

    remove: tuple[str, ...]
    move: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The JSON document."""
        return {"remove": list(self.remove), "move": list(self.move)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str) -> CommitRecord:
        """Validate a JSON document; every path must be one shardio writes."""
        remove, move = _strings(doc, "remove", where), _strings(doc, "move", where)
        for rel in remove + move:
            if not is_dataset_path(rel):
                raise FormatError(f"{where}: {rel!r} is not a dataset file shardio writes")
        return cls(remove=remove, move=move)


_Record = TypeVar("_Record", StateRecord, ShardRecord, PartRecord, CommitRecord)
_WHAT = {
    StateRecord: "pack state record",
    ShardRecord: "shard done-record",
    PartRecord: "part record",
    CommitRecord: "commit record",
}


def load_record(path: str, kind: type[_Record]) -> _Record:
    """Read and validate one record.

    Raises:
        FormatError: the file is not valid JSON or a field is missing or mistyped; the
            message names the file.
        StorageError: the file is missing, unreadable or not a regular file.
    """
    what = _WHAT[kind]
    try:
        data = read_regular(path, max_bytes=_MAX_RECORD_BYTES, what=what)
    except StorageError as exc:
        if exc.errno == errno.EINVAL:  # a FIFO, device or directory in place of the record
            raise FormatError(str(exc)) from exc
        raise
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{what} {path} is damaged (not valid JSON)") from exc
    if not isinstance(doc, dict):
        raise FormatError(f"{what} {path} is damaged (not a JSON object)")
    try:
        return kind.from_json(doc, path)
    except FormatError as exc:
        raise FormatError(f"{what} {exc}") from exc


def write_record(path: str, record: _Record, *, durable: bool) -> None:
    """Publish a record atomically."""
    with atomic_write(path, durable=durable) as fh:
        fh.write(json.dumps(record.to_json(), indent=1).encode("ascii"))
