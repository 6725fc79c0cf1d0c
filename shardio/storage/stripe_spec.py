"""Stripe settings: the ``--stripe`` text, an explicit StripeSpec and the planned layout.

Sizes are binary, as Lustre's and BeeGFS's own suffixes are; :func:`lfs_size` and
:func:`beegfs_size` write them back the way each tool takes them. Applying a layout to a
directory is :mod:`shardio.storage.striping`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from shardio.errors import UsageError

__all__ = [
    "DEFAULT_PFL",
    "StripeSpec",
    "beegfs_size",
    "lfs_size",
    "parse_stripe",
    "plan_stripe",
]

KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB

STRIPE_UNIT_BYTES: Final = 64 * KiB
"""Lustre stripe sizes must be a positive multiple of 64 KiB."""

STRIPE_KEYWORDS: Final = frozenset({"auto", "none", "pfl"})
"""The stripe settings that are not an explicit ``COUNTxSIZE``."""

_PIECE_BYTES: Final = 256 * MiB  # one stripe per 256 MiB of shard
_MAX_PLANNED_COUNT: Final = 8  # the article's `lfs setstripe -c 8 -S 4M` for large data
_SMALL_SHARD_BYTES: Final = 64 * MiB
_LARGE_STRIPE_BYTES: Final = 4 * MiB
SMALL_STRIPE_BYTES: Final = 1 * MiB


# Lustre's and BeeGFS's own size suffixes are binary: 4M means 4 MiB.
_STRIPE_SIZE_UNITS: Final = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "m": MiB,
    "mib": MiB,
    "g": GiB,
    "gib": GiB,
}
_STRIPE_RE: Final = re.compile(r"^(-1|[0-9]+)\s*[xX]\s*([0-9]+)\s*([A-Za-z]*)$")
_STRIPE_HINT: Final = "use auto, none, pfl or COUNTxSIZE such as 8x4MiB, 4x1M or -1x4MiB"


def _format_binary(size_bytes: int, suffixes: Sequence[tuple[int, str]]) -> str:
    for unit, suffix in suffixes:
        if size_bytes % unit == 0:
            return f"{size_bytes // unit}{suffix}"
    return str(size_bytes)


def _size_text(size_bytes: int) -> str:
    """``4MiB``, ``192KiB``, ``1GiB``: how a stripe size is shown to people."""
    return _format_binary(size_bytes, ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")))


def lfs_size(size_bytes: int) -> str:
    """``4M``, ``192K``, ``1G``: the suffixes ``lfs setstripe -S`` takes."""
    return _format_binary(size_bytes, ((GiB, "G"), (MiB, "M"), (KiB, "K")))


def beegfs_size(size_bytes: int) -> str:
    """``4m``, ``512k``: the suffixes ``beegfs-ctl --chunksize`` takes (no ``g``)."""
    return _format_binary(size_bytes, ((MiB, "m"), (KiB, "k")))


@dataclass(frozen=True, kw_only=True)
class StripeSpec:
    """An explicit stripe layout: how many OSTs (targets) and how much per stripe.

    Attributes:
        count: the number of OSTs a file is striped over, or -1 for all of them (Lustre).
        size_bytes: the stripe (chunk) size, a multiple of 64 KiB.
        progressive: a Lustre Progressive File Layout whose last component (from 1 GiB to end
            of file) uses ``count`` and ``size_bytes``; smaller components come first.
    """

    count: int
    size_bytes: int
    progressive: bool = False

    def __post_init__(self) -> None:
        if self.count != -1 and self.count < 1:
            raise UsageError(f"stripe count must be >= 1 or -1 (all OSTs), got {self.count}")
        if self.size_bytes < STRIPE_UNIT_BYTES or self.size_bytes % STRIPE_UNIT_BYTES:
            raise UsageError(
                f"stripe size must be a multiple of 64KiB and at least 64KiB, "
                f"got {self.size_bytes} bytes"
            )

    def to_text(self) -> str:
        """Return the layout as ``4x4MiB``, or ``pfl`` for a progressive layout.

        The text of a plain layout parses back with :func:`parse_stripe`; the exact
        components of a progressive one are in the commands of
        :class:`~shardio.storage.striping.LayoutResult`.
        """
        if self.progressive:
            return "pfl"
        return f"{self.count}x{_size_text(self.size_bytes)}"


DEFAULT_PFL: Final = StripeSpec(count=8, size_bytes=4 * MiB, progressive=True)


def parse_stripe(text: str) -> str | StripeSpec:
    """Parse a ``--stripe`` setting.

    Sizes take Lustre's binary suffixes: ``4M``, ``4MiB`` and ``4m`` all mean 4 MiB.

    Args:
        text: ``auto`` (plan from the shard size), ``none`` (leave the layout alone), ``pfl``
            (Lustre progressive layout) or ``COUNTxSIZE`` such as ``8x4MiB``, ``4x1M`` or
            ``-1x4MiB`` (all OSTs); case-insensitive.

    Returns:
        The keyword in lower case, or a :class:`StripeSpec`.

    Raises:
        UsageError: the text is none of these, in one line naming it.
    """
    cleaned = text.strip().lower()
    if cleaned in STRIPE_KEYWORDS:
        return cleaned
    match = _STRIPE_RE.match(cleaned)
    if match is None or match.group(3) not in _STRIPE_SIZE_UNITS:
        raise UsageError(f"invalid stripe {text!r}: {_STRIPE_HINT}")
    count = int(match.group(1))
    size_bytes = int(match.group(2)) * _STRIPE_SIZE_UNITS[match.group(3)]
    try:
        return StripeSpec(count=count, size_bytes=size_bytes)
    except UsageError as exc:
        raise UsageError(f"invalid stripe {text!r}: {exc}") from exc


def plan_stripe(shard_size_bytes: int, ost_count: int | None) -> StripeSpec:
    """Plan the stripe layout for shards of a given size.

    Shards are read whole and sequentially, each by one worker, while many ranks on many
    nodes read different shards at the same time. The parallelism across OSTs therefore comes
    mostly from having many shards spread over them, not from striping each shard wide: wide
    striping makes every read touch every OST and adds per-stripe locks and RPCs. So striping
    is moderate: one stripe per 256 MiB of shard, which lets a single large shard (when staged
    or read by a lone rank) stream from a few OSTs at once, capped at 8, the article's
    ``lfs setstripe -c 8 -S 4M`` for large data, and at the number of OSTs when known.

    The stripe size is 4 MiB, Lustre's largest bulk RPC, so each read request fills one
    stripe; shards under 64 MiB use 1 MiB (Lustre's default) so a small file is not split
    into a handful of oversized stripes.

    Args:
        shard_size_bytes: the target size of one shard.
        ost_count: the number of OSTs, or ``None`` when unknown.

    Returns:
        A plain (not progressive) layout.

    Raises:
        UsageError: ``shard_size_bytes`` or ``ost_count`` is not positive.
    """
    if shard_size_bytes <= 0:
        raise UsageError(f"shard size must be positive, got {shard_size_bytes} bytes")
    if ost_count is not None and ost_count < 1:
        raise UsageError(f"OST count must be positive, got {ost_count}")
    size_bytes = (
        SMALL_STRIPE_BYTES if shard_size_bytes < _SMALL_SHARD_BYTES else _LARGE_STRIPE_BYTES
    )
    count = min(max(1, math.ceil(shard_size_bytes / _PIECE_BYTES)), _MAX_PLANNED_COUNT)
    if ost_count is not None:
        count = min(count, ost_count)
    return StripeSpec(count=count, size_bytes=size_bytes)
