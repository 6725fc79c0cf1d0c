"""The soak run and its growth detector: memory, descriptors and threads over many epochs.

:func:`soak` reads a plain dataset (stream mode) and a 2-source :class:`MixedDataset`
(map mode) one epoch after the other, epoch after epoch, through ``ds.loader`` with
persistent workers, the Prometheus exporter on (127.0.0.1, a free port) and scraped once an
epoch. After each epoch it samples, from /proc, the training process and each DataLoader
worker: RSS, PSS and USS (``smaps_rollup``), open descriptors, threads, and the shared-memory
areas mapped (``/dev/shm`` in ``maps``). :func:`judge` is the detector that
``bench_soak.py`` reports with and ``tests/integration/test_soak.py`` asserts with.

Memory is noisy (allocator arenas, the page cache behind mapped shards, a worker's
copy-on-write pages after the fork), so the detector skips the warm-up epochs and asks two
things of each process's memory: the least-squares slope over the second half of the run
under a limit (a leak keeps growing; a plateau does not), and the end's median (over the
last tenth) less the start's (the first tenth) under a limit. Descriptors, threads and shared
memory must not grow at all: a leak there is whole units, so the smallest count of the last
tenth is compared with the largest of the first tenth.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common import child_pids  # benchmarks/ is on sys.path (the bench, the test)

__all__ = [
    "METRICS",
    "Limits",
    "ProcSample",
    "SoakRun",
    "growth",
    "judge",
    "sample_process",
    "slope",
    "soak",
]

METRICS = ("rss_kib", "anon_kib", "pss_kib", "uss_kib", "fds", "threads", "shm_maps")
JUDGED_MEMORY = ("rss_kib", "anon_kib")  # USS and PSS move as pages become shared or not


@dataclass(frozen=True)
class ProcSample:
    """One process at one epoch's end (KiB; counts)."""

    rss_kib: int
    anon_kib: int  # RssAnon: the heap, where a leak lands (not the page cache of mapped files)
    pss_kib: int  # proportional set size: shared pages divided among their users
    uss_kib: int  # unique set size: pages only this process maps (private clean + dirty)
    fds: int
    threads: int
    shm_maps: int  # distinct /dev/shm files mapped (torch's shared tensors, the ring)


def _status_fields(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "Threads"):
                out[key] = int(value.split()[0])
    return out


def _rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("Pss", "Private_Clean", "Private_Dirty"):
                    out[key] = int(value.split()[0])
    except OSError:  # a kernel without smaps_rollup (before 4.14): RSS only
        pass
    return out


def _shm_maps(pid: int) -> int:
    paths = set()
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                paths.add(parts[5].strip())
    return len(paths)


def sample_process(pid: int) -> ProcSample | None:
    """``pid``'s memory, descriptors and threads now; None once it is gone."""
    try:
        status = _status_fields(pid)
        rollup = _rollup(pid)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        shm = _shm_maps(pid)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return ProcSample(
        rss_kib=status.get("VmRSS", 0),
        anon_kib=status.get("RssAnon", 0),
        pss_kib=rollup.get("Pss", 0),
        uss_kib=rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0),
        fds=fds,
        threads=status.get("Threads", 0),
        shm_maps=shm,
    )


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs`` (0.0 with fewer than 2 distinct xs)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


Series = list[tuple[int, ProcSample]]  # (epoch, sample), warm-up epochs excluded


@dataclass(frozen=True)
class Growth:
    """How one figure of one process moved over the run (after warm-up)."""

    start: float  # median of the first tenth of the samples (at least 3)
    end: float  # median of the last tenth
    first_max: float  # largest of the first tenth
    last_min: float  # smallest of the last tenth
    slope: float  # least squares, per epoch, over every sample
    late_slope: float  # over the second half


def growth(series: Series, metric: str) -> Growth:
    """How ``metric`` (one of :data:`METRICS`) moved over ``series``."""
    if not series:
        raise ValueError("no samples")
    k = max(3, len(series) // 10)
    xs = [float(e) for e, _ in series]
    ys = [float(getattr(s, metric)) for _, s in series]
    half = len(series) // 2
    return Growth(
        start=statistics.median(ys[:k]),
        end=statistics.median(ys[-k:]),
        first_max=max(ys[:k]),
        last_min=min(ys[-k:]),
        slope=slope(xs, ys),
        late_slope=slope(xs[half:], ys[half:]),
    )


@dataclass(frozen=True)
class Limits:
    """What the detector tolerates, per process (memory: RSS and anonymous RSS each)."""

    late_slope_kib_per_epoch: float = 32.0
    growth_mib: float = 4.0
    fds: int = 0
    threads: int = 0
    shm_maps: int = 0


_LABEL = {"rss_kib": "RSS", "anon_kib": "anonymous RSS"}


def judge(series: dict[str, Series], limits: Limits, *, restarts: int = 0) -> list[str]:
    """The growth found in ``series`` (process name -> samples after warm-up): one line per
    figure of a process over its limit; ``restarts``: workers replaced during the run (a
    persistent worker replaced hides its growth, and is a finding itself). Empty: flat."""
    problems: list[str] = []
    if restarts:
        problems.append(f"{restarts} DataLoader worker(s) replaced during the run")
    for name, samples in series.items():
        if len(samples) < 6:
            problems.append(f"{name}: {len(samples)} samples, too few to judge")
            continue
        for metric in JUDGED_MEMORY:
            g = growth(samples, metric)
            grew_mib = (g.end - g.start) / 1024
            if g.late_slope > limits.late_slope_kib_per_epoch:
                problems.append(
                    f"{name}: {_LABEL[metric]} grows {g.late_slope:,.1f} KiB/epoch over the "
                    f"second half (limit {limits.late_slope_kib_per_epoch:g})"
                )
            if grew_mib > limits.growth_mib:
                problems.append(
                    f"{name}: {_LABEL[metric]} grew {grew_mib:,.1f} MiB from start to end "
                    f"(limit {limits.growth_mib:g})"
                )
        for metric in ("fds", "threads", "shm_maps"):
            g = growth(samples, metric)
            allowed = getattr(limits, metric)
            if g.last_min - g.first_max > allowed:
                problems.append(
                    f"{name}: {metric} grew from {g.first_max:.0f} to {g.last_min:.0f} "
                    f"(at least, over the last tenth; limit +{allowed})"
                )
    return problems


@dataclass
class SoakRun:
    """What a soak recorded."""

    epochs: int
    warmup: int
    samples: int = 0  # delivered to the loop, both loaders, every epoch
    wall_s: float = 0.0
    scrapes: int = 0
    roles: dict[str, str] = field(default_factory=dict)  # process name -> what it is
    series: dict[str, Series] = field(default_factory=dict)  # after warm-up
    restarts: int = 0
    before: dict[str, int] = field(default_factory=dict)  # threads, fds before the loaders ran
    after_close: dict[str, int] = field(default_factory=dict)  # workers, threads, fds left

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (samples as dicts)."""
        out = dataclasses.asdict(self)
        out["series"] = {
            n: [[e, dataclasses.asdict(s)] for e, s in v] for n, v in self.series.items()
        }
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SoakRun:
        """The inverse of :meth:`to_json`."""
        data = dict(data)
        data["series"] = {
            n: [(int(e), ProcSample(**s)) for e, s in v] for n, v in data["series"].items()
        }
        return cls(**data)


def _scrape(port: int | None) -> int:
    """Read the exporter's page as Prometheus would; its size (0: not served)."""
    if port is None:
        return 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read()
    if b"shardio_samples_delivered_total" not in text:
        raise RuntimeError("the exporter's page has no shardio_samples_delivered_total")
    return len(text)


def soak(
    single: str,
    mix: Sequence[str],
    *,
    epochs: int,
    warmup: int,
    batch_size: int = 32,
    workers: int = 2,
    on_batch: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> SoakRun:
    """Read ``single`` (stream mode) and the mix of ``mix`` (map mode) for ``epochs`` epochs
    each, alternating, through loaders with persistent workers and the exporter on, sampling
    this process and each worker after every epoch (the first ``warmup`` epochs unrecorded).

    ``on_batch`` sees every batch (the test injects a leak through it); ``progress`` gets
    (epoch, seconds so far) after each epoch.
    """
    from shardio import MixedDataset, ShardDataset
    from shardio.metrics import PrometheusExporter, combine

    run = SoakRun(epochs=epochs, warmup=warmup)
    start = sample_process(os.getpid())
    run.before = {"threads": start.threads if start else -1, "fds": start.fds if start else -1}
    plain = ShardDataset(single, mode="stream", seed=1)
    mixed = MixedDataset(
        [(ShardDataset(p, mode="map", seed=10 + i), 1.0) for i, p in enumerate(mix)], seed=2
    )
    loaders = [
        ("plain", plain.loader(batch_size=batch_size, num_workers=workers)),
        ("mix", mixed.loader(batch_size=batch_size, num_workers=workers)),
    ]
    me = os.getpid()
    names: dict[int, str] = {me: "training process"}
    run.roles["training process"] = "the loop, both loaders, the exporter"
    known = set(child_pids(me))  # not the loaders' (a pack's forkserver, ...): left out
    ignored = set(known)
    exporter = PrometheusExporter(
        lambda: combine([loader.metrics() for _, loader in loaders]),
        port=0,
        host="127.0.0.1",
        job="soak",
        interval_s=0.5,
        linger_s=0,
    )
    shm_before = _dev_shm()
    began = time.perf_counter()
    try:
        with exporter:
            for epoch in range(epochs):
                for role, loader in loaders:
                    loader.set_epoch(epoch)
                    for batch in loader:
                        run.samples += len(batch["__key__"])
                        if on_batch is not None:
                            on_batch(batch)
                    kids = set(child_pids(me))
                    new = sorted(kids - known)
                    if epoch > 0 and new:
                        run.restarts += len(new)
                    for pid in new:
                        n = sum(1 for r in names.values() if r.startswith(f"{role} worker"))
                        names[pid] = f"{role} worker {n}"
                        run.roles[names[pid]] = f"DataLoader worker of the {role} loader"
                    known |= kids
                run.scrapes += _scrape(exporter.bound_port) > 0
                if epoch >= warmup:
                    for pid, name in names.items():
                        sample = sample_process(pid)
                        if sample is not None and pid not in ignored:
                            run.series.setdefault(name, []).append((epoch, sample))
                if progress is not None:
                    progress(epoch, time.perf_counter() - began)
    finally:
        for _, loader in loaders:
            loader.close()
    run.wall_s = time.perf_counter() - began
    # Let go as a script would (a dataset made per evaluation): whatever they held is freed.
    batch = loader = None  # the last ones, still bound
    loaders.clear()  # the exporter's closure still names the list
    del batch, loader, plain, mixed, exporter
    gc.collect()
    end = sample_process(me)
    ours = {str(p) for p in known - ignored | {me}}
    run.after_close = {
        "workers_left": len([p for p in child_pids(me) if p in known - ignored]),
        "threads": end.threads if end else -1,
        "fds": end.fds if end else -1,
        # Segments named after one of our processes (torch's are torch_PID_...), left behind.
        "dev_shm_left": sum(
            1 for n in _dev_shm() - shm_before if any(pid in n.split("_") for pid in ours)
        ),
    }
    return run


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()
