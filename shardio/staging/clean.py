"""Remove what shardio staged in an area, file by file, and keep its repair journal.

Only files shardio lists are removed: the staged manifest, index, shards and DALI indexes
(the staged manifest and the plan name them), and shardio's own records in
``.shardio-stage`` (the marker, the plan, one stamp and one lock file per shard, the area
lock, leftover temps of those). The repair journal (``.shardio-stage/repairs.jsonl``: which
samples were retried, re-staged or skipped, and why) is moved out first to a place the
caller names, never overwriting a file there. Anything else stays, and so does a folder
that is not empty; the result lists what was left.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass

from shardio.errors import StorageError, UsageError
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import MANIFEST_FILENAME
from shardio.staging.protocol import (
    AREA_FILE,
    AREA_LOCK,
    PLAN_FILE,
    STAGE_DIR,
    lock_rel,
    read_plan,
    stamp_rel,
)
from shardio.storage.atomic import storage_error
from shardio.storage.files import (
    describe_kind,
    remove_temps_inside,
    rmdir_inside,
    unlink_inside,
)

__all__ = ["CleanResult", "journal_name", "remove_staged", "staged_manifest"]

JOURNAL_FILE = "repairs.jsonl"  # shardio.read.journal.JOURNAL_NAME: the reader writes it
_MAX_KEPT_NAMES = 1000  # journal.jsonl, journal.1.jsonl, ...: then give up
_LISTED_LEFT = 5
_MAX_LISTED = 4096
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class CleanResult:
    """What cleaning an area did.

    Attributes:
        dest: the area.
        removed: staged shards removed.
        journal: where the repair journal was moved (None: there was none, or it was empty).
        journal_error: why the journal could not be moved (it stays in the area), or None.
        left: what was left because shardio did not put it there (relative to ``dest``).
    """

    dest: str
    removed: int
    journal: str | None = None
    journal_error: str | None = None
    left: tuple[str, ...] = ()

    def left_line(self) -> str | None:
        """One line on what was left in place, or None."""
        if not self.left:
            return None
        shown = ", ".join(self.left[:_LISTED_LEFT])
        more = f" and {len(self.left) - _LISTED_LEFT} more" if len(self.left) > _LISTED_LEFT else ""
        return (
            f"left {len(self.left)} file(s) shardio did not stage in {self.dest} (and the "
            f"folders holding them): {shown}{more}"
        )


def journal_name(dest: str, job: str | None) -> str:
    """The name a moved journal gets: ``shardio-repairs-<job>-<host>-<area name>.jsonl``
    (each node of a job moves its own into one directory)."""
    host = socket.gethostname().split(".")[0] or "host"
    area = os.path.basename(os.path.abspath(dest)) or "area"
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{host}-{area}")
    return f"shardio-repairs-{job or 'nojob'}-{safe}.jsonl"


def staged_manifest(dest: str) -> Manifest | None:
    """The manifest staging wrote in ``dest`` (None if it never got that far).

    Raises:
        UsageError: it is a symlink or special file, or a packed dataset's manifest.
        FormatError: it is damaged (what was staged is unknown).
    """
    path = os.path.join(dest, MANIFEST_FILENAME)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise UsageError(
            f"{path} is a {describe_kind(mode)}, not the manifest staging wrote: refusing to clean"
        )
    manifest = load_manifest(path)
    if manifest.staged_from is None:
        raise UsageError(f"{dest} is a packed dataset, not a staging area: refusing to clean it")
    return manifest


def remove_staged(
    dest: str,
    *,
    keep_marker: bool = False,
    journal_dir: str | None = None,
    journal_as: str = JOURNAL_FILE,
) -> CleanResult:
    """Remove what shardio staged in area ``dest`` (see the module docstring).

    Args:
        dest: a staging area (the caller has recognised it).
        keep_marker: keep the marker and the area lock (``stage --force``, which writes a new
            marker next), and the journal in place.
        journal_dir: move the repair journal into this directory as ``journal_as``; None
            leaves it in the area (and the ``.shardio-stage`` folder with it).
        journal_as: the journal's name in ``journal_dir`` (``.1``, ``.2``... before the
            extension when a file has that name: none is overwritten).

    Raises:
        UsageError: the staged manifest is not a regular file or is a packed dataset's.
        FormatError: the staged manifest is damaged.
        StorageError: a file cannot be removed.
    """
    manifest = staged_manifest(dest)
    journal, journal_error = None, None
    if journal_dir is not None and not keep_marker:
        try:
            journal = _move_journal(dest, journal_dir, journal_as)
        except StorageError as exc:
            journal_error = str(exc)
    try:
        removed = _remove_files(dest, manifest, keep_marker=keep_marker)
    except OSError as exc:
        if isinstance(exc, StorageError):
            raise
        raise storage_error(exc, dest, "cleaning") from exc
    return CleanResult(
        dest=dest,
        removed=removed,
        journal=journal,
        journal_error=journal_error,
        left=tuple(_left_over(dest)),
    )


def _remove_files(dest: str, manifest: Manifest | None, *, keep_marker: bool) -> int:
    shards: set[str] = set(read_plan(dest) or ())
    files: list[str] = []
    if manifest is not None:
        unlink_inside(dest, MANIFEST_FILENAME)  # first: no reader sees a half cache
        files.append(manifest.index.path)
        for s in manifest.shards:
            shards.add(s.path)
            files.append(s.path)
            if s.dali_index is not None:
                files.append(s.dali_index)
    files += sorted(shards - set(files))
    by_folder: dict[str, set[str]] = {"": {MANIFEST_FILENAME}}
    for path in files:
        folder, name = os.path.split(path)
        by_folder.setdefault(folder, set()).add(name)
    records = [f"{STAGE_DIR}/{PLAN_FILE}"]
    for rel in sorted(shards):
        records += [stamp_rel(rel), lock_rel(rel)]
    if not keep_marker:
        records += [f"{STAGE_DIR}/{AREA_FILE}", f"{STAGE_DIR}/{AREA_LOCK}"]
    for path in records:
        folder, name = os.path.split(path)
        by_folder.setdefault(folder, set()).add(name)
    for folder, names in by_folder.items():
        remove_temps_inside(dest, folder, names)
    removed = 0
    for path in files:
        if unlink_inside(dest, path) and path in shards:
            removed += 1
    for path in records:
        unlink_inside(dest, path)
    _remove_empty_folders(dest, set(by_folder) - {""})
    return removed


def _remove_empty_folders(root: str, folders: set[str]) -> None:
    """rmdir the folders (and their parents below root) that staging left empty."""
    todo: set[str] = set()
    for folder in folders:
        while folder:
            todo.add(folder)
            folder = os.path.dirname(folder)  # noqa: PLW2901 - walk up to root
    for folder in sorted(todo, key=lambda f: (-f.count("/"), f)):
        rmdir_inside(root, folder)  # kept when not empty, or a symlink


def _left_over(dest: str) -> list[str]:
    """Files still in ``dest`` (no symlink followed), relative, sorted; at most a few
    thousand are listed."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(dest):  # follows no symlinked folder
        dirnames.sort()
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in sorted(filenames + links):
            out.append(os.path.relpath(os.path.join(dirpath, name), dest))
            if len(out) >= _MAX_LISTED:
                return out
    return out


# --------------------------------------------------------------------------- the journal


def _move_journal(dest: str, journal_dir: str, name: str) -> str | None:
    """Move the area's journal into ``journal_dir``; return its new path (None: no journal,
    or an empty one, which is removed). The original is removed only once the copy is
    complete; an existing file in ``journal_dir`` is never replaced.

    Raises:
        StorageError: the journal or the directory cannot be read or written.
    """
    rel = f"{STAGE_DIR}/{JOURNAL_FILE}"
    path = os.path.join(dest, rel)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None  # a symlink there is not shardio's journal: left alone
        raise storage_error(exc, path, "keeping the repair journal") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None  # not shardio's journal: left alone (and listed as left)
        if st.st_size == 0:
            unlink_inside(dest, rel)
            return None
        target = _copy_out(fd, journal_dir, name)
    finally:
        os.close(fd)
    unlink_inside(dest, rel)
    return target


def _copy_out(fd: int, journal_dir: str, name: str) -> str:
    """Copy open file ``fd`` into a new file in ``journal_dir`` named ``name`` (or
    ``name.N``); fsync it; return its path."""
    stem, ext = os.path.splitext(name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for n in range(_MAX_KEPT_NAMES):
        target = os.path.join(journal_dir, name if n == 0 else f"{stem}.{n}{ext}")
        try:
            out = os.open(target, flags, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            raise storage_error(exc, target, "keeping the repair journal in") from exc
        try:
            while chunk := os.read(fd, _COPY_CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
            os.fsync(out)
        except OSError as exc:
            os.close(out)
            os.unlink(target)  # ours: created above with O_EXCL
            raise storage_error(exc, target, "keeping the repair journal in") from exc
        os.close(out)
        return target
    raise StorageError(
        errno.EEXIST,
        f"cannot keep the repair journal in {journal_dir}: {name} and {_MAX_KEPT_NAMES - 1} "
        "numbered names after it exist",
    )
