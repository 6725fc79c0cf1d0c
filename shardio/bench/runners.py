"""``shardio bench``'s runs: shardio's own runner, and the run of every runner compared.

Torch is imported only when a runner starts, so a mistake in the settings costs no import.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shardio.bench.loop import stall_notes, timed_loop
from shardio.bench.report import BenchRun
from shardio.bench.settings import BenchSettings, Peer, Runner, RunnerStats
from shardio.errors import MissingExtraError, UsageError
from shardio.metrics.histogram import LatencyHistogram

if TYPE_CHECKING:
    from shardio.order.quality import QualityReport
    from shardio.storage.opener import Opener

__all__ = ["ShardioRunner", "require_torch", "run_bench", "run_shardio"]

logger = logging.getLogger(__name__)

QUALITY_EPOCHS = 3  # epochs whose shuffle quality the report shows (each is reseeded alike)


def require_torch() -> None:
    """Check that torch imports (every runner reads through a DataLoader).

    Raises:
        MissingExtraError: torch is absent, or its install is broken.
    """
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # absent, or a broken install
        detail = None if exc.name == "torch" else str(exc)
        raise MissingExtraError("shardio bench needs PyTorch", "torch", detail) from exc


# -- the shardio runner ----------------------------------------------------------------------
class ShardioRunner:
    """``ShardDataset(path).loader(...)``, as a training job uses it.

    Args:
        path: the dataset directory.
        settings: the bench settings.
        opener: the opener the dataset reads through (a FaultyOpener in tests).
    """

    name = "shardio"

    def __init__(self, path: str, settings: BenchSettings, *, opener: Opener | None = None) -> None:
        from shardio.runtime.dataset import ShardDataset

        self.dataset = ShardDataset(path, mode=settings.mode, seed=settings.seed, opener=opener)
        self.settings = settings
        fmt = self.dataset.packed.manifest.shard_format
        self.source = f"{path} ({fmt} shards)"
        self.loader = self.dataset.loader(
            batch_size=settings.batch_size, num_workers=settings.workers
        )

    def batches(self, epoch: int) -> Iterator[Any]:
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def account(self, batch: Any) -> tuple[int, int]:
        from shardio.runtime.batch import ByteColumn

        nbytes = 0
        for column in batch.values():
            if isinstance(column, ByteColumn) and len(column):
                nbytes += int(column.offsets[-1] - column.offsets[0])
        return len(batch["__key__"]), nbytes

    def files(self) -> list[str]:
        root = self.dataset.path
        return [os.path.join(root, s.path) for s in self.dataset.packed.manifest.shards]

    def finish(self) -> RunnerStats:
        snap = self.loader.metrics()
        hist = LatencyHistogram()
        for name in ("read_staged", "read_source"):
            found = snap.histograms.get(name)
            if found is not None:
                hist.merge(found)
        opened = snap.counters.get("opens_staged", 0) + snap.counters.get("opens_source", 0)
        return RunnerStats(
            read_latency=hist,
            files_opened=opened,
            notes=stall_notes(snap, self.dataset),
            order_quality=self._order_quality(),
        )

    def _order_quality(self) -> tuple[QualityReport, ...]:
        """The shuffle quality of the order the loader read, in the first epochs run (a pure
        function of the dataset's spec and the epoch: what the loop was handed)."""
        from shardio.order.quality import dataset_label_entropy, order_quality

        ds = self.dataset
        sizes = [shard.num_samples for shard in ds.packed.manifest.shards]
        labels = ds.packed.index.samples["label"] if ds.classes is not None else None
        entropy = dataset_label_entropy(labels) if labels is not None else None
        batch = min(self.settings.batch_size, max(1, len(ds)))
        nodes = ds.cursor.ranks().num_nodes if ds.spec.partitioned else 1
        return tuple(
            order_quality(
                sizes,
                labels,
                ds.spec,
                epoch=epoch,
                batch_size=batch,
                nodes=nodes,
                dataset_entropy=entropy,
            )
            for epoch in range(min(self.settings.epochs, QUALITY_EPOCHS))
        )

    def close(self) -> None:
        self.loader.close()
        self.dataset.close()


def run_shardio(path: str, settings: BenchSettings, *, opener: Opener | None = None) -> BenchRun:
    """Bench shardio's loader on the dataset at ``path``.

    Raises:
        ShardioError: the dataset cannot be read (missing, damaged, a read failed).
    """
    runner = ShardioRunner(path, settings, opener=opener)
    try:
        return timed_loop(runner, settings)
    finally:
        runner.close()


def run_bench(
    path: str,
    settings: BenchSettings,
    *,
    compare: Sequence[Peer] = (),
    opener: Opener | None = None,
) -> list[BenchRun]:
    """Bench shardio on ``path``, then each peer of ``compare`` with the same loop.

    Every runner is set up (trees listed, formats checked) before the first one runs, so a
    mistake shows at once, not after the shardio run.

    Raises:
        UsageError: a peer cannot read this dataset (webdataset on HDF5 shards), or a loose
            tree holds no regular file.
        ShardioError: a dataset or file cannot be read.
    """
    from shardio.bench.peers import LooseRunner, WebDatasetRunner  # imports torch

    if not os.path.isdir(path):
        raise UsageError(f"no dataset directory {path}")
    runners: list[Runner] = []
    try:
        runners.append(ShardioRunner(path, settings, opener=opener))
        for peer in compare:
            if peer.kind == "loose" and peer.root is not None:
                runners.append(LooseRunner(peer.root, settings))
            else:
                runners.append(WebDatasetRunner(path, settings))
        runs = []
        for runner in runners:
            logger.info("bench: running %s", runner.name)
            runs.append(timed_loop(runner, settings))
            runner.close()  # its workers and files go before the next runner starts
        return runs
    finally:
        for runner in runners:
            runner.close()
