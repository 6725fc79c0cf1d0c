"""The dataset manifest: model, JSON serialisation and the validating parser for each version."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardio.errors import FormatError
from shardio.format.spec import FORMAT_NAME, FORMAT_VERSION, SHARD_FORMATS

__all__ = ["IndexEntry", "Manifest", "ShardEntry", "load_manifest", "parse_manifest"]


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    """One shard file of the dataset."""

    path: str  # relative to the dataset root, "/"-separated
    size_bytes: int
    num_samples: int
    first_sample: int
    xxh3_128: str
    dali_index: str | None = None  # the DALI .idx beside a tar shard

    def __post_init__(self) -> None:
        if self.size_bytes < 0 or self.num_samples < 0 or self.first_sample < 0:
            raise FormatError(f"shard {self.path!r}: negative size or count")
        if len(self.xxh3_128) != 32:
            raise FormatError(f"shard {self.path!r}: xxh3_128 must be 32 hex digits")
        _check_relative(self.path)
        if self.dali_index is not None:
            _check_relative(self.dali_index)


@dataclass(frozen=True, kw_only=True)
class IndexEntry:
    """The binary index file of the dataset."""

    path: str
    size_bytes: int
    xxh3_128: str

    def __post_init__(self) -> None:
        _check_relative(self.path)


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
        label_layout: how labels were derived ("class-dirs", "split-class-dirs" or "none").
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

    def __post_init__(self) -> None:
        if self.shard_format not in SHARD_FORMATS:
            raise FormatError(f"unknown shard_format {self.shard_format!r}")
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
        """Return the JSON document (keys in a fixed order, so output is deterministic)."""
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
        return (json.dumps(self.to_json(), indent=1) + "\n").encode("ascii")


def _check_relative(path: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or ".." in parts or "" in parts:
        raise FormatError(f"path {path!r} in manifest must be relative and inside the dataset")


def _get(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise FormatError(f"{where}: missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _parse_v1(doc: Mapping[str, Any], where: str) -> Manifest:
    index_doc = _get(doc, "index", dict, where)
    labels = _get(doc, "labels", dict, where)
    classes = labels.get("classes")
    if classes is not None and not (
        isinstance(classes, list) and all(isinstance(c, str) for c in classes)
    ):
        raise FormatError(f"{where}: labels.classes must be a list of strings or null")
    shards = []
    for i, s in enumerate(_get(doc, "shards", list, where)):
        if not isinstance(s, dict):
            raise FormatError(f"{where}: shards[{i}] is not an object")
        w = f"{where}: shards[{i}]"
        dali = s.get("dali_index")
        shards.append(
            ShardEntry(
                path=_get(s, "path", str, w),
                size_bytes=_get(s, "size_bytes", int, w),
                num_samples=_get(s, "num_samples", int, w),
                first_sample=_get(s, "first_sample", int, w),
                xxh3_128=_get(s, "xxh3_128", str, w),
                dali_index=dali if isinstance(dali, str) else None,
            )
        )
    return Manifest(
        shard_format=_get(doc, "shard_format", str, where),
        num_samples=_get(doc, "num_samples", int, where),
        num_members=_get(doc, "num_members", int, where),
        data_bytes=_get(doc, "data_bytes", int, where),
        index=IndexEntry(
            path=_get(index_doc, "path", str, f"{where}: index"),
            size_bytes=_get(index_doc, "size_bytes", int, f"{where}: index"),
            xxh3_128=_get(index_doc, "xxh3_128", str, f"{where}: index"),
        ),
        shards=tuple(shards),
        classes=tuple(classes) if classes is not None else None,
        label_layout=str(labels.get("layout", "none")),
        options=dict(doc.get("options") or {}),
        layout=dict(doc.get("layout") or {}),
        created_by=str(doc.get("created_by", "")),
        format_version=1,
        staged_from=doc["staged_from"] if isinstance(doc.get("staged_from"), str) else None,
    )


_PARSERS = {1: _parse_v1}


def parse_manifest(data: bytes, *, where: str = "manifest") -> Manifest:
    """Validate and parse a manifest document.

    Raises:
        FormatError: the document is not JSON, not a shardio manifest, of an unknown version,
            or misses or mistypes a field. The message names ``where``.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a shardio manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{where}: format_version must be an integer")
    parser = _PARSERS.get(version)
    if parser is None:
        raise FormatError(
            f"{where}: unsupported format_version {version} (this shardio reads "
            f"{', '.join(map(str, sorted(_PARSERS)))}); upgrade shardio"
        )
    try:
        return parser(doc, where)
    except FormatError as exc:
        if str(exc).startswith(where):
            raise
        raise FormatError(f"{where}: {exc}") from exc


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate a manifest file."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as fh:
            data = fh.read()
    except IsADirectoryError as exc:
        raise FormatError(f"{name}: is a directory, not a manifest") from exc
    except FileNotFoundError as exc:
        raise FormatError(
            f"{name}: no manifest (not a shardio dataset, or its pack did not finish)"
        ) from exc
    return parse_manifest(data, where=name)
