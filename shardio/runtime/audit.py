"""The exactly-once epoch audit: ShardLoader's first batch observer, and the epoch's verdict.

Each rank folds the identity of every sample it hands to training (a dataset's global sample
index; a mix's ``source << 48 | index``; salted with the dataset id) into an
order-independent digest (:mod:`shardio.order.digest`: 2.4 ns a sample, about 20 ns with
the index lookups and the plan: ``benchmarks/bench_audit.py``). The span of an
epoch starts where the cursor stood at its first batch (0, or a resume's consumed
positions, also under another rank layout) and the samples before it are the plan's
prefix. At the epoch's end the ranks' digests are combined with the plan
(:mod:`shardio.order.epochplan`): through ``torch.distributed`` when it is initialised (one
``all_gather_object`` of a few hundred bytes a rank at the end of the epoch's iteration,
which every rank reaches after the same number of batches), else through per-rank record
files under ``audit_dir`` that ``shardio audit DIR`` combines; a single process judges alone. The
verdict is one log line (INFO when exact, WARNING naming what is wrong otherwise).

The identity of a delivered batch is the loader's: the planned samples of the batch's slot
in the run, as many as the batch holds. The audit proves the position accounting (resume,
elastic re-layouts, worker replacement, persistent workers' positions, rank layouts) adds up
to the plan; the bytes of each sample are proved by the reads' checksums. Samples a rank
missed or repeated are named from its delivered identities, kept up to :data:`KEEP` a rank
an epoch (8 bytes each: 32 MiB at most; beyond, counted but not named), against its share of
the plan, recomputed only when an epoch is not exact. A position that jumps ahead of what a
rank delivered (a state loaded ahead, a miscount) is a warning at once, naming the samples.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from shardio.errors import ShardioError, UsageError
from shardio.order.digest import MIX_SHIFT, Digest, dataset_salt
from shardio.order.epochplan import plan_span
from shardio.read.epochaudit import NAMED, AuditRecord, combine, write_record
from shardio.runtime.quality import shuffle_observer

if TYPE_CHECKING:
    from shardio.metrics.snapshots import MetricsSnapshot
    from shardio.order.cursor import EpochCursor
    from shardio.runtime.protocol import ReadSource

__all__ = [
    "FOLD_AT",
    "KEEP",
    "EpochAudit",
    "make_observers",
    "observe",
    "sample_facts",
    "with_audit_counts",
]

logger = logging.getLogger(__name__)

KEEP = 1 << 22  # identities a rank keeps per epoch to name its misses and repeats
FOLD_AT = 1 << 15  # identities folded at once


def observe(observers: list[Any], source: Any, epoch: int, values: Any) -> None:
    """Hand a batch delivered to training to ShardLoader's observers (the hook, internal).

    Each observer has ``observe(epoch, indices, labels, shards)``, called once per delivered
    batch before the cursor moves past it, and ``end_epoch(epoch)``, called when an epoch's
    iteration ends (every rank at the same point). ``indices``: the identities of the batch's
    samples, the run's planned positions of its slot, as many as it holds (int64: a
    dataset's global sample indices, a mix's ``source << 48 | index``); ``labels`` (int32)
    and ``shards`` (int64) from the dataset's index, None for a mix (:func:`sample_facts`).
    """
    indices, labels, shards = sample_facts(source, values)
    for observer in observers:
        observer.observe(epoch, indices, labels, shards)


def make_observers(loader: Any, audit: object) -> list[Any]:
    """A loader's batch observers: its audit (``audit``: True, False or a directory for
    the ranks' records), then the shuffle-quality observer (:mod:`shardio.runtime.quality`)
    of a dataset.

    Raises:
        UsageError: ``audit`` is none of these.
    """
    if audit is False:
        return []
    if not isinstance(audit, bool | str | os.PathLike):
        raise UsageError(f"audit must be True, False or a directory, got {audit!r}")
    source = loader.dataset

    def substitutes() -> int:
        # An auxiliary figure: a source whose read figures cannot be had (a bare ReadSource
        # of a test) is audited all the same, its substitutions not counted.
        try:
            return int(source.read_metrics()["substitutes"])
        except (AttributeError, KeyError, TypeError):
            return 0

    observers: list[Any] = [
        EpochAudit(
            source,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            audit_dir=None if isinstance(audit, bool) else os.fspath(audit),
            substitutes=substitutes,
        )
    ]
    quality = shuffle_observer(source)  # the epoch's shuffle quality, logged at its end
    if quality is not None:
        observers.append(quality)
    return observers


def with_audit_counts(snap: MetricsSnapshot, observers: list[Any]) -> MetricsSnapshot:
    """``snap`` with the audit's counters (``epochs_audited``, ``epochs_not_exact``)."""
    audits = [o for o in observers if isinstance(o, EpochAudit)]
    if not audits:
        return snap
    counts = {"epochs_audited": audits[0].epochs_audited}
    counts["epochs_not_exact"] = audits[0].epochs_not_exact
    return dataclasses.replace(snap, counters={**snap.counters, **counts})


def sample_facts(source: Any, values: Any) -> tuple[Any, Any, Any]:
    """(identities, labels, shards) of the cursor's ``values`` in ``source``: a dataset's
    sample indices with their labels and shards from its index; a mix's
    ``source << 48 | index`` (labels and shards: None)."""
    values = np.asarray(values, dtype=np.int64)
    locate = getattr(source, "locate_many", None)
    if locate is not None:
        sources, indices = locate(values)
        ids = (np.asarray(sources, dtype=np.int64) << MIX_SHIFT) | indices
        return ids, None, None
    samples = source.packed.index.samples
    return values, samples["label"][values], samples["shard"][values]


class _Span:
    """What a rank handed to training since the span's start."""

    def __init__(self, cursor: EpochCursor) -> None:
        self.epoch = cursor.epoch
        self.start = cursor.consumed
        self.history = list(cursor.history)
        self.layout = cursor.ranks()
        self.position = cursor.consumed
        self.digest = Digest()
        self.kept: list[np.ndarray[Any, Any]] | None = []
        self.kept_n = 0
        self.pending: list[np.ndarray[Any, Any]] = []  # delivered, not folded yet
        self.pending_n = 0


class EpochAudit:
    """Audit a loader's epochs (a ShardLoader observer: :meth:`observe`, :meth:`end_epoch`).

    Args:
        source: the loader's dataset or mix.
        batch_size: the loader's batch size; ``drop_last``: its drop_last.
        audit_dir: where ranks write their records when ``torch.distributed`` is not
            initialised (None: no files; a single process judges alone).
        substitutes: a function giving the substitutions counted so far on this rank.
    """

    def __init__(
        self,
        source: ReadSource,
        *,
        batch_size: int,
        drop_last: bool,
        audit_dir: str | None = None,
        substitutes: Any = None,
    ) -> None:
        self.source = source
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.audit_dir = audit_dir
        self.substitutes = substitutes or (lambda: 0)
        self.epochs_audited = 0
        self.epochs_not_exact = 0
        self._span: _Span | None = None
        self._subs0 = 0
        self._salt_of: tuple[str | None, int] | None = None

    def observe(self, epoch: int, indices: Any, labels: Any, shards: Any) -> None:
        """Fold one delivered batch (before the cursor moves past it)."""
        cursor = self.source.cursor
        span = self._span
        if span is None or span.epoch != epoch or cursor.consumed < span.position:
            span = self._span = _Span(cursor)  # a new epoch, a resume, a rewind
            self._subs0 = self.substitutes()
        elif cursor.consumed > span.position:
            self._jumped(span, cursor)
        ids = np.asarray(indices, dtype=np.int64)
        span.position += len(ids) * span.layout.world_size
        # Folded FOLD_AT at a time: numpy's cost per call would dominate a small batch.
        span.pending.append(ids)
        span.pending_n += len(ids)
        if span.pending_n >= FOLD_AT:
            self._fold(span)

    def _fold(self, span: _Span) -> None:
        """Fold the span's pending identities (kept, up to KEEP, to name samples)."""
        if not span.pending:
            return
        ids = np.concatenate(span.pending)
        span.pending, span.pending_n = [], 0
        span.digest += Digest.of(ids, self._salt())
        if span.kept is not None:
            if span.kept_n + len(ids) > KEEP:
                span.kept = None  # counted, no longer named
            else:
                span.kept.append(ids)
                span.kept_n += len(ids)

    def _jumped(self, span: _Span, cursor: EpochCursor) -> None:
        """The position moved ahead of what this rank delivered (a state loaded ahead, or a
        miscount): the positions between were never handed to training. The span goes on:
        its verdict will miss them."""
        world = span.layout.world_size
        steps = (cursor.consumed - span.position) // world
        stream = cursor.stream(consumed=span.position)
        skipped = self._identify(stream.take(0, min(steps, NAMED)))
        logger.warning(
            "epoch %d, rank %d: the position jumped from %d to %d without delivering %d of "
            "this rank's samples (%s%s)",
            span.epoch, span.layout.rank, span.position, cursor.consumed, steps,
            skipped.tolist(), ", ..." if steps > NAMED else "",
        )  # fmt: skip
        span.position = cursor.consumed

    def _salt(self) -> int:
        found = self.source.dataset_id
        if self._salt_of is None or self._salt_of[0] != found:
            self._salt_of = (found, dataset_salt(found))
        return self._salt_of[1]

    def end_epoch(self, epoch: int) -> None:
        """The epoch's iteration ended: combine the ranks' digests and log the verdict."""
        span, self._span = self._span, None
        cursor = self.source.cursor
        if span is None or span.epoch != epoch:
            span = _Span(cursor)  # an epoch with no batch (all consumed before)
        self._fold(span)
        record = self._record(span)
        gathered = _gather(record)
        if gathered is None and span.layout.world_size > 1:
            # Ranks without torch.distributed: each checks its own share and writes its
            # record for ``shardio audit`` (which needs rank 0's plan).
            record = self._named(record, span)
            self._write(record)
            if record.missing or record.duplicated:
                logger.warning(
                    "epoch %d, rank %d: its share is not exact: missed %s, repeated %s",
                    epoch, record.rank, record.missing, record.duplicated,
                )  # fmt: skip
            return
        records = gathered if gathered is not None else [record]
        verdict = combine(records)
        if not verdict.exact:
            # Only now (O(the rank's share)): which of this rank's samples are wrong.
            record = self._named(record, span)
            if gathered is None:
                verdict = combine([record])
            elif record.missing or record.duplicated:
                logger.warning(
                    "epoch %d, rank %d: missed %s, repeated %s",
                    epoch, record.rank, record.missing, record.duplicated,
                )  # fmt: skip
        self._write(record)
        self.epochs_audited += 1
        if verdict.exact:
            if span.layout.rank == 0:
                logger.info("%s", verdict.line())
        else:
            self.epochs_not_exact += 1
            logger.warning("%s", verdict.line())

    def _named(self, record: AuditRecord, span: _Span) -> AuditRecord:
        """``record`` with the samples of this rank's share it missed or repeated, when its
        digest differs from the share's (and the rank kept what it delivered)."""
        stream = self.source.cursor.stream(consumed=span.start)
        n = len(stream)
        if self.drop_last:
            n = n // self.batch_size * self.batch_size
        salt = self._salt()
        mine = Digest()
        for lo in range(0, n, KEEP):
            mine += Digest.of(self._identify(stream.take(lo, min(n, lo + KEEP))), salt)
        if mine == span.digest or span.kept is None or n > 2 * KEEP:
            return record
        missing, duplicated = _named(self._identify(stream.take(0, n)), span.kept)
        return dataclasses.replace(record, missing=missing, duplicated=duplicated)

    def _write(self, record: AuditRecord) -> None:
        """Write the rank's record under ``audit_dir`` (a failure is logged: the audit must
        never stop training)."""
        if self.audit_dir is None:
            return
        try:
            write_record(self.audit_dir, record)
        except ShardioError as exc:
            logger.warning("epoch %d: the audit record was not written: %s", record.epoch, exc)

    def _record(self, span: _Span) -> AuditRecord:
        """This rank's record of the span (rank 0's with the plan)."""
        cursor, salt = self.source.cursor, self._salt()
        layout = span.layout
        plan = None
        if layout.rank == 0:
            p = plan_span(
                cursor.shard_sizes, cursor.spec, span.epoch, layout,
                consumed=span.start, history=span.history, batch_size=self.batch_size,
                drop_last=self.drop_last, identify=self._identify, salt=salt,
            )  # fmt: skip
            plan = {
                "expected": p.expected.to_list(), "prefix": p.prefix.to_list(),
                "values": p.values, "padding": p.padding, "cut": p.cut,
            }  # fmt: skip
        return AuditRecord(
            dataset_id=self.source.dataset_id or "",
            epoch=span.epoch,
            rank=layout.rank,
            world_size=layout.world_size,
            start=span.start,
            digest=span.digest.to_list(),
            substituted=max(0, self.substitutes() - self._subs0),
            plan=plan,
        )

    def _identify(self, values: Any) -> Any:
        return sample_facts(self.source, values)[0]


def _named(planned: Any, kept: list[np.ndarray[Any, Any]]) -> tuple[list[int], list[int]]:
    """The planned identities not delivered, and those delivered more often than planned."""
    got = np.concatenate(kept) if kept else np.empty(0, dtype=np.int64)
    values, where = np.unique(np.concatenate([planned, got]), return_inverse=True)
    want = np.bincount(where[: len(planned)], minlength=len(values))
    have = np.bincount(where[len(planned) :], minlength=len(values))
    missing = values[have < want][:NAMED].tolist()
    duplicated = values[have > want][:NAMED].tolist()
    return missing, duplicated


def _gather(record: AuditRecord) -> list[AuditRecord] | None:
    """Every rank's record through ``torch.distributed`` (None when it is not initialised
    or the job has one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    # An object gather (a few hundred bytes a rank) once an epoch: the named samples and
    # rank 0's plan travel with the digests.
    dist.all_gather_object(gathered, record.to_json())
    return [AuditRecord.from_json(g, f"rank {i}'s audit record") for i, g in enumerate(gathered)]
