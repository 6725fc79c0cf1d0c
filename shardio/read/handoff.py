"""What a ShardReader hands on: a Handoff to the workers it starts, recovery events to its
caller.

A worker started by spawn or forkserver takes its parent's checked manifest and staging
decisions from a :class:`Handoff` instead of reading and making them again; a recovery event
(a dropped or re-staged copy) is a plain dict, handed to ``on_event`` or logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardio.format.manifest import Manifest

__all__ = ["Event", "Handoff", "emit_event"]

logger = logging.getLogger(__name__)

Event = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Handoff:
    """What a process hands the ShardReader of a worker it starts by pickling (spawn,
    forkserver), so that the worker does not read the manifest again.

    Attributes:
        manifest: the manifest, read and checked by the parent (the worker still maps the
            index and checks it against this manifest).
        staged: the shards the parent's resolver found staged (:meth:`ShardResolver.decide`).
        dataset_id: the id of the parent's manifest bytes (the parent checked the cache
            against it; the worker re-stages only into an area holding that dataset).
    """

    manifest: Manifest
    staged: frozenset[int]
    dataset_id: str | None = None


def emit_event(event: Event, on_event: Callable[[Event], None] | None) -> None:
    """Hand a recovery event to ``on_event``; without one, log it (once, as a warning)."""
    if on_event is not None:
        on_event(event)
    elif event["event"] == "drop":
        logger.warning(
            "staged copy %s is bad (%s): reading %s",
            event["shard"],
            event["why"],
            event.get("source", "the source"),
        )
    else:
        logger.warning("staged copy %s: %s", event["shard"], event)
