"""The options of a pack and the result it reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shardio._pool import check_workers
from shardio.errors import UsageError
from shardio.format.label_source import LabelSource
from shardio.format.spec import SHARD_FORMATS
from shardio.packing.calls import SourceCalls
from shardio.packing.merge import MergeResult
from shardio.packing.scan import LABEL_MODES, Listing, Skipped
from shardio.packing.workfiles import MAX_PARTS
from shardio.packing.write import STREAM_THRESHOLD_BYTES
from shardio.parity.codec import parse_scheme
from shardio.storage.stripe_spec import parse_stripe
from shardio.storage.striping import LayoutResult

__all__ = ["PackOptions", "PackResult"]

GiB = 1024**3


@dataclass(frozen=True, kw_only=True)
class PackOptions:
    """How to pack.

    Attributes:
        shard_format: "tar" (WebDataset layout) or "hdf5".
        shard_size_bytes: target size of each shard; a larger single sample gets its own.
        workers: processes writing shards in parallel.
        labels: "auto" (class index from an ImageNet-style layout) or "none".
        labels_from: pin the label map to that of this packed dataset (a directory).
        classes_file: pin the label map to this file's class names, one per line.
        stripe: "auto", "none", "pfl" or "COUNTxSIZE" for the destination's layout.
        fs_type: force the filesystem type instead of detecting it.
        strict: fail instead of skipping unpackable files.
        resume: finish an interrupted pack, reusing verified shards.
        force: replace the shardio dataset in the destination (once the new one is complete).
        part: which part this process packs (0-based), of ``num_parts``.
        num_parts: parts of a multi-node pack; 1 packs and merges in one go.
        durable: fsync every file before publishing it.
        stream_threshold_bytes: files above this size are copied in chunks, not read whole.
        parity: "K+M" to write M parity files per group of K shards (needs pyeclib).
    """

    shard_format: str = "tar"
    shard_size_bytes: int = GiB
    workers: int = 1
    labels: str = "auto"
    labels_from: str | None = None
    classes_file: str | None = None
    stripe: str = "auto"
    fs_type: str | None = None
    strict: bool = False
    resume: bool = False
    force: bool = False
    part: int = 0
    num_parts: int = 1
    durable: bool = True
    stream_threshold_bytes: int = STREAM_THRESHOLD_BYTES
    parity: str | None = None

    def __post_init__(self) -> None:
        if self.shard_format not in SHARD_FORMATS:
            raise UsageError(
                f"invalid format {self.shard_format!r}: choose one of {', '.join(SHARD_FORMATS)}"
            )
        if self.shard_size_bytes < 4096:
            raise UsageError(f"shard size {self.shard_size_bytes} bytes is too small (min 4 KiB)")
        check_workers(self.workers)  # the one cap of a worker pool (verify's too)
        if self.labels not in LABEL_MODES:
            raise UsageError(f"invalid --labels {self.labels!r}: choose one of {LABEL_MODES}")
        pins = [
            (o, v)
            for o, v in (("--labels-from", self.labels_from), ("--classes", self.classes_file))
            if v is not None
        ]
        if len(pins) > 1:
            raise UsageError("--labels-from and --classes exclude each other: give one")
        for option, value in pins:
            if not value or "\0" in value:
                raise UsageError(f"invalid {option} {value!r}: give a path")
            if self.labels == "none":
                raise UsageError(f"{option} pins a label map: it cannot go with --labels none")
        if not 0 <= self.part < self.num_parts <= MAX_PARTS:
            raise UsageError(
                f"invalid part {self.part}/{self.num_parts}: need 0 <= I < N <= {MAX_PARTS}"
            )
        if self.resume and self.force:
            raise UsageError("--resume and --force exclude each other")
        if self.force and self.num_parts > 1:
            raise UsageError(
                "--force cannot be combined with --part: remove the old dataset first, or "
                "pack the parts into a new directory"
            )
        if self.stream_threshold_bytes < 1:
            raise UsageError("stream_threshold_bytes must be positive")
        parse_stripe(self.stripe)
        if self.parity is not None:
            k, m = parse_scheme(self.parity)
            object.__setattr__(self, "parity", f"{k}+{m}")


@dataclass(frozen=True)
class PackResult:
    """What a pack did.

    ``label_layout``, ``num_classes`` and ``labels_note`` say what labels were found (the
    note explains "none"); ``classes`` is the label map (index order), ``label_source``
    where a pinned one came from (None: the class directories), ``classes_without_files``
    the classes no file of the source belongs to (they keep their index). ``replaced`` is
    set when ``force`` replaced an old dataset; ``already_complete`` when ``resume`` found
    the dataset complete and packed from this source with these options (nothing written).
    ``source_calls`` counts what this run asked of the source tree: the scan's directory
    listings and stat calls, and the opens of the files of the shards it wrote.
    """

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
    label_layout: str = "none"
    num_classes: int = 0
    labels_note: str = ""
    replaced: bool = False
    source_calls: SourceCalls = field(default_factory=SourceCalls)
    classes: tuple[str, ...] = ()
    label_source: LabelSource | None = None
    classes_without_files: tuple[str, ...] = ()
    already_complete: bool = False

    def with_labels(self, listing: Listing) -> PackResult:
        """A copy that says what labels ``listing`` found."""
        return dataclasses.replace(
            self,
            label_layout=listing.label_layout,
            num_classes=len(listing.classes) if listing.classes is not None else 0,
            labels_note=listing.labels_note,
            classes=listing.classes or (),
            label_source=listing.label_source,
            classes_without_files=listing.classes_without_files(),
        )
