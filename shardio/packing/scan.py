"""Scan a source tree: group its files into samples, find the labels, stat what will be packed.

The listing reads directories only (no stat per file), so each SLURM task of a multi-node
pack computes the same global sample list cheaply, then stats only its own part with
:func:`resolve_samples`: one ``stat`` per file, none per directory. Both count what they
ask of the filesystem into a :class:`~shardio.packing.calls.SourceCalls` tally.
"""

from __future__ import annotations

import collections
import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from shardio.errors import PackError, SourceError, UsageError, wrap_os_error
from shardio.format.keys import encode_component, split_name
from shardio.format.label_source import LabelSource
from shardio.format.spec import LABEL_EXT, NO_LABEL
from shardio.packing.calls import SourceCalls
from shardio.packing.labels import PinnedLabels

__all__ = [
    "LABEL_MODES",
    "Listing",
    "PlannedFile",
    "PlannedSample",
    "Skipped",
    "list_tree",
    "member_ext",
    "resolve_samples",
]

_KIND_FILE, _KIND_LINK, _KIND_OTHER = "file", "link", "other"
LABEL_MODES = ("auto", "none")
_LAYOUT_DEPTH = {"class-dirs": 1, "split-class-dirs": 2}
_SILENCE = "; --labels none silences this"


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
    """The sample groups of a tree, from a directory listing only (no stat per file).

    Attributes:
        groups: the sample groups, sorted by directory then stem.
        classes: the class names (index = label), or None when unlabelled.
        label_layout: "class-dirs", "split-class-dirs" or "none".
        num_files: directory entries that are not directories.
        excluded: hidden files outside the label layout, left out of every part.
        labels_note: for people: why there are no labels (empty when there are).
        label_source: where a pinned label map came from; None: the class directories.
    """

    groups: tuple[_Group, ...]
    classes: tuple[str, ...] | None
    label_layout: str
    num_files: int
    excluded: tuple[Skipped, ...] = ()
    labels_note: str = ""
    label_source: LabelSource | None = None

    def classes_without_files(self) -> tuple[str, ...]:
        """The classes of the map that no listed file of this tree belongs to."""
        if self.classes is None:
            return ()
        found = {_class_of(g.dir_rel, self.label_layout) for g in self.groups}
        return tuple(c for c in self.classes if os.fsencode(c) not in found)

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


_File = tuple[bytes, bytes, str]  # (directory relative to the root, name, kind)


def list_tree(
    src: str,
    *,
    labels: str = "auto",
    calls: SourceCalls | None = None,
    pinned: PinnedLabels | None = None,
) -> Listing:
    """List a source tree (readdir only) and group its files into samples.

    Files with the same stem in one directory form one sample. Symbolic links to
    directories are not followed, so loops cannot occur. With ``labels="auto"``, hidden
    names (starting with ".") do not count when the label layout is decided, and hidden
    files that do not fit the layout found are left out (listed in ``excluded``). The
    class names are those of the class directories, empty ones included, so a class's
    index never depends on which other classes hold files; a ``pinned`` map replaces them
    (every class directory must be in it). The directories listed and the entries seen are
    added to ``calls``.

    Raises:
        SourceError: SRC is missing, not a directory, unreadable, or holds no files.
        UsageError: ``labels`` is not one of LABEL_MODES, or a map is pinned for a tree
            without class directories.
        PackError: a class directory is not in the pinned map.
    """
    if labels not in LABEL_MODES:
        raise UsageError(f"invalid --labels {labels!r}: choose one of {', '.join(LABEL_MODES)}")
    root = os.fsencode(src)
    if not os.path.exists(root):
        raise SourceError(errno.ENOENT, f"source {src} does not exist")
    if not os.path.isdir(root):
        raise SourceError(errno.ENOTDIR, f"source {src} is not a directory")
    files, dirs = _walk(root, calls if calls is not None else SourceCalls())
    if not files:
        raise SourceError(errno.ENOENT, f"source {src} holds no files to pack")
    classes, label_layout, note = _detect_labels(files, dirs, labels)
    if pinned is not None:
        classes = _pin(src, classes, dirs, layout=label_layout, note=note, pinned=pinned)
    kept, excluded = _fit_layout(files, classes, label_layout)
    groups: dict[tuple[bytes, bytes], list[tuple[bytes, str]]] = {}
    for rel_dir, name, kind in kept:
        stem, _ = split_name(name)
        groups.setdefault((rel_dir, stem), []).append((name, kind))
    ordered = tuple(_Group(d, s, tuple(sorted(groups[(d, s)]))) for d, s in sorted(groups))
    return Listing(
        groups=ordered,
        classes=classes,
        label_layout=label_layout,
        num_files=len(files),
        excluded=tuple(excluded),
        labels_note=note,
        label_source=pinned.source if pinned is not None else None,
    )


def _pin(
    src: str,
    classes: tuple[str, ...] | None,
    dirs: Sequence[bytes],
    *,
    layout: str,
    note: str,
    pinned: PinnedLabels,
) -> tuple[str, ...]:
    """The pinned classes, once every class directory of the tree is known to be in them."""
    if classes is None:
        raise UsageError(
            f"{pinned.option} pins a label map, but {src} has no class directories ({note})"
        )
    known = set(pinned.classes)
    for name in classes:
        if name not in known:
            raw = os.fsencode(name)
            rel = next(
                (d for d in dirs if _is_class_dir(d, layout) and _class_of(d, layout) == raw), raw
            )
            where = os.path.join(os.fsencode(src), rel).decode("utf-8", "backslashreplace")
            raise PackError(
                f"class directory {where} is not in the label map of "
                f"{pinned.option} ({len(pinned.classes):,} class(es)): pack it against a map "
                "that has it, or move it out of the source"
            )
    return pinned.classes


def _walk(root: bytes, calls: SourceCalls) -> tuple[list[_File], list[bytes]]:
    """Every non-directory entry under ``root``, by directory, each directory listed once,
    and every directory (relative to ``root``; symlinks to directories are entries).

    Tells files, symlinks and directories apart by the entry type the listing carries
    (``d_type``), so nothing here is stat'ed.
    """
    files: list[_File] = []
    dirs: list[bytes] = []
    stack = [b""]
    dirs_listed = entries_seen = 0
    while stack:
        rel_dir = stack.pop()
        path = os.path.join(root, rel_dir) if rel_dir else root
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise wrap_os_error(
                exc, f"cannot list {os.fsdecode(path)}: {exc.strerror}", SourceError
            ) from exc
        dirs_listed += 1
        entries_seen += len(entries)
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
        dirs.extend(subdirs)
    calls.dirs_listed += dirs_listed
    calls.entries_seen += entries_seen
    return files, dirs


def _depth(rel_dir: bytes) -> int:
    return rel_dir.count(b"/") + 1 if rel_dir else 0


def _hidden_dir(rel_dir: bytes) -> bool:
    return bool(rel_dir) and any(p.startswith(b".") for p in rel_dir.split(b"/"))


def _shown(rel_dir: bytes, name: bytes) -> str:
    rel = rel_dir + b"/" + name if rel_dir else name
    return rel.decode("utf-8", "backslashreplace")


def _class_of(rel_dir: bytes, layout: str) -> bytes:
    return rel_dir if layout == "class-dirs" else rel_dir.split(b"/")[1]


def _is_class_dir(rel_dir: bytes, layout: str) -> bool:
    """Whether directory ``rel_dir`` is a class directory of ``layout`` (empty or not)."""
    return _depth(rel_dir) == _LAYOUT_DEPTH[layout] and not _hidden_dir(rel_dir)


def _detect_labels(
    files: Sequence[_File], dirs: Sequence[bytes], labels: str
) -> tuple[tuple[str, ...] | None, str, str]:
    """Return (classes, layout, note): the layout from the visible (not hidden) files, the
    classes from the visible class directories of that layout, empty ones included."""
    if labels == "none":
        return None, "none", "--labels none"
    visible = [(d, n) for d, n, _ in files if not n.startswith(b".") and not _hidden_dir(d)]
    if not visible:
        return None, "none", "only hidden files" + _SILENCE
    depths = collections.Counter(_depth(d) for d, _ in visible)
    if len(depths) == 1:
        (depth,) = depths
        for layout, want in _LAYOUT_DEPTH.items():
            if depth == want:
                names = {_class_of(d, layout) for d, _ in visible}
                names.update(_class_of(d, layout) for d in dirs if _is_class_dir(d, layout))
                return tuple(os.fsdecode(c) for c in sorted(names)), layout, ""
        if depth == 0:
            why = "no class directories: every file is at the top of the source"
        else:
            why = f"every file is {depth} directories deep, not in CLASS/ or SPLIT/CLASS/"
        return None, "none", why + _SILENCE
    # Most files sit at the usual depth; name one that does not.
    common = max(sorted(depths), key=lambda k: depths[k])
    odd = next((d, n) for d, n in visible if _depth(d) != common)
    return None, "none", f"files at different depths, e.g. {_shown(*odd)}" + _SILENCE


def _fit_layout(
    files: Sequence[_File], classes: tuple[str, ...] | None, layout: str
) -> tuple[list[_File], list[Skipped]]:
    """Split the files into those packed and the hidden ones outside the label layout."""
    if classes is None:
        return list(files), []
    want = _LAYOUT_DEPTH[layout]
    known = {os.fsencode(c) for c in classes}
    kept: list[_File] = []
    excluded: list[Skipped] = []
    for d, n, kind in files:
        if _depth(d) == want and not _hidden_dir(d) and _class_of(d, layout) in known:
            kept.append((d, n, kind))
        else:  # only hidden names can be here: every visible file fits the layout found
            rel = d + b"/" + n if d else n
            excluded.append(Skipped(rel, f"hidden file outside the {layout} label layout"))
    return kept, excluded


def _label_of(group: _Group, classes: dict[bytes, int], layout: str) -> int:
    if layout in _LAYOUT_DEPTH:
        return classes[_class_of(group.dir_rel, layout)]
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
    src: str, listing: Listing, groups: Sequence[_Group], *, calls: SourceCalls | None = None
) -> tuple[list[PlannedSample], list[Skipped]]:
    """Stat the files of some groups and turn them into planned samples.

    Each file is stat'ed once (a symlink through its target): the size plans the shards and
    is checked again when the file is read, so the writers stat nothing. The stat calls are
    added to ``calls``.

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
    stat_calls = 0
    for group in groups:
        planned: list[PlannedFile] = []
        used = {LABEL_EXT} if labelled else set()
        for name, kind in group.entries:
            rel = group.dir_rel + b"/" + name if group.dir_rel else name
            size, mtime_ns, reason = _classify(os.path.join(root, rel), kind)
            stat_calls += 1
            if reason is not None:
                skipped.append(Skipped(rel, reason))
                continue
            ext = member_ext(split_name(name)[1], used)
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
    if calls is not None:
        calls.stat_calls += stat_calls
    return samples, skipped


def member_ext(raw_ext: bytes, used: set[str]) -> str:
    """Member extension: lower-cased, percent-encoded, never reserved, unique in the sample.

    WebDataset reserves field names starting with "__" (``__key__``, ``__url__``, ...), so
    the first underscore of such an extension is written ``%5F``: ``x.__key__`` becomes
    member ``%5F_key__``, which decodes back to the original bytes like any other escape.
    """
    base = encode_component(raw_ext.lower()) if raw_ext else "noext"
    if base.startswith("__"):
        base = "%5F" + base[1:]
    ext, n = base, 0
    while ext in used:
        n += 1
        ext = f"{base}_{n}"
    return ext
