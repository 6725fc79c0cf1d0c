"""ShardDataset: the PyTorch face of a packed dataset, map-style random access or streaming.

The faces are thin: how samples and batches are read is :mod:`shardio.runtime.reading`'s,
a loader's run over the dataset :mod:`shardio.runtime.runs`', the epoch and the position
:mod:`shardio.runtime.position`'s (the dataset's cursor).

Start-up opens the manifest and the memory-mapped index only, whatever the shard count. Each
process (DataLoader worker) opens a shard once, lazily, and reads members with ``pread`` at
the index offsets, verifying each member's xxh3-64.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from shardio._check import require_int, require_path
from shardio._deprecated import renamed_option, warn_renamed
from shardio.errors import ShardioError, UsageError
from shardio.metrics.read import ReadMetrics
from shardio.order import OrderSpec, RankStream
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo
from shardio.order.spec import resolve_spec
from shardio.read.handoff import Event, Handoff
from shardio.read.reader import ShardReader
from shardio.read.recovery import RecoveryPolicy
from shardio.read.setup import set_up_reader
from shardio.runtime.batch import share_tensors
from shardio.runtime.decode import Decoder, make_decoder
from shardio.runtime.loader import ShardLoader
from shardio.runtime.mptemp import ensure_short as ensure_short_mp_tempdir
from shardio.runtime.position import CursorFace
from shardio.runtime.reading import SampleReads
from shardio.runtime.recovering import SampleRecovery, make_policy
from shardio.runtime.runs import ShardRuns
from shardio.runtime.threads import in_process, worker_info
from shardio.runtime.wire import WorkerFailure

if TYPE_CHECKING:
    from shardio.read import Opener

__all__ = ["ShardDataset", "ShardStreamDataset"]

logger = logging.getLogger(__name__)

MODES = ("map", "stream")
TRANSPORTS = ("ring", "shm", "mmap")


def _default_max_open() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft // 2)


class ShardDataset(ShardRuns, SampleReads, CursorFace, Dataset[dict[str, Any]]):
    """A packed dataset as a PyTorch dataset.

    ``ShardDataset(path, mode="stream")`` returns a :class:`ShardStreamDataset` (an
    ``IterableDataset``); ``mode="map"`` (the default) a map-style dataset with ``len`` and
    ``ds[i]``.

    Args:
        path: the dataset directory (holding manifest.json).
        mode: "map" or "stream".
        shuffle: shuffle each epoch; False reads in dataset order.
        seed: the order is a pure function of (seed, epoch); an integer in [0, 2**64).
        order: an :class:`~shardio.order.OrderSpec` (the one description a job's stage step
            and training share: order, seed, window, node partition, drop_last), or the
            order's name: "random", "shard-local" or "sequential" (default: random for map,
            shard-local for stream; :func:`shardio.order.default_order`), or a spec string
            such as ``"order=random,partition=node"``. With an OrderSpec, give seed,
            window_shards and drop_last in it, not here.
        window_shards: shards per shuffle window in shard-local order (at least 1).
        decode: None (raw bytes), "pil", "torch" or a callable on the sample dict; a
            sample it fails on raises SampleDecodeError naming it (a ``recovery=`` policy
            substitutes or raises it).
        transform: a callable applied to each (decoded) sample.
        verify: check every member's xxh3-64 on read (cheap); a mismatch raises
            ChecksumMismatchError.
        drop_last: per rank, cut the epoch's remainder instead of padding it by repeating
            samples (either way every rank gets the same count).
        ranks: the rank layout; detected from torch.distributed, SLURM or RANK/WORLD_SIZE
            when None.
        transport: how undecoded batches cross from DataLoader workers to the training
            loop (with :meth:`loader`). "ring" (default): each worker reads and verifies its
            batch into one of a few shared-memory slots that :class:`ShardLoader` allocates
            once per iteration, and sends only offsets; a slot is reused once nothing views
            its batch any more (a batch the caller keeps is never overwritten; when every
            slot is held, a batch takes a fresh segment instead). "shm": a fresh
            shared-memory segment per batch (its pages fault on every batch: slower).
            "mmap": opt-in, for node-local copies only: the worker verifies each member
            through its mapping of the shard and sends (file, offset, size) and the file's
            identity; the training process maps that very file and views the same
            page-cache pages, without a copy (a shard renamed over since, e.g. by
            ``shardio pack --force``, raises StorageError when viewed). A shard truncated or
            unreadable (EIO on a parallel filesystem) once mapped then raises SIGBUS in the
            training process; the mapped page cache also counts in its RSS.
        metrics: time every member read into the read-latency histograms and send the
            workers' figures with their batches (``loader.metrics()``); False keeps only
            the counters of each process.
        stage: a staging area (``shardio stage SRC DEST``) to read verified shard copies
            from; shards not staged (yet) are read from ``path``.
        cache: the old name of ``stage`` (warns; goes in 0.3).
        max_open: shard files held open at once per process; None (default) holds every
            shard open up to half the process's open-file limit, so random reads never
            reopen a shard (each reopen is a metadata-server round trip on Lustre).
        read_timeout_s: seconds a read (or open) of a shard may stall before it is
            abandoned and raises :class:`~shardio.errors.ReadStalledError` naming the shard
            ("stalled for T s"); the shard is then held unavailable on the node for a while
            (its other reads fail at once). None (default): 120 s on a network or parallel
            filesystem, no deadline on a local one; 0: no deadline. See
            :mod:`shardio.read.timeouts`.
        read_strategy: how members are read: "local" (map mode: one pread per member in
            the reading thread, what a local disk is fast with), "pfs" (for a network or
            parallel filesystem: map mode reads a batch with several coalesced requests in
            flight) or "auto". With either, stream mode reads its window's shards ahead
            sequentially into the page cache, and every member is still checked after its
            read. None (default): the
            ``SHARDIO_READ_STRATEGY`` environment variable, else "auto" (chosen from the
            filesystem holding ``path``). See :mod:`shardio.read.strategy`.
        recovery: what a sample that cannot be read (or decoded) gets: None (default): its
            error is raised as it is; "raise", "skip" or a
            :class:`~shardio.read.recovery.RecoveryPolicy`: retried, re-staged, rebuilt,
            then raised as SampleUnavailableError or substituted (see
            :mod:`shardio.read.recovery`).
        rebuild: with ``recovery``: rebuilds a damaged source shard in place
            (``rebuild(shard_index) -> bool``), tried after the retries.
    """

    mode = "map"
    # From __getstate__: what a worker started by pickling opens the packed dataset with.
    _handoff: Handoff | None = None

    def __new__(cls, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> ShardDataset:
        del path, args
        mode = kwargs.get("mode", "map")
        if cls is ShardDataset and mode == "stream":
            return super().__new__(ShardStreamDataset)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: str = "map",
        shuffle: bool = True,
        seed: int | None = None,
        order: str | OrderSpec | None = None,
        window_shards: int | None = None,
        decode: str | Decoder | None = None,
        transform: Decoder | None = None,
        verify: bool = True,
        drop_last: bool | None = None,
        ranks: RankInfo | None = None,
        max_open: int | None = None,
        stage: str | os.PathLike[str] | None = None,
        cache: str | os.PathLike[str] | None = None,
        transport: str = "ring",
        opener: Opener | None = None,
        metrics: bool = True,
        read_timeout_s: float | None = None,
        read_strategy: str | None = None,
        recovery: str | RecoveryPolicy | None = None,
        rebuild: Callable[[int], bool] | None = None,
    ) -> None:
        if recovery is None and rebuild is not None:
            raise UsageError("rebuild is a step of a recovery policy: give recovery= too")
        if rebuild is not None and not callable(rebuild):
            raise UsageError(f"rebuild must be callable, got {type(rebuild).__name__}")
        self.recovering: SampleRecovery | None = (
            SampleRecovery(make_policy(recovery, {}), rebuild) if recovery is not None else None
        )
        if transport not in TRANSPORTS:
            raise UsageError(
                f"invalid transport {transport!r}: choose one of {', '.join(TRANSPORTS)}"
            )
        self.transport = transport
        if mode not in MODES:
            raise UsageError(f"invalid mode {mode!r}: choose one of {', '.join(MODES)}")
        self.spec = resolve_spec(
            mode, order, shuffle=shuffle, seed=seed, window_shards=window_shards,
            drop_last=drop_last,
        )  # fmt: skip
        self.path = require_path(path, "dataset path")
        self.mode = mode
        if max_open is not None:
            max_open = require_int(max_open, "max_open", minimum=1)
        self.decode = decode
        self.transform = transform
        self.verify = verify
        self.max_open = max_open if max_open is not None else _default_max_open()
        self._decoder = make_decoder(decode)
        stage = renamed_option("ShardDataset", "cache", cache, "stage", stage)
        self.stage = None if stage is None else require_path(stage, "stage")
        if read_strategy is not None and not isinstance(read_strategy, str):
            raise UsageError(f"read_strategy must be a string, got {type(read_strategy).__name__}")
        # Chosen once, here (workers get the choice with the dataset), with the one statfs of
        # the dataset (each is a metadata-server request): as shardio.dali chooses.
        self._reader = set_up_reader(
            self.path, read_strategy=read_strategy, read_timeout_s=read_timeout_s, opener=opener
        )
        self.read_choice = self._reader.choice
        # The deadline in force (0: none); the opener runs every call under it.
        self.read_timeout_s = self._reader.read_timeout_s
        self.opener = self._reader.opener
        self.timed = bool(metrics)
        self._ds: ShardReader | None = self._open_packed(fs=self.read_choice.fs)
        self.num_samples = len(self._ds)
        self._shard_sizes = np.array(
            [s.num_samples for s in self._ds.manifest.shards], dtype=np.int64
        )
        self.order_mismatch = _check_staged_order(
            self._ds.cache_root, self._ds.staged_for, self.spec
        )
        self._closed_metrics: ReadMetrics | None = None
        # The one owner of the epoch and the position in it (advanced as samples reach the
        # training loop, by direct iteration or by a loader).
        self.cursor = EpochCursor(self.spec, self._shard_sizes, ranks=ranks)
        self._received = ReadMetrics()  # what workers sent (the training process's sum)

    # -- pickling: workers reopen the dataset lazily (no mmap or descriptors cross) ----------
    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.path,), {"mode": self.mode}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # The manifest read here and the staged copies found here go along, so a worker
        # started by pickling (spawn, forkserver) neither reads the manifest nor checks
        # stamps again each epoch; it still maps and checks the index itself.
        state["_handoff"] = self._ds.handoff() if self._ds is not None else self._handoff
        state["_ds"] = None
        state.pop("_buffers", None)  # the reused batch buffers stay with this process
        state.pop("_warming", None)  # a read-ahead thread of this process (see begin_run)
        # The figures of a reader this process closed are this process's: a worker sends
        # what it read itself (it would send these again with its first batch).
        state["_closed_metrics"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        ensure_short_mp_tempdir()  # a worker started by pickling sends its batches through it

    @property
    def packed(self) -> ShardReader:
        """The underlying packed dataset, opened in this process on first use."""
        if self._ds is None:
            handoff, self._handoff = self._handoff, None
            self._ds = self._open_packed(handoff=handoff)
            if self._closed_metrics is not None:  # figures of a closed reader go on
                self._ds.metrics.merge(self._closed_metrics)
                self._closed_metrics = None
        return self._ds

    def _open_packed(self, *, fs: Any = None, handoff: Handoff | None = None) -> ShardReader:
        """This process's reader: with the recovery policy's re-staging, its events routed
        to the recovery."""
        return self._reader.open(
            max_open=self.max_open,
            stage=self.stage,
            timed=self.timed,
            fs=fs,
            handoff=handoff,
            restage=self.recovering is not None and self.recovering.policy.restage,
            on_event=self._reader_event if self.recovering is not None else None,
            read_strategy=self._batch_strategy(),
        )

    def _reader_event(self, event: Event) -> None:
        if self.recovering is not None:
            self.recovering.reader_event(self, event)

    # -- recovery (a policy given to the reader; see shardio.runtime.recovering) -------------
    def with_recovery(
        self,
        policy: str | RecoveryPolicy = "raise",
        *,
        rebuild: Callable[[int], bool] | None = None,
        **options: Any,
    ) -> ShardDataset:
        """Deprecated (goes in 0.3): ``ShardDataset(path, recovery=...)`` asks for recovery.

        A copy of this dataset that recovers from read faults by ``policy`` (a name with
        RecoveryPolicy's fields as ``options``, or a RecoveryPolicy); this one is left
        unchanged. The copy starts where this one stands, with figures of its own."""
        warn_renamed("ShardDataset.with_recovery(...)", "ShardDataset(path, recovery=...)")
        return recovering_copy(self, policy, rebuild=rebuild, options=options)

    @property
    def recovery_policy(self) -> RecoveryPolicy | None:
        """The recovery policy in force, or None (errors are raised as they are)."""
        return self.recovering.policy if self.recovering is not None else None

    @property
    def rebuild(self) -> Callable[[int], bool] | None:
        """The recovery's rebuild hook, or None."""
        return self.recovering.rebuild if self.recovering is not None else None

    @property
    def recovery_events(self) -> list[Event]:
        """The recovery events the training process saw (the last 10,000), from every
        worker, each a dict as in the journal; empty without a recovery policy."""
        return self.recovering.events if self.recovering is not None else []

    @property
    def recovery_stats(self) -> Counter[str]:
        """Recoveries by kind, from every worker: ``retry`` (a retry read the sample),
        ``restage``, ``drop``, ``rebuild``, ``skip`` (substituted) and ``raise``; a view of
        the rank's read metrics (``loader.metrics().counters``)."""
        return SampleRecovery.stats(self.read_metrics().counts)

    def probe_sample(self, sample: int) -> None:
        """Read ``sample`` as it would be delivered (decoded too), raising what its read
        would: the recovery's retry, and its check of a substitute before it is taken."""
        self._read_decoded([sample])

    # -- metrics -----------------------------------------------------------------------------
    @property
    def dataset_id(self) -> str | None:
        """The id of this dataset (the xxh3-128 of its manifest's bytes), or None."""
        found = self.packed.resolver.dataset_id
        return found if isinstance(found, str) else None

    @property
    def classes(self) -> tuple[str, ...] | None:
        """The label map (class index -> name), or None."""
        return self.packed.manifest.classes

    # -- order -------------------------------------------------------------------------------
    @property
    def seed(self) -> int:
        """The order's seed (``spec.seed``)."""
        return self.spec.seed

    @property
    def order(self) -> str:
        """The order's name (``spec.order``)."""
        return self.spec.order

    @property
    def window_shards(self) -> int:
        """Shards per shuffle window (``spec.window_shards``)."""
        return self.spec.window_shards

    def epoch_order(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The global sample order of the current epoch, as one array (8 bytes a sample).

        Raises:
            UsageError: the order is node-partitioned: each node has an order of its own
                (see :meth:`rank_indices`).
        """
        return self.cursor.epoch_order()

    def rank_stream(self, *, consumed: int | None = None) -> RankStream:
        """What this rank reads in the rest of the epoch, computed chunk by chunk (no array
        of the whole epoch: a billion-sample dataset starts at once)."""
        return self.cursor.stream(consumed=consumed)

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """A batch: packed in shared memory when undecoded, else collated decoded samples."""
        info = worker_info()
        if info is not None:
            self._follow_board()
            if self.mode == "map":
                self._advise_planned(indices)
            try:
                batch = self._read_items(indices)
                if in_process(info):  # a reader thread's: stays in its reused buffers
                    return batch
                # Shared now, not while torch pickles it (a full /dev/shm would fail there).
                return share_tensors(batch)
            except ShardioError as exc:
                # An error of the data travels intact, with the figures of the reads that met
                # it (a checksum failure is counted), and is raised at its batch.
                return WorkerFailure(exc, self._drain_metrics())
        return self._read_items(indices)

    def loader(self, batch_size: int, num_workers: int = 0, **kwargs: Any) -> ShardLoader:
        """The DataLoader shardio recommends: batches built in the workers and moved through
        shared memory, resumable with ``state_dict``/``load_state_dict``."""
        return ShardLoader(self, batch_size=batch_size, num_workers=num_workers, **kwargs)

    def close(self) -> None:
        """Close shard files and the index (the read figures are kept)."""
        if self._ds is not None:
            self._closed_metrics = self._ds.metrics.copy()
            self._ds.close()
            self._ds = None


def _check_staged_order(
    area: str | None, staged: dict[str, Any] | None, spec: OrderSpec
) -> list[str]:
    """How the order a staging area was staged for (``staged``) differs from ``spec``
    (logged: a job that reads in another order than it staged for reads much from the
    source)."""
    if area is None or staged is None:
        return []
    try:
        staged_spec = OrderSpec.from_dict(staged.get("spec"))
    except UsageError:
        return []
    differences = spec.differences(staged_spec)
    if differences:
        logger.warning(
            "staging area %s was staged for order %s, this dataset reads order %s "
            "(%s; this dataset's, then the area's): shards outside the staged share are read "
            "from the source; stage with --order '%s' (or set SHARDIO_ORDER for both)",
            area,
            staged_spec,
            spec,
            "; ".join(differences),
            spec,
        )
    return differences


def recovering_copy(
    dataset: ShardDataset,
    policy: str | RecoveryPolicy,
    *,
    rebuild: Callable[[int], bool] | None,
    options: dict[str, Any],
) -> ShardDataset:
    """A copy of ``dataset`` (left unchanged) reading through a recovery policy, starting
    where it stands, with figures of its own: what the deprecated ``with_recovery`` and
    ``ResilientDataset`` return."""
    chosen = make_policy(policy, options)
    if rebuild is not None and not callable(rebuild):
        raise UsageError(f"rebuild must be callable, got {type(rebuild).__name__}")
    copy = object.__new__(type(dataset))
    copy.__setstate__(dataset.__getstate__())
    copy.cursor = dataset.cursor.copy()  # its own position, from where this one stood
    copy._received = ReadMetrics()
    copy._closed_metrics = None
    copy.recovering = SampleRecovery(chosen, rebuild)
    return copy


class ShardStreamDataset(ShardDataset, IterableDataset[dict[str, Any]]):
    """Streaming mode: an IterableDataset that splits work by rank and DataLoader worker.

    Reads follow the epoch order (shard-local by default, so reads stay sequential within a
    window of shards). With :meth:`ShardDataset.loader` each worker builds whole batches;
    iterated directly it yields single samples.
    """

    mode = "stream"

    def __len__(self) -> int:
        return self.samples_per_rank()

    def __iter__(self) -> Iterator[Any]:
        info = worker_info()
        if info is not None:
            self._follow_board()
        run = self._run
        if run is not None:
            positions, batch_size = run.plan.positions, run.plan.batch_size
        else:
            # A restarted direct iteration continues after what was delivered (an epoch read
            # to its end is read again).
            self.cursor.begin()
            positions, batch_size = self.rank_indices(), None
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        world = self.ranks().world_size  # each sample delivered moves the epoch as far
        if batch_size is None:
            for i in positions[worker::workers]:
                sample = self[int(i)]
                if info is None:
                    self.cursor.advance(world)
                yield sample
            if info is None:
                self.cursor.finish()
            return
        with contextlib.closing(
            self._stream_batches(positions, batch_size, worker, workers)
        ) as batches:
            for batch in batches:
                yield self.__getitems__(batch)
