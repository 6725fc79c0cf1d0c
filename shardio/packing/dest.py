"""The destination of a pack: lock it, recognise what it holds, remove only shardio's files.

shardio removes nothing it cannot prove it wrote: a dataset counts as shardio's only when its
manifest parses and ``index.bin`` has the checksum the manifest records; an interrupted pack
only when its work directory holds a valid state record. Even then only the files those
records list (and shardio's own work directory) are removed, never through a symlink.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from shardio.errors import FormatError, ShardioError, UsageError, wrap_os_error
from shardio.format.checksum import file_xxh3_128
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import (
    INDEX_FILENAME,
    MANIFEST_FILENAME,
    REPORT_FILENAME,
    SHARD_DIR,
    WORK_DIR,
)
from shardio.packing.workfiles import (
    COMMIT_NAME,
    NEXT_DIR,
    CommitRecord,
    StateRecord,
    is_dataset_path,
    load_record,
    parse_record_name,
)
from shardio.storage.atomic import is_temp_name
from shardio.storage.files import describe_kind
from shardio.storage.striping import LayoutResult

__all__ = [
    "DestState",
    "check_owned",
    "dataset_files",
    "inspect_dst",
    "layout_of",
    "make_dst",
    "existing_dir",
    "remove_bare_dst",
    "remove_interrupted",
    "remove_temps",
    "remove_work_dir",
    "unlink_regular",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- lock


def make_dst(dst: str) -> bool:
    """Create DST if missing (its parents too); return whether it was created.

    Raises:
        UsageError: DST exists and is not a directory.
        StorageError: DST cannot be created.
    """
    try:
        os.mkdir(dst)
        return True
    except FileExistsError:
        pass
    except FileNotFoundError:
        try:
            os.makedirs(dst)
            return True
        except OSError as exc:
            raise wrap_os_error(exc, f"cannot create {dst}: {exc}") from exc
    except OSError as exc:
        raise wrap_os_error(exc, f"cannot create {dst}: {exc.strerror}") from exc
    if not os.path.isdir(dst):
        raise UsageError(f"destination {dst} exists and is not a directory")
    return False


# --------------------------------------------------------------------------- inspect


@dataclass(frozen=True)
class DestState:
    """What a destination holds.

    Attributes:
        kind: "empty" (nothing but empty shardio directories and temp files), "dataset"
            (a verified shardio dataset), "interrupted" (a pack's work directory with state
            records) or "foreign" (anything else).
        manifest: the dataset's manifest (kind "dataset").
        states: the state records of an interrupted pack.
        commit: a replacement's journal, when one was interrupted.
        has_next: the work directory holds a replacement pack (``next/``).
        why: for "foreign", what made it so (one line, naming a file).
        damaged: for "interrupted", a state record that does not parse (naming it).
    """

    kind: str
    manifest: Manifest | None = None
    states: tuple[StateRecord, ...] = ()
    commit: CommitRecord | None = None
    has_next: bool = False
    why: str = ""
    damaged: str = ""


def _is_regular(path: str) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise wrap_os_error(exc, f"cannot stat {path}: {exc.strerror}") from exc


def existing_dir(path: str) -> bool:
    """Whether ``path`` is a directory (not a symlink); refuse a symlink or other kind."""
    st = _lstat(path)
    if st is None:
        return False
    if stat.S_ISDIR(st.st_mode):
        return True
    raise UsageError(
        f"{path} is a {describe_kind(st.st_mode)}, not a directory: shardio does not write "
        "through symlinks or replace what it did not create"
    )


def _is_bare(path: str, depth: int = 3) -> bool:
    """A real directory holding only real (bare) directories and shardio temp files."""
    st = _lstat(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return False
    for name in os.listdir(path):
        child = os.path.join(path, name)
        cst = _lstat(child)
        if cst is None or (is_temp_name(name) and stat.S_ISREG(cst.st_mode)):
            continue
        if depth > 0 and stat.S_ISDIR(cst.st_mode) and _is_bare(child, depth - 1):
            continue
        return False
    return True


def _load_dataset(dst: str) -> tuple[Manifest | None, str]:
    """The manifest of a verified dataset in DST, or (None, why it is not one)."""
    path = os.path.join(dst, MANIFEST_FILENAME)
    st = _lstat(path)
    if st is None:
        return None, ""
    if not stat.S_ISREG(st.st_mode):
        return None, f"{path} is a {describe_kind(st.st_mode)}, not a shardio manifest"
    try:
        manifest = load_manifest(path)
    except (ShardioError, OSError) as exc:
        return None, str(exc)
    index = os.path.join(dst, manifest.index.path)
    try:
        if manifest.index.path != INDEX_FILENAME:
            raise FormatError(f"{path} names an index other than {INDEX_FILENAME}")
        digest = file_xxh3_128(index, what="index")
    except (ShardioError, OSError) as exc:
        return None, f"{path} has no matching index ({exc})"
    if digest != manifest.index.xxh3_128:
        return None, f"{index} does not match the checksum in {path}"
    return manifest, ""


def inspect_dst(dst: str) -> DestState:
    """Recognise what DST (an existing directory) holds; change nothing.

    Raises:
        UsageError: DST/shards or DST/.shardio-work is a symlink or not a directory.
        FormatError: a commit record is damaged (naming it).
    """
    work = os.path.join(dst, WORK_DIR)
    has_work = existing_dir(work)
    existing_dir(os.path.join(dst, SHARD_DIR))
    # Listed before the state records: another part of a parallel write may publish its state
    # record at any moment, and a work directory seen holding one must also show it below.
    others = [
        n
        for n in sorted(os.listdir(dst))
        if not (n in (SHARD_DIR, WORK_DIR) and _is_bare(os.path.join(dst, n)))
        and not (is_temp_name(n) and _is_regular(os.path.join(dst, n)))
    ]
    commit = None
    states: list[StateRecord] = []
    bad_state = ""
    has_next = False
    if has_work:
        commit_path = os.path.join(work, COMMIT_NAME)
        if _lstat(commit_path) is not None:
            commit = load_record(commit_path, CommitRecord)
        for name in sorted(os.listdir(work)):
            split = parse_record_name(name, "state")
            if split is None:
                continue
            path = os.path.join(work, name)
            try:
                state = load_record(path, StateRecord)
                if (state.part, state.num_parts) != split:
                    raise FormatError(f"pack state record {path} is damaged: it names another part")
                states.append(state)
            except ShardioError as exc:
                bad_state = bad_state or str(exc)
        nxt = os.path.join(work, NEXT_DIR)
        has_next = existing_dir(nxt) and not _is_bare(nxt)
    manifest, why = _load_dataset(dst)
    if manifest is not None:
        return DestState("dataset", manifest=manifest, commit=commit, has_next=has_next)
    if commit is not None:
        return DestState("foreign", commit=commit, why="an interrupted replacement")
    if why:
        return DestState("foreign", why=why)
    if states or bad_state:
        return DestState("interrupted", states=tuple(states), has_next=has_next, damaged=bad_state)
    if others:
        return DestState("foreign", why=f"{dst} is not empty ({others[0]!r}, ...)")
    return DestState("empty")


# --------------------------------------------------------------------------- files


def dataset_files(manifest: Manifest) -> list[str]:
    """Every file of a dataset, relative to its root; the manifest last."""
    out: list[str] = []
    for shard in manifest.shards:
        out.append(shard.path)
        if shard.dali_index is not None:
            out.append(shard.dali_index)
    if manifest.parity is not None:
        out += [f.path for f in manifest.parity.files()]
    return [*out, manifest.index.path, REPORT_FILENAME, MANIFEST_FILENAME]


def check_owned(dst: str, rels: Sequence[str], *, source: str) -> None:
    """Check that each listed file may be removed: a shardio dataset name, a regular file
    (or missing), reached through real directories only.

    Raises:
        UsageError: a name shardio does not write, a symlink, or not a regular file; the
            caller then removes nothing.
    """
    for rel in rels:
        if not is_dataset_path(rel):
            raise UsageError(
                f"{source} lists {rel!r}, which is not a file shardio writes: not removing "
                f"anything from {dst}"
            )
        parts = rel.split("/")
        path = dst
        for i, part in enumerate(parts):
            path = os.path.join(path, part)
            st = _lstat(path)
            if st is None:
                break
            last = i == len(parts) - 1
            if (last and not stat.S_ISREG(st.st_mode)) or (
                not last and not stat.S_ISDIR(st.st_mode)
            ):
                raise UsageError(
                    f"{path} is a {describe_kind(st.st_mode)}, not a file shardio wrote: "
                    f"refusing to replace the dataset in {dst} (nothing was removed)"
                )


def unlink_regular(path: str) -> None:
    """Remove ``path`` if it is a regular file (a symlink or other kind is left alone)."""
    st = _lstat(path)
    if st is None:
        return
    if not stat.S_ISREG(st.st_mode):
        logger.warning(
            "not removing %s: a %s, not a file shardio wrote", path, describe_kind(st.st_mode)
        )
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_temps(folder: str, prefixes: Sequence[str] = ("",)) -> None:
    """Remove shardio temp files (regular files with its temp mark) left by a killed run."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        if is_temp_name(name) and name.startswith(tuple(prefixes)):
            path = os.path.join(folder, name)
            if _is_regular(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _ignore_missing(
    func: Callable[..., Any],
    path: str,
    exc_info: tuple[type[BaseException], BaseException, TracebackType],
) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):  # removed by another part: fine
        raise exc_info[1]


def remove_work_dir(dst: str) -> None:
    """Remove DST's work directory (a real directory: never a symlink's target).

    State records go last, so a removal killed half-way still leaves DST recognisable.
    Files another process removed first are no error.
    """
    import shutil

    work = os.path.join(dst, WORK_DIR)
    if not existing_dir(work):
        return
    states = []
    for name in os.listdir(work):
        path = os.path.join(work, name)
        st = _lstat(path)
        if st is None:
            continue
        if parse_record_name(name, "state") is not None:
            states.append(path)
        elif stat.S_ISDIR(st.st_mode):
            # fd-based: symlinks inside are removed, not followed
            shutil.rmtree(path, onerror=_ignore_missing)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    for path in states:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(work)


def remove_interrupted(dst: str, states: Sequence[StateRecord]) -> None:
    """Remove an interrupted pack: the shards its state records planned, then its work dir.

    Raises:
        UsageError: a planned file is a symlink or not a regular file (nothing removed).
    """
    shard_dir = os.path.join(dst, SHARD_DIR)
    names = sorted(os.listdir(shard_dir)) if existing_dir(shard_dir) else []
    planned = [f"{SHARD_DIR}/{n}" for n in names if any(s.owns(f"{SHARD_DIR}/{n}") for s in states)]
    check_owned(dst, planned, source=f"the interrupted pack in {dst}")
    for rel in planned:
        unlink_regular(os.path.join(dst, rel))
    remove_temps(shard_dir)
    remove_work_dir(dst)


def remove_bare_dst(dst: str) -> None:
    """Remove a DST this run created if it holds nothing but empty shardio directories."""
    if not _is_bare(dst):
        return
    for rel in (f"{WORK_DIR}/frag", f"{WORK_DIR}/{NEXT_DIR}", WORK_DIR, SHARD_DIR, ""):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(dst, rel) if rel else dst)


def layout_of(manifest: Manifest) -> LayoutResult:
    """The layout a dataset records (FormatError if damaged)."""
    try:
        return LayoutResult.from_json(manifest.layout)
    except (ShardioError, ValueError) as exc:
        raise FormatError(f"layout record of the manifest is damaged: {exc}") from exc
