"""The recovery a ShardDataset reads through: a policy given to the reader, not a subclass.

``ShardDataset(path, recovery="skip")`` (or ``ResilientDataset(ds, policy="skip")``, which
returns such a dataset) holds one :class:`SampleRecovery`: the
:class:`~shardio.read.recovery.RecoveryPolicy`, the optional ``rebuild`` hook and the events
the training process received. Each process (a DataLoader worker included) builds its own
:class:`~shardio.read.recovery.Recovery` over its own reader on first use; the dataset reads
every batch through :meth:`SampleRecovery.read`. Nothing here writes the dataset's or the
reader's state: the reader was opened with the policy's ``restage`` and hands its events to
the dataset, which passes them to :meth:`SampleRecovery.reader_event`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import xxhash

from shardio.errors import UsageError
from shardio.order import RankStream
from shardio.order.ranks import RankInfo
from shardio.read.handoff import Event
from shardio.read.reader import ShardReader
from shardio.read.rebuild import parity_rebuild_for
from shardio.read.recovery import Recovery, RecoveryPolicy

__all__ = ["RECOVERY_COUNTERS", "Recoverable", "SampleRecovery", "make_policy"]

T = TypeVar("T")

_MAX_EVENTS_KEPT = 10_000  # the journal has them all; memory stays bounded
_DRAWS_PER_TRY = 32
# Event kind -> the read counter that counts it.
RECOVERY_COUNTERS = {
    "retry": "recovered",
    "restage": "restages",
    "drop": "drops",
    "rebuild": "rebuilds",
    "skip": "substitutes",
    "raise": "unavailable",
}


class Recoverable(Protocol):
    """What a recovery needs of the dataset it reads for (ShardDataset has it)."""

    @property
    def packed(self) -> ShardReader: ...

    @property
    def seed(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    def ranks(self) -> RankInfo: ...

    def rank_stream(self, *, consumed: int | None = None) -> RankStream: ...

    def probe_sample(self, sample: int) -> None: ...


def make_policy(policy: str | RecoveryPolicy, options: Mapping[str, Any]) -> RecoveryPolicy:
    """A policy from a name and RecoveryPolicy's fields, or the policy given (no options).

    Raises:
        UsageError: options beside a RecoveryPolicy, an unknown option or a bad value.
    """
    if isinstance(policy, RecoveryPolicy):
        if options:
            raise UsageError(
                "give either a RecoveryPolicy or options, not both: " + ", ".join(sorted(options))
            )
        return policy
    if not isinstance(policy, str):
        raise UsageError(
            f"recovery policy must be a name or a RecoveryPolicy, got {type(policy).__name__}"
        )
    try:
        return RecoveryPolicy(policy=policy, **options)
    except TypeError as exc:
        raise UsageError(f"recovery policy: {exc}") from exc


class SampleRecovery:
    """A policy, a rebuild hook, and this process's :class:`Recovery` (built lazily).

    Picklable with its policy and hook: a worker gets a copy and builds its own Recovery.

    Attributes:
        policy: the policy in force.
        rebuild: rebuilds a damaged source shard in place (``rebuild(shard) -> bool``), or None.
        events: the events the training process received (the last 10,000).
    """

    def __init__(
        self, policy: RecoveryPolicy, rebuild: Callable[[int], bool] | None = None
    ) -> None:
        self.policy = policy
        self.rebuild = rebuild
        self.events: list[Event] = []
        self._recovery: Recovery | None = None
        self._pid = -1
        self._for: ShardReader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"policy": self.policy, "rebuild": self.rebuild}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["policy"], state["rebuild"])  # type: ignore[misc]

    def fresh(self) -> SampleRecovery:
        """The same policy and hook, with no events and no process state (for a copy of
        the dataset)."""
        return SampleRecovery(self.policy, self.rebuild)

    def for_process(self, ds: Recoverable) -> Recovery:
        """This process's Recovery over ``ds``'s reader (a forked worker, or a reader
        reopened, gets a new one)."""
        packed = ds.packed
        if self._recovery is None or self._pid != os.getpid() or self._for is not packed:
            # A dataset with parity rebuilds from it unless the caller gave a hook.
            rebuild = self.rebuild if self.rebuild is not None else parity_rebuild_for(packed)
            self._recovery = Recovery(
                packed,
                self.policy,
                candidates=lambda sample: _candidates(ds, self.policy, sample),
                context=lambda: {"rank": ds.ranks().rank, "epoch": ds.epoch},
                rebuild=rebuild,
                probe=ds.probe_sample,
            )
            self._pid, self._for = os.getpid(), packed
        return self._recovery

    def read(
        self, ds: Recoverable, read: Callable[[list[int]], T], indices: list[int]
    ) -> tuple[T, list[Event]]:
        """``read(indices)`` with every failing sample recovered or substituted, and the
        events of the read."""
        recovery = self.for_process(ds)
        batch = recovery.read_batch(read, indices)
        return batch, recovery.drain_events()

    def reader_event(self, ds: Recoverable, event: Event) -> None:
        """An event of the reader (a dropped or re-staged copy): logged, queued, journalled."""
        self.for_process(ds).emit(event)

    def absorb(self, events: list[Event]) -> None:
        """Keep the events a batch brought (the training process)."""
        self.events.extend(events)
        del self.events[:-_MAX_EVENTS_KEPT]

    @staticmethod
    def stats(counts: Mapping[str, int]) -> Counter[str]:
        """Recoveries by kind from a rank's read counters."""
        return Counter({kind: counts[name] for kind, name in RECOVERY_COUNTERS.items()})


def _candidates(ds: Recoverable, policy: RecoveryPolicy, sample: int) -> Iterator[int]:
    """Substitutes for ``sample``: drawn from this rank's share of the epoch by a hash of
    (seed, epoch, sample, k), the same in every worker and on resume. The share is a lazy
    stream: a draw computes one position, not the rank's whole epoch."""
    share = ds.rank_stream(consumed=0)
    if len(share) == 0:
        return
    # More draws than tries: those on shards held unavailable are passed over unread.
    for k in range(policy.max_substitutes * _DRAWS_PER_TRY):
        draw = xxhash.xxh3_64_intdigest(f"{ds.seed}:{ds.epoch}:{sample}:{k}".encode())
        yield int(share[draw % len(share)])
