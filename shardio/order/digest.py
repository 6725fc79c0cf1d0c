"""An order-independent digest of a multiset of sample identities (the exactly-once audit).

Each identity (an int64: a dataset's global sample index, or ``source << 48 | index`` in a
mix) is mixed with a 64-bit salt drawn from the dataset id (so another dataset's samples
never match) through splitmix64's finaliser, a bijection of 64-bit words; the digest keeps
the count, the sum mod 2^64 and the xor of the mixed words. Adding or removing a sample
changes the count; swapping one for another changes the sum and the xor but for a chance of
2^-64; a sample delivered twice in place of another changes the sum. Digests add up across
ranks and batches in any order (:meth:`Digest.__add__`); a planned repeat or cut is added or
taken out (:meth:`Digest.__sub__`). Vectorised with numpy: a few ns a sample
(``benchmarks/audit_digest.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardio.order.permute import mix64

__all__ = ["MIX_SHIFT", "Digest", "dataset_salt", "mix_ids"]

MIX_SHIFT = 48  # a mix's identity: source << MIX_SHIFT | index (a source holds < 2^48)
_MASK = (1 << 64) - 1


def dataset_salt(dataset_id: str | None) -> int:
    """The 64-bit salt of a dataset id (None, a dataset without an id: a fixed salt)."""
    raw = hashlib.blake2b((dataset_id or "").encode(), digest_size=8, person=b"shardio-aud")
    return int.from_bytes(raw.digest(), "little")


def mix_ids(ids: Any, salt: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """The mixed 64-bit words of ``ids`` (int64 identities) under ``salt``: the orders'
    splitmix64 finaliser (:func:`shardio.order.permute.mix64`) of each id xor the salt."""
    words = np.asarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(salt)
    return mix64(words)


@dataclass(frozen=True)
class Digest:
    """A multiset of identities: its size, and the sum (mod 2^64) and xor of its mixed words.

    Attributes:
        count: identities folded in (taken out counts negative).
        total: sum of the mixed words, mod 2^64.
        xor: xor of the mixed words.
    """

    count: int = 0
    total: int = 0
    xor: int = 0

    @classmethod
    def of(cls, ids: Any, salt: int) -> Digest:
        """The digest of ``ids`` (int64 identities; any order)."""
        mixed = mix_ids(ids, salt)
        if not len(mixed):
            return cls()
        total = int(np.add.reduce(mixed, dtype=np.uint64))
        return cls(len(mixed), total, int(np.bitwise_xor.reduce(mixed)))

    def __add__(self, other: Digest) -> Digest:
        return Digest(
            self.count + other.count, (self.total + other.total) & _MASK, self.xor ^ other.xor
        )

    def __sub__(self, other: Digest) -> Digest:
        return Digest(
            self.count - other.count, (self.total - other.total) & _MASK, self.xor ^ other.xor
        )

    def to_list(self) -> list[int]:
        """``[count, total, xor]`` (plain ints, JSON-ready)."""
        return [self.count, self.total, self.xor]

    @classmethod
    def from_list(cls, values: Any) -> Digest:
        """The digest of :meth:`to_list`'s values (checked by the caller)."""
        count, total, xor = (int(v) for v in values)
        return cls(count, total & _MASK, xor & _MASK)
