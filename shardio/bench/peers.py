"""The runners ``shardio bench --compare`` measures shardio against: loose files, webdataset.

Both feed the same timed loop (:func:`shardio.bench.loop.timed_loop`) with the same batch
size, workers and prefetch as shardio's loader, and send each batch's bytes from the workers
the way shardio does: in one uint8 tensor (shared memory) with per-sample offsets.

* ``loose``: a map-style torch Dataset over every regular file under a directory, read whole
  in the workers (open, fstat, read, close: what ``ImageFolder`` does), each read timed.
* ``webdataset``: ``webdataset.WebDataset`` over the dataset's own tar shards, batched in the
  workers; it cannot time its reads, so its read latency is "n/a".
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shardio.bench.settings import BenchSettings, RunnerStats
from shardio.errors import ShardioError, StorageError, UsageError, wrap_os_error
from shardio.format.fields import MAX_INT
from shardio.format.manifest import load_manifest
from shardio.format.spec import LABEL_EXT, MANIFEST_FILENAME
from shardio.metrics.histogram import LatencyHistogram
from shardio.storage.files import read_regular

__all__ = ["LooseFiles", "LooseRunner", "WebDatasetRunner", "list_regular_files"]

_PREFETCH = 4  # batches each worker prepares ahead: what ShardLoader uses
# A batch as the peers' workers send it: (bytes of every sample, n + 1 offsets, read
# latencies in ns: one per file for loose files, none for webdataset).
PeerBatch = tuple[torch.Tensor, np.ndarray[Any, Any], np.ndarray[Any, Any]]


class _Failure:
    """A ShardioError raised in a worker, carried to the loop intact (torch would rebuild
    it from its message)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _identity(batch: Any) -> Any:
    return batch


def _loader_options(settings: BenchSettings) -> dict[str, Any]:
    options: dict[str, Any] = {"num_workers": settings.workers, "collate_fn": _identity}
    if settings.workers > 0:
        options["prefetch_factor"] = _PREFETCH
    return options


def _pack(payloads: Sequence[bytes], latency_ns: Sequence[int]) -> PeerBatch:
    offsets = np.zeros(len(payloads) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    for i, payload in enumerate(payloads):
        data[offsets[i] : offsets[i + 1]] = np.frombuffer(payload, dtype=np.uint8)
    return torch.from_numpy(data), offsets, np.asarray(latency_ns, dtype=np.int64)


def _unpack(batch: Any) -> PeerBatch:
    if isinstance(batch, _Failure):
        raise batch.error
    data, offsets, latency = batch
    return data, offsets, latency


# -- loose files -----------------------------------------------------------------------------
def list_regular_files(root: str) -> list[bytes]:
    """Relative paths (bytes, sorted) of the regular files under ``root``; symlinks and
    special files are skipped, and no symlink is followed.

    Raises:
        StorageError: a directory cannot be listed.
    """
    base = os.fsencode(root)
    found: list[bytes] = []
    pending = [b""]
    while pending:
        rel = pending.pop()
        where = os.path.join(base, rel) if rel else base
        try:
            with os.scandir(where) as entries:
                for entry in entries:
                    name = os.path.join(rel, entry.name) if rel else entry.name
                    if entry.is_symlink():
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(name)
                    elif entry.is_file(follow_symlinks=False):
                        found.append(name)
        except OSError as exc:
            raise wrap_os_error(exc, f"cannot list {os.fsdecode(where)}: {exc.strerror}") from exc
    found.sort()
    return found


class LooseFiles(Dataset[Any]):
    """Every regular file under a directory, as a map-style dataset read a batch at a time.

    ``__getitems__`` (what the DataLoader calls with a batch of indices) reads the files and
    returns one :data:`PeerBatch`, with each file's open-to-close time in nanoseconds.

    Args:
        root: the directory.
        paths: its files, relative (from :func:`list_regular_files`).
    """

    def __init__(self, root: str, paths: Sequence[bytes]) -> None:
        self.root = os.fsencode(root)
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> Any:
        payloads = []
        latency = []
        try:
            for i in indices:
                began = time.perf_counter_ns()
                payloads.append(
                    read_regular(
                        os.path.join(self.root, self.paths[i]),
                        max_bytes=MAX_INT,
                        nofollow=True,
                    )
                )
                latency.append(time.perf_counter_ns() - began)
        except ShardioError as exc:
            return _Failure(exc)
        return _pack(payloads, latency)


class LooseRunner:
    """The same loop over the original loose files (``--compare loose:DIR``).

    Map mode reads them in a new random order each epoch (from the seed), stream mode in
    sorted order.

    Raises:
        UsageError: ``root`` holds no regular file.
        StorageError: ``root`` cannot be listed.
    """

    name = "loose"

    def __init__(self, root: str, settings: BenchSettings) -> None:
        paths = list_regular_files(root)
        if not paths:
            raise UsageError(f"--compare loose:{root}: no regular files there")
        self.source = f"{root} ({len(paths):,} loose files)"
        self.dataset = LooseFiles(root, paths)
        self.settings = settings
        self.latency = LatencyHistogram()
        self.opened = 0

    def batches(self, epoch: int) -> Iterator[Any]:
        n = len(self.dataset)
        if self.settings.mode == "map":
            order = np.random.default_rng([self.settings.seed, epoch]).permutation(n).tolist()
        else:
            order = list(range(n))
        loader = DataLoader(
            self.dataset,
            batch_size=self.settings.batch_size,
            sampler=order,
            **_loader_options(self.settings),
        )
        return iter(loader)

    def account(self, batch: Any) -> tuple[int, int]:
        _data, offsets, latency = _unpack(batch)
        for ns in latency.tolist():
            self.latency.record(ns)
        samples = len(offsets) - 1
        self.opened += samples
        return samples, int(offsets[-1])

    def files(self) -> list[str]:
        return [os.fsdecode(os.path.join(self.dataset.root, p)) for p in self.dataset.paths]

    def finish(self) -> RunnerStats:
        return RunnerStats(read_latency=self.latency, files_opened=self.opened)

    def close(self) -> None:
        pass  # each epoch's DataLoader shuts its workers down when its iteration ends


# -- webdataset ------------------------------------------------------------------------------
def _collate_samples(samples: Sequence[dict[str, Any]]) -> PeerBatch:
    """One batch of webdataset samples: each sample's members (not its label) concatenated."""
    payloads = []
    for sample in samples:
        members = [
            v
            for k, v in sample.items()
            if not k.startswith("__") and k != LABEL_EXT and isinstance(v, bytes)
        ]
        payloads.append(b"".join(members))
    return _pack(payloads, ())


class WebDatasetRunner:
    """The same loop through ``webdataset.WebDataset`` over the dataset's tar shards
    (``--compare webdataset``).

    Map mode shuffles the shard order each epoch (webdataset reads each shard through);
    stream mode reads the shards in manifest order.

    Raises:
        UsageError: the dataset's shards are not tar, or webdataset is not installed.
        FormatError: the manifest is missing or damaged.
    """

    name = "webdataset"

    def __init__(self, path: str, settings: BenchSettings) -> None:
        manifest = load_manifest(os.path.join(path, MANIFEST_FILENAME))
        if manifest.shard_format != "tar":
            raise UsageError(
                f"--compare webdataset reads tar shards; {path} holds "
                f"{manifest.shard_format} shards"
            )
        try:
            import webdataset  # noqa: F401  - checked here, before any runner starts
        except ImportError as exc:
            raise UsageError(
                "--compare webdataset needs the webdataset package (pip install webdataset)"
            ) from exc
        self.urls = [os.path.join(path, s.path) for s in manifest.shards]
        self.source = f"{path} ({len(self.urls):,} tar shards)"
        self.settings = settings
        self.epochs_started = 0

    def batches(self, epoch: int) -> Iterator[Any]:
        import webdataset as wds

        shuffle = self.settings.mode == "map"
        pipeline = wds.WebDataset(
            self.urls,
            shardshuffle=len(self.urls) if shuffle else False,
            detshuffle=True,
            seed=self.settings.seed * 1_000_003 + epoch,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
            empty_check=False,
        ).batched(self.settings.batch_size, collation_fn=_collate_samples, partial=True)
        options = _loader_options(self.settings)
        del options["collate_fn"]  # batches are made in the workers; batch_size=None passes them
        loader = DataLoader(pipeline, batch_size=None, **options)
        self.epochs_started += 1
        return _reraised(iter(loader))

    def account(self, batch: Any) -> tuple[int, int]:
        _data, offsets, _latency = _unpack(batch)
        return len(offsets) - 1, int(offsets[-1])

    def files(self) -> list[str]:
        return list(self.urls)

    def finish(self) -> RunnerStats:
        return RunnerStats(
            read_latency=None,
            files_opened=len(self.urls) * self.epochs_started,
            notes=("webdataset reads shards as streams: its read latency is not timed",),
        )

    def close(self) -> None:
        pass  # each epoch's DataLoader shuts its workers down when its iteration ends


def _reraised(batches: Iterator[Any]) -> Iterator[Any]:
    """``batches``, with a failure inside webdataset as one StorageError line."""
    try:
        yield from batches
    except ShardioError:
        raise
    except Exception as exc:  # webdataset and torch raise anything: tar, I/O, worker deaths
        first = str(exc).strip().splitlines()
        reason = first[-1] if first else type(exc).__name__
        raise StorageError(errno.EIO, f"webdataset failed: {reason}") from exc
