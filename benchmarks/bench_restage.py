"""Bytes a node partition moves when a job goes from 8 nodes to 7 and back, against a re-deal.

For each of three shard-size distributions (seeded, so a rerun prints the same figures), the
node shares of ``partition=node`` (:func:`shardio.order.partition.owners`, the nested deal)
are computed for 8 and 7 nodes, and so are those of the greedy deal earlier releases used
(shards largest first to the lightest node: a re-deal from scratch, written out here as the
baseline). Bytes moved: the bytes of the shards each node must stage that it did not hold
before (node i keeps its number; the node that leaves is the last). Also the spread of node
shares (samples), against the largest shard's samples (the documented bound), and the time
one deal takes. The section "Re-staging after a lost node" of RESULTS.md gets the table.

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


def _moved(before: np.ndarray[Any, Any], after: np.ndarray[Any, Any], nbytes: Any) -> int:
    """Bytes of the shards whose node changed (each must be staged where it now belongs)."""
    return int(nbytes[before != after].sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    rows, worst = [], 0.0
    middle: list[tuple[str, float, float, float]] = []
    for name, make in (
        ("ImageNet-1k, 1,000 a shard", _imagenet),
        ("long-tailed corpus, 1 GiB shards", _capped),
        ("images + video clips", _mixed),
    ):
        samples, nbytes = make()
        total = int(nbytes.sum())
        start = time.perf_counter()
        n8 = owners(samples, num_nodes=8, seed=SEED)
        deal_s = time.perf_counter() - start
        n7 = owners(samples, num_nodes=7, seed=SEED)
        r8, r7 = _redeal(samples, 8, SEED), _redeal(samples, 7, SEED)
        down, up = _moved(n8, n7, nbytes), _moved(n7, n8, nbytes)
        worst = max(worst, down / total, up / total)
        load = np.bincount(n8, weights=samples, minlength=8)
        if not middle:  # node 3 lost, the survivors renumbered as SLURM does (4 -> 3, ...)
            shifted, swapped = [0, 1, 2, 4, 5, 6, 7], [0, 1, 2, 7, 4, 5, 6]
            fetch = [
                sum(int(nbytes[(n7 == i) & (n8 != host[i])].sum()) for i in range(7)) / total
                for host in (shifted, swapped)
            ]
            middle.append((name, *fetch, int(nbytes[n8 == 3].sum()) / total))
        rows.append(
            [
                f"{name}: {len(samples):,} shards, {total / 1e12:.2f} TB",
                f"{down / total:.1%} ({down / 1e9:,.0f} GB)",
                f"{up / total:.1%}",
                f"{_moved(r8, r7, nbytes) / total:.1%}",
                f"{_moved(r7, r8, nbytes) / total:.1%}",
                f"{load.max() - load.min():,.0f} / {samples.max():,}",
                f"{deal_s * 1e3:,.0f} ms",
            ]
        )
        print(f"{name}: 8->7 {down / total:.3f}, 7->8 {up / total:.3f}", file=sys.stderr)
    body = "\n".join(
        [
            f"Run {datetime.date.today().isoformat()}: `python benchmarks/bench_restage.py` "
            "(computed, no I/O: the shares of `partition=node`, seed 1).",
            "",
            "Share of the dataset's bytes that must be staged again when a job goes from 8 "
            "nodes to 7 (the last node lost) and from 7 back to 8, with the nested deal "
            "`partition=node` uses now and with a re-deal from scratch (the greedy deal of "
            "earlier releases). Spread: the largest node share minus the smallest, in "
            "samples, against the largest shard's samples (the documented bound). "
            f"1/8 = {1 / 8:.1%}, 1/7 = {1 / 7:.1%}.",
            "",
            common.markdown_table(
                [
                    "dataset",
                    "8 -> 7 nested",
                    "7 -> 8 nested",
                    "8 -> 7 re-deal",
                    "7 -> 8 re-deal",
                    "spread / largest shard",
                    "one deal (8 nodes)",
                ],
                rows,
            ),
            "",
            f"The nested deal moves at most {worst:.1%} of the bytes (about 1/N: the last "
            "node's share going, or the new node's coming); a re-deal moves most of them. "
            "`shardio stage --peers` reads what moved from the other nodes' staging areas "
            "where they are reachable (tests/slurm/test_slurm_restage.py, on the SLURM test "
            "cluster).",
            "",
            f"The node that leaves must be the last one. {middle[0][0]}: when node 3 of 8 is "
            "lost and the survivors are renumbered in order (SLURM's node ids: 4 becomes 3, "
            f"...), {middle[0][1]:.1%} of the bytes are no longer where they are needed; "
            f"{middle[0][3]:.1%} (node 3's share) was only on the lost node. When the last "
            f"node takes number 3 and the others keep theirs, {middle[0][2]:.1%} move (see "
            'docs/guides/staging-slurm.md, "When a node is lost"); `--peers` fetches what '
            "moved from the survivors' areas instead of the source.",
        ]
    )
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
