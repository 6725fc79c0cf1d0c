"""ReadMetrics: the one set of counters and latency histograms of a process's reads.

Every part of the read path counts here and nowhere else: the file pool (opens), the map
cache (map opens), the resolver (cache hits and misses, dropped and re-staged copies), the
reader (bytes, samples and read latency by source, checksum failures, read errors, copies
evicted under it, which are not errors) and the
recovery steps (retries, substitutes, rebuilds). A DataLoader worker drains its figures into
a :class:`ReadDelta` that travels with the batch it read (no channel of its own); the
training process merges the deltas into one ReadMetrics per rank.

A forked child starts from zero: its parent's figures stay the parent's.

Recording a read costs one append to a plain array (a few hundred nanoseconds would be a
measurable share of a 20 µs read from the page cache); the values are bucketed with numpy
when the figures are read, drained, or every 4,096 reads.
"""

from __future__ import annotations

import os
import threading
import weakref
from array import array
from dataclasses import dataclass
from typing import Any

from shardio.errors import UsageError
from shardio.metrics.histogram import LatencyHistogram

__all__ = ["COUNTERS", "SOURCES", "ReadDelta", "ReadMetrics"]

# Where a read was served from: a verified staged copy (node-local) or the source (the
# parallel filesystem).
SOURCES = ("staged", "source")
COUNTERS = (
    "samples",  # samples read (a batch's samples, counted once the batch is read)
    "members",  # member reads (files inside samples), timed or not
    "bytes_staged",
    "bytes_source",
    "opens_staged",  # shard files opened (pool), by source
    "opens_source",
    "map_opens",  # shard files mapped (the opt-in mmap transport)
    "cache_hits",  # shards located in the staging area
    "cache_misses",  # shards read from the source while a staging area is in use
    "cache_missing",  # a cache= that holds no staging area (missing, empty, not one) at open
    "evictions",  # a staged copy located, then evicted before it was opened: not an error
    "drop_failures",  # a bad staged copy that could not be removed (read-only disk): kept
    "checksum_failures",  # members whose bytes differed from the index (any source)
    "read_errors",  # failed, short or truncated reads (any source)
    "retries",  # recovery: a sample read again
    "recovered",  # recovery: a retry that read the sample
    "restages",  # a bad staged copy staged again from the source
    "restage_failures",
    "drops",  # a bad staged copy passed over for the source
    "rebuilds",  # a source shard rebuilt by the rebuild hook
    "substitutes",  # policy "skip": a sample replaced by another
    "unavailable",  # policy "raise": a sample given up on
    "stalls",  # reads abandoned after their deadline (read_timeout_s)
    "stall_ms",  # time lost waiting on them, in milliseconds
    "held_fails",  # reads refused at once: their shard was held unavailable after a stall
    "worker_restarts",  # DataLoader workers torn down by the loader's watchdog
)
_LIVE: weakref.WeakSet[ReadMetrics] = weakref.WeakSet()
_FOLD_EVERY = 4096  # reads kept raw before they are bucketed


@dataclass(frozen=True)
class ReadDelta:
    """What a worker read since its last batch: counters and read times, compact.

    Attributes:
        counts: (name, value) pairs of the counters that moved.
        latency: (source, histogram wire form) pairs of histograms already bucketed.
        raw: (source, ``array("q")`` of read times in ns) pairs not bucketed yet; the
            training process buckets them when its figures are read (a few bytes per read,
            and no numpy call per batch in the worker).
    """

    counts: tuple[tuple[str, int], ...]
    latency: tuple[tuple[str, Any], ...] = ()
    raw: tuple[tuple[str, Any], ...] = ()


class ReadMetrics:
    """Counters and per-source read-latency histograms of one process (or, merged, a rank).

    Attributes:
        counts: the counters, by name (:data:`COUNTERS`).
    """

    def __init__(self) -> None:
        self.reset()
        _LIVE.add(self)

    def reset(self) -> None:
        """Back to zero."""
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._latency: dict[str, LatencyHistogram] = {s: LatencyHistogram() for s in SOURCES}
        self._raw_staged = array("q")  # read times not bucketed yet
        self._raw_source = array("q")
        self._fold_lock = threading.Lock()  # a fresh one in a forked child (reset runs there)

    @property
    def latency(self) -> dict[str, LatencyHistogram]:
        """Read-latency histograms by source (:data:`SOURCES`)."""
        self._fold()
        return self._latency

    def _fold(self) -> None:
        # Another thread may read the figures (a reporter) while this one records: one fold
        # at a time takes the first n values and deletes exactly those (``del a[:n]`` is one
        # C call), so a value appended meanwhile stays for the next fold. Recording takes no
        # lock.
        with self._fold_lock:
            for source, raw in (("staged", self._raw_staged), ("source", self._raw_source)):
                n = len(raw)
                if n:
                    self._latency[source].record_many(raw[:n])
                    del raw[:n]

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        self.counts[name] += n

    def record_stall(self, waited_s: float) -> None:
        """A read abandoned after its deadline, ``waited_s`` lost (``stalls``, ``stall_ms``),
        or, with nothing waited, refused at once: its file is held unavailable
        (``held_fails``)."""
        if waited_s > 0:
            self.counts["stalls"] += 1
            self.counts["stall_ms"] += round(waited_s * 1000)
        else:
            self.counts["held_fails"] += 1

    def record_read(self, staged: bool, nbytes: int, ns: int | None) -> None:
        """One member read of ``nbytes`` that took ``ns`` nanoseconds (None: not timed).

        Positional (a keyword call costs more, on every member read).
        """
        counts = self.counts
        counts["members"] += 1
        if staged:
            counts["bytes_staged"] += nbytes
            raw = self._raw_staged
        else:
            counts["bytes_source"] += nbytes
            raw = self._raw_source
        if ns is not None:
            raw.append(ns)
            if len(raw) >= _FOLD_EVERY:
                self._fold()

    def record_reads(self, staged: bool, count: int, nbytes: int, ns: list[int]) -> None:
        """``count`` member reads of ``nbytes`` in all from one source, ``ns`` how long each
        took (empty: not timed): :meth:`record_read` for a batch at once."""
        counts = self.counts
        counts["members"] += count
        counts["bytes_staged" if staged else "bytes_source"] += nbytes
        raw = self._raw_staged if staged else self._raw_source
        raw.extend(ns)
        if len(raw) >= _FOLD_EVERY:
            self._fold()

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    @property
    def bytes_read(self) -> int:
        """Payload bytes read from either source."""
        return self.counts["bytes_staged"] + self.counts["bytes_source"]

    def all_latency(self) -> LatencyHistogram:
        """Read latency of every source together."""
        out = LatencyHistogram()
        for hist in self.latency.values():
            out.merge(hist)
        return out

    def merge(self, other: ReadMetrics) -> None:
        """Add ``other``'s figures to these."""
        for name, value in other.counts.items():
            self.counts[name] += value
        for source, hist in other.latency.items():
            self.latency[source].merge(hist)

    def copy(self) -> ReadMetrics:
        """An independent copy."""
        out = ReadMetrics()
        out.merge(self)
        return out

    # -- worker -> training process -------------------------------------------------------
    def drain(self) -> ReadDelta | None:
        """The figures since the last drain, which are zeroed; None when nothing moved."""
        counts = tuple((k, v) for k, v in self.counts.items() if v)
        latency = tuple((s, h.to_wire()) for s, h in self._latency.items() if h.max_ns)
        raw = tuple(
            (source, values)
            for source, values in (("staged", self._raw_staged), ("source", self._raw_source))
            if values
        )
        if not counts and not latency and not raw:
            return None
        self.reset()
        return ReadDelta(counts, latency, raw)

    def absorb(self, delta: object) -> None:
        """Add a worker's :class:`ReadDelta` (checked: it crossed a process boundary).

        Raises:
            UsageError: ``delta`` is not a well-formed ReadDelta.
        """
        if not isinstance(delta, ReadDelta):
            raise UsageError(f"read metrics: expected a ReadDelta, got {type(delta).__name__}")
        counts: dict[str, int] = {}
        latency: dict[str, LatencyHistogram] = {}
        raw: list[tuple[str, array[int]]] = []
        try:
            for name, value in delta.counts:
                if name not in self.counts or not _is_count(value):
                    raise UsageError(f"read metrics: bad counter {name!r}={value!r}")
                counts[name] = value
            for source, wire in delta.latency:
                if source not in self._latency:
                    raise UsageError(f"read metrics: unknown source {source!r}")
                latency[source] = LatencyHistogram.from_wire(wire)
            for source, values in delta.raw:
                if source not in self._latency:
                    raise UsageError(f"read metrics: unknown source {source!r}")
                if not isinstance(values, array) or values.typecode != "q" or min(values) < 0:
                    raise UsageError("read metrics: read times must be an array('q') of ns >= 0")
                raw.append((source, values))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"read metrics: malformed delta: {exc}") from exc
        for name, value in counts.items():
            self.counts[name] += value
        for source, hist in latency.items():
            self._latency[source].merge(hist)
        for source, values in raw:
            pending = self._raw_staged if source == "staged" else self._raw_source
            pending.extend(values)
            if len(pending) >= _FOLD_EVERY:
                self._fold()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into a spawned worker: the worker counts its own reads from zero.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        del state
        self.__init__()  # type: ignore[misc]

    def __repr__(self) -> str:
        moved = {k: v for k, v in self.counts.items() if v}
        return f"ReadMetrics({moved})"


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _reset_in_child() -> None:
    for metrics in list(_LIVE):
        metrics.reset()


os.register_at_fork(after_in_child=_reset_in_child)
