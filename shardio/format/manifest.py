"""The dataset manifest: its model and the validating parser for each version."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardio.errors import FormatError
from shardio.format.document import check_document_checksum, encode_document
from shardio.format.fields import MAX_INT, get_field
from shardio.format.label_source import LabelSource
from shardio.format.parity import ParitySection
from shardio.format.spec import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LABEL_LAYOUTS,
    MANIFEST_CHECKSUM_FIELD,
    MANIFEST_FILENAME,
    MAX_MANIFEST_BYTES,
    SHARD_FORMATS,
)
from shardio.storage.files import read_regular

__all__ = [
    "IndexEntry",
    "Manifest",
    "ShardEntry",
    "load_manifest",
    "parse_manifest",
]

_HEX128 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry:
    """One shard file of the dataset (slots: a manifest may list 100,000 of them)."""

    path: str  # relative to the dataset root, "/"-separated
    size_bytes: int
    num_samples: int
    first_sample: int
    xxh3_128: str
    dali_index: str | None = None  # the DALI .idx beside a tar shard
    # xxh3-64 of this shard's slice of index.bin (records, keys, paths): checked the first
    # time a reader touches the shard, so opening stays O(1) whatever the index size.
    index_xxh3_64: str | None = None

    def __post_init__(self) -> None:
        _check_relative(self.path)
        for name in ("size_bytes", "num_samples", "first_sample"):
            value = getattr(self, name)
            if value < 0:
                raise FormatError(f"shard {self.path!r}: negative size or count ({name})")
            if value > MAX_INT:
                raise FormatError(f"shard {self.path!r}: {name} {value} is out of range")
        if not _HEX128.fullmatch(self.xxh3_128):
            raise FormatError(f"shard {self.path!r}: xxh3_128 must be 32 lower-case hex digits")
        if self.index_xxh3_64 is not None and not _HEX64.fullmatch(self.index_xxh3_64):
            raise FormatError(
                f"shard {self.path!r}: index_xxh3_64 must be 16 lower-case hex digits"
            )
        if self.dali_index is not None:
            _check_relative(self.dali_index)


@dataclass(frozen=True, kw_only=True)
class IndexEntry:
    """The binary index file of the dataset."""

    path: str
    size_bytes: int
    xxh3_128: str
    # xxh3-64 of the index header and extension table (format 2): checked at every open.
    head_xxh3_64: str | None = None

    def __post_init__(self) -> None:
        _check_relative(self.path)
        if not 0 <= self.size_bytes <= MAX_INT:
            raise FormatError(f"index {self.path!r}: size_bytes {self.size_bytes} is out of range")
        if not _HEX128.fullmatch(self.xxh3_128):
            raise FormatError(f"index {self.path!r}: xxh3_128 must be 32 lower-case hex digits")
        if self.head_xxh3_64 is not None and not _HEX64.fullmatch(self.head_xxh3_64):
            raise FormatError(f"index {self.path!r}: head_xxh3_64 must be 16 lower-case hex digits")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything a reader needs to know about a dataset, besides the index.

    Attributes:
        shard_format: "tar" or "hdf5".
        num_samples: samples in the dataset.
        num_members: members (files) in the dataset, synthesised labels included.
        data_bytes: bytes of member payload (the packed files).
        index: the binary index.
        shards: the shards, in dataset order.
        classes: the label map (class index -> name) or None when unlabelled.
        label_layout: how labels were derived ("class-dirs", "split-class-dirs", "writer":
            given to a ShardWriter, or "none").
        label_source: where a pinned label map came from; None: the class directories.
        options: the packing options, as given.
        layout: what was done about filesystem striping.
        created_by: the shardio version that wrote the dataset.
        format_version: the on-disk format version.
    """

    shard_format: str
    num_samples: int
    num_members: int
    data_bytes: int
    index: IndexEntry
    shards: tuple[ShardEntry, ...]
    classes: tuple[str, ...] | None
    label_layout: str
    options: Mapping[str, Any] = field(default_factory=dict)
    layout: Mapping[str, Any] = field(default_factory=dict)
    created_by: str = ""
    format_version: int = FORMAT_VERSION
    staged_from: str | None = None  # set in a staging area's manifest: the source dataset
    # The plan fingerprint of each part of the pack: --resume on a finished dataset compares
    # the source tree and options against them.
    pack_fingerprints: tuple[str, ...] = ()
    label_source: LabelSource | None = None  # format 2 on: optional labels.source
    parity: ParitySection | None = None  # format 3 on: the parity groups (pack --parity)

    def __post_init__(self) -> None:
        if self.shard_format not in SHARD_FORMATS:
            raise FormatError(f"unknown shard_format {self.shard_format!r}")
        for name in ("num_samples", "num_members", "data_bytes"):
            if not 0 <= getattr(self, name) <= MAX_INT:
                raise FormatError(f"{name} {getattr(self, name)} is out of range")
        if self.label_layout not in LABEL_LAYOUTS:
            raise FormatError(f"unknown label layout {self.label_layout!r}")
        if (self.classes is None) != (self.label_layout == "none"):
            raise FormatError(f"label layout {self.label_layout!r} does not match the classes")
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise FormatError("labels.classes holds a class name twice")
        if self.label_source is not None and self.classes is None:
            raise FormatError("labels.source is set, but there are no classes")
        names = {MANIFEST_FILENAME, self.index.path}
        if len(names) != 2:
            raise FormatError(f"index path {self.index.path!r} is the manifest's")
        for shard in self.shards:
            for name in filter(None, (shard.path, shard.dali_index)):
                if name in names:
                    raise FormatError(f"path {name!r} is listed twice in the manifest")
                names.add(name)
        if self.parity is not None:
            if self.format_version < 3:
                raise FormatError(f"parity needs format 3, not {self.format_version}")
            self.parity.check_shards([s.size_bytes for s in self.shards])
            for entry in self.parity.files():
                _check_relative(entry.path)
                if entry.path in names:
                    raise FormatError(f"path {entry.path!r} is listed twice in the manifest")
                names.add(entry.path)
        first = 0
        for shard in self.shards:
            if shard.first_sample != first:
                raise FormatError(
                    f"shard {shard.path!r}: first_sample is {shard.first_sample}, expected {first}"
                )
            first += shard.num_samples
        if first != self.num_samples:
            raise FormatError("shard sample counts do not add up to num_samples")

    @property
    def total_bytes(self) -> int:
        """Bytes of all shard files."""
        return sum(s.size_bytes for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        """Return the JSON document (keys in a fixed order, so output is deterministic).

        The document of format 2 on ends with its own checksum field (see
        :func:`encode_document`); format 3 adds ``parity`` (null without parity).
        """
        if self.format_version == 1:
            return self._to_json_v1()
        doc = self._to_json_v1()
        doc["format_version"] = self.format_version
        doc["index"]["head_xxh3_64"] = self.index.head_xxh3_64
        doc["pack_fingerprints"] = list(self.pack_fingerprints)
        if self.label_source is not None:
            doc["labels"]["source"] = self.label_source.to_json()
        shards = doc.pop("shards")
        if self.format_version >= 3:
            doc["parity"] = self.parity.to_json() if self.parity is not None else None
        for entry, s in zip(shards, self.shards, strict=True):
            entry["index_xxh3_64"] = s.index_xxh3_64
        doc["shards"] = shards
        doc[MANIFEST_CHECKSUM_FIELD] = "0" * 32
        return doc

    def _to_json_v1(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "created_by": self.created_by,
            "shard_format": self.shard_format,
            "num_samples": self.num_samples,
            "num_members": self.num_members,
            "num_shards": len(self.shards),
            "data_bytes": self.data_bytes,
            "total_bytes": self.total_bytes,
            "index": {
                "path": self.index.path,
                "size_bytes": self.index.size_bytes,
                "xxh3_128": self.index.xxh3_128,
            },
            "labels": {
                "layout": self.label_layout,
                "classes": list(self.classes) if self.classes is not None else None,
            },
            "options": dict(self.options),
            "layout": dict(self.layout),
            **({"staged_from": self.staged_from} if self.staged_from is not None else {}),
            "shards": [
                {
                    "path": s.path,
                    "size_bytes": s.size_bytes,
                    "num_samples": s.num_samples,
                    "first_sample": s.first_sample,
                    "xxh3_128": s.xxh3_128,
                    "dali_index": s.dali_index,
                }
                for s in self.shards
            ],
        }

    def dumps(self) -> bytes:
        """Serialise to bytes (ASCII JSON; non-UTF-8 class names travel as escapes)."""
        return encode_document(self.to_json())


def _check_relative(path: str) -> None:
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or ".." in parts
        or "." in parts
        or "" in parts
        or not path.isascii()
        or not path.isprintable()
        or "\\" in path
    ):
        raise FormatError(f"path {path!r} in manifest must be relative and inside the dataset")


def _opt(doc: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    """An optional field: None when absent or null, else of ``kind``."""
    if doc.get(key) is None:
        return None
    return get_field(doc, key, kind, where)


# A shard path of the usual shape ("shards/shard-000042.tar"): "/"-separated names of safe
# characters, none of them "." or "..". One that does not match is checked the long way.
_PLAIN_PATH = re.compile(r"(?:(?!\.\.?/)[A-Za-z0-9_.\-]+/)*(?!\.\.?\Z)[A-Za-z0-9_.\-]+")


def _plain_shard(s: object, version: int) -> ShardEntry | None:
    """The entry of shard record ``s`` when every field has the plain, valid form (the
    manifest of a 100,000-shard dataset parses in a fraction of a second); None sends the
    record through the full checks, which name what is wrong."""
    if type(s) is not dict:
        return None
    get = s.get
    path, size, count, first, digest = (
        get("path"), get("size_bytes"), get("num_samples"), get("first_sample"), get("xxh3_128")
    )  # fmt: skip
    index_digest = get("index_xxh3_64") if version >= 2 else None
    if (
        type(path) is not str
        or type(size) is not int
        or type(count) is not int
        or type(first) is not int
        or type(digest) is not str
        or not (0 <= size <= MAX_INT and 0 <= count <= MAX_INT and 0 <= first <= MAX_INT)
        or get("dali_index") is not None
        or not _PLAIN_PATH.fullmatch(path)
        or not _HEX128.fullmatch(digest)
        or (version >= 2 and (type(index_digest) is not str or not _HEX64.fullmatch(index_digest)))
    ):
        return None
    # The checks of __post_init__ are the ones above: set the slots directly.
    entry = _new_entry(ShardEntry)
    _SET_PATH(entry, path)
    _SET_SIZE(entry, size)
    _SET_COUNT(entry, count)
    _SET_FIRST(entry, first)
    _SET_DIGEST(entry, digest)
    _SET_DALI(entry, None)
    _SET_INDEX(entry, index_digest)
    return entry


_new_entry = object.__new__


def _slot_setter(name: str) -> Any:
    """The setter of slot ``name`` of ShardEntry (bypasses the frozen __setattr__)."""
    return ShardEntry.__dict__[name].__set__


_SET_PATH = _slot_setter("path")
_SET_SIZE = _slot_setter("size_bytes")
_SET_COUNT = _slot_setter("num_samples")
_SET_FIRST = _slot_setter("first_sample")
_SET_DIGEST = _slot_setter("xxh3_128")
_SET_DALI = _slot_setter("dali_index")
_SET_INDEX = _slot_setter("index_xxh3_64")


def _parse_shards(doc: Mapping[str, Any], where: str, *, version: int) -> list[ShardEntry]:
    shards = []
    for i, s in enumerate(get_field(doc, "shards", list, where)):
        plain = _plain_shard(s, version)
        if plain is not None:
            shards.append(plain)
            continue
        if not isinstance(s, dict):
            raise FormatError(f"{where}: shards[{i}] is not an object")
        w = f"{where}: shards[{i}]"
        index_digest = None
        if version >= 2:
            index_digest = get_field(s, "index_xxh3_64", str, w)
        shards.append(
            ShardEntry(
                path=get_field(s, "path", str, w),
                size_bytes=get_field(s, "size_bytes", int, w),
                num_samples=get_field(s, "num_samples", int, w),
                first_sample=get_field(s, "first_sample", int, w),
                xxh3_128=get_field(s, "xxh3_128", str, w),
                dali_index=_opt(s, "dali_index", str, w),
                index_xxh3_64=index_digest,
            )
        )
    return shards


def _parse(doc: Mapping[str, Any], where: str, version: int) -> Manifest:
    index_doc = get_field(doc, "index", dict, where)
    labels = get_field(doc, "labels", dict, where)
    classes = labels.get("classes")
    if classes is not None and not (
        isinstance(classes, list) and all(isinstance(c, str) and "\0" not in c for c in classes)
    ):
        raise FormatError(f"{where}: labels.classes must be a list of strings or null")
    layout = labels.get("layout", "none")
    if not isinstance(layout, str):
        raise FormatError(f"{where}: labels.layout must be a string")
    fingerprints: tuple[str, ...] = ()
    head_digest = None
    label_source = None
    if version >= 2 and labels.get("source") is not None:
        label_source = LabelSource.from_json(labels["source"], where)
    if version >= 2:
        prints = get_field(doc, "pack_fingerprints", list, where)
        if not all(isinstance(p, str) and _HEX128.fullmatch(p) for p in prints):
            raise FormatError(f"{where}: pack_fingerprints must be a list of 32-hex-digit strings")
        fingerprints = tuple(prints)
        head_digest = get_field(index_doc, "head_xxh3_64", str, f"{where}: index")
    parity = None
    if version >= 3:
        if "parity" not in doc:
            raise FormatError(f"{where}: missing field 'parity'")
        if doc["parity"] is not None:
            parity = ParitySection.from_json(doc["parity"], where)
    shards = _parse_shards(doc, where, version=version)
    num_shards = doc.get("num_shards")
    if num_shards is not None and num_shards != len(shards):
        raise FormatError(
            f"{where}: num_shards is {num_shards!r}, the shard list has {len(shards)}"
        )
    options, layout_doc = doc.get("options", {}), doc.get("layout", {})
    options = {} if options is None else options
    layout_doc = {} if layout_doc is None else layout_doc
    if not isinstance(options, dict) or not isinstance(layout_doc, dict):
        raise FormatError(f"{where}: options and layout must be objects")
    created_by, staged_from = doc.get("created_by", ""), doc.get("staged_from")
    if not isinstance(created_by, str) or not isinstance(staged_from, (str, type(None))):
        raise FormatError(f"{where}: created_by and staged_from must be strings")
    if staged_from is not None and ("\0" in staged_from or not staged_from):
        raise FormatError(f"{where}: staged_from must be a path")
    manifest = Manifest(
        shard_format=get_field(doc, "shard_format", str, where),
        num_samples=get_field(doc, "num_samples", int, where),
        num_members=get_field(doc, "num_members", int, where),
        data_bytes=get_field(doc, "data_bytes", int, where),
        index=IndexEntry(
            path=get_field(index_doc, "path", str, f"{where}: index"),
            size_bytes=get_field(index_doc, "size_bytes", int, f"{where}: index"),
            xxh3_128=get_field(index_doc, "xxh3_128", str, f"{where}: index"),
            head_xxh3_64=head_digest,
        ),
        shards=tuple(shards),
        classes=tuple(classes) if classes is not None else None,
        label_layout=layout,
        options=options,
        layout=layout_doc,
        created_by=created_by,
        format_version=version,
        staged_from=staged_from,
        pack_fingerprints=fingerprints,
        label_source=label_source,
        parity=parity,
    )
    total = doc.get("total_bytes")
    if total is not None and total != manifest.total_bytes:
        raise FormatError(f"{where}: total_bytes does not match the shard sizes")
    return manifest


_VERSIONS = (1, 2, 3)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_manifest(data: bytes, *, where: str = "manifest") -> Manifest:
    """Validate and parse a manifest document.

    Raises:
        FormatError: the document is not JSON, not a shardio manifest, of an unknown version,
            fails its own checksum (format 2 on), or misses or mistypes a field. The message
            names ``where``.
    """
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise FormatError(f"{where}: not valid JSON ({reason})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a shardio manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{where}: format_version must be an integer")
    if version not in _VERSIONS:
        raise FormatError(
            f"{where}: unsupported format_version {version} (this shardio reads "
            f"{', '.join(map(str, _VERSIONS))}); upgrade shardio"
        )
    if version >= 2:
        check_document_checksum(data, where)
    try:
        return _parse(doc, where, version)
    except FormatError as exc:
        if str(exc).startswith(where):
            raise
        raise FormatError(f"{where}: {exc}") from exc


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate a manifest file (a regular file of bounded size; a FIFO never
    blocks)."""
    name = os.fspath(path)
    if not os.path.lexists(name):
        raise FormatError(
            f"{name}: no manifest (not a shardio dataset, or its pack did not finish)"
        )
    data = read_regular(name, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
    return parse_manifest(data, where=name)
