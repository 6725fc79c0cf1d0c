"""The default orders reshuffle every epoch: shard order and sample order of epoch e+1 differ
from epoch e's, and each is a pure function of (seed, epoch), the same in a fresh process.

(An unseeded webdataset pipeline replays one shard order every epoch; a reader that does so
trains on the same batch sequence again and again.)"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shardio.order import EpochCursor, OrderSpec, RankInfo
from shardio.order.spec import MODE_ORDERS, resolve_spec

SIZES = np.array([20] * 99 + [7], dtype=np.int64)  # 100 shards, the last one short
SHARD_OF = np.repeat(np.arange(len(SIZES)), SIZES)
EPOCHS = 6


def _shard_order(samples: np.ndarray) -> tuple[int, ...]:
    """The shards in the order the epoch first reads from them."""
    shards = SHARD_OF[samples]
    _, first = np.unique(shards, return_index=True)
    return tuple(shards[np.sort(first)].tolist())


def _when_read(samples: np.ndarray) -> np.ndarray:
    """Each shard's mean delivery position: when in the epoch (or the rank's share) it is
    read; NaN for a shard it does not read."""
    shards = SHARD_OF[samples]
    n = len(SIZES)
    with np.errstate(invalid="ignore"):
        return np.bincount(shards, weights=np.arange(len(samples)), minlength=n) / np.bincount(
            shards, minlength=n
        )


def _shard_order_kept(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation of when each shard is read in two epochs: about 0 (+-0.15 for 50
    shards) when the shards are reshuffled, near 1 when the same shards come in the same part
    of both epochs (a fixed shard order under reshuffled windows, which first appearances
    alone miss)."""
    wa, wb = _when_read(a), _when_read(b)
    both = ~np.isnan(wa) & ~np.isnan(wb)
    ra, rb = np.argsort(np.argsort(wa[both])), np.argsort(np.argsort(wb[both]))
    return float(np.corrcoef(ra, rb)[0, 1])


def _epochs(spec: OrderSpec, ranks: RankInfo | None = None) -> list[np.ndarray]:
    cursor = EpochCursor(spec, SIZES, ranks=ranks or RankInfo())
    out = []
    for epoch in range(EPOCHS):
        cursor.set_epoch(epoch)
        out.append(cursor.stream().materialise())
    return out


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_the_default_order_of_each_mode_reshuffles_shards_and_samples_every_epoch(
    mode: str,
) -> None:
    spec = resolve_spec(mode, None)  # what ShardDataset(path, mode=mode) reads with
    assert spec.order == MODE_ORDERS[mode] and spec.seed == 0
    epochs = _epochs(spec)
    for samples in epochs:
        assert np.array_equal(np.sort(samples), np.arange(int(SIZES.sum())))  # each once
    for e in range(EPOCHS - 1):
        assert not np.array_equal(epochs[e], epochs[e + 1]), f"epoch {e + 1} replays {e}"
        assert _shard_order(epochs[e]) != _shard_order(epochs[e + 1]), f"epoch {e}"
        assert abs(_shard_order_kept(epochs[e], epochs[e + 1])) < 0.6, f"epoch {e}"
    # Not only the neighbours: no two of the epochs share a shard order.
    assert len({_shard_order(s) for s in epochs}) == EPOCHS


@pytest.mark.parametrize(
    "text",
    ["shard-local", "order=random,partition=node", "order=shard-local,partition=rotating"],
)
def test_every_rank_and_every_node_reshuffles_too(text: str) -> None:
    spec = OrderSpec.parse(text)
    for rank in (0, 3):
        epochs = _epochs(spec, RankInfo(rank=rank, world_size=4, ranks_per_node=2))
        for e in range(EPOCHS - 1):
            assert not np.array_equal(epochs[e], epochs[e + 1])
            assert _shard_order(epochs[e]) != _shard_order(epochs[e + 1])
            assert abs(_shard_order_kept(epochs[e], epochs[e + 1])) < 0.6


def _digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def test_each_epoch_is_a_pure_function_of_seed_and_epoch() -> None:
    """The same (seed, epoch) gives the same order in another cursor, in any order of
    epochs, and in a fresh process; another seed gives another order."""
    spec = resolve_spec("stream", None, seed=5)
    here = _epochs(spec)
    cursor = EpochCursor(spec, SIZES, ranks=RankInfo())
    for epoch in reversed(range(EPOCHS)):  # straight to an epoch: no state carried
        cursor.set_epoch(epoch)
        assert np.array_equal(cursor.stream().materialise(), here[epoch])
    other_seed = _epochs(resolve_spec("stream", None, seed=6))
    assert all(not np.array_equal(a, b) for a, b in zip(here, other_seed, strict=True))
    code = textwrap.dedent(
        f"""
        import hashlib, numpy as np
        from shardio.order import EpochCursor, RankInfo
        from shardio.order.spec import resolve_spec
        np.random.seed(1234)  # the global RNG has no say
        cursor = EpochCursor(resolve_spec("stream", None, seed=5), {SIZES.tolist()},
                             ranks=RankInfo())
        h = hashlib.sha256()
        for epoch in range({EPOCHS}):
            cursor.set_epoch(epoch)
            h.update(np.ascontiguousarray(cursor.stream().materialise(), np.int64).tobytes())
        print(h.hexdigest())
        """
    )
    fresh = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert fresh.stdout.strip() == _digest(here)
