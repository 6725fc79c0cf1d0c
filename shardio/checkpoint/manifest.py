"""The manifest of one checkpoint: what it holds, who saved it, the xxh3-128 of every file.

``manifest.json`` is written last, inside the checkpoint's temp directory, and sealed: its
``seal`` is the xxh3-128 of the rest of the document as canonical JSON, so a flipped digit
in a step or a size is found, not believed. The parser refuses anything malformed, naming the
field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

import xxhash

from shardio.checkpoint.naming import (
    KINDS,
    MAX_STEP,
    clean_host,
    is_job_id,
    is_rank_file_name,
    rank_file_name,
)
from shardio.errors import FormatError
from shardio.format.fields import get_field

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "CheckpointManifest",
    "RankFile",
    "parse_manifest",
    "parse_rank_file",
]

FORMAT_NAME = "shardio-checkpoint"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 16 << 20
COMPRESSIONS = ("zstd", "none")
_HEX128 = re.compile(r"[0-9a-f]{32}")
_MAX_BYTES = 1 << 50  # a petabyte: no rank's state is larger
_MAX_RANKS = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFile:
    """One rank's file in a checkpoint.

    Attributes:
        rank: the rank that wrote it.
        host: that rank's host.
        name: the file's name in the checkpoint directory.
        size_bytes: its size on disk.
        raw_bytes: the size of the serialized state before compression.
        xxh3_128: the xxh3-128 of its bytes on disk (hex).
        compression: ``zstd`` or ``none``.
        has_state: whether it holds the training state (else only the loader's).
        has_loader: whether it holds the loader's state.
    """

    rank: int
    host: str
    name: str
    size_bytes: int
    raw_bytes: int
    xxh3_128: str
    compression: str
    has_state: bool
    has_loader: bool

    def to_json(self) -> dict[str, Any]:
        """The entry as the manifest stores it."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointManifest:
    """What one checkpoint holds.

    Attributes:
        kind: ``full`` or ``light``.
        step: the training step it was taken at.
        job_id: the job that saved it.
        world_size: the number of ranks that saved it.
        per_rank: every rank saved its own state (else rank 0's state is everyone's).
        saved_at_ns: when it was committed (nanoseconds since the epoch, rank 0's clock).
        token: the save's token (the name of its temp directory).
        files: one entry per rank, by rank.
        loader: a summary of rank 0's loader state (epoch, consumed, num_samples) or None.
        shardio_version: the version that wrote it.
    """

    kind: str
    step: int
    job_id: str
    world_size: int
    per_rank: bool
    saved_at_ns: int
    token: str
    files: tuple[RankFile, ...]
    loader: dict[str, int] | None
    shardio_version: str

    @property
    def size_bytes(self) -> int:
        """The checkpoint's bytes on disk (its files, not the manifest)."""
        return sum(f.size_bytes for f in self.files)

    @property
    def raw_bytes(self) -> int:
        """The checkpoint's serialized bytes before compression."""
        return sum(f.raw_bytes for f in self.files)

    def order_key(self) -> tuple[int, int]:
        """Newest first sorts by this, descending: the step, then the time of the commit."""
        return (self.step, self.saved_at_ns)

    def to_document(self) -> dict[str, Any]:
        """The sealed JSON document."""
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "kind": self.kind,
            "step": self.step,
            "job_id": self.job_id,
            "world_size": self.world_size,
            "per_rank": self.per_rank,
            "saved_at_ns": self.saved_at_ns,
            "token": self.token,
            "files": [f.to_json() for f in self.files],
            "loader": self.loader,
            "shardio_version": self.shardio_version,
        }
        body["seal"] = _seal(body)
        return body

    def to_bytes(self) -> bytes:
        """The manifest file's bytes."""
        return (json.dumps(self.to_document(), indent=1, sort_keys=True) + "\n").encode()


def _seal(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(
        {k: v for k, v in body.items() if k != "seal"}, sort_keys=True, separators=(",", ":")
    )
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def _count(doc: Mapping[str, Any], key: str, where: str, maximum: int) -> int:
    value = get_field(doc, key, int, where)
    if not 0 <= value <= maximum:
        raise FormatError(f"{where}: field {key!r} is out of range ({value}; 0 to {maximum})")
    return int(value)


def parse_rank_file(
    doc: object, rank: int, where: str, *, kind: str, step: int, job_id: str
) -> RankFile:
    """Rank ``rank``'s entry of a manifest (or of a rank's record), checked field by field.

    Raises:
        FormatError: anything malformed, or a name that is not this rank's file's.
    """
    job = job_id
    here = f"{where}: files[{rank}]"
    if not isinstance(doc, dict):
        raise FormatError(f"{here} is not an object")
    entry = RankFile(
        rank=_count(doc, "rank", here, _MAX_RANKS),
        host=get_field(doc, "host", str, here),
        name=get_field(doc, "name", str, here),
        size_bytes=_count(doc, "size_bytes", here, _MAX_BYTES),
        raw_bytes=_count(doc, "raw_bytes", here, _MAX_BYTES),
        xxh3_128=get_field(doc, "xxh3_128", str, here),
        compression=get_field(doc, "compression", str, here),
        has_state=get_field(doc, "has_state", bool, here),
        has_loader=get_field(doc, "has_loader", bool, here),
    )
    if entry.rank != rank:
        raise FormatError(f"{here}: rank {entry.rank} is listed in place {rank}")
    if _HEX128.fullmatch(entry.xxh3_128) is None:
        raise FormatError(f"{here}: 'xxh3_128' is not 32 hex digits")
    if entry.compression not in COMPRESSIONS:
        raise FormatError(f"{here}: unknown compression {entry.compression!r}")
    # The name is the one this rank's file has: a manifest cannot point a load at any file.
    if not is_rank_file_name(entry.name):
        raise FormatError(f"{here}: {entry.name!r} is not a checkpoint file's name")
    if clean_host(entry.host) != entry.host:
        raise FormatError(f"{here}: 'host' {entry.host!r} is not a host name")
    expected = rank_file_name(entry.host, job, kind, step, rank, zstd=entry.compression == "zstd")
    if entry.name != expected:
        raise FormatError(f"{here}: {entry.name!r} is not this rank's file (expected {expected})")
    return entry


def parse_manifest(doc: object, where: str) -> CheckpointManifest:
    """The manifest in ``doc`` (parsed JSON), checked field by field and against its seal.

    Raises:
        FormatError: anything malformed, of another format or version, or a broken seal.
    """
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a shardio checkpoint manifest")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise FormatError(f"{where}: checkpoint format version {version!r} is not supported")
    seal = doc.get("seal")
    if not isinstance(seal, str) or seal != _seal(doc):
        raise FormatError(f"{where}: the manifest does not match its seal (damaged or edited)")
    kind = get_field(doc, "kind", str, where)
    if kind not in KINDS:
        raise FormatError(f"{where}: unknown kind {kind!r}")
    step = _count(doc, "step", where, MAX_STEP)
    job = get_field(doc, "job_id", str, where)
    if not is_job_id(job):
        raise FormatError(f"{where}: 'job_id' {job!r} is not a job id")
    world = _count(doc, "world_size", where, _MAX_RANKS)
    raw_files = get_field(doc, "files", list, where)
    if world < 1 or len(raw_files) != world:
        raise FormatError(f"{where}: {len(raw_files)} files for {world} ranks")
    files = tuple(
        parse_rank_file(f, r, where, kind=kind, step=step, job_id=job)
        for r, f in enumerate(raw_files)
    )
    loader = doc.get("loader")
    if loader is not None and (
        not isinstance(loader, dict)
        or not all(isinstance(k, str) and type(v) is int for k, v in loader.items())
    ):
        raise FormatError(f"{where}: 'loader' is not an object of whole numbers")
    return CheckpointManifest(
        kind=kind,
        step=step,
        job_id=job,
        world_size=world,
        per_rank=get_field(doc, "per_rank", bool, where),
        saved_at_ns=_count(doc, "saved_at_ns", where, 1 << 63),
        token=get_field(doc, "token", str, where),
        files=files,
        loader=loader,
        shardio_version=get_field(doc, "shardio_version", str, where),
    )
