"""ResilientDataset: a ShardDataset that survives read faults (retry, re-stage, rebuild, skip).

``ResilientDataset(ShardDataset(path, cache=stage), policy="skip")`` reads exactly like the
dataset it wraps (map or stream mode, in DataLoader workers, with ``ds.loader(...)``, ranks
and exact resume) and applies a :class:`~shardio.read.recovery.RecoveryPolicy` to every
sample that fails, to be read or to be decoded (a
:class:`~shardio.errors.SampleDecodeError`): see :mod:`shardio.read.recovery` for the steps.
Workers send their recovery events with the batches; the training process counts them in
:attr:`ResilientDataset.recovery_stats` (a view of the rank's read metrics).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from shardio.errors import UsageError
from shardio.metrics.read import ReadMetrics
from shardio.read.recovery import Recovery, RecoveryPolicy
from shardio.runtime.dataset import ShardDataset, ShardStreamDataset
from shardio.runtime.wire import EVENTS_KEY

__all__ = ["ResilientDataset"]

_MAX_EVENTS_KEPT = 10_000  # the journal has them all; memory stays bounded
# Event kind -> the read counter that counts it.
_RECOVERY_COUNTERS = {
    "retry": "recovered",
    "restage": "restages",
    "drop": "drops",
    "rebuild": "rebuilds",
    "skip": "substitutes",
    "raise": "unavailable",
}


class ResilientDataset(ShardDataset):
    """Wrap a ShardDataset so that faults are recovered from, substituted, or raised clearly.

    Args:
        dataset: the ShardDataset to read (map or stream mode); it is left unchanged.
        policy: "raise" or "skip", or a full :class:`RecoveryPolicy`.
        rebuild: rebuilds a damaged source shard in place (``rebuild(shard_index) -> bool``),
            tried after the retries; None until a repair source (parity) exists.
        **options: fields of :class:`RecoveryPolicy` (retries, backoff_s, max_backoff_s,
            restage, budget_s, max_substitutes, journal) when ``policy`` is a string.

    Attributes:
        recovery_policy: the policy in force.
        recovery_events: the events seen by the training process (the last 10,000), each a
            dict as in the journal, from every worker.
    """

    def __new__(cls, dataset: Any, *args: Any, **kwargs: Any) -> ResilientDataset:
        del args
        # Called with a ShardDataset by users, and with (path, mode=...) when unpickled.
        mode = dataset.mode if isinstance(dataset, ShardDataset) else kwargs.get("mode", "map")
        target = _ResilientStreamDataset if mode == "stream" else cls
        if cls is _ResilientStreamDataset:
            target = cls
        return object.__new__(target)

    def __init__(
        self,
        dataset: ShardDataset,
        *,
        policy: str | RecoveryPolicy = "raise",
        rebuild: Callable[[int], bool] | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(dataset, ShardDataset):
            raise UsageError(f"ResilientDataset wraps a ShardDataset, got {type(dataset).__name__}")
        if isinstance(policy, RecoveryPolicy):
            if options:
                raise UsageError(
                    "give either a RecoveryPolicy or options, not both: "
                    + ", ".join(sorted(options))
                )
            chosen = policy
        else:
            try:
                chosen = RecoveryPolicy(policy=policy, **options)
            except TypeError as exc:
                raise UsageError(f"ResilientDataset: {exc}") from exc
        self.__dict__.update(dataset.__getstate__())
        self.cursor = dataset.cursor.copy()  # its own position, from where the dataset stood
        self._received = ReadMetrics()  # its own figures, not the wrapped dataset's
        self._closed_metrics = None
        self.recovery_policy = chosen
        self.rebuild = rebuild
        self.recovery_events: list[dict[str, Any]] = []
        self._recovery: Recovery | None = None
        self._recovery_pid = -1

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_recovery"] = None
        state["recovery_events"] = []
        return state

    # -- the hook ShardDataset reads through -------------------------------------------------
    def recovery(self) -> Recovery:
        """This process's recovery state (a forked worker gets its own)."""
        if self._recovery is None or self._recovery_pid != os.getpid():
            self._recovery = Recovery(
                self.packed,
                self.recovery_policy,
                candidates=self._candidates,
                context=self._context,
                rebuild=self.rebuild,
                probe=self._probe_sample,
            )
            self._recovery_pid = os.getpid()
        return self._recovery

    def _read_checked(self, read: Callable[[list[int]], Any], indices: list[int]) -> Any:
        recovery = self.recovery()
        batch = recovery.read_batch(read, indices)
        events = recovery.drain_events()
        if events:
            if _in_worker():
                if isinstance(batch, dict):
                    batch[EVENTS_KEY] = events
            else:
                self.absorb_events(events)
        return batch

    @property
    def recovery_stats(self) -> Counter[str]:
        """Recoveries by kind, from every worker: ``retry`` (a retry read the sample),
        ``restage``, ``drop``, ``rebuild``, ``skip`` (substituted) and ``raise``; a view of
        the rank's read metrics (``loader.metrics().counters``)."""
        counts = self.read_metrics().counts
        return Counter({kind: counts[name] for kind, name in _RECOVERY_COUNTERS.items()})

    def absorb_events(self, events: list[dict[str, Any]]) -> None:
        """Count events from a worker's batch (called by the loader)."""
        self.recovery_events.extend(events)
        del self.recovery_events[:-_MAX_EVENTS_KEPT]

    def _probe_sample(self, sample: int) -> None:
        """Read ``sample`` as it would be delivered (decoded too): a retry, or a substitute
        before it is taken."""
        self._read_decoded([sample])

    def _context(self) -> dict[str, Any]:
        ranks = self.ranks()
        return {"rank": ranks.rank, "epoch": self.epoch}

    def _candidates(self, sample: int) -> Iterator[int]:
        """Substitutes for ``sample``: drawn from this rank's share of the epoch by a hash of
        (seed, epoch, sample, k), the same in every worker and on resume. The share is a
        lazy stream: a draw computes one position, not the rank's whole epoch."""
        share = self.rank_stream(consumed=0)
        if len(share) == 0:
            return
        # More draws than tries: those on shards held unavailable are passed over unread.
        for k in range(self.recovery_policy.max_substitutes * _DRAWS_PER_TRY):
            draw = xxhash.xxh3_64_intdigest(f"{self.seed}:{self.epoch}:{sample}:{k}".encode())
            yield int(share[draw % len(share)])


_DRAWS_PER_TRY = 32


class _ResilientStreamDataset(ResilientDataset, ShardStreamDataset):
    """ResilientDataset in stream mode (an IterableDataset)."""

    mode = "stream"


def _in_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None
