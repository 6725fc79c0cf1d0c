"""Restore the original tree from a dataset, byte for byte (every member verified).

The tree is built in a private directory beside OUT (``.<name>.shardio-tmp-<pid>``) and
renamed to OUT only once every file promised by the manifest is written from verified bytes.
So OUT never holds a partial tree: on any failure (or a kill, which leaves only the hidden
directory) OUT stays as it was, and nothing outside OUT and that directory is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardio.errors import FormatError, StorageError, UsageError, wrap_os_error
from shardio.metrics.progress import Counters, ProgressCallback, ProgressThread
from shardio.read.reader import ShardReader
from shardio.storage.atomic import TEMP_MARK, create_temp

__all__ = ["UnpackResult", "unpack_dataset"]

_NAME_KEEP = 200  # bytes of OUT's name kept in the private directory's name (NAME_MAX 255)
_TEMP_MARK = os.fsencode(TEMP_MARK)


@dataclass(frozen=True)
class UnpackResult:
    """What an unpack wrote."""

    files: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _File:
    """One file to restore: where its bytes are and where they go."""

    member: int
    sample: int
    shard: int
    rel: bytes


def _plan(ds: ShardReader, where: str) -> list[_File]:
    """Every file to restore, checked before a byte is written.

    Raises:
        FormatError: a record the index checks refuse; an unsafe, duplicate or conflicting
            path; or fewer (more) files than the manifest promises.
    """
    index, man = ds.index, ds.manifest
    index.check_all()  # every record checked against the manifest before one is followed
    files: list[_File] = []
    seen: set[bytes] = set()
    dirs: set[bytes] = set()
    for sample, rec in enumerate(index.samples):
        shard = int(rec["shard"])
        first = int(rec["first_member"])
        for m in range(first, first + int(rec["n_members"])):
            rel = index.member_path(m)
            if not rel:
                continue  # a member shardio made (the label)
            shown = os.fsdecode(rel)
            parts = rel.split(b"/")
            if b"\0" in rel or rel.startswith(b"/") or any(p in (b"", b".", b"..") for p in parts):
                raise FormatError(f"{where} holds an unsafe path {shown!r}: refusing to unpack")
            if rel in seen:
                raise FormatError(f"{where} lists {shown!r} twice: refusing to unpack")
            seen.add(rel)
            dirs.update(b"/".join(parts[:i]) for i in range(1, len(parts)))
            files.append(_File(m, sample, shard, rel))
    clash = seen & dirs
    if clash:
        shown = os.fsdecode(min(clash))
        raise FormatError(f"{where} lists {shown!r} as a file and a directory: refusing to unpack")
    promised = man.num_members - (man.num_samples if man.classes is not None else 0)
    if len(files) != promised:
        raise FormatError(
            f"{where} lists {len(files):,} files to restore, the manifest of {ds.root} "
            f"promises {promised:,}: the index and the manifest disagree; refusing to unpack"
        )
    return files


def _check_out(out: bytes, shown: str) -> tuple[bytes, int | None]:
    """Return (OUT with a symlink resolved, the mode of an existing empty OUT or None).

    Raises:
        UsageError: OUT is not empty, not a directory, the current directory, or a symlink
            to anything but an empty directory.
    """
    try:
        st = os.lstat(out)
        if stat.S_ISLNK(st.st_mode):  # the user named it: unpack where it points
            out = os.path.realpath(out)
            try:
                st = os.stat(out)
            except FileNotFoundError:
                raise UsageError(f"{shown} is a symlink to nothing: name a new directory") from None
    except FileNotFoundError:
        return out, None
    except OSError as exc:  # a parent that is a file, a name too long, ...
        raise wrap_os_error(exc, f"cannot unpack into {shown}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode) or os.listdir(out):
        raise UsageError(f"{shown} exists and is not empty: choose a new directory")
    if os.path.samestat(st, os.stat(b".")):
        raise UsageError(f"{shown} is the current directory: name a new directory to unpack into")
    return out, stat.S_IMODE(st.st_mode)


def _make_parents(parent: bytes) -> list[bytes]:
    """Create the missing ancestors of OUT (as ``mkdir -p``); return them, outermost first."""
    missing = []
    path = parent
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    missing.reverse()
    for i, path in enumerate(missing):
        try:
            os.mkdir(path)
        except OSError as exc:
            _remove_dirs(missing[:i])
            raise wrap_os_error(exc, f"cannot create {os.fsdecode(path)}: {exc.strerror}") from exc
    return missing


def _remove_dirs(made: list[bytes]) -> None:
    for path in reversed(made):
        try:
            os.rmdir(path)
        except OSError:
            break  # no longer empty: someone else uses it now


def _make_private_dir(parent: bytes, name: bytes) -> bytes:
    """Create the hidden directory the tree is built in (a fresh name, never an old one)."""
    base = os.path.join(parent, b"." + name[:_NAME_KEEP] + _TEMP_MARK + b"%d" % os.getpid())
    for attempt in range(100):
        path = base if attempt == 0 else base + b"-%d" % attempt
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue  # left by a killed run whose pid was ours
        except OSError as exc:
            raise wrap_os_error(exc, f"cannot create {os.fsdecode(path)}: {exc.strerror}") from exc
    raise StorageError(errno.EEXIST, f"cannot create a fresh {os.fsdecode(base)}-N directory")


def _temp_name(taken: set[bytes], rel_dir: bytes) -> bytes:
    """A short temp name in ``rel_dir`` that no restored file or directory has."""
    name = b".shardio-unpack" + _TEMP_MARK + b"%d" % os.getpid()
    while (os.path.join(rel_dir, name) if rel_dir else name) in taken:
        name += b"x"
    return name


def _write_tree(
    ds: ShardReader,
    files: list[_File],
    tree: bytes,
    shown: Callable[[bytes], str],
    counters: Counters | None = None,
) -> int:
    """Write every file under ``tree`` (each under a temp name, then renamed); return bytes.

    Each file written is added to ``counters`` (one file, its bytes), when given.
    """
    taken = {f.rel for f in files}
    for f in files:
        parts = f.rel.split(b"/")
        taken.update(b"/".join(parts[:i]) for i in range(1, len(parts)))
    temps: dict[bytes, bytes] = {}
    nbytes = 0
    for f in files:
        data = ds.read_member(f.member, shard=f.shard, sample=f.sample)  # verified
        rel_dir = os.path.dirname(f.rel)
        dest = os.path.join(tree, f.rel)
        try:
            if rel_dir not in temps:
                os.makedirs(os.path.join(tree, rel_dir), exist_ok=True)
                temps[rel_dir] = _temp_name(taken, rel_dir)
            tmp = os.path.join(tree, rel_dir, temps[rel_dir])
            with os.fdopen(create_temp(os.fsdecode(tmp), 0o666), "wb") as fh:
                fh.write(data)
            os.replace(tmp, dest)
        except OSError as exc:
            raise wrap_os_error(exc, f"cannot write {shown(f.rel)}: {exc.strerror or exc}") from exc
        nbytes += len(data)
        if counters is not None:
            counters.add(1, len(data))
    return nbytes


def unpack_dataset(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    progress: ProgressCallback | None = None,
) -> UnpackResult:
    """Write every packed file back under ``out`` at its original relative path.

    ``out`` must not exist or be an empty directory; it appears (or is replaced by the
    filled directory) only when every file is restored. Missing parents are created.

    Args:
        root: the dataset directory.
        out: the directory to restore the tree into.
        progress: called from a helper thread with (files, bytes) snapshots against the
            totals the index lists, and once more with a final snapshot when ``out`` is in
            place (not after a failure).

    Raises:
        UsageError: ``out`` exists and is not empty (or is not a directory).
        FormatError: the index holds an unsafe, duplicate or conflicting path, or not the
            number of files the manifest promises.
        ChecksumMismatchError: a member is damaged (``out`` is left as it was).
        StorageError: a shard is missing or short, or writing failed.
    """
    start = time.monotonic()
    out_shown = os.fsdecode(out)
    if not out_shown:
        raise UsageError("the directory to unpack into is an empty string: name a new directory")
    target, keep_mode = _check_out(os.path.abspath(os.fsencode(out)), out_shown)
    parent, name = os.path.split(target)
    if not name:
        raise UsageError(f"cannot unpack into {out_shown}: name a new directory")

    def shown(rel: bytes) -> str:
        return os.fsdecode(os.path.join(os.fsencode(out), rel))

    with ShardReader(root) as ds:
        files = _plan(ds, ds.index.path)
        counters = Counters(shared=False)  # one thread writes: no shared memory needed
        tracker = (
            ProgressThread(
                counters,
                progress,
                files_total=len(files),
                # Sizes from the index, whose records _plan checked against the manifest.
                bytes_total=int(ds.index.members["size"][[f.member for f in files]].sum()),
            )
            if progress is not None
            else contextlib.nullcontext()
        )
        made = _make_parents(parent)
        tree = b""
        try:
            with tracker:  # the final snapshot only once OUT is in place
                tree = _make_private_dir(parent, name)
                nbytes = _write_tree(ds, files, tree, shown, counters)
                if keep_mode is not None:
                    os.chmod(tree, keep_mode)
                try:
                    os.rename(tree, target)  # onto an empty directory too
                except OSError as exc:
                    raise wrap_os_error(
                        exc, f"cannot move the unpacked tree to {out_shown}: {exc.strerror}"
                    ) from exc
        except BaseException:
            if tree:
                shutil.rmtree(tree, ignore_errors=True)
            _remove_dirs(made)
            raise
    return UnpackResult(len(files), nbytes, time.monotonic() - start)
