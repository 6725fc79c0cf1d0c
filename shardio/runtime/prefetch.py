"""GPUPrefetcher: copy the next batches to the GPU in a background thread while training runs.

``GPUPrefetcher(loader, device="cuda:0", depth=2)`` wraps a :class:`ShardLoader` or any
iterable of batches (tensors, nested dicts/lists/tuples of tensors; other leaves such as the
list of ``__key__`` strings are carried along unchanged). A thread named ``shardio-prefetch``
takes batches from the loader and, on CUDA:

1. lays every CPU tensor of the batch out in one pinned host arena (64-byte aligned). The
   arenas are reused: ``depth + 1`` of them, taken in turn, each grown only when a batch
   needs more than it has (to 1.25 times that batch). Before an arena is written again the
   thread waits on the CUDA event recorded after its last host-to-device copy. A shardio
   :class:`~shardio.runtime.batch.ByteColumn` is gathered straight from its ring slot into
   the arena (one copy per column, no intermediate tensor), so the slot is free for the
   workers again before the batch reaches training;
2. copies the used part of the arena to the device in one ``non_blocking`` copy on a side
   CUDA stream and records an event after it;
3. queues the batch rebuilt from views of that device buffer: tensors keep their dtype and
   shape, a ByteColumn becomes a :class:`DeviceByteColumn`.

The consumer's ``__next__`` makes the current stream wait on the batch's event (no kernel
reads a batch before it arrived) and calls ``record_stream`` on its device buffer, so the
caching allocator does not reuse that memory while the training stream may still read it.
When the batch's copy has not landed yet (its event not reached), ``__next__`` waits for it
on the host, so the time counts in the step's wait and the stall fraction
(:meth:`GPUPrefetcher.metrics`); a stream wait alone would return at once and hide it.
Delivered tensors are views of one device buffer per batch: keeping any of them keeps the
batch's buffer.

Memory held (what ``tests/gpu/test_prefetch_gpu.py`` measures): device memory of at most
``depth + 2`` batches (``depth`` queued, the one the consumer holds and the one being
copied; more only while the caller keeps older batches), and pinned host memory of
``depth + 1`` arenas, each up to 1.25 x the largest batch's bytes, which torch's host
allocator rounds up to a power of two per block (an arena that grows returns its old block
to that allocator's cache, which keeps it). Do not also pass ``pin_memory=True`` to the
loader: its batches would be pinned once by the DataLoader and copied into a pinned arena
again (the prefetcher warns). The source article asks for a prefetch buffer of
``num_workers * batch_size`` samples ahead of the GPU: with :class:`ShardLoader` the workers
already hold ``num_workers * prefetch_factor`` batches read ahead in shared memory (the ring);
the prefetcher adds ``depth`` batches that are already on the device, so the transfer of the
next batch is hidden behind the current step, and the arenas are a transfer buffer, not more
read-ahead.

The loader's iterator is started, and its first batch taken, in the thread that calls
``iter(prefetcher)``, not in the prefetch thread: DataLoader workers are forked there, never
from a second thread of a process that has initialised CUDA (a fork from a thread other than
the one holding the process's locks can deadlock the child). A worker started again later
(after a stall, or an elastic change) is forked from the prefetch thread: use
``multiprocessing_context="forkserver"`` where that matters.

On the CPU (``device="cpu"``, or no CUDA) the same class runs the same thread and bounded
queue of ``depth`` batches and delivers the loader's batches as they are: ByteColumns are
passed through, not copied into reused buffers, because a batch the caller keeps must never
be overwritten, and a copy into fresh memory would cost what it saves. The ring transport
frees a slot once nothing views its batch; while a worker's slots are all held (the queue
holds up to ``depth`` batches more), its batches take fresh shared memory instead, counted
in ``loader.transport_stats``.

Resume stays exact: the thread records the loader's ``state_dict()`` right after taking
each batch, and :meth:`GPUPrefetcher.state_dict` returns the state recorded with the last
batch the consumer received, never counting batches still queued. A new pass after an
abandoned one rewinds the loader to that state first.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from shardio.errors import UsageError
from shardio.metrics.read import ReadMetrics
from shardio.metrics.snapshots import MetricsSnapshot, snapshot
from shardio.metrics.steps import StepTimer
from shardio.order.ranks import detect_ranks
from shardio.runtime.batch import ByteColumn, MappedColumn

__all__ = ["DeviceByteColumn", "GPUPrefetcher"]

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes: any dtype's view of the arena starts aligned
_GROWTH = 1.25  # an arena grows to this times the batch that did not fit
_GRAIN = 64 * 1024  # arena sizes are multiples of this
_POLL_S = 0.05  # how often a thread blocked on a full queue looks for close()


class DeviceByteColumn:
    """One payload field of a batch on the device: a uint8 tensor plus host offsets.

    ``col.tensor(i)`` is sample i's bytes as a device tensor (a view); ``col[i]`` is the same,
    or None where the sample lacks this field.

    Attributes:
        data: uint8 tensor on the device holding the column, samples in order.
        offsets: int64 ndarray (host) of n + 1 offsets into ``data``; ``offsets[0] == 0``.
        present: bool ndarray (host), False where a sample lacks this field.
    """

    def __init__(
        self, data: torch.Tensor, offsets: np.ndarray[Any, Any], present: np.ndarray[Any, Any]
    ) -> None:
        self.data = data
        self.offsets = offsets
        self.present = present

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def tensor(self, i: int) -> torch.Tensor:
        """Sample i's bytes as a uint8 view of ``data`` (on the device)."""
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __getitem__(self, i: int) -> torch.Tensor | None:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.tensor(i) if self.present[i % len(self)] else None

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"DeviceByteColumn(n={len(self)}, bytes={self.data.numel()}, {self.data.device})"


# -- host staging: a batch laid out in one reused arena ------------------------------------------
@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _ColumnSlot:
    offset: int
    nbytes: int
    offsets: np.ndarray[Any, Any]
    present: np.ndarray[Any, Any]


@dataclasses.dataclass(frozen=True)
class _Node:
    """A container holding at least one slot: rebuilt around the device views."""

    kind: type[Any]
    keys: tuple[Any, ...] | None  # a mapping's keys, else None
    items: tuple[Any, ...]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _plan(obj: Any, copies: list[tuple[int, Any]], cursor: int) -> tuple[Any, int]:
    """(template, new cursor): ``obj`` with its tensors and columns replaced by arena slots.

    ``copies`` gets (offset, source) for each slot. Unchanged parts are ``obj`` itself.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.layout != torch.strided:
            return obj, cursor  # already elsewhere, or not a plain dense tensor: carried
        copies.append((cursor, obj))
        end = cursor + obj.numel() * obj.element_size()
        return _TensorSlot(cursor, obj.dtype, tuple(obj.shape)), _aligned(end)
    if isinstance(obj, ByteColumn):
        nbytes = _column_nbytes(obj)
        offsets = np.asarray(obj.offsets, dtype=np.int64)
        copies.append((cursor, obj))
        slot = _ColumnSlot(cursor, nbytes, offsets - offsets[0], np.asarray(obj.present))
        return slot, _aligned(cursor + nbytes)
    if isinstance(obj, Mapping):
        keys = tuple(obj)
        items, cursor, changed = _plan_items([obj[k] for k in keys], copies, cursor)
        return (_Node(type(obj), keys, items) if changed else obj), cursor
    if isinstance(obj, (list, tuple)):
        items, cursor, changed = _plan_items(obj, copies, cursor)
        return (_Node(type(obj), None, items) if changed else obj), cursor
    return obj, cursor


def _plan_items(
    values: Iterable[Any], copies: list[tuple[int, Any]], cursor: int
) -> tuple[tuple[Any, ...], int, bool]:
    items = []
    changed = False
    for value in values:
        item, cursor = _plan(value, copies, cursor)
        changed = changed or item is not value
        items.append(item)
    return tuple(items), cursor, changed


def _column_nbytes(col: ByteColumn) -> int:
    if isinstance(col, MappedColumn):
        return int(col.sizes.sum())
    return int(col.offsets[-1]) - int(col.offsets[0])


def _copy_into(arena: torch.Tensor, offset: int, source: Any) -> None:
    """Copy one tensor or column into ``arena`` at ``offset`` (the only copy it gets)."""
    if isinstance(source, torch.Tensor):
        nbytes = source.numel() * source.element_size()
        arena[offset : offset + nbytes].view(source.dtype).view(source.shape).copy_(source)
    elif isinstance(source, MappedColumn):
        dst = arena.numpy()
        for i in range(len(source)):
            view = source[i]
            if view is not None and len(view):
                dst[offset : offset + len(view)] = np.frombuffer(view, dtype=np.uint8)
                offset += len(view)
    else:
        first, last = int(source.offsets[0]), int(source.offsets[-1])
        arena[offset : offset + last - first].copy_(source.buffer[first:last])


def _fill(template: Any, data: torch.Tensor) -> Any:
    """The batch ``template`` describes, its slots made views of ``data``."""
    if isinstance(template, _TensorSlot):
        nbytes = int(np.prod(template.shape, dtype=np.int64)) * template.dtype.itemsize
        view = data[template.offset : template.offset + nbytes]
        return view.view(template.dtype).view(template.shape)
    if isinstance(template, _ColumnSlot):
        view = data[template.offset : template.offset + template.nbytes]
        return DeviceByteColumn(view, template.offsets, template.present)
    if isinstance(template, _Node):
        items = [_fill(item, data) for item in template.items]
        if template.keys is not None:
            pairs = dict(zip(template.keys, items, strict=True))
            try:
                return template.kind(pairs)
            except TypeError:  # a mapping type that cannot be built from a dict
                return pairs
        if hasattr(template.kind, "_fields"):  # a namedtuple
            return template.kind(*items)
        return template.kind(items)
    return template


@dataclasses.dataclass
class _Arena:
    buffer: torch.Tensor  # uint8, pinned on CUDA
    event: Any = None  # torch.cuda.Event recorded after the last copy out of it


class _HostStaging:
    """``sets`` reused host arenas, taken in turn; a batch is laid out in one of them.

    Args:
        sets: arenas (depth + 1: the copy of one may be in flight while the others fill).
        pin: allocate pinned memory (needs CUDA).
    """

    def __init__(self, *, sets: int, pin: bool) -> None:
        self.pin = pin
        self.arenas = [_Arena(torch.empty(0, dtype=torch.uint8)) for _ in range(sets)]
        self.allocations = 0
        self._turn = 0

    def stage(self, batch: Any) -> tuple[Any, _Arena, int]:
        """(template, arena, bytes used): ``batch`` copied into the next arena."""
        copies: list[tuple[int, Any]] = []
        template, nbytes = _plan(batch, copies, 0)
        arena = self.arenas[self._turn]
        self._turn = (self._turn + 1) % len(self.arenas)
        if arena.event is not None:
            arena.event.synchronize()  # its last host-to-device copy has finished
            arena.event = None
        if arena.buffer.numel() < nbytes:
            size = -(-int(nbytes * _GROWTH) // _GRAIN) * _GRAIN
            arena.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        for offset, source in copies:
            _copy_into(arena.buffer, offset, source)
        return template, arena, nbytes

    def stats(self) -> dict[str, int]:
        return {
            "arenas": len(self.arenas),
            "allocations": self.allocations,
            "bytes": sum(a.buffer.numel() for a in self.arenas),
        }


# -- the prefetcher ------------------------------------------------------------------------------
@dataclasses.dataclass
class _Item:
    batch: Any
    state: dict[str, Any] | None
    data: torch.Tensor | None = None  # the device buffer the batch views (CUDA)
    event: Any = None  # recorded after its copy (CUDA)


@dataclasses.dataclass
class _Failure:
    error: BaseException


_END = object()


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put ``item`` unless ``stop`` is set first; never blocks past a close()."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
        except queue.Full:
            continue
        return True
    return False


def _samples_in(batch: Any) -> int:
    """Samples in a batch: its keys, else the first dimension of its first tensor."""
    if isinstance(batch, Mapping):
        keys = batch.get("__key__")
        if isinstance(keys, list):
            return len(keys)
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for leaf in batch:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                return int(leaf.shape[0])
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.dim() > 0 else 0


def _resolve_device(device: str | torch.device) -> torch.device:
    """The device of ``device``: "auto" is this local rank's GPU (the CPU without CUDA);
    a CUDA device asked for by name must exist."""
    if device == "auto":
        if not torch.cuda.is_available():
            logger.info("GPUPrefetcher: no CUDA device; batches stay on the CPU")
            return torch.device("cpu")
        # bind.sh narrows CUDA_VISIBLE_DEVICES to the rank's GPU (then index 0); otherwise
        # the local ranks of a node take the GPUs in turn.
        return torch.device("cuda", detect_ranks().local_rank % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"invalid device {device!r}: {exc}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UsageError(f"GPUPrefetcher copies to cuda or cpu, not {dev.type!r}")
    if not torch.cuda.is_available():
        raise UsageError(
            f"device {str(device)!r}: CUDA is not available to this process (no GPU, a CPU "
            "build of torch, or CUDA_VISIBLE_DEVICES empty); pass device='auto' to fall back "
            "to the CPU, or device='cpu'"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and not 0 <= dev.index < count:
        raise UsageError(f"device {str(device)!r}: this process sees {count} CUDA device(s)")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def await_copy(event: Any) -> int:
    """Wait on the host until ``event`` (recorded after a batch's copy) is reached; return
    the nanoseconds waited (0 when the copy had landed)."""
    if event.query():
        return 0
    began = time.perf_counter_ns()
    event.synchronize()
    return time.perf_counter_ns() - began


def _double_pinning(loader: Any, device: torch.device) -> str | None:
    """Why the loader's batches would be pinned twice, or None."""
    if device.type != "cuda" or getattr(loader, "pin_memory", False) is not True:
        return None
    return (
        "GPUPrefetcher: the loader pins its batches (pin_memory=True) and the prefetcher "
        "copies them into pinned arenas again; pass pin_memory=False to the loader"
    )


class GPUPrefetcher:
    """Iterate ``loader``'s batches with the next ``depth`` already copied to ``device``.

    Args:
        loader: a :class:`ShardLoader` (``ds.loader(...)``) or any iterable of batches.
        device: "auto" (default): this local rank's GPU (``LOCAL_RANK`` modulo the GPUs this
            process sees, index 0 when ``bind.sh`` narrowed ``CUDA_VISIBLE_DEVICES`` to one),
            or the CPU when CUDA is not available; a CUDA device ("cuda:1"), which must
            exist (no silent fallback); or "cpu".
        depth: batches prepared ahead (an int >= 1).

    Iterating starts a pass: ``iter(loader)`` anew and its first batch taken in the calling
    thread (so the loader's workers are forked there), the rest in a thread named
    ``shardio-prefetch``; a second ``iter()`` stops the first. Call :meth:`close` (or use
    ``with``) when stopping early. Errors raised by the loader reach the consumer as the same
    exception object, after every batch that came before it.

    Attributes:
        loader: the wrapped loader.
        device: where batches are delivered.
        depth: batches prepared ahead.
        stream: the side CUDA stream of the copies (None on the CPU).
        steps: step time and the wait for each batch, measured where the training loop
            takes it from the prefetcher (see :meth:`metrics`).
    """

    def __init__(
        self, loader: Iterable[Any], device: str | torch.device = "auto", depth: int = 2
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise UsageError(f"depth must be an int >= 1, got {depth!r}")
        self.loader = loader
        self.device = _resolve_device(device)
        self.depth = depth
        problem = _double_pinning(loader, self.device)
        if problem is not None:
            warnings.warn(problem, stacklevel=2)
        self.stream: Any = None
        self._staging: _HostStaging | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._state: dict[str, Any] | None = None  # with the last batch delivered
        self._pulled_state: dict[str, Any] | None = None  # with the last batch taken
        self.steps = StepTimer()

    # -- passes ----------------------------------------------------------------------------------
    def __iter__(self) -> GPUPrefetcher:
        self._stop_pass()
        self._rewind()
        self._state = self._pulled_state = self._loader_state()
        if self.device.type == "cuda" and self._staging is None:
            self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._staging = _HostStaging(sets=self.depth + 1, pin=True)
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        it = iter(self.loader)
        first = self._first(it)  # here: the loader's workers are forked by this thread
        self._thread = threading.Thread(
            target=self._run,
            args=(it, self._queue, self._stop, first),
            name="shardio-prefetch",
            daemon=True,  # a forgotten close() must not keep the interpreter from exiting
        )
        self._thread.start()
        self.steps.start()
        return self

    def metrics(self) -> MetricsSnapshot:
        """The data path as the training loop sees it through the prefetcher.

        Read figures are the wrapped :class:`ShardLoader`'s (none for another iterable);
        step time, wait and stall fraction are measured at :meth:`__next__`, so a batch
        whose copy to the device was not finished counts as a stall.
        """
        dataset = getattr(self.loader, "dataset", None)
        read_metrics = getattr(dataset, "read_metrics", None)
        ranks = getattr(dataset, "ranks", None)
        where = ranks() if callable(ranks) else None
        return snapshot(
            read_metrics() if callable(read_metrics) else ReadMetrics(),
            self.steps,
            rank=where.rank if where is not None else 0,
            world_size=where.world_size if where is not None else 1,
            transport=getattr(self.loader, "transport_stats", None),
        )

    def __next__(self) -> Any:
        asked = time.perf_counter_ns()
        batch = self._next()
        now = time.perf_counter_ns()
        self.steps.batch(wait_ns=now - asked, samples=_samples_in(batch), now_ns=now)
        return batch

    def _next(self) -> Any:
        thread = self._thread
        if thread is None:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not thread.is_alive() and self._queue.empty():
                    self._end_pass()
                    raise StopIteration from None
        if item is _END:
            self._end_pass()
            raise StopIteration
        if isinstance(item, _Failure):
            self._end_pass()
            raise item.error
        self._state = item.state
        if item.event is not None and item.data is not None:
            await_copy(item.event)  # a copy not landed yet is waited for here: a stall
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.event)
            item.data.record_stream(current)
        return item.batch

    def _first(self, it: Iterator[Any]) -> Any:
        """The pass's first batch, taken in the calling thread: a batch, _END or _Failure."""
        try:
            batch = next(it)
        except StopIteration:
            return _END
        except (KeyboardInterrupt, SystemExit):
            close = getattr(it, "close", None)
            if close is not None:
                close()  # its workers shut down; Ctrl-C is not held back to the next()
            raise
        except BaseException as exc:  # delivered at the first next(), like any other
            return _Failure(exc)
        self._pulled_state = self._loader_state()
        return batch

    def _run(
        self, it: Iterator[Any], q: queue.Queue[Any], stop: threading.Event, first: Any = _END
    ) -> None:
        pending = [first]
        try:
            while not stop.is_set():
                if pending:
                    batch = pending.pop()
                    if batch is _END or isinstance(batch, _Failure):
                        _put(q, batch, stop)
                        return
                    state = self._pulled_state
                else:
                    try:
                        batch = next(it)
                    except StopIteration:
                        _put(q, _END, stop)
                        return
                    state = self._pulled_state = self._loader_state()
                item = self._transfer(batch, state)
                del batch  # the loader's slot is free once nothing views it
                if not _put(q, item, stop):
                    return
        except BaseException as exc:  # handed to the consumer with its type intact
            _put(q, _Failure(exc), stop)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()  # a generator's finally runs now: its workers shut down
                except Exception:
                    logger.exception("GPUPrefetcher: closing the loader's iterator failed")

    def _transfer(self, batch: Any, state: dict[str, Any] | None) -> _Item:
        if self._staging is None:
            return _Item(batch, state)
        template, arena, nbytes = self._staging.stage(batch)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            data = arena.buffer[:nbytes].to(self.device, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        arena.event = event
        return _Item(_fill(template, data), state, data, event)

    def _stop_pass(self) -> None:
        """Stop the thread (joined) and drop the batches it queued."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()  # it sees the stop within _POLL_S once the loader returns a batch
        self._drain()

    def _end_pass(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """Stop the thread (joined), drop queued batches, and close the loader (idempotent)."""
        self._stop_pass()
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> GPUPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError without one, as len()

    @property
    def staging_stats(self) -> dict[str, int]:
        """The pinned staging arenas: ``arenas``, ``allocations`` made, ``bytes`` held."""
        if self._staging is None:
            return {"arenas": 0, "allocations": 0, "bytes": 0}
        return self._staging.stats()

    # -- resumable state -------------------------------------------------------------------------
    @property
    def dataset_id(self) -> str | None:
        """The id of the dataset the wrapped loader reads (its ``dataset_id``; None when it
        has none): what a checkpoint of the position records, as for the loader itself, so
        that the position resumes no other dataset."""
        found = getattr(self.loader, "dataset_id", None)
        return found if isinstance(found, str) else None

    def _loader_state(self) -> dict[str, Any] | None:
        state_dict = getattr(self.loader, "state_dict", None)
        return state_dict() if state_dict is not None else None

    def _rewind(self) -> None:
        """After an abandoned pass, move the loader back to the last batch delivered.

        Only when nobody moved the loader since (set_epoch, load_state_dict on it).
        """
        state, pulled = self._state, self._pulled_state
        if state is None or pulled is None or state == pulled:
            return
        if self._loader_state() == pulled:
            self.loader.load_state_dict(state)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """The loader's state as of the last batch delivered to the consumer.

        Raises:
            UsageError: the loader has no ``state_dict``.
        """
        if getattr(self.loader, "state_dict", None) is None:
            raise UsageError(f"{type(self.loader).__name__} has no state_dict: cannot resume")
        if self._state is None:
            return self._loader_state() or {}
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stop the current pass and resume the loader from :meth:`state_dict`.

        Raises:
            UsageError: the loader has no ``load_state_dict``.
        """
        load = getattr(self.loader, "load_state_dict", None)
        if load is None:
            raise UsageError(f"{type(self.loader).__name__} has no load_state_dict")
        self._stop_pass()
        load(state)
        self._state = self._pulled_state = None

    def set_epoch(self, epoch: int) -> None:
        """Stop the current pass and select the loader's epoch (``loader.set_epoch``)."""
        set_epoch = getattr(self.loader, "set_epoch", None)
        if set_epoch is None:
            raise UsageError(f"{type(self.loader).__name__} has no set_epoch")
        self._stop_pass()
        set_epoch(epoch)
        self._state = self._pulled_state = None
