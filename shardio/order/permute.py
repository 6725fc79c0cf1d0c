"""Permutations evaluated position by position: a keyed Feistel network with cycle walking.

``permute(positions, n, key)`` returns where a pseudo-random permutation of ``range(n)`` sends
each position, without building the permutation: O(1) memory per position, whatever ``n``
(a billion-sample epoch costs nothing until positions are asked for). It is a true
permutation (a Feistel network on ``2**b >= n`` values is a bijection; values that land at or
above ``n`` are sent through again until they fall inside, which keeps it a bijection of
``range(n)``), deterministic for a key, and vectorised over numpy arrays. ``n`` and ``key``
may be arrays too (one permutation per element: the windows of the shard-local order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["mix64", "permute"]

_ROUNDS = 4
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MAX_WALKS = 64  # a value leaves [n, 2**b) with probability >= 1/4 per walk


def mix64(values: Any) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    z = np.asarray(values, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def key_of(*words: int) -> int:
    """One 64-bit key from integers (seed, epoch, salt, ...): mixed in turn."""
    acc = np.zeros(1, dtype=np.uint64)
    for word in words:
        acc = mix64(acc ^ np.uint64(word & 0xFFFFFFFFFFFFFFFF))
    return int(acc[0])


def _half_bits(n: Any) -> Any:
    """Bits of each half of the Feistel domain: 2**(2*h) >= n, h >= 1."""
    bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(np.int64)
    # log2 of a float can be off by one for huge n: correct it exactly.
    bits += (np.left_shift(np.int64(1), bits) < n).astype(np.int64)
    return np.maximum(1, (bits + 1) // 2)


def _feistel(x: Any, half: Any, keys: list[Any]) -> Any:
    mask = (np.uint64(1) << half.astype(np.uint64)) - np.uint64(1)
    shift = half.astype(np.uint64)
    left = x >> shift
    right = x & mask
    for i in range(_ROUNDS):
        with np.errstate(over="ignore"):
            f = mix64(right ^ keys[i]) & mask
        left, right = right, left ^ f
    return (left << shift) | right


def permute(positions: Any, n: Any, key: Any) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Where the keyed permutation of ``range(n)`` sends each of ``positions``.

    Args:
        positions: int64 array, each in ``[0, n)``.
        n: the domain size (> 0): an int, or an array like ``positions``.
        key: the permutation's key: an int, or a uint64 array like ``positions``.

    Returns:
        An int64 array of the same shape.
    """
    pos = np.asarray(positions, dtype=np.int64)
    sizes = np.broadcast_to(np.asarray(n, dtype=np.int64), pos.shape)
    base = np.broadcast_to(np.asarray(key, dtype=np.uint64), pos.shape)
    half = _half_bits(sizes)
    keys = [mix64(base ^ np.uint64(0xA5A5A5A5 * (i + 1))) for i in range(_ROUNDS)]
    out = _feistel(pos.astype(np.uint64), half, keys)
    outside = np.flatnonzero(out >= sizes.astype(np.uint64))
    for _ in range(_MAX_WALKS):
        if len(outside) == 0:
            break
        sub_keys = [k[outside] for k in keys]
        out[outside] = _feistel(out[outside], half[outside], sub_keys)
        outside = outside[out[outside] >= sizes[outside].astype(np.uint64)]
    else:  # pragma: no cover - each walk leaves with probability >= 1/4
        raise RuntimeError("permute: cycle walking did not end")
    result: np.ndarray[Any, np.dtype[np.int64]] = out.astype(np.int64)
    return result
