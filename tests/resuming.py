"""Save, restore and compare for the resume tests: what a job's checkpoint does to the data
position, and the one comparison every exact-resume test makes.

- :func:`take`: the first batches of a fresh iteration, which is then abandoned mid-epoch (its
  workers shut down), as a killed job's would be;
- :func:`saved`: a state through JSON, as it goes into a checkpoint;
- :func:`resumed`: a fresh loader (or dataset) made by the caller, with the state loaded;
- :func:`assert_resumed_exactly`: the head before the save and the tail after the restore
  are the uninterrupted epoch, with the first difference named when they are not.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def take(loader: Iterable[Any], batches: int, *, field: str = "__key__") -> list[Any]:
    """``field`` of every sample in the first ``batches`` batches of a new iteration of
    ``loader``; the iteration is then closed mid-epoch."""
    it = iter(loader)
    try:
        return [value for batch in itertools.islice(it, batches) for value in batch[field]]
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a checkpoint gives it back: through JSON (it must survive that)."""
    out: dict[str, Any] = json.loads(json.dumps(state))
    return out


def resumed(make: Callable[[], T], state: dict[str, Any]) -> T:
    """``make()`` (a fresh loader or dataset, in effect a new process) with ``state`` loaded."""
    fresh = make()
    fresh.load_state_dict(state)  # type: ignore[attr-defined]
    return fresh


def assert_resumed_exactly(head: Sequence[Any], tail: Sequence[Any], whole: Sequence[Any]) -> None:
    """``head + tail == whole``; otherwise say where they part, and what repeats or is lost."""
    got = list(head) + list(tail)
    if got == list(whole):
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(got, whole, strict=False)) if a != b),
        min(len(got), len(whole)),
    )
    counts, want = collections.Counter(got), collections.Counter(whole)
    repeated = sorted((counts - want).elements())[:5]
    lost = sorted((want - counts).elements())[:5]
    raise AssertionError(
        f"resume is not exact: {len(head)} before the save + {len(tail)} after the restore "
        f"= {len(got)} samples, the epoch has {len(whole)}; first difference at position "
        f"{first} ({len(head)} were delivered before the save); delivered twice: {repeated}; "
        f"never delivered: {lost}"
    )
