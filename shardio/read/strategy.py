"""The read path per filesystem: which way a worker turns member reads into requests.

On a local disk one ``pread`` per member, in the reading thread, is as fast as the device
(kernel readahead and an NVMe queue do the rest). On a network or parallel filesystem each
request pays a round trip to a data server, so the fast way is large sequential requests
with several in flight. The strategy is chosen from the filesystem that holds the dataset
(:func:`shardio.storage.fsdetect.describe_fs`), and the user can override it with
``ShardDataset(..., read_strategy=...)`` or the ``SHARDIO_READ_STRATEGY`` environment
variable (``auto``, ``local`` or ``pfs``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardio.errors import UsageError
from shardio.storage.fsdetect import FsInfo, describe_fs

__all__ = [
    "ENV_VAR",
    "LOCAL",
    "PFS",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "ReadStrategy",
    "StrategyChoice",
    "choose_strategy",
]

ENV_VAR = "SHARDIO_READ_STRATEGY"
MiB = 1 << 20
MAX_INFLIGHT = 256  # I/O threads per reading process
MAX_REQUEST_BYTES = 256 * MiB  # one request, and the read-ahead's scratch buffer


@dataclass(frozen=True, kw_only=True)
class ReadStrategy:
    """How members are read.

    The mechanics are in :mod:`shardio.read.extents` and :mod:`shardio.read.readahead`: map
    mode's batches are read by :func:`~shardio.read.extents.read_members_planned` when
    ``inflight > 1``; stream mode reads its shards ahead with
    :class:`~shardio.read.readahead.StreamReadahead` when ``stream_readahead_bytes > 0``.
    Either way each member is still read into the batch's buffer and checked there, by the
    calling thread.

    Attributes:
        name: ``local`` or ``pfs``.
        inflight: map mode: requests in flight per reading process, in that many runs at
            once, each on an I/O thread (``shardio-io-deadline`` under a read deadline, else
            ``shardio-io``; 1: each pread in the reading thread, one at a time).
        coalesce_gap_bytes: neighbouring members of one shard at most this far apart are
            read by one request (the bytes between are read and dropped).
        request_bytes: the largest coalesced request, and the size of each read-ahead
            request (the read-ahead's one scratch buffer per process).
        stream_readahead_bytes: stream mode: the bound on bytes read ahead into shards the
            reader has not begun yet (0: no read-ahead). They sit in the page cache (the
            kernel's, reclaimable), not in the process; the shards of the window being read
            are read whole, as the shuffle over the window needs them all.
    """

    name: str
    inflight: int
    coalesce_gap_bytes: int
    request_bytes: int
    stream_readahead_bytes: int

    def __post_init__(self) -> None:
        for field in ("inflight", "request_bytes"):
            if getattr(self, field) < 1:
                raise UsageError(f"ReadStrategy.{field} must be at least 1")
        for field in ("coalesce_gap_bytes", "stream_readahead_bytes"):
            if getattr(self, field) < 0:
                raise UsageError(f"ReadStrategy.{field} must not be negative")
        # Threads and scratch buffers are made from these: a typo must not exhaust a node.
        if self.inflight > MAX_INFLIGHT:
            raise UsageError(f"ReadStrategy.inflight must be at most {MAX_INFLIGHT}")
        if self.request_bytes > MAX_REQUEST_BYTES or self.coalesce_gap_bytes > MAX_REQUEST_BYTES:
            raise UsageError(
                f"ReadStrategy.request_bytes and coalesce_gap_bytes must be at most "
                f"{MAX_REQUEST_BYTES // MiB} MiB"
            )

    def describe(self) -> str:
        """One phrase for the CLI: how map mode and stream mode read."""
        if self.inflight == 1:
            mapped = "map: one pread per member in the reading thread"
        else:
            mapped = (
                f"map: {self.inflight} requests in flight, members within "
                f"{self.coalesce_gap_bytes // 1024} KiB coalesced, requests up to "
                f"{self.request_bytes // MiB} MiB"
            )
        if self.stream_readahead_bytes:
            streamed = (
                f"stream: shards read ahead sequentially in {self.request_bytes // MiB} MiB "
                f"requests, {self.stream_readahead_bytes // MiB} MiB ahead"
            )
        else:
            streamed = "stream: members advised ahead"
        return f"{self.name} ({mapped}; {streamed})"


# Stream mode reads its shards ahead on a local disk too: a window's shuffled member reads
# are random reads, and a cold random read costs the reader CPU that a sequential one does
# not (benchmarks/RESULTS.md, "CPU per verified GB": the random-order ceiling). A reader
# starts its read-ahead at its first batch the page cache lacks (a warm epoch starts none).
# Measured here (2 epochs, 0.66 GB each, the first cold, medians of 4): 0.70 -> 0.47 CPU-s
# and 1.00 -> 0.73 s with no workers, 1.00 -> 0.86 CPU-s and 0.88 -> 0.74 s with 2; warm,
# the same (0.38 and 0.69 CPU-s).
LOCAL = ReadStrategy(
    name="local",
    inflight=1,
    coalesce_gap_bytes=0,
    request_bytes=8 * MiB,
    stream_readahead_bytes=64 * MiB,
)
# Values measured on the MooseFS bed (benchmarks/bench_read_path.py, RESULTS.md "Read path
# per filesystem"): sequential 8 MiB requests, one in flight, read as fast as ``cat`` (more in
# flight or 32 MiB requests were slower on the FUSE client); random member reads peaked near
# 16 in flight (4: a little less, 32: less again).
PFS = ReadStrategy(
    name="pfs",
    inflight=16,
    coalesce_gap_bytes=256 * 1024,
    request_bytes=8 * MiB,
    stream_readahead_bytes=64 * MiB,
)
STRATEGIES: dict[str, ReadStrategy] = {"local": LOCAL, "pfs": PFS}
STRATEGY_NAMES = ("auto", *STRATEGIES)


@dataclass(frozen=True, kw_only=True)
class StrategyChoice:
    """The strategy in use for a dataset, the filesystem it was chosen for, and why."""

    strategy: ReadStrategy
    fs: FsInfo
    reason: str

    def describe(self) -> str:
        """``pfs (auto: moosefs is a network filesystem)``."""
        return f"{self.strategy.name} ({self.reason})"


def _parse(value: str, what: str) -> str:
    name = value.strip().lower()
    if name not in STRATEGY_NAMES:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise UsageError(f"invalid {what} {shown!r}: choose one of {', '.join(STRATEGY_NAMES)}")
    return name


def choose_strategy(
    root: str | os.PathLike[str],
    requested: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    fs: FsInfo | None = None,
) -> StrategyChoice:
    """Choose the read strategy for the dataset at ``root``.

    ``requested`` (the ``read_strategy=`` argument) wins, then ``SHARDIO_READ_STRATEGY``,
    then the filesystem: ``pfs`` on a network or parallel filesystem, ``local`` elsewhere.

    Raises:
        UsageError: ``requested`` or the environment variable is not a strategy name.
    """
    env = os.environ if environ is None else environ
    fs = fs if fs is not None else describe_fs(root)
    if requested is not None:
        name, reason = _parse(requested, "read_strategy"), "read_strategy="
    elif env.get(ENV_VAR, "").strip():
        name, reason = _parse(env[ENV_VAR], ENV_VAR), f"{ENV_VAR}="
    else:
        name, reason = "auto", ""
    if name == "auto":
        name = "pfs" if fs.network else "local"
        kind = "a network filesystem" if fs.network else "not a network filesystem"
        reason = f"{reason}auto: {fs.name} is {kind}" if reason else f"auto: {fs.name} is {kind}"
    else:
        reason = f"{reason}{name}"
    return StrategyChoice(strategy=STRATEGIES[name], fs=fs, reason=reason)
