"""The DataLoader workers of a ShardLoader: the DataLoader of a run started, and the
persistent workers kept between epochs.

:func:`make_dataloader` builds the DataLoader of one run (the sampler of its positions, the
workers' pinning and stall watch, the source's plan taken before they start);
:class:`KeptWorkers` are a run's persistent workers parked between epochs and resumed
through the shared board; :class:`WorkerKeeper` holds them for the loader and stops them.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from shardio._pool import short_socket_dir
from shardio.runtime import internals
from shardio.runtime.mptemp import ensure_short as ensure_short_mp_tempdir
from shardio.runtime.placement import pinning_for, rank_placement
from shardio.runtime.plan import RunPlan
from shardio.runtime.protocol import ReadSource
from shardio.runtime.reaping import stop_workers
from shardio.runtime.stallwatch import StallWatch
from shardio.runtime.transport import BatchRing
from shardio.topology.model import Placement, Topology

__all__ = [
    "PREFETCH",
    "KeptWorkers",
    "PositionSampler",
    "WorkerKeeper",
    "make_dataloader",
    "start_batches",
]

PREFETCH = 4  # batches each worker prepares ahead (the DataLoader's prefetch_factor)


def _identity(batch: Any) -> Any:
    return batch


def start_batches(loader: DataLoader[Any], *, forks: bool) -> Iterator[Any]:
    """``iter(loader)``, its workers forked while the heap is frozen (``forks``: this
    ``iter`` starts workers; a loader with none, or persistent ones already running, is
    just iterated: asking whether the heap is frozen walks the frozen objects, about 13 ms
    of CPU an epoch with torch imported).

    A forked worker inherits the training process's objects (torch alone brings hundreds of
    thousands). Its first full collection walks them all and writes to each one's header,
    which copies every page they lie on: about 0.1 CPU-second per worker start, measured with
    torch and shardio imported. Frozen at the fork, they stay in the workers' permanent
    generation, which the collector leaves alone; this process unfreezes them at once
    (freezing and unfreezing move lists, not objects). A heap the caller froze is left so.

    torch's worker loop seeds numpy's global generator, and numpy imports ``numpy.random``
    at that first use: imported here, once, the workers inherit it instead of each importing
    it after the fork (on a cold node, from disk: about 60 ms of a cold stream epoch's start
    on the pinned MooseFS bed, 2 workers on one CPU).
    """
    if forks:
        import numpy.random  # noqa: F401 - see above
    if not forks or gc.get_freeze_count():
        return iter(loader)
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


# A rank's positions up to this many are an array; more stay a lazy RankStream, read a chunk
# at a time (8 bytes a sample: a billion-sample epoch split over 8 ranks would take 1 GB).
_CHUNK = 1 << 16


class PositionSampler(Sampler[int]):
    """A map-mode run's positions, in order (a lazy stream read a chunk at a time); a
    persistent DataLoader's is given the next run's positions."""

    def __init__(self, positions: Any) -> None:
        self.positions = positions

    def __iter__(self) -> Iterator[int]:
        if isinstance(self.positions, np.ndarray):
            return iter(self.positions.tolist())
        return self._chunks()

    def _chunks(self) -> Iterator[int]:
        for start in range(0, len(self.positions), _CHUNK):
            yield from self.positions[start : start + _CHUNK].tolist()

    def __len__(self) -> int:
        return len(self.positions)


def make_dataloader(
    source: ReadSource,
    positions: Any,
    mode: str,
    *,
    batch_size: int,
    num_workers: int,
    drop_last: bool,
    pin_workers: bool,
    kwargs: Mapping[str, Any],
    ring: BatchRing | None = None,
    timeout: float = 0.0,
    watch: StallWatch | None = None,
    board: torch.Tensor | None = None,
    on_start: Callable[[tuple[Topology, Placement] | None], object] | None = None,
) -> tuple[DataLoader[Any], PositionSampler | None]:
    """The DataLoader of a loader's run of ``source`` over ``positions`` (cut to whole
    batches with ``drop_last``), and its sampler (map mode); ``kwargs``: the DataLoader's
    other arguments. The source takes the run's plan first (its workers get it with it).
    ``on_start`` is called with the placement the workers are pinned to (None: unpinned)
    before they start (the loader's sizing check)."""
    common: dict[str, Any] = {"num_workers": num_workers, **kwargs}
    where = None
    if board is not None:
        common["persistent_workers"] = True
    if num_workers > 0:
        ensure_short_mp_tempdir()  # the workers send batches through sockets named in it
        if timeout:
            common["timeout"] = timeout
        common.setdefault("prefetch_factor", PREFETCH)
        if pin_workers:  # computed here, in the main process, before workers start
            local_rank = source.cursor.ranks().local_rank
            where = rank_placement(num_workers=num_workers, local_rank=local_rank)
            if where is not None:
                common["worker_init_fn"] = pinning_for(where[1], common.get("worker_init_fn"))
        if watch is not None:
            common["worker_init_fn"] = watch.init_fn(common.get("worker_init_fn"))
    if on_start is not None:
        on_start(where)
    # Before the workers start, which take the source and its plan with it: the batches
    # each reads (each advises its first ones before reading any), the ring, the board.
    prefetch = common.get("prefetch_factor")
    source.begin_run(
        RunPlan(
            positions=positions,
            batch_size=batch_size,
            workers=num_workers,
            depth=prefetch if isinstance(prefetch, int) and prefetch >= 2 else 2,
            shares_opens=num_workers > 0 and _forks(common.get("multiprocessing_context")),
            drop_last=drop_last,
            ring=ring,
            board=board,
        )
    )
    if num_workers > 0 and not _forks(common.get("multiprocessing_context")):
        short_socket_dir()  # a forkserver's socket under a long TMPDIR would fail to bind
    data: Any = source  # a torch Dataset (map mode) or IterableDataset (stream)
    if mode == "stream":
        return DataLoader(data, batch_size=None, collate_fn=_identity, **common), None
    sampler = PositionSampler(positions)
    loader = DataLoader(
        data,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=_identity,
        **common,
    )
    return loader, sampler


def _forks(context: object) -> bool:
    """Whether DataLoader workers started with ``multiprocessing_context=context`` are
    forked (and so inherit this process's open descriptors)."""
    if context is None:
        # Not get_start_method(allow_none=False): that would fix the method for the process.
        chosen = multiprocessing.get_start_method(allow_none=True)
        return (chosen or multiprocessing.get_all_start_methods()[0]) == "fork"
    if isinstance(context, str):
        return context == "fork"
    method = getattr(context, "get_start_method", None)
    return callable(method) and method() == "fork"


@dataclass
class KeptWorkers:
    """A DataLoader's persistent workers between iterations, and what they were given."""

    loader: DataLoader[Any]
    batches: Any  # its iterator (a persistent DataLoader resets and reuses it)
    sampler: PositionSampler | None
    ring: BatchRing | None
    watch: StallWatch | None
    board: torch.Tensor  # [run, epoch, consumed], read by the workers at each run's start

    def park(self) -> None:
        """Between epochs: the workers idle, and their death (the OOM killer) must not raise
        from torch's SIGCHLD handler in whatever the training loop runs then; it is found
        at the next epoch's start instead (:meth:`resume`)."""
        internals.unwatch(self.batches)

    def resume(self) -> bool:
        """At an epoch's start: whether every worker is alive (then watched again)."""
        workers = internals.workers(self.batches)
        if not workers or not all(w.is_alive() for w in workers):
            return False
        internals.watch(self.batches, tuple(w.pid for w in workers))
        return True

    def shutdown(self) -> None:
        """Stop the workers (joined)."""
        stop_workers(self.batches)


class WorkerKeeper:
    """Holds a loader's persistent workers; stops them when asked or when the loader goes."""

    def __init__(self) -> None:
        self.kept: KeptWorkers | None = None

    def drop(self) -> None:
        """Stop the kept workers, if any."""
        kept, self.kept = self.kept, None
        if kept is not None:
            kept.shutdown()
