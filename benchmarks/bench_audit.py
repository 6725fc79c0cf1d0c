"""The exactly-once epoch audit: what it costs a sample, a plan and an epoch.

Measures, in one process:

1. the digest alone (``Digest.of``, the numpy fold) per sample, folding the observer's
   chunks of 32,768 identities;
2. the observer's whole path per delivered sample (what ShardLoader calls per batch:
   ``sample_facts`` from the dataset's index, then ``EpochAudit.observe``), by batch size;
3. the plan of an epoch (``plan_span``: every sample once, padding and cuts, chunked) per
   sample of a 10-million-sample random order over 8 ranks, and the end of an epoch
   (``EpochAudit.end_epoch``: its share re-derived, the plan, the verdict) of one rank;
4. one loader epoch of a small dataset (4 KiB samples, no workers, warm page cache) with
   ``audit=True`` and ``audit=False``, alternating, and the ratio of the medians.

The section "## The exactly-once audit" of benchmarks/RESULTS.md gets the figures. Not a test:
it measures and reports, and asserts nothing about speed.

Usage: ``python benchmarks/bench_audit.py [--samples 20000] [--repeat 7] [--no-write]``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import tempfile
import time

import common
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## The exactly-once audit"
PLAN_SAMPLES = 10_000_000


def _ns_per(fn, samples: int, repeat: int) -> float:
    """Median ns per sample of ``fn()`` (which handles ``samples`` samples)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t) / samples)
    return common.median(times)


def _write_files(root: str, n: int, size: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        d = os.path.join(root, f"c{i % 4}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:07d}.bin"), "wb") as fh:
            fh.write(rng.bytes(size))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    logging.getLogger("shardio").setLevel(logging.WARNING)
    from shardio.order.digest import Digest, dataset_salt
    from shardio.order.epochplan import plan_span
    from shardio.order.ranks import RankInfo
    from shardio.order.spec import OrderSpec
    from shardio.packing.run import PackOptions, pack
    from shardio.runtime.audit import FOLD_AT, EpochAudit, sample_facts
    from shardio.runtime.dataset import ShardDataset

    load_before = common.loadavg()
    salt = dataset_salt("bench")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        src, dst = os.path.join(root, "src"), os.path.join(root, "ds")
        _write_files(src, args.samples, 4096)
        pack(src, dst, PackOptions(shard_size_bytes=8 << 20, durable=False))
        ds = ShardDataset(dst, ranks=RankInfo(), seed=1)
        audit = EpochAudit(ds, batch_size=256, drop_last=False)
        order = ds.epoch_order()
        chunks = [order[i : i + FOLD_AT] for i in range(0, len(order), FOLD_AT)]
        fold = _ns_per(lambda: [Digest.of(c, salt) for c in chunks], len(order), args.repeat)
        for bs in (64, 256, 1024):
            batches = [order[i : i + bs] for i in range(0, len(order), bs)]

            def observe(batches=batches) -> None:
                ds.cursor.rewind()
                for b in batches:  # as ShardLoader hands each batch to training
                    ids, labels, shards = sample_facts(ds, b)
                    audit.observe(0, ids, labels, shards)
                    ds.cursor.advance(len(b))
                audit.end_epoch(0)  # each repeat one whole epoch, folded and judged

            path = _ns_per(observe, len(order), args.repeat)
            rows.append([str(bs), f"{path:.1f}"])
        spec = OrderSpec(order="random", seed=3)
        sizes = np.full(PLAN_SAMPLES // 1000, 1000)
        plan_ns = _ns_per(
            lambda: plan_span(sizes, spec, 0, RankInfo(world_size=8), consumed=0, history=[],
                              batch_size=256, drop_last=False, identify=lambda v: v, salt=salt),
            PLAN_SAMPLES, 3,
        )  # fmt: skip

        def epoch(on: bool) -> float:
            ds.cursor.rewind()
            loader = ds.loader(batch_size=256, audit=on)
            t = time.perf_counter()
            n = sum(len(b["__key__"]) for b in loader)
            assert n == args.samples
            return time.perf_counter() - t

        epoch(True)  # warm the page cache
        timed: dict[bool, list[float]] = {True: [], False: []}
        for rnd in range(args.repeat):
            for on in (True, False) if rnd % 2 == 0 else (False, True):
                timed[on].append(epoch(on))
    on_s, off_s = common.median(timed[True]), common.median(timed[False])
    body = "\n".join(
        [
            f"Run {datetime.date.today().isoformat()}: `python benchmarks/bench_audit.py "
            f"--samples {args.samples} --repeat {args.repeat}` (load average before: "
            f"{load_before}). Medians.",
            "",
            f"- The digest alone (`Digest.of` over chunks of {FOLD_AT:,}): {fold:.1f} ns a sample.",
            "- A whole epoch through the observer (`sample_facts` and `observe` per batch, then "
            "`end_epoch`: the plan and the verdict), per sample:",
            "",
            common.markdown_table(["batch size", "ns/sample"], rows),
            "",
            f"- The plan of an epoch (`plan_span`, 10,000,000 samples, random order, 8 ranks): "
            f"{plan_ns:.1f} ns a sample ({plan_ns * PLAN_SAMPLES / 1e9:.2f} s an epoch, "
            "on rank 0 only, at the epoch's end).",
            f"- One loader epoch of {args.samples:,} samples of 4 KiB (no workers, warm): "
            f"audit on {on_s * 1e3:.0f} ms, off {off_s * 1e3:.0f} ms, ratio "
            f"{common.fmt_ratio(on_s / off_s)}.",
        ]
    )
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
