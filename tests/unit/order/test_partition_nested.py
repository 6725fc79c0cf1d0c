"""partition=node's nested deal: node shares within one shard of each other, and a change of
the number of nodes moves only the last node's share (bytes bounded), deterministically."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.order.partition import owners


def _distributions() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, samples per shard, bytes per shard): equal shards with a short last one, a
    size-capped pack of a long-tailed corpus, a mix of small and huge shards."""
    rng = np.random.default_rng(5)
    equal = np.full(300, 100, dtype=np.int64)
    equal[-1] = 13
    per = rng.lognormal(np.log(200e3), 1.0, 400).clip(1e3, 3e7)
    capped = np.maximum(1, (2**28 / per)).astype(np.int64)
    mixed = np.concatenate([np.full(150, 2000), np.full(40, 40), rng.integers(1, 500, 60)])
    out = []
    for name, given in (("equal", equal), ("capped", capped), ("mixed", mixed)):
        samples = np.asarray(given, dtype=np.int64)
        nbytes = (samples * rng.lognormal(np.log(1e5), 0.2, len(samples))).astype(np.int64)
        out.append((name, samples, nbytes))
    return out


@pytest.mark.parametrize(("name", "samples", "nbytes"), _distributions())
def test_shares_balanced_and_moves_minimal(name, samples, nbytes) -> None:
    total_samples, total_bytes = int(samples.sum()), int(nbytes.sum())
    prev = owners(samples, num_nodes=1, seed=3)
    assert (prev == 0).all()
    for n in range(2, 17):
        now = owners(samples, num_nodes=n, seed=3)
        load = np.bincount(now, weights=samples, minlength=n)
        # balance: within the largest shard's samples, every node with samples
        assert load.max() - load.min() <= samples.max(), (name, n)
        assert (load > 0).all()
        moved = now != prev
        # growing n-1 -> n: only the new node takes shards; shrinking n -> n-1: only the
        # last node's shards move, each survivor keeps every shard it had
        assert (now[moved] == n - 1).all(), (name, n)
        assert np.array_equal(owners(samples, num_nodes=n - 1, seed=3), prev)
        # the bound in samples, and in bytes (bytes per sample within 2x across shards here)
        moved_samples = int(samples[moved].sum())
        assert moved_samples <= total_samples / n + samples.max(), (name, n)
        assert int(nbytes[moved].sum()) <= 2 * total_bytes / n + nbytes.max(), (name, n)
        prev = now


def test_eight_to_seven_and_back_moves_an_eighth_of_the_bytes() -> None:
    """The benchmark's case (ImageNet-like: 1,282 shards of 1,000, the last short)."""
    rng = np.random.default_rng(1)
    samples = np.full(1282, 1000, dtype=np.int64)
    samples[-1] = 167
    nbytes = np.array([rng.lognormal(np.log(110e3), 0.5, n).sum() for n in samples])
    n8, n7 = owners(samples, num_nodes=8, seed=1), owners(samples, num_nodes=7, seed=1)
    moved = nbytes[n8 != n7].sum() / nbytes.sum()
    assert 0.11 <= moved <= 1 / 8 + nbytes.max() / nbytes.sum(), moved
    assert (n7[n8 != 7] == n8[n8 != 7]).all()  # every survivor keeps its shards


def test_deterministic_across_processes_and_seeded() -> None:
    samples = np.random.default_rng(0).integers(1, 1000, 500)
    here = owners(samples, num_nodes=6, seed=9)
    code = (
        "import numpy as np; from shardio.order.partition import owners; "
        "s = np.random.default_rng(0).integers(1, 1000, 500); "
        "print(owners(s, num_nodes=6, seed=9).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == str(here.tolist())
    assert not np.array_equal(owners(samples, num_nodes=6, seed=10), here)
    here[0] = 99  # a caller's copy: the cached deal is not changed through it
    assert owners(samples, num_nodes=6, seed=9)[0] != 99


def test_more_nodes_than_shards_is_one_line() -> None:
    with pytest.raises(UsageError, match=r"^a node-partitioned order needs at least one shard "
                       r"per node: 5 nodes, 4 shards with samples[^\n]*$"):  # fmt: skip
        owners([10, 0, 5, 7, 1], num_nodes=5, seed=0)
    # as many nodes as shards with samples: one each; the empty shard stays with node 0
    got = owners([10, 0, 5, 7, 1], num_nodes=4, seed=0)
    assert sorted(got[[0, 2, 3, 4]].tolist()) == [0, 1, 2, 3] and got[1] == 0
