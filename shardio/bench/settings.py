"""What ``shardio bench`` runs: its settings, the runner protocol, a peer to compare with."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shardio._check import require_int
from shardio.errors import UsageError
from shardio.metrics.histogram import LatencyHistogram

if TYPE_CHECKING:
    from shardio.order.quality import QualityReport

__all__ = ["BenchSettings", "MODES", "Peer", "Runner", "RunnerStats", "parse_compare"]

logger = logging.getLogger(__name__)


MODES = ("map", "stream")


def _whole(value: object, what: str, minimum: int) -> int:
    return require_int(value, what, minimum=minimum)


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """How to run the bench (the same for every runner).

    Attributes:
        mode: "map" (a new random order each epoch) or "stream" (shard order; loose files
            in sorted order).
        workers: DataLoader worker processes (0: read in the loop's own process).
        batch_size: samples per batch.
        compute_ms: emulated compute per step, in milliseconds (a sleep).
        epochs: epochs to run.
        seed: the seed of every shuffle.
        cold: empty the page cache before each epoch (see :func:`drop_page_cache`).
    """

    mode: str = "map"
    workers: int = 4
    batch_size: int = 32
    compute_ms: float = 0.0
    epochs: int = 1
    seed: int = 0
    cold: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"invalid mode {self.mode!r}: choose one of {', '.join(MODES)}")
        _whole(self.workers, "workers", 0)
        _whole(self.batch_size, "batch size", 1)
        _whole(self.epochs, "epochs", 1)
        _whole(self.seed, "seed", 0)
        ms = self.compute_ms
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
            raise UsageError(f"compute time must be a finite number of ms, got {ms!r}")
        if ms < 0:
            raise UsageError(f"compute time must be at least 0 ms, got {ms}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready values."""
        return {
            "mode": self.mode,
            "workers": self.workers,
            "batch_size": self.batch_size,
            "compute_ms": float(self.compute_ms),
            "epochs": self.epochs,
            "seed": self.seed,
            "cold": self.cold,
        }


@dataclass(frozen=True, kw_only=True)
class RunnerStats:
    """What a runner measured itself, beside the loop's timing.

    Attributes:
        read_latency: its read latencies, or None where it cannot time its reads.
        files_opened: files it opened, where known.
        notes: what the report should say about it.
        order_quality: the shuffle quality of the order it read, per epoch measured
            (shardio's runner; :mod:`shardio.order.quality`).
    """

    read_latency: LatencyHistogram | None
    files_opened: int | None = None
    notes: tuple[str, ...] = ()
    order_quality: tuple[QualityReport, ...] = ()


class Runner(Protocol):
    """One way of reading a dataset into batches, as the timed loop drives it."""

    name: str
    source: str

    def batches(self, epoch: int) -> Iterator[Any]:
        """The batches of ``epoch`` (workers start here, not before)."""

    def account(self, batch: Any) -> tuple[int, int]:
        """(samples, payload bytes) of ``batch``; takes in the read latencies it carries.

        Raises:
            ShardioError: the batch stands for a failure in a worker.
        """

    def files(self) -> list[str]:
        """Every file the run reads (for a cold start)."""

    def finish(self) -> RunnerStats:
        """What it measured itself, once the epochs are done."""

    def close(self) -> None:
        """Release what it holds (idempotent)."""


# -- the whole bench -------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """A runner to compare shardio with: ``loose`` (with its tree) or ``webdataset``."""

    kind: str
    root: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.root}" if self.root is not None else self.kind


def parse_compare(text: str) -> Peer:
    """Parse a ``--compare`` value: ``loose:DIR`` or ``webdataset``.

    Raises:
        UsageError: another value, or DIR is empty or not a directory.
    """
    kind, sep, root = text.partition(":")
    if kind == "webdataset" and not sep:
        return Peer("webdataset")
    if kind == "loose" and sep:
        if not root:
            raise UsageError("--compare loose:DIR needs the directory of the loose files")
        if not os.path.isdir(root):
            raise UsageError(f"--compare loose:{root}: not a directory")
        return Peer("loose", root)
    raise UsageError(f"invalid --compare {text!r}: use loose:DIR or webdataset")
