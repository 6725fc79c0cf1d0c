"""PrometheusExporter: metrics snapshots as Prometheus metrics, one HTTP port per node.

Every rank of a node runs an exporter. Local rank 0 is the node's reporter: it serves
``/metrics`` over HTTP when given a port (on 127.0.0.1 unless ``host`` says otherwise), and
writes the exposition to a textfile for node_exporter when given one. The other local ranks
write their latest snapshot into a spool directory every interval, which local rank 0 reads
at each scrape, so one port (or one textfile) per node reports every local rank, each under
its own ``rank`` label. Without a spool directory each process reports only itself.

Each scrape is served in a thread of its own, bounded in time, so a stalled or slow client
holds up neither the other scrapes nor :meth:`PrometheusExporter.close` (see
:mod:`shardio.metrics._http`). The spool (``spool_dir="auto"``: private and unpredictable,
made by local rank 0 and removed by it at close; see :mod:`shardio.metrics._spool`) holds
files written atomically (temp file, then rename) without following a symlink; files older
than ten intervals (a rank that ended or died) are passed over. A spool that cannot be used
(another user's directory, a symlink) is logged and the node reports without it: metrics
never stop training. The metric names are
:mod:`shardio.metrics.prometheus_families`'.

The first report is taken at :meth:`PrometheusExporter.start`; until one holds figures and
reached the node (a spool file written, on the other local ranks), the exporter looks again
every :data:`~shardio.metrics.export.FIRST_POLL_S`, so the first batches show within about a
second, not after an interval of zeros. Alert rules and a Grafana dashboard over these names
ship with the package (:func:`shardio.metrics.alerts_path`).

Metrics never stop training: a port that cannot be served (taken by another job on the
node), a textfile that cannot be written, a spool that cannot be used, a disk that fills up
are logged (once) and the job trains on without that output. Only an argument that is wrong
in itself (a port out of range, a path with a NUL) is an error, raised by the constructor.

The final figures of a run that counted something abnormal (any counter an alert rule
watches: :data:`ALERT_COUNTERS`) that no scrape has read yet are served after
:meth:`PrometheusExporter.close` until :data:`LINGER_SCRAPES` scrapes have read them, for at
most ``linger_s``: a run that fails (a sample given up on ends training) would otherwise
close the port in the same instant and no scrape would ever see the count. It lingers only
when a scrape came during the run (some Prometheus is listening); ``linger_s=0`` turns it
off. A textfile keeps the final figures
anyway (it is rewritten at close and left in place).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from shardio._check import require_path, require_seconds
from shardio.errors import StorageError, UsageError
from shardio.metrics import _spool
from shardio.metrics._http import CountedBody, MetricsServer
from shardio.metrics.export import PeriodicReporter, SnapshotSource
from shardio.metrics.prometheus_families import (
    Alerting,
    alerting_counts,
    load_client,
    metric_families,
)
from shardio.metrics.snapshots import MetricsSnapshot
from shardio.storage.atomic import atomic_write
from shardio.storage.files import check_replaceable

__all__ = ["DEFAULT_HOST", "DEFAULT_LINGER_S", "LINGER_SCRAPES", "PrometheusExporter"]

logger = logging.getLogger(__name__)

# A spool file not rewritten for this many intervals belongs to a rank that is gone.
STALE_INTERVALS = 10
DEFAULT_HOST = "127.0.0.1"  # this node only; another address must be asked for (host=)
_SPOOL_NAME = _spool.SPOOL_NAME
_P = TypeVar("_P", bound="PrometheusExporter")
# After close, serve the final figures until this many scrapes read them (or linger_s).
LINGER_SCRAPES = 2
# Two scrape intervals at Prometheus's default of one minute.
DEFAULT_LINGER_S = 120.0


class _SnapshotCollector:
    """A prometheus_client collector of the node's snapshots (see the exporter); with
    ``served``, what it collects is noted as served to a scrape."""

    def __init__(
        self,
        exporter: PrometheusExporter,
        served: Callable[[Sequence[tuple[MetricsSnapshot, str]]], None] | None = None,
    ) -> None:
        self._exporter = exporter
        self._served = served

    def collect(self) -> Iterable[Any]:
        labelled = self._exporter.node_snapshots()
        if self._served is not None:
            self._served(labelled)
        return metric_families(labelled)


class PrometheusExporter(PeriodicReporter):
    """Reports snapshots to Prometheus: over HTTP, into a textfile, or both (see the module
    docstring for the node layout and the metric names).

    Example:
        >>> exporter = PrometheusExporter(  # doctest: +SKIP
        ...     loader.metrics, port=9464, local_rank=local_rank, spool_dir="auto", job=job_id
        ... )
        >>> with exporter:  # doctest: +SKIP
        ...     train(loader)

    Attributes:
        port: the port asked for (None: no HTTP); :attr:`bound_port` is the one served.
        host: the address to serve on.
        textfile: the ``.prom`` file written each interval (None: none).
        job: the ``job`` label ("" when None).
        local_rank: this process's rank on its node; local rank 0 serves the node.
        spool_dir: where the local ranks leave their snapshots: ``"auto"``, a path, or None
            (no sharing); :attr:`spool_path` is the directory in use.
        spool_root: where ``spool_dir="auto"`` makes its directory.
        linger_s: how long, at most, the port serves the final figures after close (see
            the module docstring).
    """

    kind: ClassVar[str] = "prometheus"
    failure_logger: ClassVar[logging.Logger] = logger

    def __init__(
        self,
        source: SnapshotSource,
        *,
        port: int | None = None,
        host: str = DEFAULT_HOST,
        textfile: str | os.PathLike[str] | None = None,
        job: str | None = None,
        local_rank: int = 0,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_root: str | os.PathLike[str] = _spool.DEFAULT_ROOT,
        interval_s: float = 15.0,
        linger_s: float = DEFAULT_LINGER_S,
    ) -> None:
        """Check the arguments; nothing is served or written before :meth:`start`.

        Args:
            source: returns this rank's snapshot.
            port: the HTTP port local rank 0 serves (0: any free one); other local ranks
                ignore it.
            host: the address to serve on: 127.0.0.1 by default (this node only); ``"::1"``,
                a host name, or ``"0.0.0.0"`` (every interface: anyone who reaches the node
                reads the job's figures) when Prometheus scrapes from elsewhere.
            textfile: a path ending in ``.prom`` that local rank 0 rewrites each interval.
            job: the ``job`` label (give each job its own, e.g. ``SLURM_JOB_ID``: the local
                ranks of a job find its ``"auto"`` spool by it).
            local_rank: this process's rank on its node.
            spool_dir: ``"auto"`` (recommended): a private directory that local rank 0 makes
                with an unpredictable name under ``spool_root`` and removes at close, which
                the other local ranks find by its owner (see :mod:`shardio.metrics._spool`).
                A path: a directory of this user, mode 0700, made by local rank 0 if
                missing. None: each process reports only itself.
            spool_root: the directory an ``"auto"`` spool is made in (``/dev/shm``).
            interval_s: seconds between snapshots.
            linger_s: at most this long after :meth:`close`, the HTTP port keeps serving the
                final figures of a run that counted something an alert watches, until
                :data:`LINGER_SCRAPES` scrapes read them (0: close at once; see the module
                docstring). Give at least two scrape intervals.

        Raises:
            UsageError: an argument is invalid, or prometheus_client is not installed.
        """
        super().__init__(source, interval_s=interval_s)
        if port is not None and (
            not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535
        ):
            raise UsageError(f"port must be 0..65535 or None, not {port!r}")
        if not isinstance(host, str) or not host or "\0" in host:
            raise UsageError(f"host must be a host name or address, not {host!r}")
        if not isinstance(local_rank, int) or isinstance(local_rank, bool) or local_rank < 0:
            raise UsageError(f"local_rank must be an integer >= 0, not {local_rank!r}")
        if job is not None and not isinstance(job, str):
            raise UsageError(f"job must be a string, not {job!r}")
        self.linger_s = require_seconds(linger_s, "linger_s")
        self.textfile = None if textfile is None else require_path(textfile, "textfile")
        if self.textfile is not None and not (
            self.textfile.endswith(".prom") and os.path.basename(self.textfile) != ".prom"
        ):
            raise UsageError(
                f"textfile {self.textfile} must end in .prom (node_exporter reads only those)"
            )
        self.port = port
        self.host = host
        self.job = job
        self.local_rank = local_rank
        self.spool_dir = None if spool_dir is None else require_path(spool_dir, "spool_dir")
        self.spool_root = require_path(spool_root, "spool_root")
        self.spool_path: str | None = None  # the spool in use (found later on other ranks)
        self._spool_made = False
        client = load_client()
        self._registry = client.CollectorRegistry(auto_describe=False)  # the textfile's
        self._registry.register(_SnapshotCollector(self))
        self._http_registry = client.CollectorRegistry(auto_describe=False)  # scrapes'
        self._http_registry.register(_SnapshotCollector(self, self._note_served))
        self._make_app = client.make_wsgi_app
        self._generate = client.generate_latest
        self._latest: MetricsSnapshot | None = None
        self._server: MetricsServer | None = None
        self._spooled = False  # the last emit left a spool file (where one is to be left)
        # Scrapes answered: how many, and when the latest began (for the linger at close).
        self._scrapes = threading.Condition()
        self._scrape_count = 0
        self._scrape_starts: deque[float] = deque(maxlen=LINGER_SCRAPES)
        self._served_alerting: Alerting = {}  # the alert counters the latest scrape read
        self._emitted_at = 0.0  # time.monotonic() of the latest snapshot given to emit()

    @property
    def serves_node(self) -> bool:
        """Whether this process reports for its node (local rank 0)."""
        return self.local_rank == 0

    @property
    def bound_port(self) -> int | None:
        """The port being served (None when not serving)."""
        server = self._server
        return None if server is None else int(server.server_address[1])

    def start(self: _P) -> _P:
        """Prepare the spool and textfile, serve HTTP, report once at once, then every
        ``interval_s``.

        A port that cannot be served (taken by another job), a textfile or a spool
        directory that cannot be used is logged (the node then reports without it), never
        raised: metrics do not stop training.

        Raises:
            UsageError: the reporter was closed.
        """
        if self.running:
            return self
        super().start()
        # At once, so a scrape right after start() has figures and local rank 0 sees the
        # others' spool files without waiting an interval.
        self.report()
        return self

    # -- the sink ------------------------------------------------------------------------
    def open(self) -> None:
        """Make the spool (local rank 0), check the textfile; start serving HTTP."""
        if self.spool_dir is not None and self.serves_node:
            try:
                self.spool_path, self._spool_made = _spool.make_spool(
                    self.spool_dir, root=self.spool_root, job=self.job
                )
            except (UsageError, StorageError) as exc:
                self.log_failure("preparing the metrics spool (the node's other local ranks go "
                                 "unreported)", exc)  # fmt: skip
        if not self.serves_node:
            if self.port is not None or self.textfile is not None:
                logger.debug(
                    "local rank %d: the port and textfile are local rank 0's; this rank "
                    "only writes its spool file",
                    self.local_rank,
                )
            return
        if self.textfile is not None:
            try:
                check_replaceable(self.textfile, what="metrics textfile", parent=True)
            except (UsageError, StorageError) as exc:  # each report tries again (logged once)
                self.log_failure(f"reporting metrics ({self.kind})", exc)
        if self.port is not None:
            self._serve(self.port)

    def _serve(self, port: int) -> None:
        """Serve HTTP on ``port``; one that cannot be served is logged, and the job trains
        on without the endpoint (two jobs on one node asking for one port)."""
        server: MetricsServer | None = None
        try:
            family = socket.getaddrinfo(
                self.host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0][0]
            server = MetricsServer((self.host, port), family, self._counting_app())
            server.start("shardio-metrics-http")
        except (OSError, UnicodeError, RuntimeError) as exc:  # RuntimeError: no new thread
            if server is not None:
                server.server_close()
            reason = getattr(exc, "strerror", None) or exc
            logger.warning(
                "cannot serve metrics on %s:%d (%s): training goes on without this endpoint "
                "(another job on this node may hold the port: give each job its own)",
                self.host,
                port,
                reason,
            )
            return
        self._server = server
        logger.info("serving shardio metrics on http://%s:%d/metrics", self.host, self.bound_port)

    def _counting_app(self) -> Callable[..., Any]:
        """The metrics WSGI app, counting the scrapes it answered (see :meth:`_linger`)."""
        app = self._make_app(self._http_registry)

        def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            began = time.monotonic()
            body = app(environ, start_response)
            if environ.get("PATH_INFO") == "/favicon.ico":
                return body
            return CountedBody(body, lambda: self._scraped(began))

        return counted

    def _note_served(self, labelled: Sequence[tuple[MetricsSnapshot, str]]) -> None:
        """A scrape is reading these snapshots."""
        alerting = alerting_counts(labelled)
        with self._scrapes:
            self._served_alerting = alerting

    def _scraped(self, began: float) -> None:
        """A scrape that began at ``began`` (time.monotonic()) was answered."""
        with self._scrapes:
            self._scrape_count += 1
            self._scrape_starts.append(began)
            self._scrapes.notify_all()

    def emit(self, snap: MetricsSnapshot) -> None:
        """Keep the snapshot for scrapes, leave it in the spool, rewrite the textfile."""
        self._latest = snap
        self._emitted_at = time.monotonic()
        self._spooled = False
        if self.spool_dir is not None:
            try:
                self._spooled = self._write_spool(snap)
            except Exception as exc:  # the textfile below still gets written
                self.log_failure("writing the metrics spool file", exc)
        if self.serves_node and self.textfile is not None:
            check_replaceable(self.textfile, what="metrics textfile", parent=True)
            with atomic_write(self.textfile, durable=False) as fh:
                fh.write(self._generate(self._registry))

    def delivered(self) -> bool:
        """Whether the last snapshot reached the node's report: always on local rank 0 (its
        scrapes and textfile read it); on another local rank with a spool, once its spool
        file was written (local rank 0 may make the spool after this rank started)."""
        return self.serves_node or self.spool_dir is None or self._spooled

    def release(self) -> None:
        """Stop serving HTTP (in bounded time, whatever the clients do, once the final
        figures of an abnormal run were scraped: see ``linger_s``); on local rank 0, remove
        the spool files and the spool directory it made."""
        server = self._server
        try:
            if server is not None:
                try:
                    self._linger()
                finally:
                    self._server = None
                    server.stop()
        finally:
            spool, self.spool_path = self.spool_path, None
            if spool is not None and self.serves_node:
                _spool.remove_spool(spool, made=self._spool_made)

    def _linger(self) -> None:
        """Wait until :data:`LINGER_SCRAPES` scrapes began after the final snapshot, for at
        most ``linger_s``, when the node's figures count something an alert watches that
        no scrape read yet, and some scraper came during the run."""
        if self.linger_s <= 0:
            return
        final = self._emitted_at
        alerting = alerting_counts(self.node_snapshots())
        with self._scrapes:
            unseen = sorted(
                f"{name}={count} (rank {rank})"
                for (job, rank, name), count in alerting.items()
                if count > self._served_alerting.get((job, rank, name), 0)
            )
            if not unseen:
                return
            if not self._scrape_count:
                logger.debug("metrics: nothing scraped this run; no linger for %s", unseen)
                return
            logger.info(
                "metrics: the run counted %s; serving its final figures on %s:%s until they "
                "are scraped (at most %g s, linger_s)",
                ", ".join(unseen),
                self.host,
                self.bound_port,
                self.linger_s,
            )
            deadline = time.monotonic() + self.linger_s
            while sum(began >= final for began in self._scrape_starts) < LINGER_SCRAPES:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning(
                        "metrics: the final figures were not scraped %d times within %g s "
                        "(linger_s); closing the port",
                        LINGER_SCRAPES,
                        self.linger_s,
                    )
                    return
                self._scrapes.wait(left)

    # -- the spool -----------------------------------------------------------------------
    def _current_spool(self) -> str | None:
        """Local rank 0's spool, or on another local rank the one it finds now (None: not
        there yet)."""
        if self.serves_node or self.spool_dir is None:
            return self.spool_path
        if self.spool_dir == _spool.AUTO:
            oldest = time.time() - STALE_INTERVALS * self.interval_s
            self.spool_path = _spool.find_auto_spool(self.spool_root, self.job, oldest)
        else:
            try:
                _spool.check_private(self.spool_dir)
            except StorageError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                self.spool_path = None  # local rank 0 has not made it (yet)
            else:
                self.spool_path = self.spool_dir
        if self.spool_path is None:
            logger.debug("local rank %d: no metrics spool yet", self.local_rank)
        return self.spool_path

    def _write_spool(self, snap: MetricsSnapshot) -> bool:
        """Leave the snapshot in the spool; False when there is no spool (yet)."""
        spool = self._current_spool()
        if spool is None:
            return False
        record = {"local_rank": self.local_rank, "job": self.job, "snapshot": snap.to_dict()}
        with atomic_write(_spool.spool_file(spool, self.local_rank), durable=False) as fh:
            fh.write(json.dumps(record, separators=(",", ":")).encode())
        return True

    def node_snapshots(self) -> list[tuple[MetricsSnapshot, str]]:
        """This rank's latest snapshot and, on local rank 0 with a spool, the other local
        ranks' fresh ones, each with its job label; one per (job, rank)."""
        own_job = self.job or ""
        found: list[tuple[MetricsSnapshot, str]] = []
        if self._latest is not None:
            found.append((self._latest, own_job))
        spool = self.spool_path
        if self.serves_node and spool is not None:
            others = self._read_spool(spool, own_job)
            found.extend(sorted(others, key=lambda pair: -pair[0].time_s))
        seen: set[tuple[str, int]] = set()
        out = []
        for snap, job in found:
            if (job, snap.rank) not in seen:
                seen.add((job, snap.rank))
                out.append((snap, job))
        return out

    def _read_spool(self, spool_dir: str, own_job: str) -> list[tuple[MetricsSnapshot, str]]:
        try:
            names = os.listdir(spool_dir)
        except OSError as exc:
            self.log_failure(f"listing the metrics spool {spool_dir}", exc)
            return []
        out = []
        oldest = time.time() - STALE_INTERVALS * self.interval_s
        for name in sorted(names):
            match = _SPOOL_NAME.match(name)
            if match is None or int(match.group(1)) == self.local_rank:
                continue
            path = os.path.join(spool_dir, name)
            try:
                record = _spool.read_spool_file(path, oldest)
                if record is None:
                    continue
                job = record.get("job")
                snap = MetricsSnapshot.from_dict(record["snapshot"])
            except Exception as exc:  # one bad file must not fail the scrape
                self.log_failure(f"reading metrics spool file {path}", exc)
                continue
            out.append((snap, job if isinstance(job, str) else own_job))
        return out
