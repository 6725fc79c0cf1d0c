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

import errno
import json
import math
import numbers
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xxhash
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from shardio._check import require_int
from shardio.errors import StorageError, UsageError
from shardio.format.spec import LABEL_EXT
from shardio.metrics.read import ReadMetrics
from shardio.metrics.snapshots import MetricsSnapshot, snapshot
from shardio.metrics.steps import StepTimer
from shardio.order.mix import MixCursor, MixOrder, check_weight, mix_counts, mix_schedule
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec
from shardio.order.streams import RankStream
from shardio.read.timeouts import check_read_timeout
from shardio.runtime.dataset import ShardDataset, collate_samples
from shardio.runtime.loader import default_watchdog_s
from shardio.runtime.reaping import kill_workers, stop_workers

__all__ = [
    "METRICS_KEY",
    "SOURCE_KEY",
    "MixedDataset",
    "MixedLoader",
    "collate_mixed",
    "mix_counts",
    "mix_schedule",
]

SOURCE_KEY = "__source__"  # each sample's source index (its keys are the source's own)
MIXED_STATE_VERSION = 1
METRICS_KEY = "__mix_metrics__"  # a worker's read figures per source, with its batch
_SEED_LIMIT = 2**64
_CHUNK = 1 << 16  # positions of a rank's share computed at once (8 bytes each)
_BLOCK = 256  # positions located at once by ``locate``
_SHOWN_CLASSES = 6  # class names of a label map shown in a message


class MixedDataset(Dataset[dict[str, Any]]):
    """A weighted mix of shardio datasets (map-style: ``mixed[p]`` is position ``p`` of the
    epoch's mix; see the module docstring for the epoch, the draws and the rank split).

    Args:
        sources: ``(dataset, weight)`` pairs: ShardDatasets (any mode; a ResilientDataset
            is one), each dataset once (by dataset id and real path: not opened twice, nor
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
                    f"source {s} of the mix must be a ShardDataset (or ResilientDataset), "
                    f"got {type(ds).__name__}"
                )
            if ds.spec.partitioned:
                raise UsageError(
                    f"source {s} of the mix reads partition={ds.spec.partition!r}: a mix needs "
                    "sources with one global order"
                )
            datasets.append(ds)
            weights.append(check_weight(weight, s))
        _refuse_repeats(datasets)
        self.classes, self._relabel = _label_maps(datasets, classes)
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
        self.cursor = MixCursor(spec, self.num_samples, [ds.cursor for ds in datasets])
        self.cursor.ranks()  # the layouts agree, or one line now
        self.cursor.set_epoch(datasets[0].epoch)
        self._order: MixOrder | None = None  # the epoch's, computed position by position
        self._block: tuple[tuple[int, int], np.ndarray[Any, Any], np.ndarray[Any, Any]] | None
        self._block = None  # the block of positions located last (see locate)
        self._ship_metrics = False  # set by MixedLoader: its workers send their read figures

    # -- the epoch ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch (the sources' too)."""
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch, for the mix and every source.

        Raises:
            UsageError: ``epoch`` is not an integer >= 0.
        """
        self.cursor.set_epoch(epoch)

    def ranks(self) -> RankInfo:
        """The sources' common rank layout."""
        return self.cursor.ranks()

    @property
    def drop_last(self) -> bool:
        """Whether each rank's share of the mix is cut instead of padded."""
        return self.cursor.spec.drop_last

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

    def rank_indices(self, *, consumed: int | None = None) -> np.ndarray[Any, Any]:
        """The positions of the mix this rank reads in the rest of the epoch (a sampler for
        a plain DataLoader)."""
        return self.cursor.stream(consumed=consumed).materialise()

    def samples_per_rank(self) -> int:
        """Samples each rank reads in a whole epoch."""
        return self.cursor.samples_per_rank()

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
            sample[LABEL_EXT] = self._remapped(s, sample, table)
        sample[SOURCE_KEY] = s
        return sample

    def _remapped(self, s: int, sample: dict[str, Any], table: tuple[int, ...]) -> int:
        label = sample[LABEL_EXT]
        key = sample.get("__key__")
        if isinstance(label, bool) or not isinstance(label, numbers.Integral):
            raise UsageError(
                f"sample {key!r} of source {s} of the mix has a {LABEL_EXT!r} of type "
                f"{type(label).__name__}: classes= remaps integer labels (a transform must "
                "keep it one)"
            )
        if not 0 <= int(label) < len(table):
            raise UsageError(
                f"sample {key!r} of source {s} of the mix has label {int(label)}, outside its "
                f"label map of {len(table)} classes"
            )
        return table[int(label)]

    def __getitems__(self, positions: Sequence[int]) -> dict[str, Any]:
        """A batch: the samples collated, ``__source__`` an int64 tensor; in a worker, the
        read figures of the sources it read go along."""
        wanted = [require_int(p, "mix position") for p in positions]
        if any(not 0 <= p < self.num_samples for p in wanted):
            bad = next(p for p in wanted if not 0 <= p < self.num_samples)
            raise IndexError(f"position {bad} out of range for a mix of {self.num_samples}")
        source, index = self.locate_many(np.asarray(wanted, dtype=np.int64))
        batch = collate_mixed(
            [self._read(s, i) for s, i in zip(source.tolist(), index.tolist(), strict=True)]
        )
        batch[SOURCE_KEY] = torch.tensor(batch[SOURCE_KEY], dtype=torch.int64)
        if self._ship_metrics and get_worker_info() is not None:
            read = {int(s) for s in batch[SOURCE_KEY].tolist()}
            deltas = [(s, self.sources[s].packed.metrics.drain()) for s in sorted(read)]
            batch[METRICS_KEY] = [(s, d) for s, d in deltas if d is not None]
        return batch

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
        is unknown. Its loader's (:attr:`MixedLoader.dataset_id`) is the same."""
        parts = [
            (ds.packed.resolver.dataset_id, weight)
            for ds, weight in zip(self.sources, self.weights, strict=True)
        ]
        if not all(isinstance(found, str) for found, _ in parts):
            return None
        what: list[Any] = ["mix", self.seed, parts]
        if self.remaps_labels:  # (the id of a mix without classes= is unchanged)
            what.append(list(self.classes or ()))
        return xxhash.xxh3_128_hexdigest(json.dumps(what).encode())

    # -- resumable state ---------------------------------------------------------------------
    def _identity(self) -> list[dict[str, Any]]:
        return [
            {
                "name": name,
                "weight": weight,
                "draws": count,
                "num_samples": ds.num_samples,
                "spec": ds.spec.to_dict(),
                "dataset_id": ds.packed.resolver.dataset_id,
            }
            for name, weight, count, ds in zip(
                self.source_names, self.weights, self.counts, self.sources, strict=True
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        """The position in the mix (global positions delivered) and what the mix is made of
        (plain values: JSON-ready)."""
        return {
            "version": MIXED_STATE_VERSION,
            "kind": "mixed",
            "sources": self._identity(),
            "cursor": self.cursor.state(),
            "classes": list(self.classes) if self.classes is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, also with another number of ranks.

        Raises:
            UsageError: the state is malformed, of another version, or of another mix (other
                sources, weights, seed or source orders).
        """
        if not isinstance(state, Mapping) or state.get("kind") != "mixed":
            raise UsageError("not the state of a MixedDataset (no 'kind': 'mixed')")
        if state.get("version") != MIXED_STATE_VERSION:
            raise UsageError(f"unsupported MixedDataset state version {state.get('version')!r}")
        saved = state.get("sources")
        mine = self._identity()
        if not isinstance(saved, list) or len(saved) != len(mine):
            raise UsageError(
                f"state was saved for a mix of {len(saved) if isinstance(saved, list) else '?'} "
                f"sources, this mix has {len(mine)}: cannot resume"
            )
        for s, (theirs, ours) in enumerate(zip(saved, mine, strict=True)):
            if not isinstance(theirs, Mapping):
                raise UsageError(f"state 'sources'[{s}] must be a dict")
            differ = [
                k
                for k in ours
                if k != "name" and theirs.get(k) != ours[k] and not _unknown_id(k, theirs, ours)
            ]
            if differ:
                raise UsageError(
                    f"state was saved for another mix: source {s} differs in "
                    f"{', '.join(differ)}: cannot resume"
                )
        mine_classes = list(self.classes) if self.classes is not None else None
        if "classes" in state and state["classes"] != mine_classes:  # absent: an older state
            raise UsageError(
                "state was saved for a mix whose labels mean other classes "
                f"({_described(state['classes'])}; this mix: {_described(mine_classes)}): "
                "cannot resume"
            )
        self.cursor.load(state.get("cursor"))  # type: ignore[arg-type]

    def loader(self, batch_size: int, num_workers: int = 0, **kwargs: Any) -> MixedLoader:
        """A DataLoader over this rank's share of the mix, resumable with ``state_dict``."""
        return MixedLoader(self, batch_size=batch_size, num_workers=num_workers, **kwargs)


def _refuse_repeats(datasets: Sequence[ShardDataset]) -> None:
    """Refuse a dataset given twice (as two objects, a recovering copy, a staging area of it
    or a byte-for-byte copy): its samples would be drawn twice an epoch.

    Raises:
        UsageError: naming both sources and the dataset.
    """
    seen: list[tuple[str | None, str]] = []
    for s, ds in enumerate(datasets):
        resolver = ds.packed.resolver
        ident = resolver.identity()
        real = os.path.realpath(resolver.source_root)
        for t, (other_id, other_real) in enumerate(seen):
            if (
                ident.dataset_id is not None and ident.dataset_id == other_id
            ) or real == other_real:
                raise UsageError(
                    f"source {s} of the mix is the same dataset as source {t} "
                    f"({ident.describe()}): its samples would be drawn twice an epoch; give "
                    "each dataset once, with the sum of its weights"
                )
        seen.append((ident.dataset_id, real))


def _show_classes(classes: Sequence[str]) -> str:
    """A label map for a one-line message: its first names and its size."""
    shown = ", ".join(repr(c) for c in classes[:_SHOWN_CLASSES])
    more = ", ..." if len(classes) > _SHOWN_CLASSES else ""
    return f"[{shown}{more}] ({len(classes)} classes)"


def _described(classes: object) -> str:
    """A saved or current label map for a message."""
    if classes is None:
        return "no labels"
    if isinstance(classes, list) and all(isinstance(c, str) for c in classes):
        return f"label map {_show_classes(classes)}"
    return f"label map {type(classes).__name__}"


def _first_difference(a: Sequence[str], b: Sequence[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"class {i} is {x!r} in one, {y!r} in the other"
    return f"one has {len(a)} classes, the other {len(b)}"


def _label_maps(
    datasets: Sequence[ShardDataset], classes: Sequence[str] | None
) -> tuple[tuple[str, ...] | None, tuple[tuple[int, ...] | None, ...]]:
    """The mix's label map and, per source, the table from its labels to the mix's (None:
    unchanged).

    Raises:
        UsageError: labelled sources with different maps and no ``classes``; a bad
            ``classes``, or one that lacks a class of a source.
    """
    maps = [ds.classes for ds in datasets]
    labelled = [(s, found) for s, found in enumerate(maps) if found is not None]
    if classes is None:
        for s, mine in labelled[1:]:
            t, first = labelled[0]
            if mine != first:
                raise UsageError(
                    f"sources {t} ({datasets[t].path}) and {s} ({datasets[s].path}) of the mix "
                    f"have different label maps, {_show_classes(first)} and "
                    f"{_show_classes(mine)} ({_first_difference(first, mine)}): one cls would "
                    "mean two classes; give the mix's map as classes=[...] to remap them"
                )
        return (labelled[0][1] if labelled else None), (None,) * len(datasets)
    wanted = _check_classes(classes)
    if not labelled:
        raise UsageError("classes= remaps the sources' labels, but no source of the mix has any")
    position = {name: i for i, name in enumerate(wanted)}
    tables: list[tuple[int, ...] | None] = []
    for s, found in enumerate(maps):
        if found is None:
            tables.append(None)
            continue
        missing = [name for name in found if name not in position]
        if missing:
            raise UsageError(
                f"source {s} of the mix ({datasets[s].path}) has classes that classes= lacks: "
                f"{_show_classes(missing)}"
            )
        table = tuple(position[name] for name in found)
        tables.append(None if table == tuple(range(len(table))) else table)
    return wanted, tuple(tables)


def _check_classes(classes: object) -> tuple[str, ...]:
    """``classes`` as a label map: a non-empty list of distinct, non-empty strings.

    Raises:
        UsageError: naming what is wrong.
    """
    if not isinstance(classes, Sequence) or isinstance(classes, str | bytes):
        raise UsageError(f"classes must be a list of class names, got {type(classes).__name__}")
    if not classes:
        raise UsageError("classes must name at least one class, got none")
    seen: set[str] = set()
    for i, name in enumerate(classes):
        if not isinstance(name, str) or not name:
            raise UsageError(f"classes[{i}] must be a non-empty string, got {name!r}")
        if name in seen:
            raise UsageError(f"classes holds {name!r} twice")
        seen.add(name)
    return tuple(classes)


def _unknown_id(key: str, theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> bool:
    """A dataset id that one side could not tell (None) does not count as a difference."""
    return key == "dataset_id" and (theirs.get(key) is None or ours[key] is None)


def collate_mixed(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Collate samples as ShardDataset does; samples of sources with other fields give a list
    per field (None where a sample lacks it), labels included."""
    fields = list(dict.fromkeys(f for s in samples for f in s))
    if all(len(s) == len(fields) for s in samples):
        return collate_samples(samples)
    batch: dict[str, Any] = {f: [s.get(f) for s in samples] for f in fields}
    if all(v is not None for v in batch.get(LABEL_EXT, [None])):
        batch[LABEL_EXT] = torch.tensor(batch[LABEL_EXT], dtype=torch.int64)
    return batch


def _identity_collate(batch: Any) -> Any:
    return batch


class _PositionSampler(Sampler[int]):
    """A rank's positions of the mix, computed a chunk at a time (a Python list of a rank's
    share of a billion-sample mix would take tens of GB)."""

    def __init__(self, positions: RankStream) -> None:
        self.positions = positions

    def __iter__(self) -> Iterator[int]:
        for start in range(0, len(self.positions), _CHUNK):
            yield from self.positions.take(start, start + _CHUNK).tolist()

    def __len__(self) -> int:
        return len(self.positions)


class MixedLoader:
    """Batches of a :class:`MixedDataset` through a torch DataLoader; resumable mid-epoch.

    The loader counts the samples it hands to the training loop (the mix's cursor), so
    ``state_dict()`` after step k resumes at the first sample not yet delivered, as
    ShardLoader does. Batches are collated samples (``jpeg`` a list of bytes, ``cls`` and
    ``__source__`` int64 tensors), read in the workers by each sample's own source.

    Args:
        dataset: the mix.
        batch_size: samples per batch (an int >= 1).
        num_workers: DataLoader worker processes (an int >= 0).
        drop_last: drop this rank's last incomplete batch.
        worker_timeout_s: with workers, the seconds without a batch after which the loader
            kills them and raises ``StorageError`` (ETIMEDOUT; a read that never returns:
            a dead data server, a hung mount). None (default): as ShardLoader, six read
            deadlines of the slowest source, at least a minute, or none when no source reads
            under a deadline; 0: never. ``state_dict()`` then resumes at the first sample
            not delivered.
        **kwargs: passed to ``torch.utils.data.DataLoader`` (pin_memory, prefetch_factor,
            multiprocessing_context, ...).
    """

    def __init__(
        self,
        dataset: MixedDataset,
        *,
        batch_size: int,
        num_workers: int = 0,
        drop_last: bool = False,
        worker_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.batch_size = require_int(batch_size, "batch_size", minimum=1)
        self.worker_timeout_s = check_read_timeout(worker_timeout_s, "worker_timeout_s")
        self.num_workers = require_int(num_workers, "num_workers", minimum=0)
        if not isinstance(drop_last, bool):
            raise UsageError(f"drop_last must be True or False, got {drop_last!r}")
        for key in ("sampler", "batch_sampler", "shuffle", "collate_fn", "batch_size", "timeout"):
            if key in kwargs:
                hint = " (pass worker_timeout_s)" if key == "timeout" else ""
                raise UsageError(f"MixedLoader sets {key} itself{hint}")
        if kwargs.get("in_order") is False:
            raise UsageError("MixedLoader needs in_order=True: resume relies on the order")
        self.dataset = dataset
        self.drop_last = drop_last
        self.kwargs = kwargs
        self.steps = StepTimer()
        self.delivered = dict.fromkeys(dataset.source_names, 0)  # samples per source

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (the mix's and its sources')."""
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        n = self.dataset.samples_per_rank()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _watchdog_s(self) -> float:
        """Seconds without a batch after which the workers are deemed stuck (0: never)."""
        if self.num_workers == 0:
            return 0.0
        if self.worker_timeout_s is not None:
            return self.worker_timeout_s
        return default_watchdog_s(max(ds.read_timeout_s or 0.0 for ds in self.dataset.sources))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        cursor = self.dataset.cursor
        cursor.begin()  # an epoch read to its end is read again, as a DataLoader does
        world = cursor.ranks().world_size
        positions = cursor.stream()
        if self.drop_last:
            positions = positions.head(len(positions) // self.batch_size * self.batch_size)
        # Nothing of the epoch's size is computed: each process locates the positions of its
        # batches when it reads them (MixSchedule), a few microseconds a sample.
        self.dataset._ship_metrics = self.num_workers > 0
        watchdog = self._watchdog_s()
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=_PositionSampler(positions),
            num_workers=self.num_workers,
            collate_fn=_identity_collate,
            timeout=watchdog,
            **self.kwargs,
        )
        names = self.dataset.source_names
        batches = iter(loader)
        clock = time.perf_counter_ns
        try:
            self.steps.start()
            while True:
                asked = clock()
                try:
                    batch = next(batches)
                except StopIteration:
                    cursor.finish()
                    return
                except RuntimeError as exc:
                    if not watchdog or "timed out" not in str(exc):
                        raise
                    kill_workers(batches)
                    paths = ", ".join(str(ds.path) for ds in self.dataset.sources)
                    raise StorageError(
                        errno.ETIMEDOUT,
                        f"no batch arrived for {watchdog:g} s from the mix's DataLoader "
                        f"workers (killed): reads of {paths} do not complete (is a storage "
                        f"server down?); state_dict() resumes after {cursor.consumed} samples",
                    ) from None
                for s, delta in batch.pop(METRICS_KEY, ()):
                    self.dataset.sources[s].absorb_metrics(delta)
                drawn = np.bincount(batch[SOURCE_KEY].numpy(), minlength=len(names))
                for name, n in zip(names, drawn.tolist(), strict=True):
                    self.delivered[name] += n
                cursor.advance(len(batch["__key__"]) * world)
                now = clock()
                self.steps.batch(wait_ns=now - asked, samples=len(batch["__key__"]), now_ns=now)
                yield batch
        finally:
            # Now, not when the garbage collector finds the iterator: batches in flight of a
            # run left early must not arrive later.
            stop_workers(batches)
            self.dataset._ship_metrics = False

    def metrics(self) -> MetricsSnapshot:
        """This rank's data path so far: the sources' read figures added up, the loop's
        timings, and in ``sources`` the samples delivered per source (the mix drawn)."""
        read = ReadMetrics()
        for ds in self.dataset.sources:
            read.merge(ds.read_metrics())
        ranks = self.dataset.ranks()
        return snapshot(
            read,
            self.steps,
            rank=ranks.rank,
            world_size=ranks.world_size,
            sources=self.delivered,
        )

    @property
    def dataset_id(self) -> str | None:
        """The id of the mix it reads (:attr:`MixedDataset.dataset_id`)."""
        return self.dataset.dataset_id

    def state_dict(self) -> dict[str, Any]:
        """Where the mix stands (:meth:`MixedDataset.state_dict`)."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, also with another number of ranks."""
        self.dataset.load_state_dict(state)
