"""Read a batch of samples into one shared-memory buffer plus offsets.

A DataLoader worker that returns per-sample ``bytes`` pays a pickle and a copy per sample on
the way to the main process; measured here that caps a 2-worker loader near 8,200 samples/s
with no I/O at all. shardio reads every member of a batch with ``preadv`` straight into one
uint8 buffer in shared memory (a reused slot of the ring transport, :mod:`.transport`, or a
fresh segment), so only offsets and a slot number or a file descriptor cross the process
boundary.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from shardio.errors import StorageError, UsageError
from shardio.format.spec import LABEL_EXT
from shardio.read.extents import read_members_planned
from shardio.read.mapcache import FileIdentity, MapCache
from shardio.read.reader import ShardReader
from shardio.units import format_size

__all__ = [
    "ByteColumn",
    "MappedColumn",
    "payload_rows",
    "read_batch",
    "read_batch_mapped",
    "share_tensors",
    "shared_uint8",
    "shm_full_error",
]

# Where shm_open puts torch's shared storages on Linux (named in the error when it is full).
SHM_DIR = "/dev/shm"
# torch's messages when a shared storage finds no room (posix_fallocate/ftruncate failed).
_NO_ROOM = ("No space left on device", "unable to allocate shared memory")
_MAX_DEPTH = 4  # how deep share_tensors looks into a batch's lists and dicts

# Mappings of shard files in the process that receives mapped batches (the training loop).
# One per process and file, like the page cache they view; forked children map afresh.
_RECEIVER_MAPS = MapCache()


class ByteColumn(Sequence[memoryview]):
    """One payload field of a batch: ``bytes(col[i])`` is sample i's bytes.

    Attributes:
        buffer: the uint8 tensor holding the whole batch (shared memory, pinnable).
        offsets: int64 array of n + 1 offsets into ``buffer``.
        present: bool array, False where a sample lacks this field (``col[i]`` is then None).
    """

    def __init__(
        self, buffer: torch.Tensor, offsets: np.ndarray[Any, Any], present: np.ndarray[Any, Any]
    ) -> None:
        self.buffer = buffer
        self.offsets = offsets
        self.present = present

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _present(self, i: int) -> int | None:
        """Sample ``i``'s place (a negative ``i`` counts from the end), or None where it
        lacks this field.

        Raises:
            IndexError: ``i`` is outside the column.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        return i if self.present[i] else None

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        view, bounds, present = self._views()
        if not 0 <= i < len(present):  # a negative i counts from the end
            at = self._present(i)
            if at is None:
                return None  # type: ignore[return-value]
            i = at
        elif not present[i]:
            return None  # type: ignore[return-value]
        return view[bounds[i] : bounds[i + 1]]

    def _views(self) -> tuple[memoryview, list[int], list[bool]]:
        """The buffer as a memoryview, the offsets as ints and ``present`` as bools, made on
        first use (a training loop takes every sample of a batch: not once per sample)."""
        views = self.__dict__.get("_cached")
        if views is None:
            views = self._cached = (
                memoryview(self.buffer.numpy()),  # type: ignore[arg-type]
                self.offsets.tolist(),
                self.present.tolist(),
            )
        return views

    def __iter__(self) -> Iterator[memoryview]:
        view, bounds, present = self._views()
        for at, has in enumerate(present):
            yield view[bounds[at] : bounds[at + 1]] if has else None  # type: ignore[misc]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_cached", None)  # a memoryview does not pickle (a worker's fallback batch)
        return state

    def tensor(self, i: int) -> torch.Tensor:
        """Sample i's bytes as a uint8 tensor view (no copy)."""
        return self.buffer[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def pin_memory(self) -> ByteColumn:
        """Called by the DataLoader's pin-memory thread."""
        return ByteColumn(self.buffer.pin_memory(), self.offsets, self.present)

    def __repr__(self) -> str:
        return f"ByteColumn(n={len(self)}, bytes={int(self.offsets[-1] - self.offsets[0])})"


class MappedColumn(ByteColumn):
    """A payload field whose bytes stay where they are: in the shard files' page cache.

    The worker verified each member through its own mapping and sends only (file, offset,
    size) per sample, with the identity of each file it mapped; the receiving process views
    the same pages through its mapping of that very file, so no byte is copied until the
    caller copies it (``bytes(col[i])``, pinning, or ``.buffer``, which gathers the column
    into one contiguous tensor on first use). A file replaced under its name since the worker
    verified it (a rename: ``shardio pack --force``) is refused with a StorageError naming it
    when a sample of it is first viewed, never viewed.

    Shard files are never modified in place (shardio publishes by rename and drops by
    unlink), which keeps such views valid.

    Attributes:
        identities: per path, the identity of the file the worker verified (None: the file
            mapped here, unchecked: a column made by hand).
    """

    def __init__(
        self,
        paths: Sequence[str],
        which: np.ndarray[Any, Any],
        starts: np.ndarray[Any, Any],
        sizes: np.ndarray[Any, Any],
        present: np.ndarray[Any, Any],
        *,
        identities: Sequence[FileIdentity | None] | None = None,
    ) -> None:
        self.paths = tuple(paths)
        self.identities = tuple(identities) if identities is not None else (None,) * len(self.paths)
        if len(self.identities) != len(self.paths):
            raise UsageError(
                f"MappedColumn: {len(self.identities)} identities for {len(self.paths)} paths"
            )
        self.which = which
        self.starts = starts
        self.sizes = sizes
        self.present = present
        self._gathered: torch.Tensor | None = None

    @property
    def offsets(self) -> np.ndarray[Any, Any]:  # type: ignore[override]
        """Offsets of the samples in the gathered layout (see ``buffer``)."""
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    @property
    def buffer(self) -> torch.Tensor:  # type: ignore[override]
        """The column gathered into one uint8 tensor (one copy, made on first use)."""
        if self._gathered is None:
            self._gathered = self._gather(pin=False)
        return self._gathered

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        at = self._present(i)
        if at is None:
            return None  # type: ignore[return-value]
        j = int(self.which[at])
        view = _RECEIVER_MAPS.view(self.paths[j], self.identities[j])
        start = int(self.starts[at])
        return view[start : start + int(self.sizes[at])]

    def __iter__(self) -> Iterator[memoryview]:
        return (self[i] for i in range(len(self)))

    def tensor(self, i: int) -> torch.Tensor:
        """Sample i's bytes as a uint8 tensor view of the mapping (no copy)."""
        view = self[i]
        return (
            torch.frombuffer(view, dtype=torch.uint8)
            if len(view)
            else torch.empty(0, dtype=torch.uint8)
        )

    def _gather(self, *, pin: bool) -> torch.Tensor:
        out = torch.empty(int(self.sizes.sum()), dtype=torch.uint8, pin_memory=pin)
        dst = memoryview(out.numpy())  # type: ignore[arg-type]
        pos = 0
        for i in range(len(self)):
            if self.present[i]:
                n = int(self.sizes[i])
                dst[pos : pos + n] = self[i]
                pos += n
        return out

    def pin_memory(self) -> ByteColumn:
        """Gather into pinned memory (called by the DataLoader's pin-memory thread)."""
        return ByteColumn(self._gather(pin=True), self.offsets, self.present)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_gathered"] = None
        return state

    def __repr__(self) -> str:
        return f"MappedColumn(n={len(self)}, bytes={int(self.sizes.sum())})"


def shared_uint8(nbytes: int, *, shm_dir: str = SHM_DIR) -> torch.Tensor:
    """A uint8 tensor whose storage is created in shared memory (no later move/copy).

    Raises:
        StorageError: shared memory has no room for it (:func:`shm_full_error`).
    """
    try:
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        error = shm_full_error(exc, max(nbytes, 1), what="a batch buffer", shm_dir=shm_dir)
        if error is None:
            raise
        raise error from exc
    return torch.tensor([], dtype=torch.uint8).set_(storage)[:nbytes]


def shm_full_error(
    exc: BaseException, nbytes: int, *, what: str, shm_dir: str = SHM_DIR
) -> StorageError | None:
    """The one-line error for torch's failure ``exc`` to make ``nbytes`` of shared memory, or
    None when ``exc`` is not about room.

    It names ``shm_dir`` with its size and free space and says what to do: a container's
    default /dev/shm (64 MiB under docker) holds a few batches of a few workers at most.
    """
    text = str(exc)
    full = (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or any(
        marker in text for marker in _NO_ROOM
    )
    if not full:
        return None
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        room = "size unknown"
    else:
        size = st.f_blocks * st.f_frsize
        room = f"{format_size(size)}, {format_size(st.f_bavail * st.f_frsize)} free"
    return StorageError(
        errno.ENOSPC,
        f"shared memory is full: {shm_dir} ({room}) has no room for {what} of "
        f"{format_size(nbytes)}; give the job more (docker run --shm-size=8g, or "
        "--tmpfs /dev/shm:size=8g; Kubernetes: an emptyDir of medium Memory on /dev/shm), or "
        "use fewer workers, a smaller batch_size or prefetch_factor, or "
        "transport='mmap' on node-local copies (num_workers=0 needs none)",
    )


def share_tensors(batch: Any, *, shm_dir: str = SHM_DIR) -> Any:
    """Move the tensors of a worker's batch into shared memory now, in the worker.

    torch would move them while pickling the batch, in its queue's feeder thread, where a
    full /dev/shm prints a traceback, drops the batch and leaves the training loop waiting.
    Here the failure is one StorageError the worker sends instead. Already shared tensors
    (the batch buffers) are left as they are.

    Raises:
        StorageError: shared memory has no room (:func:`shm_full_error`).
    """
    _share(batch, shm_dir, _MAX_DEPTH)
    return batch


def _share(value: Any, shm_dir: str, depth: int) -> None:
    if isinstance(value, torch.Tensor):
        if (
            value.device.type != "cpu"
            or value.layout != torch.strided  # sparse: torch shares its parts itself
            or value.is_shared()  # type: ignore[no-untyped-call]
        ):
            return
        try:
            value.share_memory_()  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            nbytes = value.untyped_storage().nbytes()
            error = shm_full_error(exc, nbytes, what="a batch tensor", shm_dir=shm_dir)
            if error is None:
                raise
            raise error from exc
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            _share(item, shm_dir, depth - 1)
    elif depth > 0 and isinstance(value, list | tuple):
        for item in value:
            _share(item, shm_dir, depth - 1)


def payload_rows(
    ds: ShardReader, samples: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(member rows, sample positions) of every member a batch of ``samples`` reads.

    In sample order, members in index order within a sample. The label shardio synthesised is
    in the index already (``cls``): it needs no read. The ring transport sizes its slots
    with this too, so a slot holds exactly what :func:`read_batch` reads.

    Args:
        ds: the dataset.
        samples: sample records (``ds.index.records(...)``: their shards checked).
    """
    counts = samples["n_members"].astype(np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    rows = np.repeat(samples["first_member"].astype(np.int64), counts) + (
        np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
    )
    positions = np.repeat(np.arange(len(samples), dtype=np.int64), counts)
    exts = ds.index.exts
    if ds.manifest.classes is not None and LABEL_EXT in exts:
        members = ds.index.members
        synthesised = (members["ext_id"][rows] == exts.index(LABEL_EXT)) & (
            members["path_length"][rows] == 0
        )
        rows, positions = rows[~synthesised], positions[~synthesised]
    return rows, positions


def _buffer_for(
    nbytes: int, *, shared: bool, allocate: Callable[[int], torch.Tensor] | None
) -> torch.Tensor:
    if allocate is None:
        return shared_uint8(nbytes) if shared else torch.empty(nbytes, dtype=torch.uint8)
    buffer = allocate(nbytes)
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.dtype != torch.uint8
        or tuple(buffer.shape) != (nbytes,)
        or buffer.device.type != "cpu"
        or not buffer.is_contiguous()
    ):
        raise UsageError(
            f"allocate({nbytes}) must return a contiguous uint8 CPU tensor of that size"
        )
    return buffer


def read_batch(
    ds: ShardReader,
    indices: Sequence[int],
    *,
    verify: bool = True,
    shared: bool = True,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Read samples into a batch dict: ``__key__`` list, ``cls`` tensor, ByteColumn per ext.

    Every member is read with ``preadv`` straight into one uint8 buffer, laid out field by
    field (fields by name, so each ByteColumn is contiguous), samples in order within a field.
    Where ``ds.read_strategy`` has more than one request in flight (the ``pfs`` strategy, map
    mode), the batch's members are read as coalesced requests, several runs of them at once
    on I/O threads (:func:`shardio.read.extents.read_members_planned`), each member checked
    once its bytes lie in the buffer; otherwise one pread per member, in this thread.

    Args:
        ds: the dataset.
        indices: the samples, in batch order.
        verify: check each member's xxh3-64 after reading it.
        shared: allocate the buffer in shared memory (a DataLoader worker's batch).
        allocate: ``allocate(nbytes)`` returns the contiguous uint8 tensor of exactly
            ``nbytes`` to read into (a slot of the ring transport); overrides ``shared``.

    Raises:
        ChecksumMismatchError: a member's bytes differ from the index.
        StorageError: a shard is missing or short.
        UsageError: ``allocate`` returned something else.
    """
    index = ds.index
    strategy = ds.read_strategy
    # From the page cache (the last batch came as fast, or this one's first member is
    # there), a batch gets neither advice (a call per member range that finds nothing to do;
    # on a network filesystem each a hand-off to the read deadline's thread) nor planned
    # reads (many requests in flight gain nothing there and cost their hand-offs: on the
    # MooseFS bed, warm, 0.88 against 0.54 CPU-s/GB read in turn).
    cached = len(indices) > 0 and ds.first_cached(indices)
    planned = strategy is not None and strategy.inflight > 1 and len(indices) > 1 and not cached
    if not cached and (not planned or ds.cache_root is not None):
        # Planned reads are already many requests in flight: advice first would only ask
        # for the same bytes again, a call per member range (on the MooseFS bed it cost a
        # third of a warm epoch's CPU and made a cold one 10% slower). Staged copies are
        # read one member at a time (read_members_planned leaves them to the reader): they
        # keep it.
        ds.advise(indices)
    samples = index.records(indices)  # their shards' records checked first
    exts = index.exts
    n = len(indices)
    rows, positions = payload_rows(ds, samples)
    ext_ids = index.members["ext_id"][rows].astype(np.int64)
    ext_rank = np.empty(len(exts), dtype=np.int64)
    ext_rank[sorted(range(len(exts)), key=exts.__getitem__)] = np.arange(len(exts))
    order = np.lexsort((positions, ext_rank[ext_ids]))
    rows, positions, ext_ids = rows[order], positions[order], ext_ids[order]
    sizes = index.members["size"][rows].astype(np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    buffer = _buffer_for(int(ends[-1]) if len(ends) else 0, shared=shared, allocate=allocate)
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    shards = samples["shard"].astype(np.int64)[positions]
    sample_ids = np.asarray(indices, dtype=np.int64)[positions]
    if planned and strategy is not None and len(rows) > 1:
        # A network or parallel filesystem: coalesced requests, several in flight, each
        # member hashed here once its bytes are in the buffer (shardio.read.extents).
        targets = [view[lo:hi] for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True)]
        read_members_planned(
            ds, rows.tolist(), shards.tolist(), sample_ids.tolist(), targets, strategy,
            verify=verify,
        )  # fmt: skip
    else:
        ds.read_members_into(
            rows,
            shards.tolist(),
            sample_ids.tolist(),
            [view[lo:hi] for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True)],
            verify=verify,
        )
    ds.metrics.add("samples", n)
    batch: dict[str, Any] = {"__key__": index.keys(np.asarray(indices, dtype=np.int64))}
    if ds.manifest.classes is not None:
        batch[LABEL_EXT] = torch.from_numpy(samples["label"].astype(np.int64))
    for e in sorted(set(ext_ids.tolist()), key=exts.__getitem__):
        mine = ext_ids == e
        present = np.zeros(n, dtype=bool)
        present[positions[mine]] = True
        # offsets[i + 1] is the end of the last present sample up to i (absent ones are empty).
        column_ends = np.zeros(n, dtype=np.int64)
        column_ends[positions[mine]] = ends[mine]
        first = int(starts[mine][0])
        offsets = np.empty(n + 1, dtype=np.int64)
        offsets[0] = first
        offsets[1:] = np.maximum.accumulate(np.maximum(column_ends, first))
        batch[exts[e]] = ByteColumn(buffer, offsets, present)
    return batch


def read_batch_mapped(
    ds: ShardReader, indices: Sequence[int], *, verify: bool = True
) -> dict[str, Any]:
    """Verify a batch in place and describe it as MappedColumns (no payload copied).

    The reads happen here (hashing touches every page, after ``advise`` started them all),
    so the receiving process finds the pages in the page cache.
    """
    index = ds.index
    ds.advise(indices)
    samples = index.records(indices)  # their shards' records checked first
    members = index.members
    exts = index.exts
    labelled = ds.manifest.classes is not None
    n = len(indices)
    paths: dict[str, int] = {}
    identities: dict[str, FileIdentity | None] = {}
    columns: dict[int, tuple[np.ndarray[Any, Any], ...]] = {}
    rows, positions = payload_rows(ds, samples)
    ext_ids = members["ext_id"][rows]
    for m, ext_id, pos in zip(rows.tolist(), ext_ids.tolist(), positions.tolist(), strict=True):
        shard = int(samples[pos]["shard"])
        path, view = ds.member_view(m, shard=shard, sample=int(indices[pos]), verify=verify)
        # The file this worker's map holds, just checked through: the receiver maps that one.
        identities.setdefault(path, ds.maps.identity(path))
        col = columns.get(ext_id)
        if col is None:
            col = columns[ext_id] = (
                np.zeros(n, np.int32),
                np.zeros(n, np.int64),
                np.zeros(n, np.int64),
                np.zeros(n, bool),
            )
        which, starts, sizes, present = col
        which[pos] = paths.setdefault(path, len(paths))
        starts[pos] = int(members[m]["offset"])
        sizes[pos] = len(view)
        present[pos] = True
    ds.metrics.add("samples", n)
    batch: dict[str, Any] = {"__key__": [index.key(int(i)) for i in indices]}
    if labelled:
        # An ndarray pickles inline; a tensor would cost a shared-memory segment per batch
        # (open, truncate, map), so the loader makes it a tensor on arrival.
        batch[LABEL_EXT] = samples["label"].astype(np.int64)
    ordered_paths = sorted(paths, key=paths.__getitem__)
    for ext_id in sorted(columns, key=lambda e: exts[e]):
        batch[exts[ext_id]] = MappedColumn(
            ordered_paths, *columns[ext_id], identities=[identities[p] for p in ordered_paths]
        )
    return batch
