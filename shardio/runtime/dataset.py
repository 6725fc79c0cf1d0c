"""ShardDataset: map-style random access and streaming over shardio shards, for PyTorch.

Start-up opens the manifest and the memory-mapped index only, whatever the shard count. Each
process (DataLoader worker) opens a shard once, lazily, and reads members with ``pread`` at
the index offsets, verifying each member's xxh3-64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from shardio._check import require_int, require_path
from shardio._deprecated import renamed_option, warn_renamed
from shardio.errors import ShardioError, UsageError
from shardio.format.spec import LABEL_EXT
from shardio.metrics.read import ReadDelta, ReadMetrics
from shardio.metrics.snapshots import MetricsSnapshot, snapshot
from shardio.metrics.steps import StepTimer
from shardio.order import OrderSpec, RankStream
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo
from shardio.order.spec import resolve_spec
from shardio.read.handoff import Event, Handoff
from shardio.read.readahead import StreamReadahead
from shardio.read.reader import ShardReader
from shardio.read.recovery import RecoveryPolicy
from shardio.read.setup import set_up_reader
from shardio.read.strategy import ReadStrategy
from shardio.read.timeouts import replaceable_readers
from shardio.runtime.batch import read_batch, read_batch_mapped, share_tensors
from shardio.runtime.decode import Decoder, decode_sample, make_decoder
from shardio.runtime.loader import ShardLoader
from shardio.runtime.mptemp import ensure_short as ensure_short_mp_tempdir
from shardio.runtime.plan import RunNeeds, RunPlan, RunState
from shardio.runtime.protocol import FAULTS_KEY
from shardio.runtime.recovering import SampleRecovery, make_policy
from shardio.runtime.stallwatch import watched_opener
from shardio.runtime.transport import max_batch_bytes
from shardio.runtime.wire import EVENTS_KEY, METRICS_KEY, WorkerFailure, labels_to_tensor

if TYPE_CHECKING:
    from shardio.read import Opener

__all__ = ["ShardDataset", "ShardStreamDataset", "collate_samples"]

logger = logging.getLogger(__name__)

MODES = ("map", "stream")
TRANSPORTS = ("ring", "shm", "mmap")
MIN_WORKER_INFLIGHT = 4  # map mode, pfs: requests in flight per DataLoader worker, at least
# The most a stream read-ahead reads into shards not begun to hold the next whole window.
_WINDOW_AHEAD_MAX = 1 << 30
# Samples of an epoch scanned for the order its shards are first read in (open_ahead).
_OPEN_AHEAD_SCAN = 1 << 18


def _first_use(shards: np.ndarray[Any, Any], num_shards: int) -> np.ndarray[Any, Any]:
    """The distinct shards of ``shards`` in the order of their first appearance."""
    first = np.full(num_shards, len(shards), dtype=np.int64)
    np.minimum.at(first, shards, np.arange(len(shards), dtype=np.int64))
    used = np.flatnonzero(first < len(shards))
    return used[np.argsort(first[used], kind="stable")]


def _default_max_open() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft // 2)


def collate_samples(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Collate decoded samples: lists per field, ``cls`` as a tensor, equal-shape tensors
    stacked."""
    batch: dict[str, Any] = {}
    for field in samples[0]:
        values = [s.get(field) for s in samples]
        if field == LABEL_EXT:
            batch[field] = torch.tensor(values, dtype=torch.int64)
        elif all(isinstance(v, torch.Tensor) for v in values):
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            same = len({tuple(t.shape) for t in tensors}) == 1
            batch[field] = torch.stack(tensors) if same else tensors
        else:
            batch[field] = values
    return batch


class ShardDataset(Dataset[dict[str, Any]]):
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
            sample it fails on raises SampleDecodeError naming it (ResilientDataset's policy
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
        read_strategy: how members are read: "local" (one pread per member in the reading
            thread: what a local disk is fast with), "pfs" (for a network or parallel
            filesystem: map mode reads a batch with several coalesced requests in flight,
            stream mode reads its window's shards ahead sequentially into the page cache;
            every member still checked after its read) or "auto"; None (default): the
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
    # A loader's pass while it drives this dataset (its plan, set before its workers start).
    _run: RunState | None = None
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

    def _batch_strategy(self) -> ReadStrategy | None:
        """The strategy ``read_batch`` reads with: map mode's (stream mode reads its shards
        ahead instead, and each member with one pread from the page cache).

        In a DataLoader worker of several, each takes a share of the requests in flight
        (measured on the MooseFS bed: 16 in one process, 4 per worker with 2 workers; more
        threads per worker cost more CPU than they gained)."""
        if self.mode != "map":
            return None
        strategy = self.read_choice.strategy
        info = get_worker_info()
        if info is None or info.num_workers < 2 or strategy.inflight <= 1:
            return strategy
        share = max(MIN_WORKER_INFLIGHT, strategy.inflight // (2 * info.num_workers))
        return dataclasses.replace(strategy, inflight=min(share, strategy.inflight))

    # -- metrics -----------------------------------------------------------------------------
    def read_metrics(self) -> ReadMetrics:
        """This rank's read figures: its workers' (sent with their batches) plus this
        process's own reads. A copy."""
        out = self._received.copy()
        if self._ds is not None:
            out.merge(self._ds.metrics)
        elif self._closed_metrics is not None:
            out.merge(self._closed_metrics)
        return out

    def snapshot(self, steps: StepTimer, *, transport: Mapping[str, int]) -> MetricsSnapshot:
        """This rank's read figures (:meth:`read_metrics`) with a loader's ``steps`` and
        ``transport`` counts."""
        ranks = self.cursor.ranks()
        return snapshot(
            self.read_metrics(),
            steps,
            rank=ranks.rank,
            world_size=ranks.world_size,
            transport=transport,
        )

    @property
    def dataset_id(self) -> str | None:
        """The id of this dataset (the xxh3-128 of its manifest's bytes), or None."""
        found = self.packed.resolver.dataset_id
        return found if isinstance(found, str) else None

    def _drain_metrics(self) -> ReadDelta | None:
        """In a worker of the loader: this process's figures since its last batch."""
        if self._run is None or not self.timed or self._ds is None or get_worker_info() is None:
            return None
        return self._ds.metrics.drain()

    @property
    def classes(self) -> tuple[str, ...] | None:
        """The label map (class index -> name), or None."""
        return self.packed.manifest.classes

    def ranks(self) -> RankInfo:
        """The rank layout used for splitting (detected at call time unless given)."""
        return self.cursor.ranks()

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

    @property
    def drop_last(self) -> bool:
        """Whether each rank's epoch is cut instead of padded (``spec.drop_last``)."""
        return self.spec.drop_last

    @property
    def epoch(self) -> int:
        """The epoch (``cursor.epoch``)."""
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a new epoch reshuffles and starts from its beginning.

        Raises:
            UsageError: ``epoch`` is not an integer >= 0.
        """
        self.cursor.set_epoch(epoch)

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

    def rank_indices(self, *, consumed: int | None = None) -> np.ndarray[Any, Any]:
        """Sample indices this rank reads in the rest of the epoch, as one array."""
        return self.rank_stream(consumed=consumed).materialise()

    def samples_per_rank(self) -> int:
        """Samples each rank reads in a whole epoch (of the layout now)."""
        return self.cursor.samples_per_rank()

    # -- resumable state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: global positions delivered (``cursor.state()``)."""
        return self.cursor.state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, also with another number of ranks or nodes
        (see :meth:`EpochCursor.load <shardio.order.cursor.EpochCursor.load>`).

        Raises:
            UsageError: the state is malformed (a key missing, of the wrong type or out of
                range), of another version, or from a dataset with another order.
        """
        self.cursor.load(state)

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def _finish(self, sample: dict[str, Any]) -> dict[str, Any]:
        key = sample.get("__key__") if isinstance(sample, dict) else None
        if self.transform is not None:
            sample = self.transform(sample)
        if isinstance(sample, dict) and "__key__" not in sample and key is not None:
            # The loader counts delivered samples by key (exact resume): keep it.
            sample = {"__key__": key, **sample}
        return sample

    def _sample_index(self, index: object) -> int:
        """``index`` checked and made non-negative.

        Raises:
            UsageError: not an integer (a float, a bool, a string).
            IndexError: out of range (what ``for x in ds`` relies on to stop).
        """
        number = require_int(index, "sample index")
        if not -self.num_samples <= number < self.num_samples:
            raise IndexError(f"sample {number} out of range for {self.num_samples} samples")
        return number % self.num_samples

    def _read_checked(self, read: Callable[[list[int]], Any], indices: list[int]) -> Any:
        """``read(indices)``, through the recovery policy when there is one; a worker sends
        the recovery's events with the batch, the training process keeps them."""
        if self.recovering is None:
            return read(indices)
        batch, events = self.recovering.read(self, read, indices)
        if events:
            if get_worker_info() is not None:
                if isinstance(batch, dict):
                    batch[EVENTS_KEY] = events
            else:
                self.recovering.absorb(events)
        return batch

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as a dict: ``__key__``, bytes per extension, ``cls`` as int.

        Raises:
            SampleDecodeError: the decoder failed on the sample (naming it).
        """
        return self._sample(index)[0]

    def _sample(self, index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(sample ``index`` decoded and transformed, the recovery events of its read)."""
        got = self._read_checked(self._read_decoded, [self._sample_index(index)])
        events = got.pop(EVENTS_KEY, None) if isinstance(got, dict) else None
        return self._finish(got), events or []

    def _read_decoded(self, indices: list[int]) -> dict[str, Any]:
        """Read and decode the one sample of ``indices``: the read a ResilientDataset
        recovers, so that a sample its decoder refuses is substituted like an unreadable one.

        Raises:
            SampleDecodeError: the decoder failed on it.
        """
        batch = read_batch(self.packed, indices, verify=self.verify, shared=False)
        sample = {
            k: (
                v[0]
                if k == "__key__"
                else int(v[0])
                if k == LABEL_EXT
                else (bytes(v[0]) if v[0] is not None else None)
            )
            for k, v in batch.items()
        }
        if self._decoder is None:
            return sample
        packed, index = self.packed, indices[0]
        decoded = decode_sample(
            self._decoder,
            sample,
            dataset=self.path,
            shard=packed.manifest.shards[packed.shard_of(index)].path,
            index=index,
        )
        if isinstance(decoded, dict) and "__key__" not in decoded:
            # The loader counts delivered samples by key (exact resume): keep it.
            decoded = {"__key__": sample["__key__"], **decoded}
        return decoded

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """A batch: packed in shared memory when undecoded, else collated decoded samples."""
        if get_worker_info() is not None:
            self._follow_board()
            if self.mode == "map":
                self._advise_planned(indices)
            try:
                # Shared now, not while torch pickles it (a full /dev/shm would fail there).
                return share_tensors(self._read_items(indices))
            except ShardioError as exc:
                return WorkerFailure(exc, self._drain_metrics())
        return self._read_items(indices)

    # -- a loader's run (ReadSource) ----------------------------------------------------------
    def needs(self, positions: Any, *, batch_size: int, workers: int) -> RunNeeds:
        """What a loader's run over ``positions`` needs (see :class:`RunNeeds`): a ring when
        undecoded batches cross from ``workers`` over ``transport="ring"``."""
        ringed = self.transport == "ring" and workers > 0
        ringed = ringed and self.decode is None and self.transform is None
        opener = watched_opener(self)
        return RunNeeds(
            mode=self.mode,
            slot_bytes=max_batch_bytes(self.packed, positions, batch_size) if ringed else None,
            read_timeout_s=self.read_timeout_s,
            # Readers behind the deadline's threads: a kill replaces none (no stall watch).
            watch=opener if replaceable_readers(self.read_choice.fs) else None,
            shards=len(self.packed.manifest.shards),
            where=self.path,
        )

    def begin_run(self, plan: RunPlan) -> None:
        """In the training process, before a loader starts its workers (they get the dataset
        with its plan): with workers, the stamps of the epoch's shards checked once here and,
        forked, its first shards opened here for all of them."""
        self._run = RunState(plan)
        if plan.workers == 0:
            return
        positions = plan.positions
        # One stamp check per shard of the epoch, here, instead of one in every worker:
        # each worker still opens a copy without following a symlink, locks it and checks
        # every member, so a decision gone stale costs a fallback to the source, never a byte.
        # An epoch too large to scan (a lazy stream) checks the shards its rank may read.
        self.packed.decide(positions if isinstance(positions, np.ndarray) else self._shards_read())
        if plan.forked:
            self.packed.open_ahead(self._first_shards(positions))

    def _follow_board(self) -> None:
        """In a persistent worker at a pass's start: follow the loader's board (the copies
        staged since the last epoch are looked for again)."""
        if self._run is not None and self._run.follow(self.cursor):
            self.packed.resolver.recheck_unstaged()

    def end_run(self) -> None:
        """After a loader's run (its workers shut down): direct use reads as before."""
        self._run = None

    def absorb(self, sent: dict[str, Any]) -> None:
        """Take a worker's figures and recovery events out of ``sent`` (a batch), and the
        loader's own fault counts (``worker_restarts``, ``stalls``, ``stall_ms``).

        Raises:
            UsageError: the figures are malformed.
        """
        delta = sent.pop(METRICS_KEY, None)
        if delta is not None:
            self._received.absorb(delta)
        events = sent.pop(EVENTS_KEY, None)
        if events is not None:
            self.absorb_events(events)
        for name, value in sent.pop(FAULTS_KEY, {}).items():
            self._received.add(name, require_int(value, name, minimum=0))

    def absorb_events(self, events: list[dict[str, Any]]) -> None:
        """Recovery events a worker sent (kept with a recovery policy; a dataset without one
        sends none)."""
        if self.recovering is not None:
            self.recovering.absorb(events)
        elif events:
            logger.debug("%d recovery events without a recovery policy: dropped", len(events))

    # -- read-ahead advice ------------------------------------------------------------------
    def _first_shards(self, positions: Any) -> list[int]:
        """The shards of the epoch in the order its first samples reach them (a lazy stream:
        the shards this rank may read, by number)."""
        if not isinstance(positions, np.ndarray):
            return [int(s) for s in self.packed.index.shards_of(self._shards_read())]
        head = np.asarray(positions[:_OPEN_AHEAD_SCAN], dtype=np.int64)
        if len(head) == 0:
            return []
        return [
            int(s) for s in _first_use(self.packed.index.shards_of(head), len(self._shard_sizes))
        ]

    def _shards_read(self) -> np.ndarray[Any, Any]:
        """A first sample of every shard this rank may read in the epoch (its node's share
        with a partition, else every shard)."""
        first = np.concatenate([[0], np.cumsum(self._shard_sizes)[:-1]]).astype(np.int64)
        shards = np.flatnonzero(self._shard_sizes > 0)
        if self.spec.partitioned:
            from shardio.order import node_shares

            layout = self.ranks()
            owner = node_shares(self._shard_sizes, self.spec, self.epoch, layout.num_nodes)
            shards = shards[owner[shards] == layout.node]
        return first[shards]

    def _advise_planned(self, indices: Sequence[int]) -> None:
        """Map mode, in a loader's worker, before its first batch ``indices`` (workers start
        afresh each epoch): advise its next ``depth - 1`` batches of the plan too."""
        run, info = self._run, get_worker_info()
        if run is None or info is None or run.plan.workers == 0:
            return
        if run.advised_in == os.getpid():
            return
        run.advised_in = os.getpid()
        plan = run.plan
        first, size = info.id, plan.batch_size
        if not np.array_equal(plan.positions[first * size : (first + 1) * size], indices):
            return  # not the batch the plan deals this worker first (another sampler)
        ahead = (first + a * plan.workers for a in range(1, plan.depth))
        self._advise_batches(plan.positions, size, ahead)

    def _advise_batches(
        self, positions: np.ndarray[Any, Any], batch_size: int, batches: Iterable[int]
    ) -> None:
        """Advise the reads of batches ``batches`` of ``positions`` (those past the end are
        none)."""
        wanted = [
            positions[b * batch_size : (b + 1) * batch_size]
            for b in batches
            if 0 <= b * batch_size < len(positions)
        ]
        if not wanted:
            return
        # Advice only: a fault found here (a shard that cannot be opened, altered records) is
        # raised, with its own type, by the read of that batch.
        with contextlib.suppress(ShardioError, OSError):
            self.packed.advise(np.concatenate(wanted).tolist())

    def _read_items(self, indices: Sequence[int]) -> Any:
        checked = [self._sample_index(i) for i in indices]
        if self._decoder is None and self.transform is None:
            batch = self._read_checked(self._read_raw, checked)
        else:
            samples, events = [], []
            for i in checked:
                sample, got = self._sample(i)
                samples.append(sample)
                events.extend(got)
            batch = collate_samples(samples)
            if events:
                batch[EVENTS_KEY] = events
        delta = self._drain_metrics()
        if delta is not None and isinstance(batch, dict):
            batch[METRICS_KEY] = delta  # travels with the batch: no channel of its own
        return self._to_send(batch)

    def read_samples(self, indices: Sequence[int]) -> dict[str, Any]:
        """Samples ``indices`` undecoded, as one batch in this process's memory
        (:func:`~shardio.runtime.batch.read_batch`'s form), read through the recovery policy;
        in a DataLoader worker the recovery's events go along (``EVENTS_KEY``). What a mix
        reads this dataset's share of its batch with.

        Raises:
            IndexError: an index out of range.
        """
        checked = [self._sample_index(i) for i in indices]
        return self._read_checked(self._read_local, checked)  # type: ignore[no-any-return]

    def _read_local(self, checked: list[int]) -> dict[str, Any]:
        self._share_strategy()
        return read_batch(self.packed, checked, verify=self.verify, shared=False)

    def _share_strategy(self) -> None:
        """In a DataLoader worker: take its share of the requests in flight."""
        worker = get_worker_info()
        if worker is not None and self._ds is not None and self._ds.read_strategy is not None:
            self._ds.read_strategy = self._batch_strategy()  # a forked worker's share

    def _read_raw(self, checked: list[int]) -> Any:
        """Read a batch of checked indices, undecoded, in the transport's form."""
        self._share_strategy()
        worker = get_worker_info()
        if self.transport == "mmap":
            batch = read_batch_mapped(self.packed, checked, verify=self.verify)
            return batch if worker is not None else labels_to_tensor(batch)
        ring = self._run.plan.ring if self._run is not None else None
        if worker is not None and ring is not None:
            return ring.read(self.packed, checked, worker=worker.id, verify=self.verify)
        # "shm", a plain DataLoader's worker (no ring) or in-process: a buffer of its own.
        return read_batch(self.packed, checked, verify=self.verify, shared=worker is not None)

    def _to_send(self, batch: Any) -> Any:
        """``batch`` as a worker sends it: a ring slot's batch as a small description."""
        worker = get_worker_info()
        ring = self._run.plan.ring if self._run is not None else None
        if worker is None or ring is None or not isinstance(batch, dict):
            return batch
        return ring.describe(batch, worker=worker.id)

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
        info = get_worker_info()
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
        n_chunks = -(-len(positions) // batch_size)
        # This worker's next batches: all ``depth - 1`` of them before its first batch (the
        # cold start of the epoch), then one more before each (see RunPlan).
        depth = run.plan.depth if run is not None and run.plan.workers > 0 else 2
        readahead = self._stream_readahead(positions, batch_size, worker, workers)
        if readahead is not None:
            self.packed.advising = False  # the read-ahead fills the page cache
        try:
            for k, c in enumerate(range(worker, n_chunks, workers)):
                batch = positions[c * batch_size : (c + 1) * batch_size]
                if readahead is not None:
                    readahead.before_batch(batch)  # its shards are read ahead, not advised
                else:
                    ahead = range(1, depth) if k == 0 else (depth - 1,)
                    self._advise_batches(positions, batch_size, (c + a * workers for a in ahead))
                yield self.__getitems__(batch.tolist())
        finally:
            if readahead is not None:
                readahead.close()
                self.packed.advising = True

    def _readahead_bound(self, least: int) -> int:
        """Bytes a stream read-ahead may read into shards not begun: ``least``, and at least
        a whole window of the shard-local order (up to ``_WINDOW_AHEAD_MAX``). A window's
        first batch needs every shard of the window: with less, the read-ahead stops while
        the window before it is consumed, and each window's start waits for the rest."""
        if self.spec.order != "shard-local" or not len(self._shard_sizes):
            return least
        sizes = sorted((int(s.size_bytes) for s in self.packed.manifest.shards), reverse=True)
        window = sum(sizes[: self.spec.window_shards])
        return max(least, min(window, _WINDOW_AHEAD_MAX))

    def _stream_readahead(
        self, positions: np.ndarray[Any, Any], batch_size: int, worker: int, workers: int
    ) -> StreamReadahead | None:
        """The read strategy's read-ahead of this worker's shards, started (None: the strategy
        reads none, as on a local disk). The order is the epoch's; only how its bytes arrive
        changes: each shard sequentially, in large requests, before its members are read."""
        strategy = self.read_choice.strategy
        if strategy.stream_readahead_bytes <= 0 or not len(positions):
            return None
        n = len(positions)
        step = workers * batch_size
        mine = np.concatenate(
            [positions[c : c + batch_size] for c in range(worker * batch_size, n, step)]
            or [np.empty(0, dtype=np.int64)]
        )
        packed = self.packed
        shards = packed.index.shards_of(np.asarray(mine, dtype=np.int64))
        if not len(shards):
            return None
        order = _first_use(shards, len(self._shard_sizes))
        return StreamReadahead(
            packed,
            order.tolist(),
            request_bytes=strategy.request_bytes,
            ahead_bytes=self._readahead_bound(strategy.stream_readahead_bytes),
        ).start()
