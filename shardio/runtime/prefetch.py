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
   shape, a ByteColumn becomes a
   :class:`~shardio.runtime.gpucopy.DeviceByteColumn` (:mod:`shardio.runtime.gpucopy` copies).

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

import torch

from shardio.errors import UsageError
from shardio.metrics.read import ReadMetrics
from shardio.metrics.snapshots import MetricsSnapshot, snapshot
from shardio.metrics.steps import StepTimer
from shardio.runtime.gpucopy import (
    HostStaging,
    await_copy,
    double_pinning,
    fill_views,
    resolve_device,
)

__all__ = ["GPUPrefetcher"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a thread blocked on a full queue looks for close()


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
        self.device = resolve_device(device)
        self.depth = depth
        problem = double_pinning(loader, self.device)
        if problem is not None:
            warnings.warn(problem, stacklevel=2)
        self.stream: Any = None
        self._staging: HostStaging | None = None
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
            self._staging = HostStaging(sets=self.depth + 1, pin=True)
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
        return _Item(fill_views(template, data), state, data, event)

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
        self._stop_and_call("load_state_dict", state)

    def set_epoch(self, epoch: int) -> None:
        """Stop the current pass and select the loader's epoch (``loader.set_epoch``)."""
        self._stop_and_call("set_epoch", epoch)

    def _stop_and_call(self, name: str, arg: Any) -> None:
        """Stop the current pass and call the loader's ``name(arg)`` (which moves it: the
        states recorded are void).

        Raises:
            UsageError: the loader has no ``name``.
        """
        method = getattr(self.loader, name, None)
        if method is None:
            raise UsageError(f"{type(self.loader).__name__} has no {name}")
        self._stop_pass()
        method(arg)
        self._state = self._pulled_state = None
