"""partition=node's rendezvous deal over the nodes' names: shares within one shard's samples
of each other, and losing any node (first, middle, last), renumbering the survivors, or
adding one moves about its own share, deterministically."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.order import EpochCursor, OrderSpec, RankInfo
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


def _hosts(n: int) -> tuple[str, ...]:
    return tuple(f"gpu{i:03d}" for i in range(n))


def _by_name(samples, keys, seed=3) -> np.ndarray:
    """Each shard's owner as a host name."""
    return np.asarray(keys)[owners(samples, num_nodes=len(keys), seed=seed, keys=keys)]


@pytest.mark.parametrize(("name", "samples", "nbytes"), _distributions())
def test_shares_differ_by_at_most_the_largest_shard(name, samples, nbytes) -> None:
    for n in [1, 2, 3, 5, 8, 13, 16, 64]:
        for keys in (None, _hosts(n)):
            load = np.bincount(
                owners(samples, num_nodes=n, seed=3, keys=keys), weights=samples, minlength=n
            )
            assert load.max() - load.min() <= samples.max(), (name, n)
            assert (load > 0).all()


@pytest.mark.parametrize(("name", "samples", "nbytes"), _distributions())
@pytest.mark.parametrize("lost", [0, 3, 7])
def test_losing_any_node_moves_about_its_share(name, samples, nbytes, lost) -> None:
    keys = _hosts(8)
    before = _by_name(samples, keys)
    survivors = keys[:lost] + keys[lost + 1 :]
    after = _by_name(samples, survivors)
    moved = before != after
    assert (after[before == keys[lost]] != keys[lost]).all()
    share = nbytes[before == keys[lost]].sum()
    # the lost share, plus a cascade: about 30 shards a node here (measured up to 70% of
    # the share for "mixed"; 0-15% for the benchmark's thousands of shards); a re-deal
    # moves most of the dataset
    assert share <= nbytes[moved].sum() <= 2 * share + nbytes.max(), (name, lost)
    # the survivors' numbering does not matter: the shares follow the names
    assert np.array_equal(_by_name(samples, survivors[::-1]), after)
    # a new host (7 -> 8 with a new name) takes about 1/8, from every node
    grown = (*survivors, "gpu999")
    regrown = _by_name(samples, grown)
    took = regrown != after
    assert (regrown[took] == "gpu999").mean() > 0.6
    assert nbytes[took].sum() <= 2 * nbytes.sum() / 8 + nbytes.max()


def test_numbered_nodes_are_named_by_their_numbers() -> None:
    samples = np.random.default_rng(0).integers(1, 1000, 400)
    for n in (4, 7):
        names = tuple(str(i) for i in range(n))
        assert np.array_equal(
            owners(samples, num_nodes=n, seed=9), owners(samples, num_nodes=n, seed=9, keys=names)
        )


def test_deterministic_across_processes_and_seeded() -> None:
    samples = np.random.default_rng(0).integers(1, 1000, 500)
    keys = ("b", "a", "node07", "c")
    here = owners(samples, num_nodes=4, seed=9, keys=keys)
    code = (
        "import numpy as np; from shardio.order.partition import owners; "
        "s = np.random.default_rng(0).integers(1, 1000, 500); "
        "print(owners(s, num_nodes=4, seed=9, keys=('b', 'a', 'node07', 'c')).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == str(here.tolist())
    assert not np.array_equal(owners(samples, num_nodes=4, seed=10, keys=keys), here)
    here[0] = 99  # a caller's copy: the cached deal is not changed through it
    assert owners(samples, num_nodes=4, seed=9, keys=keys)[0] != 99


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        (("a", "a", "b"), "node key 'a' is given twice"),
        (("a", "b"), "2 node keys for 3 nodes"),
        (("a", "", "b"), "is not a name of 1 to 255"),
        ("abc", "not one string"),
    ],
)
def test_bad_keys_are_one_line(keys, needle) -> None:
    with pytest.raises(UsageError, match=needle):
        owners([5] * 10, num_nodes=3, seed=0, keys=keys)


def test_more_nodes_than_shards_is_one_line() -> None:
    with pytest.raises(UsageError, match=r"^a node-partitioned order needs at least one shard "
                       r"per node: 5 nodes, 4 shards with samples[^\n]*$"):  # fmt: skip
        owners([10, 0, 5, 7, 1], num_nodes=5, seed=0)
    # as many nodes as shards with samples: one each, whatever their sizes
    for seed in range(20):
        got = owners([10, 0, 5, 7, 1], num_nodes=4, seed=seed, keys=("w", "x", "y", "z"))
        assert sorted(got[[0, 2, 3, 4]].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("after", [("h1", "h2", "h3"), ("h3", "h1", "new", "h2")])
def test_a_resume_on_other_hosts_is_exact(after) -> None:
    """4 named nodes of 2 ranks each read part of an epoch; the job resumes on the same
    hosts less the first (renumbered), or with a new host in its place: every sample is
    read, the only repeats are the padding of the new layout."""
    spec = OrderSpec(order="random", seed=4, partition="node")
    sizes = np.random.default_rng(1).integers(5, 40, 120)
    before = ("h0", "h1", "h2", "h3")

    def cursor(rank, keys):
        layout = RankInfo(rank=rank, world_size=2 * len(keys), ranks_per_node=2, node_keys=keys)
        return EpochCursor(spec, sizes, ranks=layout)

    steps = 30
    read = [cursor(r, before).stream().take(0, steps) for r in range(8)]
    saver = cursor(0, before)
    saver.advance(steps * 8)
    state = saver.state()
    assert state["node_keys"] == list(before)
    rest = []
    for rank in range(2 * len(after)):
        resumed = cursor(rank, after)
        resumed.load(state)
        rest.append(resumed.stream().materialise())
    got = np.concatenate(read + rest)
    counts = np.bincount(got, minlength=int(sizes.sum()))
    assert (counts >= 1).all()
    padding = len(got) - int(sizes.sum())
    assert int((counts - 1).sum()) == padding < 2 * len(after) * sizes.max()
    again = cursor(0, after)
    again.load(state)
    assert again.state()["history"] == [[8, 2, steps * 8, list(before)]]
