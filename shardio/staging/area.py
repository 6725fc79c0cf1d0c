"""Staging areas: recognise one (its marker), create one, choose the default one, clean one.

A directory is staged into only when it is missing, empty, or a staging area shardio made
before (recognised by its marker ``.shardio-stage/area.json``, or by the staged manifest of
a release that wrote no marker), never by a file name alone. ``clean_stage`` removes only the
regular files the staged manifest lists and shardio's own records. An area records the
dataset it holds (its dataset id, :mod:`shardio.staging.identity`): another dataset is staged
into it only with ``force``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import stat
from collections.abc import Iterator, Mapping

from shardio.errors import FormatError, ShardioError, StorageError, UsageError, wrap_os_error
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import MANIFEST_FILENAME
from shardio.staging.clean import CleanResult, journal_name, remove_staged
from shardio.staging.identity import DatasetIdentity, describe_area, same_dataset
from shardio.staging.protocol import (
    AREA_LOCK,
    STAGE_DIR,
    area_lock,
    read_area_marker,
    write_area_marker,
)
from shardio.storage.atomic import is_temp_name, storage_error
from shardio.storage.files import describe_kind, make_dirs_inside

__all__ = [
    "check_paths",
    "clean_stage",
    "default_stage_dir",
    "open_area",
    "storage_errors",
]

logger = logging.getLogger(__name__)

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SOURCE_HASH_CHARS = 8


@contextlib.contextmanager
def storage_errors(path: str, action: str) -> Iterator[None]:
    """Turn a stray OSError into a StorageError naming ``path`` (one line for the CLI)."""
    try:
        yield
    except ShardioError:
        raise
    except OSError as exc:
        raise storage_error(exc, path, action) from exc


# --------------------------------------------------------------------------- default DEST


def default_stage_dir(src: str | os.PathLike[str], environ: Mapping[str, str]) -> str:
    """The default staging area of ``src``, private to this user and job.

    ``<base>/shardio-<uid>-<job>/<name>-<hash>``: base is ``$SLURM_TMPDIR``, else
    ``$TMPDIR``, else ``/mnt/nvme``; job is ``$SLURM_JOB_ID`` or ``nojob``; name is the
    source directory's name (``os.path.basename(os.path.abspath(src))``) and hash the first 8
    hex digits of the SHA-256 of its real path (``os.path.realpath``), so that two sources
    with one name (``/lustre/a/train``, ``/lustre/b/train``) get two areas. In a shell:
    ``printf %s "$(realpath -m -- "$SRC")" | sha256sum | cut -c1-8``. The
    ``shardio-<uid>-<job>`` directory is created with mode 0700 and then checked: a
    directory another user made in a shared ``$TMPDIR`` (or a symlink there) is refused,
    never written into.

    Args:
        src: the source dataset.
        environ: the environment to read (the CLI passes ``os.environ``).

    Raises:
        UsageError: the private directory cannot be made, or is not a real directory owned
            by this user and writable by no one else.
    """
    base = environ.get("SLURM_TMPDIR") or environ.get("TMPDIR") or "/mnt/nvme"
    job = environ.get("SLURM_JOB_ID") or "nojob"
    if not _JOB_ID.fullmatch(job):
        raise UsageError(f"SLURM_JOB_ID {job!r} is not a job id: give the destination (DEST)")
    uid = os.getuid()
    private = os.path.join(base, f"shardio-{uid}-{job}")
    _make_private_dir(private, uid)
    path = os.fspath(src)
    name = os.path.basename(os.path.abspath(path)) or "dataset"
    real = os.fsencode(os.path.realpath(path))
    digest = hashlib.sha256(real).hexdigest()[:_SOURCE_HASH_CHARS]
    return os.path.join(private, f"{name}-{digest}")


def _make_private_dir(path: str, uid: int) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(
            f"cannot create the staging directory {path} ({exc.strerror}): give DEST"
        ) from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UsageError(f"cannot check the staging directory {path} ({exc.strerror})") from exc
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = f"is a {describe_kind(st.st_mode)}, not a directory"
    elif st.st_uid != uid:
        problem = f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    elif st.st_mode & 0o022:
        problem = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem is not None:
        raise UsageError(
            f"staging directory {path} {problem}: another user could control it; "
            "remove it or give DEST"
        )


# --------------------------------------------------------------------------- recognise


def _is_legacy_area(dest: str, *, cleaning: bool) -> bool:
    """Whether ``dest`` holds the staged manifest of a previous release (no marker)."""
    path = os.path.join(dest, MANIFEST_FILENAME)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        manifest = load_manifest(path)
    except (OSError, FormatError):
        return False
    if manifest.staged_from is None:
        action = "clean" if cleaning else "stage into"
        raise UsageError(f"{dest} is a packed dataset, not a staging area: refusing to {action} it")
    return True


def _classify_dest(dest: str, *, cleaning: bool) -> str:
    """The state of DEST: missing, empty, unfinished (an area whose marker is not yet
    written) or area.

    Raises:
        UsageError: ``dest`` is not a directory, or neither empty nor a staging area.
    """
    for _look in range(3):
        try:
            st = os.stat(dest)
            break
        except FileNotFoundError:
            try:
                link = os.lstat(dest)
            except FileNotFoundError:
                return "missing"
            except OSError as exc:
                raise wrap_os_error(exc, f"cannot access {dest}: {exc.strerror}") from exc
            if stat.S_ISLNK(link.st_mode):
                raise UsageError(f"{dest} is a dangling symlink: give a directory") from None
            # Another stager of this node made DEST between the two looks: look again.
        except OSError as exc:
            raise wrap_os_error(exc, f"cannot access {dest}: {exc.strerror}") from exc
    else:
        raise StorageError(errno.EAGAIN, f"cannot access {dest}: it keeps changing")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{dest} is a {describe_kind(st.st_mode)}, not a directory")
    if read_area_marker(dest) is not None or _is_legacy_area(dest, cleaning=cleaning):
        return "area"
    try:
        entries = os.listdir(dest)
        if not entries:
            return "empty"
        folder = os.path.join(dest, STAGE_DIR)
        if (
            entries == [STAGE_DIR]
            and stat.S_ISDIR(os.lstat(folder).st_mode)
            and all(is_temp_name(e) or e == AREA_LOCK for e in os.listdir(folder))
        ):
            # An area whose creator was killed before its marker, or is writing it now
            # (under the area lock, which this stager then waits for).
            return "unfinished"
    except OSError as exc:
        raise wrap_os_error(exc, f"cannot list {dest}: {exc.strerror}") from exc
    if read_area_marker(dest) is not None:
        # Another stager of this node made DEST an area between our two looks (rank 0 and
        # rank 1 both found it empty): the marker is published atomically, so it is one.
        return "area"
    if cleaning:
        raise UsageError(
            f"{dest} holds no staged dataset (it is not a shardio staging area): "
            "refusing to clean it"
        )
    raise UsageError(
        f"{dest} is not empty and is not a shardio staging area: refusing to stage into it "
        "(give a new or empty directory)"
    )


# --------------------------------------------------------------------------- create


def open_area(
    src_root: str, dest: str, dataset: DatasetIdentity, *, durable: bool, force: bool = False
) -> None:
    """Check DEST and make it a staging area of ``dataset`` (marker first), or refuse with
    nothing written.

    An area that holds another dataset is refused, unless ``force``: then what shardio
    staged there is removed first (:func:`shardio.staging.clean.remove_staged`; the repair
    journal and any file shardio did not put there stay).

    Raises:
        UsageError: DEST is inside the source (or holds it), is not a directory, is neither
            missing, empty nor a staging area, or holds another dataset (without ``force``).
        StorageError: DEST or its records cannot be created.
    """
    real_src, real_dest = os.path.realpath(src_root), os.path.realpath(dest)
    if real_src == real_dest or real_dest.startswith(real_src.rstrip(os.sep) + os.sep):
        raise UsageError(f"stage destination {dest} must be outside the source {src_root}")
    if real_src.startswith(real_dest.rstrip(os.sep) + os.sep):
        raise UsageError(f"stage destination {dest} must not contain the source {src_root}")
    state = _classify_dest(dest, cleaning=False)
    if state == "missing":
        try:
            os.makedirs(dest, exist_ok=True)
        except OSError as exc:
            raise storage_error(exc, dest, "creating") from exc
    if dataset.dataset_id is None:
        raise UsageError(f"{src_root}: no dataset id to record in staging area {dest}")
    with area_lock(dest):  # one stager of the node decides (and replaces) at a time
        if state == "area" and same_dataset(dest, dataset) is False:
            if not force:
                raise UsageError(
                    f"staging area {dest} holds {describe_area(dest)}, not "
                    f"{dataset.describe()}: refusing to stage into it (give another DEST, "
                    "or --force to remove what shardio staged there first)"
                )
            logger.warning(
                "staging area %s holds %s: removing what shardio staged there (--force)",
                dest,
                describe_area(dest),
            )
            remove_staged(dest, keep_marker=True)
        marker = read_area_marker(dest)
        staged_from = os.path.abspath(src_root)
        if (
            marker is None
            or marker.get("dataset_id") != dataset.dataset_id
            or marker.get("staged_from") != staged_from
        ):
            write_area_marker(dest, staged_from, dataset_id=dataset.dataset_id, durable=durable)
    for sub in ("locks", "ok"):
        make_dirs_inside(dest, f"{STAGE_DIR}/{sub}")


def check_paths(manifest: Manifest, src_root: str) -> None:
    """Refuse a manifest whose paths would land in staging's own records.

    Raises:
        FormatError: a path is under ``.shardio-stage`` or has a shardio temp name.
    """
    paths = [manifest.index.path]
    for s in manifest.shards:
        paths.append(s.path)
        if s.dali_index is not None:
            paths.append(s.dali_index)
    for path in paths:
        if path.split("/", 1)[0] == STAGE_DIR or is_temp_name(path):
            raise FormatError(
                f"{os.path.join(src_root, MANIFEST_FILENAME)}: path {path!r} is reserved for "
                "shardio's staging records"
            )


# --------------------------------------------------------------------------- clean


def clean_stage(
    dest: str | os.PathLike[str], *, journal_dir: str | None = None, job: str | None = None
) -> CleanResult:
    """Remove what staging put in ``dest`` (epilogue); see :mod:`shardio.staging.clean`.

    Only regular files named by DEST's staged manifest and plan and shardio's own records
    are removed; no symlink is followed, and anything else in ``dest`` stays (listed in the
    result), with the folders holding it.

    Args:
        dest: the staging area.
        journal_dir: move the repair journal (which samples were retried, re-staged or
            skipped, and why) into this directory first, as
            ``shardio-repairs-<job>-<host>-<area>.jsonl``; None leaves it in the area.
        job: the job id in the journal's name.

    Raises:
        UsageError: ``dest`` is not a staging area, or its manifest is not the one staging
            wrote (a symlink).
        FormatError: the staged manifest is damaged (what was staged is unknown).
    """
    dest_root = os.fspath(dest)
    state = _classify_dest(dest_root, cleaning=True)
    if state in ("missing", "empty"):
        raise UsageError(f"{dest_root} holds no staged dataset")
    with storage_errors(dest_root, "cleaning"):
        return remove_staged(
            dest_root, journal_dir=journal_dir, journal_as=journal_name(dest_root, job)
        )
