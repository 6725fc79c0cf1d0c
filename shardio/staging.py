"""Stage shards from the parallel filesystem to node-local storage (NVMe, BeeOND), verified.

``stage_dataset`` copies the shards a node will read, in the order training first needs
them, with parallel copy streams. Each copy is hashed while it is written and published
under its final name only when its xxh3-128 matches the manifest. A per-shard ``flock`` on
the local filesystem makes it safe for every rank of a node to run it at once (each shard is
copied once; the others wait, then find it done); the kernel drops the lock of a killed
process, so stale locks recover by themselves. A rerun copies only what is missing or bad.

Staging writes only into a new or empty directory, or into a staging area it made before
(recognised by its marker, never by a file name alone); it follows no symlink inside DEST,
opens every file so that a FIFO or device cannot block it, and ``clean_stage`` removes only
the regular files the staged manifest lists. Layout of the destination::

    DEST/.shardio-stage/area.json  the marker: {"format": "shardio-stage", "version": 1, ...}
    DEST/manifest.json             the source's manifest plus "staged_from" (the source path)
    DEST/index.bin                 copy of the source index
    DEST/shards/...                staged shards, same relative names as in the source
    DEST/.shardio-stage/locks/     one lock file per shard
    DEST/.shardio-stage/ok/        one stamp per verified shard (size, inode, ctime, xxh3)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import xxhash

from shardio.errors import FormatError, IntegrityError, ShardioError, StorageError, UsageError
from shardio.format.manifest import Manifest, ShardEntry, load_manifest
from shardio.format.spec import MANIFEST_FILENAME
from shardio.progress import Counters, ProgressCallback, ProgressThread
from shardio.runtime.order import check_order, epoch_order
from shardio.storage.atomic import (
    atomic_write,
    create_temp,
    is_temp_name,
    publish,
    storage_error,
    temp_path_for,
)
from shardio.storage.files import (
    describe_kind,
    make_dirs_inside,
    open_regular,
    read_regular,
    real_dir,
)
from shardio.storage.stamps import (
    STAGE_DIR,
    drop_staged,
    find_temps_inside,
    lock_path,
    read_area_marker,
    remove_temps_inside,
    rmdir_inside,
    stamp_matches,
    stamp_rel,
    unlink_inside,
    write_area_marker,
    write_stamp,
)

__all__ = [
    "MAX_NODES",
    "MAX_RANKS_PER_NODE",
    "MAX_STREAMS",
    "StageOptions",
    "StageResult",
    "clean_stage",
    "default_stage_dir",
    "node_shard_order",
    "stage_dataset",
]

logger = logging.getLogger(__name__)

_CHUNK = 16 * 1024 * 1024
MAX_RANKS_PER_NODE = 4096
MAX_NODES = 1 << 20
MAX_STREAMS = 256
# A DALI .idx holds one short text line per sample: bound what is read of one.
_IDX_BASE_BYTES = 64 * 1024 * 1024
_IDX_BYTES_PER_SAMPLE = 64
_READ_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """What to stage and how.

    Attributes:
        node: this node's number (0-based), of ``num_nodes``.
        num_nodes: nodes of the job; 1 stages every shard.
        ranks_per_node: training ranks per node (the rank layout decides which shards a
            node reads first), at most MAX_RANKS_PER_NODE.
        seed, epoch, order, window_shards, drop_last: as given to ShardDataset, so the
            stager computes the same order as training.
        streams: parallel copy streams, at most MAX_STREAMS.
        capacity_bytes: stage at most this many bytes (the shards needed first); None: all.
        durable: fsync each copy before publishing it. Off by default: a staging area is a
            job-scoped cache, a kill -9 cannot expose a half-written copy (temp name, then
            rename), and every read verifies each member and falls back to the source, which
            also covers a copy damaged by a node crash.
    """

    node: int = 0
    num_nodes: int = 1
    ranks_per_node: int = 1
    seed: int = 0
    epoch: int = 0
    order: str = "shard-local"
    window_shards: int = 4
    drop_last: bool = False
    streams: int = 4
    capacity_bytes: int | None = None
    durable: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= MAX_NODES or not 0 <= self.node < self.num_nodes:
            raise UsageError(
                f"invalid node {self.node}/{self.num_nodes}: need 0 <= I < N <= {MAX_NODES:,}"
            )
        if not 1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE:
            raise UsageError(
                f"invalid ranks per node {self.ranks_per_node}: need 1 to {MAX_RANKS_PER_NODE}"
            )
        if not 1 <= self.streams <= MAX_STREAMS:
            raise UsageError(f"invalid copy streams {self.streams}: need 1 to {MAX_STREAMS}")
        if self.window_shards < 1:
            raise UsageError(f"invalid window shards {self.window_shards}: need at least 1")
        if self.seed < 0 or self.epoch < 0:
            raise UsageError(f"seed ({self.seed}) and epoch ({self.epoch}) must be >= 0")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise UsageError("capacity must be positive")
        check_order(self.order)


@dataclass(frozen=True)
class StageResult:
    """What a stage run did."""

    dest: str
    shards_needed: int
    copied: int
    present: int
    replaced: int
    from_source: tuple[str, ...]
    bytes_copied: int
    bytes_staged: int
    seconds: float
    evicted: tuple[str, ...] = field(default_factory=tuple)


# --------------------------------------------------------------------------- default DEST


def default_stage_dir(src: str | os.PathLike[str], environ: Mapping[str, str]) -> str:
    """The default staging area of ``src``, private to this user and job.

    ``<base>/shardio-<uid>-<job>/<name>``: base is ``$SLURM_TMPDIR``, else ``$TMPDIR``,
    else ``/mnt/nvme``; job is ``$SLURM_JOB_ID`` or ``nojob``; name is the source
    directory's name. The ``shardio-<uid>-<job>`` directory is created with mode 0700 and
    then checked: a directory another user made in a shared ``$TMPDIR`` (or a symlink
    there) is refused, never written into.

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
    name = os.path.basename(os.path.abspath(os.fspath(src))) or "dataset"
    return os.path.join(private, name)


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


# --------------------------------------------------------------------------- order


def node_shard_order(manifest: Manifest, options: StageOptions) -> list[int]:
    """The shards this node's ranks read in the epoch, in the order they first need them.

    Uses the same order and rank split as ShardDataset (epoch_order + rank_positions), with
    global rank = node * ranks_per_node + local rank, computed for this node's ranks only:
    memory is the node's share of the epoch, whatever the number of ranks.
    """
    # Imported here: stage_dataset runs this beside its first I/O, so that numpy's import
    # (a good part of a cold start) overlaps the copy of the index.
    import numpy as np

    sizes = np.array([s.num_samples for s in manifest.shards], dtype=np.int64)
    order = epoch_order(
        shard_sizes=sizes,
        seed=options.seed,
        epoch=options.epoch,
        order=options.order,
        window_shards=options.window_shards,
    )
    n = len(order)
    world = options.num_nodes * options.ranks_per_node
    first = options.node * options.ranks_per_node
    # rank_positions: rank r reads positions r, r + W, ... of the order padded (by repeating
    # it from its start) to a multiple of W, or cut to one with drop_last.
    steps = n // world if options.drop_last else -(-n // world)
    if steps == 0:
        return []
    ranks = np.arange(first, first + options.ranks_per_node, dtype=np.int64)
    # Time order: step 0 of every rank of the node, then step 1, ...
    positions = (np.arange(steps, dtype=np.int64)[:, None] * world + ranks[None, :]).ravel()
    samples = order[positions % n]  # a position past the end is padding: order[p - n], ...
    shards = np.searchsorted(np.cumsum(sizes), samples, side="right")
    _, first_seen = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in np.sort(first_seen)]


# --------------------------------------------------------------------------- the area


@contextlib.contextmanager
def _storage_errors(path: str, action: str) -> Iterator[None]:
    """Turn a stray OSError into a StorageError naming ``path`` (one line for the CLI)."""
    try:
        yield
    except ShardioError:
        raise
    except OSError as exc:
        raise storage_error(exc, path, action) from exc


def _refuse_staged(path: str, kind: str) -> UsageError:
    return UsageError(
        f"{path} is a {kind}, not a copy staged by shardio: it is not read, replaced or "
        "removed; remove it yourself and stage again"
    )


def _open_staged(path: str, what: str) -> int | None:
    """Open a file staging wrote, without following a symlink or blocking on a FIFO; None
    when absent. Anything but a regular file is refused (UsageError)."""
    try:
        fd = os.open(path, _READ_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse_staged(path, "symlink") from exc
        raise StorageError(
            exc.errno or errno.EIO, f"cannot read {what} {path}: {exc.strerror}"
        ) from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse_staged(path, describe_kind(mode))
    return fd


def _staged_digest(path: str, what: str) -> str | None:
    """xxh3-128 of a staged file (None when absent), read, not mapped: a file truncated
    meanwhile ends the hash early instead of killing the process with SIGBUS."""
    fd = _open_staged(path, what)
    if fd is None:
        return None
    try:
        hasher = xxhash.xxh3_128()
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := os.readv(fd, [buf]):
            hasher.update(view[:n])
        return hasher.hexdigest()
    finally:
        os.close(fd)


def _staged_equals(path: str, data: bytes, what: str) -> bool:
    """Whether the staged file at ``path`` holds exactly ``data`` (False when absent)."""
    fd = _open_staged(path, what)
    if fd is None:
        return False
    try:
        if os.fstat(fd).st_size != len(data):
            return False
        got = bytearray()
        while len(got) <= len(data) and (chunk := os.read(fd, len(data) + 1 - len(got))):
            got += chunk
        return got == data
    finally:
        os.close(fd)


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
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        if os.path.lexists(dest):
            raise UsageError(f"{dest} is a dangling symlink: give a directory") from None
        return "missing"
    except OSError as exc:
        raise StorageError(exc.errno or errno.EIO, f"cannot access {dest}: {exc.strerror}") from exc
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
            and all(is_temp_name(e) for e in os.listdir(folder))
        ):
            return "unfinished"  # an area whose creator was killed before its marker
    except OSError as exc:
        raise StorageError(exc.errno or errno.EIO, f"cannot list {dest}: {exc.strerror}") from exc
    if cleaning:
        raise UsageError(
            f"{dest} holds no staged dataset (it is not a shardio staging area): "
            "refusing to clean it"
        )
    raise UsageError(
        f"{dest} is not empty and is not a shardio staging area: refusing to stage into it "
        "(give a new or empty directory)"
    )


def _open_area(src_root: str, dest: str, *, durable: bool) -> None:
    """Check DEST and make it a staging area (marker first), or refuse with nothing written."""
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
    if state != "area" or read_area_marker(dest) is None:
        write_area_marker(dest, os.path.abspath(src_root), durable=durable)
    for sub in ("locks", "ok"):
        make_dirs_inside(dest, f"{STAGE_DIR}/{sub}")


def _check_paths(manifest: Manifest, src_root: str) -> None:
    """Refuse a manifest whose paths would land in staging's own records."""
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


# --------------------------------------------------------------------------- copies


@contextlib.contextmanager
def _shard_lock(dest: str, rel: str) -> Iterator[None]:
    path = lock_path(dest, rel)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(
                f"lock file {path} is a symlink: shardio does not write through symlinks; remove it"
            ) from exc
        raise storage_error(exc, path, "locking") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(
                f"lock file {path} is a {describe_kind(mode)}, not a regular file; remove it"
            )
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another rank copies this shard
        yield
    finally:
        os.close(fd)  # releases the lock; a killed holder's lock goes with its process


def _copy_range(fin: int, fout: int, limit: int, counters: Counters) -> int:
    """Copy at most ``limit`` bytes inside the kernel (copy_file_range, else sendfile, else
    read/write); return the bytes copied."""
    total = 0
    for copy in (os.copy_file_range, _sendfile):
        try:
            while total < limit:
                n = copy(fin, fout, min(_CHUNK, limit - total))
                if n == 0:
                    break
                total += n
                counters.add(0, n)
            return total
        except OSError as exc:
            if total or exc.errno not in (
                errno.EXDEV,
                errno.ENOSYS,
                errno.EINVAL,
                errno.EOPNOTSUPP,
            ):
                raise
    buf = bytearray(min(_CHUNK, max(limit, 1)))
    view = memoryview(buf)
    while total < limit:
        n = os.readv(fin, [view[: min(len(buf), limit - total)]])
        if n == 0:
            break
        written = 0
        while written < n:
            written += os.write(fout, view[written:n])
        total += n
        counters.add(0, n)
    return total


def _sendfile(fin: int, fout: int, count: int) -> int:
    return os.sendfile(fout, fin, None, count)


def _hash_file(fd: int) -> str:
    """xxh3-128 of a temp file of ours through a mapping (its pages are hashed where they
    lie)."""
    hasher = xxhash.xxh3_128()
    if os.fstat(fd).st_size:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for pos in range(0, len(view), _CHUNK):
                    hasher.update(view[pos : pos + _CHUNK])
            finally:
                view.release()
    return hasher.hexdigest()


def _copy_verified(
    src: str,
    dst: str,
    expected: str,
    *,
    size_bytes: int,
    durable: bool,
    counters: Counters,
    what: str = "source shard",
) -> int:
    """Copy src to a temp file in the kernel, hash the copy's own bytes, publish if it matches.

    The copy is hashed after it is written (its pages are still in the page cache), so what is
    checked is what will be read, not the source. A source whose size is not ``size_bytes``
    is refused before a byte is copied, and no more than ``size_bytes + 1`` are ever copied.
    """
    fin = open_regular(src, what=what)
    try:
        size = os.fstat(fin).st_size
        if size != size_bytes:
            raise IntegrityError(
                errno.EIO,
                f"{what} {src} is {size:,} bytes, its manifest says {size_bytes:,}: it changed "
                "after it was packed; run shardio verify on the source",
            )
        with contextlib.suppress(OSError):
            os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        tmp = temp_path_for(dst)
        try:
            fout = create_temp(tmp, readable=True)
        except OSError as exc:
            raise storage_error(exc, dst, "staging") from exc
        try:
            try:
                total = _copy_range(fin, fout, size_bytes + 1, counters)
                actual = _hash_file(fout) if total == size_bytes else ""
            finally:
                os.close(fout)
            if total != size_bytes:
                raise IntegrityError(
                    errno.EIO,
                    f"{what} {src} changed while it was copied ({total:,} bytes read, its "
                    f"manifest says {size_bytes:,}): run shardio verify on the source",
                )
            if actual != expected:
                raise IntegrityError(
                    errno.EIO,
                    f"{what} {src} does not match its manifest checksum "
                    f"(expected {expected}, got {actual}): run shardio verify on the source",
                )
            publish(tmp, dst, durable=durable)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError) and not isinstance(exc, ShardioError):
                raise storage_error(exc, dst, "staging") from exc
            raise
    finally:
        os.close(fin)
    return total


def _sync_small_file(src: str, dst: str, durable: bool, *, max_bytes: int) -> None:
    """Make dst a copy of a small file (no checksum in the manifest: compare the bytes)."""
    data = read_regular(src, max_bytes=max_bytes, what="DALI index")
    if _staged_equals(dst, data, "staged DALI index"):
        return
    with atomic_write(dst, durable=durable) as out:
        out.write(data)


def _leftover_temps(dest: str, folders: set[str]) -> dict[str, list[str]]:
    """Temp files in ``folders`` of DEST: final relative path -> the temps' relative paths.

    Listed once per folder; each is removed under its shard's lock, which every writer of
    that final name holds, so a live copy's temp is never removed.
    """
    found: dict[str, list[str]] = {}
    for folder in folders:
        prefix = f"{folder}/" if folder else ""
        for final, names in find_temps_inside(dest, folder).items():
            found[prefix + final] = [prefix + n for n in names]
    return found


def _stage_one(
    src_root: str,
    dest: str,
    entry: ShardEntry,
    temps: list[str],
    *,
    durable: bool,
    counters: Counters,
) -> tuple[str, str, int]:
    """Stage one shard (and its DALI index) under its lock; return (rel, outcome, bytes)."""
    rel, expected = entry.path, entry.xxh3_128
    final = os.path.join(dest, rel)
    with _storage_errors(final, "staging"), _shard_lock(dest, rel):
        for temp in temps:  # a killed run's partial copy; the lock excludes live ones
            unlink_inside(dest, temp)
        outcome, copied = "present", 0
        if not stamp_matches(dest, rel, expected):
            digest = _staged_digest(final, "staged copy")
            if digest == expected:
                write_stamp(dest, rel, expected, durable)  # a verified copy, no stamp
            else:
                outcome = "copied"
                if digest is not None:
                    logger.warning("staged copy %s is damaged: copying it again", final)
                    drop_staged(dest, rel)
                    outcome = "replaced"
                copied = _copy_verified(
                    os.path.join(src_root, rel),
                    final,
                    expected,
                    size_bytes=entry.size_bytes,
                    durable=durable,
                    counters=counters,
                )
                write_stamp(dest, rel, expected, durable)
        if entry.dali_index is not None:  # DALI wants the .idx beside the staged tar
            _sync_small_file(
                os.path.join(src_root, entry.dali_index),
                os.path.join(dest, entry.dali_index),
                durable,
                max_bytes=_IDX_BASE_BYTES + _IDX_BYTES_PER_SAMPLE * entry.num_samples,
            )
    counters.add(1, 0)
    return rel, outcome, copied


def _write_local_metadata(src_root: str, dest: str, manifest: Manifest, durable: bool) -> None:
    """Copy the index (verified) and write DEST's manifest, which names the source."""
    index_rel = manifest.index.path
    make_dirs_inside(dest, os.path.dirname(index_rel))
    index_dst = os.path.join(dest, index_rel)
    if _staged_digest(index_dst, "staged index") != manifest.index.xxh3_128:
        _copy_verified(
            os.path.join(src_root, index_rel),
            index_dst,
            manifest.index.xxh3_128,
            size_bytes=manifest.index.size_bytes,
            durable=durable,
            counters=Counters(shared=False),
            what="index",
        )
    data = dataclasses.replace(manifest, staged_from=os.path.abspath(src_root)).dumps()
    target = os.path.join(dest, MANIFEST_FILENAME)
    if not _staged_equals(target, data, "staged manifest"):
        with atomic_write(target, durable=durable) as fh:
            fh.write(data)


def _evict_for(
    dest: str, manifest: Manifest, keep: set[str], need_bytes: int, capacity: int
) -> list[str]:
    """Remove staged shards not needed now while DEST would exceed ``capacity`` with the
    ``need_bytes`` of the kept ones; oldest first, skipping any a reader holds open."""
    staged = []
    for s in manifest.shards:
        if s.path in keep:
            continue
        try:
            st = os.lstat(os.path.join(dest, s.path))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            staged.append((st.st_mtime, s))
    used = sum(s.size_bytes for _, s in staged)  # the kept shards are in need_bytes
    evicted = []
    for _, entry in sorted(staged, key=lambda t: (t[0], t[1].path)):
        if used + need_bytes <= capacity:
            break
        try:
            fd = os.open(os.path.join(dest, entry.path), _READ_NOFOLLOW)
        except OSError:
            continue  # gone, or no longer a file staging wrote
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # readers hold LOCK_SH
            except BlockingIOError:
                continue
            if not drop_staged(dest, entry.path):
                continue
            if entry.dali_index is not None:
                unlink_inside(dest, entry.dali_index)
        finally:
            os.close(fd)
        used -= entry.size_bytes
        evicted.append(entry.path)
    return evicted


def _choose(
    manifest: Manifest, needed: list[int], capacity: int | None
) -> tuple[list[ShardEntry], list[str]]:
    """The shards to stage (the prefix of first need that fits) and those read from SRC."""
    chosen, from_source, budget = [], [], capacity
    for shard in needed:
        entry = manifest.shards[shard]
        if budget is not None and entry.size_bytes > budget:
            from_source.append(entry.path)
            budget = 0
            continue
        chosen.append(entry)
        if budget is not None:
            budget -= entry.size_bytes
    return chosen, from_source


def stage_dataset(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    options: StageOptions,
    *,
    progress: ProgressCallback | None = None,
) -> StageResult:
    """Stage this node's shards of the dataset at ``src`` into ``dest``.

    ``dest`` must be missing, an empty directory, or a staging area made by shardio; a new
    area gets its marker (``.shardio-stage/area.json``) before anything else is written.

    Raises:
        FormatError: src holds no valid manifest.
        UsageError: dest is inside src (or holds it), is not a directory, is neither empty
            nor a staging area, or has a symlink or special file where staging writes.
        IntegrityError: a source shard does not match its size or checksum.
        StorageError: copying failed (ENOSPC included); published copies stay valid.
    """
    start = time.monotonic()
    src_root, dest_root = os.fspath(src), os.fspath(dest)
    manifest = load_manifest(os.path.join(src_root, MANIFEST_FILENAME))
    _check_paths(manifest, src_root)
    _open_area(src_root, dest_root, durable=options.durable)
    with (
        _storage_errors(dest_root, "staging into"),
        concurrent.futures.ThreadPoolExecutor(
            max_workers=options.streams, thread_name_prefix="shardio-stage"
        ) as pool,
    ):
        # The order needs numpy, whose import is a good part of a cold start: it is
        # computed beside the copy of the index.
        order = pool.submit(node_shard_order, manifest, options)
        _write_local_metadata(src_root, dest_root, manifest, options.durable)
        needed = order.result()
        chosen, from_source = _choose(manifest, needed, options.capacity_bytes)
        folders = {os.path.dirname(e.path) for e in chosen} | {
            os.path.dirname(e.dali_index) for e in chosen if e.dali_index is not None
        }
        for folder in sorted(folders):
            make_dirs_inside(dest_root, folder)  # refuses a symlink on the way
        temps = _leftover_temps(dest_root, folders | {f"{STAGE_DIR}/ok"})
        evicted: list[str] = []
        if options.capacity_bytes is not None:
            evicted = _evict_for(
                dest_root,
                manifest,
                {e.path for e in chosen},
                sum(e.size_bytes for e in chosen),
                options.capacity_bytes,
            )
        counters = Counters(shared=False)
        tracker = (
            ProgressThread(
                counters,
                progress,
                files_total=len(chosen),
                bytes_total=sum(e.size_bytes for e in chosen),
            )
            if progress is not None
            else contextlib.nullcontext()
        )
        with tracker:
            futures = [
                pool.submit(
                    _stage_one,
                    src_root,
                    dest_root,
                    e,
                    _temps_of(e, temps),
                    durable=options.durable,
                    counters=counters,
                )
                for e in chosen
            ]
            try:
                outcomes = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    if from_source:
        logger.warning(
            "%d shard(s) exceed --capacity and will be read from %s", len(from_source), src_root
        )
    return StageResult(
        dest=dest_root,
        shards_needed=len(needed),
        copied=sum(1 for _, o, _ in outcomes if o == "copied"),
        present=sum(1 for _, o, _ in outcomes if o == "present"),
        replaced=sum(1 for _, o, _ in outcomes if o == "replaced"),
        from_source=tuple(from_source),
        bytes_copied=sum(n for _, _, n in outcomes),
        bytes_staged=sum(e.size_bytes for e in chosen),
        seconds=time.monotonic() - start,
        evicted=tuple(evicted),
    )


def _temps_of(entry: ShardEntry, temps: dict[str, list[str]]) -> list[str]:
    """Leftover temps of a shard's copy, its DALI index and its stamp."""
    finals = [entry.path, stamp_rel(entry.path)]
    if entry.dali_index is not None:
        finals.append(entry.dali_index)
    return [t for f in finals for t in temps.get(f, ())]


def clean_stage(dest: str | os.PathLike[str]) -> int:
    """Remove what staging put in ``dest`` (epilogue); return the number of shards removed.

    Only regular files named by DEST's staged manifest and shardio's own records are
    removed; no symlink is followed, and anything else in ``dest`` stays.

    Raises:
        UsageError: ``dest`` is not a staging area, or its manifest is not the one staging
            wrote (a symlink).
        FormatError: the staged manifest is damaged (what was staged is unknown).
    """
    dest_root = os.fspath(dest)
    state = _classify_dest(dest_root, cleaning=True)
    if state in ("missing", "empty"):
        raise UsageError(f"{dest_root} holds no staged dataset")
    with _storage_errors(dest_root, "cleaning"):
        manifest = _staged_manifest(dest_root)
        removed = 0
        if manifest is not None:
            unlink_inside(dest_root, MANIFEST_FILENAME)  # first: no reader sees a half cache
            files = [manifest.index.path] + [
                p for s in manifest.shards for p in (s.path, s.dali_index) if p is not None
            ]
            by_folder: dict[str, set[str]] = {}
            for path in [MANIFEST_FILENAME, *files]:
                folder, name = os.path.split(path)
                by_folder.setdefault(folder, set()).add(name)
            for folder, names in by_folder.items():
                remove_temps_inside(dest_root, folder, names)
            shards = {s.path for s in manifest.shards}
            for path in files:
                if unlink_inside(dest_root, path) and path in shards:
                    removed += 1
            _remove_empty_folders(dest_root, set(by_folder))
        stage_dir = os.path.join(dest_root, STAGE_DIR)
        if real_dir(stage_dir):  # shardio's own records; a symlink there is not
            shutil.rmtree(stage_dir)
    return removed


def _staged_manifest(dest: str) -> Manifest | None:
    """The manifest staging wrote in ``dest`` (None if it never got that far)."""
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


def _remove_empty_folders(root: str, folders: set[str]) -> None:
    """rmdir the folders (and their parents below root) that staging left empty."""
    todo: set[str] = set()
    for folder in folders:
        while folder:
            todo.add(folder)
            folder = os.path.dirname(folder)  # noqa: PLW2901 - walk up to root
    for folder in sorted(todo, key=lambda f: (-f.count("/"), f)):
        rmdir_inside(root, folder)  # kept when not empty, or a symlink
