"""The ring transport: verified batches cross from DataLoader workers in reused shared memory.

A fresh shared-memory segment per batch (``transport="shm"``) is allocated and faulted in,
page by page, for every batch (well under half the ring's throughput here); mapping the
shard files in the training process (``transport="mmap"``) turns a truncated file or an EIO
while paging in into SIGBUS there. The ring avoids both. It is allocated once per loader
iteration, in the training process, before the DataLoader starts its workers: per worker,
``slots`` slots of ``slot_bytes`` bytes each, sized to the largest batch of the rank's epoch.
A worker claims a free slot of its own row, reads and verifies its batch into it
(``read_batch(allocate=...)``) and sends only a :class:`RingBatch`: where the batch lies, its
offsets, keys and labels. The training process checks the message, builds
:class:`ByteColumn` objects over a view of the slot, and frees the slot when the last object
viewing it is gone. A worker never waits for a slot: when all of its slots are held (the
caller keeps batches) or a batch does not fit, that batch gets a fresh shared segment, as
with ``transport="shm"``.

Slot states live in shared memory too: only worker w marks a slot of row w busy, and only
the training process marks it free again, so no lock is needed.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import secrets
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from shardio.errors import ShardioError, StorageError
from shardio.format.spec import LABEL_EXT
from shardio.read.deadline import AbandonedBufferError, into_fresh_buffers
from shardio.read.reader import ShardReader
from shardio.runtime.batch import SHM_DIR, ByteColumn, payload_rows, read_batch, shared_uint8
from shardio.runtime.shmroom import ring_shortfall
from shardio.runtime.wire import EVENTS_KEY, METRICS_KEY, SOURCE_KEY, WorkerFailure

__all__ = ["BatchRing", "RingBatch", "max_batch_bytes", "sample_bytes"]

logger = logging.getLogger(__name__)

FREE, BUSY = 0, 1
_COUNT_RING, _COUNT_FALLBACK = 0, 1

# The rings of this process by token, so that the DataLoader's pin-memory thread, which
# sees only a message, can build the batch. Weak: a ring lives as long as its iteration.
_RINGS: weakref.WeakValueDictionary[int, BatchRing] = weakref.WeakValueDictionary()


# A batch of a lazily ordered epoch (too many positions to scan) gets this many times the
# mean sample's payload; a larger batch takes a fresh segment (the ring's fallback).
_SLOT_HEADROOM = 2.0


def sample_bytes(ds: ShardReader, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The payload :func:`read_batch` reads for each sample of ``positions`` (int64; the
    records come checked, ``index.records``, so a damaged index sizes nothing)."""
    rows, where = payload_rows(ds, ds.index.records(positions))
    sizes = ds.index.members["size"][rows].astype(np.int64)
    return np.bincount(where, weights=sizes, minlength=len(positions)).astype(np.int64)


def estimated_batch_bytes(ds: ShardReader, n: int, batch_size: int) -> int:
    """A batch's payload estimated from ``ds``'s mean sample (a lazily ordered epoch of
    ``n`` samples: too many to scan); a larger batch takes a fresh segment."""
    manifest = ds.manifest
    mean = manifest.data_bytes / max(1, manifest.num_samples)
    return int(mean * min(n, batch_size) * _SLOT_HEADROOM) + 1


def max_batch_bytes(ds: ShardReader, positions: Any, batch_size: int) -> int:
    """The largest payload among the batches ``positions`` makes, cut every ``batch_size``.

    The payload is what :func:`read_batch` reads (:func:`payload_rows`). For a lazy
    :class:`~shardio.order.RankStream` (an epoch too large to scan), an estimate from the
    dataset's mean sample size instead.

    Args:
        ds: the dataset.
        positions: sample indices in batch order (the rank's epoch, as the loader cuts it):
            an array, or a RankStream.
        batch_size: samples per batch; the last batch may be shorter.
    """
    n = len(positions)
    if n == 0:
        return 0
    if not isinstance(positions, np.ndarray):
        return estimated_batch_bytes(ds, n, batch_size)
    return largest_batch(sample_bytes(ds, positions), batch_size)


def largest_batch(sizes: np.ndarray[Any, Any], batch_size: int) -> int:
    """The largest sum of ``sizes`` over consecutive runs of ``batch_size`` (0: none)."""
    if not len(sizes):
        return 0
    return int(np.add.reduceat(sizes, np.arange(0, len(sizes), batch_size)).max())


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingBatch:
    """What a worker sends for a batch it read into a ring slot: no payload, only where.

    Attributes:
        ring: the token of the ring (one loader iteration).
        worker: the worker, whose row of slots holds the batch.
        slot: the slot within the row.
        nbytes: payload bytes, from the slot's start.
        keys: the sample keys.
        labels: int64 labels, or None for an unlabelled dataset.
        columns: (extension, offsets, present) per payload field, as in :class:`ByteColumn`
            (offsets into the slot).
        extras: the batch's other entries (recovery events, read metrics), passed on as
            they are.
    """

    ring: int
    worker: int
    slot: int
    nbytes: int
    keys: list[str]
    labels: np.ndarray[Any, Any] | None
    columns: tuple[tuple[str, np.ndarray[Any, Any], np.ndarray[Any, Any]], ...]
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    def pin_memory(self) -> dict[str, Any] | WorkerFailure:
        """The batch copied to pinned memory (called by the DataLoader's pin-memory thread).

        The slot is free again as soon as the copy is made.
        """
        ring = _RINGS.get(self.ring)
        try:
            if ring is None:
                raise _rejected("its loader iteration has ended")
            view = ring.slot_view(self)
        except ShardioError as exc:
            return WorkerFailure(exc)
        batch = _assemble(self, view.pin_memory())
        if isinstance(batch.get(LABEL_EXT), torch.Tensor):
            batch[LABEL_EXT] = batch[LABEL_EXT].pin_memory()
        return batch


def _rejected(problem: str) -> StorageError:
    return StorageError(errno.EPROTO, f"ring transport: batch message rejected: {problem}")


def _assemble(message: RingBatch, buffer: torch.Tensor) -> dict[str, Any]:
    batch: dict[str, Any] = {"__key__": list(message.keys)}
    if message.labels is not None:
        batch[LABEL_EXT] = torch.from_numpy(message.labels)
    for ext, offsets, present in message.columns:
        batch[ext] = ByteColumn(buffer, offsets, present)
    batch.update(message.extras)
    return batch


def _free_slot(
    state: np.ndarray[Any, Any], live: np.ndarray[Any, Any], worker: int, slot: int
) -> None:
    live[worker, slot] = False
    state[worker, slot] = FREE


class BatchRing:
    """Reused shared-memory slots for one loader iteration: per worker, ``slots`` slots.

    Made in the training process before the workers start (:meth:`allocate`); a worker gets
    it with the dataset, pickled to spawn/forkserver workers (the tensors travel as shared
    memory handles) or inherited over fork.

    Args:
        workers: DataLoader workers; worker w uses row w.
        slots: slots per worker.
        slot_bytes: bytes per slot: the largest batch payload of the iteration.

    Attributes:
        counts: int64 tensor (workers, 2) in shared memory: batches each worker sent through
            a slot and through a fresh segment (the fallback).
    """

    def __init__(self, *, workers: int, slots: int, slot_bytes: int) -> None:
        self.token = secrets.randbits(62)
        self.workers = workers
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.buffer = shared_uint8(workers * slots * slot_bytes)
        self.state = shared_uint8(workers * slots).zero_()
        self.counts = shared_uint8(workers * 2 * 8).view(torch.int64).view(workers, 2).zero_()
        self._bind()
        _RINGS[self.token] = self

    @classmethod
    def allocate(
        cls,
        *,
        workers: int,
        slots: int,
        slot_bytes: int,
        shm_dir: str = SHM_DIR,
        quiet: bool = False,
    ) -> BatchRing | None:
        """A ring, or None (with a warning) when shared memory has no room for it.

        Without a ring every batch takes a fresh segment, as with ``transport="shm"``; where
        even that finds no room, the worker's batch fails with one StorageError naming
        ``shm_dir`` (:func:`~shardio.runtime.batch.shm_full_error`).

        Args:
            workers, slots, slot_bytes: as in the constructor.
            shm_dir: where shared memory lives (whose free space bounds the ring): torch's
                shm_open puts it in /dev/shm on Linux.
            quiet: say it at debug level only (a loader warns once, not every epoch).
        """
        level = logging.DEBUG if quiet else logging.WARNING
        short = ring_shortfall(workers=workers, slots=slots, slot_bytes=slot_bytes, shm_dir=shm_dir)
        if short is not None:
            logger.log(level, "%s", short)
            return None
        try:
            return cls(workers=workers, slots=slots, slot_bytes=slot_bytes)
        except (RuntimeError, StorageError) as exc:  # torch's allocation failed (it fallocates)
            logger.log(level, "ring transport: %s: each batch takes a fresh segment instead", exc)
            return None

    def _bind(self) -> None:
        # numpy views of the shared tensors; rebuilt after unpickling, never pickled (a
        # pickled ndarray would arrive as a private copy).
        self._bytes = self.buffer.numpy()
        self._state = self.state.numpy().reshape(self.workers, self.slots)
        self._counts = self.counts.numpy()
        self._live = np.zeros((self.workers, self.slots), dtype=bool)  # delivered, viewed

    def __getstate__(self) -> dict[str, Any]:
        keep = ("token", "workers", "slots", "slot_bytes", "buffer", "state", "counts")
        return {key: self.__dict__[key] for key in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def stats(self) -> dict[str, int]:
        """Batches sent so far through a slot (``ring``) and a fresh segment (``fallback``)."""
        return {
            "ring": int(self._counts[:, _COUNT_RING].sum()),
            "fallback": int(self._counts[:, _COUNT_FALLBACK].sum()),
        }

    def _start(self, worker: int, slot: int) -> int:
        return (worker * self.slots + slot) * self.slot_bytes

    # -- worker side ---------------------------------------------------------------------------
    def _claim(self, worker: int) -> int | None:
        if not 0 <= worker < self.workers:
            return None
        row = self._state[worker]
        free = np.flatnonzero(row == FREE)
        if len(free) == 0:
            return None
        slot = int(free[0])
        row[slot] = BUSY
        return slot

    def read(
        self, ds: ShardReader, indices: Sequence[int], *, worker: int, verify: bool = True
    ) -> dict[str, Any]:
        """Read a batch in worker ``worker``: into a free slot of its row, else a fresh segment.

        :meth:`describe` then makes the message to send.

        Raises:
            ChecksumMismatchError: a member's bytes differ from the index.
            StorageError: a shard is missing or short.
        """
        return into_fresh_buffers(
            lambda: self.fill(
                lambda allocate: read_batch(ds, indices, verify=verify, allocate=allocate),
                worker=worker,
            )
        )

    def fill(
        self, build: Callable[[Callable[[int], torch.Tensor]], dict[str, Any]], *, worker: int
    ) -> dict[str, Any]:
        """The batch ``build(allocate)`` makes in worker ``worker``, its payload in what
        ``allocate(nbytes)`` gives: a free slot of the worker's row, else a fresh segment.
        A slot claimed is freed again when ``build`` raises, except for an
        :class:`~shardio.read.deadline.AbandonedBufferError`: a stalled read may still write
        the slot, so it stays claimed for the rest of the run (never handed out again)."""
        claimed: list[int] = []

        def allocate(nbytes: int) -> torch.Tensor:
            slot = self._claim(worker) if 0 < nbytes <= self.slot_bytes else None
            if slot is None:
                return shared_uint8(nbytes)
            claimed.append(slot)
            start = self._start(worker, slot)
            return self.buffer[start : start + nbytes]

        try:
            return build(allocate)
        except AbandonedBufferError:
            raise  # its slots stay BUSY: an abandoned read may still write them
        except BaseException:
            for slot in claimed:
                self._state[worker, slot] = FREE
            raise

    def describe(self, batch: dict[str, Any], *, worker: int) -> RingBatch | dict[str, Any]:
        """What worker ``worker`` sends for ``batch`` (from :meth:`read`).

        Returns:
            A :class:`RingBatch` when the payload lies in a slot of the worker's row, else
            (the fallback) ``batch`` itself, its labels made an ndarray (inline in the
            message: a tensor would cost one more shared segment).
        """
        for key in (LABEL_EXT, SOURCE_KEY):  # inline in the message: no segment of their own
            if isinstance(batch.get(key), torch.Tensor):
                batch[key] = batch[key].numpy()
        labels = batch.get(LABEL_EXT)
        columns = {ext: col for ext, col in batch.items() if isinstance(col, ByteColumn)}
        where = self._slot_of(next(iter(columns.values())).buffer) if columns else None
        if where is None or where[0] != worker:
            if 0 <= worker < self.workers:
                self._counts[worker, _COUNT_FALLBACK] += 1
            return batch
        self._counts[worker, _COUNT_RING] += 1
        skip = {"__key__", LABEL_EXT, *columns}
        return RingBatch(
            ring=self.token,
            worker=worker,
            slot=where[1],
            nbytes=int(next(iter(columns.values())).buffer.numel()),
            keys=batch["__key__"],
            labels=labels,
            columns=tuple((ext, col.offsets, col.present) for ext, col in columns.items()),
            extras={key: value for key, value in batch.items() if key not in skip},
        )

    def _slot_of(self, buffer: torch.Tensor) -> tuple[int, int] | None:
        """(worker, slot) whose start ``buffer`` begins at, or None (a fresh segment)."""
        offset = buffer.data_ptr() - self.buffer.data_ptr()
        if self.slot_bytes == 0 or not 0 <= offset < self.buffer.numel():
            return None
        index, rest = divmod(offset, self.slot_bytes)
        return (index // self.slots, index % self.slots) if rest == 0 else None

    # -- training-process side -----------------------------------------------------------------
    def receive(self, message: RingBatch) -> dict[str, Any]:
        """The batch ``message`` describes: :class:`ByteColumn` objects viewing its slot.

        The slot is free again once nothing views it: no column, tensor, memoryview or
        array taken from the batch.

        Raises:
            StorageError: the message is not one this ring's workers can have sent.
        """
        return _assemble(message, self.slot_view(message))

    def slot_view(self, message: RingBatch) -> torch.Tensor:
        """A uint8 tensor viewing the payload of ``message``; the slot is freed with it.

        Raises:
            StorageError: the message is not one this ring's workers can have sent.
        """
        problem = self._problem(message)
        if problem is not None:
            raise _rejected(problem)
        worker, slot = message.worker, message.slot
        start = self._start(worker, slot)
        # A fresh array over a memoryview (not over an ndarray): numpy collapses chains of
        # views only down to such an array, so every tensor, array or memoryview taken from
        # this batch keeps ``owner`` alive, and the slot is freed when the last one is gone.
        ring = memoryview(self._bytes)  # type: ignore[arg-type]
        owner = np.frombuffer(ring[start : start + message.nbytes], np.uint8)
        self._live[worker, slot] = True
        weakref.finalize(owner, _free_slot, self._state, self._live, worker, slot).atexit = False
        return torch.from_numpy(owner)

    def _problem(self, message: object) -> str | None:
        """Why ``message`` cannot be a batch of this ring, or None."""
        if not isinstance(message, RingBatch):
            return f"a {type(message).__name__}, not a RingBatch"
        if message.ring != self.token:
            return "it belongs to another loader iteration"
        if not (_is_int(message.worker) and 0 <= message.worker < self.workers):
            return f"worker {message.worker!r} out of range"
        if not (_is_int(message.slot) and 0 <= message.slot < self.slots):
            return f"slot {message.slot!r} out of range"
        if self._state[message.worker, message.slot] != BUSY:
            return f"slot {message.slot} of worker {message.worker} was not claimed"
        if self._live[message.worker, message.slot]:
            return f"slot {message.slot} of worker {message.worker} is still in use"
        if not (_is_int(message.nbytes) and 0 <= message.nbytes <= self.slot_bytes):
            return f"{message.nbytes!r} bytes do not fit a slot of {self.slot_bytes}"
        n = len(message.keys) if isinstance(message.keys, list) else -1
        if n < 0 or not all(isinstance(k, str) for k in message.keys):
            return "keys are not a list of str"
        if message.labels is not None and not _is_array(message.labels, np.int64, n):
            return "labels are not int64 of one per sample"
        problem = _columns_problem(message.columns, n, message.nbytes)
        if problem is None and not (
            isinstance(message.extras, dict)
            and set(message.extras) <= {EVENTS_KEY, METRICS_KEY, SOURCE_KEY}
        ):
            problem = "extras hold other entries than recovery events and read metrics"
        sources = message.extras.get(SOURCE_KEY) if problem is None else None
        if sources is not None and not _is_array(sources, np.int64, n):
            problem = "sources are not int64 of one per sample"
        return problem


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_array(value: object, dtype: type[np.generic], length: int) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == (length,)


def _columns_problem(columns: object, n: int, nbytes: int) -> str | None:
    if not isinstance(columns, tuple):
        return "columns are not a tuple"
    seen = {"__key__", LABEL_EXT}
    for column in columns:
        if not (isinstance(column, tuple) and len(column) == 3):
            return "a column is not (ext, offsets, present)"
        ext, offsets, present = column
        if not isinstance(ext, str) or ext in seen:
            return f"column name {ext!r} is not a new extension"
        seen.add(ext)
        if not (_is_array(offsets, np.int64, n + 1) and _is_array(present, np.bool_, n)):
            return f"column {ext!r}: offsets or present of the wrong type or length"
        sizes = np.diff(offsets)
        if offsets[0] < 0 or offsets[-1] > nbytes or (sizes < 0).any():
            return f"column {ext!r}: offsets not ascending inside the {nbytes} bytes"
        if (sizes[~present] != 0).any():
            return f"column {ext!r}: an absent sample has bytes"
    return None
