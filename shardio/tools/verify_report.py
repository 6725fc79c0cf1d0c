"""What a verify run found: its report, the problems of shards and staged copies, their states.

:func:`shardio.tools.verify.verify_dataset` returns a :class:`VerifyReport`; ``--json``
prints its :meth:`~VerifyReport.to_json`, and ``verify --repair`` acts on its problems.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DAMAGED",
    "FOREIGN",
    "MISSING",
    "REWRITABLE",
    "STALE",
    "UNSTAGED",
    "AreaReport",
    "BadMember",
    "ShardProblem",
    "VerifyReport",
]

# The states of a problem (a staged copy's, or a shard's of a packed dataset).
MISSING, DAMAGED, STALE, FOREIGN = "missing", "damaged", "stale", "foreign"
# A DALI ``.idx`` that is missing beside an intact shard: a function of the shard and the
# index, written again by ``verify --repair`` (no training byte is lost; DALI needs it).
REWRITABLE = "rewritable"
# A shard never staged (or evicted) in a partly staged area: no copy and no stamp. Not a
# problem (``--node I/N`` and ``--capacity`` stage a share); its source is checked instead.
UNSTAGED = "unstaged"


@dataclass(frozen=True)
class BadMember:
    """A member whose bytes do not match the index."""

    key: str
    ext: str
    expected: str
    actual: str


@dataclass(frozen=True)
class ShardProblem:
    """What is wrong with one shard (or the index).

    Attributes:
        path: the shard's (or index's) path in the manifest.
        reason: one line saying what is wrong.
        bad_members: the members whose bytes do not match the index.
        state: "missing", "damaged", "stale" (a staged copy changed since it was staged,
            bytes intact), "foreign" (a symlink or special file where a staged copy
            belongs: never read, replaced or removed) or "rewritable" (a DALI ``.idx``
            missing beside its intact shard: ``path`` is the ``.idx``'s; written again from
            the shard's index records by ``verify --repair``).
        staged: the problem is a staged copy's in a staging area (the source may be fine).
        identity: (device, inode) of the file found with wrong bytes, so that a repair drops
            that file only and keeps one another process has replaced it with meanwhile.
        samples_lost: samples of the shard none of whose bytes could be checked (the shard
            is missing, empty, unreadable, or its index records are damaged): every one of
            its samples, from the manifest; 0 when the damage is in ``bad_members``.
    """

    path: str
    reason: str
    bad_members: tuple[BadMember, ...] = ()
    state: str = DAMAGED
    staged: bool = False
    identity: tuple[int, int] | None = field(default=None, compare=False, repr=False)
    samples_lost: int = 0
    parity: bool = False  # a parity file or cell table (no training data in it)

    def to_json(self) -> dict[str, Any]:
        """The problem as the JSON of ``shardio verify --json``."""
        return {
            "shard": self.path,
            "reason": self.reason,
            "bad_samples": [
                {"key": b.key, "member": b.ext, "expected": b.expected, "actual": b.actual}
                for b in self.bad_members
            ],
            "state": self.state,
            "staged": self.staged,
            "samples_lost": self.samples_lost,
            "parity": self.parity,
        }


@dataclass(frozen=True)
class AreaReport:
    """What a verify of a staging area found beyond its copies.

    Attributes:
        source: the dataset the area was staged from, which readers fall back to.
        copies_ok: staged copies found intact and stamped.
        not_staged: shards of the dataset this area holds no copy of (never staged here, or
            evicted): read from the source, whose copy of them is checked.
        source_checked: source shards checked (those whose staged copy is not ok): exists,
            a regular file, its size as the manifest says. Their bytes are not read.
        source_problems: what is wrong with those source shards.
    """

    source: str
    copies_ok: int
    source_checked: int = 0
    not_staged: int = 0
    source_problems: tuple[ShardProblem, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The area's section of ``shardio verify --json``."""
        return {
            "source": self.source,
            "copies_ok": self.copies_ok,
            "not_staged": self.not_staged,
            "source_checked": self.source_checked,
            "source_problems": [p.to_json() for p in self.source_problems],
        }


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of a verify run.

    ``status`` sums it up: "intact"; "degraded" (a staging area whose copies are missing,
    damaged or stale while the source shards readers fall back to are intact: training gets
    every byte, from the parallel filesystem; or a dataset whose parity files or DALI
    indexes alone are bad);
    "damaged" (bytes are lost: a shard or the index of a dataset, or a staged copy whose
    source is bad too). ``rebuildable`` lists the damaged shards parity can rebuild.
    """

    root: str
    quick: bool
    shards_checked: int
    bytes_checked: int
    seconds: float
    problems: tuple[ShardProblem, ...] = field(default_factory=tuple)
    index_path: str = "index.bin"  # the index's path in the manifest (a problem may name it)
    area: AreaReport | None = None  # set when ``root`` is a staging area
    parity_checked: int = 0  # parity files and cell tables checked
    rebuildable: tuple[str, ...] = ()  # bad shards whose parity group can rebuild them
    over_parity: tuple[int, ...] = ()  # parity groups with more bad files than parity files

    @property
    def ok(self) -> bool:
        """Whether the dataset (or every staged copy) is intact."""
        return not self.problems and not (self.area is not None and self.area.source_problems)

    @property
    def damaged(self) -> bool:
        """Whether bytes are lost: damage outside staged copies, or a bad source for one (a
        rewritable DALI index loses none)."""
        return any(
            not p.staged and not p.parity and p.state != REWRITABLE for p in self.problems
        ) or bool(self.area is not None and self.area.source_problems)

    @property
    def status(self) -> str:
        """ "intact", "degraded" or "damaged" (see the class docstring)."""
        if self.ok:
            return "intact"
        return "damaged" if self.damaged else "degraded"

    @property
    def parity_paths(self) -> frozenset[str]:
        """The paths of the parity files and cell tables among the problems."""
        return frozenset(p.path for p in self.problems if p.parity)

    @property
    def damaged_samples(self) -> tuple[str, ...]:
        """Keys of the samples with at least one bad member."""
        return tuple(dict.fromkeys(b.key for p in self.problems for b in p.bad_members))

    @property
    def samples_lost(self) -> int:
        """Samples of the shards that could not be checked at all (missing, empty,
        unreadable, damaged index records), counted from the manifest."""
        return sum(p.samples_lost for p in self.problems)

    @property
    def samples_affected(self) -> int:
        """Samples training cannot get intact: those with a bad member, and every sample
        of a shard that could not be checked at all."""
        return len(self.damaged_samples) + self.samples_lost

    def to_json(self) -> dict[str, Any]:
        """The report as the JSON of ``shardio verify --json`` (fields are only ever added)."""
        return {
            "ok": self.ok,
            "quick": self.quick,
            "shards_checked": self.shards_checked,
            "bytes_checked": self.bytes_checked,
            "seconds": round(self.seconds, 3),
            "problems": [p.to_json() for p in self.problems],
            "samples_affected": self.samples_affected,
            "status": self.status,
            "staging_area": self.area.to_json() if self.area is not None else None,
            "parity_checked": self.parity_checked,
            "rebuildable": list(self.rebuildable),
            "parity_groups_over_parity": list(self.over_parity),
        }
