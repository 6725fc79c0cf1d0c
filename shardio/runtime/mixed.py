"""MixedDataset: a deterministic, weighted mix of shardio datasets, resumable mid-epoch.

``MixedDataset([(ds_a, 0.7), (ds_b, 0.3)], seed=0)`` draws from each source in proportion to
its weight. Nothing here reads bytes: each sample is read (staged, verified, decoded,
recovered) by its own source, and carries ``__source__``, the index of the source it came
from.

The epoch (a pure function of seed, epoch, weights and the sources' own epoch orders):

- **Length**: the mix ends when the first source would run out at its weight: ``N`` is the
  largest count whose apportionment by weight (largest remainders) gives no source more
  draws than it has samples. No sample is drawn twice in an epoch; the samples of the other
  sources not drawn come in later epochs, whose orders differ. ``N`` and the draws per
  source (``counts``) depend on the sizes and weights only, the same in every epoch.
- **Draws**: source ``s`` draws ``counts[s]`` samples, the first of its own epoch order
  (``source.epoch_order()``). Its ``k``-th draw is placed at the virtual time
  ``(k + u_s) / counts[s]``, with a phase ``u_s`` in [0, 1) drawn from (seed, epoch); the
  mix is the merge of all draws by time (ties to the lower source). Each source's draws are
  evenly spread, so any window of the mix holds each source's share to within two draws
  (low discrepancy, unlike a multinomial stream), and the phases vary the pattern per epoch.
- **Ranks**: the mix is one global sequence of ``N`` positions, split among ranks like a
  ShardDataset's order (interleaved positions, the remainder padded from the epoch's start or
  cut with ``drop_last``): every rank gets the same count. The position is an
  :class:`~shardio.order.cursor.EpochCursor` over those ``N`` positions, so exact and elastic
  resume behave as ShardDataset's: the consumed prefix of the mix is done, the rest is shared
  out among the ranks of the resumed job.
- **Lazily**: nothing of the size of the epoch is built. The source and draw of a position
  are computed when it is read (:class:`~shardio.order.mix.MixSchedule`), and the draw's
  sample from the source's lazy epoch order, so a mix of billions of samples starts as fast
  as one dataset does.

Provenance: a mix is one dataset to the model, so its sources must be distinct datasets
(told by dataset id and real path, not by Python object: a dataset opened twice would be
drawn twice an epoch) and their labels must mean the same classes: labelled sources with
different label maps (``ds.classes``) are refused unless ``classes=`` gives the mix's map,
into which each source's labels are then remapped by class name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from shardio._check import require_int
from shardio.errors import ShardioError, UsageError
from shardio.format.spec import LABEL_EXT
from shardio.metrics.read import ReadMetrics
from shardio.order.mix import MixOrder, check_weight, mix_counts, mix_schedule
from shardio.order.spec import OrderSpec
from shardio.runtime.batch import share_tensors
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.labels import label_maps, remap
from shardio.runtime.loader import ShardLoader
from shardio.runtime.mixread import (
    Allocate,
    allocate_local,
    allocate_shared,
    collate_mixed,
    read_shares,
    reads_batches,
)
from shardio.runtime.mixstate import MixPosition, mix_dataset_id, refuse_repeats
from shardio.runtime.plan import RunNeeds, RunPlan, RunState
from shardio.runtime.position import CursorFace
from shardio.runtime.protocol import FAULTS_KEY
from shardio.runtime.transport import estimated_batch_bytes, largest_batch, sample_bytes
from shardio.runtime.wire import EVENTS_KEY, METRICS_KEY, SOURCE_KEY, WorkerFailure

__all__ = ["SOURCE_KEY", "MixedDataset", "mix_counts", "mix_schedule"]

_SEED_LIMIT = 2**64
_CHUNK = 1 << 16  # positions of a rank's share computed at once (8 bytes each)
_BLOCK = 256  # positions located at once by ``locate``
_SPAN = 1 << 13  # a rank's positions located at once for its batches (see _located)
_SPANS_KEPT = 4


class MixedDataset(CursorFace, Dataset[dict[str, Any]]):
    """A weighted mix of shardio datasets (map-style: ``mixed[p]`` is position ``p`` of the
    epoch's mix; see the module docstring for the epoch, the draws and the rank split).

    Args:
        sources: ``(dataset, weight)`` pairs: ShardDatasets (any mode, with ``recovery=``
            or not), each dataset once (by dataset id and real path: not opened twice, nor
            with a recovering copy or a staging area of it), with positive finite weights
            (normalised) and one rank layout; their orders must be global (no
            ``partition=node``).
        seed: the mix's seed (the sources keep theirs); an integer in [0, 2**64).
        drop_last: per rank, cut the mix's remainder instead of padding it by repeating
            positions from the epoch's start (either way every rank gets the same count).
        names: a name per source (metrics, ``source_names``); default ``"0"``, ``"1"``, ...
        classes: the mix's label map (class names, index = position), into which the labels
            of every labelled source are remapped by class name: what mixes sources whose
            label maps differ. None (default): the labelled sources must share one label map
            (sources without labels mix with any). The map in force is ``mixed.classes``.

    Raises:
        UsageError: one line naming what is wrong with ``sources`` (a dataset given twice,
            label maps that differ), a weight, ``seed`` or ``classes``.
    """

    mode = "map"

    def __init__(
        self,
        sources: Sequence[tuple[ShardDataset, float]],
        *,
        seed: int = 0,
        drop_last: bool = False,
        names: Sequence[str] | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(sources, Sequence) or isinstance(sources, str | bytes):
            raise UsageError(
                f"sources must be a list of (dataset, weight) pairs, got {type(sources).__name__}"
            )
        if not sources:
            raise UsageError("a mix needs at least one (dataset, weight) pair, got none")
        datasets: list[ShardDataset] = []
        weights: list[float] = []
        for s, pair in enumerate(sources):
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise UsageError(f"source {s} of the mix must be a (dataset, weight) pair")
            ds, weight = pair
            if not isinstance(ds, ShardDataset):
                raise UsageError(
                    f"source {s} of the mix must be a ShardDataset, got {type(ds).__name__}"
                )
            if ds.spec.partitioned:
                raise UsageError(
                    f"source {s} of the mix reads partition={ds.spec.partition!r}: a mix needs "
                    "sources with one global order"
                )
            datasets.append(ds)
            weights.append(check_weight(weight, s))
        refuse_repeats(datasets)
        self.classes, self._relabel = label_maps(datasets, classes)
        self.remaps_labels = classes is not None  # classes= given: the labels are the mix's
        if not isinstance(drop_last, bool):
            raise UsageError(f"drop_last must be True or False, got {drop_last!r}")
        self.seed = require_int(seed, "seed", minimum=0, maximum=_SEED_LIMIT - 1)
        if names is None:
            names = [str(s) for s in range(len(datasets))]
        if not isinstance(names, Sequence) or isinstance(names, str) or len(names) != len(datasets):
            raise UsageError(f"names must be a list of {len(datasets)} strings, got {names!r}")
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise UsageError(f"names must be distinct strings, got {list(names)!r}")
        self.source_names = tuple(names)
        self.sources = tuple(datasets)
        largest = max(weights)  # scaled first: two weights of 1e308 do not sum to inf
        total = sum(w / largest for w in weights)
        self.weights = tuple(w / largest / total for w in weights)
        if not math.isfinite(total) or min(self.weights) <= 0:
            raise UsageError(f"weights {weights!r} span too many orders of magnitude to normalise")
        self.counts = tuple(mix_counts([ds.num_samples for ds in datasets], self.weights))
        self.num_samples = sum(self.counts)
        spec = OrderSpec(order="sequential", seed=self.seed, drop_last=drop_last)
        self.cursor: MixPosition = MixPosition(spec, self.num_samples, self)
        self.cursor.ranks()  # the layouts agree, or one line now
        self.cursor.set_epoch(datasets[0].epoch)
        self._order: MixOrder | None = None  # the epoch's, computed position by position
        self._block: tuple[tuple[int, int], np.ndarray[Any, Any], np.ndarray[Any, Any]] | None
        self._block = None  # the block of positions located last (see locate)
        # Each source reads its share of a batch with one batch read when every source is a
        # ShardDataset read undecoded (a source that reads its samples otherwise, by its own
        # __getitem__ or a decoder, is read sample by sample) and the labels agree (all or
        # none labelled: a batch's cls is one tensor).
        self._batched = all(reads_batches(ds) for ds in datasets) and (
            len({ds.classes is None for ds in datasets}) == 1
        )
        self._run: RunState | None = None  # a loader's pass (see begin_run)
        self._spans: dict[tuple[int, ...], tuple[np.ndarray[Any, Any], ...]] = {}
        self._received = ReadMetrics()  # what the loader saw (worker restarts)
        self.delivered = dict.fromkeys(self.source_names, 0)  # samples per source, by a loader

    def schedule(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The whole epoch's mix as arrays: (source of each position, its draw number in that
        source); memory: 12 bytes a position (reading never builds it: see :meth:`locate`)."""
        return mix_schedule(self.counts, self.seed, self.cursor.epoch)

    def _epoch_order(self) -> MixOrder:
        """The epoch's mix down to samples, lazy (O(sources + shards) to set up)."""
        epoch = self.cursor.epoch
        if self._order is None or self._order.epoch != epoch:
            self._order = MixOrder(
                self.counts,
                self.seed,
                epoch,
                [(ds.cursor.shard_sizes, ds.spec) for ds in self.sources],
            )
        return self._order

    def locate_many(self, positions: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(source, sample index in that source) of each of ``positions`` of the mix, computed
        for those positions alone.

        Raises:
            IndexError: a position is out of range.
        """
        return self._epoch_order().take(positions)

    def locate(self, position: int) -> tuple[int, int]:
        """(source, sample index in that source) of position ``position`` of the mix.

        Raises:
            IndexError: ``position`` is out of range.
        """
        p = require_int(position, "mix position")
        if not 0 <= p < self.num_samples:
            raise IndexError(f"position {p} out of range for a mix of {self.num_samples}")
        # Located a block at a time: ``mixed[p]`` for p in a row costs one computation.
        at = (self.cursor.epoch, p // _BLOCK)
        if self._block is None or self._block[0] != at:
            start = at[1] * _BLOCK
            positions = np.arange(start, min(start + _BLOCK, self.num_samples), dtype=np.int64)
            self._block = (at, *self.locate_many(positions))
        _, source, index = self._block
        return int(source[p % _BLOCK]), int(index[p % _BLOCK])

    # -- reading -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, position: int) -> dict[str, Any]:
        """Position ``position`` of the epoch's mix: its source's sample, with ``__source__``
        (and its label in the mix's label map)."""
        return self._read(*self.locate(position))

    def _read(self, s: int, index: int) -> dict[str, Any]:
        """Sample ``index`` of source ``s``, marked with its source, its label remapped."""
        sample = self.sources[s][index]
        if not isinstance(sample, dict):
            raise UsageError(
                f"source {s} of the mix gives {type(sample).__name__} samples: a mix needs "
                "dicts (a transform must return one)"
            )
        if SOURCE_KEY in sample:
            raise UsageError(f"a sample of source {s} already has a {SOURCE_KEY!r} field")
        table = self._relabel[s]
        if table is not None and LABEL_EXT in sample:
            sample[LABEL_EXT] = remap(s, sample, table)
        sample[SOURCE_KEY] = s
        return sample

    def __getitems__(self, positions: Sequence[int]) -> Any:
        """A batch: each source's share read with one batch read (see :mod:`.mixread`),
        ``__source__`` an int64 tensor; in a loader's worker, the read figures of the sources
        it read go along, and an error of the data travels intact."""
        wanted = [require_int(p, "mix position") for p in positions]
        if any(not 0 <= p < self.num_samples for p in wanted):
            bad = next(p for p in wanted if not 0 <= p < self.num_samples)
            raise IndexError(f"position {bad} out of range for a mix of {self.num_samples}")
        info = get_worker_info()
        if info is None:
            return self._read_batch(wanted, None)
        if self._run is not None:
            self._run.follow(self.cursor)  # persistent workers: the pass's epoch
        try:
            # Shared now, not while torch pickles it (a full /dev/shm would fail there).
            return share_tensors(self._read_batch(wanted, info.id))
        except ShardioError as exc:
            return WorkerFailure(exc, self._drain(range(len(self.sources))))

    def _read_batch(self, wanted: list[int], worker: int | None) -> dict[str, Any]:
        """The batch of positions ``wanted``, read in worker ``worker`` (None: here)."""
        source, index = self._located(np.asarray(wanted, dtype=np.int64))
        if not self._batched:
            batch = collate_mixed(
                [self._read(s, i) for s, i in zip(source.tolist(), index.tolist(), strict=True)]
            )
            batch[SOURCE_KEY] = torch.tensor(batch[SOURCE_KEY], dtype=torch.int64)
        else:
            ring = self._run.plan.ring if self._run is not None else None

            def build(allocate: Allocate) -> dict[str, Any]:
                return read_shares(self.sources, source, index, allocate, self._relabelled)

            if worker is not None and ring is not None:
                batch = ring.fill(build, worker=worker)
            else:
                batch = build(allocate_shared if worker is not None else allocate_local)
        if worker is not None and self._run is not None:
            batch[METRICS_KEY] = self._drain(np.unique(source).tolist())
            ring = self._run.plan.ring
            if ring is not None:
                return ring.describe(batch, worker=worker)  # type: ignore[return-value]
        return batch

    def _located(self, positions: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
        """:meth:`locate_many` of a batch's ``positions``, a span of the rank's positions
        (every ``step``-th) at a time: locating costs mostly per call (the sources' orders
        are computed for the positions given), and a rank's batches follow each other."""
        n = len(positions)
        step = int(positions[1] - positions[0]) if n > 1 else 1
        if step < 1 or (np.diff(positions) != step).any():
            step = 1
        width = _SPAN * step
        residue = positions % step
        span = (positions - residue) // width
        source = np.empty(n, dtype=np.int64)
        index = np.empty(n, dtype=np.int64)
        for s, r in {(int(a), int(b)) for a, b in zip(span, residue, strict=True)}:
            key = (self.cursor.epoch, step, s, r)
            found = self._spans.get(key)
            if found is None:
                start = s * width + r
                wanted = np.arange(start, min(start + width, self.num_samples), step)
                found = self._spans[key] = self.locate_many(wanted)
                while len(self._spans) > _SPANS_KEPT:
                    del self._spans[next(iter(self._spans))]
            mine = (span == s) & (residue == r)
            at = (positions[mine] - s * width - r) // step
            source[mine], index[mine] = found[0][at], found[1][at]
        return source, index

    def _relabelled(self, s: int, labels: np.ndarray[Any, Any], keys: list[str]) -> Any:
        """Source ``s``'s ``labels`` in the mix's label map."""
        table = self._relabel[s]
        if table is None:
            return labels
        return np.array(
            [
                remap(s, {LABEL_EXT: int(v), "__key__": k}, table)
                for v, k in zip(labels, keys, strict=True)
            ],
            dtype=np.int64,
        )

    def _drain(self, read: Any) -> list[tuple[int, Any]]:
        """In a worker: the read figures of sources ``read`` since its last batch."""
        deltas = [(s, self.sources[s].packed.metrics.drain()) for s in read]
        return [(s, d) for s, d in deltas if d is not None]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The rest of this rank's epoch, sample by sample (the position advances with each;
        an epoch read to its end is read again)."""
        cursor = self.cursor
        cursor.begin()
        world = cursor.ranks().world_size
        stream = cursor.stream()
        for start in range(0, len(stream), _CHUNK):
            part = stream.take(start, start + _CHUNK)
            source, index = self.locate_many(part)
            for s, i in zip(source.tolist(), index.tolist(), strict=True):
                sample = self._read(s, i)
                cursor.advance(world)
                yield sample
        cursor.finish()

    @property
    def dataset_id(self) -> str | None:
        """The id of the mix (the xxh3-128 of its seed, its sources' dataset ids and weights,
        and the label map given as ``classes=``): what a checkpoint of its position records
        (:mod:`shardio.checkpoint`), so that it resumes no other mix; None when a source's id
        is unknown. Its loader's (:attr:`ShardLoader.dataset_id`) is the same."""
        return mix_dataset_id(self)

    # -- a loader's run (ReadSource) -----------------------------------------------------------
    def needs(self, positions: Any, *, batch_size: int, workers: int) -> RunNeeds:
        """What a loader's run over ``positions`` needs: a ring when the sources' shares are
        read in batch reads and every source crosses over ``transport="ring"``; no stall
        watch (the watchdog still replaces stuck workers)."""
        ringed = workers > 0 and self._batched
        ringed = ringed and all(ds.transport == "ring" for ds in self.sources)
        return RunNeeds(
            mode="map",
            slot_bytes=self._slot_bytes(positions, batch_size) if ringed else None,
            read_timeout_s=max(float(ds.read_timeout_s or 0.0) for ds in self.sources),
            watch=None,
            shards=0,
            where=", ".join(str(ds.path) for ds in self.sources),
        )

    def _slot_bytes(self, positions: Any, batch_size: int) -> int:
        """The largest batch payload among the batches ``positions`` makes (a lazy stream:
        an estimate from the sources' mean samples)."""
        n = len(positions)
        if not isinstance(positions, np.ndarray):
            return max(estimated_batch_bytes(ds.packed, n, batch_size) for ds in self.sources)
        source, index = self.locate_many(positions)
        sizes = np.zeros(n, dtype=np.int64)
        for s, ds in enumerate(self.sources):
            places = np.flatnonzero(source == s)
            if len(places):
                sizes[places] = sample_bytes(ds.packed, index[places])
        return largest_batch(sizes, batch_size)

    def begin_run(self, plan: RunPlan) -> None:
        """Take a loader's pass (its workers get it with the mix)."""
        self._run = RunState(plan)

    def end_run(self) -> None:
        """After a loader's pass: direct use reads as before."""
        self._run = None

    def absorb(self, sent: dict[str, Any]) -> None:
        """Take the workers' figures and recovery events (per source) out of ``sent`` (a
        delivered batch, whose samples count as drawn from their sources) and the loader's
        own fault counts.

        Raises:
            UsageError: the figures are malformed.
        """
        for s, delta in sent.pop(METRICS_KEY, None) or ():
            self.sources[s].absorb({METRICS_KEY: delta})
        for s, events in sent.pop(EVENTS_KEY, None) or ():
            self.sources[s].absorb({EVENTS_KEY: events})
        for name, value in sent.pop(FAULTS_KEY, {}).items():
            self._received.add(name, require_int(value, name, minimum=0))
        drawn = sent.get(SOURCE_KEY)
        if drawn is not None:
            counts = np.bincount(np.asarray(drawn), minlength=len(self.sources))
            for name, n in zip(self.source_names, counts.tolist(), strict=True):
                self.delivered[name] += n

    def read_metrics(self) -> ReadMetrics:
        """This rank's read figures: its sources' added up, with the loader's faults."""
        read = self._received.copy()
        for ds in self.sources:
            read.merge(ds.read_metrics())
        return read

    def by_source(self) -> Mapping[str, int]:
        """Samples delivered per source by a loader (the mix drawn)."""
        return self.delivered

    def loader(self, batch_size: int, num_workers: int = 0, **kwargs: Any) -> ShardLoader:
        """The one loader (:class:`~shardio.runtime.loader.ShardLoader`) over this rank's
        share of the mix: ring transport, persistent workers, the watchdog, ``close()``,
        resumable with ``state_dict``."""
        return ShardLoader(self, batch_size=batch_size, num_workers=num_workers, **kwargs)
