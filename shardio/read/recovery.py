"""Recovery from read faults: retry, re-stage, rebuild, then the policy (raise or skip).

:class:`Recovery` wraps any batch read (``read(indices) -> batch``). When a sample fails
with an ``OSError`` (EIO, a truncated or missing shard) or a checksum mismatch, it is handled
in this order (a :class:`~shardio.errors.SampleDecodeError`, whose bytes are intact, goes
straight to step 4: re-reading or rebuilding gives the same bytes):

1. the bad staged copy (if the bytes came from one) was already dropped and staged again
   from the source, verified, once per node, by the reader (``ShardReader(restage=True)``);
2. the sample is read again with bounded exponential backoff (transient EIO), each time
   through freshly opened files;
3. the shard is rebuilt by the ``rebuild`` hook: the caller's, or for a dataset with parity
   :class:`~shardio.read.rebuild.ParityRebuild` (from the other files of its group);
4. the policy: ``raise`` a :class:`~shardio.errors.SampleUnavailableError` naming the shard,
   the sample and everything tried (the SampleDecodeError itself for an undecodable one), or
   ``skip``: substitute a sample drawn deterministically from the same rank's share (so
   per-rank counts stay equal and a resume reads the same); a substitute is read, and
   decoded, before it is taken.

A read that stalled past its deadline (``read_timeout_s``, a
:class:`~shardio.errors.ReadStalledError`) is a failed read like any other, but its shard is
then held unavailable on the node for a while (:mod:`shardio.read.unavailable`): its other
samples are not retried (they would stall again) and substitutes are drawn from other shards,
so a dead data server costs one deadline per shard, not per sample; with a rebuild hook the
shard is rebuilt at once instead (its group's other files are read, not it), its hold ended,
and the sample read from the new file.

Nothing retries forever: retries are counted, waits are capped, and an optional wall-clock
budget (``budget_s``, from the policy's creation, shared by every worker of the job) stops
repairs once spent. Every event is logged once, counted in the reader's metrics
(:class:`~shardio.metrics.read.ReadMetrics`), queued for the training process
(:meth:`Recovery.drain_events`) and appended to the journal.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardio._check import require_int, require_seconds
from shardio.errors import (
    SampleDecodeError,
    SampleUnavailableError,
    ShardioError,
    StorageError,
    UsageError,
)
from shardio.read.handoff import Event
from shardio.read.journal import RepairJournal
from shardio.read.reader import ShardReader

__all__ = ["POLICIES", "Recovery", "RecoveryPolicy"]

logger = logging.getLogger(__name__)

POLICIES = ("raise", "skip")

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RecoveryPolicy:
    """How a reader recovers from a sample it cannot read.

    Args:
        policy: "raise" (default) or "skip" (substitute a sample of the same rank's share).
        retries: re-reads of a failing sample after its first failure (0 to 100).
        backoff_s: wait before the first re-read; doubled before each later one.
        max_backoff_s: cap on one wait.
        restage: stage a bad staged copy again from the source (once per node).
        budget_s: wall-clock seconds for repairs (re-staging, rebuilding, waiting), counted
            from the policy's creation and shared by every process of the job; None: no limit.
        max_substitutes: candidates read for one skipped sample (candidates on shards held
            unavailable are passed over without a read and do not count).
        journal: the JSON-lines journal; None: ``repairs.jsonl`` beside the staging area's
            records when reading through one, else no file (events are still logged).
        created_at: when the budget started (set automatically).
    """

    policy: str = "raise"
    retries: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    restage: bool = True
    budget_s: float | None = None
    max_substitutes: int = 16
    journal: str | None = None
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise UsageError(f"invalid policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        for name in ("retries", "max_substitutes"):
            object.__setattr__(
                self, name, require_int(getattr(self, name), name, minimum=0, maximum=100)
            )
        for name in ("backoff_s", "max_backoff_s"):
            object.__setattr__(self, name, require_seconds(getattr(self, name), name))
        if self.budget_s is not None:
            object.__setattr__(self, "budget_s", require_seconds(self.budget_s, "budget_s"))
        if self.journal is not None and not isinstance(self.journal, str | os.PathLike):
            raise UsageError(f"journal must be a path, got {type(self.journal).__name__}")

    def deadline(self) -> float | None:
        """The wall-clock time (``time.time()``) after which no repair starts."""
        return None if self.budget_s is None else self.created_at + self.budget_s


# StorageError, ChecksumMismatchError (an IntegrityError), raw EIO, and a sample whose checked
# bytes its decoder refuses.
_Recoverable = (OSError, SampleDecodeError)


class Recovery:
    """Apply a :class:`RecoveryPolicy` to the reads of one process.

    The reader is not rewired: open it with ``restage=policy.restage`` and its
    ``on_event`` routed to :meth:`emit` (its dropped and re-staged copies are events too).

    Args:
        ds: the packed dataset read from.
        policy: the policy.
        candidates: substitutes for a failed sample, in the order to try (deterministic:
            drawn from the same rank's share of the epoch).
        context: fields added to every journal event (rank, epoch, ...).
        rebuild: rebuilds a shard in place from a repair source (parity); returns whether it
            did. None: no repair source.
        probe: reads one sample as the caller delivers it (decoded too), raising what its read
            would; used on retries and on every substitute before it is taken. None: read
            and verify its members (``ds.read_sample``).
        sleep, clock: injected for tests.
    """

    def __init__(
        self,
        ds: ShardReader,
        policy: RecoveryPolicy,
        *,
        candidates: Callable[[int], Iterable[int]],
        context: Callable[[], dict[str, Any]] | None = None,
        rebuild: Callable[[int], bool] | None = None,
        probe: Callable[[int], object] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ds = ds
        self.policy = policy
        self.candidates = candidates
        self.context = context
        self.rebuild = rebuild
        self.probe = probe
        self.sleep = sleep
        self.clock = clock
        self.metrics = ds.metrics  # counts retries, rebuilds, substitutes, ... with the reads
        self.bad_shards: set[int] = set()  # not retried again in this process
        # Samples known unreadable here. Substitutes are skipped by sample, not by shard: a
        # good sample of a shard that failed elsewhere is still taken, so the substitute does
        # not depend on what this process read before (a resumed run substitutes the same).
        self.bad_samples: set[int] = set()
        self._pending: list[Event] = []
        journal = policy.journal
        if journal is None and ds.resolver.can_restage():
            from shardio.read.journal import JOURNAL_NAME
            from shardio.staging.protocol import STAGE_DIR

            journal = os.path.join(str(ds.cache_root), STAGE_DIR, JOURNAL_NAME)
        self.journal = RepairJournal(journal) if journal is not None else None
        self._journal_failed = False

    # -- events ------------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Log, queue and journal one event (the reader's own events come here too: open
        it with ``on_event`` routed to this; the resolver counted them already)."""
        if self.context is not None:
            event = {**self.context(), **event}
        logger.warning("shardio recovery: %s", _describe(event))
        self._pending.append(event)
        if self.journal is not None and not self._journal_failed:
            try:
                self.journal.append(event)
            except StorageError as exc:  # the journal must never stop training
                self._journal_failed = True
                logger.error("%s; recovery events are only logged from now on", exc)

    def drain_events(self) -> list[Event]:
        """Events since the last call (the loader carries them to the training process)."""
        events, self._pending = self._pending, []
        return events

    # -- the read ------------------------------------------------------------------------------
    def read_batch(self, read: Callable[[list[int]], T], indices: Iterable[int]) -> T:
        """``read(indices)``, with every failing sample recovered or substituted.

        Raises:
            SampleUnavailableError: under ``raise``, or when no substitute could be read.
        """
        current = [int(i) for i in indices]
        for _ in range(len(current) * (self.policy.max_substitutes + 2) + 2):
            try:
                return read(current)
            except _Recoverable as exc:
                sample = getattr(exc, "sample_index", None)
                if sample is None or sample not in current:
                    raise  # not a sample's read (a bug, or an error outside the reads)
                replacement = self.recover(sample, exc)
                current = [replacement if s == sample else s for s in current]
        raise SampleUnavailableError(  # pragma: no cover - each round fixes one sample
            "a batch kept failing after every sample was recovered",
            shard="?",
            key="?",
            sample=current[0] if current else -1,
            tried=(),
        )

    def _within_budget(self) -> bool:
        deadline = self.policy.deadline()
        return deadline is None or self.clock() < deadline

    def _probe(self, sample: int, *, reopen: bool = True) -> None:
        """Read and verify every member of ``sample`` (and decode it, with a ``probe``):
        through freshly opened files when ``reopen`` (a retry: the old descriptor may be
        stale), else through the files already open (a substitute drawn from another shard:
        a close and an open each wait behind a dead server's requests on a FUSE client whose
        few threads they hold, so a substitute costs no metadata call)."""
        if reopen:
            shard = self.ds.shard_of(sample)
            self.ds.pool.discard(self.ds.shard_path(shard))
            self.ds.resolver.forget(shard)
        if self.probe is not None:
            self.probe(sample)
        else:
            self.ds.read_sample(sample, verify=True)

    def recover(self, sample: int, error: BaseException) -> int:
        """The sample to read in place of ``sample``, which failed with ``error``: itself
        when a retry or a repair succeeded, else a substitute (policy ``skip``).

        Raises:
            SampleUnavailableError: under ``raise``, or when no substitute could be read.
            SampleDecodeError: ``error`` itself when it is one, under ``raise``.
        """
        shard = self.ds.shard_of(sample)
        rel = self.ds.manifest.shards[shard].path
        key = self.ds.key(sample)
        base = {"shard": rel, "sample": sample, "key": key}
        tried = [f"read: {error}"]
        if isinstance(error, SampleDecodeError):
            # Its bytes match their checksum: a re-read, a re-stage or a rebuild gives the same
            # bytes, and the shard's other samples are fine (it is not marked bad).
            tried = [f"decode: {error}", "not read again: its bytes match their checksum"]
            return self._give_up(sample, base, error, tried)
        held = self._held(shard)
        if held is not None:
            # Its read stalled (here or in another process of the node): a retry would stall
            # again or be refused; the dead server costs one deadline per shard, not per sample.
            # A rebuild reads the other files of its group instead, and writes the shard anew.
            tried.append(f"shard held unavailable for {held:.0f} s more after a stall")
            if shard not in self.bad_shards and self._try_rebuild(sample, shard, base, error,
                                                                  tried):  # fmt: skip
                return sample
            self.bad_shards.add(shard)
            return self._give_up(sample, base, error, tried)
        if shard not in self.bad_shards:
            wait = self.policy.backoff_s
            for attempt in range(1, self.policy.retries + 1):
                if not self._within_budget():
                    tried.append("retries stopped: the repair budget is spent")
                    break
                self.sleep(min(wait, self.policy.max_backoff_s))
                wait *= 2
                self.metrics.add("retries")
                try:
                    self._probe(sample)
                except _Recoverable as exc:
                    tried.append(f"retry {attempt}: {exc}")
                    continue
                self.metrics.add("recovered")
                self.emit({**base, "event": "retry", "attempt": attempt, "error": str(error)})
                return sample
            if self._try_rebuild(sample, shard, base, error, tried):
                return sample
        else:
            tried.append("shard already failed in this process: no more retries")
        self.bad_shards.add(shard)
        return self._give_up(sample, base, error, tried)

    def _try_rebuild(
        self, sample: int, shard: int, base: Event, error: BaseException, tried: list[str]
    ) -> bool:
        """Rebuild ``shard`` with the hook (parity), end its hold, and read ``sample`` again;
        whether that worked (what failed is added to ``tried``)."""
        if self.rebuild is None:
            tried.append("rebuild: no repair source for this shard")
            return False
        if not self._within_budget():
            tried.append("rebuild: the repair budget is spent")
            return False
        try:
            rebuilt = self.rebuild(shard)
        except (*_Recoverable, ShardioError) as exc:  # a group beyond repair, a lock timeout
            tried.append(f"rebuild: {exc}")
            return False
        if not rebuilt:
            tried.append("rebuild: the repair source could not rebuild this shard")
            return False
        release = getattr(self.ds.opener, "release", None)
        if release is not None:  # a new file: the stall of the old one says nothing of it
            release(self.ds.shard_path(shard))
        try:
            self._probe(sample)
        except _Recoverable as exc:
            tried.append(f"read after rebuild: {exc}")
            return False
        self.metrics.add("rebuilds")
        # "wrote": whether this process wrote the shard (a hook may say it found it intact).
        wrote = bool(getattr(self.rebuild, "wrote", True))
        self.emit({**base, "event": "rebuild", "wrote": wrote, "error": str(error)})
        return True

    def _held(self, shard: int) -> float | None:
        """Seconds the file shard ``shard`` is read from stays held unavailable after a stall
        (:mod:`shardio.read.unavailable`), or None."""
        held = getattr(self.ds.opener, "held", None)
        if held is None:
            return None
        try:
            left: float | None = held(self.ds.shard_path(shard))
        except OSError:
            return None
        return left

    def _give_up(self, sample: int, base: Event, error: BaseException, tried: list[str]) -> int:
        """The policy for a sample nothing could read: raise, or a substitute (``skip``)."""
        self.bad_samples.add(sample)
        key, rel = str(base["key"]), str(base["shard"])
        if self.policy.policy == "raise":
            self.metrics.add("unavailable")
            self.emit({**base, "event": "raise", "error": str(error), "tried": tried})
            if isinstance(error, SampleDecodeError):
                raise error  # the typed error itself: it names the sample already
            raise SampleUnavailableError(
                f"sample {key!r} of shard {rel} cannot be read: " + "; ".join(tried),
                shard=rel,
                key=key,
                sample=sample,
                tried=tuple(tried),
            ) from error
        return self._substitute(sample, base, error, tried)

    def _substitute(self, sample: int, base: Event, error: BaseException, tried: list[str]) -> int:
        probed = held_skips = 0
        for drawn in self.candidates(sample):
            if probed >= self.policy.max_substitutes:
                break
            candidate = int(drawn)
            if candidate == sample or candidate in self.bad_samples:
                continue
            candidate_shard = self.ds.shard_of(candidate)
            held = self._held(candidate_shard)
            if held is not None:  # a substitute must not stall again
                # Passing one over costs no read: it does not use up the tries (with half
                # the shards behind a dead server, 16 draws could all land on them), but
                # the draws are bounded (the candidates' own bound).
                held_skips += 1
                if held_skips <= 4:
                    tried.append(f"substitute {self.ds.key(candidate)!r}: its shard is held")
                continue
            probed += 1
            try:
                self._probe(candidate, reopen=candidate_shard in self.bad_shards)
            except _Recoverable as exc:
                self.bad_samples.add(candidate)
                tried.append(f"substitute {self.ds.key(candidate)!r}: {exc}")
                continue
            self.metrics.add("substitutes")
            self.emit(
                {
                    **base,
                    "event": "skip",
                    "substitute": candidate,
                    "substitute_key": self.ds.key(candidate),
                    "error": str(error),
                }
            )
            return candidate
        if held_skips > 4:
            tried.append(f"{held_skips - 4} more substitutes on held shards")
        self.metrics.add("unavailable")
        self.emit({**base, "event": "raise", "error": str(error), "tried": tried})
        raise SampleUnavailableError(
            f"sample {base['key']!r} of shard {base['shard']} cannot be read and no substitute "
            "could be: " + "; ".join(tried),
            shard=str(base["shard"]),
            key=str(base["key"]),
            sample=sample,
            tried=tuple(tried),
        ) from error


def _describe(event: Event) -> str:
    kind = event.get("event")
    where = f"shard {event.get('shard')}"
    if "key" in event:
        where += f" sample {event['key']!r}"
    if kind == "skip":
        return f"{where}: substituted by {event.get('substitute_key')!r} ({event.get('error')})"
    if kind == "retry":
        return f"{where}: read again on retry {event.get('attempt')} ({event.get('error')})"
    if kind == "restage":
        return f"{where}: staged copy was bad ({event.get('why')}), staged again"
    if kind == "drop":
        return f"{where}: staged copy was bad ({event.get('why')}), reading the source"
    return f"{where}: {kind} ({event.get('error', event.get('why', ''))})"
