"""The exactly-once audit's verdict: ranks' records of an epoch combined with its plan.

Each rank's record holds the digest of what it handed to training in the epoch's span
(:mod:`shardio.order.digest`), the span's start (a resume), the recovery substitutions it
counted and, when its own share differed from its plan, the samples it missed or repeated.
Rank 0's also carries the plan (:mod:`shardio.order.epochplan`). :func:`combine` judges the
records of one epoch; :meth:`Verdict.line` is the one log line. Without
``torch.distributed`` the records go to small JSON files (:func:`write_record`, named by
dataset id, epoch and rank, written atomically, never through a symlink) that
``shardio audit DIR`` combines (:func:`read_records`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shardio._check import require_int
from shardio.errors import FormatError, StorageError, UsageError
from shardio.order.digest import Digest
from shardio.storage.atomic import atomic_write, is_temp_name
from shardio.storage.files import read_regular, real_dir

__all__ = ["AuditRecord", "Verdict", "combine", "read_records", "record_name", "write_record"]

FORMAT = "shardio-epoch-audit"
VERSION = 1
NAMED = 20  # samples named per rank (missing, duplicated)
_MAX_BYTES = 1 << 16
_NAME = re.compile(r"^audit-([0-9a-z]{1,32})-e(\d{1,9})-r(\d{1,6})\.json$")


@dataclass(frozen=True, kw_only=True)
class AuditRecord:
    """One rank's part of one epoch.

    Attributes:
        dataset_id: the dataset's id ("" when it has none).
        epoch: the epoch.
        rank: the rank; ``world_size``: the ranks of the span's layout.
        start: global positions delivered before the span (a resume's consumed).
        digest: ``[count, sum, xor]`` of what the rank handed to training in the span.
        substituted: recovery substitutions the rank counted in the span.
        missing / duplicated: samples of the rank's share it missed or repeated (the first
            :data:`NAMED`), when its digest differed from its share of the plan.
        plan: rank 0's: ``{"expected": [...], "prefix": [...], "values", "padding", "cut"}``.
    """

    dataset_id: str
    epoch: int
    rank: int
    world_size: int
    start: int
    digest: list[int]
    substituted: int = 0
    missing: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    plan: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, data: object, where: str) -> AuditRecord:
        """A record from its JSON form.

        Raises:
            FormatError: naming ``where`` and the first field that is wrong.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise FormatError(f"{where}: not a shardio epoch audit record")
        if data.get("version") != VERSION:
            raise FormatError(f"{where}: unsupported audit record version {data.get('version')!r}")
        try:
            ints = {
                k: require_int(data[k], k, minimum=0)
                for k in ("epoch", "rank", "world_size", "start", "substituted")
            }
            digest = [require_int(v, "digest", minimum=-(1 << 63)) for v in data["digest"]]
            named = {
                k: [require_int(v, k, minimum=0) for v in data[k]]
                for k in ("missing", "duplicated")
            }
            plan = data["plan"]
            if plan is not None:
                plan = {k: plan[k] for k in ("expected", "prefix", "values", "padding", "cut")}
                for k in ("expected", "prefix"):
                    plan[k] = [require_int(v, k, minimum=-(1 << 64)) for v in plan[k]]
                    if len(plan[k]) != 3:
                        raise UsageError(f"plan {k!r} must hold 3 integers")
                for k in ("values", "padding", "cut"):
                    plan[k] = require_int(plan[k], k, minimum=0)
            if len(digest) != 3 or not isinstance(data["dataset_id"], str):
                raise UsageError("digest must hold 3 integers, dataset_id a string")
            if ints["rank"] >= ints["world_size"]:
                raise UsageError(f"rank {ints['rank']} of world size {ints['world_size']}")
        except (KeyError, TypeError, UsageError) as exc:
            raise FormatError(f"{where}: malformed audit record ({exc})") from exc
        return cls(
            dataset_id=data["dataset_id"],
            epoch=ints["epoch"],
            rank=ints["rank"],
            world_size=ints["world_size"],
            start=ints["start"],
            substituted=ints["substituted"],
            digest=digest,
            missing=named["missing"],
            duplicated=named["duplicated"],
            plan=plan,
        )

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values."""
        return {"format": FORMAT, "version": VERSION, **asdict(self)}


def record_name(dataset_id: str, epoch: int, rank: int) -> str:
    """The file name of a rank's record: by dataset id, epoch and rank."""
    tag = re.sub(r"[^0-9a-z]", "", dataset_id.lower())[:32] or "noid"
    return f"audit-{tag}-e{epoch:06d}-r{rank:05d}.json"


def write_record(directory: str, record: AuditRecord) -> str:
    """Write ``record`` into ``directory`` atomically; its path.

    Raises:
        StorageError: the directory is missing, a symlink or not a directory, or the write
            failed.
    """
    if not real_dir(directory):
        raise StorageError(
            20, f"audit_dir {directory} is not a directory (a symlink is refused): create it"
        )
    path = os.path.join(directory, record_name(record.dataset_id, record.epoch, record.rank))
    with atomic_write(path, durable=False) as fh:
        fh.write(json.dumps(record.to_json(), sort_keys=True).encode())
    return path


def read_records(directory: str) -> dict[tuple[str, int], list[AuditRecord]]:
    """The records found in ``directory``, by (dataset id, epoch).

    Raises:
        UsageError: ``directory`` is not a directory (or a symlink to one).
        StorageError: a record is a symlink or not a regular file.
        FormatError: a record is malformed, or its content disagrees with its name.
    """
    if not real_dir(directory):
        raise UsageError(f"{directory} is not a directory (a symlink is refused)")
    found: dict[tuple[str, int], list[AuditRecord]] = {}
    for name in sorted(os.listdir(directory)):
        if is_temp_name(name) or not name.startswith("audit-"):
            continue
        path = os.path.join(directory, name)
        match = _NAME.match(name)
        if match is None:
            raise FormatError(f"{path}: not an audit record's name (audit-ID-eEPOCH-rRANK.json)")
        raw = read_regular(path, max_bytes=_MAX_BYTES, what="audit record", nofollow=True)
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise FormatError(f"{path}: not JSON ({exc})") from exc
        record = AuditRecord.from_json(data, path)
        if name != record_name(record.dataset_id, record.epoch, record.rank):
            raise FormatError(f"{path}: its content is of epoch {record.epoch} rank {record.rank}")
        found.setdefault((record.dataset_id, record.epoch), []).append(record)
    return found


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One epoch judged.

    Attributes:
        epoch: the epoch; ``exact``: every planned sample delivered exactly once.
        samples: distinct samples of the plan (planned deliveries less padding).
        delivered: deliveries counted (the resumed prefix included).
        planned: planned deliveries (padding included).
        substituted / padding / cut: as counted and planned.
        problems: what is wrong, one phrase each (empty when exact).
    """

    epoch: int
    exact: bool
    samples: int
    delivered: int
    planned: int
    substituted: int
    padding: int
    cut: int
    problems: tuple[str, ...] = ()

    def line(self) -> str:
        """The log line of the epoch."""
        notes = []
        if self.substituted:
            notes.append(f"{self.substituted:,} substituted, listed in the journal")
        if self.padding:
            notes.append(f"{self.padding:,} planned repeats to even the ranks")
        if self.cut:
            notes.append(f"{self.cut:,} cut by drop_last")
        tail = f" ({'; '.join(notes)})" if notes else ""
        if self.exact:
            return f"epoch {self.epoch}: {self.samples:,} samples, each exactly once{tail}"
        return (
            f"epoch {self.epoch}: NOT exactly once: {self.delivered:,} deliveries, the plan has "
            f"{self.planned:,}{tail}: " + "; ".join(self.problems)
        )


def combine(records: Sequence[AuditRecord]) -> Verdict:
    """Judge one epoch from its ranks' records (rank 0's carries the plan).

    Raises:
        UsageError: the records are of several datasets or epochs, or none carries a plan.
    """
    if not records:
        raise UsageError("no audit records to combine")
    first = records[0]
    for r in records:
        if (r.dataset_id, r.epoch) != (first.dataset_id, first.epoch):
            raise UsageError(
                f"audit records of dataset {r.dataset_id or '?'} epoch {r.epoch} and of "
                f"{first.dataset_id or '?'} epoch {first.epoch} cannot be combined"
            )
    plans = [r.plan for r in records if r.plan is not None]
    if not plans:
        raise UsageError(f"epoch {first.epoch}: no record carries the plan (rank 0's is missing)")
    plan = plans[0]
    problems = []
    world = {r.world_size for r in records}
    starts = {r.start for r in records}
    ranks = [r.rank for r in records]
    if len(world) > 1 or len(starts) > 1:
        problems.append(
            f"the ranks disagree on the layout or the resume point (world sizes "
            f"{sorted(world)}, starts {sorted(starts)}): were they launched alike?"
        )
    twice = sorted({k for k in ranks if ranks.count(k) > 1})
    if twice:
        problems.append(f"rank(s) {twice} reported more than once: ranks that think alike?")
    absent = sorted(set(range(max(world))) - set(ranks))
    if absent:
        problems.append(f"no record of rank(s) {_short(absent)}")
    delivered = Digest.from_list(plan["prefix"])
    for r in records:
        delivered += Digest.from_list(r.digest)
    expected = Digest.from_list(plan["expected"])
    if delivered != expected and not problems:
        diff = delivered.count - expected.count
        if diff < 0:
            problems.append(f"{-diff:,} deliveries missing")
        elif diff > 0:
            problems.append(f"{diff:,} deliveries too many")
        else:
            problems.append("as many deliveries as planned, but not the planned samples")
    for r in records:
        if r.missing or r.duplicated:
            problems.append(
                f"rank {r.rank} missed {_short(r.missing)} and repeated {_short(r.duplicated)}"
            )
    return Verdict(
        epoch=first.epoch,
        exact=delivered == expected and not problems,
        samples=expected.count - plan["padding"],
        delivered=delivered.count,
        planned=expected.count,
        substituted=sum(r.substituted for r in records),
        padding=plan["padding"],
        cut=plan["cut"],
        problems=tuple(problems),
    )


def _short(values: Sequence[int]) -> str:
    """Values for a message: the first few, and how many more."""
    if not values:
        return "none"
    shown = ", ".join(str(v) for v in values[:NAMED])
    return f"[{shown}{', ...' if len(values) > NAMED else ''}]"
