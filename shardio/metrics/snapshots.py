"""MetricsSnapshot: one rank's data-path figures at one moment, typed and JSON-ready.

``loader.metrics()`` returns one; the exporters of :mod:`shardio.metrics` log it, write it
as a JSON line or serve it to Prometheus. Snapshots of several ranks add up with
:func:`combine` (a node's or a job's totals).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardio.errors import UsageError
from shardio.metrics.histogram import LatencyHistogram, LatencySummary, stddev
from shardio.metrics.read import COUNTERS, ReadMetrics
from shardio.metrics.steps import StepTimer

__all__ = ["MetricsSnapshot", "combine", "snapshot"]

SNAPSHOT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class MetricsSnapshot:
    """One rank's data path at ``time_s``.

    Attributes:
        rank: the rank (0 on a single process).
        world_size: ranks in the job.
        time_s: when it was taken (Unix time).
        elapsed_s: wall time of the loader's iterations up to their last batch.
        samples: samples delivered to the training loop.
        batches: batches delivered.
        samples_read: samples read by this rank's workers (prefetched ones included).
        bytes_read: payload bytes read, ``bytes_staged`` from staged copies and
            ``bytes_source`` from the source (the parallel filesystem).
        samples_per_s: ``samples / elapsed_s``.
        bytes_per_s: ``bytes_read / elapsed_s``.
        read_latency: member read latency by source: "staged", "source" and "all".
        counters: every read counter (see :data:`shardio.metrics.read.COUNTERS`): opens,
            cache hits and misses, checksum failures, read errors, retries, repairs.
        steps: steps timed (a batch following another in one iteration).
        step_mean_s: mean step time (compute on a batch plus the wait for the next).
        step_std_s: its standard deviation.
        wait_s: time the loop waited for batches, in total.
        wait_latency: the wait per batch.
        stall_fraction: ``wait_s / elapsed_s``: the share of the time the loop was starved.
        transport: batches by how they crossed from the workers ("ring", "fallback").
        sources: samples delivered per source of a mix (``MixedDataset``), by source name;
            empty for a single dataset.
        histograms: the latency histograms themselves (for exporters), by name:
            "read_staged", "read_source", "wait", "step".
    """

    rank: int
    world_size: int
    time_s: float
    elapsed_s: float
    samples: int
    batches: int
    samples_read: int
    bytes_read: int
    bytes_staged: int
    bytes_source: int
    samples_per_s: float
    bytes_per_s: float
    read_latency: Mapping[str, LatencySummary]
    counters: Mapping[str, int]
    steps: int
    step_mean_s: float
    step_std_s: float
    wait_s: float
    wait_latency: LatencySummary
    stall_fraction: float
    transport: Mapping[str, int] = field(default_factory=dict)
    sources: Mapping[str, int] = field(default_factory=dict)
    histograms: Mapping[str, LatencyHistogram] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The snapshot as JSON-ready values: latencies as their summaries, and under
        "histograms" the histograms themselves in their wire form (read back by
        :meth:`from_dict`)."""
        return {
            "version": SNAPSHOT_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "time_s": self.time_s,
            "elapsed_s": self.elapsed_s,
            "samples": self.samples,
            "batches": self.batches,
            "samples_read": self.samples_read,
            "bytes_read": self.bytes_read,
            "bytes_staged": self.bytes_staged,
            "bytes_source": self.bytes_source,
            "samples_per_s": self.samples_per_s,
            "bytes_per_s": self.bytes_per_s,
            "read_latency": {k: v.to_dict() for k, v in self.read_latency.items()},
            "counters": dict(self.counters),
            "steps": self.steps,
            "step_mean_s": self.step_mean_s,
            "step_std_s": self.step_std_s,
            "wait_s": self.wait_s,
            "wait_latency": self.wait_latency.to_dict(),
            "stall_fraction": self.stall_fraction,
            "transport": dict(self.transport),
            "sources": dict(self.sources),
            "histograms": {k: _wire_to_json(v.to_wire()) for k, v in self.histograms.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetricsSnapshot:
        """The snapshot :meth:`to_dict` described (after a JSON round trip too), checked.

        Keys it does not know are ignored (a JSON line may carry a "job"); a dict without
        "histograms" gives a snapshot without them.

        Raises:
            UsageError: ``data`` is not such a description, or of another version.
        """
        if not isinstance(data, Mapping):
            raise UsageError(f"metrics snapshot: expected a mapping, got {type(data).__name__}")
        if data.get("version") != SNAPSHOT_VERSION:
            raise UsageError(
                f"metrics snapshot: unsupported version {data.get('version')!r} "
                f"(this shardio reads version {SNAPSHOT_VERSION})"
            )
        try:
            return cls(
                rank=_integer(data, "rank"),
                world_size=_count(data, "world_size"),
                time_s=_real(data, "time_s"),
                elapsed_s=_real(data, "elapsed_s"),
                samples=_count(data, "samples"),
                batches=_count(data, "batches"),
                samples_read=_count(data, "samples_read"),
                bytes_read=_count(data, "bytes_read"),
                bytes_staged=_count(data, "bytes_staged"),
                bytes_source=_count(data, "bytes_source"),
                samples_per_s=_real(data, "samples_per_s"),
                bytes_per_s=_real(data, "bytes_per_s"),
                read_latency={
                    str(k): _summary(v) for k, v in _mapping(data, "read_latency").items()
                },
                counters=_counts(data, "counters"),
                steps=_count(data, "steps"),
                step_mean_s=_real(data, "step_mean_s"),
                step_std_s=_real(data, "step_std_s"),
                wait_s=_real(data, "wait_s"),
                wait_latency=_summary(data["wait_latency"]),
                stall_fraction=_real(data, "stall_fraction"),
                transport=_counts(data, "transport"),
                sources=_counts(data, "sources", optional=True),
                histograms={
                    str(k): LatencyHistogram.from_wire(_wire_from_json(v))
                    for k, v in _mapping(data, "histograms", optional=True).items()
                },
            )
        except UsageError:
            raise
        except KeyError as exc:
            raise UsageError(f"metrics snapshot: missing key {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise UsageError(f"metrics snapshot: malformed: {exc}") from exc

    @property
    def has_data(self) -> bool:
        """Whether a batch was delivered or a sample read yet (a snapshot taken before
        training began holds only zeros)."""
        return self.batches > 0 or self.samples_read > 0 or self.bytes_read > 0

    @property
    def stalls(self) -> int:
        """Reads abandoned after their deadline (``read_timeout_s``)."""
        return int(self.counters.get("stalls", 0))

    @property
    def stall_time_s(self) -> float:
        """Time lost waiting on reads that were then abandoned, in seconds."""
        return self.counters.get("stall_ms", 0) / 1000.0

    def line(self) -> str:
        """A one-line summary for a log."""
        read = self.read_latency.get("all")
        hits, misses = self.counters.get("cache_hits", 0), self.counters.get("cache_misses", 0)
        parts = [
            f"rank {self.rank}/{self.world_size}",
            f"{self.samples_per_s:,.0f} samples/s",
            f"{self.bytes_per_s / 1e6:,.1f} MB/s",
        ]
        if read is not None and read.count:
            parts.append(f"read p50 {_ms(read.p50_s)} p99 {_ms(read.p99_s)} max {_ms(read.max_s)}")
        parts.append(f"stall {self.stall_fraction:.1%}")
        if self.steps:
            parts.append(f"step {_ms(self.step_mean_s)} ± {_ms(self.step_std_s)}")
        if hits + misses:
            parts.append(f"cache hits {hits / (hits + misses):.0%}")
        if self.counters.get("cache_missing", 0):  # cache= named no staging area (a typo?)
            parts.append("cache missing: reading the source")
        faults = {
            k: self.counters.get(k, 0)
            for k in ("checksum_failures", "read_errors", "retries", "restages", "substitutes")
        }
        moved = [f"{k.replace('_', ' ')} {v}" for k, v in faults.items() if v]
        if self.stalls:
            moved.append(f"read stalls {self.stalls} ({self.stall_time_s:.1f} s lost)")
        parts.append(", ".join(moved) if moved else "no faults")
        return " | ".join(parts)


def _integer(data: Mapping[str, Any], key: str) -> int:
    value = data[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"metrics snapshot: {key} must be an integer, not {value!r}")
    return value


def _count(data: Mapping[str, Any], key: str) -> int:
    value = _integer(data, key)
    if value < 0:
        raise UsageError(f"metrics snapshot: {key} must be >= 0, not {value!r}")
    return value


def _real(data: Mapping[str, Any], key: str) -> float:
    value = data[key]
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise UsageError(f"metrics snapshot: {key} must be a number, not {value!r}")
    return float(value)


def _mapping(data: Mapping[str, Any], key: str, *, optional: bool = False) -> Mapping[Any, Any]:
    value = data.get(key, {}) if optional else data[key]
    if not isinstance(value, Mapping):
        raise UsageError(f"metrics snapshot: {key} must be a mapping, not {value!r}")
    return value


def _counts(data: Mapping[str, Any], key: str, *, optional: bool = False) -> dict[str, int]:
    values = _mapping(data, key, optional=optional)
    return {str(k): _count(values, k) for k in values}


def _summary(value: object) -> LatencySummary:
    if not isinstance(value, Mapping):
        raise UsageError(f"metrics snapshot: a latency summary must be a mapping, not {value!r}")
    return LatencySummary(
        count=_count(value, "count"),
        mean_s=_real(value, "mean_s"),
        p50_s=_real(value, "p50_s"),
        p95_s=_real(value, "p95_s"),
        p99_s=_real(value, "p99_s"),
        max_s=_real(value, "max_s"),
    )


def _wire_to_json(wire: tuple[tuple[tuple[int, int], ...], int, int, int]) -> list[Any]:
    pairs, total, least, most = wire
    return [[list(p) for p in pairs], total, least, most]


def _wire_from_json(value: object) -> Any:
    # JSON turns the wire form's tuples into lists; from_wire checks the rest.
    if not isinstance(value, list | tuple) or len(value) != 4:
        raise UsageError(f"metrics snapshot: malformed histogram {value!r:.80}")
    pairs, total, least, most = value
    if not isinstance(pairs, list | tuple) or not all(
        isinstance(p, list | tuple) and len(p) == 2 for p in pairs
    ):
        raise UsageError(f"metrics snapshot: malformed histogram buckets {pairs!r:.80}")
    return tuple(tuple(p) for p in pairs), total, least, most


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 0.001 else f"{seconds * 1e6:.0f} µs"


def snapshot(
    read: ReadMetrics,
    steps: StepTimer,
    *,
    rank: int = 0,
    world_size: int = 1,
    transport: Mapping[str, int] | None = None,
    sources: Mapping[str, int] | None = None,
) -> MetricsSnapshot:
    """The snapshot of a rank's read figures and training-side timings (``sources``: the
    samples delivered per source of a mix)."""
    elapsed_s = steps.wall_ns / 1e9
    all_reads = read.all_latency()
    return MetricsSnapshot(
        rank=rank,
        world_size=world_size,
        time_s=time.time(),
        elapsed_s=elapsed_s,
        samples=steps.samples,
        batches=steps.batches,
        samples_read=read["samples"],
        bytes_read=read.bytes_read,
        bytes_staged=read["bytes_staged"],
        bytes_source=read["bytes_source"],
        samples_per_s=steps.samples / elapsed_s if elapsed_s > 0 else 0.0,
        bytes_per_s=read.bytes_read / elapsed_s if elapsed_s > 0 else 0.0,
        read_latency={
            "staged": read.latency["staged"].summary(),
            "source": read.latency["source"].summary(),
            "all": all_reads.summary(),
        },
        counters=dict(read.counts),
        steps=steps.step.count,
        step_mean_s=steps.step_mean_s,
        step_std_s=steps.step_std_s,
        wait_s=steps.wait_ns / 1e9,
        wait_latency=steps.wait.summary(),
        stall_fraction=steps.stall_fraction,
        transport=dict(transport or {}),
        sources=dict(sources or {}),
        histograms={
            "read_staged": read.latency["staged"].copy(),
            "read_source": read.latency["source"].copy(),
            "wait": steps.wait.copy(),
            "step": steps.step.copy(),
        },
    )


def combine(snapshots: Sequence[MetricsSnapshot]) -> MetricsSnapshot:
    """The sum of several ranks' snapshots (rank -1): counts and histograms add, rates add,
    the stall fraction is the mean of the ranks' (each rank stalls on its own).

    Raises:
        ValueError: ``snapshots`` is empty.
    """
    if not snapshots:
        raise ValueError("combine() needs at least one snapshot")
    hists: dict[str, LatencyHistogram] = {}
    for snap in snapshots:
        for name, hist in snap.histograms.items():
            hists.setdefault(name, LatencyHistogram()).merge(hist)
    read_all = LatencyHistogram()
    for name in ("read_staged", "read_source"):
        if name in hists:
            read_all.merge(hists[name])
    empty = LatencyHistogram()
    counters = {k: sum(s.counters.get(k, 0) for s in snapshots) for k in COUNTERS}
    steps = sum(s.steps for s in snapshots)
    step_sum = sum(s.step_mean_s * s.steps for s in snapshots)
    step_sq = sum((s.step_std_s**2 + s.step_mean_s**2) * s.steps for s in snapshots)
    transport: dict[str, int] = {}
    for snap in snapshots:
        for k, v in snap.transport.items():
            transport[k] = transport.get(k, 0) + v
    sources: dict[str, int] = {}
    for snap in snapshots:
        for k, v in snap.sources.items():
            sources[k] = sources.get(k, 0) + v
    return MetricsSnapshot(
        rank=-1,
        world_size=max(s.world_size for s in snapshots),
        time_s=max(s.time_s for s in snapshots),
        elapsed_s=max(s.elapsed_s for s in snapshots),
        samples=sum(s.samples for s in snapshots),
        batches=sum(s.batches for s in snapshots),
        samples_read=sum(s.samples_read for s in snapshots),
        bytes_read=sum(s.bytes_read for s in snapshots),
        bytes_staged=sum(s.bytes_staged for s in snapshots),
        bytes_source=sum(s.bytes_source for s in snapshots),
        samples_per_s=sum(s.samples_per_s for s in snapshots),
        bytes_per_s=sum(s.bytes_per_s for s in snapshots),
        read_latency={
            "staged": hists.get("read_staged", empty).summary(),
            "source": hists.get("read_source", empty).summary(),
            "all": read_all.summary(),
        },
        counters=counters,
        steps=steps,
        step_mean_s=step_sum / steps if steps else 0.0,
        step_std_s=stddev(step_sum, step_sq, steps),
        wait_s=sum(s.wait_s for s in snapshots),
        wait_latency=hists.get("wait", empty).summary(),
        stall_fraction=sum(s.stall_fraction for s in snapshots) / len(snapshots),
        transport=transport,
        sources=sources,
        histograms=hists,
    )
