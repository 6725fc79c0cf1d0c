"""Scan a source tree and plan the shards: which files form which sample, in which shard.

The plan is a pure function of the tree (names, kinds and sizes) and the options, so the
same tree packs to byte-identical shards whatever the number of workers, and each SLURM task
of a multi-node pack computes the same global sample list from a directory listing alone,
then stats only its own part.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from shardio.errors import SourceError, UsageError
from shardio.format.keys import encode_component, split_name
from shardio.format.spec import LABEL_EXT, NO_LABEL, TAR_BLOCK

__all__ = [
    "Listing",
    "PlannedFile",
    "PlannedSample",
    "ShardPlan",
    "Skipped",
    "list_tree",
    "plan_fingerprint",
    "plan_shards",
    "resolve_samples",
    "shard_name",
]

_KIND_FILE, _KIND_LINK, _KIND_OTHER = "file", "link", "other"
LABEL_MODES = ("auto", "none")


@dataclass(frozen=True, slots=True)
class Skipped:
    """A source file left out of the pack, and why."""

    path: bytes
    reason: str

    def to_json(self) -> dict[str, str]:
        """JSON form; non-UTF-8 bytes travel as surrogate escapes."""
        return {"path": os.fsdecode(self.path), "reason": self.reason}


@dataclass(frozen=True, slots=True)
class _Group:
    dir_rel: bytes
    stem: bytes
    entries: tuple[tuple[bytes, str], ...]  # (name, kind), sorted by name


@dataclass(frozen=True)
class Listing:
    """The sample groups of a tree, from a directory listing only (no stat per file)."""

    groups: tuple[_Group, ...]
    classes: tuple[str, ...] | None
    label_layout: str
    num_files: int

    def part(self, part: int, num_parts: int) -> tuple[int, tuple[_Group, ...]]:
        """Return (first global sample position, groups) of one part of ``num_parts``."""
        n = len(self.groups)
        lo, hi = part * n // num_parts, (part + 1) * n // num_parts
        return lo, self.groups[lo:hi]


@dataclass(frozen=True, slots=True)
class PlannedFile:
    """One source file and the member it becomes."""

    rel: bytes
    ext: str
    size: int
    mtime_ns: int = 0  # in the resume fingerprint only: shard bytes carry mtime 0


@dataclass(frozen=True, slots=True)
class PlannedSample:
    """One sample: its key, label and files."""

    key: str
    label: int
    files: tuple[PlannedFile, ...]


@dataclass(frozen=True)
class ShardPlan:
    """The samples of one shard."""

    seq: int
    name: str
    samples: tuple[PlannedSample, ...]
    planned_bytes: int

    @property
    def num_files(self) -> int:
        """Source files in the shard."""
        return sum(len(s.files) for s in self.samples)


def list_tree(src: str, *, labels: str = "auto") -> Listing:
    """List a source tree (readdir only) and group its files into samples.

    Files with the same stem in one directory form one sample. Symbolic links to
    directories are not followed, so loops cannot occur.

    Raises:
        SourceError: SRC is missing, not a directory, unreadable, or holds no files.
        UsageError: ``labels`` is not one of LABEL_MODES.
    """
    if labels not in LABEL_MODES:
        raise UsageError(f"invalid --labels {labels!r}: choose one of {', '.join(LABEL_MODES)}")
    root = os.fsencode(src)
    if not os.path.exists(root):
        raise SourceError(errno.ENOENT, f"source {src} does not exist")
    if not os.path.isdir(root):
        raise SourceError(errno.ENOTDIR, f"source {src} is not a directory")
    files: list[tuple[bytes, bytes, str]] = []
    stack = [b""]
    while stack:
        rel_dir = stack.pop()
        path = os.path.join(root, rel_dir) if rel_dir else root
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise SourceError(
                exc.errno or errno.EIO, f"cannot list {os.fsdecode(path)}: {exc.strerror}"
            ) from exc
        subdirs = []
        for entry in entries:
            rel = rel_dir + b"/" + entry.name if rel_dir else entry.name
            if entry.is_symlink():
                files.append((rel_dir, entry.name, _KIND_LINK))
            elif entry.is_dir(follow_symlinks=False):
                subdirs.append(rel)
            elif entry.is_file(follow_symlinks=False):
                files.append((rel_dir, entry.name, _KIND_FILE))
            else:
                files.append((rel_dir, entry.name, _KIND_OTHER))
        stack.extend(reversed(subdirs))
    if not files:
        raise SourceError(errno.ENOENT, f"source {src} holds no files to pack")
    classes, label_layout = _detect_labels(files, labels)
    groups: dict[tuple[bytes, bytes], list[tuple[bytes, str]]] = {}
    for rel_dir, name, kind in files:
        stem, _ = split_name(name)
        groups.setdefault((rel_dir, stem), []).append((name, kind))
    ordered = tuple(_Group(d, s, tuple(sorted(groups[(d, s)]))) for d, s in sorted(groups))
    return Listing(groups=ordered, classes=classes, label_layout=label_layout, num_files=len(files))


def _detect_labels(
    files: Sequence[tuple[bytes, bytes, str]], labels: str
) -> tuple[tuple[str, ...] | None, str]:
    if labels == "none":
        return None, "none"
    depths = {d.count(b"/") + 1 if d else 0 for d, _, _ in files}
    if depths == {1}:
        names = {d for d, _, _ in files}
        return tuple(os.fsdecode(n) for n in sorted(names)), "class-dirs"
    if depths == {2}:
        names = {d.split(b"/")[1] for d, _, _ in files}
        return tuple(os.fsdecode(n) for n in sorted(names)), "split-class-dirs"
    return None, "none"


def _label_of(group: _Group, classes: dict[bytes, int], layout: str) -> int:
    if layout == "class-dirs":
        return classes[group.dir_rel]
    if layout == "split-class-dirs":
        return classes[group.dir_rel.split(b"/")[1]]
    return NO_LABEL


def _classify(path: bytes, kind: str) -> tuple[int, int, str | None]:
    """Return (size, mtime in ns, skip reason or None) of one listed entry; one stat call."""
    try:
        st = os.stat(path) if kind == _KIND_LINK else os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return 0, 0, "symlink loop"
        if exc.errno == errno.ENOENT and kind == _KIND_LINK:
            return 0, 0, "broken symlink"
        return 0, 0, f"unreadable ({exc.strerror})"
    if stat.S_ISREG(st.st_mode):
        return st.st_size, st.st_mtime_ns, None
    if stat.S_ISDIR(st.st_mode):
        return 0, 0, "symlink to a directory (not followed)"
    if stat.S_ISFIFO(st.st_mode):
        return 0, 0, "FIFO (named pipe)"
    if stat.S_ISSOCK(st.st_mode):
        return 0, 0, "socket"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return 0, 0, "device file"
    return 0, 0, "not a regular file"


def resolve_samples(
    src: str, listing: Listing, groups: Sequence[_Group]
) -> tuple[list[PlannedSample], list[Skipped]]:
    """Stat the files of some groups and turn them into planned samples.

    Returns:
        The samples (in listing order) and the files skipped, with reasons.
    """
    root = os.fsencode(src)
    class_ids: dict[bytes, int] = {}
    if listing.classes is not None:
        class_ids = {os.fsencode(c): i for i, c in enumerate(listing.classes)}
    labelled = listing.label_layout != "none"
    samples: list[PlannedSample] = []
    skipped: list[Skipped] = []
    for group in groups:
        planned: list[PlannedFile] = []
        used = {LABEL_EXT} if labelled else set()
        for name, kind in group.entries:
            rel = group.dir_rel + b"/" + name if group.dir_rel else name
            size, mtime_ns, reason = _classify(os.path.join(root, rel), kind)
            if reason is not None:
                skipped.append(Skipped(rel, reason))
                continue
            ext = _member_ext(split_name(name)[1], used)
            used.add(ext)
            planned.append(PlannedFile(rel, ext, size, mtime_ns))
        if not planned:
            continue
        key = encode_component(group.stem)
        if group.dir_rel:
            key = encode_component(group.dir_rel, keep_slash=True) + "/" + key
        samples.append(
            PlannedSample(key, _label_of(group, class_ids, listing.label_layout), tuple(planned))
        )
    return samples, skipped


def _member_ext(raw_ext: bytes, used: set[str]) -> str:
    """Member extension: lower-cased and encoded, made unique within the sample."""
    base = encode_component(raw_ext.lower()) if raw_ext else "noext"
    ext, n = base, 0
    while ext in used:
        n += 1
        ext = f"{base}_{n}"
    return ext


def shard_name(seq: int, *, part: int, num_parts: int) -> str:
    """File stem of a shard: ``shard-000012`` or, for a multi-part pack, ``shard-p0003-000012``."""
    if num_parts == 1:
        return f"shard-{seq:06d}"
    return f"shard-p{part:04d}-{seq:06d}"


def _tar_cost(sample: PlannedSample, labelled: bool) -> int:
    cost = sum(TAR_BLOCK + -(-f.size // TAR_BLOCK) * TAR_BLOCK for f in sample.files)
    return cost + (2 * TAR_BLOCK if labelled else 0)


def plan_shards(
    samples: Sequence[PlannedSample],
    *,
    shard_size_bytes: int,
    labelled: bool,
    part: int = 0,
    num_parts: int = 1,
) -> list[ShardPlan]:
    """Cut the samples, in order, into shards of at most ``shard_size_bytes`` each.

    A sample larger than the shard size gets a shard of its own (reported as oversized).
    """
    shards: list[ShardPlan] = []
    current: list[PlannedSample] = []
    size = 2 * TAR_BLOCK  # end-of-archive blocks

    def close() -> None:
        seq = len(shards)
        shards.append(
            ShardPlan(seq, shard_name(seq, part=part, num_parts=num_parts), tuple(current), size)
        )

    for sample in samples:
        cost = _tar_cost(sample, labelled)
        if current and size + cost > shard_size_bytes:
            close()
            current, size = [], 2 * TAR_BLOCK
        current.append(sample)
        size += cost
    if current:
        close()
    return shards


def plan_fingerprint(shards: Sequence[ShardPlan], options: dict[str, object]) -> str:
    """A digest of the plan and options: a resumed pack must see the same one."""
    h = xxhash.xxh3_128()
    h.update(repr(sorted(options.items())).encode())
    for shard in shards:
        h.update(shard.name.encode())
        for sample in shard.samples:
            h.update(b"\0s" + sample.key.encode() + str(sample.label).encode())
            for f in sample.files:
                h.update(b"\0f" + f.rel + b"\0" + f.ext.encode() + b"%d:%d" % (f.size, f.mtime_ns))
    return h.hexdigest()
