"""The plan of an epoch for the exactly-once audit: what the ranks must deliver, as digests.

A pure function of the order spec, the seed, the epoch and the rank layout (with the
layouts an elastic resume went through): every sample of the epoch once, plus the planned
repeats that give every rank the same count (padding, drawn from the start of the order),
minus what ``drop_last`` cuts (the order's, and the loader's last incomplete batch of each
rank). It is computed chunk by chunk (``_CHUNK`` positions at a time: a billion-sample epoch
is never held), independently of what the ranks fold, so a bug in the rank streams, a
resume or a rank layout shows as a difference. The span's prefix (what was delivered before
the position the span started from: a resume) is given apart, so that a resumed epoch is
audited as prefix + what is delivered after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardio.order.digest import Digest
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec
from shardio.order.streams import RankStream, rank_stream, remaining_samples

__all__ = ["Identify", "SpanPlan", "plan_span"]

_CHUNK = 1 << 20  # positions mixed at once: 8 MB of int64 at most, whatever the epoch
Identify = Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]  # values -> identities


@dataclass(frozen=True, kw_only=True)
class SpanPlan:
    """An epoch as planned, from a span's start.

    Attributes:
        expected: the epoch's planned multiset: every value once, padding in, cuts out.
        prefix: what was delivered before the span (its start's consumed positions).
        values: values of the epoch (its samples, or a mix's positions).
        padding: planned repeats delivered in the epoch (the prefix's included).
        cut: values ``drop_last`` leaves out (the order's and the loader's).
    """

    expected: Digest
    prefix: Digest
    values: int
    padding: int
    cut: int


class _Folder:
    """Folds values through the identity map, chunk by chunk."""

    def __init__(self, identify: Identify, salt: int) -> None:
        self.identify = identify
        self.salt = salt

    def values(self, order: Any, start: int, stop: int) -> Digest:
        """Positions ``start`` to ``stop`` of ``order``."""
        out = Digest()
        for lo in range(start, stop, _CHUNK):
            hi = min(stop, lo + _CHUNK)
            out += self.ids(order.take(np.arange(lo, hi, dtype=np.int64)))
        return out

    def ids(self, values: np.ndarray[Any, Any]) -> Digest:
        return Digest.of(self.identify(values), self.salt)

    def steps(self, stream: RankStream, start: int, stop: int) -> tuple[Digest, int]:
        """Steps ``start`` to ``stop`` of a rank (from the epoch's step 0): their digest and
        how many are padding (positions past the order's end, repeating its start)."""
        out, padding = Digest(), 0
        n = stream.order.size
        for lo in range(start, stop, _CHUNK):
            k = np.arange(lo, min(stop, lo + _CHUNK), dtype=np.int64)
            positions = stream.base + stream.index + k * stream.group
            beyond = positions >= n
            padding += int(beyond.sum())
            positions[beyond] = (positions[beyond] - n) % n
            out += self.ids(stream.order.take(positions))
        return out, padding


def _groups(
    sizes: np.ndarray[Any, Any],
    spec: OrderSpec,
    epoch: int,
    layout: RankInfo,
    *,
    consumed: int,
    history: Sequence[Sequence[Any]],
) -> list[tuple[RankStream, list[int]]]:
    """The group streams (the global order's, or each node's; its member 0's) with the
    first step of each member rank of the group."""
    world = layout.world_size
    group = world if not spec.partitioned else layout.node_size
    out = []
    for first_rank in range(0, world, group):
        head = rank_stream(
            sizes, spec, epoch, layout.with_rank(first_rank), consumed=consumed, history=history
        )
        firsts = [
            head.first if not spec.partitioned else _steps_done(consumed, world, first_rank + j)
            for j in range(group)
        ]
        out.append((head, [min(f, head.steps) for f in firsts]))
        if not spec.partitioned:
            break
    return out


def _steps_done(consumed: int, world: int, rank: int) -> int:
    """Steps rank ``rank`` took when ``consumed`` global positions were delivered."""
    return consumed // world + (1 if rank < consumed % world else 0)


def plan_span(
    sizes: Any,
    spec: OrderSpec,
    epoch: int,
    layout: RankInfo,
    *,
    consumed: int,
    history: Sequence[Sequence[Any]],
    batch_size: int,
    drop_last: bool,
    identify: Identify,
    salt: int,
) -> SpanPlan:
    """The plan of ``epoch`` under ``layout`` for a span that starts after ``consumed``
    global positions (and the earlier layouts ``history``, a partitioned order's).

    Args:
        sizes: values per shard (a mix: one "shard" of its positions).
        spec: the order.
        epoch: the epoch.
        layout: the rank layout of the span.
        consumed: the span's first global position (a resume's).
        history: the earlier layouts of the epoch (world size, ranks per node, consumed and
            the node names, as the cursor keeps them).
        batch_size: the loader's batch size (with ``drop_last``, its last incomplete batch
            of each rank is cut).
        drop_last: the loader's ``drop_last``.
        identify: the identity of each value (int64).
        salt: the dataset's salt (:func:`~shardio.order.digest.dataset_salt`).
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    values = int(sizes_arr.sum())
    fold = _Folder(identify, salt)
    whole = fold.values(_Identity(values), 0, values)
    prefix, extra, cut = Digest(), Digest(), Digest()
    padding = 0
    if spec.partitioned and history:
        left = remaining_samples(sizes_arr, spec, epoch, history)
        if left is not None:
            prefix += fold.values(_Identity(values, np.flatnonzero(~left)), 0, int((~left).sum()))
    for head, firsts in _groups(sizes_arr, spec, epoch, layout, consumed=consumed, history=history):
        n = head.order.size
        prefix += fold.values(head.order, 0, min(head.base, n))  # the global order's prefix
        reached = head.base + head.steps * head.group
        if reached < n:  # the order's drop_last
            cut += fold.values(head.order, reached, n)
        for j, first in enumerate(firsts):
            member = RankStream(
                head.order, index=j, group=head.group, first=0, steps=head.steps, base=head.base
            )
            rest = head.steps - first
            run = rest // batch_size * batch_size if drop_last else rest
            if first:
                prefix += fold.steps(member, 0, first)[0]
            padding += max(0, first + run - _first_padded(member))
            # Padding is what the plan repeats: its steps' values, over those the order has.
            extra += _padding_of(fold, member, first + run)
            if run < rest:  # the loader's drop_last: the rank's last incomplete batch
                cut += _unpadded(fold, member, first + run, head.steps)
    expected = whole + extra - cut
    return SpanPlan(expected=expected, prefix=prefix, values=values, padding=padding, cut=cut.count)


def _first_padded(member: RankStream) -> int:
    """The member's first step whose position is past the order's end."""
    beyond = int(member.order.size) - member.base - member.index
    return max(0, -(-beyond // member.group))


def _padding_of(fold: _Folder, member: RankStream, stop: int) -> Digest:
    """The padding among the member's steps before ``stop``."""
    start = _first_padded(member)
    return fold.steps(member, start, stop)[0] if start < stop else Digest()


def _unpadded(fold: _Folder, member: RankStream, start: int, stop: int) -> Digest:
    """The order's own values among the member's steps ``start`` to ``stop``."""
    stop = min(stop, _first_padded(member))
    return fold.steps(member, start, stop)[0] if start < stop else Digest()


class _Identity:
    """The values 0 to n - 1 (or the given ones) as an order to take from."""

    def __init__(self, n: int, samples: np.ndarray[Any, Any] | None = None) -> None:
        self.size = n if samples is None else len(samples)
        self.samples = samples

    def take(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return positions if self.samples is None else self.samples[positions]
