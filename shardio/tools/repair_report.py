"""What ``verify --repair`` did: what it fixed, what it could not, and the hook that rebuilds.

:func:`shardio.tools.repair.repair_dataset` returns a :class:`RepairReport`; ``--json``
prints its :meth:`~RepairReport.to_json`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardio.tools.verify_report import VerifyReport

__all__ = ["PARITY_SOURCE", "Rebuild", "RepairReport", "Repaired", "Unrepaired"]

PARITY_SOURCE = "parity"  # RepairReport.source of a repair from the dataset's own parity

Rebuild = Callable[[int], bool]
"""``rebuild(shard) -> bool``: make shard ``shard`` good again in place from a repair source
of its own (parity): the dataset's own shard, or, for a staging area, its source's. Return
whether it did; the result is verified before it is trusted."""


@dataclass(frozen=True)
class Repaired:
    """One thing fixed.

    Attributes:
        path: the shard's (or index's) path in the manifest.
        state: what verify found ("missing", "damaged", "stale").
        how: what was done, one line.
    """

    path: str
    state: str
    how: str


@dataclass(frozen=True)
class Unrepaired:
    """One thing that could not be fixed.

    Attributes:
        path: the shard's (or index's) path in the manifest.
        why: one line.
        damage: bytes are lost for training until it is restored (a dataset's own shard or
            index, or a staged copy whose source is bad too); False for a staged copy whose
            source is intact (training reads that).
    """

    path: str
    why: str
    damage: bool


@dataclass(frozen=True)
class RepairReport:
    """What ``verify --repair`` found, fixed and could not fix.

    Attributes:
        root: the dataset or staging area repaired.
        source: where good copies came from.
        staging_area: ``root`` is a staging area.
        found: the verify run before repairing (after the index was repaired, if it was).
        after: the shards touched (and the index), verified again; None if none were.
        repaired: what was fixed.
        unrepaired: what could not be fixed, with why.
        seconds: the whole run.
    """

    root: str
    source: str
    staging_area: bool
    found: VerifyReport
    after: VerifyReport | None
    repaired: tuple[Repaired, ...]
    unrepaired: tuple[Unrepaired, ...]
    seconds: float

    @property
    def status(self) -> str:
        """ "intact" (nothing to repair), "repaired" (everything found was fixed),
        "degraded" (staged copies left that the source stands in for) or "damaged"."""
        after_damaged = self.after is not None and self.after.damaged
        if any(u.damage for u in self.unrepaired) or after_damaged:
            return "damaged"
        if self.unrepaired or (self.after is not None and not self.after.ok):
            return "degraded"
        return "repaired" if self.repaired else "intact"

    def to_json(self) -> dict[str, Any]:
        """``shardio verify --repair --json``: the verify report of what was found, with
        ``status`` the state after the repair (``found_status`` before it)."""
        return {
            **self.found.to_json(),
            "status": self.status,
            "found_status": self.found.status,
            "repair_source": self.source,
            "repaired": [{"shard": r.path, "state": r.state, "how": r.how} for r in self.repaired],
            "unrepaired": [
                {"shard": u.path, "why": u.why, "damage": u.damage} for u in self.unrepaired
            ],
        }
