"""ShardDataset: map-style random access and streaming over shardio shards, for PyTorch.

Start-up opens the manifest and the memory-mapped index only, whatever the shard count. Each
process (DataLoader worker) opens a shard once, lazily, and reads members with ``pread`` at
the index offsets, verifying each member's xxh3-64.
"""

from __future__ import annotations

import operator
import os
import resource
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from shardio.errors import ShardioError, UsageError
from shardio.format.spec import LABEL_EXT
from shardio.metrics.read import ReadDelta, ReadMetrics
from shardio.read.opener import Opener
from shardio.read.packed import PackedDataset
from shardio.runtime.batch import read_batch, read_batch_mapped
from shardio.runtime.decode import Decoder, make_decoder
from shardio.runtime.order import check_order, epoch_order, rank_positions
from shardio.runtime.ranks import RankInfo, detect_ranks

if TYPE_CHECKING:
    from shardio.runtime.transport import BatchRing

__all__ = ["ShardDataset", "ShardStreamDataset", "collate_samples"]

MODES = ("map", "stream")
TRANSPORTS = ("ring", "shm", "mmap")
STATE_VERSION = 1
# Recovery events a worker sends with a batch (ResilientDataset); the loader takes them out.
EVENTS_KEY = "__shardio_events__"
# The read metrics a worker drained after reading a batch (a ReadDelta); the loader takes them
# out and merges them into the rank's figures.
METRICS_KEY = "__shardio_metrics__"
SEED_LIMIT = 2**64  # the order generator takes the seed as two 32-bit words
# The integers a state holds (every key :meth:`ShardDataset._state` writes but ``order``), with
# the least value each may take.
_STATE_INTS = {
    "version": 0,
    "epoch": 0,
    "seed": 0,
    "window_shards": 1,
    "num_samples": 0,
    "consumed": 0,
    "world_size": 1,
}


def require_int(value: object, what: str, *, minimum: int | None = None) -> int:
    """Return ``value`` as an int, refusing floats, strings and bools.

    Python and numpy integers (and anything with ``__index__``, e.g. a 0-d integer tensor)
    pass: ``1.5`` or ``np.float64(2.0)`` would otherwise be truncated into another sample.

    Raises:
        UsageError: not an integer, or below ``minimum``; the message names ``what``.
    """
    if isinstance(value, bool | np.bool_):
        raise UsageError(f"{what} must be an integer, not a bool ({value!r})")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise UsageError(
            f"{what} must be an integer, got {type(value).__name__} {value!r}"
        ) from exc
    if minimum is not None and number < minimum:
        raise UsageError(f"{what} must be at least {minimum}, got {number}")
    return number


def _check_seed(seed: object) -> int:
    number = require_int(seed, "seed", minimum=0)
    if number >= SEED_LIMIT:
        raise UsageError(f"seed must be below 2**64, got {number}")
    return number


def _default_max_open() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft // 2)


class WorkerFailure:
    """A ShardioError raised in a DataLoader worker, carried to the main process intact.

    torch re-raises worker errors by building a new exception from a message, which loses
    the type and the attributes of a ChecksumMismatchError; the loader re-raises this one.

    Attributes:
        error: the exception.
        metrics: the worker's read metrics up to the failure (its checksum failures, ...).
    """

    def __init__(self, error: BaseException, metrics: ReadDelta | None = None) -> None:
        self.error = error
        self.metrics = metrics


def labels_to_tensor(batch: dict[str, Any]) -> dict[str, Any]:
    """Make a batch's labels a tensor (workers send them as an ndarray: no shared memory)."""
    labels = batch.get(LABEL_EXT)
    if isinstance(labels, np.ndarray):
        batch[LABEL_EXT] = torch.from_numpy(labels)
    return batch


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
        order: "random", "shard-local" or "sequential" (default: random for map, shard-local
            for stream); see :mod:`shardio.runtime.order`.
        window_shards: shards per shuffle window in shard-local order (at least 1).
        decode: None (raw bytes), "pil", "torch" or a callable on the sample dict.
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
            through its mapping of the shard and sends (file, offset, size); the training
            process maps the file and views the same page-cache pages, without a copy. A
            shard truncated or unreadable (EIO on a parallel filesystem) after the check
            then raises SIGBUS in the training process, and a file replaced in place yields
            wrong bytes; the mapped page cache also counts in its RSS.
        metrics: time every member read into the read-latency histograms and send the
            workers' figures with their batches (``loader.metrics()``); False keeps only
            the counters of each process.
        cache: a staging area (``shardio stage SRC DEST``) to read verified shard copies
            from; shards not staged (yet) are read from ``path``.
        max_open: shard files held open at once per process; None (default) holds every
            shard open up to half the process's open-file limit, so random reads never
            reopen a shard (each reopen is a metadata-server round trip on Lustre).
    """

    mode = "map"

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
        seed: int = 0,
        order: str | None = None,
        window_shards: int = 4,
        decode: str | Decoder | None = None,
        transform: Decoder | None = None,
        verify: bool = True,
        drop_last: bool = False,
        ranks: RankInfo | None = None,
        max_open: int | None = None,
        cache: str | os.PathLike[str] | None = None,
        transport: str = "ring",
        opener: Opener | None = None,
        metrics: bool = True,
    ) -> None:
        if transport not in TRANSPORTS:
            raise UsageError(
                f"invalid transport {transport!r}: choose one of {', '.join(TRANSPORTS)}"
            )
        self.transport = transport
        if mode not in MODES:
            raise UsageError(f"invalid mode {mode!r}: choose one of {', '.join(MODES)}")
        if order is None:
            order = "random" if mode == "map" else "shard-local"
        if not shuffle:
            order = "sequential"
        check_order(order)
        self.path = os.fspath(path)
        self.mode = mode
        self.seed = _check_seed(seed)
        self.order = order
        self.window_shards = require_int(window_shards, "window_shards", minimum=1)
        if max_open is not None:
            max_open = require_int(max_open, "max_open", minimum=1)
        self.decode = decode
        self.transform = transform
        self.verify = verify
        self.drop_last = drop_last
        self.max_open = max_open if max_open is not None else _default_max_open()
        self._ranks = ranks
        self._decoder = make_decoder(decode)
        self.cache = os.fspath(cache) if cache is not None else None
        self.opener = opener
        self.timed = bool(metrics)
        self._ds: PackedDataset | None = PackedDataset(
            self.path, max_open=self.max_open, cache=self.cache, opener=opener, timed=self.timed
        )
        self.num_samples = len(self._ds)
        self._shard_sizes = np.array(
            [s.num_samples for s in self._ds.manifest.shards], dtype=np.int64
        )
        self._closed_metrics: ReadMetrics | None = None
        self.epoch = 0
        self._consumed = 0  # global positions of this epoch delivered before this run
        self._delivered = 0  # samples this process delivered since (direct iteration)
        self._order_cache: tuple[int, np.ndarray[Any, Any]] | None = None
        self._stream_plan: tuple[np.ndarray[Any, Any], int | None] | None = None
        self._ring: BatchRing | None = None  # the loader's, while it iterates
        self._ship_metrics = False  # set by the loader: workers send their figures
        self._received = ReadMetrics()  # what workers sent (the training process's sum)

    # -- pickling: workers reopen the dataset lazily (no mmap or descriptors cross) ----------
    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.path,), {"mode": self.mode}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ds"] = None
        state["_order_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def packed(self) -> PackedDataset:
        """The underlying packed dataset, opened in this process on first use."""
        if self._ds is None:
            self._ds = PackedDataset(
                self.path,
                max_open=self.max_open,
                cache=self.cache,
                opener=self.opener,
                timed=self.timed,
            )
            if self._closed_metrics is not None:  # figures of a closed reader go on
                self._ds.metrics.merge(self._closed_metrics)
                self._closed_metrics = None
        return self._ds

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

    def absorb_metrics(self, delta: object) -> None:
        """Add a worker's figures (called by the loader with each batch's).

        Raises:
            UsageError: ``delta`` is malformed.
        """
        self._received.absorb(delta)

    def _drain_metrics(self) -> ReadDelta | None:
        """In a worker of the loader: this process's figures since its last batch."""
        if not self._ship_metrics or self._ds is None or get_worker_info() is None:
            return None
        return self._ds.metrics.drain()

    @property
    def classes(self) -> tuple[str, ...] | None:
        """The label map (class index -> name), or None."""
        return self.packed.manifest.classes

    def ranks(self) -> RankInfo:
        """The rank layout used for splitting (detected at call time unless given)."""
        return self._ranks if self._ranks is not None else detect_ranks()

    # -- order -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a new epoch reshuffles and starts from its beginning.

        Raises:
            UsageError: ``epoch`` is not an integer >= 0.
        """
        epoch = require_int(epoch, "epoch", minimum=0)
        if epoch != self.epoch:
            self.epoch = epoch
            self._consumed = 0
            self._delivered = 0

    def epoch_order(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The global sample order of the current epoch."""
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            order = epoch_order(
                shard_sizes=self._shard_sizes,
                seed=self.seed,
                epoch=self.epoch,
                order=self.order,
                window_shards=self.window_shards,
            )
            self._order_cache = (self.epoch, order)
        return self._order_cache[1]

    def rank_indices(self, *, consumed: int | None = None) -> np.ndarray[Any, Any]:
        """Sample indices this rank reads in the rest of the epoch."""
        if consumed is not None:
            consumed = require_int(consumed, "consumed", minimum=0)
        ranks = self.ranks()
        return rank_positions(
            self.epoch_order(),
            consumed=self._consumed if consumed is None else consumed,
            rank=ranks.rank,
            world_size=ranks.world_size,
            drop_last=self.drop_last,
        )

    def samples_per_rank(self) -> int:
        """Samples each rank reads in a whole epoch."""
        world = self.ranks().world_size
        return self.num_samples // world if self.drop_last else -(-self.num_samples // world)

    # -- resumable state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position of the iteration in this process (global positions consumed)."""
        return self._state(self._consumed + self._delivered * self.ranks().world_size)

    def _state(self, consumed: int) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "order": self.order,
            "window_shards": self.window_shards,
            "num_samples": self.num_samples,
            "consumed": min(consumed, self.num_samples),
            "world_size": self.ranks().world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (also from a run with another number of ranks).

        Raises:
            UsageError: the state is malformed (a key missing, of the wrong type or out of
                range), of another version, or from a dataset with another order.
        """
        values = _parse_state(state)
        for key in ("seed", "order", "window_shards", "num_samples"):
            if values[key] != getattr(self, key):
                raise UsageError(
                    f"state was saved with {key}={values[key]!r}, this dataset has "
                    f"{getattr(self, key)!r}: cannot resume"
                )
        self.epoch = values["epoch"]
        self._consumed = values["consumed"]
        self._delivered = 0

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def _finish(self, sample: dict[str, Any]) -> dict[str, Any]:
        key = sample["__key__"]
        if self._decoder is not None:
            sample = self._decoder(sample)
        if self.transform is not None:
            sample = self.transform(sample)
        if isinstance(sample, dict) and "__key__" not in sample:
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
        """``read(indices)``: the hook a ResilientDataset recovers faults in."""
        return read(indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as a dict: ``__key__``, bytes per extension, ``cls`` as int."""
        batch = self._read_checked(
            lambda indices: read_batch(self.packed, indices, verify=self.verify, shared=False),
            [self._sample_index(index)],
        )
        sample = {
            k: (
                v[0]
                if k == "__key__"
                else int(v[0])
                if k == LABEL_EXT
                else (bytes(v[0]) if v[0] is not None else None)
            )
            for k, v in batch.items()
            if k != EVENTS_KEY
        }
        return self._finish(sample)

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """A batch: packed in shared memory when undecoded, else collated decoded samples."""
        if get_worker_info() is not None:
            try:
                return self._read_items(indices)
            except ShardioError as exc:
                return WorkerFailure(exc, self._drain_metrics())
        return self._read_items(indices)

    def _read_items(self, indices: Sequence[int]) -> Any:
        checked = [self._sample_index(i) for i in indices]
        if self._decoder is None and self.transform is None:
            batch = self._read_checked(self._read_raw, checked)
        else:
            batch = collate_samples([self[i] for i in checked])
        delta = self._drain_metrics()
        if delta is not None and isinstance(batch, dict):
            batch[METRICS_KEY] = delta  # travels with the batch: no channel of its own
        return self._to_send(batch)

    def _read_raw(self, checked: list[int]) -> Any:
        """Read a batch of checked indices, undecoded, in the transport's form."""
        worker = get_worker_info()
        if self.transport == "mmap":
            batch = read_batch_mapped(self.packed, checked, verify=self.verify)
            return batch if worker is not None else labels_to_tensor(batch)
        if worker is not None and self._ring is not None:
            return self._ring.read(self.packed, checked, worker=worker.id, verify=self.verify)
        # "shm", a plain DataLoader's worker (no ring) or in-process: a buffer of its own.
        return read_batch(self.packed, checked, verify=self.verify, shared=worker is not None)

    def _to_send(self, batch: Any) -> Any:
        """``batch`` as a worker sends it: a ring slot's batch as a small description."""
        worker = get_worker_info()
        if worker is None or self._ring is None or not isinstance(batch, dict):
            return batch
        return self._ring.describe(batch, worker=worker.id)

    def loader(self, batch_size: int, num_workers: int = 0, **kwargs: Any) -> Any:
        """The DataLoader shardio recommends: batches built in the workers and moved through
        shared memory, resumable with ``state_dict``/``load_state_dict``."""
        from shardio.runtime.loader import ShardLoader

        return ShardLoader(self, batch_size=batch_size, num_workers=num_workers, **kwargs)

    def close(self) -> None:
        """Close shard files and the index (the read figures are kept)."""
        if self._ds is not None:
            self._closed_metrics = self._ds.metrics.copy()
            self._ds.close()
            self._ds = None


def _parse_state(state: object) -> dict[str, Any]:
    """The fields of a saved state, each checked for presence, type and range.

    Raises:
        UsageError: naming the first field that is wrong.
    """
    if not isinstance(state, Mapping):
        raise UsageError(f"ShardDataset state must be a dict, got {type(state).__name__}")
    missing = [k for k in (*_STATE_INTS, "order") if k not in state]
    if missing:
        raise UsageError(f"ShardDataset state lacks {', '.join(map(repr, missing))}: cannot resume")
    version = state["version"]
    if type(version) is not int or version != STATE_VERSION:
        raise UsageError(f"unsupported ShardDataset state version {version!r}")
    values: dict[str, Any] = {
        key: require_int(state[key], f"state {key!r}", minimum=least)
        for key, least in _STATE_INTS.items()
    }
    if values["consumed"] > values["num_samples"]:
        raise UsageError(
            f"state 'consumed' is {values['consumed']}, more than its {values['num_samples']} "
            "samples"
        )
    _check_seed(values["seed"])
    if not isinstance(state["order"], str):
        raise UsageError(f"state 'order' must be a str, got {type(state['order']).__name__}")
    values["order"] = state["order"]
    return values


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
        if self._stream_plan is not None:
            positions, batch_size = self._stream_plan
        else:
            if info is None:
                # A restarted direct iteration continues after what was delivered.
                self._consumed += self._delivered * self.ranks().world_size
                self._delivered = 0
            positions, batch_size = self.rank_indices(), None
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if batch_size is None:
            for i in positions[worker::workers]:
                sample = self[int(i)]
                if info is None:
                    self._delivered += 1
                yield sample
            return
        n_chunks = -(-len(positions) // batch_size)
        for c in range(worker, n_chunks, workers):
            following = c + workers  # this worker's next batch: start its reads now
            if following < n_chunks:
                self.packed.advise(
                    positions[following * batch_size : (following + 1) * batch_size].tolist()
                )
            yield self.__getitems__(positions[c * batch_size : (c + 1) * batch_size].tolist())
